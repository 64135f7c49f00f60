"""A custom args module for fault tests: the semi-sync experiment's config, plus fault-injection
knobs, and trainers with them (the semi-sync trainer with a ``semi_sync_method``, the core trainer
without), so that a test can SIGKILL a group at a chosen point.

Steps and syncs of a tiny model last milliseconds, too short to hit with a signal from outside.
With ``--fault_injection.stall_after_quorum=N`` the group stops for ``stall_seconds`` right after
its N-th sync quorum: it is then in the replica process group with its peers, whose all-reduce of
that sync waits for its contribution; killing it there is a death in the middle of a sync. With
``--fault_injection.stall_after_step=S`` it stops after step S (between two inner steps).
``--fault_injection.pause_file=PATH`` holds the group between two steps while PATH exists (it
stays alive and heartbeating), so a test can keep a survivor from running out of steps while a
killed peer restarts. ``--fault_injection.hold_before_sync_file=PATH`` holds it at each sync
point, before it asks for the sync's quorum, while PATH exists. ``--fault_injection.step_sleep_s``
stretches every step (periods of seconds instead of milliseconds), and
``--fault_injection.corrupt_global_after_sync=K`` changes one number of this group's DiLoCo global
copy after its sync K (the agreement check must catch it), ``--fault_injection.nan_in_sync=K``
puts a NaN into what it sends in sync K, and ``--fault_injection.corrupt_heal_history_sync=K``
damages this group's heal-history entry of sync K. As the peer of a replay,
``--fault_injection.damage_replay_payload=N`` damages the N-th average it sends (on the wire,
not in its history), and ``--fault_injection.exit_serving_replay_after=N`` exits the process
once it has sent N averages; ``--fault_injection.heal_send_sleep_s`` paces every heal it serves.
``--fault_injection.freeze_inner_steps`` runs every inner step at learning rate 0.

The step-level knobs (``stall_after_step``, ``pause_file``, ``step_sleep_s``) work with both
trainers; the sync-level ones with the semi-sync trainer only. Use with
``--job.custom_args_module=tests.integration_tests.faults``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig as CoreJobConfig
from torchtitan.experiments.fault_tolerance.heal.exchange import HealAnswer
from torchtitan.experiments.fault_tolerance.heal.history import HistoryEntry
from torchtitan.experiments.fault_tolerance.job_config import JobConfig as SemiSyncJobConfig
from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
from torchtitan.tools.events import EventKind
from torchtitan.trainer import Trainer

STALLING_TRAINER = "tests.integration_tests.faults:StallingTrainer"
FAULTY_CORE_TRAINER = "tests.integration_tests.faults:FaultyTrainer"


def trainer_for(config: CoreJobConfig) -> str:
    return STALLING_TRAINER if config.fault_tolerance.semi_sync_method else FAULTY_CORE_TRAINER


# What the knobs did, as events (``torchtitan.tools.events``) a test can wait for.
STALLED_IN_SYNC = EventKind(
    "fault.stalled_in_sync",
    "[fault-injection] stalling inside sync (quorum {quorum}, {groups} groups) for {seconds:.0f}s",
)
STALLED_AFTER_STEP = EventKind(
    "fault.stalled_after_step", "[fault-injection] stalling after step {step}"
)
PAUSED = EventKind("fault.paused", "[fault-injection] paused after step {step}")
RESUMED = EventKind("fault.resumed", "[fault-injection] resumed")
HELD_BEFORE_SYNC = EventKind(
    "fault.held_before_sync", "[fault-injection] holding before sync #{sync}"
)
RELEASED = EventKind("fault.released", "[fault-injection] released")
NAN_INJECTED = EventKind(
    "fault.nan_injected", "[fault-injection] a NaN in this group's pseudo-gradient of sync #{sync}"
)
CORRUPTED = EventKind(
    "fault.corrupted_global_copy", "[fault-injection] corrupted the global copy after sync #{sync}"
)
HISTORY_CORRUPTED = EventKind(
    "fault.corrupted_heal_history",
    "[fault-injection] corrupted the heal history entry of sync #{sync}",
)
REPLAY_PAYLOAD_DAMAGED = EventKind(
    "fault.damaged_replay_payload", "[fault-injection] damaged average {index} of a replay sent"
)
EXITING_SERVING_REPLAY = EventKind(
    "fault.exiting_serving_replay",
    "[fault-injection] exiting after sending {sent} averages of a replay",
)


@dataclass
class FaultInjection:
    """Test-only faults."""

    stall_after_quorum: int = 0
    """Stall right after this process's N-th quorum (1-based), before the sync's all-reduce.
    0: never."""

    stall_after_step: int = 0
    """Stall after this training step (and its checkpoint, if one is due). 0: never."""

    stall_seconds: float = 120.0
    """How long the stall lasts (the test kills the group during it)."""

    pause_file: str = ""
    """While this file exists, wait after each step. Empty: never."""

    hold_before_sync_file: str = ""
    """While this file exists, wait at each sync point before asking for its quorum."""

    step_sleep_s: float = 0.0
    """Sleep this long after every step (a longer period)."""

    corrupt_global_after_sync: int = 0
    """After this group's sync K (the first time it gets there), add 1e-3 to one element of its
    DiLoCo global copy. 0: never."""

    fail_syncs_from: int = 0
    """From sync K on, this group fails every sync after its all-reduce (its commit says no).
    0: never."""

    nan_in_sync: int = 0
    """Put a NaN into the first tensor this group hands to the all-reduce of sync K (a
    pseudo-gradient, or LocalSGD's parameters). 0: never."""

    corrupt_heal_history_sync: int = 0
    """Once this group has kept sync K in its heal history, change one byte of that entry (as
    a fault in memory would): a joiner must never be served it. 0: never."""

    damage_replay_payload: int = 0
    """Serving a replay, change one byte of the N-th average sent (1-based; its history keeps
    it intact), as a fault on the wire would. 0: never."""

    damage_replay_payload_rank: int = -1
    """Only this rank of the group damages what it serves (``damage_replay_payload``): the
    joiner's other ranks replay in full. -1: every rank."""

    exit_serving_replay_after: int = 0
    """Serving a replay, exit the process (status 3) once N averages were sent and had time to
    arrive: a peer that dies in the middle of a replay. 0: never."""

    heal_send_sleep_s: float = 0.0
    """Serving a heal, sleep this long before each tensor it sends: a slow link, so that a heal
    outlasts the process group's own timeout. 0: never."""

    freeze_inner_steps: bool = False
    """Every inner optimizer step runs at learning rate 0 and leaves the model as it was: the
    syncs then depend only on the state the group started from (a checkpoint's), whatever
    its host's kernels compute in the forward and backward passes."""


@dataclass
class JobConfig(SemiSyncJobConfig):
    fault_injection: FaultInjection = field(default_factory=FaultInjection)


class StepFaults:
    """The step-level knobs, for any trainer (mixed in before it)."""

    faults: FaultInjection
    train_state: Any

    def after_step(self, result: Any) -> None:
        super().after_step(result)
        if self.faults.step_sleep_s > 0:
            time.sleep(self.faults.step_sleep_s)
        if self.train_state.step == self.faults.stall_after_step:
            STALLED_AFTER_STEP.emit(step=self.train_state.step)
            time.sleep(self.faults.stall_seconds)
        pause = Path(self.faults.pause_file) if self.faults.pause_file else None
        if pause is not None and pause.exists():
            PAUSED.emit(step=self.train_state.step)
            while pause.exists():
                time.sleep(0.1)
            RESUMED.emit(step=self.train_state.step)


def _at_learning_rate_zero(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.0


class _ExitAfter(list):
    """A replay's averages that end the process when the peer reaches the one after the first
    ``after`` (sent by then: the joiner posted every receive, so they left at once)."""

    def __init__(self, payloads: list[torch.Tensor], after: int) -> None:
        super().__init__(payloads)
        self.after = after

    def __iter__(self) -> Any:
        for index, payload in enumerate(list.__iter__(self)):
            if index == self.after:
                EXITING_SERVING_REPLAY.emit(sent=index)
                time.sleep(2.0)  # the sends posted so far reach the joiner
                os._exit(3)
            yield payload


class FaultyTrainer(StepFaults, Trainer):
    """The core trainer (synchronous FT) with the step-level knobs."""

    def __init__(self, job_config: CoreJobConfig) -> None:
        super().__init__(job_config)
        self.faults = job_config.fault_injection  # type: ignore[attr-defined]


class StallingTrainer(StepFaults, SemiSyncTrainer):
    def __init__(self, job_config: CoreJobConfig) -> None:
        super().__init__(job_config)
        self.faults: FaultInjection = job_config.fault_injection  # type: ignore[attr-defined]
        sync_rounds = self.sync.sync_rounds
        quorums = 0

        @contextlib.contextmanager
        def sync_rounds_with_faults() -> Iterator[Any]:
            nonlocal quorums
            hold = (
                Path(self.faults.hold_before_sync_file)
                if self.faults.hold_before_sync_file
                else None
            )
            manager = self.ft.manager  # type: ignore[union-attr]
            if hold is not None and hold.exists():
                HELD_BEFORE_SYNC.emit(sync=manager.current_step() + 1)
                while hold.exists():
                    time.sleep(0.1)
                RELEASED.emit(sync=manager.current_step() + 1)
            with sync_rounds() as rounds:
                yield rounds
            quorums += 1
            if quorums == self.faults.stall_after_quorum:
                STALLED_IN_SYNC.emit(
                    quorum=quorums,
                    groups=manager.num_participants(),
                    seconds=self.faults.stall_seconds,
                )
                time.sleep(self.faults.stall_seconds)

        self.sync.sync_rounds = sync_rounds_with_faults  # type: ignore[method-assign]
        decide = self.sync.decide

        def decide_with_faults() -> Any:
            first = self.faults.fail_syncs_from
            if first and self.sync.current_step() + 1 >= first:
                self.ft.manager.report_error(RuntimeError("injected sync failure"))
            return decide()

        self.sync.decide = decide_with_faults  # type: ignore[method-assign]
        allreduce = self.sync.allreduce
        poisoned: set[int] = set()

        def allreduce_with_faults(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            sync = self.sync.current_step() + 1  # a follower of its site: its leader's
            if sync == self.faults.nan_in_sync and sync not in poisoned and not kwargs.get("exact"):
                poisoned.add(sync)
                tensor.view(-1)[0] = float("nan")
                NAN_INJECTED.emit(sync=sync)
            return allreduce(tensor, *args, **kwargs)

        self.sync.allreduce = allreduce_with_faults  # type: ignore[method-assign]
        self._corrupted = False
        report = self.reporter.report

        def report_with_faults(step: int) -> None:
            report(step)
            self._corrupt_after_report()

        self.reporter.report = report_with_faults  # type: ignore[method-assign]
        history = self.heal.history
        record = history.record

        def record_with_faults(entry: HistoryEntry) -> None:
            record(entry)
            if entry.sync == self.faults.corrupt_heal_history_sync:
                (kept,) = history.after(entry.sync - 1)
                kept.transfers[0].payload.view(torch.uint8)[0] ^= 0xFF
                HISTORY_CORRUPTED.emit(sync=entry.sync)

        history.record = record_with_faults  # type: ignore[method-assign]
        if self.faults.damage_replay_payload or self.faults.exit_serving_replay_after:
            answer = self.heal.answer

            def answer_with_faults(*args: Any, **kwargs: Any) -> HealAnswer:
                served = answer(*args, **kwargs)
                payloads = list(served.payloads)
                n = self.faults.damage_replay_payload
                rank = self.faults.damage_replay_payload_rank
                if 0 < n <= len(payloads) and rank in (-1, self.parallel_dims.rank):
                    payloads[n - 1] = payloads[n - 1].clone()
                    payloads[n - 1].view(torch.uint8)[0] ^= 0xFF
                    REPLAY_PAYLOAD_DAMAGED.emit(index=n)
                after = self.faults.exit_serving_replay_after
                if 0 < after < len(payloads):
                    payloads = _ExitAfter(payloads, after)
                return HealAnswer(served.state, payloads)

            self.heal.answer = answer_with_faults  # type: ignore[method-assign]

        if self.faults.heal_send_sleep_s:
            self._pace_heals(self.faults.heal_send_sleep_s)
        if self.faults.freeze_inner_steps:
            # Before every step, after the schedule set the step's rate: p - 0 x update = p.
            self.optimizer.register_step_pre_hook(_at_learning_rate_zero)

    def _pace_heals(self, seconds: float) -> None:
        """Once the torchft Manager exists, sleep before each tensor its heal transport sends."""
        build = self.ft._build_manager  # type: ignore[union-attr]

        def build_paced(transport: Any) -> Any:
            manager = build(transport)
            group = manager._checkpoint_transport._pg  # the heal's PiecewiseGroup
            send = group.send

            def paced(*args: Any, **kwargs: Any) -> Any:
                time.sleep(seconds)
                return send(*args, **kwargs)

            group.send = paced
            return manager

        self.ft._build_manager = build_paced  # type: ignore[union-attr]

    def _corrupt_after_report(self) -> None:
        sync = self.sync.current_step()
        # Once: a group that steps back after the agreement check is at sync K again.
        corrupt = sync == self.faults.corrupt_global_after_sync and not self._corrupted
        if corrupt and self.method == "diloco":
            self._corrupted = True
            first = next(iter(self.algorithm.global_parameters(0).values()))
            first.view(-1)[0] += 1e-3
            CORRUPTED.emit(sync=sync)
