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
steps but as many as its speed allows (:func:`dylu_inner_steps`, decided in each sync quorum
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from torchtitan.experiments.fault_tolerance.outer_loop import (
    Ending,
    GlobalCopyLoop,
    SyncOutcome,
    as_param_layout,
    local_tensor,
)
from torchtitan.experiments.fault_tolerance.outer_optimizer import DelayedNesterov

#: How a group's next local period starts while its pseudo-gradient is being averaged.
UPDATES = ("eager", "eager_share", "delayed")


def _state_tensor(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.empty(like.shape, dtype=torch.float32, device=device)
    if t.device.type == "cpu" and torch.cuda.is_available():
        t = t.pin_memory()
    return t


def _wait_for_copies(device: torch.device) -> None:
    """Wait until the copies queued on ``device``'s current stream are done. Copies between the
    model (on CUDA) and the outer state (pinned host memory) are issued ``non_blocking``, a
    whole fragment at a time; the host waits once, before it reads what came from the device
    or overwrites what goes to it. Nothing to wait for on the CPU, where copies are done when
    they return."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _Fragment:
    """One fragment's outer state: its global copy, where this group's local period started,
    and the outer optimizer over the global copy."""

    #: Copies between the model and the outer state are queued without blocking the host
    #: (waited for where the host needs them: :func:`_wait_for_copies`). False: each copy
    #: blocks, the reference the CUDA tests compare with.
    non_blocking = True

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        lr: float,
        momentum: float,
        nesterov: bool,
        momentum_every: int,
    ) -> None:
        self.params = dict(module.named_parameters())
        self.global_ = {n: _state_tensor(local_tensor(p), device) for n, p in self.params.items()}
        self.start = {n: _state_tensor(local_tensor(p), device) for n, p in self.params.items()}
        self.outer: torch.optim.Optimizer
        if momentum_every > 1:
            self.outer = DelayedNesterov(
                list(self.global_.values()), lr=lr, momentum=momentum, delay=momentum_every
            )
        else:
            self.outer = torch.optim.SGD(
                list(self.global_.values()),
                lr=lr,
                momentum=momentum,
                nesterov=nesterov and momentum > 0,
            )
        #: Inner steps this group took since the fragment's last sync point.
        self.steps = 0
        #: Where the model's shards live (copies to and from it are queued on its stream).
        self.model_device = local_tensor(next(iter(self.params.values()))).device

    def numel(self) -> int:
        return sum(t.numel() for t in self.global_.values())

    @torch.no_grad()
    def model_to_global(self) -> None:
        """The model's current values become the global copy and the local start."""
        for name, p in self.params.items():
            self.global_[name].copy_(local_tensor(p.data), non_blocking=self.non_blocking)
        _wait_for_copies(self.model_device)
        for name in self.params:
            self.start[name].copy_(self.global_[name])

    @torch.no_grad()
    def pseudo_gradient(self, out: torch.Tensor) -> None:
        """Write start - model (this group's progress since its local period started, with
        the sign of a gradient) into the flat ``out``."""
        offset = 0
        for name, p in self.params.items():
            local = local_tensor(p.data)
            n = local.numel()
            view = out[offset : offset + n].view_as(local)
            view.copy_(self.start[name], non_blocking=self.non_blocking)
            view.sub_(local)
            offset += n
        _wait_for_copies(self.model_device)  # the host rewrites ``start`` next

    @torch.no_grad()
    def apply_average(self, flat: torch.Tensor) -> None:
        """One outer step on the global copy with the averaged pseudo-gradient ``flat``."""
        offset = 0
        for t in self.global_.values():
            n = t.numel()
            t.grad = (
                flat[offset : offset + n].view_as(t).to(t.device, non_blocking=self.non_blocking)
            )
            offset += n
        _wait_for_copies(flat.device)  # the outer step reads them on the host
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def follow_global(self) -> None:
        """Shift the local copy by how far the global copy is from the local start, and start
        the local period there: inner progress since is kept, what the period assumed about
        the global copy is replaced by what it is."""
        for name, p in self.params.items():
            local = local_tensor(p.data)
            shift = self.global_[name] - self.start[name]
            # ``shift`` is a fresh tensor nobody writes to: it may still be in flight below.
            local.add_(shift.to(local.device, non_blocking=self.non_blocking))
            self.start[name].copy_(self.global_[name])
        _wait_for_copies(self.model_device)  # the shifts are freed on return

    @torch.no_grad()
    def start_period(self, estimate: torch.Tensor | None, scale: float = 1.0) -> None:
        """Start the fragment's next local period at the global copy, moved by the outer step
        ``scale x estimate`` (a flat pseudo-gradient) would make when given (``eager``)."""
        offset = 0
        lr = self.outer.param_groups[0]["lr"]
        if estimate is not None:  # from the device to the host, all queued, waited for once
            grads = {}
            for name in self.params:
                n = self.start[name].numel()
                part = estimate[offset : offset + n].view_as(self.start[name])
                grads[name] = part.to(self.start[name].device, non_blocking=self.non_blocking)
                offset += n
            _wait_for_copies(estimate.device)
        for name, p in self.params.items():
            target = self.start[name]
            target.copy_(self.global_[name])
            if estimate is not None:
                grad = grads[name] if scale == 1.0 else grads[name] * scale
                target.sub_(self._outer_direction(name, grad), alpha=lr)
            local_tensor(p.data).copy_(target, non_blocking=self.non_blocking)
        _wait_for_copies(self.model_device)  # ``start`` is rewritten at the next sync point

    def _outer_direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The direction the outer optimizer's next step takes the global copy ``name`` along
        for gradient ``grad``, its state left as it is."""
        global_ = self.global_[name]
        if isinstance(self.outer, DelayedNesterov):
            return self.outer.direction(global_, grad)
        group = self.outer.param_groups[0]
        momentum = self.outer.state.get(global_, {}).get("momentum_buffer")
        return outer_sgd_direction(grad, momentum, group["momentum"], group["nesterov"])

    def delayed_state(self) -> dict[str, Any]:
        """Delayed Nesterov's state besides the momentum (a checkpoint needs it): where in
        its window the optimizer is, and the pseudo-gradients summed in the window so far
        (zeros where nothing is summed, so that every checkpoint has the same keys)."""
        if not isinstance(self.outer, DelayedNesterov):
            return {}
        sums = {}
        for name, p in self.params.items():
            summed = self.outer.state.get(self.global_[name], {}).get("grad_sum")
            if summed is None:
                summed = torch.zeros_like(self.global_[name])
            sums[name] = as_param_layout(p, summed)
        return {"outer_step": self.outer.param_groups[0]["step"], "grad_sum": sums}

    @torch.no_grad()
    def load_delayed_state(self, saved: dict[str, Any]) -> None:
        if not isinstance(self.outer, DelayedNesterov):
            return
        self.outer.param_groups[0]["step"] = int(saved["outer_step"])
        for name, value in saved["grad_sum"].items():
            target = self.global_[name]
            self.outer.state[target]["grad_sum"] = local_tensor(value).to(target.device, copy=True)

    def state_for_heal(self) -> dict[str, Any]:
        return {
            "global": dict(self.global_),
            "start": dict(self.start),
            "outer": self.outer.state_dict(),
            "steps": self.steps,
        }

    @torch.no_grad()
    def load_from_heal(self, state: dict[str, Any]) -> None:
        """The peer's global copy, outer state and local start (which goes with the model the
        peer sends alongside): this group goes on exactly as the peer."""
        for name, value in state["global"].items():
            self.global_[name].copy_(value)
            self.start[name].copy_(state["start"][name])
        self.outer.load_state_dict(state["outer"])
        # The peer's inner steps since the fragment's last sync point go with its model (a
        # group that was behind in a sync quorum then drops them: ``AsyncDiLoCo._after_heal``).
        self.steps = int(state.get("steps", 0))


def outer_sgd_direction(
    grad: torch.Tensor, momentum_buffer: torch.Tensor | None, momentum: float, nesterov: bool
) -> torch.Tensor:
    """The direction ``torch.optim.SGD`` (no weight decay, no dampening) steps along for
    ``grad`` with this momentum buffer, without changing the buffer: the estimate ``eager``
    applies is exactly the step the outer optimizer would take if every group had sent the
    same pseudo-gradient as this one."""
    if momentum == 0:
        return grad
    buf = grad.clone() if momentum_buffer is None else momentum_buffer * momentum + grad
    return grad + momentum * buf if nesterov else buf


def dylu_inner_steps(period: int, step_seconds: list[float], mine: float) -> int:
    """DyLU: this group's inner steps for the next period, so that every group reaches the sync
    point at about the same time. ``step_seconds``: every group's seconds per inner step in its
    last period (0: not measured yet, e.g. just (re)started); ``mine``: this group's.

    The slowest group takes the whole steps closest to the time the fastest group needs for
    ``period`` steps; that time (its steps x its step time) is the period's length, and every
    other group takes the whole steps closest to it (up to ``2 * period``). A group then waits
    at most about half of its own step for the others, whatever the speeds. Every group
    computes this from the same exchanged numbers, so the plans fit together. Unmeasured
    groups take ``period`` steps."""
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
    """The whole inner steps this period should take in all, ``taken`` of them done in
    ``elapsed`` seconds, to end closest to ``length`` seconds after it began: this period's
    own speed corrects the plan made from the last one (at least ``taken``, at most
    ``2 * period``)."""
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


@dataclass
class _InFlight:
    """A started all-reduce: ``buffer`` holds [sum of tokens x pseudo-gradient, sum of tokens]
    once ``work`` is done."""

    fragment: int
    buffer: torch.Tensor
    work: Any
    #: This group's inner steps and tokens in the sync (its weight before normalizing).
    inner_steps: int
    tokens: int
    #: The result is in ``buffer`` (waited for; or loaded from a checkpoint).
    arrived: bool = False


class _AllOf:
    """The works of one sync's all-reduce: the pseudo-gradient and, exact, the token count."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class _Arrived:
    """The work of an all-reduce whose result is already in its buffer."""

    def wait(self) -> None:
        pass


class AsyncDiLoCo(GlobalCopyLoop):
    """DiLoCo whose outer step is applied one sync point later, overlapped with compute."""

    method = "async_diloco"

    def __init__(
        self,
        manager: Any,
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
    ) -> None:
        """``manager``: the sync Manager (quorum, all-reduce, should_commit, state for
        healing); ``sync_steps``: inner steps between two syncs of one fragment; ``update``:
        ``eager`` or ``delayed``; ``tokens_per_step``: tokens this group trains on per inner
        step (the weight of its pseudo-gradients)."""
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, not {update!r}")
        self.manager = manager
        self.fragments = fragments
        self.period = sync_steps // len(fragments)
        self.update = update
        self.tokens_per_step = tokens_per_step
        self.inner_optimizer = inner_optimizer
        self._states = [
            _Fragment(
                f, state_device, outer_lr, outer_momentum, outer_nesterov, outer_momentum_every
            )
            for f in fragments
        ]
        self._local_step = 0
        #: Inner steps of the current period (``period`` unless DyLU planned fewer).
        self._steps_this_period = self.period
        #: DyLU: the planned length of the current period in seconds (0: none), and the
        #: inner step after which the step count is corrected to it (None: not corrected).
        self._period_seconds = 0.0
        self._replan_at: int | None = None
        #: The most of this group's ranks' numbers (the trainer sets a MAX all-reduce when the
        #: group has more than one rank).
        self.agree_in_group: Callable[[int], int] = lambda n: n
        self.sync_points = 0
        #: When the current period's inner steps began, and this group's seconds per inner
        #: step in the last period that ended (0: none yet).
        self._period_began: float | None = None
        self._step_seconds = 0.0
        self._in_flight: _InFlight | None = None
        self._outcome: SyncOutcome | None = None
        #: Set when torchft loaded a peer's state into this group in the last quorum.
        self._healed = False
        self.take_global_copies()
        for index, state in enumerate(self._states):
            manager.register_state_dict_fn(
                f"async_diloco_fragment_{index}",
                lambda saved, state=state: self._load_from_heal(state, saved),
                state.state_for_heal,
            )
        manager.register_state_dict_fn("async_diloco_progress", self._load_progress, self._progress)

    # ---- the loop ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _installed(self) -> Iterator[AsyncDiLoCo]:
        self._period_began = time.perf_counter()
        handles = [
            self.inner_optimizer.register_step_pre_hook(self._before_step),
            self.inner_optimizer.register_step_post_hook(self._after_step),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def hooks(self) -> contextlib.AbstractContextManager:
        return self._installed()

    def _before_step(self, *_: Any) -> None:
        # Parameters change in the step: a peer must not read them for a heal meanwhile.
        self.manager.disallow_state_dict_read()

    def _after_step(self, *_: Any) -> None:
        self.manager.allow_state_dict_read()
        for state in self._states:
            state.steps += 1
        self._local_step += 1
        if self._local_step == self._replan_at:
            self._replan()
        if self._local_step >= self._steps_this_period:
            self.sync_point()

    def sync_point(self) -> None:
        """Finish the sync in flight, start this fragment's (see the module docstring)."""
        if self._period_began is not None and self._local_step > 0:
            self._step_seconds = (time.perf_counter() - self._period_began) / self._local_step
        self.sync_points += 1
        # At the quorum every group is at inner step 0 of its next period, whatever the length
        # of the one it ended (DyLU): a group healing from it continues from there.
        self._local_step = 0
        self._outcome = self._finish_in_flight()
        index = self.current_fragment()
        state = self._states[index]
        buffer = self._buffer(state)
        state.pseudo_gradient(buffer[:-1])
        if self.update == "delayed":
            state.start_period(None)
        else:
            # eager_share: this group's share of the average now, the others' when it arrives.
            share = 1.0 if self.update == "eager" else 1 / max(1, self.manager.num_participants())
            state.start_period(buffer[:-1], share)
        steps, state.steps = state.steps, 0
        self._healed = False
        self.manager.start_quorum()
        if self._healed:  # this group's progress was replaced by a peer's state
            self._after_heal()
            steps = 0
            # The peer may be a sync ahead (its Manager step is now this group's): take part
            # in the all-reduce it starts, of the fragment it syncs.
            index = self.current_fragment()
            buffer = self._buffer(self._states[index])
        self._start_all_reduce(index, buffer, steps)
        self._period_began = time.perf_counter()

    def _buffer(self, state: _Fragment) -> torch.Tensor:
        device = local_tensor(next(iter(state.params.values()))).device
        return torch.empty(state.numel() + 1, dtype=torch.float32, device=device)

    def _start_all_reduce(self, index: int, buffer: torch.Tensor, steps: int) -> None:
        """All-reduce (SUM) ``[tokens x pseudo-gradient, tokens]`` for the pseudo-gradient in
        ``buffer[:-1]``, from ``steps`` inner steps (0: this group sends zeros)."""
        tokens = steps * self.tokens_per_step
        if tokens == 0:
            buffer.zero_()
        else:
            buffer[:-1].mul_(tokens)
            buffer[-1] = tokens
        # The pseudo-gradient as pseudo_grad_dtype says, the token count exact (fp32, no error
        # feedback); all of it sent now, to arrive while the next period computes.
        works = [
            self.manager.allreduce(buffer[:-1], reduce_op=ReduceOp.SUM),
            self.manager.allreduce(buffer[-1:], reduce_op=ReduceOp.SUM, exact=True),
        ]
        self.manager.flush()
        self._in_flight = _InFlight(index, buffer, _AllOf(works), steps, tokens)

    def _finish_in_flight(self) -> SyncOutcome | None:
        """Wait for the sync in flight, commit it or not, apply it or not (alike in every
        group), and let its fragment's local copy follow the global copy."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        flight.work.wait()  # a failed all-reduce is recorded by the Manager, not raised
        committed = bool(self.manager.should_commit())
        state = self._states[flight.fragment]
        total = float(flight.buffer[-1])
        if committed and total > 0:
            state.apply_average(flight.buffer[:-1].div_(total))
        state.follow_global()
        number = self.manager.current_step() + (0 if committed else 1)
        # Bytes of a sync loaded as arrived from a checkpoint: its payload (it was sent by the
        # process that saved it).
        sent, compression_s = (
            (flight.buffer.numel() * 4, None)
            if isinstance(flight.work, _Arrived)
            else self.manager.sync_stats()
        )
        return SyncOutcome(
            number,
            flight.fragment,
            committed,
            sent,
            self.manager.num_participants(),
            compression_s=compression_s,
            inner_steps=flight.inner_steps,
            tokens=flight.tokens,
            weight=flight.tokens / total if committed and total > 0 else None,
        )

    # ---- DyLU ---------------------------------------------------------------------------------

    def step_seconds(self) -> float:
        """This group's seconds per inner step in its last period (0: no period yet)."""
        return self._step_seconds

    def plan_period(self, steps: int, seconds: float = 0.0) -> None:
        """The next period (which starts after this quorum) takes ``steps`` inner steps; with
        ``seconds`` (the period's planned length), the group corrects its step count by its
        speed in the period so far (:func:`dylu_steps_to_deadline`) halfway through it, then
        halfway through what is left, until one step is left (:func:`dylu_next_correction`):
        how fast a group computes varies from one period to the next and within one, and an
        error of the estimate would otherwise make the other groups wait for all of it."""
        if not 1 <= steps <= 2 * self.period:
            raise ValueError(f"a period takes 1 to {2 * self.period} inner steps, not {steps}")
        self._steps_this_period = steps
        self._period_seconds = seconds
        self._replan_at = dylu_next_correction(0, steps) if seconds > 0 else None

    def _replan(self) -> None:
        if self._period_began is None:  # restarted mid-period: keep the plan
            self._replan_at = None
            return
        elapsed = time.perf_counter() - self._period_began
        steps = dylu_steps_to_deadline(self._local_step, elapsed, self._period_seconds, self.period)
        # Every rank of the group takes the same number of steps, and so corrects at the same
        # step next time.
        self._steps_this_period = self.agree_in_group(steps)
        self._replan_at = dylu_next_correction(self._local_step, self._steps_this_period)

    def steps_this_period(self) -> int:
        return self._steps_this_period

    # ---- healing -----------------------------------------------------------------------------

    def _progress(self) -> dict[str, Any]:
        """Sent to a group that heals from this one: the job's progress and, from a starting
        group, the sync its checkpoint holds as arrived (applied at the next sync point; a
        running group has nothing in flight in a sync quorum)."""
        state: dict[str, Any] = {"sync_points": self.sync_points}
        flight = self._in_flight
        if flight is not None and flight.arrived:
            state["arrived"] = {
                "fragment": flight.fragment,
                "buffer": flight.buffer,
                "inner_steps": flight.inner_steps,
                "tokens": flight.tokens,
            }
        return state

    def _load_progress(self, saved: dict[str, Any]) -> None:
        """The peer's progress, and its arrived sync in place of this group's own: both groups
        then apply the same average at the next sync point."""
        self.sync_points = int(saved["sync_points"])
        arrived = saved.get("arrived")
        self._in_flight = None
        if arrived is not None:
            self._in_flight = _InFlight(
                int(arrived["fragment"]),
                arrived["buffer"].detach().clone(),
                _Arrived(),
                int(arrived["inner_steps"]),
                int(arrived["tokens"]),
                arrived=True,
            )

    def _load_from_heal(self, state: _Fragment, saved: dict[str, Any]) -> None:
        state.load_from_heal(saved)
        self._healed = True

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
        self._period_began = time.perf_counter()
        return False

    # ---- what the trainer asks -----------------------------------------------------------------

    def local_step(self) -> int:
        return self._local_step

    def set_local_step(self, step: int) -> None:
        self._local_step = step

    def current_fragment(self) -> int:
        return self.manager.current_step() % len(self.fragments)

    def global_parameters(self, index: int) -> dict[str, torch.Tensor]:
        return self._states[index].global_

    def outer_optimizer(self, index: int) -> torch.optim.Optimizer:
        return self._states[index].outer

    def outer_parameters(self, index: int) -> dict[str, torch.Tensor]:
        return self._states[index].global_

    def in_flight(self, index: int) -> bool:
        flight = self._in_flight
        return flight is not None and flight.fragment == index and not flight.arrived

    def extra_state(self) -> dict[str, Any]:
        """Per fragment the start of the local period and its inner-step count, and the sync
        in flight: waited for here (a checkpoint blocks anyway), its summed result kept, so that
        a job restarted from the checkpoint applies it at its next sync point as the
        uninterrupted job does. Unless the all-reduce failed: then nothing is kept, and the
        restarted job drops that sync (``in_flight`` stays true)."""
        flight = self._in_flight
        if flight is not None and not flight.arrived:
            flight.work.wait()
            # Every rank of the group decides alike (each sees only its own shard's failure).
            failed = self.agree_in_group(int(self.manager.sync_failed()))
            flight.arrived = not failed
        kept = flight if flight is not None and flight.arrived else None
        state: dict[str, Any] = {"sync_points": self.sync_points}
        for index, fs in enumerate(self._states):
            state[f"fragment_{index}"] = {
                "local_start": {
                    name: as_param_layout(p, fs.start[name]) for name, p in fs.params.items()
                },
                "steps": fs.steps,
                **fs.delayed_state(),
            }
        # Every parameter of the model has an entry (zeros outside the kept fragment), so the
        # keys do not depend on which fragment was in flight.
        arrived_sum: dict[str, dict[str, torch.Tensor]] = {}
        for index, fs in enumerate(self._states):
            offset = 0
            part_of = arrived_sum[f"fragment_{index}"] = {}
            for name, p in fs.params.items():
                local = local_tensor(p.data)
                part = (
                    kept.buffer[offset : offset + local.numel()].view_as(local)
                    if kept is not None and kept.fragment == index
                    else torch.zeros_like(fs.global_[name])  # where the outer state lives
                )
                part_of[name] = as_param_layout(p, part)
                offset += local.numel()
        state["arrived"] = {
            "fragment": kept.fragment if kept is not None else -1,
            "inner_steps": kept.inner_steps if kept is not None else 0,
            "own_tokens": kept.tokens if kept is not None else 0,
            "sum": arrived_sum,
            "tokens": float(kept.buffer[-1]) if kept is not None else 0.0,
        }
        return state

    @torch.no_grad()
    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.sync_points = int(state["sync_points"])
        for index, fs in enumerate(self._states):
            saved = state[f"fragment_{index}"]
            for name, value in saved["local_start"].items():
                fs.start[name].copy_(local_tensor(value))
            fs.steps = int(saved["steps"])
            fs.load_delayed_state(saved)
        arrived = state["arrived"]
        self._in_flight = None
        fragment = int(arrived["fragment"])
        if fragment >= 0:
            sums = arrived["sum"][f"fragment_{fragment}"]
            parts = [
                local_tensor(sums[n]).reshape(-1).float() for n in self._states[fragment].params
            ]
            tokens = torch.tensor([float(arrived["tokens"])], device=parts[0].device)
            buffer = torch.cat([*parts, tokens])
            self._in_flight = _InFlight(
                fragment,
                buffer,
                _Arrived(),
                int(arrived["inner_steps"]),
                int(arrived["own_tokens"]),
                arrived=True,
            )

    def drop_in_flight(self, index: int) -> None:
        if self.in_flight(index):
            assert self._in_flight is not None
            self._in_flight.work.wait()
            self._in_flight = None

    def restore_global_copies(self, index: int) -> None:
        self._states[index].start_period(None)

    def take_global_copies(self) -> None:
        for state in self._states:
            state.model_to_global()
            state.outer.state.clear()

    def last_outcome(self, manager: Any) -> SyncOutcome | None:
        return self._outcome

    def finish(self) -> Ending:
        """Finish the sync in flight (the job's last average counts), then every fragment's
        global copy goes into the model."""
        self._outcome = self._finish_in_flight()
        for index in range(len(self.fragments)):
            self.restore_global_copies(index)
        return Ending(self._outcome is not None, 0, self._local_step or None)
