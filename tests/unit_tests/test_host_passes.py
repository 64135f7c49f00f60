"""An async DiLoCo sync point's host work in passes (``host_passes``): the same bits as the
whole-fragment operations, no temporaries of a fragment's size, the host's cores, exact pinned
memory, and the global copy's digest taken once."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from torch import nn

from torchtitan.experiments.fault_tolerance.methods import host_passes, piece_workers
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncOuterState
from torchtitan.experiments.fault_tolerance.methods.host_passes import SyncPointPasses
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import outer_optimizer
from torchtitan.experiments.fault_tolerance.methods.piece_workers import PASS_PIECE_VALUES
from torchtitan.tools import pinned
from torchtitan.tools.digest import chunk_hashes, device_digest, fold_digest

#: Parameters larger than a piece (and not a multiple of one), and small ones.
SHAPES = [(3 * PASS_PIECE_VALUES + 5,), (7, 3), (PASS_PIECE_VALUES,), (1,)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    for i, shape in enumerate(SHAPES):
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape)))
    return model


def _state(passes: bool, momentum: float, nesterov: bool) -> tuple[nn.Module, AsyncOuterState]:
    model = _model()
    state = AsyncOuterState(model, torch.device("cpu"), outer_optimizer(0.7, momentum, nesterov, 1))
    state.take_model()
    if not passes:
        state.passes.usable = lambda: False  # type: ignore[method-assign]
    return model, state


def _snapshot(model: nn.Module, state: AsyncOuterState, out: torch.Tensor) -> list[torch.Tensor]:
    momentum = [
        state.outer.state.get(t, {}).get("momentum_buffer") for t in state.global_copy.values()
    ]
    return [
        *(p.detach().clone() for p in model.parameters()),
        *(t.clone() for t in state.global_copy.values()),
        *(t.clone() for t in state.period_start.values()),
        *(torch.zeros(0) if m is None else m.clone() for m in momentum),
        out.clone(),
    ]


@pytest.mark.parametrize("update", ["eager", "eager_share", "delayed"])
@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, False)])
@pytest.mark.parametrize("one_call", [True, False])
def test_the_passes_give_the_bits_of_the_whole_fragment_operations(
    update: str, momentum: float, nesterov: bool, one_call: bool
) -> None:
    """Five sync points (a dropped one among them, the first with no momentum yet) through
    the passes and through the whole-fragment methods: every tensor the same, bit for bit."""
    share = None if update == "delayed" else (1.0 if update == "eager" else 1 / 3)
    runs = []
    for passes in (True, False):
        model, state = _state(passes, momentum, nesterov)
        data = torch.Generator().manual_seed(1)
        out = torch.empty(state.numel())
        seen = []
        sums: torch.Tensor | None = None
        for sync in range(5):
            with torch.no_grad():  # a period's inner steps
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=data) * 0.01)
            arrived = None if sync == 0 or sync == 3 else sums  # sync 3 is dropped
            total = 30.0
            if one_call:  # finish_and_start: one pass over each piece
                state.finish_and_start(arrived, total, out, share, 40.0)
            else:
                state.finish(arrived, total)
                state.start(out, share, 40.0)
            seen.append(_snapshot(model, state, out))
            # What the groups' all-reduce sums: this group's and another's pseudo-gradient.
            sums = out * 10 + torch.randn(out.shape, generator=data) * 0.01
        runs.append(seen)
    for sync, (a, b) in enumerate(zip(*runs, strict=True)):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"sync {sync}, tensor {index} differs"


def test_a_pass_allocates_nothing_of_a_fragments_size() -> None:
    """The sync point's temporaries are pieces (scratch of ``PASS_PIECE_VALUES`` values),
    whatever the fragment's size; the momentum buffers made at the first outer step are the
    state's own."""
    model, state = _state(True, 0.9, True)
    out = torch.empty(state.numel())
    state.finish_and_start(None, 1.0, out, 1.0)  # the scratch exists from here on
    sums = torch.randn(state.numel())
    state.finish_and_start(sums, 30.0, out, 1.0)  # the momentum buffers are made here
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:  # fmt: skip
        state.finish_and_start(sums, 30.0, out, 1.0)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 8 * PASS_PIECE_VALUES, (
        largest
    )  # an int64 piece at most (the digest's products)
    assert state.numel() * 4 > 2 * 8 * PASS_PIECE_VALUES  # the fragment is larger than twice that


def test_a_sync_point_runs_on_the_cores_of_its_rank_one_thread_per_op(monkeypatch) -> None:
    """torchrun starts a rank with one thread; its sync point's host work takes the cores the
    rank may use (the host's, shared by its ranks; or those the launcher pinned it to), each
    piece's ops on one core, and training goes on with the threads it had."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert piece_workers.cores_per_rank() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5}, raising=False)
    assert piece_workers.cores_per_rank() == 1  # a cpuset of 3 cores for 4 ranks: at least one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert piece_workers.cores_per_rank() == 3  # a cpuset of its own
    model, state = _state(True, 0.9, True)  # 0 threads: cores_per_rank's
    threads: set[int] = set()
    workers: set[int] = set()  # each worker hashes into scratch of its own
    op_threads: set[int] = set()
    original = piece_workers.PieceHashes.add

    def add(self: Any, start: int, piece: torch.Tensor, scratch: torch.Tensor) -> None:
        threads.add(threading.get_ident())
        workers.add(scratch.data_ptr())
        op_threads.add(torch.get_num_threads())
        original(self, start, piece, scratch)

    monkeypatch.setattr(piece_workers.PieceHashes, "add", add)
    torch.set_num_threads(2)
    try:
        state.finish_and_start(torch.randn(state.numel()), 3.0, torch.empty(state.numel()), 1.0)
        assert torch.get_num_threads() == 2  # given back
    finally:
        torch.set_num_threads(1)
    # Three shares of the pieces (the caller's and two pool threads', which the pool may run on
    # one thread if the first is done first), one thread per op.
    assert len(workers) == 3 and len(threads) >= 2 and op_threads == {1}


def test_the_global_copys_digest_is_taken_in_the_pass_and_kept_until_it_changes(
    monkeypatch,
) -> None:
    model, state = _state(True, 0.9, True)
    out = torch.empty(state.numel())
    state.finish_and_start(torch.randn(state.numel()), 3.0, out, 1.0)
    taken: list[Any] = []
    original = host_passes.chunk_hashes
    monkeypatch.setattr(host_passes, "chunk_hashes", lambda t: taken.append(t) or original(t))
    expected = device_digest(state.global_copy.values())
    for _ in range(3):  # the agreement check, the heal history's basis, a heal's answer
        assert fold_digest(state.global_chunk_hashes()) == expected
    assert taken == []  # all from the pass
    with torch.no_grad():  # e.g. a checkpoint loaded into the global copy
        next(iter(state.global_copy.values()))[0] += 1
    assert fold_digest(state.global_chunk_hashes()) == device_digest(state.global_copy.values())
    assert len(taken) == len(state.global_copy)  # taken again, once


def test_the_outer_state_is_pinned_at_its_exact_size(monkeypatch) -> None:
    """With a GPU present the global copy and the local start are page-locked where they are
    allocated, at their size (torch's pinned allocator rounds each up to a power of two and
    keeps the blocks of device-to-host copies)."""
    registered: list[tuple[int, int]] = []

    class Cudart:
        def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:  # noqa: N802
            registered.append((pointer, size))
            return 0

        def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda *a, **k: pytest.fail("rounded-up pinned memory")
    )
    before = pinned.registered_bytes
    model = _model()
    state = AsyncOuterState(model, torch.device("cpu"), outer_optimizer(0.7, 0.9, True, 1))
    sizes = sorted(size for _, size in registered)
    expected = sorted(2 * [4 * p.numel() for p in model.parameters()])
    assert sizes == expected
    assert pinned.registered_bytes - before == sum(expected)
    assert all(t.data_ptr() in {p for p, _ in registered} for t in state.global_copy.values())


def test_passes_apply_only_to_plain_sgd_with_the_state_on_the_host() -> None:
    model = _model()
    delayed = AsyncOuterState(
        model, torch.device("cpu"), outer_optimizer(0.7, 0.9, True, 2)
    )  # Delayed Nesterov
    assert not delayed.passes.usable()
    plain = AsyncOuterState(model, torch.device("cpu"), outer_optimizer(0.7, 0.9, True, 1))
    assert plain.passes.usable()
    assert isinstance(delayed.passes, SyncPointPasses)


def test_an_outer_step_the_passes_did_not_take_voids_the_digest_kept() -> None:
    """A replayed outer step (``outer_step``: the optimizer's own ``step``) after a digest was
    kept: the next digest is the new copy's."""
    model, state = _state(True, 0.9, True)
    state.finish_and_start(torch.randn(state.numel()), 3.0, torch.empty(state.numel()), 1.0)
    before = state.global_chunk_hashes()
    state.outer_step(state.views(torch.randn(state.numel())))  # a heal's replay
    fresh = [h for t in state.global_copy.values() for h in chunk_hashes(t)]
    assert fresh != before and state.global_chunk_hashes() == fresh


def _odd_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    for i, numel in enumerate(
        [PASS_PIECE_VALUES + 3, 0, 5]
    ):  # an empty shard, as FSDP gives some ranks
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(numel).to(dtype)))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_shards_and_a_bf16_model_give_the_bits_of_the_whole_fragment_operations(
    dtype: torch.dtype,
) -> None:
    runs = []
    for passes in (True, False):
        model = _odd_model(dtype)
        state = AsyncOuterState(model, torch.device("cpu"), outer_optimizer(0.7, 0.9, True, 1))
        state.take_model()
        if not passes:
            state.passes.usable = lambda: False  # type: ignore[method-assign]
        out = torch.empty(state.numel())
        data = torch.Generator().manual_seed(3)
        seen = []
        for sync in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_((torch.randn(p.shape, generator=data) * 0.01).to(dtype))
            sums = None if sync == 0 else out * 4 + 1
            state.finish_and_start(sums, 8.0, out, 1.0, 4.0)
            seen.append([*(p.detach().clone() for p in model.parameters()), out.clone()])
        runs.append(seen)
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
