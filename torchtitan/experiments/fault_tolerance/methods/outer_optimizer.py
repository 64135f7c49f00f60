"""The outer optimizers: :class:`OuterSGD` (SGD, plain or with Nesterov momentum) and Delayed
Nesterov (:class:`DelayedNesterov`, for asynchronous DiLoCo).

Both step the global copies, which every group must hold bit for bit on whatever host it runs,
so every value goes through operations with one IEEE rounding each (``docs/design.md``, "Bits
the groups agree on"): a product, then a sum, never ``add(x, alpha=a)``, ``addcmul``, ``lerp``
or a fused optimizer kernel, whose vectorized kernels contract ``a * x + y`` into one fused
multiply-add on AVX2, AVX-512 and Arm but not in x86-64's portable ATen kernels. There
(``ATEN_CPU_CAPABILITY=default``), on float32, ``OuterSGD`` is torch's SGD bit for bit; on any
CPU it is the same rule in NumPy float32 (``tests/unit_tests/test_host_arithmetic.py``).
:func:`sgd_step_` is SGD's step on one tensor (or a piece of one: every operation is
element-wise), the one ``OuterSGD.step``, async DiLoCo's host passes and its eager estimate call.

Delayed Nesterov (DN): async Local-SGD steps the outer optimizer once per arriving (often
stale) pseudo-gradient, and plain Nesterov momentum then compounds stale directions. DN (Liu,
Douillard et al., arXiv 2401.09135, Algorithm 3) updates the momentum once every ``N = delay``
outer steps from the average of those steps' pseudo-gradients; in between, each step moves the
parameters by its own pseudo-gradient over ``N`` plus a fraction ``c`` of the momentum. For
outer step ``t`` with pseudo-gradient ``g_t``, momentum ``beta``, ``k = t mod N`` and momentum
buffer ``m`` (zero before its first update)::

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
is ``OuterSGD(lr, momentum, nesterov=True)`` bit for bit: same operations, same order. The
formula follows ``src/halos/opt.py`` of https://github.com/utnslab/halos.

Failure semantics: a ``step`` is a pure function of the state and the gradients (no clock,
rank, membership or host), so replicas applying the same gradients in the same order stay
identical. All checks run before anything is written: a ``step`` that raises changes nothing;
an uncommitted sync is simply not passed to ``step``. ``state_dict()`` holds all a healing
replica needs: per parameter ``momentum_buffer`` (and DN's ``grad_sum``), per group the
hyperparameters (and DN's ``step``, its count of outer steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, overload

import torch
from torch.optim.optimizer import ParamsT

from torchtitan.tools.exact_division import divided

__all__ = [
    "DelayedNesterov",
    "DelayedNesterovBuffers",
    "delayed_nesterov_buffers",
    "delayed_nesterov_estimate",
    "delayed_nesterov_step_",
    "OuterSGD",
    "delayed_nesterov_direction",
    "outer_optimizer",
    "sgd_step_",
]


def sgd_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    first: bool,
    scratch: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    momentum_out: torch.Tensor | None = None,
) -> None:
    """One SGD step on ``param`` (a tensor, or any piece of one) for ``grad``, with torch's
    SGD's operations in its order (no dampening, weight decay or maximize), each rounded on its
    own: the same bits on every host and device.

    ``momentum_buffer``: the momentum (needed when ``momentum`` > 0, but at the optimizer's
    ``first`` step with ``momentum_out``; a first step's momentum is ``grad`` itself, as
    torch's). ``out``: where the stepped
    values go (None: into ``param``); ``momentum_out``: where the updated momentum goes (None:
    into ``momentum_buffer``): with both, nothing of the optimizer's changes (async DiLoCo's
    estimate of a step). ``scratch``: room of ``param``'s size for the temporary (None:
    allocated). No two of them may alias, except ``out`` with ``param``; ``grad`` is left as
    it was."""
    direction, temporary = grad, False
    if momentum != 0:
        updated = momentum_buffer if momentum_out is None else momentum_out
        assert updated is not None, "SGD with momentum needs its buffer"
        if not first:  # buffer x momentum + grad
            assert momentum_buffer is not None, "SGD with momentum needs its buffer"
            torch.mul(momentum_buffer, momentum, out=updated).add_(grad)
        elif momentum_out is None:
            updated.copy_(grad)
        else:
            updated = grad  # read below, never written
        direction = updated
        if nesterov:  # grad + momentum x buffer: torch's grad.add(buf, alpha=momentum)
            direction = torch.mul(updated, momentum, out=scratch).add_(grad)
            temporary = True
    # param - lr x direction: torch's param.add_(direction, alpha=-lr)
    step = direction.mul_(lr) if temporary else torch.mul(direction, lr, out=scratch)
    torch.sub(param, step, out=param if out is None else out)


def _check_lr_and_momentum(lr: Any, momentum: Any) -> None:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if (
        not isinstance(momentum, (int, float))
        or isinstance(momentum, bool)
        or not 0.0 <= momentum < 1.0
    ):
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")


def _check_sgd(lr: Any, momentum: Any, nesterov: Any) -> None:
    """Raise ValueError naming the first of SGD's arguments outside its allowed range."""
    _check_lr_and_momentum(lr, momentum)
    if not isinstance(nesterov, bool) or (nesterov and momentum == 0):
        raise ValueError(f"nesterov must be a bool, and False with momentum 0, got {nesterov!r}")


class _CheckedStep(torch.optim.Optimizer):
    """An outer optimizer's ``step``: every group and gradient checked before anything is
    written (a step that raises changes nothing), then each group stepped."""

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
        for group in self.param_groups:
            self._check_group(group)
            for p in _with_grad(group["params"]):
                assert p.grad is not None
                _check_grad(p, p.grad, type(self).__name__)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        """Raise ValueError naming the group's first setting out of range (also after a
        ``load_state_dict`` or an edit of ``param_groups``, an LR scheduler's, say)."""
        raise NotImplementedError

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError


class OuterSGD(_CheckedStep):
    """SGD with optional (Nesterov) momentum whose step has the same bits on every host
    (:func:`sgd_step_`); ``torch.optim.SGD``'s on float32 with x86-64's
    ``ATEN_CPU_CAPABILITY=default``. Its state is torch's SGD's: ``momentum_buffer`` per
    parameter, from its first step with momentum. A parameter without ``grad`` is left
    alone."""

    def __init__(
        self, params: ParamsT, lr: float, momentum: float = 0.0, nesterov: bool = False
    ) -> None:
        _check_sgd(lr, momentum, nesterov)
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        _check_sgd(group["lr"], group["momentum"], group["nesterov"])

    def _step_group(self, group: dict[str, Any]) -> None:
        momentum = group["momentum"]
        for p in _with_grad(group["params"]):
            assert p.grad is not None
            buffer, first = None, False
            if momentum != 0:
                buffer = self.state[p].get("momentum_buffer")
                if buffer is None:
                    buffer = self.state[p]["momentum_buffer"] = torch.empty_like(p.grad)
                    first = True
            sgd_step_(
                p, p.grad, buffer, lr=group["lr"], momentum=momentum,
                nesterov=group["nesterov"], first=first,
            )  # fmt: skip


def _check_grad(param: torch.Tensor, grad: torch.Tensor, optimizer: str) -> None:
    if grad.is_sparse:
        raise ValueError(f"{optimizer} does not support sparse gradients")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise ValueError(
            f"grad must have the param's shape, dtype and device: got "
            f"{tuple(grad.shape)} {grad.dtype} {grad.device} for "
            f"{tuple(param.shape)} {param.dtype} {param.device}"
        )


def _check_hyperparameters(lr: Any, momentum: Any, delay: Any, c: Any) -> None:
    """Raise ValueError naming the first argument outside its allowed range."""
    _check_lr_and_momentum(lr, momentum)
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
    # What torch's SGD computes for Nesterov (grad.add(buf, alpha=momentum)), rounded twice.
    return scaled.add_(pulled_by * weight), new_momentum


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


class DelayedNesterov(_CheckedStep):
    """Delayed Nesterov outer optimizer (rule in the module docstring); each parameter's
    ``grad`` is its pseudo-gradient, applied as ``param -= d * lr`` (two roundings).

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
        _check_hyperparameters(group["lr"], group["momentum"], group["delay"], group["c"])
        _check_step(group["step"])

    @torch.no_grad()
    def direction(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The ``d`` the next ``step`` would apply to ``param`` if its gradient were ``grad``;
        changes no state and never aliases ``grad`` or the state. ``param.sub(d * lr)`` is
        bit for bit what ``step`` leaves."""
        group = self._group_of(param)
        self._check_group(group)
        _check_grad(param, grad, "DelayedNesterov")
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

    def _step_group(self, group: dict[str, Any]) -> None:
        step, delay = group["step"], group["delay"]
        last = step % delay == delay - 1
        if last:
            for p in group["params"]:
                stale = self.state.get(p, {}).get("grad_sum") if p.grad is None else None
                if stale is not None:
                    stale.zero_()
        for p in _with_grad(group["params"]):
            assert p.grad is not None
            buffers = delayed_nesterov_buffers(self.state[p], p.grad, last)
            delayed_nesterov_step_(
                p, p.grad, *buffers, step=step, lr=group["lr"], momentum=group["momentum"],
                delay=delay, c=group["c"],
            )  # fmt: skip
            buffers.keep(self.state[p])
        group["step"] = step + 1


class DelayedNesterovBuffers(NamedTuple):
    """Where a Delayed Nesterov step reads and writes a parameter's momentum and window sum
    (None: the step needs none), and whether each holds nothing yet (allocated for this
    step: not read)."""

    momentum: torch.Tensor | None
    grad_sum: torch.Tensor | None
    fresh_momentum: bool
    fresh_sum: bool

    def keep(self, state: dict[str, Any]) -> None:
        """Put the buffers the step wrote for the first time into the optimizer's ``state``
        (after the step: a step that fails keeps none)."""
        if self.fresh_momentum and self.momentum is not None:
            state["momentum_buffer"] = self.momentum
        if self.fresh_sum and self.grad_sum is not None:
            state["grad_sum"] = self.grad_sum


def delayed_nesterov_buffers(
    state: dict[str, Any], like: torch.Tensor, last: bool
) -> DelayedNesterovBuffers:
    """A parameter's buffers for its next step (``last``: a window's last), read from its
    optimizer ``state``, new (``like``'s) where the step writes them for the first time: the
    momentum at a window's end, the sum inside a window. The state is not changed."""
    momentum, grad_sum = state.get("momentum_buffer"), state.get("grad_sum")
    fresh_momentum, fresh_sum = momentum is None, grad_sum is None
    if last and momentum is None:
        momentum = torch.empty_like(like)
    if not last and grad_sum is None:
        grad_sum = torch.empty_like(like)
    return DelayedNesterovBuffers(momentum, grad_sum, fresh_momentum, fresh_sum)


def delayed_nesterov_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    grad_sum: torch.Tensor | None,
    fresh_momentum: bool,
    fresh_sum: bool,
    *,
    step: int,
    lr: float,
    momentum: float,
    delay: int,
    c: float,
) -> None:
    """Delayed Nesterov's outer step ``step`` on ``param`` (a tensor or any piece of one: every
    operation is element-wise) for ``grad``, with the buffers of
    :func:`delayed_nesterov_buffers` (or pieces of them), written in place."""
    direction, new_momentum = _direction_and_momentum(
        grad,
        None if fresh_momentum else momentum_buffer,
        None if fresh_sum else grad_sum,
        step,
        momentum,
        delay,
        c,
    )
    if new_momentum is not None:
        assert momentum_buffer is not None
        momentum_buffer.copy_(new_momentum)  # into the buffer: its memory (pinned, say) stays
        if not fresh_sum:
            assert grad_sum is not None
            grad_sum.zero_()
    else:
        assert grad_sum is not None
        if fresh_sum or step % delay == 0:
            grad_sum.copy_(grad)
        else:
            grad_sum.add_(grad)  # the same addition _next_momentum makes out of place
    param.sub_(direction.mul_(lr))


def delayed_nesterov_estimate(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    grad_sum: torch.Tensor | None,
    out: torch.Tensor,
    *,
    step: int,
    lr: float,
    momentum: float,
    delay: int,
    c: float,
) -> None:
    """Where outer step ``step`` for ``grad`` would take ``param`` (a tensor or a piece), into
    ``out``; the buffers (None: none yet) are read, never written."""
    direction, _ = _direction_and_momentum(
        grad, momentum_buffer, grad_sum, step, momentum, delay, c
    )
    torch.sub(param, direction.mul_(lr), out=out)


def _with_grad(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.grad is not None]


def outer_optimizer(
    lr: float, momentum: float, nesterov: bool, momentum_every: int = 1
) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """What builds a fragment's outer optimizer over the tensors it steps: Delayed Nesterov with
    the momentum updated every ``momentum_every`` > 1 outer steps, else :class:`OuterSGD`
    (Nesterov only with momentum: with 0 it is plain SGD anyway)."""

    def make(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        if momentum_every > 1:
            return DelayedNesterov(tensors, lr=lr, momentum=momentum, delay=momentum_every)
        return OuterSGD(tensors, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    return make
