"""Delayed Nesterov (DN): an outer optimizer for asynchronous DiLoCo.

Async Local-SGD steps the outer optimizer once per arriving (often stale) pseudo-gradient, and
plain Nesterov momentum then compounds stale directions. DN (Liu, Douillard et al., arXiv
2401.09135, Algorithm 3) updates the momentum once every ``N = delay`` outer steps from the
average of those steps' pseudo-gradients; in between, each step moves the parameters by its own
pseudo-gradient over ``N`` plus a fraction ``c`` of the momentum. For outer step ``t`` with
pseudo-gradient ``g_t``, momentum ``beta``, ``k = t mod N`` and momentum buffer ``m`` (zero
before its first update)::

    S_t = g_t                      if k == 0   (the first gradient of a window)
          S_{t-1} + g_t            otherwise   (state "grad_sum" carries S between steps)
    if k == N - 1 (the last step of a window):
        m   <- beta * m + S_t / N  (m <- S_t / N at the first update)
        d_t  = g_t / N + (1 - (N - 1) * c) * beta * m
        S   <- 0
    else:
        d_t  = g_t / N + c * beta * m
    theta <- theta - lr * d_t

with ``0 <= c <= 1/N`` (0 by default; the paper writes ``1 - c N + c``). With ``c = 0`` a window
is one Nesterov step on its average pseudo-gradient, spread over the window. With ``N = 1`` this
is ``torch.optim.SGD(lr, momentum, nesterov=True)`` (no dampening or weight decay) bit for bit:
same ops, same order. The formula follows ``src/halos/opt.py`` of https://github.com/utnslab/halos.

Failure semantics: ``step`` is a pure function of the state and the gradients (no clock, rank or
membership), so replicas applying the same gradients in the same order stay identical. All
checks run before anything is written: a ``step`` that raises changes nothing; an uncommitted
sync is simply not passed to ``step``. ``state_dict()`` holds all a healing replica needs: per
parameter ``momentum_buffer`` and ``grad_sum``, per group the hyperparameters and ``step`` (the
optimizer's step count: every group advances it on every call).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch.optim.optimizer import ParamsT

from torchtitan.tools.exact_division import divided

__all__ = ["DelayedNesterov", "delayed_nesterov_direction"]


def _check_hyperparameters(lr: Any, momentum: Any, delay: Any, c: Any) -> None:
    """Raise ValueError naming the first argument outside its allowed range."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if (
        not isinstance(momentum, (int, float))
        or isinstance(momentum, bool)
        or not 0.0 <= momentum < 1.0
    ):
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
        raise ValueError(f"delay must be an integer >= 1, got {delay!r}")
    # 1.0 / delay is what a caller computes for "c = 1/N", so that value itself passes.
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0.0 <= c <= 1.0 / delay:
        raise ValueError(f"c must be a number in [0, 1/delay] = [0, {1.0 / delay!r}], got {c!r}")


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")


def _next_momentum(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    grad_sum: torch.Tensor | None,
    position: int,
    momentum: float,
    delay: int,
) -> torch.Tensor:
    """The momentum buffer after a window's last step (a new tensor)."""
    # Not added to a zeroed buffer: -0.0 would become +0.0, and delay=1 must match SGD's bits.
    total = grad if position == 0 or grad_sum is None else grad_sum + grad
    average = divided(total, delay)  # CUDA would multiply by 1 / delay: other bits
    # As torch's SGD: the buffer starts as the first gradient, not momentum * 0 + grad.
    return average if momentum_buffer is None else momentum_buffer * momentum + average


def _direction_and_momentum(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    grad_sum: torch.Tensor | None,
    step: int,
    momentum: float,
    delay: int,
    c: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outer step ``step``'s direction and, on a window's last step, the new momentum buffer
    (else None). Shared by ``step`` and ``direction`` so the two cannot drift."""
    position = step % delay
    scaled = divided(grad, delay)
    new_momentum: torch.Tensor | None = None
    pulled_by: torch.Tensor | None
    if position == delay - 1:
        new_momentum = _next_momentum(grad, momentum_buffer, grad_sum, position, momentum, delay)
        pulled_by = new_momentum
        # 1 - (N - 1) c rather than the paper's 1 - N c + c: exactly 1.0 for N = 1.
        weight = momentum * (1.0 - c * (delay - 1))
    else:
        pulled_by = momentum_buffer
        weight = momentum * c
    if pulled_by is None or weight == 0.0:
        return scaled, new_momentum
    # The same call torch's SGD makes for Nesterov (grad.add(buf, alpha=momentum)).
    return scaled.add(pulled_by, alpha=weight), new_momentum


def delayed_nesterov_direction(
    grad: torch.Tensor,
    *,
    momentum_buffer: torch.Tensor | None,
    grad_sum: torch.Tensor | None,
    step: int,
    momentum: float,
    delay: int,
    c: float = 0.0,
) -> torch.Tensor:
    """The direction ``d`` (parameters move by ``-lr * d``) of outer step ``step`` (0-based)
    for pseudo-gradient ``grad``; nothing passed in is modified. ``momentum_buffer`` is None
    before the first momentum update; ``grad_sum`` sums the window's earlier pseudo-gradients
    (ignored on a window's first step)."""
    _check_hyperparameters(0.0, momentum, delay, c)  # lr does not enter the direction
    _check_step(step)
    direction, _ = _direction_and_momentum(
        grad, momentum_buffer, grad_sum, step, momentum, delay, c
    )
    return direction


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov outer optimizer (rule in the module docstring); each parameter's
    ``grad`` is its pseudo-gradient, applied with ``param.add_(d, alpha=-lr)`` as torch's SGD.

    A parameter whose ``grad`` is None is not moved and its momentum not updated, but the window
    (counted in ``step`` calls) still advances; if it misses a window's last step, what it
    accumulated in that window is dropped.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float,
        delay: int,
        c: float = 0.0,
    ) -> None:
        _check_hyperparameters(lr, momentum, delay, c)
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay, "c": c})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checked like the constructor's; its step counter starts at 0 unless
        given."""
        merged = {**self.defaults, **param_group}
        _check_hyperparameters(merged["lr"], merged["momentum"], merged["delay"], merged["c"])
        _check_step(merged.get("step", 0))
        super().add_param_group(param_group)
        self.param_groups[-1].setdefault("step", 0)

    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ValueError("param is not one of this optimizer's parameters")

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        # Also after load_state_dict or an edit of param_groups (an LR scheduler, say).
        _check_hyperparameters(group["lr"], group["momentum"], group["delay"], group["c"])
        _check_step(group["step"])

    @staticmethod
    def _check_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise ValueError("DelayedNesterov does not support sparse gradients")
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            raise ValueError(
                f"grad must have the param's shape, dtype and device: got "
                f"{tuple(grad.shape)} {grad.dtype} {grad.device} for "
                f"{tuple(param.shape)} {param.dtype} {param.device}"
            )

    @torch.no_grad()
    def direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The ``d`` the next ``step`` would apply to ``param`` if its gradient were ``grad``;
        changes no state and never aliases ``grad`` or the state. ``param.add(d, alpha=-lr)``
        is bit for bit what ``step`` leaves (so is ``param - lr * d`` when ``lr`` is a power
        of two)."""
        group = self._group_of(param)
        self._check_group(group)
        self._check_grad(param, grad)
        state = self.state.get(param, {})
        direction, _ = _direction_and_momentum(
            grad,
            state.get("momentum_buffer"),
            state.get("grad_sum"),
            group["step"],
            group["momentum"],
            group["delay"],
            group["c"],
        )
        return direction

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One outer step with every parameter's ``grad`` as its pseudo-gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # All checks before any write: a step that raises changes nothing.
        for group in self.param_groups:
            self._check_group(group)
            for p in _with_grad(group["params"]):
                assert p.grad is not None
                self._check_grad(p, p.grad)
        for group in self.param_groups:
            step, delay = group["step"], group["delay"]
            position = step % delay
            if position == delay - 1:
                for p in group["params"]:
                    stale = self.state.get(p, {}).get("grad_sum") if p.grad is None else None
                    if stale is not None:
                        stale.zero_()
            for p in _with_grad(group["params"]):
                grad = p.grad
                assert grad is not None
                state = self.state[p]
                direction, new_momentum = _direction_and_momentum(
                    grad,
                    state.get("momentum_buffer"),
                    state.get("grad_sum"),
                    step,
                    group["momentum"],
                    delay,
                    group["c"],
                )
                grad_sum = state.get("grad_sum")
                if new_momentum is not None:
                    buffer = state.get("momentum_buffer")
                    # Into the existing buffer so that its memory (pinned, say) stays.
                    if buffer is None:
                        state["momentum_buffer"] = new_momentum
                    else:
                        buffer.copy_(new_momentum)
                    if grad_sum is not None:
                        grad_sum.zero_()
                elif grad_sum is None:
                    state["grad_sum"] = grad.clone()
                elif position == 0:
                    grad_sum.copy_(grad)
                else:
                    # The same addition _next_momentum makes out of place.
                    grad_sum.add_(grad)
                p.add_(direction, alpha=-group["lr"])
            group["step"] = step + 1
        return loss


def _with_grad(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.grad is not None]
