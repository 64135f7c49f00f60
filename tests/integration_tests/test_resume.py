"""Stop a run right after its checkpoint of step N, resume it: steps N+1.. give bit for bit the
losses of the same run left uninterrupted (``--training.deterministic`` and a seed, on CPU); a
corrupt newer checkpoint is skipped for the older one.

The stop is a SIGKILL sent as soon as the run reports its step-N save (a ``checkpoint.saved``
event): no clean shutdown. The losses compared are the unrounded ones of
``<dump_folder>/metrics.jsonl`` (the printed step line has 4 decimals, too coarse for a bitwise
claim).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.integration_tests import warm_start
from tests.integration_tests.train_runs import (
    REPO,
    RUN_TRAIN,
    SMALL,
    TIMEOUT_S,
    run_train,
    step_losses,
    train_env,
)
from torchtitan.components import checksums
from torchtitan.components.checkpoint import (
    CHECKPOINT_REJECTED,
    CHECKPOINT_RESUMED,
    CHECKPOINT_SAVED,
    scan_steps,
)
from torchtitan.components.metrics import read_metrics
from torchtitan.tools.cluster import process_tree
from torchtitan.tools.events import EVENTS_FOLDER, read_events

N = 5  # checkpoint interval and the step the run is killed after
STEPS = 2 * N


def _args(dump: Path) -> list[str]:
    return [
        *SMALL,
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        "--training.seed=7",
        "--training.deterministic",
        "--checkpoint.enable",
        f"--checkpoint.interval={N}",
        "--checkpoint.keep_latest_k=0",
        "--validation.enable",
        f"--validation.freq={N}",
        "--validation.steps=2",
        "--validation.local_batch_size=4",
    ]


def _run_until_saved(args: list[str], dump: Path, step: int) -> None:
    """Start a run and SIGKILL it (its whole process group) once it reports the save of
    ``step`` in its events."""
    log = dump.parent / f"{dump.name}.log"

    def saved() -> bool:
        events = read_events(dump / EVENTS_FOLDER, CHECKPOINT_SAVED)
        return any(event.step == step for event in events)

    with open(log, "w") as out:
        proc = subprocess.Popen(
            [RUN_TRAIN, *args],
            cwd=REPO,
            env=train_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None and not saved() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            trainers = warm_start.children(process_tree(proc.pid))  # a warm one is elsewhere
            os.killpg(proc.pid, signal.SIGKILL)
            warm_start.kill(trainers)
        proc.wait(timeout=TIMEOUT_S)
    assert saved(), log.read_text()


def test_resume_after_kill_gives_bitwise_equal_losses(tmp_path: Path) -> None:
    full_dir, stopped_dir = tmp_path / "full", tmp_path / "stopped"
    full = run_train(_args(full_dir))
    assert full.returncode == 0, full.stdout
    reference = read_metrics(full_dir / "metrics.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1))

    _run_until_saved(_args(stopped_dir), stopped_dir, N)
    # The kill may land a little after the save: drop what the run wrote after step N (a
    # later save, complete or not), so that the resume point is N whatever the timing.
    checkpoints = stopped_dir / "checkpoint"
    complete, incomplete = scan_steps(checkpoints)
    assert N in complete
    for later in [s for s in complete + incomplete if s > N]:
        shutil.rmtree(checkpoints / f"step-{later}")

    resumed_at = time.time()
    resumed = run_train(_args(stopped_dir))
    assert resumed.returncode == 0, resumed.stdout
    resumes = read_events(stopped_dir / EVENTS_FOLDER, CHECKPOINT_RESUMED, since=resumed_at)
    assert [(e.step, e["folder"]) for e in resumes] == [(N, str(checkpoints / f"step-{N}"))]
    assert sorted(step_losses(stopped_dir, since=resumed_at)) == list(range(N + 1, STEPS + 1))

    # One record per step and kind, steps 1..N from the stopped run, N+1.. from the resumed one.
    lines = (stopped_dir / "metrics.jsonl").read_text().splitlines()
    train_lines = [line for line in lines if '"train/loss"' in line]
    assert len(train_lines) == STEPS, lines
    history = read_metrics(stopped_dir / "metrics.jsonl")
    assert sorted(history) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert history[step]["train/loss"] == reference[step]["train/loss"], step
        assert history[step]["train/grad_norm"] == reference[step]["train/grad_norm"], step
    for step in (N, STEPS):  # validation of the stopped run's last and the resumed run's step
        assert history[step]["validation/loss"] == reference[step]["validation/loss"], step


def test_a_corrupt_rank_file_of_a_2_rank_fsdp_checkpoint_falls_back_to_the_older_one(
    tmp_path: Path,
) -> None:
    """2 FSDP2 ranks, checkpoints at steps 5 and 10. 4 KB of zeros in the middle of rank 1's
    file of step 10, as a bad disk or a cut-short copy leaves: the resumed run does not load
    it, says which folder, file and rank failed, and resumes from step 5 instead; steps 6..10
    then give the losses of the first run, bit for bit, and step 10 is saved again, intact."""
    dump = tmp_path / "fsdp"
    env = train_env(NGPU="2")
    first = run_train(_args(dump), env=env)
    assert first.returncode == 0, first.stdout
    reference = read_metrics(dump / "metrics.jsonl")
    step10 = dump / "checkpoint" / f"step-{STEPS}"
    shard = step10 / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(4096)
    shard.write_bytes(bytes(data))

    resumed_at = time.time()
    resumed = run_train(_args(dump), env=env)
    assert resumed.returncode == 0, resumed.stdout
    rejected = read_events(dump / EVENTS_FOLDER, CHECKPOINT_REJECTED, since=resumed_at)
    assert {e.rank for e in rejected} == {0, 1}  # every rank knows, and says it once
    problem = rejected[0]["problem"]
    said = rf"checkpoint {step10}: __1_0.distcp \(written by rank 1\), bytes \[\d+, \d+\) fails"
    said += " its checksum"
    assert re.search(said, problem), problem
    resumes = read_events(dump / EVENTS_FOLDER, CHECKPOINT_RESUMED, since=resumed_at)
    assert {e.step for e in resumes} == {N}
    history = read_metrics(dump / "metrics.jsonl")
    for step in range(N + 1, STEPS + 1):
        assert history[step]["train/loss"] == reference[step]["train/loss"], step
    assert checksums.verify(step10) is None  # the corrupt one was replaced by the new save
