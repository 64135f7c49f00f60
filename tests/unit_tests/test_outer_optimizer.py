"""The outer optimizers. ``OuterSGD``: torch's SGD to rounding on any kernels (to the bit on
the portable ones: ``test_host_arithmetic.py``), its state torch's, its checks. Delayed Nesterov
(async DiLoCo, arXiv 2401.09135): ``OuterSGD``'s Nesterov to the bit with delay 1, a
hand-computed trajectory, an independent float64 reference, ``direction`` against ``step``, and
a checkpoint round trip."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import (
    DelayedNesterov,
    OuterSGD,
    delayed_nesterov_direction,
    outer_optimizer,
    sgd_step_,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


def _params(device: str = "cpu", seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (2, 3, 2)]
    return [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=gen).to(p.device) for p in params] for _ in range(steps)
    ]


def _clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def _step(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _assert_same(a: Any, b: Any) -> None:
    """Equal to the bit, recursively through dicts and lists (tensors by torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c", [0.0, 0.6, 1.0])
def test_delay_one_is_outer_nesterov_sgd_bit_for_bit(device: str, c: float) -> None:
    lr, momentum = 0.7, 0.9
    ours, theirs = _params(device), _params(device)
    dn = DelayedNesterov(ours, lr=lr, momentum=momentum, delay=1, c=c)
    sgd = OuterSGD(theirs, lr=lr, momentum=momentum, nesterov=True)
    for grads in _grads(ours, steps=8):
        _step(dn, ours, grads)
        _step(sgd, theirs, grads)
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(dn.state[p]["momentum_buffer"], sgd.state[q]["momentum_buffer"])
    # A window of one step never has anything to carry over.
    assert all("grad_sum" not in dn.state[p] for p in ours)
    assert dn.param_groups[0]["step"] == 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True)])
def test_outer_sgd_is_torch_sgd_to_rounding_with_its_state(
    device: str, momentum: float, nesterov: bool
) -> None:
    """Here, on the host's own kernels (which may contract to fused multiply-adds), torch's SGD
    within an ulp or two per step; its state is torch's, so a state dict moves between them."""
    ours, theirs = _params(device), _params(device)
    outer = OuterSGD(ours, lr=0.7, momentum=momentum, nesterov=nesterov)
    sgd = torch.optim.SGD(theirs, lr=0.7, momentum=momentum, nesterov=nesterov)
    for grads in _grads(ours, steps=6):
        _step(outer, ours, grads)
        _step(sgd, theirs, grads)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        if momentum:
            torch.testing.assert_close(
                outer.state[p]["momentum_buffer"], sgd.state[q]["momentum_buffer"]
            )
        else:
            assert p not in outer.state or not outer.state[p]
    moved = OuterSGD(_clone(theirs), lr=0.7, momentum=momentum, nesterov=nesterov)
    moved.load_state_dict(sgd.state_dict())
    assert moved.param_groups[0]["lr"] == 0.7


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True)])
def test_a_step_written_elsewhere_leaves_the_optimizer_alone(
    first: bool, momentum: float, nesterov: bool
) -> None:
    """``sgd_step_`` with ``out`` and ``momentum_out`` (async DiLoCo's eager estimate): the
    bits of the same step taken in place on copies, and the parameter, its momentum and the
    gradient as they were."""
    gen = torch.Generator().manual_seed(3)
    param, grad, buf = (torch.randn(1000, generator=gen) for _ in range(3))
    before = [param.clone(), grad.clone(), buf.clone()]
    into, buf_into = torch.empty(1000), torch.empty(1000)
    kwargs: dict[str, Any] = dict(lr=0.7, momentum=momentum, nesterov=nesterov, first=first)
    sgd_step_(param, grad, None if first else buf, out=into, momentum_out=buf_into, **kwargs)
    for kept, was in zip([param, grad, buf], before, strict=True):
        assert torch.equal(kept, was)
    copy, copy_buf = param.clone(), torch.empty(1000) if first else buf.clone()
    sgd_step_(copy, grad, copy_buf if momentum else None, **kwargs)
    assert torch.equal(into, copy)
    if momentum and not first:
        assert torch.equal(buf_into, copy_buf)


def test_outer_sgd_leaves_a_parameter_without_grad_and_checks_before_writing() -> None:
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    outer = OuterSGD([a, b], lr=0.5, momentum=0.5, nesterov=True)
    a.grad = torch.ones(2)
    outer.step()
    assert torch.equal(b.detach(), torch.ones(2)) and b not in outer.state
    # d = g + 0.5 g = 1.5, a = 1 - 0.5 x 1.5
    assert torch.equal(a.detach(), torch.full((2,), 0.25))
    before = copy.deepcopy(outer.state_dict())
    a.grad, b.grad = torch.ones(2), torch.ones(2).to_sparse()
    with pytest.raises(ValueError, match="^OuterSGD does not support sparse gradients"):
        outer.step()
    _assert_same(outer.state_dict(), before)
    assert torch.equal(a.detach(), torch.full((2,), 0.25))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -0.1}, "^lr must be"),
        ({"lr": float("nan")}, "^lr must be"),
        ({"momentum": 1.0}, "^momentum must be"),
        ({"momentum": 0.0, "nesterov": True}, "^nesterov must be a bool, and False with mom"),
        ({"nesterov": 1}, "^nesterov must be a bool"),
    ],
)
def test_outer_sgd_refuses_bad_arguments_naming_them(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": False, **kwargs}
    with pytest.raises(ValueError, match=match):
        OuterSGD([torch.zeros(1, requires_grad=True)], **args)


def test_the_config_builds_outer_sgd_or_delayed_nesterov() -> None:
    p = [torch.zeros(1, requires_grad=True)]
    assert type(outer_optimizer(0.7, 0.9, True)(p)) is OuterSGD
    assert outer_optimizer(0.7, 0.0, True)(p).param_groups[0]["nesterov"] is False
    assert type(outer_optimizer(0.7, 0.9, True, momentum_every=2)(p)) is DelayedNesterov


def test_hand_computed_trajectory() -> None:
    # delay 2, momentum 1/2, c 1/4, lr 1/2: every intermediate value is exact in fp32, so the
    # expected numbers below (worked out by hand from the rule) must match to the bit.
    # Window end: d = g/2 + (1 - c) * beta * m = g/2 + 0.375 m; inside: d = g/2 + 0.125 m.
    p = torch.tensor([0.0, 1.0], requires_grad=True)
    opt = DelayedNesterov([p], lr=0.5, momentum=0.5, delay=2, c=0.25)
    expected = [
        # (grad, param after, momentum_buffer after or None, grad_sum after)
        ([2.0, 4.0], [-0.5, 0.0], None, [2.0, 4.0]),  # d = [1, 2]; no momentum yet
        ([4.0, 0.0], [-2.0625, -0.375], [3.0, 2.0], [0.0, 0.0]),  # m = (2+4, 4+0)/2
        ([8.0, 8.0], [-4.25, -2.5], [3.0, 2.0], [8.0, 8.0]),  # d = [4, 4] + 0.125 [3, 2]
        ([0.0, -4.0], [-5.28125, -2.0625], [5.5, 3.0], [0.0, 0.0]),  # m = [3, 2]/2 + [4, 2]
    ]
    for grad, param_after, momentum_after, sum_after in expected:
        _step(opt, [p], [torch.tensor(grad)])
        assert torch.equal(p.detach(), torch.tensor(param_after))
        state = opt.state[p]
        if momentum_after is None:
            assert "momentum_buffer" not in state
        else:
            assert torch.equal(state["momentum_buffer"], torch.tensor(momentum_after))
        assert torch.equal(state["grad_sum"], torch.tensor(sum_after))


@pytest.mark.parametrize("delay", [2, 3, 5])
def test_momentum_changes_only_at_window_ends(delay: int) -> None:
    params = _params()
    opt = DelayedNesterov(params, lr=0.3, momentum=0.8, delay=delay, c=0.5 / delay)
    previous: list[torch.Tensor] | None = None
    for t, grads in enumerate(_grads(params, steps=4 * delay)):
        _step(opt, params, grads)
        buffers = [opt.state[p].get("momentum_buffer") for p in params]
        if t < delay - 1:
            assert all(b is None for b in buffers)
            continue
        current = [b.clone() for b in buffers if b is not None]
        assert len(current) == len(params)
        window_end = (t + 1) % delay == 0
        if previous is not None:
            changed = [not torch.equal(a, b) for a, b in zip(previous, current, strict=True)]
            assert all(changed) if window_end else not any(changed), t
        previous = current


def _reference(
    theta: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    lr: float,
    beta: float,
    delay: int,
    c: float,
) -> list[torch.Tensor]:
    """The paper's loop, written independently in float64 (the paper's own coefficient
    1 - cN + c, momentum starting at zero)."""
    theta = [t.double().clone() for t in theta]
    m = [torch.zeros_like(t) for t in theta]
    acc = [torch.zeros_like(t) for t in theta]
    for t, step_grads in enumerate(grads):
        for i, g in enumerate(step_grads):
            g = g.double()
            acc[i] += g
            if (t + 1) % delay == 0:
                m[i] = beta * m[i] + acc[i] / delay
                theta[i] -= lr * ((1 - c * delay + c) * beta * m[i] + g / delay)
                acc[i].zero_()
            else:
                theta[i] -= lr * (c * beta * m[i] + g / delay)
    return theta


@pytest.mark.parametrize(("delay", "c"), [(1, 0.0), (3, 0.0), (3, 0.2), (4, 0.25)])
def test_matches_float64_reference(delay: int, c: float) -> None:
    params = _params()
    start = [p.detach().clone() for p in params]
    grads = _grads(params, steps=5 * delay + 2)
    opt = DelayedNesterov(params, lr=0.7, momentum=0.9, delay=delay, c=c)
    for step_grads in grads:
        _step(opt, params, step_grads)
    for p, r in zip(params, _reference(start, grads, 0.7, 0.9, delay, c), strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("delay", "c"), [(1, 0.0), (3, 0.0), (3, 0.25)])
def test_direction_predicts_step_and_changes_nothing(device: str, delay: int, c: float) -> None:
    lr = 0.7
    params = _params(device)
    opt = DelayedNesterov(params, lr=lr, momentum=0.9, delay=delay, c=c)
    halved = _clone(params)
    opt_halved = DelayedNesterov(halved, lr=0.5, momentum=0.9, delay=delay, c=c)
    for grads in _grads(params, steps=3 * delay + 1):
        before = copy.deepcopy(opt.state_dict())
        pairs = list(zip(params, grads, strict=True))
        predicted = [p.detach().sub(opt.direction(p, g) * lr) for p, g in pairs]
        _assert_same(opt.state_dict(), before)
        # With a power-of-two lr the plain formula param - lr * d is exact too.
        plain = [
            p.detach() - 0.5 * opt_halved.direction(p, g)
            for p, g in zip(halved, grads, strict=True)
        ]
        _step(opt, params, grads)
        _step(opt_halved, halved, grads)
        for p, a in zip(params, predicted, strict=True):
            assert torch.equal(p.detach(), a)
        for p, a in zip(halved, plain, strict=True):
            assert torch.equal(p.detach(), a)


def test_direction_does_not_alias_grad_or_state() -> None:
    p = torch.zeros(4, requires_grad=True)
    opt = DelayedNesterov([p], lr=1.0, momentum=0.9, delay=1)
    g = torch.ones(4)
    d = opt.direction(p, g)
    d.add_(1.0)
    assert torch.equal(g, torch.ones(4))
    _step(opt, [p], [g])
    opt.direction(p, g).zero_()
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.ones(4))


def test_pure_function_matches_the_method() -> None:
    params = _params()
    opt = DelayedNesterov(params, lr=0.7, momentum=0.9, delay=3, c=0.1)
    for grads in _grads(params, steps=7):
        for p, g in zip(params, grads, strict=True):
            state = opt.state.get(p, {})
            d = delayed_nesterov_direction(
                g,
                momentum_buffer=state.get("momentum_buffer"),
                grad_sum=state.get("grad_sum"),
                step=opt.param_groups[0]["step"],
                momentum=0.9,
                delay=3,
                c=0.1,
            )
            assert torch.equal(d, opt.direction(p, g))
        _step(opt, params, grads)


@pytest.mark.parametrize("stop_after", [1, 4, 6])
def test_state_dict_round_trip_continues_bit_for_bit(stop_after: int) -> None:
    delay = 3
    params = _params()
    grads = _grads(params, steps=stop_after + 2 * delay + 1)
    opt = DelayedNesterov(params, lr=0.7, momentum=0.9, delay=delay, c=0.2)
    for step_grads in grads[:stop_after]:
        _step(opt, params, step_grads)

    # A restarted job: everything goes through bytes, into fresh tensors and a fresh optimizer.
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["opt"]["param_groups"][0]["step"] == stop_after
    assert all("grad_sum" in s for s in saved["opt"]["state"].values())
    restarted = [t.clone().requires_grad_() for t in saved["params"]]
    opt_restarted = DelayedNesterov(restarted, lr=0.7, momentum=0.9, delay=delay, c=0.2)
    opt_restarted.load_state_dict(saved["opt"])
    _assert_same(opt_restarted.state_dict(), opt.state_dict())

    for step_grads in grads[stop_after:]:
        _step(opt, params, step_grads)
        _step(opt_restarted, restarted, step_grads)
        for p, q in zip(params, restarted, strict=True):
            assert torch.equal(p, q)
        _assert_same(opt_restarted.state_dict(), opt.state_dict())


def test_parameter_without_grad_is_left_alone() -> None:
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = DelayedNesterov([a, b], lr=1.0, momentum=0.5, delay=2)
    a.grad = torch.ones(2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and b not in opt.state
    assert torch.equal(opt.state[a]["grad_sum"], torch.ones(2))
    # a misses the window's last step: its partial sum is dropped, not carried on.
    a.grad, b.grad = None, torch.ones(2)
    opt.step()
    assert torch.equal(opt.state[a]["grad_sum"], torch.zeros(2))
    assert "momentum_buffer" not in opt.state[a]
    assert torch.equal(opt.state[b]["momentum_buffer"], torch.full((2,), 0.5))


def test_failed_step_changes_nothing() -> None:
    params = _params()
    opt = DelayedNesterov(params, lr=0.7, momentum=0.9, delay=2)
    _step(opt, params, _grads(params, steps=1)[0])
    before = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    # Sparse (torch refuses a wrong shape itself), and last: the first would be written already.
    params[-1].grad = torch.ones_like(params[-1]).to_sparse()
    with pytest.raises(ValueError, match="does not support sparse gradients"):
        opt.step()
    _assert_same(opt.state_dict(), before)
    for p, v in zip(params, values, strict=True):
        assert torch.equal(p.detach(), v)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -0.1}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"momentum": -0.1}, "momentum"),
        ({"momentum": 1.0}, "momentum"),
        ({"delay": 0}, "delay"),
        ({"delay": 2.0}, "delay"),
        ({"delay": True}, "delay"),
        ({"c": -0.01}, "c"),
        ({"delay": 4, "c": 0.26}, "c"),
        ({"delay": 1, "c": 1.5}, "c"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "delay": 2, "c": 0.0, **kwargs}
    with pytest.raises(ValueError, match=rf"^{name} must be .*(>=|\[0, 1)"):
        DelayedNesterov([torch.zeros(1, requires_grad=True)], **args)


def test_invalid_group_and_edge_values() -> None:
    p = torch.zeros(1, requires_grad=True)
    # The largest allowed c (1/delay, as a caller computes it) and momentum 0 are accepted.
    DelayedNesterov([p], lr=0.0, momentum=0.0, delay=3, c=1 / 3)
    with pytest.raises(ValueError, match="^delay must be an integer >= 1"):
        DelayedNesterov([{"params": [p], "delay": 0}], lr=0.7, momentum=0.9, delay=2)
    opt = DelayedNesterov([p], lr=0.7, momentum=0.9, delay=2)
    opt.param_groups[0]["c"] = 0.9  # e.g. a bad load_state_dict: caught before any write
    p.grad = torch.ones(1)
    with pytest.raises(ValueError, match=r"^c must be a number in \[0, 1/delay\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(1)) and p not in opt.state
    with pytest.raises(ValueError, match="^param is not one of this optimizer's parameters"):
        opt.direction(torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="^step must be an integer >= 0"):
        delayed_nesterov_direction(
            torch.ones(1), momentum_buffer=None, grad_sum=None, step=-1, momentum=0.9, delay=2
        )
