"""Real fault-tolerant jobs for integration tests: a torchft lighthouse and replica groups.

``FTJob`` is a ``torchtitan.tools.cluster.LocalJob`` (real processes on 127.0.0.1, free ports,
a log file per start, every process killed by ``close()`` even after a failure) with the
tests' defaults (one thread per rank, every rank's output, a shared dump folder) and what
tests wait for. Use it through the ``ft_job`` fixture (``conftest.py``) or as a context
manager.

What the groups did is read from their event files (``FTJob.events``, ``FTJob.wait_for_event``;
``torchtitan.tools.events``), not from their log text.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tests.integration_tests import warm_start
from torchtitan.tools.cluster import (
    LighthouseSettings,
    LocalJob,
    Process,
    listening_sockets,
    process_tree,
)
from torchtitan.tools.cluster.lighthouse import groups_alive_at
from torchtitan.tools.cluster.process import ProcessSpec
from torchtitan.tools.events import EVENTS_FOLDER, Event, EventKind, read_events

REPO = Path(__file__).resolve().parents[2]

# A small, fast job: the debug model's smallest flavor on the embedded corpus.
FAST_ARGS = [
    "--model.flavor=debugmodel_small",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
    "--lr_scheduler.warmup_steps=2",
    "--validation.enable=false",
    "--metrics.log_freq=1",
    "--metrics.log_param_digest",
    "--metrics.cpu_peak_flops=-1",
    "--fault_tolerance.process_group_timeout_ms=5000",
    "--fault_tolerance.quorum_timeout_s=60",
    "--fault_tolerance.timeout_s=30",
]
SEMI_SYNC_MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
# The experiment's config plus test-only fault knobs (tests/integration_tests/faults.py).
FAULTS_MODULE = "--job.custom_args_module=tests.integration_tests.faults"
# Steps of ~0.2 s: slow enough to kill a group at a chosen step from outside, fast enough for a
# test. A sleep after each (tiny) step, so that the cores stay free for the test's other
# processes (a restarting group starts faster than beside two groups computing flat out).
PACED_ARGS = [FAULTS_MODULE, "--fault_injection.step_sleep_s=0.2"]


class FTJob(LocalJob):
    """A local job with the tests' defaults; every group writes to ``dump_folder`` (default
    ``<folder>/dump``). Its trainers start warm (``warm_start.py``) unless ``warm`` is False."""

    def __init__(
        self,
        folder: Path,
        groups: int = 2,
        train_args: list[str] | None = None,
        ngpu: int = 1,
        heartbeat_timeout_ms: int = 2000,
        min_replicas: int = 1,
        dump_folder: Path | None = None,
        warm: bool = True,
        group_env: dict[int, dict[str, str]] | None = None,
        groups_per_site: int = 1,
    ) -> None:
        """``group_env``: variables for every start of a group (by replica id), e.g. another
        CPU's kernels (``tests/kernel_sets.py``); ``groups_per_site`` > 1: sites of groups, each
        with its own lighthouse (``start`` starts them)."""
        self.dump_folder = dump_folder or folder / "dump"
        super().__init__(
            folder,
            groups=groups,
            train_args=[f"--job.dump_folder={self.dump_folder}", *(train_args or [])],
            ngpu=ngpu,
            threads=1,
            log_all_ranks=True,
            lighthouse=LighthouseSettings(
                min_replicas=min_replicas, heartbeat_timeout_ms=heartbeat_timeout_ms
            ),
            launch_group=_warm_group if warm else _cold_group,
            group_env=group_env,
            groups_per_site=groups_per_site,
        )

    def run_to_end(self, timeout: float = 240) -> FTJob:
        """Start the lighthouse and every group, assert that each exits 0, then stop the job
        (its dump folder stays, e.g. to restart from its checkpoints)."""
        self.start()
        for r in range(self.groups):
            assert self.wait_exit(r, timeout) == 0, tail(self.latest(r).text())
        self.close()
        return self

    def wait_exit(self, replica_id: int, timeout: float) -> int:
        group = self.latest(replica_id)
        try:
            return group.wait(timeout)
        except TimeoutError:
            raise AssertionError(
                f"group {replica_id} still running after {timeout:.0f}s:\n{tail(group.text())}"
            ) from None

    def wait_quorum_request(self, replica_id: int, timeout: float = 240) -> None:
        """Until a replica group waits for a quorum at the lighthouse; fails if the latest
        start of ``replica_id`` exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.groups_waiting() > 0:
                return
            group = self.latest(replica_id)
            assert group.alive(), tail(group.text())
            time.sleep(0.2)
        raise AssertionError(f"nobody asked for a quorum:\n{tail(self.latest(replica_id).text())}")

    def pids(self) -> list[int]:
        """Every live process of the job, warm trainers included."""
        return warm_start.children(super().pids())

    def close(self, grace_s: float = 0.0) -> None:
        """As ``LocalJob.close``; when it returns, the warm trainers are gone too (their
        zygote kills them just after their stand-ins, not with them)."""
        trainers = self.pids()
        super().close(grace_s)
        warm_start.kill(trainers)

    def _kill(self, process: Process) -> None:
        """SIGKILL a process's tree, its warm trainers with it; returns once all are gone."""
        trainers = warm_start.children(process_tree(process.pid)) if process.alive() else []
        super()._kill(process)
        warm_start.kill(trainers)

    def group_pids(self, replica_id: int) -> list[int]:
        """The live processes of the group's latest start (its warm trainer included)."""
        return warm_start.children(process_tree(self.latest(replica_id).pid))

    def wait_until_dead_to_lighthouse(self, alive: int, timeout: float = 60) -> None:
        """Until the lighthouse counts ``alive`` groups alive, e.g. after a kill: it counts a
        killed group until its heartbeats are older than the heartbeat timeout. A group
        restarted sooner meets its dead self in the next quorum (3 members of 2 groups; that
        sync then fails), which a cold start, slower than the timeout, never did."""
        deadline = time.monotonic() + timeout
        while groups_alive_at(self.lighthouse_address) != alive:
            assert time.monotonic() < deadline, f"the lighthouse never counted {alive} alive"
            time.sleep(0.1)

    def _others(self, replica_id: int) -> str:
        """The other groups' latest output, for a failure message: a group that waits for a
        quorum in vain usually waits for one of them that died."""
        parts = [
            f"\n--- group {r} ({'running' if self.latest(r).alive() else 'exited'}):\n"
            f"{tail(self.latest(r).text())}"
            for r in sorted(self.starts)
            if r != replica_id
        ]
        return "".join(parts)

    def all_text(self, replica_id: int) -> str:
        return "".join(group.text() for group in self.starts.get(replica_id, []))

    # ---- events --------------------------------------------------------------------------

    def events(
        self,
        replica_id: int,
        kind: EventKind | str | None = None,
        *,
        rank: int | None = None,
        all_starts: bool = False,
        start: Process | None = None,
    ) -> list[Event]:
        """The group's events (of ``kind``, of ``rank``; default every rank), oldest first:
        those of its latest start, of ``start``, or of all its starts in this job."""
        runs = self.starts[replica_id]
        since, until = self.time_window(start or runs[-1])
        if all_starts:
            since = runs[0].started_at
        found = read_events(
            self.dump_folder / EVENTS_FOLDER, kind, replica=replica_id, rank=rank, since=since
        )
        found = [event for event in found if event.time < until]
        return found

    def wait_for_event(
        self,
        replica_id: int,
        kind: EventKind | str,
        timeout: float,
        count: int = 1,
        where: Callable[[Event], bool] | None = None,
        rank: int | None = None,
    ) -> list[Event]:
        """Wait until the latest start of the group has emitted ``count`` events of ``kind``
        (for which ``where`` holds); return them all. Fails with the log tail if the group exits
        first or the time runs out."""
        run = self.latest(replica_id)
        name = kind.name if isinstance(kind, EventKind) else kind

        def found() -> list[Event]:
            events = self.events(replica_id, kind, rank=rank)
            return [e for e in events if where is None or where(e)]

        deadline = time.monotonic() + timeout
        while True:
            events = found()
            if len(events) >= count:
                return events
            if run.poll() is not None:
                events = found()
                if len(events) >= count:
                    return events
                raise AssertionError(
                    f"group {replica_id} exited ({run.returncode}) before {count}x "
                    f"event {name}:\n{tail(run.text())}{self._others(replica_id)}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"group {replica_id}: no {count}x event {name} within {timeout:.0f}s:\n"
                    f"{tail(run.text())}{self._others(replica_id)}"
                )
            time.sleep(0.2)


def _warm_group(replica_id: int, spec: ProcessSpec) -> ProcessSpec:
    return ProcessSpec(spec.argv, warm_start.launch(spec.env))


def _cold_group(replica_id: int, spec: ProcessSpec) -> ProcessSpec:
    return spec


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def per_step(events: Iterable[Event], field_name: str) -> dict[int, Any]:
    """{step: the field} of events (a step given twice: the last one wins)."""
    return {event.step: event[field_name] for event in events if event.step is not None}


def per_rank(events: Iterable[Event]) -> dict[int, list[Event]]:
    """Events by rank, each rank's oldest first."""
    found: dict[int, list[Event]] = {}
    for event in events:
        found.setdefault(event.rank, []).append(event)
    return found


# Never used to listen or connect: the exposure tests assert that no socket of a job is on
# torchft's defaults (another run on the machine could otherwise join our quorum).
TORCHFT_DEFAULT_PORTS = {29510, 29512}


def check_loopback_only(pids: list[int]) -> list[tuple[int, str, int]]:
    """The listening sockets of ``pids``; fails if one is beyond loopback or on a torchft
    default port."""
    sockets = listening_sockets(pids)
    exposed = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
    on_defaults = [s for s in sockets if s[2] in TORCHFT_DEFAULT_PORTS]
    assert not on_defaults, f"listening on torchft's default ports: {on_defaults}"
    return sockets


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"
