"""Shared by the fault-tolerance benchmarks: start a lighthouse and trainer processes on
127.0.0.1, pin them to cores, collect their logs and peak memory, parse step lines, write JSON.

Every process is started in its own session and killed (by its process group) when the
``Job`` closes, also after an error. Ports are picked free on 127.0.0.1, never torchft's
defaults.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks run from a clone without installing it
RESULTS = REPO / "benchmarks" / "results"
TRAIN_ENTRY = REPO / "benchmarks" / "train_entry.py"
SEMI_SYNC_MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_LINE = re.compile(
    r"step:\s+(\d+)\s+loss:\s+([0-9.naif]+)\s+grad_norm:\s+\S+\s+memory:\s+([0-9.]+) GiB\s+"
    r"tps:\s+([0-9,]+)"
)
VALIDATION_LINE = re.compile(r"validation: step (\d+)\s+loss: ([0-9.naif]+)")
SYNC_LINE = re.compile(
    r"\[semi-sync\] step (\d+) sync: .*?(NOT committed|committed)\s+time (\d+) ms"
)

# The FT settings every benchmark uses: generous timeouts (a busy 2-core machine), quiet logs.
FT_ARGS = [
    "--fault_tolerance.process_group_timeout_ms=60000",
    "--fault_tolerance.quorum_timeout_s=120",
    "--fault_tolerance.timeout_s=120",
]

# The methods compared, as trainer flags (two groups each, except "no_ft").
METHODS: dict[str, list[str]] = {
    "no_ft": [],
    "sync_ft": [],
    "localsgd": [SEMI_SYNC_MODULE, "--fault_tolerance.semi_sync_method=localsgd"],
    "diloco": [SEMI_SYNC_MODULE, "--fault_tolerance.semi_sync_method=diloco"],
    "streaming_diloco": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.num_fragments=2",
        "--fault_tolerance.fragment_sync_delay=1",
    ],
}


def command_line(script: str, argv: list[str] | None) -> str:
    """How a benchmark was run, for its JSON: the script and its arguments."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"benchmarks/{Path(script).name}", *map(shlex.quote, args)])


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (and SIGINT, which a background shell leaves ignored) raise
    KeyboardInterrupt, so that every ``Job`` kills its processes before the script exits."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


@dataclass
class Proc:
    """One started process: its log file, and after ``wait`` its exit code and peak RSS."""

    name: str
    popen: subprocess.Popen
    log: Path
    returncode: int | None = None
    max_rss_mib: float | None = None

    def wait(self, timeout: float) -> int:
        """Wait for the exit; records the peak resident set of the process and its waited
        children (``wait4``), which ``Popen.wait`` would throw away."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(self.popen.pid, os.WNOHANG)
            if pid == self.popen.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.popen.returncode = self.returncode
                self.max_rss_mib = usage.ru_maxrss / 1024  # KiB on Linux
                return self.returncode
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} still running after {timeout:.0f}s:\n{self.tail()}"
                )
            time.sleep(0.2)

    def text(self) -> str:
        return strip_ansi(self.log.read_text(errors="replace")) if self.log.exists() else ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


@dataclass
class Job:
    """A lighthouse (optional) and trainer processes; ``close`` kills all that still run."""

    folder: Path
    procs: list[Proc] = field(default_factory=list)
    lighthouse_addr: str = ""
    ft_args: list[str] = field(default_factory=lambda: list(FT_ARGS))

    def __enter__(self) -> Job:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_lighthouse(self, min_replicas: int) -> str:
        port = free_port()
        cmd = [
            str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--quorum_tick_ms", "100",
            "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "5000",
            "--bind", f"127.0.0.1:{port}",
        ]  # fmt: skip
        self._start("lighthouse", cmd, dict(os.environ))
        self.lighthouse_addr = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return self.lighthouse_addr
            time.sleep(0.1)
        raise RuntimeError("torchft_lighthouse did not listen within 15 s")

    def start_trainer(
        self,
        name: str,
        args: list[str],
        *,
        replica_id: int | None = None,
        groups: int = 1,
        cpus: str | None = None,
        threads: int = 1,
    ) -> Proc:
        """One trainer process (``benchmarks/train_entry.py``); with ``replica_id`` a replica
        group of the job's lighthouse. ``cpus``: a ``taskset -c`` list to pin it to."""
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
        cmd = [sys.executable, str(TRAIN_ENTRY), f"--job.dump_folder={self.folder / name}"]
        cmd += ["--metrics.disable_color_printing"]
        if replica_id is not None:
            env.update(
                TORCHFT_LIGHTHOUSE=self.lighthouse_addr, TORCHFT_MANAGER_PORT=str(free_port())
            )
            cmd += [
                "--fault_tolerance.enable",
                f"--fault_tolerance.replica_id={replica_id}",
                f"--fault_tolerance.group_size={groups}",
                *self.ft_args,
            ]
        cmd += args
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        return self._start(name, cmd, env)

    def _start(self, name: str, cmd: list[str], env: dict[str, str]) -> Proc:
        log = self.folder / f"{name}.log"
        with open(log, "w") as out:
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None and proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            if proc.returncode is None:
                try:
                    proc.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass


def run_method(
    folder: Path,
    method: str,
    train_args: list[str],
    *,
    semi_sync_args: list[str] = (),
    groups: int = 2,
    pin: bool = True,
    threads: int = 1,
    timeout: float = 1800,
) -> list[Proc]:
    """Run one method to the end: ``no_ft`` as ``groups`` independent processes, the others
    as a lighthouse plus ``groups`` replica groups. ``semi_sync_args`` go to the LocalSGD and
    DiLoCo methods only. With ``pin``, process i runs on core i. Raises with the log tail if
    any process fails."""
    extra = list(semi_sync_args) if SEMI_SYNC_MODULE in METHODS[method] else []
    with Job(folder) as job:
        fault_tolerant = method != "no_ft"
        if fault_tolerant:
            job.start_lighthouse(min_replicas=groups)
        trainers = []
        for i in range(groups):
            trainers.append(
                job.start_trainer(
                    f"{method}_g{i}",
                    [*METHODS[method], *train_args, *extra],
                    replica_id=i if fault_tolerant else None,
                    groups=groups,
                    cpus=str(i % (os.cpu_count() or 1)) if pin else None,
                    threads=threads,
                )
            )
        deadline = time.monotonic() + timeout
        for proc in trainers:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{proc.name} exited with {code}:\n{proc.tail()}")
        return trainers


def step_lines(text: str) -> list[dict[str, float]]:
    """Every step line of a log: step, loss, memory (GiB), tps."""
    return [
        {
            "step": int(m.group(1)),
            "loss": float(m.group(2)),
            "memory_gib": float(m.group(3)),
            "tps": float(m.group(4).replace(",", "")),
        }
        for m in STEP_LINE.finditer(strip_ansi(text))
    ]


def validation_losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in VALIDATION_LINE.finditer(text)}


def sync_times_ms(text: str) -> list[int]:
    return [int(m.group(3)) for m in SYNC_LINE.finditer(text)]


def interval_tokens_per_second(lines: list[dict[str, float]], after_step: int) -> float:
    """Tokens/s over the log intervals that end after ``after_step``: the tokens of equal
    intervals divided by their summed time (the harmonic mean of the interval rates), so a
    slow sync step weighs in with its real time."""
    rates = [line["tps"] for line in lines if line["step"] > after_step]
    if not rates:
        raise ValueError(f"no step line after step {after_step}")
    return len(rates) / sum(1.0 / r for r in rates)


def median(values: list[float]) -> float:
    return statistics.median(values)


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores' time spent busy over the next ``seconds`` (``/proc/stat``); unlike
    the load average it does not remember the run that just ended."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet_machine(max_load: float, max_wait_s: float) -> float:
    """Before a measurement: wait (up to ``max_wait_s``) until the cores are mostly idle (under
    25 % busy over 2 s) or the 1-minute load average is below ``max_load``; returns the load
    average then (recorded with each measurement)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline and load_average() >= max_load:
        if cpu_busy_fraction() < 0.25:
            break
    return load_average()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": commit + ("+dirty" if dirty else ""),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
