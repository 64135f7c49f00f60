"""The compressed pseudo-gradient all-reduce: codecs, error feedback, real gloo groups."""

from __future__ import annotations

import gc
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    BLOCK,
    SMALLEST_SCALE,
    BlockQuantCodec,
    Codec,
    get_codec,
)
from torchtitan.experiments.fault_tolerance.transport.collective import (
    compressed_all_reduce,
)
from torchtitan.experiments.fault_tolerance.transport.residuals import ResidualKey, Residuals
from torchtitan.experiments.fault_tolerance.transport.runner import (
    AsyncCompressedAllReduce,
    Packed,
)

QUANTIZED = ("int8", "int4")
NUMEL = 10_001  # not a multiple of BLOCK, nor of 2 or 3 ranks


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """A benchmark may share the machine: keep the intra-op pool at one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _varied(numel: int, seed: int) -> torch.Tensor:
    """Normal values whose magnitude differs from block to block, so that scales differ."""
    gen = torch.Generator().manual_seed(seed)
    blocks = math.ceil(numel / BLOCK)
    magnitude = torch.exp(2 * torch.randn(blocks, generator=gen)).repeat_interleave(BLOCK)
    return torch.randn(numel, generator=gen) * magnitude[:numel]


def _per_element(per_block: torch.Tensor, numel: int) -> torch.Tensor:
    return per_block.repeat_interleave(BLOCK)[:numel]


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    blocks = math.ceil(x.numel() / BLOCK)
    return (
        torch.nn.functional.pad(x.abs(), (0, blocks * BLOCK - x.numel())).view(blocks, -1).amax(1)
    )


# ---------------------------------------------------------------------------------------------
# Codecs


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("numel", [1, 5, 127, 128, 129, 1000, 1001])
def test_quantized_round_trip_is_within_half_a_step(dtype: str, numel: int) -> None:
    codec = get_codec(dtype)
    assert isinstance(codec, BlockQuantCodec)
    x = _varied(numel, seed=numel)
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.numel() == codec.wire_bytes(numel)
    blocks = math.ceil(numel / BLOCK)
    stored = packed[: 4 * blocks].view(torch.float32)
    assert torch.equal(stored, _block_absmax(x) / codec.qmax)
    decoded = codec.decode(packed, numel)
    step = _per_element(stored, numel)
    # Half a step, plus the few ulps of the fp32 division and multiply.
    assert ((decoded - x).abs() <= step * 0.5 * (1 + 1e-5)).all()
    # The largest element of each block uses the full range (q = +-qmax).
    assert torch.allclose(_block_absmax(decoded), stored * codec.qmax, rtol=1e-6, atol=0)
    # Decoding is a pure function of the bytes.
    assert torch.equal(codec.decode(packed.clone(), numel), decoded)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_zero_blocks_get_scale_zero_and_decode_to_zero(dtype: str) -> None:
    codec = get_codec(dtype)
    x = _varied(3 * BLOCK + 7, seed=1)
    x[BLOCK : 2 * BLOCK] = 0  # a whole zero block
    x[3 * BLOCK :] = 0  # a zero short tail block
    packed = codec.encode(x)
    scales = packed[:16].view(torch.float32)
    assert scales[1] == 0 and scales[3] == 0 and (scales[[0, 2]] > 0).all()
    decoded = codec.decode(packed, x.numel())
    assert torch.equal(decoded[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
    assert torch.equal(decoded[3 * BLOCK :], torch.zeros(7))
    assert torch.isfinite(decoded).all()
    assert torch.equal(codec.decode(codec.encode(torch.zeros(300)), 300), torch.zeros(300))


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_tiny_blocks_get_the_smallest_normal_scale_and_stay_in_range(dtype: str) -> None:
    """absmax / qmax below the smallest normal fp32 would be a subnormal scale, too coarse to
    keep |x / scale| <= qmax; such blocks get SMALLEST_SCALE and still decode within half a
    step. A normal block next to them is untouched."""
    codec = get_codec(dtype)
    assert isinstance(codec, BlockQuantCodec)
    tiny = torch.finfo(torch.float32).tiny
    assert SMALLEST_SCALE == tiny
    x = torch.cat(
        [
            torch.linspace(-10, 10, BLOCK) * 1.4e-45,  # a few subnormal steps
            torch.linspace(-1, 1, BLOCK) * tiny * codec.qmax * 0.9,  # absmax / qmax: subnormal
            torch.linspace(-3, 3, BLOCK),
        ]
    )
    packed = codec.encode(x)
    stored = packed[: 4 * 3].view(torch.float32)
    assert stored.tolist()[:2] == [tiny, tiny]
    assert stored[2] == 3 / codec.qmax
    assert torch.equal(stored, codec.scales(x))
    decoded = codec.decode(packed, x.numel())
    step = _per_element(stored, x.numel())
    assert ((decoded - x).abs() <= step / 2).all()


def test_int4_packs_two_offset_nibbles_per_byte_low_first() -> None:
    codec = get_codec("int4")
    # absmax 1.75: scale 0.25 exactly; x / scale = 7, -3.5, 0, 2.5, -7. Round half to even gives
    # q = 7, -4, 0, 2, -7, stored +8 as 15, 4, 8, 10, 1 and a padding nibble 8.
    x = torch.tensor([1.75, -0.875, 0.0, 0.625, -1.75])
    packed = codec.encode(x)
    assert packed.numel() == 4 + 3
    assert packed[:4].view(torch.float32).item() == 0.25
    assert packed[4:].tolist() == [15 | 4 << 4, 8 | 10 << 4, 1 | 8 << 4]
    assert codec.decode(packed, 5).tolist() == [1.75, -1.0, 0.0, 0.5, -1.75]


def test_int8_layout_is_scales_then_values() -> None:
    codec = get_codec("int8")
    # absmax 63.5: scale 0.5; x / scale = 127, -2.5, 1.5, 0 -> q = 127, -2, 2, 0.
    x = torch.tensor([63.5, -1.25, 0.75, 0.0])
    packed = codec.encode(x)
    assert packed[:4].view(torch.float32).item() == 0.5
    assert packed[4:].view(torch.int8).tolist() == [127, -2, 2, 0]
    assert codec.decode(packed, 4).tolist() == [63.5, -1.0, 1.0, 0.0]


def test_bfloat16_and_float32_codecs() -> None:
    x = _varied(1001, seed=2)
    bf16 = get_codec("bfloat16")
    decoded = bf16.decode(bf16.encode(x), x.numel())
    assert torch.equal(decoded, x.to(torch.bfloat16).float())
    assert ((decoded - x).abs() <= x.abs() * 2**-8).all()
    fp32 = get_codec("float32")
    original = x.clone()
    packed = fp32.encode(x)
    x.add_(1)  # the encoding is a copy, not a view of the input
    assert torch.equal(fp32.decode(packed, x.numel()), original)


@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
def test_decode_into_out_and_from_unaligned_bytes(dtype: str) -> None:
    codec = get_codec(dtype)
    x = _varied(333, seed=3)
    packed = codec.encode(x)
    expected = codec.decode(packed, x.numel())
    shifted = torch.empty(packed.numel() + 1, dtype=torch.uint8)
    shifted[1:] = packed  # the scales no longer start on a 4-byte boundary
    out = torch.full((333,), float("nan"))
    assert codec.decode(shifted[1:], 333, out=out) is out
    assert torch.equal(out, expected)
    with pytest.raises(ValueError):
        codec.decode(packed[:-1], 333)
    with pytest.raises(ValueError):
        codec.encode(x.double())


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="int2"):
        get_codec("int2")


@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 2, 255, 256, 1_000_000])
def test_wire_bytes_is_the_encoded_size(dtype: str, numel: int) -> None:
    codec = get_codec(dtype)
    assert codec.encode(torch.randn(numel)).numel() == codec.wire_bytes(numel)


def test_wire_ratios_for_a_million_elements() -> None:
    fp32_bytes = 4 * 1_000_000
    ratios = {d: get_codec(d).wire_bytes(1_000_000) / fp32_bytes for d in PSEUDO_GRAD_DTYPES}
    assert ratios["float32"] == 1 and ratios["bfloat16"] == 0.5
    assert ratios["int8"] <= 0.27 and ratios["int4"] <= 0.14
    # 7813 blocks of scales plus the values.
    assert get_codec("int8").wire_bytes(1_000_000) == 4 * 7813 + 1_000_000
    assert get_codec("int4").wire_bytes(1_000_000) == 4 * 7813 + 500_000


# ---------------------------------------------------------------------------------------------
# Error feedback


def encode_staged(
    residuals: Residuals, key: ResidualKey, x: torch.Tensor, codec: Codec
) -> torch.Tensor:
    """``x``'s encoding with what ``residuals`` owe at ``key`` added first, and what it drops
    staged there (as one transfer of a sync does)."""
    corrected = residuals.correct_(key, x.clone())
    packed = torch.empty(codec.wire_bytes(x.numel()), dtype=torch.uint8)
    residual = residuals.buffer(key, corrected)
    codec.encode_into(corrected, packed, x.numel(), residual=residual)
    residuals.stage(key, residual)
    return packed


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_error_feedback_makes_the_running_mean_converge(dtype: str) -> None:
    codec = get_codec(dtype)
    x = _varied(1000, seed=4)
    rounds = 20
    plain = codec.decode(codec.encode(x), x.numel())  # the same every round
    residuals, key = Residuals(), ResidualKey(0, 0)
    total = torch.zeros_like(x)
    for _ in range(rounds):
        total += codec.decode(encode_staged(residuals, key, x, codec), x.numel())
        residuals.commit()
    err_plain = (plain - x).norm()
    err_feedback = (total / rounds - x).norm()
    assert err_plain > 0
    assert err_feedback < err_plain / 5
    # What is still owed is at most half a step of the last (corrected) input.
    residual = residuals.owed(key, 1000)
    assert residual is not None
    assert torch.allclose(total + residual, rounds * x, rtol=0, atol=1e-3)


def test_residuals_round_trip_through_a_flat_tensor_and_fragments_are_separate() -> None:
    codec = get_codec("int4")
    x, y = _varied(300, seed=5), _varied(300, seed=6)
    first = Residuals()
    encode_staged(first, ResidualKey(0, 0), x, codec)
    encode_staged(first, ResidualKey(1, 0), y, codec)
    first.commit()
    assert torch.equal(first.flat(0, 300), x - codec.decode(codec.encode(x), 300))
    second, saved = Residuals(), first.flat(0, 300)
    second.load(0, saved)
    assert second.owed(ResidualKey(1, 0), 300) is None
    again = encode_staged(first, ResidualKey(0, 0), x, codec)
    assert torch.equal(encode_staged(second, ResidualKey(0, 0), x, codec), again)
    first.discard()  # not committed: the first sync's residuals stay owed
    assert torch.equal(first.flat(0, 300), second.flat(0, 300))
    for _ in range(2):  # the store computes in buffers of its own, never in the one it loaded
        second.commit()
        encode_staged(second, ResidualKey(0, 0), y, codec)
    assert torch.equal(saved, first.flat(0, 300))
    with pytest.raises(ValueError, match="none covering the 7 values at offset 300"):
        first.correct_(ResidualKey(1, 300), torch.zeros(7))


class _OneRank:
    """The only thing a one-rank all-reduce asks of its group."""

    def size(self) -> int:
        return 1


@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
def test_a_single_rank_gets_its_own_round_trip(dtype: str) -> None:
    codec = get_codec(dtype)
    x = _varied(500, seed=7)
    tensor = x.clone()
    residuals, key = Residuals(), ResidualKey(2, 0)
    pg: Any = _OneRank()
    stats = compressed_all_reduce(pg, tensor, dtype, error_feedback=residuals, key=key)
    assert torch.equal(tensor, codec.decode(codec.encode(x), 500))
    assert stats.bytes_sent == 0 and stats.world_size == 1
    assert residuals.owed(key, 500) is None  # staged: owed only once the sync commits
    residuals.commit()
    assert torch.equal(residuals.flat(2, 500), x - tensor)


def test_wait_returns_after_the_callbacks_chained_on_the_future() -> None:
    """torchft's bucketed DiLoCo copies each bucket back into its gradients in a callback on
    the work's future and then waits on the work: ``wait`` must not return before that
    callback has run (a future's own ``wait`` does)."""
    runner = AsyncCompressedAllReduce()
    pg: Any = _OneRank()
    copied: list[torch.Tensor] = []

    def copy_back(fut: torch.futures.Future[torch.Tensor]) -> None:
        time.sleep(0.3)  # a slow copy
        copied.append(fut.value().clone())

    try:
        for done in range(3):
            work = runner.submit(pg, torch.ones(256), "int8")
            work.get_future().then(copy_back)
            work.wait()
            assert work.error is None
            assert len(copied) == done + 1
    finally:
        runner.shutdown(timeout=10)


class _WatchedPacked(Packed):
    """A bucket that says when it is packed (and can hold its packing until ``release``),
    keeps a weak reference to its buffer, and counts the buckets that hold one at once."""

    def __init__(self, members: list[tuple[torch.Tensor, int]], numel: int, watch: dict[str, Any],
                 release: threading.Event | None = None) -> None:  # fmt: skip
        super().__init__(members, numel, torch.device("cpu"))
        self.watch, self.release, self.entered = watch, release, threading.Event()
        self.buffer: weakref.ref[torch.Tensor] | None = None

    def pack(self) -> torch.Tensor:
        with self.watch["lock"]:
            self.watch["live"] += 1
            self.watch["most"] = max(self.watch["most"], self.watch["live"])
        self.entered.set()
        if self.release is not None and not self.release.wait(30):
            raise TimeoutError("never released")
        flat = super().pack()
        self.buffer = weakref.ref(flat)
        return flat

    def unpack(self, flat: torch.Tensor) -> None:
        super().unpack(flat)
        with self.watch["lock"]:
            self.watch["live"] -= 1


def test_a_bucket_holds_its_buffer_only_while_its_own_collective_runs() -> None:
    """A sync queues all its buckets at once; each is packed on the background thread right
    before its collective and its values are back in its tensors (its buffer dropped) before
    the next one is packed: one bucket's copy at a time, not the whole sync's."""
    runner = AsyncCompressedAllReduce()
    pg: Any = _OneRank()
    release = threading.Event()
    watch: dict[str, Any] = {"lock": threading.Lock(), "live": 0, "most": 0}
    tensors = [torch.full((3, 5), float(i)) for i in range(8)]
    buckets = [
        _WatchedPacked([(tensors[2 * i], 0), (tensors[2 * i + 1], 15)], 30, watch,
                       release if i == 0 else None)
        for i in range(4)
    ]  # fmt: skip
    try:
        works = [runner.submit(pg, b, "float32", divide_by=2) for b in buckets]
        assert buckets[0].entered.wait(30)
        assert not any(b.entered.is_set() for b in buckets[1:])  # queued, not packed
        assert all(torch.equal(t, torch.full((3, 5), float(i))) for i, t in enumerate(tensors))
        release.set()
        for work in works:
            assert work._done.wait(30)
    finally:
        release.set()
        runner.shutdown(timeout=10)
    assert all(w.error is None for w in works) and watch["most"] == 1 and watch["live"] == 0
    for i, tensor in enumerate(tensors):  # the result is back in every tensor
        assert torch.equal(tensor, torch.full((3, 5), i / 2))
    # The works hold no buffer (nor does anything else), and still say what they carried.
    gc.collect()
    assert all(b.buffer is not None and b.buffer() is None for b in buckets)
    assert all(w.tensor.numel() == 0 and w.numel == 30 for w in works)


class _UnpackablePacked(Packed):
    def pack(self) -> torch.Tensor:
        raise MemoryError("no room for the bucket")


def test_a_bucket_that_cannot_be_packed_stops_this_rank_s_collectives() -> None:
    """Its collective is never issued, so every later one would pair with a peer's earlier
    one: the later jobs fail without a collective, and the runner says why."""
    runner = AsyncCompressedAllReduce()
    pg: Any = _OneRank()
    tensor = torch.ones(4)
    try:
        first = runner.submit(pg, _UnpackablePacked([(tensor, 0)], 4, torch.device("cpu")),
                              "float32")  # fmt: skip
        later = runner.submit(pg, torch.ones(8), "int8")
        assert first._done.wait(30) and later._done.wait(30)
    finally:
        runner.shutdown(timeout=10)
    assert "could not be packed" in str(first.error)
    assert str(later.error).startswith("not sent: a bucket of 4 fp32 values could not be packed")
    assert runner.broken is not None and torch.equal(tensor, torch.ones(4))


class _BrokenPair:
    """A two-rank group whose collectives fail, as a group with a dead peer does."""

    def size(self) -> int:
        return 2

    def alltoall_base(self, *args: Any) -> Any:
        raise RuntimeError("peer gone")


def test_an_async_failure_is_in_its_work_which_completes_normally() -> None:
    runner = AsyncCompressedAllReduce()
    broken: Any = _BrokenPair()
    tensor = torch.ones(300)
    work = runner.submit(broken, tensor, "int8")
    assert work.wait() is True
    assert work.get_future().value() is tensor and work.stats is None
    assert str(work.error) == "peer gone"
    runner.shutdown(timeout=10)
    with pytest.raises(RuntimeError, match="shut down"):
        runner.submit(broken, torch.ones(3), "int8")
    other = AsyncCompressedAllReduce()
    with pytest.raises(ValueError, match="fp8"):
        other.submit(broken, torch.ones(3), "fp8")
    other.shutdown(timeout=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
def test_cuda_encodes_the_bytes_and_decodes_the_values_of_the_cpu(dtype: str) -> None:
    """Groups on different devices must agree bit for bit: the same ops, the same IEEE
    results (round half to even, one rounding per op)."""
    codec = get_codec(dtype)
    x = _varied(NUMEL, seed=13)
    numel = NUMEL + 200  # a zero tail too
    encoded, residuals = [], []
    for device in ("cpu", "cuda"):
        packed = torch.empty(codec.wire_bytes(numel), dtype=torch.uint8, device=device)
        residual = torch.empty(NUMEL, device=device)
        codec.encode_into(x.to(device), packed, numel, residual=residual)
        encoded.append(packed)
        residuals.append(residual.cpu())
    assert torch.equal(encoded[1].cpu(), encoded[0])
    assert torch.equal(residuals[1], residuals[0])
    assert torch.equal(codec.decode(encoded[1], numel).cpu(), codec.decode(encoded[0], numel))


# ---------------------------------------------------------------------------------------------
# Real gloo groups (spawned processes)


def _rank_tensor(rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: varied magnitudes, and one block that is zero on every rank."""
    x = _varied(NUMEL, seed=100 + rank)
    x[2 * BLOCK : 3 * BLOCK] = 0
    return x


def _init(rank: int, world_size: int, store_path: str, timeout_s: float) -> Any:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.distributed_c10d._get_default_group()


def _collectives_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """Every dtype through the default group, error feedback, then the async runner."""
    pg = _init(rank, world_size, store_path, timeout_s=20)
    x = _rank_tensor(rank)
    out: dict[str, Any] = {}
    try:
        for dtype in PSEUDO_GRAD_DTYPES:
            tensor = x.clone()
            stats = compressed_all_reduce(pg, tensor, dtype)
            out[dtype] = tensor
            out[f"{dtype}.bytes_sent"] = stats.bytes_sent
            out[f"{dtype}.times"] = (stats.encode_s, stats.decode_s, stats.total_s)
        reference = x.clone()
        dist.all_reduce(reference)
        out["torch_all_reduce"] = reference

        residuals = Residuals()
        tensor = x.clone()
        int4, sparse = ResidualKey(0, 0), ResidualKey(1, 0)
        compressed_all_reduce(pg, tensor, "int4", error_feedback=residuals, key=int4)
        out["int4.feedback"] = tensor
        out["int4.residual_before_commit"] = residuals.owed(int4, NUMEL)
        residuals.commit()
        out["int4.residual"] = residuals.owed(int4, NUMEL)
        tensor = x.clone()
        compressed_all_reduce(pg, tensor, "sparse", error_feedback=residuals, key=sparse)
        residuals.commit()
        out["sparse.residual"] = residuals.owed(sparse, NUMEL)

        runner = AsyncCompressedAllReduce()
        first = runner.submit(pg, x.clone(), "int8", divide_by=world_size)
        second = runner.submit(pg, x.clone(), "bfloat16", divide_by=world_size)
        assert second.wait() is True
        out["async.first_done_before_second"] = first.get_future().done()
        first.wait()
        out["async.int8"] = first.get_future().value()
        out["async.bfloat16"] = second.get_future().value()
        out["async.stats"] = (first.stats is not None, second.stats is not None)
        out["async.errors"] = [repr(w.error) for w in (first, second) if w.error is not None]
        runner.shutdown(timeout=10)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _dead_peer_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """Rank 1 leaves right after the group has formed; rank 0's collective must fail, its
    error in its work."""
    pg = _init(rank, world_size, store_path, timeout_s=5)
    # Both ranks are connected before rank 1 goes (leaving during gloo's connection setup
    # would fail rank 0's init instead of its collective, on a loaded machine).
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone before taking part in the compressed collective
    runner = AsyncCompressedAllReduce()
    residuals = Residuals()
    out: dict[str, Any] = {}
    tensor = _rank_tensor(rank)
    start = time.monotonic()
    try:
        work = runner.submit(pg, tensor, "int8", error_feedback=residuals)
        out["wait"] = work.wait()
        out["seconds"] = time.monotonic() - start
        out["done"] = work.get_future().done()
        out["value_is_tensor"] = work.get_future().value() is tensor
        errors = [] if work.error is None else [work.error]
        out["errors"] = [repr(e) for e in errors]
        # From the collective (gloo raises RuntimeError subclasses), not from a bug of ours.
        out["errors_are_runtime"] = all(isinstance(e, RuntimeError) for e in errors)
        residuals.commit()  # a failed collective staged nothing
        out["residual"] = residuals.owed(ResidualKey(0, 0), NUMEL)
        runner.shutdown(timeout=10)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    # The group is broken; tearing it down is not what this test is about.
    del pg
    os._exit(0)


def _spawn(
    fn: Callable[..., None], world_size: int, tmp_path: Path, deadline_s: float = 60
) -> list[dict[str, Any]]:
    """Run ``fn(rank, world_size, store_path, out_dir)`` in ``world_size`` processes and return
    what each rank saved; kills them (they are ours) if they outlive ``deadline_s``."""
    import torch.multiprocessing as mp

    store_path = str(tmp_path / "store")
    ctx = mp.start_processes(
        fn, args=(world_size, store_path, str(tmp_path)), nprocs=world_size, join=False
    )
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{fn.__name__} ran past {deadline_s} s")
    saved = [tmp_path / f"rank{r}.pt" for r in range(world_size)]
    return [torch.load(path) if path.exists() else {} for path in saved]


def _expected_chunk(world_size: int) -> int:
    return math.ceil(NUMEL / (world_size * BLOCK)) * BLOCK


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_all_reduce_is_identical_on_every_rank_and_close_to_the_sum(
    world_size: int, tmp_path: Path
) -> None:
    results = _spawn(_collectives_worker, world_size, tmp_path)
    inputs = [_rank_tensor(r) for r in range(world_size)]
    true_sum = torch.stack(inputs).double().sum(0)
    abs_sum = torch.stack(inputs).abs().double().sum(0)

    for dtype in PSEUDO_GRAD_DTYPES:
        for r in range(1, world_size):
            assert torch.equal(results[r][dtype], results[0][dtype]), (dtype, r)
        result = results[0][dtype].double()
        error = (result - true_sum).abs()
        if dtype == "float32":
            assert torch.equal(results[0][dtype], results[0]["torch_all_reduce"])
            continue
        if dtype == "sparse":
            # Every rank decodes every rank's encoding and adds them in rank order: exactly.
            codec = get_codec(dtype)
            decoded = [codec.decode(codec.encode(x), NUMEL) for x in inputs]
            expected = decoded[0].clone()
            for other in decoded[1:]:
                expected += other
            assert torch.equal(results[0][dtype], expected)
            for r in range(world_size):
                assert results[r][f"{dtype}.bytes_sent"] == (world_size - 1) * codec.wire_bytes(
                    NUMEL
                )
                assert torch.equal(results[r]["sparse.residual"], inputs[r] - decoded[r])
            continue
        if dtype == "bfloat16":
            # Each input cast, then the fp32 sum cast once more: 2^-8 relative each time.
            u = 2**-8
            tol = u * abs_sum + u * (1 + u) * abs_sum
        else:
            codec: Any = get_codec(dtype)
            qmax = codec.qmax
            absmax = torch.stack([_block_absmax(x) for x in inputs]).double()
            steps = (absmax / qmax).sum(0)  # the inputs' scales, summed per block
            # Half a step per input, plus half a step of the re-encoded sum, whose absmax is at
            # most the inputs' absmaxes plus their errors.
            reduced_step = (absmax.sum(0) + steps / 2) / qmax
            tol = _per_element(steps / 2 + reduced_step / 2, NUMEL)
        assert (error <= tol * (1 + 1e-4) + 1e-6).all(), (dtype, (error - tol).max().item())
        assert torch.equal(results[0][dtype][2 * BLOCK : 3 * BLOCK], torch.zeros(BLOCK))
        chunk = _expected_chunk(world_size)
        expected_bytes = 2 * (world_size - 1) * get_codec(dtype).wire_bytes(chunk)
        for r in range(world_size):
            assert results[r][f"{dtype}.bytes_sent"] == expected_bytes
            encode_s, decode_s, total_s = results[r][f"{dtype}.times"]
            assert 0 < encode_s and 0 < decode_s and encode_s + decode_s <= total_s

    assert (results[0]["int8"] - true_sum).abs().max() > 0  # the wire really was lossy

    codec = get_codec("int4")
    for r in range(world_size):
        # Nothing owed before the first round: the same result as without feedback ...
        assert torch.equal(results[r]["int4.feedback"], results[0]["int4"])
        # ... and the residual is exactly what this rank's own encoding dropped.
        own = codec.decode(codec.encode(inputs[r]), NUMEL)
        assert results[r]["int4.residual_before_commit"] is None
        assert torch.equal(results[r]["int4.residual"], inputs[r] - own)

        assert results[r]["async.errors"] == []
        assert results[r]["async.first_done_before_second"]
        assert results[r]["async.stats"] == (True, True)
        assert torch.equal(results[r]["async.int8"], results[0]["int8"] / world_size)
        assert torch.equal(results[r]["async.bfloat16"], results[0]["bfloat16"] / world_size)


def test_a_dead_peer_s_error_is_in_the_work_which_still_completes(tmp_path: Path) -> None:
    rank0 = _spawn(_dead_peer_worker, 2, tmp_path)[0]
    assert rank0["wait"] is True
    assert rank0["done"] and rank0["value_is_tensor"]
    assert len(rank0["errors"]) == 1 and rank0["errors_are_runtime"], rank0["errors"]
    assert rank0["seconds"] < 15
    # Nothing was delivered, so the residual was not replaced by this round's.
    assert rank0["residual"] is None


@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
@pytest.mark.parametrize("numel", [1, BLOCK, 5 * BLOCK + 3, NUMEL])
def test_working_in_pieces_gives_the_results_of_one_pass(monkeypatch, dtype: str, numel: int):
    from torchtitan.experiments.fault_tolerance.transport import codecs

    codec = get_codec(dtype)
    x = _varied(numel, seed=11)
    previous = torch.randn(numel)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        packed = torch.empty(codec.wire_bytes(numel), dtype=torch.uint8)
        residual = torch.empty(numel)
        codec.encode_into(x, packed, numel, residual=residual)
        summed = previous.clone()
        codec.decode_into(packed, numel, summed, accumulate=True)
        return packed, residual, codec.decode(packed, numel), summed

    monkeypatch.setattr(codecs, "ENCODE_PIECE_VALUES", 10**9)
    whole = run()
    monkeypatch.setattr(codecs, "ENCODE_PIECE_VALUES", 2 * BLOCK)
    for expected, got in zip(whole, run(), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
def test_encode_into_takes_the_tail_as_zeros_and_computes_the_residual(dtype: str) -> None:
    """What compressed_all_reduce relies on: a short last chunk encodes as if zero padded, its
    residual is exactly what decoding drops, a decode can stop early or add to a sum."""
    codec = get_codec(dtype)
    numel, k = 3 * BLOCK, 2 * BLOCK - 5
    x = _varied(k, seed=12)
    padded = torch.cat([x, torch.zeros(numel - k)])
    packed = torch.full((codec.wire_bytes(numel),), 0x5A, dtype=torch.uint8)  # stale bytes
    residual = torch.full((k,), float("nan"))
    codec.encode_into(x, packed, numel, residual=residual)
    assert torch.equal(packed, codec.encode(padded))
    decoded = codec.decode(packed, numel)
    assert torch.equal(decoded[k:], torch.zeros(numel - k))
    assert torch.equal(residual, x - decoded[:k])
    if dtype == "float32":
        assert torch.equal(residual, torch.zeros(k))

    head = torch.empty(k)
    codec.decode_into(packed, numel, head)
    assert torch.equal(head, decoded[:k])
    total = torch.ones(numel)
    codec.decode_into(packed, numel, total, accumulate=True)
    assert torch.equal(total, 1 + decoded)

    with pytest.raises(ValueError, match="do not fit"):
        codec.encode_into(padded, packed[: codec.wire_bytes(k)], k)
    with pytest.raises(ValueError, match="more than the"):
        codec.decode_into(packed, numel, torch.empty(numel + 1))
    with pytest.raises(ValueError, match="4-byte aligned"):
        shifted = torch.empty(codec.wire_bytes(numel) + 1, dtype=torch.uint8)
        codec.encode_into(x, shifted[1:], numel)
