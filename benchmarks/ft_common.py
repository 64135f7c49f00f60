"""Shared by the fault-tolerance benchmarks: trainer processes and local jobs (a lighthouse
and replica groups, ``torchtitan.tools.cluster``), each group pinned to a core; the methods
compared; parsing of step lines; waiting for a quiet machine before measuring.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks run from a clone without installing it

from torchtitan.tools.cluster import (  # noqa: E402
    GroupLaunch,
    Launch,
    LighthouseSettings,
    LocalJob,
    Process,
    ProcessSpec,
    strip_ansi,
)
from torchtitan.tools.cluster.process import as_built  # noqa: E402

TRAIN_ENTRY = REPO / "benchmarks" / "train_entry.py"
SEMI_SYNC_MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
# The semi-sync config plus trainers that log per-step timing lines (benchmarks/timed_trainer.py).
TIMED_MODULE = "--job.custom_args_module=benchmarks.timed_trainer"

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


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (and SIGINT, which a background shell leaves ignored) raise
    KeyboardInterrupt, so that every job kills its processes before the script exits."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def pin_to_core(index: int, spec: ProcessSpec) -> ProcessSpec:
    """Run on core ``index`` (modulo the cores), so that two groups do not share one."""
    core = str(index % (os.cpu_count() or 1))
    return ProcessSpec(["taskset", "-c", core, *spec.argv], spec.env)


def trainer_job(
    folder: Path,
    groups: int,
    train_args: Sequence[str],
    *,
    ft_args: Sequence[str] = FT_ARGS,
    lighthouse: LighthouseSettings | None = None,
    launch_group: GroupLaunch = pin_to_core,
    launch_lighthouse: Launch = as_built,
) -> LocalJob:
    """A job whose replica groups are one ``benchmarks/train_entry.py`` process each (one
    thread, group i on core i unless ``launch_group`` says otherwise), without colour codes in
    their logs. Default lighthouse: every group needed for a quorum, 5 s heartbeat timeout.
    The caller starts the lighthouse and groups it needs."""
    return LocalJob(
        folder,
        groups=groups,
        entry=[sys.executable, str(TRAIN_ENTRY)],
        train_args=[
            f"--job.dump_folder={folder / 'dump'}",
            "--metrics.disable_color_printing",
            *ft_args,
            *train_args,
        ],
        threads=1,
        lighthouse=lighthouse or LighthouseSettings(min_replicas=groups, heartbeat_timeout_ms=5000),
        launch_group=launch_group,
        launch_lighthouse=launch_lighthouse,
    )


def start_alone(
    job: LocalJob, name: str, train_args: Sequence[str], launch: Launch = as_built
) -> Process:
    """A trainer without fault tolerance (no lighthouse, no torchft), one thread, as a process
    of ``job``; ``launch`` as for a job's groups."""
    argv = [
        sys.executable,
        str(TRAIN_ENTRY),
        f"--job.dump_folder={job.folder / name}",
        "--metrics.disable_color_printing",
        *train_args,
    ]
    return job.start_process(name, argv, {"OMP_NUM_THREADS": "1"}, launch)


def wait_all(trainers: list[Process], timeout: float) -> None:
    """Wait until every trainer has exited; raises with the log tail of one that failed."""
    deadline = time.monotonic() + timeout
    for trainer in trainers:
        code = trainer.wait(max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise RuntimeError(f"{trainer.name} exited with {code}:\n{trainer.tail()}")


def run_method(
    folder: Path,
    method: str,
    train_args: list[str],
    *,
    semi_sync_args: Sequence[str] = (),
    groups: int = 2,
    timeout: float = 1800,
) -> list[Process]:
    """Run one method to the end: ``no_ft`` as ``groups`` independent processes, the others
    as a lighthouse plus ``groups`` replica groups; process i runs on core i. ``semi_sync_args``
    go to the LocalSGD and DiLoCo methods only. Raises with the log tail if any process
    fails."""
    extra = list(semi_sync_args) if SEMI_SYNC_MODULE in METHODS[method] else []
    args = [*METHODS[method], *train_args, *extra]
    with trainer_job(folder, groups, args) as job:
        if method == "no_ft":
            trainers = [
                start_alone(job, f"{method}_g{i}", args, functools.partial(pin_to_core, i))
                for i in range(groups)
            ]
        else:
            job.start()
            trainers = [job.latest(i) for i in range(groups)]
        wait_all(trainers, timeout)
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
