"""Async DiLoCo's state (``async_diloco`` runs the algorithm around it).

* :class:`FragmentState`, one per fragment: its global copy, outer optimizer, where this
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from torchtitan.experiments.fault_tolerance.global_copy import Fragment, MakeOuter, state_tensor
from torchtitan.experiments.fault_tolerance.outer_loop import (
    SyncOutcome,
    as_param_layout,
    local_tensor,
)
from torchtitan.experiments.fault_tolerance.outer_optimizer import DelayedNesterov, sgd_step_
from torchtitan.experiments.fault_tolerance.outer_passes import SyncPointPasses, wait_for_copies
from torchtitan.tools.digest import chunk_hashes
from torchtitan.tools.exact_division import divide_

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync_quorum import SyncManager


class FragmentState(Fragment):
    """One fragment's outer state (:class:`~.global_copy.Fragment`) and where this group's local
    period started."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        make_outer: MakeOuter,
        host_threads: int = 0,
    ) -> None:
        """``device``: where the outer state lives; ``host_threads``: for a sync point's host
        work (0: this rank's share of the host's cores)."""
        super().__init__(module, make_outer, device)
        self.period_start = {
            n: state_tensor(local_tensor(p), device) for n, p in self.params.items()
        }
        #: Inner steps this group took since the fragment's last sync point.
        self.steps = 0
        #: A sync point's host work in passes, where they apply (``passes.usable()``).
        self.passes = SyncPointPasses(
            self.params, self.global_copy, self.period_start, self.outer, self.model_device,
            host_threads,
        )  # fmt: skip

    # ---- a sync point --------------------------------------------------------------------------

    def finish(self, sums: torch.Tensor | None, total: float) -> None:
        """The outer step with the average ``sums / total`` (None: the sync is dropped, no
        step), then the local copy follows the global copy (:meth:`follow_global`)."""
        if self.passes.usable():
            self.passes.finish(sums, total)
            return
        if sums is not None:
            self.outer_step(self.views(divide_(sums, total)))
        self.follow_global()

    def start(self, out: torch.Tensor, share: float | None, tokens: float = 1.0) -> None:
        """This group's pseudo-gradient into ``out``, the next local period (:meth:`start_period`
        with ``share x out``; ``share`` None: none), then ``out`` scaled by ``tokens``."""
        if self.passes.usable():
            self.passes.start(out, share, tokens)
            return
        self.pseudo_gradient(out)
        self.start_period(None if share is None else out, 1.0 if share is None else share)
        if tokens != 1.0:
            out.mul_(tokens)

    def finish_and_start(
        self,
        sums: torch.Tensor | None,
        total: float,
        out: torch.Tensor,
        share: float | None,
        tokens: float = 1.0,
    ) -> None:
        """:meth:`finish` then :meth:`start`, in one pass where the passes allow."""
        if self.passes.usable():
            self.passes.finish_and_start(sums, total, out, share, tokens)
            return
        self.finish(sums, total)
        self.start(out, share, tokens)

    def global_chunk_hashes(self) -> list[int]:
        """The global copy's chunk hashes (``tools.digest``), taken once per change."""
        if self.passes.usable():
            return self.passes.global_chunk_hashes()
        return [h for t in self.global_copy.values() for h in chunk_hashes(t)]

    # ---- whole-fragment operations (other outer optimizers, heals); the passes' reference ----

    @torch.no_grad()
    def take_model(self) -> None:
        """The model's current values become the global copy and the local start."""
        super().take_model()
        for name in self.params:
            self.period_start[name].copy_(self.global_copy[name])

    @torch.no_grad()
    def pseudo_gradient(self, out: torch.Tensor) -> None:
        """start - model (the progress since the local period started, as a gradient) into the
        flat ``out``."""
        views = self.views(out)
        for name, local in self.locals().items():
            views[name].copy_(self.period_start[name], non_blocking=self.non_blocking)
            views[name].sub_(local)
        wait_for_copies(self.model_device)  # the host rewrites ``start`` next

    @torch.no_grad()
    def follow_global(self) -> None:
        """Shift the local copy by global copy - local start and start the period there: the
        inner progress is kept, what the period assumed of the global copy is replaced."""
        for name, p in self.params.items():
            local = local_tensor(p.data)
            shift = self.global_copy[name] - self.period_start[name]
            # ``shift`` is a fresh tensor nobody writes to: it may still be in flight below.
            local.add_(shift.to(local.device, non_blocking=self.non_blocking))
            self.period_start[name].copy_(self.global_copy[name])
        wait_for_copies(self.model_device)  # the shifts are freed on return

    @torch.no_grad()
    def start_period(self, estimate: torch.Tensor | None, scale: float = 1.0) -> None:
        """Start the next local period at the global copy, moved by the outer step ``scale x
        estimate`` (a flat pseudo-gradient) would make when given (``eager``)."""
        lr = self.outer.param_groups[0]["lr"]
        if estimate is not None:  # from the device to the host, all queued, waited for once
            grads = {
                name: view.to(self.period_start[name].device, non_blocking=self.non_blocking)
                for name, view in self.views(estimate).items()
            }
            wait_for_copies(estimate.device)
        for name, p in self.params.items():
            target = self.period_start[name]
            if estimate is None:
                target.copy_(self.global_copy[name])
            else:
                grad = grads[name] if scale == 1.0 else grads[name] * scale
                self._outer_step_into(target, name, grad, lr)
            local_tensor(p.data).copy_(target, non_blocking=self.non_blocking)
        wait_for_copies(self.model_device)  # ``start`` is rewritten at the next sync point

    def _outer_step_into(
        self, target: torch.Tensor, name: str, grad: torch.Tensor, lr: float
    ) -> None:
        """Write into ``target`` global copy ``name`` moved as the outer step for ``grad`` would
        move it, the optimizer's state unchanged (its own step, the momentum updated into a
        temporary: ``eager`` lands exactly where the outer step would)."""
        copy = self.global_copy[name]
        if isinstance(self.outer, DelayedNesterov):
            torch.sub(copy, self.outer.direction(copy, grad).mul_(lr), out=target)
            return
        group = self.outer.param_groups[0]
        momentum = self.outer.state.get(copy, {}).get("momentum_buffer")
        first = momentum is None and group["momentum"] != 0
        sgd_step_(
            copy, grad, momentum, lr=lr, momentum=group["momentum"], nesterov=group["nesterov"],
            first=first, out=target, momentum_out=torch.empty_like(grad),
        )  # fmt: skip

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


class _AllTransfers:
    """The works of one sync's all-reduce: the pseudo-gradient and, exact, the token count
    (none: its result was loaded from a checkpoint or a peer)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@dataclass
class InFlightSync:
    """A started all-reduce: ``buffer`` holds [sum of tokens x pseudo-gradient, sum of tokens]
    once ``work`` is done."""

    fragment: int
    buffer: torch.Tensor
    work: _AllTransfers
    #: This group's inner steps and tokens in the sync (its weight before normalizing).
    inner_steps: int
    tokens: int
    #: The result is in ``buffer`` (waited for; or loaded from a checkpoint or a peer).
    arrived: bool = False
    #: Once committed (:meth:`decide`): the average's sum of squares, this rank's shard's.
    average_squares: float | None = None

    @property
    def loaded(self) -> bool:
        """The result came from a checkpoint or a peer, not from this process's transfers."""
        return not self.work.works

    @classmethod
    def start(
        cls,
        manager: SyncManager,
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
        # The token count exact (fp32, no error feedback); both sent now, to arrive meanwhile.
        works = [
            manager.allreduce(buffer[:-1], reduce_op=ReduceOp.SUM),
            manager.allreduce(buffer[-1:], reduce_op=ReduceOp.SUM, exact=True),
        ]
        manager.flush()
        return cls(fragment, buffer, _AllTransfers(works), steps, tokens)

    def decide(self, manager: SyncManager) -> tuple[SyncOutcome, torch.Tensor | None, float]:
        """Wait, commit or not (alike in every group): the outcome, the sums to average (None:
        nothing to apply) and their total of tokens; the average's sum of squares goes into
        :attr:`average_squares`."""
        self.work.wait()  # a failed all-reduce is recorded by the Manager, not raised
        committed = bool(manager.should_commit())
        total = float(self.buffer[-1])
        sums = self.buffer[:-1] if committed and total > 0 else None
        if sums is not None:
            # Taken by the transport where the sums arrived; a loaded sync's here.
            found = None if self.loaded else manager.sync_squares()
            found = float(torch.dot(sums, sums)) if found is None else found
            self.average_squares = found / total**2
        # A loaded sync's bytes: its payload (the process that saved it sent it).
        sent, compression_s = (
            (self.buffer.numel() * 4, None) if self.loaded else manager.sync_stats()
        )
        outcome = SyncOutcome(
            manager.current_step() + (0 if committed else 1),
            self.fragment,
            committed,
            sent,
            manager.num_participants(),
            compression_s=compression_s,
            inner_steps=self.inner_steps,
            tokens=self.tokens,
            weight=self.tokens / total if committed and total > 0 else None,
        )
        return outcome, sums, total

    def wait_for_checkpoint(self, manager: SyncManager, agree: Callable[[int], int]) -> None:
        """Wait for the result and mark it arrived unless the all-reduce failed; ``agree``: the
        most of the group's ranks' numbers (each rank sees only its own shards' failure)."""
        if self.arrived:
            return
        self.work.wait()
        self.arrived = not agree(int(manager.sync_failed()))

    def for_heal(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("fragment", "buffer", "inner_steps", "tokens")}

    @classmethod
    def from_heal(cls, saved: dict[str, Any]) -> InFlightSync:
        return cls(
            int(saved["fragment"]),
            saved["buffer"].detach().clone(),
            _AllTransfers([]),
            int(saved["inner_steps"]),
            int(saved["tokens"]),
            arrived=True,
        )


def checkpoint_arrived(kept: InFlightSync | None, states: list[FragmentState]) -> dict[str, Any]:
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


def load_arrived(saved: dict[str, Any], states: list[FragmentState]) -> InFlightSync | None:
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
        _AllTransfers([]),
        int(saved["inner_steps"]),
        int(saved["own_tokens"]),
        arrived=True,
    )
