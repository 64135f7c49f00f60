"""Divisions that round alike on the CPU and on CUDA (``tools/exact_division``).

A CUDA kernel divides by a Python number as a multiplication by its fp32 reciprocal; the CPU
divides. :class:`CudaScalarDivision` does on the CPU what CUDA does, so that these tests see, on
a machine without a GPU, where the project's arithmetic would differ on one: the codecs' scales,
a transfer's division by the number of groups, async DiLoCo's division by the tokens, a
replayed sync's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.unit_tests.test_async_diloco import Cluster, Group, run
from tests.unit_tests.test_compression import NUMEL, _varied
from torchtitan.experiments.fault_tolerance.transport.codecs import get_codec
from torchtitan.experiments.fault_tolerance.transport.collective import Delivered
from torchtitan.experiments.fault_tolerance.transport.runner import (
    AsyncCompressedAllReduce,
)
from torchtitan.tools.exact_division import divide_, divided

PACKAGE = str(Path(__file__).resolve().parents[2] / "torchtitan")

_DIVISIONS = {
    torch.div,
    torch.true_divide,
    torch.Tensor.div,
    torch.Tensor.div_,
    torch.Tensor.true_divide,
    torch.Tensor.true_divide_,
    torch.Tensor.__truediv__,
    torch.Tensor.__itruediv__,
}
_IN_PLACE = {torch.Tensor.div_, torch.Tensor.true_divide_, torch.Tensor.__itruediv__}


def _caller_in_package() -> str | None:
    """The file of the first caller outside torch (None when it is not the project's)."""
    frame: Any = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    name = frame.f_code.co_filename if frame is not None else ""
    return name if name.startswith(PACKAGE) else None


class CudaScalarDivision(TorchFunctionMode):
    """Every division of a float tensor by a Python number, done as CUDA does it: times the
    divisor's fp32 reciprocal. ``seen``: the project's files that divided so."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if (
            func in _DIVISIONS
            and len(args) == 2
            and isinstance(args[1], int | float)
            and isinstance(args[0], torch.Tensor)
            and args[0].is_floating_point()
            and kwargs.get("rounding_mode") is None
        ):
            where = _caller_in_package()
            if where is not None:
                self.seen.append(where)
            reciprocal = float(np.float32(1.0) / np.float32(args[1]))
            if func in _IN_PLACE:
                return args[0].mul_(reciprocal)
            return torch.mul(args[0], reciprocal, **kwargs)
        return func(*args, **kwargs)


@pytest.mark.parametrize("divisor", [3.0, 7.0, 127.0, 40960.0, 3 * 2**20 + 1])
def test_divide_rounds_as_the_cpu_does_where_cuda_would_take_a_reciprocal(divisor) -> None:
    x = _varied(NUMEL, seed=5)
    expected = x / divisor
    with CudaScalarDivision() as mode:
        assert torch.equal(divided(x, divisor), expected)
        assert torch.equal(divide_(x.clone(), divisor), expected)
        # What the mode changes: a plain division by the number, on CUDA.
        emulated = x / divisor
    assert not torch.equal(emulated, expected) or divisor == 2**20
    assert mode.seen == []  # the test's own division is not the project's


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_codecs_encode_the_same_bytes_with_cudas_scalar_division(dtype: str) -> None:
    """Before: ``scales.div_(qmax)`` gave other scales for about 4 % (int8) and 55 % (int4) of
    the blocks on CUDA."""
    codec = get_codec(dtype)
    x = _varied(NUMEL, seed=13)
    cpu = codec.encode(x)
    with CudaScalarDivision() as mode:
        cuda_like = codec.encode(x)
        scales = codec.scales(x)  # type: ignore[attr-defined]
    assert mode.seen == [], mode.seen
    assert torch.equal(cuda_like, cpu)
    assert torch.equal(scales, codec.scales(x))  # type: ignore[attr-defined]


class _OneRank:
    """A process group of one rank (nothing travels)."""

    def size(self) -> int:
        return 1


def test_a_transfer_and_a_kept_result_divide_by_the_groups_as_the_cpu_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner divides on its own thread, where a torch function mode (thread-local) does
    not reach: ``Tensor.div_`` itself records and emulates there."""
    mode = CudaScalarDivision()
    plain_div_ = torch.Tensor.div_

    def div_(self: torch.Tensor, other: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(other, int | float) and not kwargs:
            where = _caller_in_package()
            if where is not None:
                mode.seen.append(where)
            return self.mul_(float(np.float32(1.0) / np.float32(other)))
        return plain_div_(self, other, **kwargs)

    monkeypatch.setattr(torch.Tensor, "div_", div_)
    runner = AsyncCompressedAllReduce()
    try:
        for dtype in ("float32", "int8"):
            x = _varied(NUMEL, seed=3)
            with mode:
                work = runner.submit(
                    _OneRank(),  # type: ignore[arg-type]
                    x,
                    dtype,
                    divide_by=3,
                    keep_delivered=True,
                )
                work.wait()
                assert work.error is None
                delivered = work.delivered
                assert delivered is not None
                Delivered(delivered.dtype, delivered.numel, 1, 3, delivered.payload).values()
            assert mode.seen == [], (dtype, mode.seen)
    finally:
        runner.shutdown(timeout=10)


@pytest.mark.parametrize("momentum_every", [1, 2])
def test_async_diloco_divides_the_sums_by_the_tokens_as_the_cpu_does(momentum_every: int) -> None:
    """Three groups, eight syncs (the token sums 30 and 60 are no powers of two): the same
    global parameters with CUDA's scalar division as without, through the sync point's passes
    (SGD and Delayed Nesterov)."""

    def globals_after(mode: CudaScalarDivision | None) -> list[torch.Tensor]:
        cluster = Cluster()
        groups = [Group(cluster, seed, outer_momentum_every=momentum_every) for seed in range(3)]
        if mode is None:
            seen = run(groups, 32)
        else:
            with mode:
                seen = run(groups, 32)
        return seen[0][-1]

    mode = CudaScalarDivision()
    emulated = globals_after(mode)
    assert mode.seen == [], sorted(set(mode.seen))
    for a, b in zip(emulated, globals_after(None), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_replayed_sync_divides_as_the_live_one_did_on_any_device(dtype: str) -> None:
    """A heal's replay takes a committed sync's delivered sums and divides them by its tokens'
    total (1,792: no power of two) and by the groups, as the live sync's outer step did with
    ``divide_``. Under CUDA's scalar division the replay's average is the same bits as the
    live one computed on the CPU, and no division of the project's took a reciprocal."""
    from torchtitan.experiments.fault_tolerance.heal.history import HistoryEntry

    sums = _varied(NUMEL, 3) * 1792
    payload = sums if dtype == "float32" else get_codec(dtype).encode(sums)
    delivered = Delivered(dtype, NUMEL, 1, 3.0, payload)
    live = divide_(delivered.values(), 1792.0)  # the live sync's arithmetic, on the CPU
    entry = HistoryEntry.of(5, 0, [delivered], 0, scale=1792.0)
    mode = CudaScalarDivision()
    with mode:
        replayed = entry.average()
    assert mode.seen == [], sorted(set(mode.seen))
    assert torch.equal(replayed, live)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("divisor", [3.0, 7.0, 127.0, 40960.0])
def test_cuda_divides_as_the_cpu_does(divisor: float) -> None:
    x = _varied(NUMEL, seed=5)
    assert torch.equal(divided(x.cuda(), divisor).cpu(), x / divisor)
    assert torch.equal(divide_(x.cuda(), divisor).cpu(), x / divisor)
