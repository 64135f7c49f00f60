"""Persistent checkpoints with fault tolerance: each group writes its own folder
(``checkpoint/replica_R/step-N``), and a whole-job restart (everything SIGKILLed, then the
lighthouse and all groups started again on the same dump folder) resumes from them and finishes
with the groups bit-identical."""

from __future__ import annotations

from tests.integration_tests.harness import FAST_ARGS, PACED_ARGS, FTJob, per_step
from torchtitan.components.checkpoint import CHECKPOINT_RESUMED, CHECKPOINT_SAVED
from torchtitan.components.ft.manager import HEALED
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.trainer import PARAM_DIGEST


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
        first.wait_for_event(replica, CHECKPOINT_SAVED, timeout=240, where=lambda e: e.step == 10)
    first.close()  # SIGKILL the lighthouse and both groups, wherever they are
    saved = {
        r: [e.step for e in first.events(r, CHECKPOINT_SAVED, all_starts=True)] for r in (0, 1)
    }
    for replica in (0, 1):
        assert (dump / "checkpoint" / f"replica_{replica}" / "step-10" / ".metadata").is_file()

    second: FTJob = ft_job(folder=tmp_path / "run2", dump_folder=dump, train_args=args)
    second.start()
    assert second.wait_exit(0, 240) == 0
    assert second.wait_exit(1, 60) == 0
    resumed = {}
    for replica in (0, 1):
        resumes = second.events(replica, CHECKPOINT_RESUMED, all_starts=True)
        assert resumes, f"group {replica} did not resume:\n{second.all_text(replica)[-2000:]}"
        assert f"replica_{replica}" in resumes[0]["folder"]
        resumed[replica] = resumes[0].step
        assert resumed[replica] >= 10
        first_step = second.events(replica, TRAIN_STEP, all_starts=True)[0].step
        healed = second.events(replica, HEALED, all_starts=True)
        assert first_step > resumed[replica] or healed
    d0 = per_step(second.events(0, PARAM_DIGEST, all_starts=True), "digest")
    d1 = per_step(second.events(1, PARAM_DIGEST, all_starts=True), "digest")
    assert d0[20] == d1[20]
    print(
        f"\n[ft test] checkpoints saved before the kill: {saved}; whole-job restart resumed "
        f"group 0 from step {resumed[0]}, group 1 from step {resumed[1]}; both finished step "
        f"20 identical ({d0[20]})"
    )
