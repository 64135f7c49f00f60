"""Compressed SUM all-reduce of DiLoCo pseudo-gradients (bfloat16, int8 or int4 on the wire).

A DiLoCo outer step all-reduces one pseudo-gradient per fragment across replica groups, usually
over the slowest links of the job. This module shrinks those bytes: each rank encodes its
(error-corrected) fp32 tensor with a :class:`Codec`, the ranks exchange the encoded bytes and
reduce in fp32, and every rank decodes the same final bytes. It uses only ``alltoall_base``,
``allgather`` and ``allreduce`` of a torch.distributed-style process group (torch's Gloo/NCCL
groups or torchft's reconfigurable wrappers) and plain torch ops, so it runs on CPU/gloo and on
CUDA/nccl alike.

Codecs (``PSEUDO_GRAD_DTYPES``), each turning a flat fp32 tensor of ``numel`` elements into one
uint8 tensor, so that a single tensor travels per peer:

* ``float32``: the raw fp32 bytes (``4 * numel``); the all-reduce is a plain ``allreduce``.
* ``bfloat16``: the raw bf16 bytes of ``x.to(torch.bfloat16)`` (``2 * numel``).
* ``int8``: blocks of ``BLOCK`` (128) consecutive elements, the last one possibly short. Layout:
  ``ceil(numel / BLOCK)`` fp32 scales (native byte order), then ``numel`` int8 values. A block's
  scale is ``absmax / 127`` and ``q = round(x / scale)`` (round half to even) clamped to
  ``[-127, 127]``; a zero block gets scale 0 and decodes to zeros. Decoding is ``q * scale``.
* ``int4``: the same with ``scale = absmax / 7`` and ``q`` in ``[-7, 7]``. Layout: the fp32
  scales, then ``ceil(numel / 2)`` bytes, two values per byte, element ``2i`` in the low nibble
  and ``2i + 1`` in the high nibble, each stored as ``q + 8`` (an odd tail is padded with 8).

The scales come first so that they sit 4-byte aligned and can be read without a copy.

The all-reduce (:func:`compressed_all_reduce`) keeps the byte saving for any number ``n`` of
ranks: the tensor is padded to ``n`` equal chunks (each a whole number of blocks, so blocks never
straddle chunks) and every chunk is encoded; an all-to-all gives rank ``r`` every rank's chunk
``r``, which it decodes and sums in fp32 in rank order; it encodes that reduced chunk once more
and an all-gather hands every rank all ``n`` reduced chunks, which each rank decodes into the
tensor. A rank sends ``2 * (n - 1)`` encoded chunks in all, as a ring all-reduce would.

Why every rank ends with bit-identical values: each reduced chunk is summed by one rank only, and
every rank (its owner included) takes the result from the same re-encoded bytes, never from the
owner's private fp32 sum. Decoding is an exact cast followed by one IEEE fp32 multiply per
element, which gives the same value on every rank and device. So the outer optimizers of all
replica groups step with the same average and their global parameters stay equal.

Error feedback (:class:`ErrorFeedback`) keeps, per tensor key, what this rank's own compression
dropped, and adds it to the next round's input, so that the quantization error is delivered
later instead of lost: over many rounds the sum of what was sent tracks the sum of the inputs.
The residual covers the first (per-rank) encoding only; the re-encoding of the reduced chunk is
shared by all ranks and not fed back.

Failure semantics follow torchft's ``Manager.allreduce``: :func:`compressed_all_reduce` raises
whatever the collective raises, and leaves the tensor undefined. :class:`AsyncCompressedAllReduce`
runs it on a background thread and on failure calls ``on_error`` (the Manager's
``report_error``, so that the step is not committed) and completes the future normally; ``wait``
does not raise. A failed collective leaves the error-feedback residual as it was, because none of
the corrected tensor was delivered.

Inputs must be finite: an inf or NaN in a block makes that block's scale non-finite.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

__all__ = [
    "BLOCK",
    "PSEUDO_GRAD_DTYPES",
    "AsyncCompressedAllReduce",
    "BFloat16Codec",
    "BlockQuantCodec",
    "Codec",
    "CompressedWork",
    "CompressionStats",
    "ErrorFeedback",
    "Float32Codec",
    "chunk_numel",
    "compressed_all_reduce",
    "get_codec",
]

PSEUDO_GRAD_DTYPES = ("float32", "bfloat16", "int8", "int4")

# Elements per quantization block: one fp32 scale per block costs 4 / BLOCK bytes per element
# (0.03 for 128), small next to the 1 or 0.5 bytes of the values themselves.
BLOCK = 128


#: Values a quantizing encode handles at a time (a multiple of BLOCK, so of 2 too).
ENCODE_CHUNK = 1024 * BLOCK


def _view_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` (1-D uint8) reinterpreted as ``dtype``; copied first if it is not aligned for it,
    since a dtype view needs the start of the slice on an element boundary."""
    if buf.storage_offset() % dtype.itemsize != 0:
        buf = buf.clone()
    return buf.view(dtype)


def _check_flat_fp32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"expected a contiguous 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}"
        )


def _decode_target(numel: int, packed: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` after checking it can hold ``numel`` fp32 values, or a new tensor for them."""
    if out is None:
        return torch.empty(numel, dtype=torch.float32, device=packed.device)
    _check_flat_fp32(out)
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements, expected {numel}")
    return out


class Codec:
    """Encodes a flat fp32 tensor into one uint8 tensor and back."""

    name: str = ""

    def wire_bytes(self, numel: int) -> int:
        """The exact size in bytes of ``encode`` of ``numel`` elements."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (1-D contiguous fp32) as a new uint8 tensor of ``wire_bytes(x.numel())``."""
        raise NotImplementedError

    def decode(
        self, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``numel`` fp32 values encoded in ``packed`` (written into ``out`` if given)."""
        raise NotImplementedError

    def _check_packed(self, packed: torch.Tensor, numel: int) -> None:
        expected = self.wire_bytes(numel)
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
            raise ValueError(
                f"{self.name}: expected {expected} uint8 bytes for {numel} elements, "
                f"got {packed.dtype} of shape {tuple(packed.shape)}"
            )


class Float32Codec(Codec):
    """The raw fp32 bytes (no compression; for a uniform interface)."""

    name = "float32"

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        _check_flat_fp32(x)
        # A copy, so that the encoded bytes do not change with the caller's tensor.
        return x.clone().view(torch.uint8)

    def decode(
        self, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check_packed(packed, numel)
        out = _decode_target(numel, packed, out)
        return out.copy_(_view_as(packed, torch.float32))


class BFloat16Codec(Codec):
    """The raw bytes of ``x`` cast to bfloat16 (round to nearest even)."""

    name = "bfloat16"

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        _check_flat_fp32(x)
        return x.to(torch.bfloat16).view(torch.uint8)

    def decode(
        self, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check_packed(packed, numel)
        out = _decode_target(numel, packed, out)
        # bf16 -> fp32 is exact, so every rank gets the same values.
        return out.copy_(_view_as(packed, torch.bfloat16))


class BlockQuantCodec(Codec):
    """Symmetric block-wise absmax quantization to 8 or 4 bits (layout: module docstring)."""

    def __init__(self, bits: int) -> None:
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        self.bits = bits
        self.name = f"int{bits}"
        # Symmetric range: -qmax..qmax, so that 0 is exact and the sign costs no bias.
        self.qmax = 127 if bits == 8 else 7

    def _payload_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def wire_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / BLOCK) + self._payload_bytes(numel)

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """The per-block scales ``encode`` stores for ``x`` (absmax / qmax)."""
        _check_flat_fp32(x)
        nblocks = math.ceil(x.numel() / BLOCK)
        padded = torch.nn.functional.pad(x, (0, nblocks * BLOCK - x.numel()))
        return padded.view(nblocks, BLOCK).abs().amax(dim=1) / self.qmax

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        _check_flat_fp32(x)
        numel = x.numel()
        nblocks = math.ceil(numel / BLOCK)
        out = torch.empty(self.wire_bytes(numel), dtype=torch.uint8, device=x.device)
        scales = out[: 4 * nblocks].view(torch.float32)
        payload = out[4 * nblocks :]
        # Whole blocks at a time, ENCODE_CHUNK values each: the same bytes as one pass, but
        # the temporaries stay small (one pass over a whole model's pseudo-gradient allocated
        # several model-sized buffers, and on the CPU that cost more than the arithmetic).
        per_byte = 1 if self.bits == 8 else 2
        for start in range(0, numel, ENCODE_CHUNK):
            end = min(numel, start + ENCODE_CHUNK)
            self._encode_blocks(
                x[start:end],
                scales[start // BLOCK : math.ceil(end / BLOCK)],
                payload[start // per_byte : math.ceil(end / per_byte)],
            )
        return out

    def _encode_blocks(self, x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
        """Encode ``x`` (whole blocks, except at the tensor's end) into ``scales``/``payload``."""
        numel = x.numel()
        nblocks = scales.numel()
        # Zero padding to whole blocks changes no absmax and is cut off again below.
        blocks = torch.nn.functional.pad(x, (0, nblocks * BLOCK - numel)).view(nblocks, BLOCK)
        scale = blocks.abs().amax(dim=1) / self.qmax
        # A zero scale (zero block) divides by 1 instead: its values are 0 and quantize to 0.
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / divisor.unsqueeze(1)).clamp_(-self.qmax, self.qmax).view(-1)
        scales.copy_(scale)
        if self.bits == 8:
            payload.view(torch.int8).copy_(q[:numel])
        else:
            # Offset by 8 so that each value is a nibble 1..15; the padding stores 8 (zero).
            nib = (q[: 2 * payload.numel()] + 8).to(torch.uint8).view(-1, 2)
            payload.copy_(nib[:, 0] | (nib[:, 1] << 4))

    def decode(
        self, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check_packed(packed, numel)
        out = _decode_target(numel, packed, out)
        if numel == 0:
            return out
        nblocks = math.ceil(numel / BLOCK)
        scale = _view_as(packed[: 4 * nblocks], torch.float32)
        payload = packed[4 * nblocks :]
        if self.bits == 8:
            out.copy_(payload.view(torch.int8))
        else:
            nib = torch.stack((payload & 0xF, payload >> 4), dim=1).view(-1)[:numel]
            out.copy_(nib.to(torch.int16) - 8)
        # One exact int -> fp32 cast and one fp32 multiply per element: deterministic.
        full = numel // BLOCK
        out[: full * BLOCK].view(full, BLOCK).mul_(scale[:full].unsqueeze(1))
        if full < nblocks:
            out[full * BLOCK :].mul_(scale[full])
        return out


_CODECS: dict[str, Codec] = {
    "float32": Float32Codec(),
    "bfloat16": BFloat16Codec(),
    "int8": BlockQuantCodec(8),
    "int4": BlockQuantCodec(4),
}


def get_codec(dtype: str) -> Codec:
    """The codec of a name in ``PSEUDO_GRAD_DTYPES``."""
    try:
        return _CODECS[dtype]
    except KeyError:
        raise ValueError(
            f"unknown pseudo-gradient dtype {dtype!r}; expected one of {PSEUDO_GRAD_DTYPES}"
        ) from None


class ErrorFeedback:
    """Per-key residual of this rank's own compression, added back before the next encoding.

    ``correct(key, x)`` returns ``x + residual``; after that tensor is encoded,
    ``update(key, corrected, decoded)`` stores ``corrected - decoded``. The residuals are part
    of the training state (``state_dict``/``load_state_dict``): without them a restarted rank
    would drop the error it still owes.

    Keys of a fragment's pseudo-gradient are ``fragment_key(fragment, n)``: the ``n``-th tensor
    of the fragment's sync (torchft's buckets, in order; async DiLoCo sends one). Together they
    cover the fragment's parameters once, so a checkpoint holds a fragment's residuals as one
    flat tensor of fixed size (:meth:`fragment_residual`), whatever the bucket sizes, and a
    restarted rank hands it back in slices as the sync's tensors come
    (:meth:`load_fragment_residual`).
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        #: Loaded flat residuals not handed out yet: fragment -> (flat, offset taken so far).
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}

    @staticmethod
    def fragment_key(fragment: int, index: int) -> str:
        return f"fragment_{fragment}/{index}"

    def correct(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """A new tensor ``x + residual[key]`` (a copy of ``x`` if there is no residual yet)."""
        residual = self._residuals.get(key)
        if residual is None:
            residual = self._take_pending(key, x.numel())
        if residual is None:
            return x.clone()
        if residual.shape != x.shape:
            raise ValueError(
                f"error feedback {key!r}: residual has shape {tuple(residual.shape)}, "
                f"tensor has {tuple(x.shape)}"
            )
        # The residual may come from a checkpoint loaded on another device.
        return x + residual.to(device=x.device, dtype=x.dtype)

    def _take_pending(self, key: str, numel: int) -> torch.Tensor | None:
        """The next ``numel`` values of a loaded flat residual of ``key``'s fragment."""
        fragment = _fragment_of_key(key)
        if fragment is None or fragment not in self._pending:
            return None
        flat, offset = self._pending[fragment]
        if offset + numel > flat.numel():
            raise ValueError(
                f"error feedback {key!r}: the checkpointed residual of fragment {fragment} has "
                f"{flat.numel()} values, {offset} taken; this tensor needs {numel} more"
            )
        if offset + numel == flat.numel():
            del self._pending[fragment]
        else:
            self._pending[fragment] = (flat, offset + numel)
        return flat[offset : offset + numel]

    def fragment_residual(self, fragment: int, numel: int) -> torch.Tensor:
        """This rank's residuals of ``fragment`` as one flat fp32 CPU tensor of ``numel``
        values (the fragment's local parameters), in key order; zeros where it owes nothing
        (before its first compressed sync, or right after a heal)."""
        flat = torch.zeros(numel, dtype=torch.float32)
        if fragment in self._pending:
            pending, offset = self._pending[fragment]
            flat[offset:] = pending[offset:].cpu()
        keys = sorted(
            (int(k.rsplit("/", 1)[1]), k)
            for k in self._residuals
            if _fragment_of_key(k) == fragment
        )
        offset = 0
        for _, key in keys:
            residual = self._residuals[key].reshape(-1)
            if offset + residual.numel() > numel:
                raise ValueError(
                    f"error feedback: fragment {fragment}'s residuals hold more than its "
                    f"{numel} parameter values (key {key!r})"
                )
            flat[offset : offset + residual.numel()] = residual.cpu()
            offset += residual.numel()
        return flat

    def load_fragment_residual(self, fragment: int, flat: torch.Tensor) -> None:
        """Owe ``flat`` (from :meth:`fragment_residual`) again: the fragment's next sync takes
        it in slices, one per tensor, in key order."""
        for key in [k for k in self._residuals if _fragment_of_key(k) == fragment]:
            del self._residuals[key]
        self._pending[fragment] = (flat.detach().reshape(-1).clone(), 0)

    def update(self, key: str, corrected: torch.Tensor, decoded: torch.Tensor) -> None:
        """Store ``corrected - decoded``: what the encoding of ``corrected`` dropped."""
        self._residuals[key] = corrected - decoded

    def set_residual(self, key: str, residual: torch.Tensor) -> None:
        """Store an already computed residual for ``key``."""
        self._residuals[key] = residual

    def encode(self, key: str, x: torch.Tensor, codec: Codec) -> torch.Tensor:
        """``codec.encode(x + residual)``, updating the residual."""
        corrected = self.correct(key, x)
        packed = codec.encode(corrected)
        self.update(key, corrected, codec.decode(packed, corrected.numel()))
        return packed

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual of ``key`` (None before its first update)."""
        return self._residuals.get(key)

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of ``key``, or all of them (and any loaded, not yet taken)."""
        if key is None:
            self._residuals.clear()
            self._pending.clear()
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals by key (the tensors themselves, not copies)."""
        return dict(self._residuals)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with copies of those in ``state_dict``."""
        self._residuals = {key: value.detach().clone() for key, value in state_dict.items()}


def _fragment_of_key(key: str) -> int | None:
    """The fragment of a key made by :meth:`ErrorFeedback.fragment_key` (None for others)."""
    head, _, tail = key.partition("/")
    if not head.startswith("fragment_") or not tail.isdigit():
        return None
    return int(head.removeprefix("fragment_"))


@dataclass
class CompressionStats:
    """What one compressed all-reduce cost this rank.

    ``bytes_sent`` counts the bytes this rank put on the wire: for the compressed dtypes its
    ``n - 1`` outgoing chunks of the all-to-all plus its re-encoded chunk to each of the
    ``n - 1`` peers in the all-gather; for ``float32`` the nominal bandwidth-optimal volume
    ``2 * (n - 1) * 4 * ceil(numel / n)`` (the backend chooses its own algorithm). The timings
    are host seconds; on CUDA the stream is synchronized around each phase so that they hold.
    """

    dtype: str
    numel: int
    world_size: int
    bytes_sent: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0


def _sync(t: torch.Tensor) -> None:
    """Wait for the queued kernels on ``t``'s device, so that host timings measure them."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements per rank's chunk: ``numel / world_size`` rounded up to whole blocks."""
    return math.ceil(math.ceil(numel / world_size) / BLOCK) * BLOCK


def compressed_all_reduce(
    pg: dist.ProcessGroup,
    tensor: torch.Tensor,
    dtype: str,
    *,
    error_feedback: ErrorFeedback | None = None,
    key: str = "",
) -> CompressionStats:
    """SUM all-reduce of the 1-D fp32 ``tensor`` in place over ``pg``, ``dtype`` on the wire.

    Every rank must call it with the same ``dtype`` and ``tensor.numel()``, in the same order.
    Blocks until the result is in ``tensor`` (bit-identical on every rank). With
    ``error_feedback``, this rank's residual under ``key`` is added first and updated once the
    collectives succeed. Raises what the collectives raise; ``tensor`` is then undefined.
    """
    codec = get_codec(dtype)
    _check_flat_fp32(tensor)
    # No ``pg.rank()``: the collectives place each rank's part by rank themselves, and torchft's
    # reconfigurable wrappers answer rank() with 0 whatever the real rank is.
    n, numel = pg.size(), tensor.numel()
    stats = CompressionStats(dtype=dtype, numel=numel, world_size=n)
    start = time.perf_counter()

    if dtype == "float32":
        if error_feedback is not None:
            # fp32 drops nothing, but a residual from another dtype is still owed.
            corrected = error_feedback.correct(key, tensor)
            tensor.copy_(corrected)
        if n > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
            pg.allreduce([tensor], opts).wait()
            stats.bytes_sent = 2 * (n - 1) * 4 * math.ceil(numel / n)
        if error_feedback is not None:
            error_feedback.reset(key)
        _sync(tensor)
        stats.total_s = time.perf_counter() - start
        return stats

    if numel == 0:
        return stats
    corrected = tensor if error_feedback is None else error_feedback.correct(key, tensor)

    if n == 1:
        # Nobody to talk to: the result is what the encoding keeps of the tensor.
        t0 = time.perf_counter()
        packed = codec.encode(corrected)
        _sync(tensor)
        t1 = time.perf_counter()
        codec.decode(packed, numel, out=tensor)
        _sync(tensor)
        stats.encode_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
        if error_feedback is not None:
            error_feedback.update(key, corrected, tensor)
        stats.total_s = time.perf_counter() - start
        return stats

    chunk = chunk_numel(numel, n)
    chunk_bytes = codec.wire_bytes(chunk)
    padded = torch.zeros(n * chunk, dtype=torch.float32, device=tensor.device)
    padded[:numel].copy_(corrected)

    # Phase 1: encode every chunk; all-to-all so that rank r holds every rank's chunk r.
    t0 = time.perf_counter()
    send = torch.cat([codec.encode(part) for part in padded.split(chunk)])
    _sync(send)
    stats.encode_s += time.perf_counter() - t0
    residual: torch.Tensor | None = None
    if error_feedback is not None:
        t0 = time.perf_counter()
        own = torch.empty_like(padded)
        for i in range(n):
            own_part = own[i * chunk : (i + 1) * chunk]
            codec.decode(send[i * chunk_bytes : (i + 1) * chunk_bytes], chunk, out=own_part)
        # Kept aside (not stored yet) so that ``own`` and ``corrected`` can be freed.
        residual = corrected - own[:numel]
        del own
        _sync(residual)
        stats.decode_s += time.perf_counter() - t0
    recv = torch.empty_like(send)
    splits = [chunk_bytes] * n
    pg.alltoall_base(recv, send, splits, splits, dist.AllToAllOptions()).wait()

    # Reduce this rank's chunk in fp32, in rank order, so that a rerun gives the same bytes.
    t0 = time.perf_counter()
    reduced = torch.zeros(chunk, dtype=torch.float32, device=tensor.device)
    part = torch.empty(chunk, dtype=torch.float32, device=tensor.device)
    for i in range(n):
        reduced += codec.decode(recv[i * chunk_bytes : (i + 1) * chunk_bytes], chunk, out=part)
    _sync(reduced)
    t1 = time.perf_counter()
    stats.decode_s += t1 - t0
    mine = codec.encode(reduced)
    _sync(mine)
    stats.encode_s += time.perf_counter() - t1

    # Phase 2: all-gather the re-encoded chunks; every rank decodes the same n chunks, its own
    # included (from the bytes, not from ``reduced``), so that all ranks hold identical values.
    gathered = [torch.empty_like(mine) for _ in range(n)]
    pg.allgather([gathered], [mine], AllgatherOptions()).wait()
    t0 = time.perf_counter()
    for i, packed in enumerate(gathered):
        codec.decode(packed, chunk, out=padded[i * chunk : (i + 1) * chunk])
    tensor.copy_(padded[:numel])
    _sync(tensor)
    stats.decode_s += time.perf_counter() - t0

    if error_feedback is not None and residual is not None:
        # Only now: had a collective failed, nothing was delivered and the old residual is
        # still owed.
        error_feedback.set_residual(key, residual)
    stats.bytes_sent = 2 * (n - 1) * chunk_bytes
    stats.total_s = time.perf_counter() - start
    return stats


class CompressedWork:
    """A submitted :meth:`AsyncCompressedAllReduce.submit`: wait for it or chain on its future.

    The future completes with the tensor once the all-reduce (and the division) is done, or
    after a failure has been passed to ``on_error``; it never carries the collective's error.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.stats: CompressionStats | None = None
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._done = threading.Event()

    def wait(self) -> bool:
        """Block until done, callbacks chained on the future included (torchft's DiLoCo copies
        a bucket back into its gradients in one: a future's ``wait`` returns before its
        callbacks have run). True, as torchft's works return (a failure went to
        ``on_error``)."""
        self._done.wait()
        return True

    def complete(self, error: BaseException | None = None) -> None:
        """Complete the future (running its callbacks), then release ``wait``."""
        try:
            if error is None:
                self._future.set_result(self.tensor)
            else:
                self._future.set_exception(error)  # type: ignore[arg-type]  # stub says T
        finally:
            self._done.set()

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        """Completes with the tensor when done."""
        return self._future


def sent_and_seconds(works: list[Any]) -> tuple[int, float] | None:
    """Bytes sent and seconds spent compressing and decompressing by the finished compressed
    works among ``works`` (others are skipped); None when there are none."""
    stats = [w.stats for w in works if getattr(w, "stats", None) is not None]
    if not stats:
        return None
    return sum(s.bytes_sent for s in stats), sum(s.encode_s + s.decode_s for s in stats)


class _Job(NamedTuple):
    pg: dist.ProcessGroup
    tensor: torch.Tensor
    dtype: str
    divide_by: float
    error_feedback: ErrorFeedback | None
    key: str
    on_error: Callable[[Exception], None]
    ready: torch.cuda.Event | None
    work: CompressedWork


class AsyncCompressedAllReduce:
    """Runs :func:`compressed_all_reduce` on one background thread, in submission order.

    One thread and a FIFO queue: every rank submits the same collectives in the same order, so
    the thread issues them in the same order on every rank, as collectives require. The caller
    goes on computing meanwhile (Gloo's ``wait`` blocks its thread, and the encode and decode
    kernels run here too). On CUDA the thread works on its own stream, after the submitter's
    stream has produced the tensor, and synchronizes before completing the future.
    """

    def __init__(self, name: str = "compressed-allreduce") -> None:
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False
        self._lock = threading.Lock()
        # A daemon thread, so that a collective hung on a dead peer cannot block process exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        pg: dist.ProcessGroup,
        tensor: torch.Tensor,
        dtype: str,
        *,
        divide_by: float = 1,
        error_feedback: ErrorFeedback | None = None,
        key: str = "",
        on_error: Callable[[Exception], None],
    ) -> CompressedWork:
        """Queue a SUM all-reduce of ``tensor`` (then divided by ``divide_by``) in place.

        Do not touch ``tensor`` until the returned work is done. If the collective fails,
        ``on_error(e)`` is called and the work still completes; the tensor is then undefined.
        """
        get_codec(dtype)  # fail here, in the caller, on a bad name
        _check_flat_fp32(tensor)
        ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        work = CompressedWork(tensor)
        job = _Job(pg, tensor, dtype, divide_by, error_feedback, key, on_error, ready, work)
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCompressedAllReduce is shut down")
            self._queue.put(job)
        return work

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish the queued collectives, then stop the thread (waiting up to ``timeout``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        try:
            if job.ready is not None:
                stream = self._streams.get(job.tensor.device)
                if stream is None:
                    stream = torch.cuda.Stream(job.tensor.device)
                    self._streams[job.tensor.device] = stream
                # The caller's allocator stream must not reuse the memory while we use it.
                job.tensor.record_stream(stream)
                with torch.cuda.device(job.tensor.device), torch.cuda.stream(stream):
                    stream.wait_event(job.ready)
                    self._reduce(job)
                    stream.synchronize()
            else:
                self._reduce(job)
        except Exception as e:  # torchft semantics: record the error, complete normally
            try:
                job.on_error(e)
            except Exception as handler_error:
                # Nobody else would see it: hand it to the waiter rather than hang or drop it.
                job.work.complete(handler_error)
                return
        job.work.complete()

    @staticmethod
    def _reduce(job: _Job) -> None:
        job.work.stats = compressed_all_reduce(
            job.pg, job.tensor, job.dtype, error_feedback=job.error_feedback, key=job.key
        )
        if job.divide_by != 1:
            job.tensor.div_(job.divide_by)
