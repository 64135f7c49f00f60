"""The passes over the outer state (``outer_passes``): the same bits as the whole-fragment
operations (``outer_reference``) for both outer optimizers, no temporaries of a fragment's size,
the host's cores, exact pinned memory, and the global copy's digest taken once."""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit_tests.outer_reference import WholeFragment
from torchtitan.experiments.fault_tolerance.methods import outer_passes, piece_workers
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncOuterState
from torchtitan.experiments.fault_tolerance.methods.global_copy import OuterState
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import (
    DelayedNesterov,
    outer_optimizer,
)
from torchtitan.experiments.fault_tolerance.methods.piece_workers import (
    DEVICE_PIECE_VALUES,
    PASS_PIECE_VALUES,
)
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


def _state(
    passes: bool, momentum: float, nesterov: bool, every: int = 1, c: float = 0.0
) -> tuple[nn.Module, AsyncOuterState, AsyncOuterState | WholeFragment]:
    """A model, its outer state, and what runs its sync points: the passes or the reference
    (``c``: Delayed Nesterov's pull of the momentum between window ends)."""
    model = _model()
    make = outer_optimizer(0.7, momentum, nesterov, every)
    if c:
        make = functools.partial(DelayedNesterov, lr=0.7, momentum=momentum, delay=every, c=c)
    state = AsyncOuterState(model, torch.device("cpu"), make)
    state.take_model()
    return model, state, state if passes else WholeFragment(state)


def _snapshot(model: nn.Module, state: AsyncOuterState, out: torch.Tensor) -> list[Any]:
    """Every tensor a sync point writes, and the outer optimizer's state."""
    held = [
        state.outer.state.get(t, {}).get(key)
        for t in state.global_copy.values()
        for key in ("momentum_buffer", "grad_sum")
    ]
    return [
        *(p.detach().clone() for p in model.parameters()),
        *(t.clone() for t in state.global_copy.values()),
        *(t.clone() for t in state.period_start.values()),
        *(torch.zeros(0) if m is None else m.clone() for m in held),
        out.clone(),
        [{k: v for k, v in g.items() if k != "params"} for g in state.outer.param_groups],
    ]


@pytest.mark.parametrize("update", ["eager", "eager_share", "delayed"])
@pytest.mark.parametrize(
    ("momentum", "nesterov", "every", "c"),
    [
        (0.9, True, 1, 0.0), (0.9, False, 1, 0.0), (0.0, False, 1, 0.0), (0.9, True, 2, 0.0),
        (0.9, True, 3, 0.0), (0.9, True, 2, 0.5), (0.9, True, 3, 0.25),
    ],
)  # fmt: skip
@pytest.mark.parametrize("one_call", [True, False])
def test_the_passes_give_the_bits_of_the_whole_fragment_operations(
    update: str, momentum: float, nesterov: bool, every: int, c: float, one_call: bool
) -> None:
    """Seven sync points (a dropped one among them, the first with no momentum yet; Delayed
    Nesterov (``every`` > 1) across window ends, its sums and momentum fresh, with and without
    the momentum's pull ``c`` between them) through the passes and through the whole-fragment
    methods: every tensor the same, bit for bit."""
    share = None if update == "delayed" else (1.0 if update == "eager" else 1 / 3)
    runs = []
    for passes in (True, False):
        model, state, runner = _state(passes, momentum, nesterov, every, c)
        data = torch.Generator().manual_seed(1)
        out = torch.empty(state.numel())
        seen = []
        sums: torch.Tensor | None = None
        for sync in range(7):
            with torch.no_grad():  # a period's inner steps
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=data) * 0.01)
            arrived = None if sync == 0 or sync == 3 else sums  # sync 3 is dropped
            total = 30.0
            if one_call:  # finish_and_start: one pass over each piece
                runner.finish_and_start(arrived, total, out, share, 40.0)
            else:
                runner.finish(arrived, total)
                runner.start(out, share, 40.0)
            seen.append(_snapshot(model, state, out))
            # What the groups' all-reduce sums: this group's and another's pseudo-gradient.
            sums = out * 10 + torch.randn(out.shape, generator=data) * 0.01
        runs.append(seen)
    for sync, (a, b) in enumerate(zip(*runs, strict=True)):
        assert a[-1] == b[-1], f"sync {sync}: the optimizer's settings or step count differ"
        for index, (x, y) in enumerate(zip(a[:-1], b[:-1], strict=True)):
            assert torch.equal(x, y), f"sync {sync}, tensor {index} differs"


def test_a_pass_allocates_nothing_of_a_fragments_size() -> None:
    """The sync point's temporaries are pieces (scratch of ``PASS_PIECE_VALUES`` values),
    whatever the fragment's size; the momentum buffers made at the first outer step are the
    state's own."""
    model, state, _ = _state(True, 0.9, True)
    out = torch.empty(state.numel())
    state.finish_and_start(None, 1.0, out, 1.0)  # the scratch exists from here on
    sums = torch.randn(state.numel())
    state.finish_and_start(sums, 30.0, out, 1.0)  # the momentum buffers are made here
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:  # fmt: skip
        state.finish_and_start(sums, 30.0, out, 1.0)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 4 * PASS_PIECE_VALUES, largest  # a piece's fp32 temporary at most
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
    model, state, _ = _state(True, 0.9, True)  # 0 threads: cores_per_rank's
    threads: set[int] = set()
    workers: set[int] = set()  # each worker takes pieces into scratch of its own
    op_threads: set[int] = set()
    original = piece_workers.Worker.scratch

    def scratch(self: Any, numel: int, dtype: torch.dtype = torch.float32) -> Any:
        threads.add(threading.get_ident())
        workers.add(id(self))
        op_threads.add(torch.get_num_threads())
        return original(self, numel, dtype)

    monkeypatch.setattr(piece_workers.Worker, "scratch", scratch)
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
    model, state, _ = _state(True, 0.9, True)
    out = torch.empty(state.numel())
    state.finish_and_start(torch.randn(state.numel()), 3.0, out, 1.0)
    taken: list[Any] = []
    original = outer_passes.chunk_hashes
    monkeypatch.setattr(outer_passes, "chunk_hashes", lambda t: taken.append(t) or original(t))
    expected = device_digest(state.global_copy.values())
    for _ in range(3):  # the agreement check, the heal history's basis, a heal's answer
        assert fold_digest(state.passes.global_chunk_hashes()) == expected
    assert taken == []  # all from the pass
    with torch.no_grad():  # e.g. a checkpoint loaded into the global copy
        next(iter(state.global_copy.values()))[0] += 1
    assert fold_digest(state.passes.global_chunk_hashes()) == device_digest(
        state.global_copy.values()
    )
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


def test_a_replayed_outer_step_keeps_the_digest_of_the_new_copy() -> None:
    """A replayed outer step (``outer_step``, a pass too) after a digest was kept: the digest
    kept is the new copy's."""
    model, state, _ = _state(True, 0.9, True)
    state.finish_and_start(torch.randn(state.numel()), 3.0, torch.empty(state.numel()), 1.0)
    before = state.passes.global_chunk_hashes()
    state.passes.step(state.views(torch.randn(state.numel())))  # a heal's replay
    fresh = [h for t in state.global_copy.values() for h in chunk_hashes(t)]
    assert fresh != before and state.passes.global_chunk_hashes() == fresh


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
        runner = state if passes else WholeFragment(state)
        out = torch.empty(state.numel())
        data = torch.Generator().manual_seed(3)
        seen = []
        for sync in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_((torch.randn(p.shape, generator=data) * 0.01).to(dtype))
            sums = None if sync == 0 else out * 4 + 1
            runner.finish_and_start(sums, 8.0, out, 1.0, 4.0)
            seen.append([*(p.detach().clone() for p in model.parameters()), out.clone()])
        runs.append(seen)
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_pass_that_does_not_step_keeps_the_digest_of_the_copy() -> None:
    """``start`` writes the local start and the model, never the global copy: the digest the
    last step's pass took stays, and it is the copy's."""
    model, state, _ = _state(True, 0.9, True)
    out = torch.empty(state.numel())
    state.finish(torch.randn(state.numel()), 3.0)
    kept = state.passes.global_chunk_hashes()
    state.start(out, 1.0, 2.0)
    assert state.passes.global_chunk_hashes() == kept
    assert kept == [h for t in state.global_copy.values() for h in chunk_hashes(t)]


def test_diloco_steps_a_bf16_global_copy_in_pieces_as_the_optimizer_would() -> None:
    """Blocking DiLoCo's global copy lives beside the parameters, in their dtype: the pass's
    outer step (two fragments' worth of pieces) is ``OuterSGD.step``'s on the whole tensors,
    and its digest, taken after the pass, the copy's."""
    model = _odd_model(torch.bfloat16)
    make = outer_optimizer(0.7, 0.9, True, 1)
    state = OuterState(model, make)
    reference = [t.clone().requires_grad_() for t in state.global_copy.values()]
    optimizer = make(reference)
    state.take_model()
    for r, t in zip(reference, state.global_copy.values(), strict=True):
        r.data.copy_(t)
    _steps_as_the_optimizer(state, reference, optimizer, 3, torch.bfloat16)  # 1st: momentum


def _steps_as_the_optimizer(
    state: OuterState,
    reference: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    steps: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> None:
    """``steps`` outer steps of random averages, by the passes and by ``optimizer`` on the
    whole ``reference`` tensors: the same bits, and the global copy's digest taken after."""
    data = torch.Generator().manual_seed(5)
    for _ in range(steps):
        averages = {
            name: torch.randn(t.shape, generator=data).to(dtype).to(device)
            for name, t in state.global_copy.items()
        }
        for r, average in zip(reference, averages.values(), strict=True):
            r.grad = average.clone()
        optimizer.step()
        state.passes.step(averages)
    for r, t in zip(reference, state.global_copy.values(), strict=True):
        assert torch.equal(r.detach(), t)
    fresh = [h for t in state.global_copy.values() for h in chunk_hashes(t)]
    assert state.passes.global_chunk_hashes() == fresh


def test_state_on_an_accelerator_is_stepped_in_large_pieces_on_the_callers_thread(
    monkeypatch,
) -> None:
    """The outer state beside a model on an accelerator (``outer_state_device=cuda``, or
    DiLoCo's): the passes queue pieces of ``DEVICE_PIECE_VALUES`` from the caller's thread
    with its scratch on the device, torch's host threads untouched, and take no digest in
    the pass (that would wait for the device at every piece). Observed on the meta device."""
    meta = torch.device("meta")
    model = nn.Module()
    model.register_parameter(
        "w", nn.Parameter(torch.empty(2 * DEVICE_PIECE_VALUES + 3, device=meta))
    )
    model.register_parameter("b", nn.Parameter(torch.empty(5, device=meta)))
    state = AsyncOuterState(model, meta, outer_optimizer(0.7, 0.9, True, 3))
    seen: list[tuple[int, int, str, int]] = []
    original = piece_workers._Workers.run

    def run(self: Any, pieces: list, body: Any, hashed: Any) -> Any:
        for piece in pieces:
            seen.append((piece.a, piece.glob.numel(), str(self.device), threading.get_ident()))
        assert hashed is None
        return original(self, pieces, body, hashed)

    monkeypatch.setattr(piece_workers._Workers, "run", run)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail("host threads set"))
    out = torch.empty(state.numel(), device=meta)
    state.finish_and_start(torch.empty(state.numel(), device=meta), 3.0, out, 1.0, 2.0)
    state.passes.step(state.views(torch.empty(state.numel(), device=meta)))
    sizes = [(a, n) for a, n, _, _ in seen]
    assert sizes[:4] == [(0, DEVICE_PIECE_VALUES), (DEVICE_PIECE_VALUES, DEVICE_PIECE_VALUES),
                         (2 * DEVICE_PIECE_VALUES, 3), (0, 5)]  # fmt: skip
    assert {(d, t) for _, _, d, t in seen} == {("meta", threading.get_ident())}
    assert state.outer.param_groups[0]["step"] == 2  # Delayed Nesterov counted both steps


def test_the_passes_refuse_what_they_cannot_step_naming_it() -> None:
    """At construction, not a period later at the first outer step."""
    model = _model()
    with pytest.raises(TypeError, match="OuterSGD or DelayedNesterov, not .*SGD"):
        AsyncOuterState(model, torch.device("cpu"), lambda t: torch.optim.SGD(t, lr=0.1))
    strided = nn.Module()
    strided.register_parameter("w", nn.Parameter(torch.zeros(4, 6).t()))
    with pytest.raises(ValueError, match="must be contiguous"):
        OuterState(strided, outer_optimizer(0.7, 0.0, False, 1))


@pytest.mark.parametrize("every", [1, 2])
def test_a_pass_that_fails_leaves_the_optimizers_state_as_it_was(every: int) -> None:
    """A first outer step whose average has the wrong size raises before anything is written:
    no momentum buffer or window sum appears (the next step would read it as the state), and
    Delayed Nesterov's count stays; the same step then runs as if the first had not."""
    _, state, _ = _state(True, 0.9, True, every)
    glob = next(iter(state.global_copy.values()))
    before = [t.clone() for t in state.global_copy.values()]
    with pytest.raises(ValueError, match="values for a fragment of"):
        state.finish(torch.zeros(5), 1.0)
    with pytest.raises(ValueError, match="5 values for p0, a parameter of"):
        state.passes.step({name: torch.zeros(5) for name in state.global_copy})
    assert not state.outer.state.get(glob) and state.outer.param_groups[0].get("step", 0) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, state.global_copy.values(), strict=True))

    def fails(*args: Any, **kwargs: Any) -> None:  # e.g. out of memory for its scratch
        raise RuntimeError("the pass failed")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(outer_passes, "run_pieces", fails)
        with pytest.raises(RuntimeError, match="the pass failed"):
            state.passes.step(state.views(torch.ones(state.numel())))
    assert not state.outer.state.get(glob) and state.outer.param_groups[0].get("step", 0) == 0
    for _ in range(every):
        state.passes.step(state.views(torch.ones(state.numel())))
    assert state.outer.state[glob]["momentum_buffer"] is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("every", [1, 3])
def test_on_cuda_the_state_beside_the_model_steps_as_the_optimizer_would(
    dtype: torch.dtype, every: int
) -> None:
    """DiLoCo's global copy beside CUDA parameters (and ``outer_state_device=cuda``): the
    passes, queued on the device in pieces of ``DEVICE_PIECE_VALUES``, give the bits of the
    optimizer's own step on the whole tensors, across Delayed Nesterov's window ends."""
    model = nn.Module()
    for i, numel in enumerate([DEVICE_PIECE_VALUES + 7, 0, 5]):
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(numel, dtype=dtype).cuda()))
    make = outer_optimizer(0.7, 0.9, True, every)
    state = OuterState(model, make)
    state.take_model()
    reference = [t.clone().requires_grad_() for t in state.global_copy.values()]
    optimizer = make(reference)
    _steps_as_the_optimizer(state, reference, optimizer, 4, dtype, "cuda")


def test_a_restart_starts_the_period_and_the_model_at_the_global_copy() -> None:
    """After a heal (the peer's global copy and local start loaded) or at the job's end, the
    model and the local start both take the global copy: the next pseudo-gradient holds only
    the progress made after it."""
    model, state, _ = _state(True, 0.9, True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            state.global_copy[name].copy_(torch.randn_like(p))
            state.period_start[name].copy_(torch.randn_like(p))  # the peer's, say
    state.restart()
    for name, p in model.named_parameters():
        assert torch.equal(state.period_start[name], state.global_copy[name])
        assert torch.equal(p.detach(), state.global_copy[name])
    out = torch.empty(state.numel())
    state.start(out, None)
    assert not out.any()  # no progress since the restart
