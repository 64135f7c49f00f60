"""Shared by the fault-tolerance benchmarks: trainer processes and local jobs (a lighthouse
and replica groups, ``torchtitan.tools.cluster``), each group pinned to a core; the methods
compared; reading the trainers' events (``torchtitan.tools.events``: steps, validations,
syncs); waiting for a quiet machine before measuring.
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import SYNC
from torchtitan.tools.cluster import (
    GroupLaunch,
    Launch,
    LighthouseSettings,
    LocalJob,
    Process,
    ProcessSpec,
)
from torchtitan.tools.cluster.process import as_built
from torchtitan.tools.events import (
    EVENTS_FOLDER,
    Event,
    EventKind,
    EventTail,
    event_file_path,
    read_events,
)
from torchtitan.trainer import VALIDATION

REPO = Path(__file__).resolve().parents[1]

#: How a benchmark starts a trainer (from the repository root, as a job's processes run).
TRAIN_ENTRY = [sys.executable, "-m", "benchmarks.train_entry"]
SEMI_SYNC_MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
# The semi-sync config plus trainers that emit per-step timing events (benchmarks/timed_trainer.py).
TIMED_MODULE = "--job.custom_args_module=benchmarks.timed_trainer"
# The dump folder of a trainer_job's groups, in the job's folder (all groups share it).
GROUPS_DUMP = "dump"

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
    "async_diloco": [SEMI_SYNC_MODULE, "--fault_tolerance.semi_sync_method=async_diloco"],
    "async_delayed": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.async_update=delayed",
    ],
    "async_eager_share": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.async_update=eager_share",
    ],
    "async_eager_dn": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.outer_momentum_every=2",
    ],
    "async_delayed_dn": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.async_update=delayed",
        "--fault_tolerance.outer_momentum_every=2",
    ],
    "async_dylu": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.dynamic_local_steps",
    ],
    "diloco_int8": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.pseudo_grad_dtype=int8",
    ],
    "async_diloco_int8": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.pseudo_grad_dtype=int8",
    ],
    "diloco_int4_ef": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.pseudo_grad_dtype=int4",
        "--fault_tolerance.error_feedback",
    ],
    "diloco_sparse": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.pseudo_grad_dtype=sparse",
        "--fault_tolerance.error_feedback",
        "--fault_tolerance.outer_momentum=0",
    ],
    "async_diloco_sparse": [
        SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.pseudo_grad_dtype=sparse",
        "--fault_tolerance.error_feedback",
        "--fault_tolerance.outer_momentum=0",
    ],
}


def dtype_flags(dtype: str, error_feedback: bool = False) -> list[str]:
    """The trainer flags of ``fault_tolerance.pseudo_grad_dtype=dtype`` (none for float32),
    with what the dtype needs: sparse always has error feedback and no outer momentum."""
    if dtype == "float32":
        return []
    flags = [f"--fault_tolerance.pseudo_grad_dtype={dtype}"]
    if error_feedback or dtype == "sparse":
        flags.append("--fault_tolerance.error_feedback")
    if dtype == "sparse":
        flags.append("--fault_tolerance.outer_momentum=0")
    return flags


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
    """A job whose replica groups are one ``python -m benchmarks.train_entry`` process each (one
    thread, group i on core i unless ``launch_group`` says otherwise), without colour codes in
    their logs. Default lighthouse: every group needed for a quorum, 5 s heartbeat timeout.
    The caller starts the lighthouse and groups it needs."""
    return LocalJob(
        folder,
        groups=groups,
        entry=TRAIN_ENTRY,
        train_args=[
            f"--job.dump_folder={folder / GROUPS_DUMP}",
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
    of ``job`` named ``name``, with the dump folder ``<job folder>/<name>``; ``launch`` as for
    a job's groups."""
    argv = [
        *TRAIN_ENTRY,
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
    group_args: Sequence[Sequence[str]] = (),
    groups: int = 2,
    timeout: float = 1800,
    job_options: Mapping[str, Any] | None = None,
    lighthouse_port: int | None = None,
) -> list[Process]:
    """Run one method to the end: ``no_ft`` as ``groups`` independent processes, the others
    as a lighthouse plus ``groups`` replica groups; process i runs on core i. ``semi_sync_args``
    go to the LocalSGD and DiLoCo methods only; ``group_args[i]``, when given, to group i only.
    ``job_options`` go to :func:`trainer_job` (how groups and lighthouse are launched, e.g.
    on emulated links) and ``lighthouse_port`` to the lighthouse (default: a free one).
    Raises with the log tail if any process fails."""
    extra = list(semi_sync_args) if SEMI_SYNC_MODULE in METHODS[method] else []
    args = [*METHODS[method], *train_args, *extra]
    with trainer_job(folder, groups, args, **(job_options or {})) as job:
        if method == "no_ft":
            launch = (job_options or {}).get("launch_group", pin_to_core)
            trainers = [
                start_alone(job, f"{method}_g{i}", args, functools.partial(launch, i))
                for i in range(groups)
            ]
        else:
            job.start_lighthouse(lighthouse_port)
            for i in range(groups):
                job.start_group(i, list(group_args[i]) if group_args else [])
            trainers = [job.latest(i) for i in range(groups)]
        wait_all(trainers, timeout)
        return trainers


def trainer_events(trainer: Process, *kinds: EventKind) -> list[Event]:
    """The events (of ``kinds``; default all) that rank 0 of a trainer emitted, oldest first:
    the latest start of a replica group of :func:`trainer_job` (its group's starts share a
    file: the events since its wall-clock start) or a trainer of :func:`start_alone`. For an
    earlier start of a group, or a job still running, see :class:`GroupEvents`."""
    folder = trainer.log.parent  # the job's folder: every process logs there
    dump = folder / (GROUPS_DUMP if trainer.replica_id is not None else trainer.name)
    names = {kind.name for kind in kinds}
    found = read_events(
        dump / EVENTS_FOLDER, replica=trainer.replica_id, rank=0, since=trainer.started_at
    )
    return [event for event in found if not names or event.name in names]


class GroupEvents:
    """The events of the replica groups of a :func:`trainer_job` (rank 0), per start, read as
    they are written: each look parses only what was appended since the last one. Waiting on
    a long run polls often, and parsing a whole file again each time (about 0.1 s per 3,000
    events here) would take that time from the cores the groups run on."""

    def __init__(self, job: LocalJob) -> None:
        self.job = job
        self._tails: dict[int, EventTail] = {}
        self._events: dict[int, list[Event]] = {}

    def of(self, start: Process, *kinds: EventKind) -> list[Event]:
        """The events (of ``kinds``; default all) of one start of a group, oldest first: from
        its wall-clock start until its group's next start (its group's starts share a file)."""
        replica = start.replica_id
        assert replica is not None, f"{start.name} is no replica group"
        if replica not in self._tails:
            path = event_file_path(self.job.folder / GROUPS_DUMP, replica, 0)
            self._tails[replica] = EventTail(path, whole_file=True)
        events = self._events.setdefault(replica, [])
        events.extend(self._tails[replica].read())
        since, until = self.job.time_window(start)
        names = {kind.name for kind in kinds}
        return [
            event
            for event in events
            if since <= event.time < until and (not names or event.name in names)
        ]


def step_rows(events: Iterable[Event]) -> list[dict[str, float]]:
    """step, loss, memory (GiB) and tps (tokens/s on the rank, unrounded) of every
    ``train.step`` among ``events``."""
    return [
        {"step": e.step, "loss": e["loss"], "memory_gib": e["memory_gib"], "tps": e["tps"]}
        for e in events
        if e.name == TRAIN_STEP.name and e.step is not None
    ]


def validation_losses(events: Iterable[Event]) -> dict[int, float]:
    """{step: held-out loss} of the ``train.validation`` events among ``events``."""
    return {e.step: e["loss"] for e in events if e.name == VALIDATION.name and e.step is not None}


def sync_times_ms(events: Iterable[Event]) -> list[float]:
    """Milliseconds in torchft's sync hooks of every ``semi_sync.sync`` among ``events``,
    committed or not."""
    return [1000 * e["seconds"] for e in events if e.name == SYNC.name]


def interval_tokens_per_second(lines: list[dict[str, float]], after_step: int) -> float:
    """Tokens/s over the log intervals (rows of :func:`step_rows`) that end after
    ``after_step``: the tokens of equal intervals divided by their summed time (the harmonic
    mean of the interval rates), so a slow sync step weighs in with its real time."""
    rates = [line["tps"] for line in lines if line["step"] > after_step]
    if not rates:
        raise ValueError(f"no step event after step {after_step}")
    return len(rates) / sum(1.0 / r for r in rates)


def repeats_verdict(reached: list[bool], what: str) -> str:
    """ "met" when at least 4 of 5 repeats (3 of 3; all but one in five generally) reached
    the target described by ``what``, else "missed"; with the count."""
    need = len(reached) - len(reached) // 5
    word = "met" if sum(reached) >= need else "missed"
    return f"{word}: {sum(reached)} of {len(reached)} repeats {what}"


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
