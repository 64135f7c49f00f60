"""The local launcher (``./run_launcher.sh``), run as a user runs it: it prefixes every line with
its source, exits 0 when all groups finish and 1 when a group fails for good, kills and restarts a
group on ``--kill R@S``, listens on 127.0.0.1 only, and leaves no process behind. What the groups
did is read from their event files (under the ``--job.dump_folder`` every group is given), what the
launcher did from its own output."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration_tests.harness import (
    FAST_ARGS,
    PACED_ARGS,
    REPO,
    check_loopback_only,
    per_step,
    tail,
)
from torchtitan.components.ft.build import MANAGER_STARTED
from torchtitan.components.ft.manager import HEALED
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.tools.cluster import JOB_ENV, LocalJob, processes_with_env
from torchtitan.tools.cluster.lighthouse import groups_waiting_at
from torchtitan.tools.events import EVENTS_FOLDER, Event, EventKind, read_events
from torchtitan.trainer import PARAM_DIGEST


class LauncherRun:
    """The launcher, started as a process of a ``LocalJob``: the launcher passes the job's
    marker on to everything it starts, so what it leaves behind is found by that marker. The
    groups' events are read from ``<job folder>/dump`` (give the groups that dump folder)."""

    def __init__(self, job: LocalJob, args: list[str]) -> None:
        self.job = job
        self.events_folder = job.folder / "dump" / EVENTS_FOLDER
        cmd = [
            sys.executable,
            "-m",
            "torchtitan.experiments.fault_tolerance.launch.launcher",
            *args,
        ]
        self.process = job.start_process(
            "launcher", cmd, {"OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
        )

    def text(self) -> str:
        return self.process.text()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except TimeoutError:
            message = f"launcher still running after {timeout}s:\n{tail(self.text())}"
            raise AssertionError(message) from None

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text(), re.M):
            if not self.process.alive() or time.monotonic() > deadline:
                message = f"no {pattern!r} in the launcher's output:\n{tail(self.text())}"
                raise AssertionError(message)
            time.sleep(0.2)

    def events(self, replica_id: int, kind: EventKind) -> list[Event]:
        """The group's events of ``kind``, over all its starts."""
        return read_events(self.events_folder, kind, replica=replica_id)

    def wait_for_event(
        self,
        replica_id: int,
        kind: EventKind,
        timeout: float,
        where: Callable[[Event], bool] = lambda _: True,
        count: int = 1,
    ) -> list[Event]:
        """Until the group (all its starts) has emitted ``count`` events of ``kind`` for which
        ``where`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(replica_id, kind) if where(e)]
            if len(found) >= count:
                return found
            if not self.process.alive() or time.monotonic() > deadline:
                message = f"no {kind.name} event of group {replica_id}:\n{tail(self.text())}"
                raise AssertionError(message)
            time.sleep(0.2)

    def wait_quorum_request(self, timeout: float) -> None:
        """Until a group waits for a quorum at the launcher's lighthouse."""
        self.wait_for(r"^\[launcher\] lighthouse at http://", timeout)
        found = re.search(r"^\[launcher\] lighthouse at (http://\S+)", self.text(), re.M)
        assert found is not None
        deadline = time.monotonic() + timeout
        while groups_waiting_at(found.group(1)) == 0:
            if not self.process.alive() or time.monotonic() > deadline:
                raise AssertionError(f"nobody asked for a quorum:\n{tail(self.text())}")
            time.sleep(0.2)

    def leftovers(self) -> list[int]:
        marked = processes_with_env(JOB_ENV, self.job.job_id)
        return [pid for pid in marked if pid != self.process.pid]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    with LocalJob(tmp_path) as job:  # kills the launchers and whatever they left behind

        def start(*args: str) -> LauncherRun:
            return LauncherRun(job, list(args))

        yield start


def test_launcher_prefixes_lines_and_exits_0(launch, tmp_path):
    run = launch("--groups", "2", "--", *FAST_ARGS, "--training.steps=5",
                 f"--job.dump_folder={tmp_path / 'dump'}")  # fmt: skip
    assert run.wait(240) == 0, tail(run.text())
    lines = run.text().splitlines()
    assert lines and all(re.match(r"\[(launcher|group [01])\] ", line) for line in lines)
    assert any(line.startswith("[group 0] ") and "step:" in line for line in lines)
    assert any(line.startswith("[group 1] ") and "step:" in line for line in lines)
    assert lines[-1] == "[launcher] all 2 groups finished (0 restart(s))"
    assert run.leftovers() == []


def test_launcher_exits_1_when_a_group_fails(launch, tmp_path):
    # Rejected by every group's config validation: the groups exit non-zero on their own.
    run = launch("--groups", "2", "--", *FAST_ARGS, "--fault_tolerance.min_replica_size=3",
                 f"--job.dump_folder={tmp_path / 'dump'}")  # fmt: skip
    assert run.wait(120) == 1, tail(run.text())
    text = run.text()
    assert re.search(r"^\[launcher\] group \d exited with code 2$", text, re.M)
    assert "[launcher] FAILED: group(s)" in text
    assert "min_replica_size" in text
    assert run.leftovers() == []


def test_launcher_kill_and_restart(launch, tmp_path):
    # The documented fault-injection run (docs/fault_tolerance.md), with a smaller model. While
    # group 1 restarts, the groups are held between two steps (a pause file every group
    # watches): group 0 cannot run out of steps before group 1 is back, however slow this
    # machine is; it is let go once the new group 1 has started its Manager (it asks for its
    # first quorum right then).
    pause = tmp_path / "pause"
    run = launch("--groups", "2", "--kill", "1@10", "--restart-after", "5", "--",
                 "--training.steps=40", *FAST_ARGS, *PACED_ARGS,
                 f"--fault_injection.pause_file={pause}",
                 f"--job.dump_folder={tmp_path / 'dump'}")  # fmt: skip
    run.wait_for_event(1, TRAIN_STEP, timeout=240, where=lambda e: e.step == 3)
    sockets = check_loopback_only(run.leftovers())
    assert sockets
    run.wait_for(r"^\[launcher\] SIGKILL group 1 at step", timeout=240)
    pause.touch()
    run.wait_for(r"^\[launcher\] group 1 restarted", timeout=60)
    # Both starts of group 1 have built their Manager: the restarted one asks for a quorum now.
    run.wait_for_event(1, MANAGER_STARTED, timeout=180, count=2)
    run.wait_quorum_request(timeout=180)  # group 0 is paused: the request is group 1's
    pause.unlink()
    assert run.wait(300) == 0, tail(run.text())
    text = run.text()
    killed = re.search(r"^\[launcher\] SIGKILL group 1 at step (\d+) \(--kill\); restart in 5s$",
                       text, re.M)  # fmt: skip
    assert killed and int(killed.group(1)) >= 10
    assert re.search(r"^\[launcher\] group 1 restarted \(#1\)", text, re.M)
    heals = [e.step for e in run.events(1, HEALED)]
    assert heals and heals[-1] > int(killed.group(1)), tail(text)  # the restart's heal
    assert text.splitlines()[-1] == "[launcher] all 2 groups finished (1 restart(s))"
    digests = {r: per_step(run.events(r, PARAM_DIGEST), "digest") for r in (0, 1)}
    assert digests[0][40] == digests[1][40]
    assert run.leftovers() == []
    print(
        f"\n[ft test] launcher: group 1 killed at step {killed.group(1)}, restarted after 5 s, "
        f"healed at step {heals[-1]}; {len(sockets)} listening sockets, all on loopback; "
        "both groups finished step 40 identical"
    )


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_the_semi_sync_command_line_runs_as_typed(tmp_path: Path, ranks: str) -> None:
    """``./run_train.sh --job.custom_args_module=... --fault_tolerance.semi_sync_method=X``
    without fault tolerance trains: one replica group against a lighthouse started for it (the
    launcher, run in place of the command), which says how to add groups; nothing is left
    running. With NGPU=2 the choice is made once, before torchrun, not once per rank."""
    as_typed = [
        "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config",
        "--fault_tolerance.semi_sync_method=localsgd",
    ]
    args = [*as_typed, *FAST_ARGS, "--training.steps=6", "--fault_tolerance.sync_steps=3",
            f"--job.dump_folder={tmp_path / 'dump'}"]  # fmt: skip
    with LocalJob(tmp_path / "job") as job:
        run = job.start_process(
            "run_train", [str(REPO / "run_train.sh"), *args],
            {"OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "NGPU": ranks},
        )  # fmt: skip
        assert run.wait(240) == 0, tail(run.text())
        text = run.text()
        leftovers = [p for p in processes_with_env(JOB_ENV, job.job_id) if p != run.pid]
    assert "starting a lighthouse on 127.0.0.1 and this command as replica group 0 of 1" in text
    assert "./run_launcher.sh --groups 2 -- ARGS" in text
    assert "[INFO] [torchft::" not in text  # torchft's own INFO lines are off (RUST_LOG=warn)
    assert text.count("[launcher] lighthouse at http://127.0.0.1:") == 1
    assert re.search(r"^\[group 0\] .*step 6 sync: localsgd .* committed", text, re.M), text
    assert text.rstrip().endswith("[launcher] all 1 groups finished (0 restart(s))")
    assert leftovers == []
