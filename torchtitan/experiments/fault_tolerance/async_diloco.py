"""Async DiLoCo: the outer step overlaps the next period's compute.

A group starts its pseudo-gradient all-reduce at a sync point and goes straight on with its
inner steps; the average is applied at the next sync point, a period later. torchft's Manager
does what it does for blocking DiLoCo (quorum, all-reduce, ``should_commit``, heals).

One sync point ``j`` (every ``period`` inner steps; with fragments, fragment ``j mod F``):

1. finish sync ``j - 1``: wait, ``should_commit``; if committed, the outer step with the
   token-weighted average, else the sync is dropped alike in every group. The fragment's
   local copy then moves by how far the global copy moved from this period's start: inner
   progress is kept, the estimate (3.) is replaced by the truth;
2. the pseudo-gradient of the fragment due now: its period's start minus the model;
3. the next period starts at the global copy (``delayed``), moved by the outer step this
   group's own pseudo-gradient would make (``eager``), or its share of the average would
   (``eager_share``: divided by the number of groups; with outer momentum 0, the eager update
   of arXiv 2502.12996);
4. the sync quorum (a joining group heals here: global copies and outer state);
5. start the all-reduce (SUM) of ``[tokens x pseudo-gradient, tokens]``: the average is
   weighted by the tokens of each group's period (arXiv 2401.09135); a group that has just
   healed sends zeros and weight 0.

With DyLU (``dynamic_local_steps``) a period takes as many inner steps as the group's speed
allows (:meth:`AsyncDiLoCo.plan_period`, from each sync quorum). Groups still pass sync points
together, so ``sync_points`` counts alike in every group; every group applies the same averages
in the same order, so all live groups hold identical global copies after a committed sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from torchtitan.experiments.fault_tolerance.async_state import (
    FragmentState,
    InFlightSync,
    checkpoint_arrived,
    load_arrived,
)
from torchtitan.experiments.fault_tolerance.dylu import PeriodPlan
from torchtitan.experiments.fault_tolerance.global_copy import GlobalCopyMethod
from torchtitan.experiments.fault_tolerance.heal_history import HealHistory
from torchtitan.experiments.fault_tolerance.job_config import ASYNC_UPDATES
from torchtitan.experiments.fault_tolerance.outer_loop import Ending, Quorums, SyncOutcome
from torchtitan.experiments.fault_tolerance.outer_optimizer import outer_optimizer
from torchtitan.experiments.fault_tolerance.step_clock import StepClock

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync_quorum import ProbeInFlight, SyncManager


class Decided(NamedTuple):
    """A decided sync: its fragment, the sums to average (None: nothing to apply) and their
    total of tokens, and its buffer, free for the next sync."""

    fragment: int
    sums: torch.Tensor | None
    total: float
    buffer: torch.Tensor


class DyLUPeriods:
    """Async DiLoCo's periods under DyLU: how many inner steps each takes (``dylu.PeriodPlan``,
    planned in each sync quorum), the corrections within a period, and the speed probe that
    plans the job's first period. :class:`AsyncDiLoCo` builds the attributes below."""

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


class AsyncDiLoCo(DyLUPeriods, GlobalCopyMethod[FragmentState]):
    """DiLoCo whose outer step is applied one sync point later, overlapped with compute."""

    method = "async_diloco"
    applies_next = True
    heal_key = "async_diloco_fragment_{}"

    def __init__(
        self,
        manager: SyncManager,
        fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_steps: int,
        update: str,
        outer_lr: float,
        outer_momentum: float,
        outer_nesterov: bool,
        outer_momentum_every: int = 1,
        state_device: torch.device,
        tokens_per_step: int,
        clock: Callable[[], float] | None = None,
        host_threads: int = 0,
        history: HealHistory | None = None,
    ) -> None:
        """``sync_steps``: inner steps between two syncs of one fragment; ``update``: one of
        ``ASYNC_UPDATES``; ``tokens_per_step``: the weight of an inner step's progress;
        ``clock``: seconds on the model's device, for DyLU (default: a ``StepClock``);
        ``host_threads``: for a sync point's host work (0: ``cores_per_rank``)."""
        if update not in ASYNC_UPDATES:
            raise ValueError(f"update must be one of {ASYNC_UPDATES}, not {update!r}")
        make_outer = outer_optimizer(outer_lr, outer_momentum, outer_nesterov, outer_momentum_every)
        states = [FragmentState(f, state_device, make_outer, host_threads) for f in fragments]
        super().__init__(
            manager, inner_optimizer, sync_steps // len(fragments), fragments, states, history
        )
        self.update = update
        self.tokens_per_step = tokens_per_step
        self.clock = clock or StepClock(states[0].model_device).now
        self.plan = PeriodPlan(self.period)
        self.agree_in_group = manager.agree_in_group
        self.sync_points = 0
        #: By fragment: told the sum of squares of each average the passes step with.
        self._observers: dict[int, list[Callable[[float], None]]] = {}
        self._in_flight: InFlightSync | None = None
        #: The sync a sync point decided, until its average is applied in the same sync point.
        self._decided: Decided | None = None
        self._outcome: SyncOutcome | None = None
        self._probe = None
        manager.register_state_dict_fn("async_diloco_progress", self._load_progress, self._progress)

    # ---- the loop ----------------------------------------------------------------------------

    def hooks(self, quorums: Quorums) -> contextlib.AbstractContextManager:
        self.plan.begin(self.clock())  # the first period's clock starts with the hooks
        return super().hooks(quorums)

    def count_step(self, quorums: Quorums) -> None:
        for state in self._states:
            state.steps += 1
        self._plan_after_step(quorums)

    def apply_sync(self) -> None:
        """Decide the sync in flight (step 1 of the module docstring); its average goes into
        the global copy in :meth:`start_sync`'s pass over the same fragment."""
        self.plan.end(self._local_step, self.clock())
        self._finish_probe()  # none is under way here (count_step finished it)
        self.sync_points += 1
        self._decided = self._decide_in_flight()

    def start_sync(self, quorums: Quorums) -> None:
        """Steps 1-5 of the module docstring, at inner step 0: at the quorum every group is
        there (a group healing from it goes on there)."""
        decided, self._decided = self._decided, None
        index = self.current_fragment()
        state = self._states[index]
        # A committed sync's buffer carries the next one (no fresh one faulted in at every
        # sync); not a failed one's: a transfer abandoned with it may still write into it.
        reuse = decided.buffer if decided is not None and decided.sums is not None else None
        buffer = self._buffer(state, reuse)
        share = None  # delayed
        if self.update != "delayed":
            share = 1.0 if self.update == "eager" else 1 / max(1, self.manager.num_participants())
        # Steps 1-3 in one pass when one fragment is finished and started.
        steps, state.steps = state.steps, 0
        tokens = steps * self.tokens_per_step
        if decided is not None and decided.fragment == index:
            state.finish_and_start(decided.sums, decided.total, buffer[:-1], share, tokens)
        else:
            if decided is not None:
                self._states[decided.fragment].finish(decided.sums, decided.total)
            state.start(buffer[:-1], share, tokens)
        self._healed = False
        quorums.sync_quorum()
        if self._healed:  # this group's progress was replaced by a peer's state
            self.start_transfer()
        else:
            self._in_flight = InFlightSync.start(
                self.manager, index, buffer, steps, tokens, scaled=True
            )
            self.plan.begin(self.clock())

    def _buffer(self, state: FragmentState, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """A buffer for ``state``'s sync on the model's device: ``reuse`` if it fits (its sums
        are read, piece by piece, before the pseudo-gradient overwrites them), else a new one."""
        device = state.model_device
        if reuse is not None and reuse.numel() == state.numel() + 1 and reuse.device == device:
            return reuse
        return torch.empty(state.numel() + 1, dtype=torch.float32, device=device)

    def _decide_in_flight(self) -> Decided | None:
        """Decide the sync in flight, if any (:meth:`InFlightSync.decide`); committed, what it
        delivered goes into the heal history. The outcome is kept."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            self._outcome = None
            return None
        self._outcome, sums, total = flight.decide(self.manager)
        if self._outcome.committed:  # ``total``: the buffer's token count, read once
            self._keep(flight.fragment, flight.buffer[:-1] if flight.loaded else None, total)
        # An average the passes step with (``optimizer.step()``'s pre-hooks see the others).
        if flight.average_squares is not None and self._states[flight.fragment].passes.usable():
            for observe in self._observers.get(flight.fragment, []):
                observe(flight.average_squares)
        return Decided(flight.fragment, sums, total, flight.buffer)

    # ---- healing -----------------------------------------------------------------------------

    def _progress(self) -> dict[str, Any]:
        """Sent to a group healing from this one: the job's progress and, from a starting group,
        the sync its checkpoint holds as arrived (applied at the next sync point)."""
        state: dict[str, Any] = {"sync_points": self.sync_points}
        flight = self._in_flight
        if flight is not None and flight.arrived:
            state["arrived"] = flight.for_heal()
        return state

    def _load_progress(self, saved: dict[str, Any]) -> None:
        """The peer's progress and its arrived sync in place of this group's own: both then
        apply the same average at the next sync point."""
        self.sync_points = int(saved["sync_points"])
        arrived = saved.get("arrived")
        self._in_flight = None if arrived is None else InFlightSync.from_heal(arrived)

    def start_transfer(self) -> None:
        """The global copies are a peer's (a heal in this sync point's quorum or the running
        groups'): every fragment's local period starts there and nothing this group did before
        counts (nor what its compression owed). The peer may be a sync ahead: take part in the
        all-reduce it starts, of its fragment, with weight 0."""
        self._healed = False
        self.manager.reset_error_feedback()
        for state in self._states:
            state.start_period(None)
            state.steps = 0
        self._local_step = 0
        index = self.current_fragment()
        self._in_flight = InFlightSync.start(
            self.manager, index, self._buffer(self._states[index]), 0, 0
        )
        self.plan.begin(self.clock())

    # ---- what the trainer asks -----------------------------------------------------------------

    def observe_averages(self, index: int, observe: Callable[[float], None]) -> None:
        # The sync point's passes step the outer state without ``optimizer.step()``.
        self._observers.setdefault(index, []).append(observe)

    def global_chunk_hashes(self, index: int) -> list[int]:
        return self._states[index].global_chunk_hashes()

    def in_flight(self, index: int) -> bool:
        flight = self._in_flight
        return flight is not None and flight.fragment == index and not flight.arrived

    def state_bytes(self) -> dict[str, int]:
        held = super().state_bytes()
        starts = sum(t.nbytes for s in self._states for t in s.period_start.values())
        return {**held, "period_start": starts}

    def sync_buffer_bytes(self) -> int:
        # The largest fragment's all-reduce buffer and the passes' pinned staging.
        largest = max(s.numel() + 1 for s in self._states) * 4
        return largest + sum(s.passes.staging_bytes() for s in self._states)

    def extra_state(self) -> dict[str, Any]:
        """Per fragment its period's start and inner steps, and the sync in flight, waited for:
        its sums are kept, so a job restarted from the checkpoint applies it at its next sync
        point as the uninterrupted job does. If its all-reduce failed nothing is kept and the
        restarted job drops that sync (``in_flight`` stays true)."""
        flight = self._in_flight
        if flight is not None:
            flight.wait_for_checkpoint(self.manager, self.agree_in_group)
        state: dict[str, Any] = {"sync_points": self.sync_points}
        for index, fragment_state in enumerate(self._states):
            state[f"fragment_{index}"] = fragment_state.checkpoint()
        kept = flight if flight is not None and flight.arrived else None
        state["arrived"] = checkpoint_arrived(kept, self._states)
        return state

    @torch.no_grad()
    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.sync_points = int(state["sync_points"])
        for index, fragment_state in enumerate(self._states):
            fragment_state.load_checkpoint(state[f"fragment_{index}"])
        self._in_flight = load_arrived(state["arrived"], self._states)

    def drop_in_flight(self, index: int) -> None:
        if self.in_flight(index):
            assert self._in_flight is not None
            self._in_flight.work.wait()
            self._in_flight = None

    def restore_global_copies(self, index: int) -> None:
        self._states[index].start_period(None)

    def last_outcome(self, manager: SyncManager) -> SyncOutcome | None:
        return self._outcome

    def finish(self, quorums: Quorums) -> Ending:
        """Finish the sync in flight (the job's last average counts), then every fragment's
        global copy goes into the model."""
        self._finish_probe()
        decided = self._decide_in_flight()
        if decided is not None:
            self._states[decided.fragment].finish(decided.sums, decided.total)
        for index in range(len(self.fragments)):
            self.restore_global_copies(index)
        return Ending(self._outcome is not None, 0, self._local_step or None)
