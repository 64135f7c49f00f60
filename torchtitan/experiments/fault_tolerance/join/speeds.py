"""DyLU's part of the quorum exchange: each group's speed in its record, the next period's plan
from everyone's, and the speed probe of a new job's first period.

Every member plans from the same exchanged speeds, so the plans fit together; the group's ranks
then take the most any of them planned. A new job's first period has no speeds: the groups
agree in their start-up quorum to time the ``dylu_probe_steps`` inner steps after the first and
exchange those speeds in a non-sync quorum (:meth:`SpeedExchange.on_probe`) that forms while
they train on, then plan the rest of the period (:meth:`SpeedExchange.after_probe`). If a group
restarts and meets the probe, it joins at the first sync point instead, and the probing groups
finish the period unplanned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchtitan.components.ft import FTManager
from torchtitan.components.ft.streams import side_stream
from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.methods.dylu import (
    DyLUPeriods,
    dylu_inner_steps,
    dylu_period_seconds,
)
from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.sync.quorum import (
    FRESH,
    RUNNING,
    Member,
    RankInGroup,
    exchange,
)

if TYPE_CHECKING:
    from torchtitan.trainer import TrainState


class SpeedExchange:
    """DyLU's plans of one rank of a replica group, made in the quorums of ``method``."""

    def __init__(
        self,
        method: DyLUPeriods,
        probe_steps: int,
        ft: FTManager,
        train_state: TrainState,
        rank: RankInGroup,
    ) -> None:
        self.method = method
        self.period = method.period
        self.probe_steps = probe_steps
        self.ft = ft
        self.train_state = train_state
        self.rank = rank
        #: The groups of the start-up quorum that decided the probe (all must be in it).
        self._probe_groups = 0
        #: What the probe's exchange found, until the training thread plans from it.
        self._probed: ProbeFound | None = None
        #: Seconds, for the time between the probe's exchange and its plan (tests set it).
        self.clock: Callable[[], float] = time.perf_counter

    def step_us(self, role: int) -> int:
        """This group's microseconds per inner step in its last period, for its record as a
        member in ``role``. A start-up quorum decides the probe afresh."""
        if role != RUNNING:
            self.method.plan.cancel_probe()
        return round(self.method.step_seconds() * 1e6)

    def planned_steps(self, members: list[Member], mine: Member) -> int:
        """This group's inner steps in the next period, from every member's speed."""
        return dylu_inner_steps(self.period, _speeds(members), mine.step_us / 1e6)

    def plan(self, steps: int, members: list[Member], mine: Member) -> None:
        """The next period takes ``steps`` (agreed by the group's ranks), in the length the
        speeds give it (logged when the count changes)."""
        speeds = _speeds(members)
        if steps != self.method.steps_this_period():
            events.INNER_STEPS_PLANNED.emit(
                step=self.train_state.step,
                steps=steps,
                period=self.period,
                ms_per_step=mine.step_us / 1e3,
                fastest_ms_per_step=min((s for s in speeds if s > 0), default=0.0) * 1e3,
            )
        self.method.plan.plan(steps, dylu_period_seconds(self.period, speeds))

    def probe_if_new_job(self, members: list[Member]) -> None:
        """In an accepted start-up quorum: a new job (every member fresh, more than one) probes
        its groups' speeds in its first period."""
        if self.probe_steps and len(members) > 1 and all(m.role == FRESH for m in members):
            self.method.plan.probe_after(self.probe_steps)
            self._probe_groups = len(members)

    def start_probe(self) -> ProbeInFlight:
        """The speed probe: its quorum and exchange (:meth:`on_probe`) in a thread of their
        own while this group trains on; ``ProbeInFlight.finish`` then plans the rest of the
        period (:meth:`after_probe`)."""
        return ProbeInFlight(self._probe_quorum, self.after_probe)

    def _probe_quorum(self) -> None:
        with self.method.sync.probe_rounds() as rounds:
            rounds.form()
            self.on_probe()  # the quorum is used either way

    def on_probe(self) -> None:
        """The probe's exchange, on the probe's own thread while the group trains on: every
        group's speed up to the probe, and the rest of the first period's length planned from
        them, from when the exchange ended. Kept for :meth:`after_probe`."""
        method = self.method
        # Read now: the training thread may end the period meanwhile and measure all of it.
        mine = Member(RUNNING, probe=1, step_us=round(method.plan.probed_seconds * 1e6))
        members = exchange(self.ft.manager, mine, self.rank.device)
        usable = (
            members is not None
            and len(members) == self._probe_groups
            and all(m.probe for m in members)
        )
        taken, speeds = method.plan.probed_after, _speeds(members or [])
        rest = self.period - taken
        self._probed = ProbeFound(
            usable=usable,
            after=taken,
            seconds=dylu_period_seconds(rest, speeds) if usable else 0.0,
            step_seconds=mine.step_us / 1e6,
            fastest=min(speeds, default=0.0),
            at=self.clock(),
        )

    def after_probe(self) -> None:
        """In the training thread, once the probe's quorum is done (all the group's ranks at
        the same inner step): plan the rest of the first period, the planned length left since
        the exchange ended at this group's speed (possibly no steps at the period's end). If any
        rank of the group found the probe unusable (not the start-up quorum's groups: one
        restarted or is missing), the period goes on as planned in every group, its speed
        measured from here on."""
        method = self.method
        found, self._probed = self._probed, None
        taken = method.local_step()
        over = taken >= method.steps_this_period()
        usable = found is not None and found.usable
        seconds, steps = 0.0, 0
        if usable:
            assert found is not None
            seconds = max(0.0, found.seconds - (self.clock() - found.at))
            if found.step_seconds > 0:
                steps = round(seconds / found.step_seconds)
                # Mid-period at least one more step; at its end, none if no time is left.
                steps = steps if over else max(1, steps)
            usable = steps > 0
        # Each rank exchanged with its own peers, so their plans differ a little; all take the
        # most, so the corrections fall at the same steps on all.
        unusable, steps, us = self.rank.most([int(not usable), steps, round(seconds * 1e6)])
        usable, seconds = not unusable, us / 1e6
        if not usable:
            method.probe_unused()
            return
        assert found is not None
        method.plan_rest_of_period(steps, seconds)
        events.SPEED_PROBE.emit(
            step=self.train_state.step,
            after=found.after,
            planned_at=taken,
            steps=method.steps_this_period(),
            period=self.period,
            ms_per_step=found.step_seconds * 1e3,
            fastest_ms_per_step=found.fastest * 1e3,
        )


class ProbeInFlight:
    """DyLU's speed probe under way: ``run`` (its quorum and exchange) in a daemon thread while
    the training thread takes its inner steps. Nothing else uses the replica process group
    meanwhile: the first period has no sync, and the next quorum waits for this one. A peer
    that heals in the probe's quorum reads this group's state only while the training thread
    waits in :meth:`finish` (async DiLoCo disallows reads until then)."""

    def __init__(self, run: Callable[[], None], after: Callable[[], None]) -> None:
        self._after = after
        self._error: BaseException | None = None
        # A new thread starts on device 0: torchft's quorum takes the caller's device.
        accelerator = torch.accelerator.is_available()
        device = torch.accelerator.current_device_index() if accelerator else None
        self._thread = threading.Thread(
            target=self._run, args=(run, device), name="dylu-speed-probe", daemon=True
        )
        self._thread.start()

    def _run(self, run: Callable[[], None], device: int | None) -> None:
        try:
            if device is not None:
                torch.accelerator.set_device_index(device)
            on = torch.device("cpu") if device is None else torch.device(device)
            # Not the training stream (every thread starts on it): on nccl the next inner
            # step would otherwise wait for every probing group's exchange.
            with side_stream(on):
                run()
        except BaseException as e:  # raised in the training thread, by finish()
            self._error = e

    def done(self) -> bool:
        """Whether the probe's quorum and exchange are over (this rank's)."""
        return not self._thread.is_alive()

    def finish(self) -> None:
        """Wait for the probe, raise what it raised (e.g. its quorum timed out), then run
        ``after`` in the training thread."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._after()


@dataclass(frozen=True)
class ProbeFound:
    """What the speed probe's exchange found, for the training thread to plan from."""

    #: Whether the probe was the start-up quorum's groups, all probing.
    usable: bool
    #: The inner step after which this group probed.
    after: int
    #: The planned length of the rest of the period from ``at`` (0: not usable).
    seconds: float
    #: This group's and the fastest group's seconds per inner step in the probe's steps.
    step_seconds: float
    fastest: float
    #: When the exchange ended (``time.perf_counter``).
    at: float


def _speeds(members: list[Member]) -> list[float]:
    """Every member's seconds per inner step (0: not measured)."""
    return [m.step_us / 1e6 for m in members]


def build_speed_exchange(
    job_config: JobConfig,
    loop: OuterLoop,
    ft_manager: FTManager,
    train_state: TrainState,
    rank: RankInGroup,
) -> SpeedExchange | None:
    """DyLU's plans, made in the quorums of async DiLoCo (None: no DyLU)."""
    ft = semi_sync_config(job_config)
    if not ft.dynamic_local_steps:
        return None
    assert isinstance(loop, DyLUPeriods), "the config allows DyLU with async DiLoCo only"
    return SpeedExchange(loop, ft.dylu_probe_steps, ft_manager, train_state, rank)
