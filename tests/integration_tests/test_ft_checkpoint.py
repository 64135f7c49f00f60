"""Persistent checkpoints with fault tolerance: each group writes its own folder
(``checkpoint/replica_R/step-N``), and a whole-job restart (everything SIGKILLed, then the
lighthouse and all groups started again on the same dump folder) resumes from them and finishes
with the groups bit-identical."""

from __future__ import annotations

import re

from tests.integration_tests.harness import (
    FAST_ARGS,
    PACED_ARGS,
    PARAM_DIGEST,
    STEP_LINE,
    FTJob,
    digests,
)

SAVED = re.compile(r"Saved checkpoint step (\d+) to (\S+)")
RESUMED = re.compile(r"Resumed from checkpoint (\S+) \(step (\d+)\)")


def test_whole_job_restart_resumes_from_per_group_checkpoints(ft_job, tmp_path):
    dump = tmp_path / "dump"
    args = [
        *FAST_ARGS,
        *PACED_ARGS,
        "--training.steps=20",
        "--checkpoint.enable",
        "--checkpoint.interval=5",
    ]
    first: FTJob = ft_job(folder=tmp_path / "run1", dump_folder=dump, train_args=args)
    first.start()
    for replica in (0, 1):
        first.wait_for(replica, r"Saved checkpoint step 10 ", timeout=240)
    first.close()  # SIGKILL the lighthouse and both groups, wherever they are
    saved = {r: [int(m.group(1)) for m in SAVED.finditer(first.all_text(r))] for r in (0, 1)}
    for replica in (0, 1):
        assert (dump / "checkpoint" / f"replica_{replica}" / "step-10" / ".metadata").is_file()

    second: FTJob = ft_job(folder=tmp_path / "run2", dump_folder=dump, train_args=args)
    second.start()
    assert second.wait_exit(0, 240) == 0
    assert second.wait_exit(1, 60) == 0
    resumed = {}
    for replica in (0, 1):
        text = second.all_text(replica)
        match = RESUMED.search(text)
        assert match, f"group {replica} did not resume:\n{text[-2000:]}"
        assert f"replica_{replica}" in match.group(1)
        resumed[replica] = int(match.group(2))
        assert resumed[replica] >= 10
        first_step = int(STEP_LINE.search(text).group(1))
        assert first_step > resumed[replica] or "healed" in text
    d0 = digests(second.all_text(0), PARAM_DIGEST)
    d1 = digests(second.all_text(1), PARAM_DIGEST)
    assert d0[20] == d1[20]
    print(
        f"\n[ft test] checkpoints saved before the kill: {saved}; whole-job restart resumed "
        f"group 0 from step {resumed[0]}, group 1 from step {resumed[1]}; both finished step "
        f"20 identical ({d0[20]})"
    )
