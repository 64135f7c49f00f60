"""Async DiLoCo: the outer step overlaps the next period's compute.

Blocking DiLoCo stops every group at a sync point until the pseudo-gradient all-reduce is done.
Here a group starts that all-reduce and goes straight on with its inner steps; the average is
applied at the next sync point, where it has had a whole period to arrive. torchft's Manager
does what it does for the blocking methods (quorum, the managed all-reduce, ``should_commit``,
state transfer to a healing group); this module is only the outer algorithm torchft lacks.

One sync point ``j`` (every ``period`` inner steps; with fragments, fragment ``j mod F``):

1. finish sync ``j - 1``: wait for its all-reduce, ``should_commit``; if committed, apply the
   outer step (the outer optimizer on the global copy, with the token-weighted average as
   gradient), else drop it alike in every group. The local copy of that fragment is then
   corrected by how far the global copy moved from where this group's local period started,
   so inner progress made since is kept and the estimate (below) is replaced by the truth;
2. this group's pseudo-gradient of the fragment due now: where its local period started minus
   where the model is;
3. the fragment's next local period starts from the global copy (``delayed``), or from the
   global copy plus the outer step this group's own pseudo-gradient would make (``eager``:
   the own pseudo-gradient as the estimate of the average), or its share of the average
   would make (``eager_share``: the own pseudo-gradient divided by the number of groups; the
   others' shares come when the average arrives; with outer momentum 0 this is the eager
   update of arXiv 2502.12996, which applies the own pseudo-gradient at once and the others'
   one outer step late);
4. the sync quorum (a joining group heals here: it gets the global copies and outer state);
5. start the all-reduce of ``[tokens x pseudo-gradient, tokens]`` (a SUM), so the average is
   weighted by the tokens each group processed in the fragment's period (arXiv 2401.09135);
   a group that has just healed sends zeros and weight 0.

With DyLU (``dynamic_local_steps``, arXiv 2401.09135) a group's period is not ``period`` inner
steps but as many as its speed allows (:func:`~.dylu.dylu_inner_steps`, decided in each sync quorum
by the trainer, :meth:`AsyncDiLoCo.plan_period`); the token weights then give each group's
pseudo-gradient its share. Groups still pass sync points together (every sync point is a
quorum), so ``sync_points`` counts the job's progress alike in every group.

Every group applies the same averages in the same order to the same global copies, so after
every committed sync all live groups hold identical global parameters (the trainer checks a
digest of them). Nothing is in flight while a quorum forms, so a heal carries only the global
copies and outer optimizer state. The global copies, the outer momentum and the start of the
local period live on ``state_device`` (the CPU by default: 3x the parameters off the
accelerator; pinned when a GPU is present).
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
    async_outer,
    checkpoint_arrived,
    load_arrived,
)
from torchtitan.experiments.fault_tolerance.dylu import PeriodPlan
from torchtitan.experiments.fault_tolerance.global_copy import GlobalCopyMethod
from torchtitan.experiments.fault_tolerance.heal_history import HealHistory
from torchtitan.experiments.fault_tolerance.job_config import ASYNC_UPDATES
from torchtitan.experiments.fault_tolerance.outer_loop import Ending, Quorums, SyncOutcome
from torchtitan.experiments.fault_tolerance.step_clock import StepClock

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync_quorum import ProbeInFlight, SyncManager


class Decided(NamedTuple):
    """A decided sync: its fragment, the sums to average and their total of tokens (None:
    nothing to apply; ``FragmentState.finish``), and its buffer, free for the next sync."""

    fragment: int
    sums: torch.Tensor | None
    total: float
    buffer: torch.Tensor


class AsyncDiLoCo(GlobalCopyMethod[FragmentState]):
    """DiLoCo whose outer step is applied one sync point later, overlapped with compute."""

    method = "async_diloco"
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
        """``manager``: the sync Manager (quorum, all-reduce, should_commit, state for
        healing); ``sync_steps``: inner steps between two syncs of one fragment; ``update``:
        ``eager`` or ``delayed``; ``tokens_per_step``: tokens this group trains on per inner
        step (the weight of its pseudo-gradients); ``clock``: seconds on the model's device,
        for DyLU (a :class:`~.step_clock.StepClock` of the fragments' device by default);
        ``host_threads``: threads for a sync point's host work (0: this rank's share of the
        host's cores, ``outer_passes.cores_per_rank``); ``history``: the heal history
        (``GlobalCopyMethod``)."""
        if update not in ASYNC_UPDATES:
            raise ValueError(f"update must be one of {ASYNC_UPDATES}, not {update!r}")
        make_outer = async_outer(outer_lr, outer_momentum, outer_nesterov, outer_momentum_every)
        states = [FragmentState(f, state_device, make_outer, host_threads) for f in fragments]
        super().__init__(
            manager, inner_optimizer, sync_steps // len(fragments), fragments, states, history
        )
        self.update = update
        self.tokens_per_step = tokens_per_step
        if clock is None:
            clock = StepClock(states[0].model_device).now
        #: Seconds on the model's device, for DyLU (each reading waits for the device).
        self.clock = clock
        #: The current period's inner steps (``period`` unless DyLU planned others).
        self.plan = PeriodPlan(self.period)
        #: The most of this group's ranks' numbers: the sync Manager's (one MAX all-reduce
        #: in a group of several ranks).
        self.agree_in_group: Callable[[int], int] = manager.agree_in_group
        self.sync_points = 0
        #: By fragment: told each average's sum of squares that the passes step with.
        self._observers: dict[int, list[Callable[[float], None]]] = {}
        self._in_flight: InFlightSync | None = None
        self._outcome: SyncOutcome | None = None
        #: DyLU's speed probe while its quorum forms (None: none under way).
        self._probe: ProbeInFlight | None = None
        manager.register_state_dict_fn("async_diloco_progress", self._load_progress, self._progress)

    # ---- the loop ----------------------------------------------------------------------------

    def hooks(self, quorums: Quorums) -> contextlib.AbstractContextManager:
        self.plan.begin(self.clock())  # the first period's clock starts with the hooks
        return super().hooks(quorums)

    def at_step(self, quorums: Quorums) -> None:
        for state in self._states:
            state.steps += 1
        # Only DyLU's decisions read the clock (each reading waits for the device).
        self.plan.skip_warm_up(self._local_step, self.clock)
        if self.plan.probe_due(self._local_step, self.clock):
            # DyLU's first period: the groups exchange speeds and plan the rest of it, in a
            # quorum that forms while this group takes its next steps (the fast groups would
            # otherwise wait there for the slow ones' first steps).
            self._probe = quorums.start_probe()
        elif self._probe is not None:
            # Every rank of the group takes the plan at the same inner step: once all are
            # done, or at the end of the period as it stands (the plan may lengthen it).
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
            # While the probe's quorum forms, no peer reads this group's state for a heal
            # (it would read it from that quorum's thread while the model runs).
            self.manager.allow_state_dict_read()
        if self._local_step >= self.plan.steps:
            self.sync_point(quorums)

    def sync_point(self, quorums: Quorums) -> None:
        """Finish the sync in flight, start this fragment's (see the module docstring)."""
        self.plan.end(self._local_step, self.clock())
        self._finish_probe()  # none is under way here (at_step finished it)
        self.sync_points += 1
        # At the quorum every group is at inner step 0 of its next period, whatever the length
        # of the one it ended (DyLU): a group healing from it continues from there.
        self._local_step = 0
        decided = self._decide_in_flight()
        index = self.current_fragment()
        state = self._states[index]
        # A committed sync's buffer carries the next one when it fits: a fresh one of a shard's
        # size would be allocated (and, on the host, faulted in page by page) at every sync.
        # Not a failed one's: a transfer abandoned with it may still write into it (transport).
        reuse = decided.buffer if decided is not None and decided.sums is not None else None
        buffer = self._buffer(state, reuse)
        share = None  # delayed
        if self.update != "delayed":
            # eager_share: this group's share of the average now, the others' when it arrives.
            share = 1.0 if self.update == "eager" else 1 / max(1, self.manager.num_participants())
        # Steps 1-3 of the module docstring: the host's work of the sync point, in one pass over
        # the fragment when the one finished is the one started (``outer_passes``).
        steps, state.steps = state.steps, 0
        tokens = steps * self.tokens_per_step  # the pseudo-gradient's weight, applied in the pass
        if decided is not None and decided.fragment == index:
            state.finish_and_start(decided.sums, decided.total, buffer[:-1], share, tokens)
        else:
            if decided is not None:
                self._states[decided.fragment].finish(decided.sums, decided.total)
            state.start(buffer[:-1], share, tokens)
        self._healed = False
        quorums.sync_quorum()
        if self._healed:  # this group's progress was replaced by a peer's state
            self._after_heal()
            # The peer may be a sync ahead (its Manager step is now this group's): take part
            # in the all-reduce it starts, of the fragment it syncs, with weight 0.
            index = self.current_fragment()
            self._start_all_reduce(index, self._buffer(self._states[index]), 0)
        else:
            self._start_all_reduce(index, buffer, steps, scaled=True)
        self.plan.begin(self.clock())

    def _buffer(self, state: FragmentState, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """A buffer for ``state``'s sync on the model's device: ``reuse`` if it is of its size
        and there (the sums it holds are read, piece by piece, before the pseudo-gradient
        overwrites them), else a new one."""
        device = state.model_device
        if reuse is not None and reuse.numel() == state.numel() + 1 and reuse.device == device:
            return reuse
        return torch.empty(state.numel() + 1, dtype=torch.float32, device=device)

    def _start_all_reduce(
        self, index: int, buffer: torch.Tensor, steps: int, scaled: bool = False
    ) -> None:
        """Start fragment ``index``'s all-reduce of the pseudo-gradient in ``buffer[:-1]``,
        from ``steps`` inner steps (0: this group sends zeros; ``scaled``: the buffer holds
        it multiplied by its tokens already)."""
        tokens = steps * self.tokens_per_step
        self._in_flight = InFlightSync.start(self.manager, index, buffer, steps, tokens, scaled)

    def _decide_in_flight(self) -> Decided | None:
        """Decide the sync in flight, if any (:meth:`InFlightSync.decide`; committed, what it
        delivered goes into the heal history); the outcome is kept."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            self._outcome = None
            return None
        self._outcome, sums, total = flight.decide(self.manager)
        if self._outcome.committed:  # ``total``: the buffer's token count, read once
            self._keep(flight.fragment, flight.buffer[:-1] if flight.loaded else None, total)
        self._tell_observers(flight)
        return Decided(flight.fragment, sums, total, flight.buffer)

    def _tell_observers(self, flight: InFlightSync) -> None:
        """A decided sync whose average the passes step with (``optimizer.step()``'s pre-hooks
        see the others): its sum of squares, to :meth:`observe_averages`' observers."""
        if flight.average_squares is not None and self._states[flight.fragment].passes.usable():
            for observe in self._observers.get(flight.fragment, []):
                observe(flight.average_squares)

    # ---- DyLU ---------------------------------------------------------------------------------

    def _finish_probe(self) -> None:
        """Wait for DyLU's speed probe under way, if any, and take its plan. A peer healing
        in the probe's quorum reads this group's state now, while this thread waits."""
        probe, self._probe = self._probe, None
        if probe is not None:
            self.manager.allow_state_dict_read()
            probe.finish()

    def step_seconds(self) -> float:
        """This group's seconds per inner step in its last period (0: no period yet)."""
        return self.plan.step_seconds

    def plan_period(self, steps: int, seconds: float = 0.0) -> None:
        """The next period (which starts after this quorum) takes ``steps`` inner steps; with
        ``seconds`` (the period's planned length), the group corrects its step count by its
        speed in the period so far (:func:`~.dylu.dylu_steps_to_deadline`) halfway through it, then
        halfway through what is left, until one step is left (:func:`~.dylu.dylu_next_correction`):
        how fast a group computes varies from one period to the next and within one, and an
        error of the estimate would otherwise make the other groups wait for all of it."""
        self.plan.plan(steps, seconds)

    def plan_rest_of_period(self, steps: int, seconds: float) -> None:
        """Once the speed probe is done: ``steps`` more inner steps in this period, in
        ``seconds``, from now."""
        self.plan.plan_rest(self._local_step, steps, seconds, self.clock())

    def probe_unused(self) -> None:
        """The speed probe planned nothing: the period goes on as planned."""
        self.plan.time_from(self._local_step, self.clock())

    def steps_this_period(self) -> int:
        return self.plan.steps

    # ---- healing -----------------------------------------------------------------------------

    def _progress(self) -> dict[str, Any]:
        """Sent to a group that heals from this one: the job's progress and, from a starting
        group, the sync its checkpoint holds as arrived (applied at the next sync point; a
        running group has nothing in flight in a sync quorum)."""
        state: dict[str, Any] = {"sync_points": self.sync_points}
        flight = self._in_flight
        if flight is not None and flight.arrived:
            state["arrived"] = flight.for_heal()
        return state

    def _load_progress(self, saved: dict[str, Any]) -> None:
        """The peer's progress, and its arrived sync in place of this group's own: both groups
        then apply the same average at the next sync point."""
        self.sync_points = int(saved["sync_points"])
        arrived = saved.get("arrived")
        self._in_flight = None if arrived is None else InFlightSync.from_heal(arrived)

    def _after_heal(self) -> None:
        """The global copies are the peer's: every fragment's local period starts there, and
        nothing this group did before counts (nor what its compression still owed)."""
        self.manager.reset_error_feedback()
        for state in self._states:
            state.start_period(None)
            state.steps = 0

    def join_sync(self) -> bool:
        """A group healed in the running groups' sync quorum: start from the global copies
        and take part in the all-reduce they started, with weight 0."""
        self._in_flight = None
        self._after_heal()
        index = self.current_fragment()
        self._start_all_reduce(index, self._buffer(self._states[index]), 0)
        self._healed = False
        self._local_step = 0
        self.plan.begin(self.clock())
        return False

    # ---- what the trainer asks -----------------------------------------------------------------

    def observe_averages(self, index: int, observe: Callable[[float], None]) -> None:
        # The sync point's passes step the outer state without ``optimizer.step()``.
        self._observers.setdefault(index, []).append(observe)

    def global_chunk_hashes(self, index: int) -> list[int]:
        # Taken in the sync point's pass over the fragment (``outer_passes``), once per change.
        return self._states[index].global_chunk_hashes()

    def in_flight(self, index: int) -> bool:
        flight = self._in_flight
        return flight is not None and flight.fragment == index and not flight.arrived

    def state_bytes(self) -> dict[str, int]:
        held = super().state_bytes()
        starts = sum(t.nbytes for s in self._states for t in s.period_start.values())
        return {**held, "period_start": starts}

    def sync_buffer_bytes(self) -> int:
        # The all-reduce buffer in flight ([tokens x pseudo-gradient, tokens], fp32, of the
        # largest fragment) and the passes' pinned staging (model on an accelerator).
        largest = max(s.numel() + 1 for s in self._states) * 4
        return largest + sum(s.passes.staging_bytes() for s in self._states)

    def extra_state(self) -> dict[str, Any]:
        """Per fragment the start of the local period and its inner-step count, and the sync
        in flight: waited for here (a checkpoint blocks anyway), its summed result kept, so that
        a job restarted from the checkpoint applies it at its next sync point as the
        uninterrupted job does. Unless the all-reduce failed: then nothing is kept, and the
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
