"""DyLU (arXiv 2401.09135): how many inner steps each group takes per period, so that the groups
reach the sync point at about the same time, and when a group corrects that within a period.
Arithmetic on the groups' measured seconds per inner step; :class:`PeriodPlan`, one group's
plan of its current period; and :class:`DyLUPeriods`, async DiLoCo's periods under DyLU (the
corrections and the speed probe), planned in the quorums (``join.speeds``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.methods.outer_loop import Probe, Quorums
    from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum


def dylu_inner_steps(period: int, step_seconds: list[float], mine: float) -> int:
    """This group's inner steps for the next period. ``step_seconds``: every group's seconds
    per inner step in its last period (0: not measured, e.g. just (re)started); ``mine``: this
    group's.

    Every group takes the whole steps closest to the period's length
    (:func:`dylu_period_seconds`, at most ``2 * period``), so a group waits at most about half
    its own step for the others. Unmeasured groups take ``period`` steps."""
    length = dylu_period_seconds(period, step_seconds)
    if mine <= 0 or length <= 0:
        return period
    return max(1, min(2 * period, round(length / mine)))


def dylu_period_seconds(period: int, step_seconds: list[float]) -> float:
    """The wall-clock length DyLU gives the next period: the slowest group's whole steps
    closest to the time the fastest needs for ``period`` steps (0: nobody measured yet)."""
    measured = [s for s in step_seconds if s > 0]
    if not measured:
        return 0.0
    fastest, slowest = min(measured), max(measured)
    return max(1, round(period * fastest / slowest)) * slowest


def dylu_steps_to_deadline(taken: int, elapsed: float, length: float, period: int) -> int:
    """The inner steps this period should take in all to end closest to ``length`` seconds
    after it began, ``taken`` done in ``elapsed`` seconds (at least ``taken``, at most ``2 *
    period``): this period's speed corrects the plan made from the last."""
    if taken <= 0 or elapsed <= 0:
        return max(1, taken)
    remaining = round((length - elapsed) * taken / elapsed)
    return max(taken, min(2 * period, taken + remaining))


def dylu_next_correction(taken: int, planned: int) -> int | None:
    """The inner step at which DyLU next corrects a period of ``planned`` steps, ``taken`` of
    them done: halfway through what is left (None once fewer than 2 are left). For 20 steps
    on plan: after steps 10, 15, 17, 18 and 19."""
    left = planned - taken
    return taken + left // 2 if left >= 2 else None


class PeriodPlan:
    """How many inner steps this group's current period takes, and when it corrects that.

    Without DyLU every period takes ``period`` steps. With it, each sync quorum plans the next
    period (:meth:`plan`) from the exchanged speeds, and the group corrects the count by its
    speed so far at the steps :func:`dylu_next_correction` names. The first period may be
    planned by a *speed probe* (:meth:`plan_rest`). The process's first inner step (compilation,
    warm-up) is left out of every measurement (:meth:`skip_warm_up`) but still counts against
    the planned length.

    Times are seconds on the device's timeline (``step_clock.StepClock``). Reading that clock
    waits for the device, so methods called after every inner step take a clock and read it
    only when they use the time.
    """

    def __init__(self, period: int) -> None:
        self.period = period
        #: Inner steps of the current period in all.
        self.steps = period
        #: The planned part's length in seconds (0: none), and the next correction's step.
        self._seconds = 0.0
        self._correct_at: int | None = None
        #: When the planned part began (None: not in this process), and the steps before it.
        self._began: float | None = None
        self._planned_from = 0
        #: The step after which to probe (None: none due), the last probe's, and its speed.
        self.probe_at: int | None = None
        self.probed_after = 0
        self.probed_seconds = 0.0
        #: Whether this process has taken its first inner step (see :meth:`skip_warm_up`).
        self._warm = False
        #: This group's seconds per inner step in its last period (or in the probe's steps).
        self.step_seconds = 0.0

    def begin(self, now: float) -> None:
        """A period begins (at inner step 0)."""
        self._began, self._planned_from = now, 0

    def end(self, taken: int, now: float) -> None:
        """The period ends after ``taken`` inner steps: measure this group's speed in it."""
        self.measure(taken, now)
        self.probe_at = None

    def measure(self, taken: int, now: float) -> None:
        """This group's seconds per inner step since the planned part of the period began."""
        steps = taken - self._planned_from
        if self._began is not None and steps > 0:
            self.step_seconds = (now - self._began) / steps

    def plan(self, steps: int, seconds: float = 0.0) -> None:
        """The next period takes ``steps`` inner steps; with ``seconds`` (its planned length)
        the count is corrected halfway through it, then halfway through what is left."""
        if not 1 <= steps <= 2 * self.period:
            raise ValueError(f"a period takes 1 to {2 * self.period} inner steps, not {steps}")
        self.steps, self._seconds = steps, seconds
        self._correct_at = dylu_next_correction(0, steps) if seconds > 0 else None

    def probe_after(self, steps: int) -> None:
        """Probe this group's speed in the ``steps`` inner steps after the first of the
        current period (when at least one more step is left in it after them)."""
        self.probe_at = steps + 1 if 0 < steps and steps + 1 < self.steps else None

    def cancel_probe(self) -> None:
        """No probe in the current period (a start-up quorum decides it afresh)."""
        self.probe_at = None

    def skip_warm_up(self, taken: int, clock: Callable[[], float]) -> None:
        """After inner step ``taken``: if it was this process's first, time the period from
        here (unless already timed from here or later), so compilation does not count in the
        speed. Reads ``clock`` once per process."""
        if self._warm:
            return
        self._warm = True
        if self._planned_from < taken:
            self.time_from(taken, clock())

    def probe_due(self, taken: int, clock: Callable[[], float]) -> bool:
        """After inner step ``taken``: whether to probe now (this group's speed measured).
        Reads ``clock`` only then."""
        if self.probe_at is None or taken < self.probe_at:
            return False
        self.probe_at, self.probed_after = None, taken
        self.measure(taken, clock())
        self.probed_seconds = self.step_seconds
        return True

    def time_from(self, taken: int, now: float) -> None:
        """Measure this period's speed from now (``taken`` steps done), e.g. after the warm-up
        step or a probe that planned nothing. The planned length keeps its end."""
        if self._began is not None and self._seconds > 0:
            self._seconds -= now - self._began
        self._began, self._planned_from = now, taken

    def plan_rest(self, taken: int, steps: int, seconds: float, now: float) -> None:
        """Once the probe's quorum is done (``taken`` steps done by now): ``steps`` more in
        ``seconds``, from now."""
        self._began, self._planned_from = now, taken
        self.steps = taken + max(1, min(2 * self.period - taken, steps))
        self._seconds = seconds
        self._correct_at = dylu_next_correction(taken, self.steps) if seconds > 0 else None

    def due_correction(self, taken: int) -> bool:
        return taken == self._correct_at

    def correct(self, taken: int, now: float, agree: Callable[[int], int]) -> None:
        """Correct the period's step count by its speed so far (``agree``: the most of the
        group's ranks' counts, so that every rank takes the same number of steps)."""
        if self._began is None:  # restarted mid-period: keep the plan
            self._correct_at = None
            return
        base = self._planned_from
        steps = base + dylu_steps_to_deadline(
            taken - base, now - self._began, self._seconds, self.period
        )
        self.steps = agree(min(2 * self.period, steps))
        self._correct_at = dylu_next_correction(taken, self.steps)


class DyLUPeriods:
    """Async DiLoCo's periods under DyLU: how many inner steps each takes (``dylu.PeriodPlan``,
    planned in each sync quorum), the corrections within a period, and the speed probe that
    plans the job's first period. :class:`AsyncDiLoCo` builds the attributes below."""

    sync: SyncQuorum
    #: Inner steps per period as configured, and the current period's taken so far (also
    #: :meth:`~.outer_loop.OuterLoop.local_step`).
    period: int
    _local_step: int
    local_step: Callable[[], int]
    #: The current period's inner steps (``period`` unless DyLU planned others).
    plan: PeriodPlan
    #: Seconds on the model's device, for DyLU (each reading waits for the device).
    clock: Callable[[], float]
    #: The most of this group's ranks' numbers (a MAX all-reduce over the group).
    agree_in_group: Callable[[int], int]
    #: DyLU's speed probe while its quorum forms (None: none under way).
    _probe: Probe | None

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
            self.sync.allow_state_dict_read()

    def _finish_probe(self) -> None:
        """Wait for DyLU's speed probe under way, if any, and take its plan (a peer healing in
        its quorum reads this group's state meanwhile)."""
        probe, self._probe = self._probe, None
        if probe is not None:
            self.sync.allow_state_dict_read()
            probe.finish()

    def step_seconds(self) -> float:
        """This group's seconds per inner step in its last period (0: no period yet)."""
        return self.plan.step_seconds

    def plan_rest_of_period(self, steps: int, seconds: float) -> None:
        """After the speed probe: ``steps`` more inner steps in this period, in ``seconds``."""
        self.plan.plan_rest(self._local_step, steps, seconds, self.clock())

    def probe_unused(self) -> None:
        """The speed probe planned nothing: the period goes on as planned."""
        self.plan.time_from(self._local_step, self.clock())

    def steps_this_period(self) -> int:
        return self.plan.steps
