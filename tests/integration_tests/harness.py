"""Real fault-tolerant jobs for integration tests: a torchft lighthouse and replica groups.

Everything runs as real processes on 127.0.0.1 with free ports (never torchft's defaults), each
replica group a ``run_train.sh`` (its own torchrun/TCP store), its output in a log file per
start. ``FTJob.close()`` kills every process it started, by process group, even after a failure;
use it through the ``ft_job`` fixture (``conftest.py``) or as a context manager.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIGHTHOUSE = str(Path(sys.executable).parent / "torchft_lighthouse")
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
PARAM_DIGEST = re.compile(r"param_digest step (\d+): ([0-9a-f]+)")
GLOBAL_DIGEST = re.compile(r"global_digest sync (\d+): ([0-9a-f]+)")
SYNC_LINE = re.compile(r"\[semi-sync\] step (\d+) sync: .*?(committed|NOT committed)")

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

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class FTJob:
    def __init__(
        self,
        folder: Path,
        groups: int = 2,
        train_args: list[str] | None = None,
        ngpu: int = 1,
        heartbeat_timeout_ms: int = 2000,
        min_replicas: int = 1,
    ) -> None:
        self.folder = folder
        self.groups = groups
        self.train_args = list(train_args or [])
        self.ngpu = ngpu
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.min_replicas = min_replicas
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr = ""
        self.runs: dict[int, list[GroupRun]] = {}
        self._procs: list[subprocess.Popen] = []

    # ---- processes -----------------------------------------------------------------------

    def start_lighthouse(self) -> str:
        port = free_port()
        log = open(self.folder / "lighthouse.log", "w")
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
        cmd = [
            str(REPO / "run_train.sh"),
            f"--job.dump_folder={self.folder / 'dump'}",
            "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={replica_id}",
            f"--fault_tolerance.group_size={self.groups}",
            *self.train_args,
            *(extra_args or []),
        ]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )
        self._procs.append(proc)
        run = GroupRun(replica_id, proc, log_path)
        starts.append(run)
        return run

    def start(self) -> FTJob:
        self.start_lighthouse()
        for r in range(self.groups):
            self.start_group(r)
        return self

    def kill(self, replica_id: int) -> None:
        """SIGKILL the latest start of a group, with all its processes."""
        run = self.runs[replica_id][-1]
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
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

    def all_text(self, replica_id: int) -> str:
        return "".join(run.text() for run in self.runs.get(replica_id, []))


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def digests(text: str, pattern: re.Pattern[str]) -> dict[int, str]:
    """{step or sync number: digest} from a log (the last one logged wins)."""
    return {int(m.group(1)): m.group(2) for m in pattern.finditer(text)}


def losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(text)}
