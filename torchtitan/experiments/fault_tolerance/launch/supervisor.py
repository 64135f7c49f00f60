"""A local fault-tolerant job under supervision: the lighthouse and the replica groups started,
their output printed with a prefix, groups killed and restarted as ``--kill`` / ``--kill-every``
ask, and the final models compared at the end (``launcher`` is the command line).

Which step a group has reached is read from its event file (rank 0's ``train.step`` events in
``<job.dump_folder>/events``, the dump folder the groups are given), not from its output.
Starting, killing and stopping the processes is ``torchtitan.tools.cluster``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.config.job_config import ConfigError
from torchtitan.config.job_config import JobConfig as CoreJobConfig
from torchtitan.config.manager import flag_value, load_toml
from torchtitan.experiments.fault_tolerance.sync.lineage import job_model
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


def say(prefix: str, line: str) -> None:
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


class Supervisor:
    """Runs the job ``args`` describe (``launcher.parse_args``); ``logs``: where the groups'
    output passes through."""

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
            groups_per_site=getattr(args, "groups_per_site", 1),
        )
        self.dump_folder = groups_dump_folder(args.train_args)
        self.step_kills = StepKills(args.kill)
        self.restarts = Restarts(args.restart_after)

    # ---- processes -----------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        address = self.job.start_lighthouse()
        lighthouse = self.job.lighthouse
        assert lighthouse is not None
        say("[launcher]", f"lighthouse at {address} (pid {lighthouse.pid})")
        per_site = self.job.groups_per_site
        for site in range(self.args.groups // per_site if per_site > 1 else 0):
            found = self.job.start_site_lighthouse(site)
            first = site * per_site
            say("[launcher]", f"site {site} (groups {first}..{first + per_site - 1}): "
                f"lighthouse at {found}")  # fmt: skip
        if self.args.show_lighthouse:
            threading.Thread(target=self._show_lighthouse, args=(lighthouse,), daemon=True).start()

    def _show_lighthouse(self, lighthouse: Process) -> None:
        lines = lighthouse.lines()
        for line in lines:  # its start-up, up to the line that gave its address, stays quiet
            if "listening on" in line:
                break
        for line in lines:
            say("[lighthouse]", line)

    def start_group(self, group: Group) -> None:
        # Made before the start: what the file holds by then is an earlier start's (or an
        # earlier job's, in a dump folder used before), never this start's.
        steps = self.step_events(group)
        group.process = self.job.start_group(group.replica_id)
        group.steps = steps
        group.steps_this_start = 0
        what = "started" if group.restarts == 0 else f"restarted (#{group.restarts})"
        say("[launcher]", f"group {group.replica_id} {what}, pid {group.process.pid}")
        group.follower = threading.Thread(
            target=self._follow, args=(group, group.process), daemon=True
        )
        group.follower.start()

    def step_events(self, group: Group) -> EventTail:
        """Follows the group's rank 0 event file from its current end."""
        return EventTail(event_file_path(self.dump_folder, group.replica_id, 0))

    def _follow(self, group: Group, process: Process) -> None:
        for line in process.lines():
            say(f"[group {group.replica_id}]", line)

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
        say("[launcher]", f"SIGKILL group {group.replica_id} {why}; "
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
            say("[launcher]", f"FAILED: group(s) {failed}")
            return 1
        restarts = sum(g.restarts for g in self.groups)
        say("[launcher]", f"all {len(self.groups)} groups finished ({restarts} restart(s))")
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
            say("[launcher]", f"final models: group(s) {sorted(finals)} identical (digest "
                   f"{finals[chosen]['digest']})")  # fmt: skip
            return
        for replica, fields in sorted(finals.items()):
            shared = fields["last_shared_sync"]
            say("[launcher]", f"final model of group {replica}: digest {fields['digest']}, "
                   f"last sync shared with other groups #{shared}, {fields['solo_syncs']} sync(s) "
                   "alone since")  # fmt: skip
        say("[launcher]", f"final models DIFFER: the job's model is group {chosen}'s (the "
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
                say("[launcher]", f"group {group.replica_id}: the job finished before it "
                       "rejoined; stopped")  # fmt: skip
            return
        if group.follower.is_alive():
            return  # its last lines are printed before what the launcher says about its exit
        if group.process.killed_at is not None:
            if others_finished:
                group.done = True
                self.restarts.cancel(group.replica_id)
                say("[launcher]", f"group {group.replica_id}: not restarted, the other "
                       "groups finished the job")  # fmt: skip
            elif self.restarts.due(group.replica_id, now):
                self.restarts.cancel(group.replica_id)
                group.restarts += 1
                self.start_group(group)
            return
        if code == 0:
            group.done = True
            say("[launcher]", f"group {group.replica_id} finished")
        else:
            group.failed = True
            say("[launcher]", f"group {group.replica_id} exited with code {code}")
            if any(not g.done and not g.failed for g in self.groups):
                say("[launcher]", f"the other groups go on without group {group.replica_id}")


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
