"""A local fault-tolerant job: one torchft lighthouse and N replica groups on this machine.

Each replica group is one process tree (``run_train.sh`` by default: one process, or torchrun
and its ranks) started with the environment a group needs: the lighthouse address, a free port
for its torchft manager, its rank count and a fair share of the cores. Every start of every
process has a log file of its own in the job's folder (``group1_start0.log``,
``group1_start1.log`` after a restart, ``lighthouse_start0.log``).

Failure semantics: :meth:`LocalJob.close` (also on leaving a ``with`` block, after an error
too) kills every process the job started, their descendants, and any process that carries the
job's marker in its environment (a torchrun worker whose parent died first is in no tree).
Nothing else is ever signalled, and every signal goes to one PID.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torchtitan.tools import torchft_logs
from torchtitan.tools.cluster.lighthouse import (
    LighthouseSettings,
    groups_waiting_at,
    wait_until_listening,
)
from torchtitan.tools.cluster.ports import free_port
from torchtitan.tools.cluster.process import Launch, Process, ProcessSpec, as_built, start
from torchtitan.tools.cluster.process_tree import (
    kill_tree,
    process_tree,
    processes_with_env,
    signal_pids,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
RUN_TRAIN = REPO_ROOT / "run_train.sh"
#: The TOML ``run_train.sh`` passes (before the caller's flags) unless ``CONFIG_FILE`` names one.
RUN_TRAIN_CONFIG = REPO_ROOT / "torchtitan/models/llama3/train_configs/debug_model.toml"

#: In the environment of every process a job starts: its value is the job's id.
JOB_ENV = "TORCHTITAN_LOCAL_JOB"

# Variables of a torchrun that started us: a replica group runs a rendezvous of its own.
_PARENT_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")

#: How a start of replica group ``replica_id`` is run (see ``process.Launch``).
GroupLaunch = Callable[[int, ProcessSpec], ProcessSpec]


def _same_for_every_group(replica_id: int, spec: ProcessSpec) -> ProcessSpec:
    return spec


def visible_gpus() -> list[str]:
    """The GPUs a process started from here may use, without importing torch: the entries of
    ``CUDA_VISIBLE_DEVICES`` when it is set, else one per ``/dev/nvidia<N>`` device."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    found = [p.name[len("nvidia") :] for p in Path("/dev").glob("nvidia[0-9]*")]
    return sorted((d for d in found if d.isdigit()), key=int)


def split_devices(gpus: Sequence[str], groups: int, per_group: int) -> list[str]:
    """Each group's ``CUDA_VISIBLE_DEVICES``: ``per_group`` GPUs of ``gpus`` each, in order
    (group r gets gpus[r * per_group : (r + 1) * per_group]). ValueError when there are not
    enough."""
    needed = groups * per_group
    if len(gpus) < needed:
        raise ValueError(
            f"{groups} group(s) x {per_group} GPU(s) need {needed} GPUs, {len(gpus)} are visible"
        )
    return [",".join(gpus[r * per_group : (r + 1) * per_group]) for r in range(groups)]


class LocalJob:
    """A lighthouse and replica groups on this machine; use as a context manager.

    ``train_args`` go to every group after its fault-tolerance flags. ``entry`` is the command
    that starts one group (default ``run_train.sh``). ``threads``: ``OMP_NUM_THREADS`` of every
    rank; None keeps the caller's if it has one, else gives each rank its share of the cores.
    ``job_id``: the marker value (a new one by default; a launcher passes on the one it was
    started with, so that whoever started it finds the launcher's groups too).
    ``launch_group`` / ``launch_lighthouse`` change how those processes are started, e.g.
    pinned to a core or inside a network namespace.
    """

    def __init__(
        self,
        folder: Path,
        *,
        groups: int = 2,
        train_args: Sequence[str] = (),
        ngpu: int = 1,
        entry: Sequence[str] = (str(RUN_TRAIN),),
        threads: int | None = None,
        log_all_ranks: bool = False,
        lighthouse: LighthouseSettings | None = None,
        launch_group: GroupLaunch = _same_for_every_group,
        launch_lighthouse: Launch = as_built,
        job_id: str | None = None,
        group_devices: Sequence[str] | None = None,
        group_env: Mapping[int, Mapping[str, str]] | None = None,
        groups_per_site: int = 1,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.groups = groups
        self.train_args = list(train_args)
        self.ngpu = ngpu
        self.entry = list(entry)
        self.threads = threads
        self.log_all_ranks = log_all_ranks
        self.lighthouse_settings = lighthouse or LighthouseSettings()
        self.launch_group = launch_group
        self.launch_lighthouse = launch_lighthouse
        self.job_id = job_id or uuid.uuid4().hex
        #: Each group's ``CUDA_VISIBLE_DEVICES`` (see :func:`split_devices`); None: unchanged.
        self.group_devices = list(group_devices) if group_devices is not None else None
        #: Variables given to every start of a group, by replica id (e.g. another host's
        #: ``ATEN_CPU_CAPABILITY``).
        self.group_env = {r: dict(env) for r, env in (group_env or {}).items()}
        #: Every process started, in order (lighthouse starts included).
        self.processes: list[Process] = []
        #: The starts of each replica group, in order.
        self.starts: dict[int, list[Process]] = {}
        self.lighthouse: Process | None = None
        self.lighthouse_port: int | None = None
        #: What the groups are given as ``TORCHFT_LIGHTHOUSE`` (set by start_lighthouse).
        self.lighthouse_address = ""
        #: Groups per site (``fault_tolerance.groups_per_site``; 1: every group is a site).
        self.groups_per_site = groups_per_site
        #: Each site's lighthouse (with ``groups_per_site`` > 1), by site.
        self.site_lighthouses: dict[int, Process] = {}
        self.site_addresses: dict[int, str] = {}

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- any process -------------------------------------------------------------------------

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment for a process of the job: marked, unbuffered output."""
        env = {k: v for k, v in os.environ.items() if k not in _PARENT_TORCHRUN_ENV}
        env["PYTHONUNBUFFERED"] = "1"  # log lines appear as they happen
        env[JOB_ENV] = self.job_id
        env.update(extra or {})
        return env

    def start_process(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        launch: Launch = as_built,
        replica_id: int | None = None,
    ) -> Process:
        """Start any process as part of the job (``env`` is added to :meth:`environment`), its
        output in ``<folder>/<name>.log``."""
        spec = launch(ProcessSpec(list(argv), self.environment(env)))
        process = start(name, spec, self.folder / f"{name}.log", REPO_ROOT, replica_id)
        self.processes.append(process)
        return process

    # ---- the lighthouse ----------------------------------------------------------------------

    def start_lighthouse(self, port: int | None = None) -> str:
        """Start the lighthouse on ``port`` (default: a free one) and wait until it listens;
        returns its address."""
        settings = self.lighthouse_settings
        port = port or free_port(settings.host)
        count = sum(1 for p in self.processes if p.name.startswith("lighthouse_start"))
        # Its log keeps every quorum (INFO) unless the user set RUST_LOG; this process's own
        # RUST_LOG quiets torchft's console lines (tools/torchft_logs).
        env = {torchft_logs.VARIABLE: torchft_logs.lighthouse_setting()}
        lighthouse = self.start_process(
            f"lighthouse_start{count}", settings.command(port), env, launch=self.launch_lighthouse
        )
        self.lighthouse, self.lighthouse_port = lighthouse, port
        self.lighthouse_address = settings.address(port)
        wait_until_listening(lighthouse, settings, port)
        return self.lighthouse_address

    def start_site_lighthouse(
        self,
        site: int,
        host: str | None = None,
        launch: Launch | None = None,
        port: int | None = None,
    ) -> str:
        """Start site ``site``'s lighthouse (a quorum of one group is enough: the groups'
        ``site_min_groups`` says how many they need) on ``port`` (default a free one) of
        ``host`` (default the job lighthouse's), started by ``launch`` (default the job
        lighthouse's; e.g. in the site's network namespace); returns its address."""
        settings = dataclasses.replace(
            self.lighthouse_settings,
            min_replicas=1,
            host=host or self.lighthouse_settings.host,
        )
        port = port or free_port(settings.host)
        env = {torchft_logs.VARIABLE: torchft_logs.lighthouse_setting()}
        lighthouse = self.start_process(
            f"site{site}_lighthouse",
            settings.command(port),
            env,
            launch=launch or self.launch_lighthouse,
        )
        self.site_lighthouses[site] = lighthouse
        self.site_addresses[site] = settings.address(port)
        wait_until_listening(lighthouse, settings, port)
        return self.site_addresses[site]

    def kill_lighthouse(self) -> int:
        """SIGKILL the lighthouse; returns its port (for :meth:`restart_lighthouse`)."""
        assert self.lighthouse is not None and self.lighthouse_port is not None
        self._kill(self.lighthouse)
        return self.lighthouse_port

    def restart_lighthouse(self) -> str:
        """A new lighthouse on the address of the last one (groups find it there again)."""
        assert self.lighthouse_port is not None, "no lighthouse was started"
        return self.start_lighthouse(self.lighthouse_port)

    def groups_waiting(self) -> int:
        """How many groups wait for a quorum at the lighthouse now."""
        return groups_waiting_at(self.lighthouse_address)

    # ---- replica groups ----------------------------------------------------------------------

    def group_environment(self, replica_id: int) -> dict[str, str]:
        """What a start of a replica group gets on top of :meth:`environment`."""
        env = {
            "NGPU": str(self.ngpu),
            "TORCHFT_LIGHTHOUSE": self.lighthouse_address,
            # 0: the manager server binds a port the kernel picks as it binds (a port picked
            # here and bound seconds later, at the group's start-up, was once taken meanwhile by
            # another process: "Address already in use"); its ranks find it through the store.
            # Set, not inherited: groups of one machine must not share a port from the shell.
            "TORCHFT_MANAGER_PORT": "0",
            # run_train.sh's interpreter: the one whose torchft runs the lighthouse.
            "PYTHON": os.environ.get("PYTHON", sys.executable),
        }
        if self.group_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.group_devices[replica_id]
        if self.log_all_ranks:
            env["LOG_RANK"] = ",".join(str(r) for r in range(self.ngpu))
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        elif "OMP_NUM_THREADS" not in os.environ:
            # The groups share this machine's cores: a thread per core in every rank would
            # only make them fight over the cores.
            share = (os.cpu_count() or 1) // (self.groups * self.ngpu)
            env["OMP_NUM_THREADS"] = str(max(1, share))
        return {**env, **self.group_env.get(replica_id, {})}

    def start_group(
        self,
        replica_id: int,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Process:
        """Start (or restart) replica group ``replica_id``; ``extra_args`` go to this start
        only, after the job's ``train_args``, and so do the variables of ``env``."""
        starts = self.starts.setdefault(replica_id, [])
        site_args = []
        if self.groups_per_site > 1:
            site_args = [
                f"--fault_tolerance.groups_per_site={self.groups_per_site}",
                "--fault_tolerance.site_lighthouse="
                + self.site_addresses[replica_id // self.groups_per_site],
            ]
        argv = [
            *self.entry,
            "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={replica_id}",
            f"--fault_tolerance.group_size={self.groups}",
            *site_args,
            *self.train_args,
            *extra_args,
        ]
        group = self.start_process(
            f"group{replica_id}_start{len(starts)}",
            argv,
            {**self.group_environment(replica_id), **(env or {})},
            lambda spec: self.launch_group(replica_id, spec),
            replica_id,
        )
        starts.append(group)
        return group

    def start(self) -> LocalJob:
        """The lighthouse (and each site's), then every group."""
        self.start_lighthouse()
        if self.groups_per_site > 1:
            for site in range(self.groups // self.groups_per_site):
                self.start_site_lighthouse(site)
        for replica_id in range(self.groups):
            self.start_group(replica_id)
        return self

    def latest(self, replica_id: int) -> Process:
        """The latest start of a group."""
        return self.starts[replica_id][-1]

    def time_window(self, start: Process) -> tuple[float, float]:
        """Wall-clock times (``time.time()``) from a group's start until its next start (inf
        for the latest): the events in a group's file that this start wrote, since every
        start of a group appends to the same file."""
        assert start.replica_id is not None, f"{start.name} is no replica group"
        starts = self.starts[start.replica_id]
        later = starts[starts.index(start) + 1 :]
        return start.started_at, later[0].started_at if later else math.inf

    def kill_group(self, replica_id: int) -> Process:
        """SIGKILL the latest start of a group, its whole process tree; returns that start
        (with ``killed_at`` set, unless it had exited already)."""
        group = self.latest(replica_id)
        self._kill(group)
        return group

    # ---- the whole job -----------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Every live process of the job (lighthouse, groups, their workers)."""
        found = set(processes_with_env(JOB_ENV, self.job_id))
        for process in self.processes:
            if process.alive():
                found.update(process_tree(process.pid))
        return sorted(found)

    def close(self, grace_s: float = 0.0) -> None:
        """Stop every process of the job. With ``grace_s``, SIGTERM first and SIGKILL what
        still runs after that long; else SIGKILL at once."""
        live = [p for p in self.processes if p.alive()]
        for process in live:
            kill_tree(process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        if grace_s > 0:
            deadline = time.monotonic() + grace_s
            for process in live:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    kill_tree(process.pid)
        # Signals are delivered asynchronously: when close returns, the marked ones are gone.
        deadline = time.monotonic() + 30
        while (marked := processes_with_env(JOB_ENV, self.job_id)) and time.monotonic() < deadline:
            signal_pids(marked)
            time.sleep(0.05)
        for process in live:
            try:
                process.wait(30)
            except TimeoutError:
                pass  # unkillable (in uninterruptible sleep): nothing more to do

    def _kill(self, process: Process) -> None:
        if process.alive():
            process.killed_at = time.monotonic()
            kill_tree(process.pid)
        process.wait(30)
