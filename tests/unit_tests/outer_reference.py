"""The whole-fragment forms of async DiLoCo's sync point, the reference its passes
(``methods.outer_passes``) must equal bit for bit: each operation on whole tensors, the outer
step the optimizer's own ``step``, the eager start its ``sgd_step_`` (or Delayed Nesterov's
``direction``) into a temporary."""

from __future__ import annotations

import torch

from torchtitan.distributed.tensors import local_tensor
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncOuterState
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import (
    DelayedNesterov,
    sgd_step_,
)
from torchtitan.tools.exact_division import divide_


class WholeFragment:
    """``state``'s ``finish``, ``start`` and ``finish_and_start`` on whole tensors."""

    def __init__(self, state: AsyncOuterState) -> None:
        self.state = state

    @torch.no_grad()
    def finish(self, sums: torch.Tensor | None, total: float) -> None:
        state = self.state
        if sums is not None:
            grads = state.views(divide_(sums, total))
            for name, t in state.global_copy.items():
                t.grad = grads[name].to(t.device)
            state.outer.step()
            state.outer.zero_grad()
        for name, p in state.params.items():  # the local copy follows the global copy
            local = local_tensor(p.data)
            shift = state.global_copy[name] - state.period_start[name]
            local.add_(shift.to(local.device))
            state.period_start[name].copy_(state.global_copy[name])

    @torch.no_grad()
    def start(self, out: torch.Tensor, share: float | None, tokens: float = 1.0) -> None:
        state = self.state
        views = state.views(out)
        for name, local in state.locals().items():  # the pseudo-gradient
            views[name].copy_(state.period_start[name])
            views[name].sub_(local)
        lr = state.outer.param_groups[0]["lr"]
        for name, p in state.params.items():
            target = state.period_start[name]
            if share is None:
                target.copy_(state.global_copy[name])
            else:
                grad = views[name].to(target.device)
                self._outer_step_into(target, name, grad if share == 1.0 else grad * share, lr)
            local_tensor(p.data).copy_(target)
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
        self.finish(sums, total)
        self.start(out, share, tokens)

    def _outer_step_into(
        self, target: torch.Tensor, name: str, grad: torch.Tensor, lr: float
    ) -> None:
        """Global copy ``name`` moved as the outer step for ``grad`` would, into ``target``;
        the optimizer's state unchanged."""
        outer, copy = self.state.outer, self.state.global_copy[name]
        if isinstance(outer, DelayedNesterov):
            torch.sub(copy, outer.direction(copy, grad).mul_(lr), out=target)
            return
        group = outer.param_groups[0]
        momentum = outer.state.get(copy, {}).get("momentum_buffer")
        sgd_step_(
            copy, grad, momentum, lr=lr, momentum=group["momentum"], nesterov=group["nesterov"],
            first=momentum is None and group["momentum"] != 0, out=target,
            momentum_out=torch.empty_like(grad),
        )  # fmt: skip
