"""Real fault-tolerant jobs for integration tests: a torchft lighthouse and replica groups.

Everything runs as real processes on 127.0.0.1 with free ports (never torchft's defaults), each
replica group a ``run_train.sh`` (its own torchrun/TCP store), its output in a log file per
start. ``FTJob.close()`` kills every process it started, by process group, even after a failure;
use it through the ``ft_job`` fixture (``conftest.py``) or as a context manager.

What the groups did is read from their event files (``FTJob.events``, ``FTJob.wait_for_event``;
``torchtitan.tools.events``), not from their log text.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.components.ft.torchft_adapter import lighthouse_groups_waiting
from torchtitan.experiments.fault_tolerance.launcher import (
    JOB_ENV,
    kill_tree,
    process_tree,
    processes_with_env,
)
from torchtitan.tools.events import EVENTS_FOLDER, Event, EventKind, read_events

REPO = Path(__file__).resolve().parents[2]
LIGHTHOUSE = str(Path(sys.executable).parent / "torchft_lighthouse")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GroupRun:
    """One start of one replica group."""

    replica_id: int
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)
    #: ``time.time()`` just before the start: its events are those at or after it.
    started_at: float = field(default_factory=time.time)

    def text(self) -> str:
        """The log so far, without ANSI colour codes (step lines are coloured)."""
        raw = self.log.read_text(errors="replace") if self.log.exists() else ""
        return ANSI.sub("", raw)


class FTJob:
    def __init__(
        self,
        folder: Path,
        groups: int = 2,
        train_args: list[str] | None = None,
        ngpu: int = 1,
        heartbeat_timeout_ms: int = 2000,
        min_replicas: int = 1,
        dump_folder: Path | None = None,
    ) -> None:
        self.folder = folder
        self.dump_folder = dump_folder or folder / "dump"
        self.groups = groups
        self.train_args = list(train_args or [])
        self.ngpu = ngpu
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.min_replicas = min_replicas
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr = ""
        self.runs: dict[int, list[GroupRun]] = {}
        self._procs: list[subprocess.Popen] = []
        # In every group's environment: finds workers that outlived their torchrun.
        self.job_id = uuid.uuid4().hex

    # ---- processes -----------------------------------------------------------------------

    def start_lighthouse(self, port: int | None = None) -> str:
        """Start the lighthouse on ``port`` (default: a free one); return its address."""
        port = port or free_port()
        log = open(self.folder / "lighthouse.log", "a")
        self.lighthouse = subprocess.Popen(
            [
                LIGHTHOUSE,
                "--min_replicas",
                str(self.min_replicas),
                "--quorum_tick_ms",
                "100",
                "--join_timeout_ms",
                "10000",
                "--heartbeat_timeout_ms",
                str(self.heartbeat_timeout_ms),
                "--bind",
                f"127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(self.lighthouse)
        self.lighthouse_addr = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return self.lighthouse_addr
            time.sleep(0.1)
        raise RuntimeError("lighthouse did not start listening within 10 s")

    def start_group(self, replica_id: int, extra_args: list[str] | None = None) -> GroupRun:
        starts = self.runs.setdefault(replica_id, [])
        log_path = self.folder / f"group{replica_id}_start{len(starts)}.log"
        env = dict(os.environ)
        env.update(
            NGPU=str(self.ngpu),
            LOG_RANK=",".join(str(r) for r in range(self.ngpu)),
            TORCHFT_LIGHTHOUSE=self.lighthouse_addr,
            TORCHFT_MANAGER_PORT=str(free_port()),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            PYTHON=sys.executable,
        )
        env[JOB_ENV] = self.job_id
        cmd = [
            str(REPO / "run_train.sh"),
            f"--job.dump_folder={self.dump_folder}",
            "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={replica_id}",
            f"--fault_tolerance.group_size={self.groups}",
            *self.train_args,
            *(extra_args or []),
        ]
        started_at = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )
        self._procs.append(proc)
        run = GroupRun(replica_id, proc, log_path, started_at=started_at)
        starts.append(run)
        return run

    def start(self) -> FTJob:
        self.start_lighthouse()
        for r in range(self.groups):
            self.start_group(r)
        return self

    def kill_lighthouse(self) -> int:
        """SIGKILL the lighthouse; return its port (to start a new one on the same address)."""
        assert self.lighthouse is not None
        self.lighthouse.kill()
        self.lighthouse.wait(timeout=30)
        return int(self.lighthouse_addr.rsplit(":", 1)[1])

    def kill(self, replica_id: int) -> None:
        """SIGKILL the latest start of a group, with all its processes (torchrun's workers
        live in sessions of their own: the whole tree is killed, PID by PID)."""
        run = self.runs[replica_id][-1]
        if run.proc.poll() is None:
            kill_tree(run.proc.pid)
        run.proc.wait(timeout=30)

    def pids(self) -> list[int]:
        """Every live process of the job: lighthouse, groups, torchrun workers."""
        found = set(processes_with_env(JOB_ENV, self.job_id))
        for proc in self._procs:
            if proc.poll() is None:
                found.update(process_tree(proc.pid))
        return sorted(found)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    kill_tree(proc.pid)
                except ProcessLookupError:
                    pass
        for pid in processes_with_env(JOB_ENV, self.job_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> FTJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- observing -----------------------------------------------------------------------

    def latest(self, replica_id: int) -> GroupRun:
        return self.runs[replica_id][-1]

    def wait_for(
        self, replica_id: int, pattern: re.Pattern[str] | str, timeout: float, count: int = 1
    ) -> list[re.Match[str]]:
        """Wait until the latest start of the group has logged ``count`` matches of
        ``pattern``; fail with the log tail if it exits or the time runs out."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        run = self.latest(replica_id)
        deadline = time.monotonic() + timeout
        while True:
            matches = list(regex.finditer(run.text()))
            if len(matches) >= count:
                return matches
            if run.proc.poll() is not None:
                matches = list(regex.finditer(run.text()))
                if len(matches) >= count:
                    return matches
                raise AssertionError(
                    f"group {replica_id} exited ({run.proc.returncode}) before {count}x "
                    f"{regex.pattern!r}:\n{tail(run.text())}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"group {replica_id}: no {count}x {regex.pattern!r} within {timeout:.0f}s:\n"
                    f"{tail(run.text())}"
                )
            time.sleep(0.2)

    def wait_exit(self, replica_id: int, timeout: float) -> int:
        run = self.latest(replica_id)
        try:
            return run.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"group {replica_id} still running after {timeout:.0f}s:\n{tail(run.text())}"
            ) from None

    def wait_quorum_request(self, replica_id: int, timeout: float = 240) -> None:
        """Until a replica group waits for a quorum at the lighthouse (read from its status
        page); fails if the latest start of ``replica_id`` exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if lighthouse_groups_waiting(self.lighthouse_addr) > 0:
                return
            run = self.latest(replica_id)
            assert run.proc.poll() is None, tail(run.text())
            time.sleep(0.2)
        raise AssertionError(f"nobody asked for a quorum:\n{tail(self.latest(replica_id).text())}")

    def all_text(self, replica_id: int) -> str:
        return "".join(run.text() for run in self.runs.get(replica_id, []))

    # ---- events --------------------------------------------------------------------------

    def events(
        self,
        replica_id: int,
        kind: EventKind | str | None = None,
        *,
        rank: int | None = None,
        all_starts: bool = False,
        start: GroupRun | None = None,
    ) -> list[Event]:
        """The group's events (of ``kind``, of ``rank``; default every rank), oldest first:
        those of its latest start, of ``start``, or of all its starts in this job."""
        runs = self.runs[replica_id]
        first = runs[0] if all_starts else start or runs[-1]
        found = read_events(
            self.dump_folder / EVENTS_FOLDER,
            kind,
            replica=replica_id,
            rank=rank,
            since=first.started_at,
        )
        if start is not None and start is not runs[-1]:
            end = runs[runs.index(start) + 1].started_at
            found = [event for event in found if event.time < end]
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
            if run.proc.poll() is not None:
                events = found()
                if len(events) >= count:
                    return events
                raise AssertionError(
                    f"group {replica_id} exited ({run.proc.returncode}) before {count}x "
                    f"event {name}:\n{tail(run.text())}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"group {replica_id}: no {count}x event {name} within {timeout:.0f}s:\n"
                    f"{tail(run.text())}"
                )
            time.sleep(0.2)


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


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket that one of ``pids`` holds,
    read from ``/proc/<pid>/fd`` (socket inodes) and ``/proc/net/tcp{,6}``."""
    listening: dict[int, tuple[str, int]] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            listening[int(fields[9])] = (_proc_net_address(hex_addr, width), int(hex_port, 16))
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listening:
                    found.append((pid, *listening[inode]))
    return found


def _proc_net_address(hex_addr: str, width: int) -> str:
    """The address of a ``/proc/net/tcp{,6}`` entry (little-endian 32-bit words)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if width == 8 else socket.AF_INET6
    return socket.inet_ntop(family, words)


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
