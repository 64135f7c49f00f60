"""DyLU's part of the quorum exchange: each group's speed in its record, the next period's plan
from everyone's, and the speed probe of a new job's first period.

Every member of a quorum computes the plan from the same exchanged speeds, so the plans fit
together (:func:`~.dylu.dylu_inner_steps`); the group's ranks then take the most any of them
planned. The first period of a new job has no speeds to plan from: the groups agree in their
start-up quorum to time the ``dylu_probe_steps`` inner steps after the first and exchange
those speeds in a quorum of its own that is no sync (:meth:`SpeedExchange.on_probe`). A group
that restarts meanwhile and meets the probe does not use that quorum (it joins at the first
sync point), and the probing groups then finish the period unplanned, as without the probe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from torchtitan.components.ft import FTManager
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.async_diloco import AsyncDiLoCo
from torchtitan.experiments.fault_tolerance.dylu import dylu_inner_steps, dylu_period_seconds
from torchtitan.experiments.fault_tolerance.sync_quorum import FRESH, RUNNING, Member, exchange

if TYPE_CHECKING:
    from torchtitan.trainer import TrainState


class SpeedExchange:
    """DyLU's plans of one rank of a replica group, made in the quorums of ``method``."""

    def __init__(
        self,
        method: AsyncDiLoCo,
        probe_steps: int,
        ft: FTManager,
        train_state: TrainState,
        device: torch.device,
        group_ranks: int,
        most_in_group: Callable[[list[int]], list[int]],
    ) -> None:
        self.method = method
        self.period = method.period
        self.probe_steps = probe_steps
        self.ft = ft
        self.train_state = train_state
        self.device = device
        self.group_ranks = group_ranks
        self.most_in_group = most_in_group
        #: The groups of the start-up quorum that decided the probe (all must be in it).
        self._probe_groups = 0

    def fill(self, mine: Member) -> None:
        """This group's microseconds per inner step in its last period, into its record. A
        start-up quorum decides the probe afresh: none is due until one that is used does."""
        mine.step_us = round(self.method.step_seconds() * 1e6)
        if mine.role != RUNNING:
            self.method.plan.probe_at = None

    def planned_steps(self, members: list[Member], mine: Member) -> int:
        """This group's inner steps in the next period, from every member's speed."""
        return dylu_inner_steps(self.period, _speeds(members), mine.step_us / 1e6)

    def plan(self, steps: int, members: list[Member], mine: Member) -> None:
        """The next period takes ``steps`` (the group's ranks agreed), in the length the
        speeds give it (said in the log when the count changes)."""
        speeds = _speeds(members)
        if steps != self.method.steps_this_period():
            events.INNER_STEPS_PLANNED.emit(
                step=self.train_state.step,
                steps=steps,
                period=self.period,
                ms_per_step=mine.step_us / 1e3,
                fastest_ms_per_step=min((s for s in speeds if s > 0), default=0.0) * 1e3,
            )
        self.method.plan_period(steps, dylu_period_seconds(self.period, speeds))

    def probe_if_new_job(self, members: list[Member]) -> None:
        """In an accepted start-up quorum: a new job (every member fresh, more than one) probes
        its groups' speeds in its first period."""
        if self.probe_steps and len(members) > 1 and all(m.role == FRESH for m in members):
            self.method.plan.probe_after(self.probe_steps)
            self._probe_groups = len(members)

    def on_probe(self) -> bool:
        """The probe's exchange (the sync Manager runs it in the probe's quorum): every group's
        speed in its steps so far, and the rest of the first period planned from them as a
        sync quorum plans a period. Unless it is not the start-up quorum's groups (one
        restarted meanwhile and is starting, or one is missing: the lighthouse did not wait
        for it): then the period goes on as planned, in every group alike (the group's ranks
        agree first), and its speed is measured from here on."""
        method = self.method
        mine = Member(RUNNING, probe=1)
        self.fill(mine)
        members = exchange(self.ft.manager, mine, self.device)
        usable = (
            members is not None
            and len(members) == self._probe_groups
            and all(m.probe for m in members)
        )
        taken, speeds = method.local_step(), _speeds(members or [])
        rest = self.period - taken
        steps = dylu_inner_steps(rest, speeds, mine.step_us / 1e6) if usable else 0
        if self.group_ranks > 1:
            unusable, steps = self.most_in_group([int(not usable), steps])
            usable = not unusable
        if not usable:
            method.probe_unused()
            return True
        events.SPEED_PROBE.emit(
            step=self.train_state.step,
            after=taken,
            steps=taken + steps,
            period=self.period,
            ms_per_step=mine.step_us / 1e3,
            fastest_ms_per_step=min(speeds) * 1e3,
        )
        method.plan_rest_of_period(steps, dylu_period_seconds(rest, speeds))
        return True


def _speeds(members: list[Member]) -> list[float]:
    """Every member's seconds per inner step (0: not measured)."""
    return [m.step_us / 1e6 for m in members]
