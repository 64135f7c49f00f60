"""Async DiLoCo: the outer step overlaps the next period's compute.

A group starts its pseudo-gradient all-reduce at a sync point and goes straight on with its
inner steps; the average is applied at the next sync point, a period later. torchft's Manager
does what it does for blocking DiLoCo (quorum, all-reduce, commit vote, heals).

One sync point ``j`` (every ``period`` inner steps; with fragments, fragment ``j mod F``):

1. finish sync ``j - 1``: wait, decide (torchft's vote); if committed, the outer step with the
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
allows (:meth:`~.dylu.PeriodPlan.plan`, from each sync quorum). Groups still pass sync points
together, so ``sync_points`` counts alike in every group; every group applies the same averages
in the same order, so all live groups hold identical global copies after a committed sync.

Its state:

* :class:`AsyncOuterState`, one per fragment: its global copy, outer optimizer, where this
  group's local period started, and the outer step and copies between the model and that state.
* :class:`InFlightSync`: one fragment's all-reduce of ``[tokens x pseudo-gradient, tokens]``
  (a token-weighted average, arXiv 2401.09135) from one sync point to its verdict at the next.
  It is *arrived* when its result is in the buffer and known good (waited for by a checkpoint,
  or loaded from one or from a peer); it is still committed or dropped at the next sync point
  alike in every group. A sync whose all-reduce failed never arrives.

The outer state lives on the state device (the CPU by default, pinned when a GPU is present);
copies between it and the model are queued without blocking and waited for where the host
reads or rewrites their tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.distributed import ReduceOp

from torchtitan.components.ft.delivery import AllWorks
from torchtitan.distributed.tensors import as_param_layout, local_tensor
from torchtitan.experiments.fault_tolerance.heal.history import HealHistory
from torchtitan.experiments.fault_tolerance.job_config import ASYNC_UPDATES
from torchtitan.experiments.fault_tolerance.methods.dylu import DyLUPeriods, PeriodPlan
from torchtitan.experiments.fault_tolerance.methods.global_copy import (
    GlobalCopyMethod,
    MakeOuter,
    OuterState,
    state_tensor,
)
from torchtitan.experiments.fault_tolerance.methods.outer_loop import Ending, Quorums, SyncOutcome
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import (
    DelayedNesterov,
    outer_optimizer,
)
from torchtitan.experiments.fault_tolerance.methods.outer_passes import wait_for_copies
from torchtitan.experiments.fault_tolerance.methods.step_clock import StepClock

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum
    from torchtitan.experiments.fault_tolerance.transport.collective import Delivered


class AsyncOuterState(OuterState):
    """One fragment's outer state (:class:`~.global_copy.OuterState`) and where this group's local
    period started; a sync point's work on them is the passes' (``outer_passes``)."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        make_outer: MakeOuter,
        host_threads: int = 0,
    ) -> None:
        """``device``: where the outer state lives; ``host_threads``: for a sync point's host
        work (0: this rank's share of the host's cores)."""
        super().__init__(module, make_outer, device, host_threads)
        self.period_start = {
            n: state_tensor(local_tensor(p), device) for n, p in self.params.items()
        }
        #: Inner steps this group took since the fragment's last sync point.
        self.steps = 0

    # ---- a sync point --------------------------------------------------------------------------

    def finish(self, sums: torch.Tensor | None, total: float) -> None:
        """The outer step with the average ``sums / total`` (None: the sync is dropped, no
        step), then the local copy follows the global copy: it moves by how far the global
        copy moved from the period's start, where the next period starts."""
        self.passes.finish(self.period_start, sums, total)

    def start(self, out: torch.Tensor, share: float | None, tokens: float = 1.0) -> None:
        """This group's pseudo-gradient (start - model) into ``out``; the next local period
        starts at the global copy, moved by the outer step for ``share x out`` (``share`` None:
        not moved); then ``out`` scaled by ``tokens``."""
        self.passes.start(self.period_start, out, share, tokens)

    def finish_and_start(
        self,
        sums: torch.Tensor | None,
        total: float,
        out: torch.Tensor,
        share: float | None,
        tokens: float = 1.0,
    ) -> None:
        """:meth:`finish` then :meth:`start`, in one pass where the passes allow."""
        self.passes.finish_and_start(self.period_start, sums, total, out, share, tokens)

    @torch.no_grad()
    def take_model(self) -> None:
        """The model's current values become the global copy and the local start."""
        super().take_model()
        for name in self.params:
            self.period_start[name].copy_(self.global_copy[name])

    @torch.no_grad()
    def restart(self) -> None:
        """The local period starts at the global copy, and the model takes it (a heal, the
        job's end)."""
        for name, p in self.params.items():
            self.period_start[name].copy_(self.global_copy[name])
            local_tensor(p.data).copy_(self.period_start[name], non_blocking=self.non_blocking)
        wait_for_copies(self.model_device)  # ``start`` is rewritten at the next sync point

    def checkpoint(self) -> dict[str, Any]:
        """A checkpoint's entry besides the global copy and momentum: the local start (laid out
        like the parameters), the inner steps since the last sync point and, with Delayed
        Nesterov, its step and the window's pseudo-gradient sums (zeros where none: every
        checkpoint has the same keys)."""
        saved: dict[str, Any] = {
            "local_start": {
                name: as_param_layout(p, self.period_start[name]) for name, p in self.params.items()
            },
            "steps": self.steps,
        }
        if isinstance(self.outer, DelayedNesterov):
            sums = {}
            for name, p in self.params.items():
                summed = self.outer.state.get(self.global_copy[name], {}).get("grad_sum")
                if summed is None:
                    summed = torch.zeros_like(self.global_copy[name])
                sums[name] = as_param_layout(p, summed)
            saved |= {"outer_step": self.outer.param_groups[0]["step"], "grad_sum": sums}
        return saved

    @torch.no_grad()
    def load_checkpoint(self, saved: dict[str, Any]) -> None:
        """Take back what :meth:`checkpoint` gave, as loaded."""
        for name, value in saved["local_start"].items():
            self.period_start[name].copy_(local_tensor(value))
        self.steps = int(saved["steps"])
        if isinstance(self.outer, DelayedNesterov):
            self.outer.param_groups[0]["step"] = int(saved["outer_step"])
            for name, value in saved["grad_sum"].items():
                copy = self.global_copy[name]
                self.outer.state[copy]["grad_sum"] = local_tensor(value).to(copy.device, copy=True)

    def heal_state(self) -> dict[str, Any]:
        return super().heal_state() | {"period_start": self.period_start, "steps": self.steps}

    @torch.no_grad()
    def load_heal_state(self, saved: dict[str, Any]) -> None:
        """The peer's global copy, outer state and local start (which go with its model): this
        group goes on exactly as the peer."""
        super().load_heal_state(saved)
        for name, value in saved["period_start"].items():
            self.period_start[name].copy_(local_tensor(value))
        # They go with the peer's model (a group behind in a sync quorum drops them:
        # start_transfer).
        self.steps = int(saved["steps"])


@dataclass
class InFlightSync:
    """A started all-reduce: ``buffer`` holds [sum of tokens x pseudo-gradient, sum of tokens]
    once ``work`` is done."""

    fragment: int
    buffer: torch.Tensor
    #: The pseudo-gradient's transfers and, exact, the token count's (none: its result was
    #: loaded from a checkpoint or a peer).
    work: AllWorks
    #: This group's inner steps and tokens in the sync (its weight before normalizing).
    inner_steps: int
    tokens: int
    #: The result is in ``buffer`` (waited for; or loaded from a checkpoint or a peer).
    arrived: bool = False
    #: Once committed (:meth:`decide`): the average's sum of squares, this rank's shard's.
    average_squares: float | None = None
    #: A follower of its site healed while the sync was in flight: the result comes from its
    #: leader at the decision, as for one that started it.
    followed: bool = False

    @property
    def loaded(self) -> bool:
        """The result came from a checkpoint or a peer, not from this process's transfers."""
        return not self.work.works and not self.followed

    @classmethod
    def start(
        cls,
        sync: SyncQuorum,
        fragment: int,
        buffer: torch.Tensor,
        steps: int,
        tokens: int,
        scaled: bool = False,
    ) -> InFlightSync:
        """All-reduce (SUM) ``[tokens x pseudo-gradient, tokens]`` for the pseudo-gradient in
        ``buffer[:-1]`` (``scaled``: already times ``tokens``; 0 tokens: zeros are sent)."""
        if tokens == 0:
            buffer.zero_()
        else:
            if not scaled:
                buffer[:-1].mul_(tokens)
            buffer[-1] = tokens
        # The token count exact (fp32, no error feedback), sent after the pseudo-gradient's
        # last bucket: both on their way now, to arrive meanwhile.
        works = [
            sync.allreduce(buffer[:-1], reduce_op=ReduceOp.SUM),
            sync.allreduce(buffer[-1:], reduce_op=ReduceOp.SUM, exact=True),
        ]
        return cls(fragment, buffer, AllWorks(works), steps, tokens)

    def decide(
        self, sync: SyncQuorum
    ) -> tuple[SyncOutcome, list[Delivered] | torch.Tensor, torch.Tensor | None, float]:
        """Wait, commit or not (alike in every group): the outcome, what the transfers
        delivered (a loaded sync: its sums), the sums to average (None: nothing to apply) and
        their total of tokens; the average's sum of squares goes into :attr:`average_squares`."""
        self.work.wait()  # a failed all-reduce is recorded by the Manager, not raised
        decision = sync.decide()
        if self.loaded:  # its bytes: its payload (the process that saved it sent it)
            decision = dataclasses.replace(
                decision, bytes_sent=self.buffer.numel() * 4, compression_s=None, squares=None
            )
        committed = decision.committed
        total = float(self.buffer[-1])
        sums = self.buffer[:-1] if committed and total > 0 else None
        if sums is not None:
            # Taken by the transport where the sums arrived; a loaded sync's here.
            found = decision.squares
            found = float(torch.dot(sums, sums)) if found is None else found
            self.average_squares = found / total**2
        outcome = SyncOutcome.of(
            decision,
            self.fragment,
            inner_steps=self.inner_steps,
            tokens=self.tokens,
            weight=self.tokens / total if committed and total > 0 else None,
        )
        delivered = self.buffer[:-1] if self.loaded else decision.delivered
        return outcome, delivered, sums, total

    def wait_for_checkpoint(self, sync: SyncQuorum, agree: Callable[[int], int]) -> None:
        """Wait for the result and mark it arrived unless the all-reduce failed; ``agree``: the
        most of the group's ranks' numbers (each rank sees only its own shards' failure)."""
        if self.arrived:
            return
        self.work.wait()
        self.arrived = not agree(int(sync.sync_failed()))

    def for_heal(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("fragment", "buffer", "inner_steps", "tokens")}

    @classmethod
    def from_heal(cls, saved: dict[str, Any]) -> InFlightSync:
        return cls(
            int(saved["fragment"]),
            saved["buffer"].detach().clone(),
            AllWorks([]),
            int(saved["inner_steps"]),
            int(saved["tokens"]),
            arrived=True,
        )


def checkpoint_arrived(kept: InFlightSync | None, states: list[AsyncOuterState]) -> dict[str, Any]:
    """The checkpoint entry of an arrived sync (``kept``; None: none). Every parameter has an
    entry (zeros outside the kept fragment): the keys do not depend on which fragment was in
    flight, and a fresh process offers DCP the same tensors to load into."""
    sums: dict[str, dict[str, torch.Tensor]] = {}
    for index, state in enumerate(states):
        held = (
            state.views(kept.buffer[:-1]) if kept is not None and kept.fragment == index else None
        )
        sums[f"fragment_{index}"] = {
            name: as_param_layout(
                p, held[name] if held is not None else torch.zeros_like(state.global_copy[name])
            )
            for name, p in state.params.items()
        }
    return {
        "fragment": kept.fragment if kept is not None else -1,
        "inner_steps": kept.inner_steps if kept is not None else 0,
        "own_tokens": kept.tokens if kept is not None else 0,
        "sum": sums,
        "tokens": float(kept.buffer[-1]) if kept is not None else 0.0,
    }


def load_arrived(saved: dict[str, Any], states: list[AsyncOuterState]) -> InFlightSync | None:
    """The arrived sync of a :func:`checkpoint_arrived` entry (None: it held none)."""
    fragment = int(saved["fragment"])
    if fragment < 0:
        return None
    sums = saved["sum"][f"fragment_{fragment}"]
    parts = [local_tensor(sums[n]).reshape(-1).float() for n in states[fragment].params]
    tokens = torch.tensor([float(saved["tokens"])], device=parts[0].device)
    return InFlightSync(
        fragment,
        torch.cat([*parts, tokens]),
        AllWorks([]),
        int(saved["inner_steps"]),
        int(saved["own_tokens"]),
        arrived=True,
    )


class Decided(NamedTuple):
    """A decided sync: its fragment, the sums to average (None: nothing to apply) and their
    total of tokens, and its buffer, free for the next sync."""

    fragment: int
    sums: torch.Tensor | None
    total: float
    buffer: torch.Tensor


class AsyncDiLoCo(DyLUPeriods, GlobalCopyMethod[AsyncOuterState]):
    """DiLoCo whose outer step is applied one sync point later, overlapped with compute."""

    method = "async_diloco"
    applies_next = True
    heal_key = "async_diloco_fragment_{}"

    def __init__(
        self,
        sync: SyncQuorum,
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
        states = [AsyncOuterState(f, state_device, make_outer, host_threads) for f in fragments]
        super().__init__(
            sync, inner_optimizer, sync_steps // len(fragments), fragments, states, history
        )
        self.update = update
        self.tokens_per_step = tokens_per_step
        self.clock = clock or StepClock(states[0].model_device).now
        self.plan = PeriodPlan(self.period)
        self.agree_in_group = sync.agree_in_group
        self.sync_points = 0
        self._in_flight: InFlightSync | None = None
        #: The sync a sync point decided, until its average is applied in the same sync point.
        self._decided: Decided | None = None
        self._probe = None
        sync.register_state_dict_fn("async_diloco_progress", self._load_progress, self._progress)

    # ---- the loop ----------------------------------------------------------------------------

    def hooks(self, quorums: Quorums) -> contextlib.AbstractContextManager:
        self.plan.begin(self.clock())  # the first period's clock starts with the hooks
        return super().hooks(quorums)

    def count_step(self, quorums: Quorums) -> None:
        for state in self._states:
            state.steps += 1
        self._plan_after_step(quorums)

    def decide_sync(self) -> None:
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
            share = 1.0 if self.update == "eager" else 1 / max(1, self.sync.num_participants())
        # Steps 1-3 in one pass when one fragment is finished and started.
        steps, state.steps = state.steps, 0
        tokens = self.sync.site_tokens(steps * self.tokens_per_step)
        if decided is not None and decided.fragment == index:
            state.finish_and_start(decided.sums, decided.total, buffer[:-1], share, tokens)
        else:
            if decided is not None:
                self._states[decided.fragment].finish(decided.sums, decided.total)
            state.start(buffer[:-1], share, tokens)
        if quorums.sync_quorum():  # healed: this group's progress is a peer's now
            self.start_transfer()
        else:
            self._in_flight = InFlightSync.start(
                self.sync, index, buffer, steps, tokens, scaled=True
            )
            self.plan.begin(self.clock())

    def _buffer(self, state: AsyncOuterState, reuse: torch.Tensor | None = None) -> torch.Tensor:
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
        self._outcome, delivered, sums, total = flight.decide(self.sync)
        if self._outcome.committed:  # ``total``: the buffer's token count, read once
            self._keep(flight.fragment, delivered, total)
        if flight.average_squares is not None:
            self.note_stepped_squares(flight.average_squares)
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
        self.sync.reset_error_feedback()
        for state in self._states:
            state.restart()
            state.steps = 0
        self._local_step = 0
        index = self.current_fragment()
        self._in_flight = InFlightSync.start(
            self.sync, index, self._buffer(self._states[index]), 0, 0
        )
        self.plan.begin(self.clock())

    # ---- what the trainer asks -----------------------------------------------------------------

    def in_flight(self, index: int) -> bool:
        flight = self._in_flight
        return flight is not None and flight.fragment == index and not flight.arrived

    def has_arrived(self, index: int) -> bool:
        flight = self._in_flight
        return flight is not None and flight.fragment == index and flight.arrived

    def state_bytes(self) -> dict[str, int]:
        held = super().state_bytes()
        starts = sum(t.nbytes for s in self._states for t in s.period_start.values())
        return {**held, "period_start": starts}

    def sync_buffer_bytes(self) -> int:
        # The largest fragment's all-reduce buffer and the passes' pinned staging.
        largest = max(s.numel() + 1 for s in self._states) * 4
        return largest + sum(s.passes.staging_bytes() for s in self._states)

    def extra_state(self, wait: bool = True) -> dict[str, Any]:
        """Per fragment its period's start and inner steps, and the sync in flight, waited for:
        its sums are kept, so a job restarted from the checkpoint applies it at its next sync
        point as the uninterrupted job does. If its all-reduce failed nothing is kept and the
        restarted job drops that sync (``in_flight`` stays true). ``wait=False``: kept only if
        it arrived already (a heal within a site, which must not hold the site up)."""
        flight = self._in_flight
        if flight is not None and wait:
            flight.wait_for_checkpoint(self.sync, self.agree_in_group)
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

    def await_share(self, index: int) -> None:
        """Healed from a group of its site with fragment ``index``'s sync in flight: this group
        takes the site leader's result of it at the next sync point, into a sync of its own
        that sends nothing (an arrived one loaded from the peer, or a placeholder)."""
        flight = self._in_flight
        if flight is None or flight.fragment != index:
            buffer = self._buffer(self._states[index])
            flight = self._in_flight = InFlightSync(index, buffer, AllWorks([]), 0, 0)
        flight.followed = True
        self.sync.expect([(flight.buffer[:-1], False), (flight.buffer[-1:], True)])

    def drop_in_flight(self, index: int) -> None:
        if self.in_flight(index):
            assert self._in_flight is not None
            self._in_flight.work.wait()
            self._in_flight = None

    def restore_global_copies(self, index: int) -> None:
        self._states[index].restart()

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
