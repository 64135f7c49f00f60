"""Async DiLoCo's periods under DyLU: how many inner steps each takes (``dylu.PeriodPlan``,
planned in each sync quorum), the corrections within a period, and the speed probe that plans
the job's first period."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torchtitan.experiments.fault_tolerance.dylu import PeriodPlan
from torchtitan.experiments.fault_tolerance.outer_loop import Quorums

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync_quorum import ProbeInFlight, SyncManager


class DyLUPeriods:
    """The period planning of :class:`~.async_diloco.AsyncDiLoCo`, which builds the attributes
    below."""

    manager: SyncManager
    _local_step: int
    #: The current period's inner steps (``period`` unless DyLU planned others).
    plan: PeriodPlan
    #: Seconds on the model's device, for DyLU (each reading waits for the device).
    clock: Callable[[], float]
    #: The most of this group's ranks' numbers (a MAX all-reduce over the group).
    agree_in_group: Callable[[int], int]
    #: DyLU's speed probe while its quorum forms (None: none under way).
    _probe: ProbeInFlight | None

    def _plan_after_step(self, quorums: Quorums) -> None:
        """After each inner step: probe, take the probe's plan or correct the period's step
        count where due, and let peers read the state for a heal unless a probe is under way."""
        self.plan.skip_warm_up(self._local_step, self.clock)
        if self.plan.probe_due(self._local_step, self.clock):
            # DyLU's first period: the groups exchange speeds in a quorum that forms while they
            # go on training (else the fast groups would wait for the slow ones' first steps).
            self._probe = quorums.start_probe()
        elif self._probe is not None:
            # Every rank takes the plan at the same inner step: once all are done, or at the
            # end of the period as it stands (the plan may lengthen it).
            done = self.agree_in_group(int(not self._probe.done())) == 0
            if self._local_step >= self.plan.steps:
                # This group's speed in the period, before it waits for the probe here.
                self.plan.measure(self._local_step, self.clock())
                self._finish_probe()
            elif done:
                self._finish_probe()
        elif self.plan.due_correction(self._local_step):
            self.plan.correct(self._local_step, self.clock(), self.agree_in_group)
        if self._probe is None:
            # Not while the probe's quorum forms: a peer would read the state from that
            # quorum's thread while the model runs.
            self.manager.allow_state_dict_read()

    def _finish_probe(self) -> None:
        """Wait for DyLU's speed probe under way, if any, and take its plan (a peer healing in
        its quorum reads this group's state meanwhile)."""
        probe, self._probe = self._probe, None
        if probe is not None:
            self.manager.allow_state_dict_read()
            probe.finish()

    def step_seconds(self) -> float:
        """This group's seconds per inner step in its last period (0: no period yet)."""
        return self.plan.step_seconds

    def plan_period(self, steps: int, seconds: float = 0.0) -> None:
        """The next period takes ``steps`` inner steps; with ``seconds`` (its planned length)
        the group corrects the count by its speed so far halfway through, then halfway through
        what is left (``PeriodPlan``): a group's speed varies within a period too."""
        self.plan.plan(steps, seconds)

    def plan_rest_of_period(self, steps: int, seconds: float) -> None:
        """After the speed probe: ``steps`` more inner steps in this period, in ``seconds``."""
        self.plan.plan_rest(self._local_step, steps, seconds, self.clock())

    def probe_unused(self) -> None:
        """The speed probe planned nothing: the period goes on as planned."""
        self.plan.time_from(self._local_step, self.clock())

    def steps_this_period(self) -> int:
        return self.plan.steps
