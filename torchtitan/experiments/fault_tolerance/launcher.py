"""One command for a local fault-tolerant job: a lighthouse plus N replica groups.

    ./run_launcher.sh --groups 2 -- --training.steps=100

(``run_launcher.sh`` runs this module with the project's ``.venv``) starts
``torchft_lighthouse`` on 127.0.0.1 (a free port), then N replica groups, each a
``run_train.sh`` (``--ngpu`` ranks) with its own manager port and ``--fault_tolerance.replica_id``.
Every output line is prefixed with its group. Ctrl-C stops everything; the launcher exits 0 when
every group finished, 1 when a group failed for good (exited non-zero without being killed by the
launcher: the other groups go on without it, and the launcher reports it when they are done),
130 after Ctrl-C. Faults can be injected: SIGKILL a group at a step (``--kill R@S``)
or a random group every T seconds (``--kill-every T --seed X``), each restarted after
``--restart-after D`` seconds. A kill takes the group's whole process tree (torchrun starts its
workers in sessions of their own, so killing the process group alone would leave them running).

Everything listens on 127.0.0.1 only; ports are picked free, never torchft's defaults, so two
launchers on one machine cannot join each other's quorum.

Which step a group has reached is read from its event file (rank 0's ``train.step`` events in
``<job.dump_folder>/events``, the dump folder the groups are given), not from its output.
Starting, killing and stopping the processes is ``torchtitan.tools.cluster``'s; this module is
the command line, the prefixed output and the exit status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.config.job_config import ConfigError
from torchtitan.config.job_config import JobConfig as CoreJobConfig
from torchtitan.config.manager import flag_value, load_toml, raw_value
from torchtitan.experiments.fault_tolerance.lineage import job_model
from torchtitan.tools.cluster import (
    JOB_ENV,
    REPO_ROOT,
    RUN_TRAIN_CONFIG,
    LighthouseSettings,
    LocalJob,
    PeriodicKills,
    Process,
    Restarts,
    StepKills,
    split_devices,
    visible_gpus,
)
from torchtitan.tools.events import EventTail, event_file_path, read_events

# The name of ``torchtitan.components.metrics.TRAIN_STEP``: importing the kind would bring torch
# into the launcher, which does without it (a unit test checks that the two agree).
STEP_EVENT = "train.step"
# ``events.FINAL_MODEL``'s name, for the same reason.
FINAL_MODEL_EVENT = "semi_sync.final_model"
# At the end and after Ctrl-C, how long the job's processes have to exit on SIGTERM (torchrun
# passes it on to its workers) before they are SIGKILLed.
_STOP_GRACE_S = 10.0


def _print(prefix: str, line: str) -> None:
    sys.stdout.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
    sys.stdout.flush()


@dataclass
class Group:
    """One replica group: its latest start and what the launcher knows about it."""

    replica_id: int
    process: Process | None = None
    #: Prints the latest start's output; done once that start has exited and all is printed.
    follower: threading.Thread = field(default_factory=threading.Thread)
    #: The step events of the latest start (its rank 0's event file).
    steps: EventTail | None = None
    last_step: int = 0
    steps_this_start: int = 0
    restarts: int = 0
    done: bool = False
    failed: bool = False


class Launcher:
    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args = args
        self.groups = [Group(r) for r in range(args.groups)]
        # A launcher started by someone who marks its processes (a test) keeps that marker, so
        # that its groups are found as well.
        self.job = LocalJob(
            logs,
            groups=args.groups,
            train_args=args.train_args,
            ngpu=args.ngpu,
            lighthouse=LighthouseSettings(
                min_replicas=args.min_replicas,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                join_timeout_ms=args.join_timeout_ms,
            ),
            job_id=os.environ.get(JOB_ENV),
            group_devices=args.group_devices,
        )
        self.dump_folder = groups_dump_folder(args.train_args)
        self.step_kills = StepKills(args.kill)
        self.restarts = Restarts(args.restart_after)

    # ---- processes -----------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        address = self.job.start_lighthouse()
        lighthouse = self.job.lighthouse
        assert lighthouse is not None
        _print("[launcher]", f"lighthouse at {address} (pid {lighthouse.pid})")
        if self.args.show_lighthouse:
            threading.Thread(target=self._show_lighthouse, args=(lighthouse,), daemon=True).start()

    def _show_lighthouse(self, lighthouse: Process) -> None:
        lines = lighthouse.lines()
        for line in lines:  # its start-up, up to the line that gave its address, stays quiet
            if "listening on" in line:
                break
        for line in lines:
            _print("[lighthouse]", line)

    def start_group(self, group: Group) -> None:
        # Made before the start: what the file holds by then is an earlier start's (or an
        # earlier job's, in a dump folder used before), never this start's.
        steps = self.step_events(group)
        group.process = self.job.start_group(group.replica_id)
        group.steps = steps
        group.steps_this_start = 0
        what = "started" if group.restarts == 0 else f"restarted (#{group.restarts})"
        _print("[launcher]", f"group {group.replica_id} {what}, pid {group.process.pid}")
        group.follower = threading.Thread(
            target=self._follow, args=(group, group.process), daemon=True
        )
        group.follower.start()

    def step_events(self, group: Group) -> EventTail:
        """Follows the group's rank 0 event file from its current end."""
        return EventTail(event_file_path(self.dump_folder, group.replica_id, 0))

    def _follow(self, group: Group, process: Process) -> None:
        for line in process.lines():
            _print(f"[group {group.replica_id}]", line)

    def read_steps(self, group: Group) -> None:
        """Take in the steps the group's latest start has logged since the last call, and kill
        it if ``--kill`` says so."""
        if group.steps is None:
            return
        for event in group.steps.read(STEP_EVENT):
            if event.step is None:
                continue
            group.last_step = max(group.last_step, event.step)
            group.steps_this_start += 1
            if self.step_kills.due(group.replica_id, event.step):
                self.kill(group, f"at step {event.step} (--kill)")

    def kill(self, group: Group, why: str) -> None:
        """SIGKILL the group's whole process tree, and schedule its restart."""
        if group.process is None or not group.process.alive():
            return
        self.job.kill_group(group.replica_id)
        assert group.process.killed_at is not None
        self.restarts.schedule(group.replica_id, group.process.killed_at)
        _print("[launcher]", f"SIGKILL group {group.replica_id} {why}; "
               f"restart in {self.args.restart_after:g}s")  # fmt: skip

    def stop_all(self) -> None:
        """SIGTERM every process of the job (trees), SIGKILL what is left after a while."""
        self.job.close(grace_s=_STOP_GRACE_S)

    # ---- supervision -----------------------------------------------------------------------

    def run(self) -> int:
        self.start_lighthouse()
        for group in self.groups:
            self.start_group(group)
        random_kills = PeriodicKills(self.args.kill_every, self.args.seed, time.monotonic())
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            for group in self.groups:
                self.read_steps(group)
                self._check(group, now)
            # A group that failed on its own is reported at the end; the others are fault
            # tolerant and go on without it (one slow or broken group never takes the job).
            live = [g for g in self.groups if not g.done and not g.failed]
            if not live:
                break
            if random_kills.due(now):
                running = [g for g in live if g.process and g.process.alive()]
                if len(running) > 1:  # never kill the last group standing
                    victim = random_kills.choose([g.replica_id for g in running])
                    self.kill(self.groups[victim], "(--kill-every)")
                random_kills.reschedule(now)
        failed = [g.replica_id for g in self.groups if g.failed]
        self.stop_all()
        self.summarize_final_models()
        if failed:
            _print("[launcher]", f"FAILED: group(s) {failed}")
            return 1
        restarts = sum(g.restarts for g in self.groups)
        _print("[launcher]", f"all {len(self.groups)} groups finished ({restarts} restart(s))")
        return 0

    def summarize_final_models(self) -> None:
        """Semi-sync jobs: compare the final models of the groups that finished (their rank 0
        digests) and name the job's (``lineage.job_model``)."""
        finals: dict[int, dict] = {}
        for group in self.groups:
            if not group.done or group.process is None:
                continue
            path = event_file_path(self.dump_folder, group.replica_id, 0)
            found = read_events(path, FINAL_MODEL_EVENT, since=group.process.started_at)
            if found:
                finals[group.replica_id] = found[-1].fields
        chosen = job_model(finals)
        if chosen is None:
            return
        digests = {fields["digest"] for fields in finals.values()}
        if len(digests) == 1:
            _print("[launcher]", f"final models: group(s) {sorted(finals)} identical (digest "
                   f"{finals[chosen]['digest']})")  # fmt: skip
            return
        for replica, fields in sorted(finals.items()):
            shared = fields["last_shared_sync"]
            _print("[launcher]", f"final model of group {replica}: digest {fields['digest']}, "
                   f"last sync shared with other groups #{shared}, {fields['solo_syncs']} sync(s) "
                   "alone since")  # fmt: skip
        _print("[launcher]", f"final models DIFFER: the job's model is group {chosen}'s (the "
               "longest shared lineage; docs/fault_tolerance.md, 'Which final model')")  # fmt: skip

    def _check(self, group: Group, now: float) -> None:
        if group.done or group.failed or group.process is None:
            return
        others_finished = any(g.done and g is not group for g in self.groups) and all(
            g.done for g in self.groups if g is not group
        )
        code = group.process.poll()
        if code is None:
            if others_finished and group.steps_this_start == 0 and group.restarts > 0:
                # A restarted group that has not trained yet cannot join a finished job.
                self.job.kill_group(group.replica_id)
                group.done = True
                _print("[launcher]", f"group {group.replica_id}: the job finished before it "
                       "rejoined; stopped")  # fmt: skip
            return
        if group.follower.is_alive():
            return  # its last lines are printed before what the launcher says about its exit
        if group.process.killed_at is not None:
            if others_finished:
                group.done = True
                self.restarts.cancel(group.replica_id)
                _print("[launcher]", f"group {group.replica_id}: not restarted, the other "
                       "groups finished the job")  # fmt: skip
            elif self.restarts.due(group.replica_id, now):
                self.restarts.cancel(group.replica_id)
                group.restarts += 1
                self.start_group(group)
            return
        if code == 0:
            group.done = True
            _print("[launcher]", f"group {group.replica_id} finished")
        else:
            group.failed = True
            _print("[launcher]", f"group {group.replica_id} exited with code {code}")
            if any(not g.done and not g.failed for g in self.groups):
                _print("[launcher]", f"the other groups go on without group {group.replica_id}")


def groups_dump_folder(train_args: Sequence[str], env: Mapping[str, str] = os.environ) -> Path:
    """The ``job.dump_folder`` of groups started with ``train_args`` (their event files are in
    its ``events/``), taken as their trainer takes it: the last ``--job.dump_folder`` flag,
    else the TOML's (``--job.config_file``, else ``run_train.sh``'s ``CONFIG_FILE``), else the
    default; relative to the repository root, where ``run_train.sh`` runs. Only that one field
    is read: parsing the whole config would import the custom args module (torch) and reject
    a bad value that the groups themselves must report."""
    folder = flag_value(train_args, "job.dump_folder")
    if folder is None:
        config_file = flag_value(train_args, "job.config_file") or env.get("CONFIG_FILE")
        try:
            table = load_toml(REPO_ROOT / (config_file or RUN_TRAIN_CONFIG)).get("job", {})
        except (OSError, ConfigError):
            table = {}  # the groups fail on it and say why; no step of theirs is awaited
        folder = table.get("dump_folder") if isinstance(table, dict) else None
        if not isinstance(folder, str):
            folder = CoreJobConfig().job.dump_folder
    return REPO_ROOT / folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="./run_launcher.sh",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to every group's run_train.sh (e.g. "
        "--job.custom_args_module=... --fault_tolerance.semi_sync_method=diloco).",
    )
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--ngpu", type=int, default=1, help="ranks per group (NGPU; default 1)")
    parser.add_argument(
        "--gpus-per-group",
        type=int,
        default=None,
        metavar="N",
        help="give each group N GPUs of its own (CUDA_VISIBLE_DEVICES split in order: group 0 "
        "the first N); 0: every group sees them all and puts its ranks on cuda:0.. (groups "
        "share GPUs). Default: --ngpu when the machine has a GPU per rank of every group, "
        "else 0 with a note",
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="lighthouse --min_replicas: fewest groups for a quorum (default 1). The groups' "
        "own --fault_tolerance.min_replica_size also makes them wait for that many.",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=2000,
        help="a group silent this long is dropped from the quorum (default 2000)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=10000,
        help="how long the lighthouse waits for heartbeating stragglers (default 10000)",
    )
    parser.add_argument(
        "--kill",
        type=_kill_spec,
        action="append",
        default=[],
        metavar="R@S",
        help="SIGKILL group R once it logs step S (repeatable)",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        metavar="T",
        help="SIGKILL a random running group every T seconds (0: off)",
    )
    parser.add_argument(
        "--restart-after",
        type=float,
        default=5.0,
        metavar="D",
        help="restart a killed group after D seconds (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --kill-every's choices")
    parser.add_argument("--show-lighthouse", action="store_true",
                        help="also print the lighthouse's own log")  # fmt: skip
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then arguments for run_train.sh")  # fmt: skip
    args = parser.parse_args(argv)
    if args.train_args and args.train_args[0] == "--":
        args.train_args = args.train_args[1:]
    if args.groups < 1:
        parser.error(f"--groups: {args.groups} is not allowed; use 1 or more")
    if args.ngpu < 1:
        parser.error(f"--ngpu: {args.ngpu} is not allowed; use 1 or more")
    if not 1 <= args.min_replicas <= args.groups:
        parser.error(f"--min-replicas: {args.min_replicas} must be in [1, --groups={args.groups}]")
    for replica, _ in args.kill:
        if not 0 <= replica < args.groups:
            parser.error(f"--kill: group {replica} does not exist (groups 0..{args.groups - 1})")
    args.group_devices = _group_devices(parser, args)
    return args


def _group_devices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str] | None:
    """Each group's CUDA_VISIBLE_DEVICES, or None to leave it alone (no GPU, or shared)."""
    gpus = visible_gpus()
    per_group = args.gpus_per_group
    if per_group is None:
        if not gpus:
            return None
        if len(gpus) < args.groups * args.ngpu:
            _print(
                "[launcher]",
                f"{args.groups} group(s) x {args.ngpu} rank(s) on {len(gpus)} GPU(s): the groups "
                "share them (--gpus-per-group=N gives each group N of its own)",
            )
            return None
        per_group = args.ngpu
    if per_group < 0:
        parser.error(f"--gpus-per-group: {per_group} is not allowed; use 0 or more")
    if per_group == 0:
        return None
    try:
        return split_devices(gpus, args.groups, per_group)
    except ValueError as e:
        parser.error(f"--gpus-per-group: {per_group} is not allowed; {e}")


def _kill_spec(text: str) -> tuple[int, int]:
    replica, sep, step = text.partition("@")
    if not sep or not replica.isdigit() or not step.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected R@S, e.g. 1@10")
    return int(replica), int(step)


def command_for_one_group(train_args: list[str]) -> list[str] | None:
    """The launcher's command for a semi-sync command line typed without fault tolerance
    (``./run_train.sh --job.custom_args_module=... --fault_tolerance.semi_sync_method=localsgd``):
    one replica group against a lighthouse started for it, as the user expects training to
    start. None when fault tolerance is on, when ``group_size`` asks for more groups (two
    groups must never each start a lighthouse and train apart), or when ``TORCHFT_LIGHTHOUSE``
    names one: the config's own checks then say what to do."""
    from torchtitan.experiments.fault_tolerance.job_config import SEMI_SYNC_METHODS

    config_file = flag_value(train_args, "job.config_file")
    toml_data = load_toml(config_file) if config_file else {}
    method = raw_value(train_args, toml_data, "fault_tolerance.semi_sync_method")
    enabled = raw_value(train_args, toml_data, "fault_tolerance.enable")
    group_size = raw_value(train_args, toml_data, "fault_tolerance.group_size")
    if (
        method not in SEMI_SYNC_METHODS
        or str(enabled).lower() == "true"
        or str(group_size) not in ("None", "0", "1")
        or os.environ.get("TORCHFT_LIGHTHOUSE")
    ):
        return None
    launcher = [sys.executable, "-m", "torchtitan.experiments.fault_tolerance.launcher"]
    shown = "./run_launcher.sh"
    print(
        f"[launcher] fault_tolerance.semi_sync_method={method} trains across replica groups "
        "with fault tolerance: starting a lighthouse on 127.0.0.1 and this command as replica "
        f"group 0 of 1. More groups on this machine: {shown} --groups 2 -- ARGS; on several "
        "machines: docs/fault_tolerance.md (one lighthouse, one command per group)",
        file=sys.stderr,
        flush=True,
    )
    ranks = os.environ.get("NGPU", "1")
    return [*launcher, "--groups", "1", "--ngpu", ranks, "--", *train_args]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The groups' output is printed as it comes; the log files it comes through are not kept.
    logs = Path(tempfile.mkdtemp(prefix="ft_launcher_"))
    launcher = Launcher(args, logs)

    def terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # a supervisor's SIGTERM cleans up like Ctrl-C
    try:
        with launcher.job:  # whatever happens, no process of the job outlives the launcher
            try:
                return launcher.run()
            except KeyboardInterrupt:
                _print("[launcher]", "interrupted: stopping all groups")
                launcher.stop_all()
                return 130
    finally:
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
