"""Compressed SUM all-reduce of DiLoCo pseudo-gradients (bfloat16, int8 or int4 on the wire).

A DiLoCo outer step all-reduces one pseudo-gradient per fragment across replica groups, usually
over the slowest links of the job. This module shrinks those bytes: each rank encodes its
(error-corrected) fp32 tensor with a :class:`Codec`, the ranks exchange the encoded bytes and
reduce in fp32, and every rank decodes the same final bytes. It uses only ``alltoall_base``,
``allgather`` and ``allreduce`` of a torch.distributed-style process group (torch's Gloo/NCCL
groups or torchft's reconfigurable wrappers) and plain torch ops, so the same code serves
CPU/gloo and CUDA/nccl (tested on CPU/gloo; not yet run on a GPU).

Codecs (``PSEUDO_GRAD_DTYPES``), each turning a flat fp32 tensor of ``numel`` elements into one
uint8 tensor, so that a single tensor travels per peer:

* ``float32``: the raw fp32 bytes (``4 * numel``); the all-reduce is a plain ``allreduce``.
* ``bfloat16``: the raw bf16 bytes of ``x.to(torch.bfloat16)`` (``2 * numel``).
* ``int8``: blocks of ``BLOCK`` (128) consecutive elements, the last one possibly short. Layout:
  ``ceil(numel / BLOCK)`` fp32 scales (native byte order), then ``numel`` int8 values. A block's
  scale is ``absmax / 127`` (at least ``SMALLEST_SCALE``, the smallest normal fp32) and
  ``q = round(x / scale)`` (round half to even), which lies in ``[-127, 127]``; a zero block
  gets scale 0 and decodes to zeros. Decoding is ``q * scale``.
* ``int4``: the same with ``scale = absmax / 7`` and ``q`` in ``[-7, 7]``. Layout: the fp32
  scales, then ``ceil(numel / 2)`` bytes, two values per byte, element ``2i`` in the low nibble
  and ``2i + 1`` in the high nibble, each stored as ``q + 8`` (an odd tail is padded with 8).

The scales come first so that they sit 4-byte aligned and can be read without a copy.

The all-reduce (:func:`compressed_all_reduce`) keeps the byte saving for any number ``n`` of
ranks: the tensor is cut into ``n`` equal chunks (each a whole number of blocks, so blocks never
straddle chunks; the last one is encoded as if padded with zeros) and every chunk is encoded; an
all-to-all gives rank ``r`` every rank's chunk ``r``, which it decodes and sums in fp32 in rank
order; it encodes that reduced chunk once more and an all-gather hands every rank all ``n``
reduced chunks, which each rank decodes into the tensor. A rank sends ``2 * (n - 1)`` encoded
chunks in all, as a ring all-reduce would.

Why every rank ends with bit-identical values: each reduced chunk is summed by one rank only, and
every rank (its owner included) takes the result from the same re-encoded bytes, never from the
owner's private fp32 sum. Decoding is an exact cast (for int4 also an exact subtraction of 8)
followed by one IEEE fp32 multiply per element, which gives the same value on every rank and
device. So the outer optimizers of all
replica groups step with the same average and their global parameters stay equal.

Error feedback (:class:`ErrorFeedback`) keeps, per tensor key, what this rank's own compression
dropped, and adds it to the next round's input, so that the quantization error is delivered
later instead of lost: over many rounds the sum of what was sent tracks the sum of the inputs.
The residual covers the first (per-rank) encoding only; the re-encoding of the reduced chunk is
shared by all ranks and not fed back.

Cost on the CPU: an encode or decode goes through the tensor ``PIECE`` values at a time, with
temporaries allocated once per collective and reused (:class:`Scratch`), because on the CPU
faulting in a fresh buffer cost more than the arithmetic done in it. The error-feedback residual
is computed by the encode itself (no decode of this rank's own bytes), chunks are encoded from
the tensor and decoded into it directly, and a received chunk is added to the sum piece by piece.
On one core, a 2-rank int4 sync of 4.85 M values spends about 35 ms encoding and decoding (80 ms
before this layout; ``benchmarks/README.md`` has the measurements).

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
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

__all__ = [
    "BLOCK",
    "PSEUDO_GRAD_DTYPES",
    "SMALLEST_SCALE",
    "AsyncCompressedAllReduce",
    "BlockQuantCodec",
    "CastCodec",
    "Codec",
    "CompressedWork",
    "CompressionStats",
    "ErrorFeedback",
    "Scratch",
    "chunk_numel",
    "compressed_all_reduce",
    "get_codec",
    "is_finite",
]

from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES  # noqa: E402

# Elements per quantization block: one fp32 scale per block costs 4 / BLOCK bytes per element
# (0.03 for 128), small next to the 1 or 0.5 bytes of the values themselves.
BLOCK = 128


#: The smallest scale of a block that is not all zeros: the smallest normal fp32. With a
#: subnormal scale, absmax / scale could exceed qmax (a subnormal has fewer significant bits);
#: only blocks whose values are all below qmax * 1.2e-38 in magnitude get this coarser step.
SMALLEST_SCALE = torch.finfo(torch.float32).tiny

#: Values a codec handles at a time (a multiple of BLOCK, so of 2 too). Every temporary of an
#: encode or decode is at most one piece long and is reused for the next piece (:class:`Scratch`).
PIECE = 4096 * BLOCK


class Scratch:
    """Named buffers on one device, reused: a codec's temporaries (at most :data:`PIECE`
    elements, reused piece after piece) and :func:`compressed_all_reduce`'s wire buffers.

    On the CPU, a fresh buffer of a megabyte or more comes from the kernel as untouched pages,
    and faulting them in cost more than the arithmetic done on them (a whole int4 encode of 4.85 M
    values took 24 ms with a new buffer per operation, 6 ms reusing them). One ``Scratch`` serves
    one thread: :class:`AsyncCompressedAllReduce` keeps one per device for all its collectives.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements (contents undefined), kept as ``name``."""
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:numel]


def _view_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` (1-D uint8) reinterpreted as ``dtype``; copied first if it is not aligned for it,
    since a dtype view needs the start of the slice on an element boundary."""
    if buf.storage_offset() % dtype.itemsize != 0:
        buf = buf.clone()
    return buf.view(dtype)


def _check_flat_fp32(x: torch.Tensor, what: str = "") -> None:
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"{what}expected a contiguous 1-D float32 tensor, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )


def _require_little_endian() -> None:
    """int4 (un)packing views int16 pairs as their two bytes, low byte first."""
    if sys.byteorder != "little":
        raise RuntimeError("pseudo_grad_dtype=int4 needs a little-endian host")


def _pieces(numel: int) -> range:
    return range(0, numel, PIECE)


class Codec:
    """Encodes a flat fp32 tensor into one uint8 tensor and back.

    ``encode``/``decode`` are the plain interface. :func:`compressed_all_reduce` uses
    ``encode_into``/``decode_into``, which write into given buffers, take the tensor's tail as
    zeros, compute the error-feedback residual on the way and add a decoded chunk to a sum,
    so that no extra pass over the tensor is needed for any of it.
    """

    name: str = ""

    def wire_bytes(self, numel: int) -> int:
        """The exact size in bytes of ``encode`` of ``numel`` elements."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (1-D contiguous fp32) as a new uint8 tensor of ``wire_bytes(x.numel())``."""
        _check_flat_fp32(x)
        out = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        self.encode_into(x, out, x.numel())
        return out

    def decode(
        self, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``numel`` fp32 values encoded in ``packed`` (written into ``out`` if given)."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=packed.device)
        elif out.numel() != numel:
            raise ValueError(f"out has {out.numel()} elements, expected {numel}")
        self.decode_into(packed, numel, out)
        return out

    def encode_into(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        *,
        residual: torch.Tensor | None = None,
        scratch: Scratch | None = None,
    ) -> None:
        """Encode ``numel`` values, ``x`` followed by ``numel - x.numel()`` zeros, into ``out``
        (``wire_bytes(numel)`` uint8, starting 4-byte aligned). With ``residual`` (fp32 like
        ``x``), store in it ``x`` minus what ``out`` decodes to, bit for bit."""
        _check_flat_fp32(x)
        if x.numel() > numel:
            raise ValueError(f"{self.name}: {x.numel()} values do not fit in {numel}")
        self._check_packed(out, numel)
        if out.storage_offset() % 4 != 0:
            raise ValueError(f"{self.name}: out must start 4-byte aligned")
        if residual is not None:
            _check_flat_fp32(residual, "residual: ")
            if residual.numel() != x.numel():
                raise ValueError(f"residual has {residual.numel()} elements, x {x.numel()}")
        self._encode(x, out, numel, residual, scratch or Scratch(x.device))

    def decode_into(
        self,
        packed: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        *,
        accumulate: bool = False,
        scratch: Scratch | None = None,
    ) -> None:
        """The first ``out.numel()`` (at most ``numel``) of the ``numel`` values encoded in
        ``packed``, written into ``out`` (1-D contiguous fp32), or added to it with
        ``accumulate`` (one fp32 addition per element)."""
        self._check_packed(packed, numel)
        _check_flat_fp32(out, "out: ")
        if out.numel() > numel:
            raise ValueError(f"out has {out.numel()} elements, more than the {numel} encoded")
        if out.numel() == 0:
            return
        self._decode(packed, numel, out, accumulate, scratch or Scratch(out.device))

    def _encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        residual: torch.Tensor | None,
        scratch: Scratch,
    ) -> None:
        raise NotImplementedError

    def _decode(
        self,
        packed: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        accumulate: bool,
        scratch: Scratch,
    ) -> None:
        raise NotImplementedError

    def _check_packed(self, packed: torch.Tensor, numel: int) -> None:
        expected = self.wire_bytes(numel)
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
            raise ValueError(
                f"{self.name}: expected {expected} uint8 bytes for {numel} elements, "
                f"got {packed.dtype} of shape {tuple(packed.shape)}"
            )


class CastCodec(Codec):
    """The raw bytes of ``x`` cast to a float dtype: ``float32`` (no compression; a copy, for a
    uniform interface) or ``bfloat16`` (round to nearest even). Casting back is exact."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")

    def wire_bytes(self, numel: int) -> int:
        return self.dtype.itemsize * numel

    def _encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        residual: torch.Tensor | None,
        scratch: Scratch,
    ) -> None:
        size = self.dtype.itemsize * x.numel()
        values = out[:size].view(self.dtype)
        values.copy_(x)
        out[size:].zero_()
        if residual is not None:
            residual.copy_(values)  # the decoded value (exact)
            torch.sub(x, residual, out=residual)

    def _decode(
        self,
        packed: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        accumulate: bool,
        scratch: Scratch,
    ) -> None:
        # The cast to fp32 is exact, so every rank gets the same values.
        values = _view_as(packed[: self.dtype.itemsize * out.numel()], self.dtype)
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)


class BlockQuantCodec(Codec):
    """Symmetric block-wise absmax quantization to 8 or 4 bits (layout: module docstring)."""

    def __init__(self, bits: int) -> None:
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        self.bits = bits
        self.name = f"int{bits}"
        # Symmetric range: -qmax..qmax, so that 0 is exact and the sign costs no bias.
        self.qmax = 127 if bits == 8 else 7
        self._per_byte = 1 if bits == 8 else 2
        # The byte of an all-zero stretch: int8 0, or two nibbles of 0 + 8.
        self._zero_byte = 0 if bits == 8 else 0x88

    def _payload_bytes(self, numel: int) -> int:
        return math.ceil(numel / self._per_byte)

    def wire_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / BLOCK) + self._payload_bytes(numel)

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """The per-block scales ``encode`` stores for ``x``: absmax / qmax, at least
        ``SMALLEST_SCALE`` unless the block is all zeros."""
        _check_flat_fp32(x)
        nblocks = math.ceil(x.numel() / BLOCK)
        padded = torch.nn.functional.pad(x, (0, nblocks * BLOCK - x.numel()))
        absmax = padded.view(nblocks, BLOCK).abs().amax(dim=1)
        return torch.where(absmax > 0, (absmax / self.qmax).clamp(min=SMALLEST_SCALE), 0.0)

    def _split(self, packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and the payload bytes of an encoding of ``numel`` values."""
        nblocks = math.ceil(numel / BLOCK)
        return packed[: 4 * nblocks], packed[4 * nblocks :]

    def _encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        residual: torch.Tensor | None,
        scratch: Scratch,
    ) -> None:
        scale_bytes, payload = self._split(out, numel)
        scales = scale_bytes.view(torch.float32)
        k = x.numel()
        # What lies past x encodes zeros: scale 0, every value 0.
        scales[math.ceil(k / BLOCK) :].zero_()
        payload[self._payload_bytes(k) :].fill_(self._zero_byte)
        per_byte = self._per_byte
        for start in _pieces(k):
            end = min(k, start + PIECE)
            self._encode_piece(
                x[start:end],
                scales[start // BLOCK : math.ceil(end / BLOCK)],
                payload[start // per_byte : math.ceil(end / per_byte)],
                None if residual is None else residual[start:end],
                scratch,
            )

    def _encode_piece(
        self,
        x: torch.Tensor,
        scales: torch.Tensor,
        payload: torch.Tensor,
        residual: torch.Tensor | None,
        scratch: Scratch,
    ) -> None:
        """Encode ``x`` (whole blocks, except at the tensor's end) into ``scales``/``payload``."""
        numel, nblocks = x.numel(), scales.numel()
        whole = nblocks * BLOCK
        if numel == whole:
            blocks = x.view(nblocks, BLOCK)
        else:
            # Zero padding to whole blocks changes no absmax and is cut off again below.
            padded = scratch.get("padded", whole, torch.float32)
            padded[:numel].copy_(x)
            padded[numel:].zero_()
            blocks = padded.view(nblocks, BLOCK)
        q = scratch.get("q", whole, torch.float32).view(nblocks, BLOCK)
        torch.abs(blocks, out=q)
        torch.amax(q, dim=1, out=scales)
        positive = scales > 0  # before the division, which may underflow to 0
        scales.div_(self.qmax)
        scales.copy_(torch.where(positive, scales.clamp(min=SMALLEST_SCALE), scales))
        # A zero scale (zero block) divides by 1 instead: its values are 0 and quantize to 0.
        divisor = torch.where(positive, scales, 1.0)
        torch.div(blocks, divisor.unsqueeze(1), out=q)
        # Round half to even. |q| <= qmax needs no clamp: a scale is absmax / qmax within one
        # rounding, or (below SMALLEST_SCALE) larger than that.
        q.round_()
        values = q.view(-1)
        if self.bits == 8:
            payload.view(torch.int8).copy_(values[:numel])
        else:
            self._pack_nibbles(values[: 2 * payload.numel()], payload, scratch)
        if residual is not None:
            # The decoded value is q * scale, the same single fp32 multiply as in decode.
            q.mul_(scales.unsqueeze(1))
            torch.sub(x, values[:numel], out=residual)

    @staticmethod
    def _pack_nibbles(values: torch.Tensor, payload: torch.Tensor, scratch: Scratch) -> None:
        """Pack ``values`` (integers -7..7 in fp32, an even count; the padding is 0) into
        ``payload``, one pair per byte, ``(even + 8) | (odd + 8) << 4``.

        Done on int16 pairs (four ops on half as many elements), not on fp32: on the CPU a
        cast from fp32 to int8 is fast and one to uint8 is not. As int8, a value's low nibble
        is its two's complement, and ``nibble ^ 8`` is ``value + 8`` mod 16.
        """
        _require_little_endian()
        as_int8 = scratch.get("int8", values.numel(), torch.int8)
        as_int8.copy_(values)
        pairs = as_int8.view(torch.int16)  # even value in the low byte, odd in the high one
        nibbles = scratch.get("pairs", pairs.numel(), torch.int16)
        shifted = scratch.get("shifted", pairs.numel(), torch.int16)
        torch.bitwise_and(pairs, 0x0F0F, out=nibbles)
        torch.bitwise_right_shift(nibbles, 4, out=shifted)
        shifted.bitwise_or_(nibbles).bitwise_xor_(0x88)
        payload.copy_(shifted)  # the low byte: (even nibble | odd nibble << 4) ^ 0x88

    @staticmethod
    def _unpack_nibbles(payload: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
        """``out`` (``numel`` <= 2 bytes' worth) = the nibbles of ``payload``, low one first,
        minus 8. The bytes are spread to int16 pairs of nibbles whose memory order is the
        values' order, then cast to fp32 in one contiguous pass."""
        _require_little_endian()
        wide = scratch.get("pairs", payload.numel(), torch.int16)
        shifted = scratch.get("shifted", payload.numel(), torch.int16)
        wide.copy_(payload)
        torch.bitwise_left_shift(wide, 4, out=shifted)
        # Low nibble in the low byte, high nibble in the high byte.
        shifted.bitwise_or_(wide).bitwise_and_(0x0F0F)
        out.copy_(shifted.view(torch.uint8)[: out.numel()])
        out.sub_(8)

    def _decode(
        self,
        packed: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        accumulate: bool,
        scratch: Scratch,
    ) -> None:
        scale_bytes, payload = self._split(packed, numel)
        scales = _view_as(scale_bytes, torch.float32)
        per_byte = self._per_byte
        for start in _pieces(out.numel()):
            end = min(out.numel(), start + PIECE)
            target = out[start:end]
            if accumulate:
                target = scratch.get("decoded", end - start, torch.float32)
            self._decode_piece(
                payload[start // per_byte : math.ceil(end / per_byte)],
                scales[start // BLOCK : math.ceil(end / BLOCK)],
                target,
                scratch,
            )
            if accumulate:
                out[start:end].add_(target)

    def _decode_piece(
        self, payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scratch: Scratch
    ) -> None:
        """Decode ``out.numel()`` values (from a block start) into ``out``."""
        numel = out.numel()
        if self.bits == 8:
            out.copy_(payload[:numel].view(torch.int8))
        else:
            self._unpack_nibbles(payload, out, scratch)
        # One exact int -> fp32 cast and one fp32 multiply per element: deterministic.
        full = numel // BLOCK
        out[: full * BLOCK].view(full, BLOCK).mul_(scales[:full].unsqueeze(1))
        if full * BLOCK < numel:
            out[full * BLOCK :].mul_(scales[full])


_CODECS: dict[str, Codec] = {
    "float32": CastCodec(torch.float32),
    "bfloat16": CastCodec(torch.bfloat16),
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

    ``correct(key, x)`` returns ``x + residual`` (``correct_`` adds in place); the encode of
    that tensor computes what it dropped (``Codec.encode_into(..., residual=)``) into
    ``residual_buffer(key, x)``, and ``set_residual`` stores it. The residuals are part of the
    training state (``state_dict``/``load_state_dict``): without them a restarted rank would
    drop the error it still owes.

    On the CPU the residual a new one replaces is kept as the buffer for the round after
    (:meth:`residual_buffer`): a fresh model-sized buffer there costs more in page faults than
    the arithmetic done in it. The replaced residual is not touched before that next round.

    Keys of a fragment's pseudo-gradient are ``fragment_key(fragment, n)``: the ``n``-th
    transfer of the fragment's sync (the transport's buckets, in order). Together they cover
    the fragment's parameters once, so a checkpoint holds a fragment's residuals as one flat
    tensor of fixed size (:meth:`fragment_residual`), whatever the bucket sizes, and a
    restarted rank hands it back in slices as the sync's tensors come
    (:meth:`load_fragment_residual`).

    A residual changes only when its sync commits: the collective stages (:meth:`stage`) what its
    encode dropped, and the sync's verdict either keeps it (:meth:`commit`) or drops it
    (:meth:`discard`, the residual owed before stays owed). A sync that fails anywhere (a
    later bucket, another rank of the group, another group, a non-finite value) so leaves no
    trace in what this rank owes.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        #: Loaded flat residuals not handed out yet: fragment -> (flat, offset taken so far).
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}
        #: Replaced CPU residuals, to compute the next ones in.
        self._spares: dict[str, torch.Tensor] = {}
        #: Residuals of the sync being decided, by key (from its encodes) ...
        self._staged: dict[str, torch.Tensor] = {}
        #: ... or by fragment, as a checkpoint saved them while that sync was undecided.
        self._staged_flat: dict[int, torch.Tensor] = {}

    @staticmethod
    def fragment_key(fragment: int, index: int) -> str:
        return f"fragment_{fragment}/{index}"

    def correct(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """A new tensor ``x + residual[key]`` (a copy of ``x`` if there is no residual yet)."""
        residual = self._owed(key, x)
        return x.clone() if residual is None else x + residual

    def correct_(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x += residual[key]`` in place; returns ``x``. The residual stays owed until
        :meth:`set_residual` replaces it."""
        residual = self._owed(key, x)
        return x if residual is None else x.add_(residual)

    def _owed(self, key: str, x: torch.Tensor) -> torch.Tensor | None:
        """The residual of ``key`` on ``x``'s device, or None. A loaded one is taken from the
        pending flat tensor here and kept under ``key``, so that it is still owed if the
        collective that was to deliver it fails."""
        residual = self._residuals.get(key)
        if residual is None:
            residual = self._take_pending(key, x.numel())
            if residual is not None:
                residual = residual.reshape(x.shape)
                self._residuals[key] = residual
        if residual is None:
            return None
        if residual.shape != x.shape:
            raise ValueError(
                f"error feedback {key!r}: residual has shape {tuple(residual.shape)}, "
                f"tensor has {tuple(x.shape)}"
            )
        # The residual may come from a checkpoint loaded on another device.
        return residual.to(device=x.device, dtype=x.dtype)

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

    def fragment_residual(self, fragment: int, numel: int, staged: bool = False) -> torch.Tensor:
        """This rank's residuals of ``fragment`` as one flat fp32 CPU tensor of ``numel``
        values (the fragment's local parameters), in key order; zeros where it owes nothing
        (before its first compressed sync, or right after a heal). ``staged``: the residuals
        the undecided sync of ``fragment`` leaves if it commits (:meth:`has_staged`)."""
        flat = torch.zeros(numel, dtype=torch.float32)
        residuals = self._staged if staged else self._residuals
        if staged and fragment in self._staged_flat:
            flat.copy_(self._staged_flat[fragment])
            return flat
        if not staged and fragment in self._pending:
            pending, offset = self._pending[fragment]
            flat[offset:] = pending[offset:].cpu()
        keys = sorted(
            (int(k.rsplit("/", 1)[1]), k) for k in residuals if _fragment_of_key(k) == fragment
        )
        offset = 0
        for _, key in keys:
            residual = residuals[key].reshape(-1)
            if offset + residual.numel() > numel:
                raise ValueError(
                    f"error feedback: fragment {fragment}'s residuals hold more than its "
                    f"{numel} parameter values (key {key!r})"
                )
            flat[offset : offset + residual.numel()] = residual.cpu()
            offset += residual.numel()
        return flat

    def load_fragment_residual(
        self, fragment: int, flat: torch.Tensor, staged: bool = False
    ) -> None:
        """Owe ``flat`` (from :meth:`fragment_residual`) again: the fragment's next sync takes
        it in slices, one per tensor, in key order. ``staged``: what the undecided sync of
        ``fragment`` leaves if it commits (owed from :meth:`commit` on)."""
        flat = flat.detach().reshape(-1).clone()
        if staged:
            self._staged_flat[fragment] = flat
            return
        for key in [k for k in self._residuals if _fragment_of_key(k) == fragment]:
            del self._residuals[key]
        self._pending[fragment] = (flat, 0)

    def set_residual(self, key: str, residual: torch.Tensor) -> None:
        """Store the residual of ``key`` computed by its latest encode (owed from now on)."""
        old = self._residuals.get(key)
        self._residuals[key] = residual
        if old is not None and old is not residual and old.device.type == "cpu":
            self._spares[key] = old

    def stage(self, key: str, residual: torch.Tensor) -> None:
        """The residual of ``key`` left by an encode of the sync being decided: owed only once
        :meth:`commit` says the sync committed."""
        self._staged[key] = residual

    def has_staged(self, fragment: int) -> bool:
        """Whether the undecided sync of ``fragment`` left residuals (:meth:`stage`)."""
        return fragment in self._staged_flat or any(
            _fragment_of_key(k) == fragment for k in self._staged
        )

    def commit(self) -> None:
        """The sync committed: its staged residuals are owed from now on."""
        for key, residual in self._staged.items():
            self.set_residual(key, residual)
        for fragment, flat in self._staged_flat.items():
            self.load_fragment_residual(fragment, flat)
        self._staged.clear()
        self._staged_flat.clear()

    def discard(self, loaded: bool = True) -> None:
        """The sync did not commit (or was never decided): what was owed before it stays owed.
        ``loaded``: also drop what a checkpoint loaded as staged (False: keep it for the
        verdict of the sync it belongs to)."""
        for key, residual in self._staged.items():
            if residual.device.type == "cpu":
                self._spares[key] = residual
        self._staged.clear()
        if loaded:
            self._staged_flat.clear()

    def residual_buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``like`` (contents undefined) to compute ``key``'s next residual
        in: the CPU residual the last :meth:`set_residual` replaced, or a new one."""
        spare = self._spares.pop(key, None)
        if (
            spare is not None
            and spare.shape == like.shape
            and spare.dtype == like.dtype
            and spare.device == like.device
        ):
            return spare
        return torch.empty_like(like)

    def encode(self, key: str, x: torch.Tensor, codec: Codec) -> torch.Tensor:
        """``codec.encode(x + residual)``, updating the residual."""
        corrected = self.correct(key, x)
        packed = torch.empty(codec.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        residual = self.residual_buffer(key, corrected)
        codec.encode_into(corrected, packed, x.numel(), residual=residual)
        self.set_residual(key, residual)
        return packed

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual of ``key`` (None before its first update)."""
        return self._residuals.get(key)

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of ``key``, or all of them (and any loaded, not yet taken, and
        any staged)."""
        if key is None:
            self._residuals.clear()
            self._pending.clear()
            self._spares.clear()
            self._staged.clear()
            self._staged_flat.clear()
        else:
            self._residuals.pop(key, None)
            self._spares.pop(key, None)
            self._staged.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the residuals by key (a residual's buffer is reused two rounds later)."""
        return {key: value.clone() for key, value in self._residuals.items()}

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


def _wait(work: Any, timeout: timedelta | None) -> None:
    """Wait for a collective. The timeout goes to the options (gloo honours those) and to the
    wait: torchft's nccl wrapper clears the options' timeout and honours only the wait's."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


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
    scratch: Scratch | None = None,
    timeout: timedelta | None = None,
) -> CompressionStats:
    """SUM all-reduce of the 1-D fp32 ``tensor`` in place over ``pg``, ``dtype`` on the wire.

    Every rank must call it with the same ``dtype`` and ``tensor.numel()``, in the same order.
    Blocks until the result is in ``tensor`` (bit-identical on every rank). With
    ``error_feedback``, this rank's residual under ``key`` is added first, and the new one is
    staged once the collectives succeed (``ErrorFeedback.stage``: owed only if the sync then
    commits). ``scratch`` (of ``tensor``'s device) keeps the buffers for the next call of the
    same thread. ``timeout``: the longest each collective may take (default: the process
    group's). Raises what the collectives raise; ``tensor`` is then undefined.
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
            error_feedback.correct_(key, tensor)
        if n > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
            if timeout is not None:
                opts.timeout = timeout
            _wait(pg.allreduce([tensor], opts), timeout)
            stats.bytes_sent = 2 * (n - 1) * 4 * math.ceil(numel / n)
        if error_feedback is not None:
            error_feedback.stage(key, torch.zeros_like(tensor))  # nothing dropped
        _sync(tensor)
        stats.total_s = time.perf_counter() - start
        return stats

    if numel == 0:
        return stats
    if scratch is None or scratch.device != tensor.device:
        scratch = Scratch(tensor.device)
    # Corrected in place: the tensor is undefined after a failure anyway, and the residual
    # it owed stays in ``error_feedback`` until the collectives have succeeded.
    corrected = tensor if error_feedback is None else error_feedback.correct_(key, tensor)
    # What this rank's own encoding drops, filled in by the encode itself.
    residual = None if error_feedback is None else error_feedback.residual_buffer(key, tensor)

    if n == 1:
        # Nobody to talk to: the result is what the encoding keeps of the tensor.
        t0 = time.perf_counter()
        packed = scratch.get("send", codec.wire_bytes(numel), torch.uint8)
        codec.encode_into(corrected, packed, numel, residual=residual, scratch=scratch)
        _sync(tensor)
        t1 = time.perf_counter()
        codec.decode_into(packed, numel, tensor, scratch=scratch)
        _sync(tensor)
        stats.encode_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
        if error_feedback is not None and residual is not None:
            error_feedback.stage(key, residual)
        stats.total_s = time.perf_counter() - start
        return stats

    chunk = chunk_numel(numel, n)
    chunk_bytes = codec.wire_bytes(chunk)

    def chunk_of(x: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` of a tensor of ``numel`` values: short or empty at the end."""
        return x[min(numel, i * chunk) : min(numel, (i + 1) * chunk)]

    def bytes_of(buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf[i * chunk_bytes : (i + 1) * chunk_bytes]

    # Phase 1: encode every chunk (the tensor's tail as zeros); all-to-all so that rank r holds
    # every rank's chunk r.
    t0 = time.perf_counter()
    send = scratch.get("send", n * chunk_bytes, torch.uint8)
    for i in range(n):
        codec.encode_into(
            chunk_of(corrected, i),
            bytes_of(send, i),
            chunk,
            residual=None if residual is None else chunk_of(residual, i),
            scratch=scratch,
        )
    _sync(send)
    stats.encode_s += time.perf_counter() - t0
    # The buffers the collectives write are new every time: a collective that failed on another
    # rank's error must not be able to write into the next one's.
    recv = torch.empty_like(send)
    splits = [chunk_bytes] * n
    alltoall_opts = dist.AllToAllOptions()
    if timeout is not None:
        alltoall_opts.timeout = timeout
    _wait(pg.alltoall_base(recv, send, splits, splits, alltoall_opts), timeout)

    # Reduce this rank's chunk in fp32, in rank order, so that a rerun gives the same bytes.
    t0 = time.perf_counter()
    # The tensor's values are all encoded by now: its head can hold the sum (it is decoded over
    # only after the sum has been encoded).
    reduced = tensor[:chunk] if chunk <= numel else scratch.get("reduced", chunk, torch.float32)
    for i in range(n):
        codec.decode_into(bytes_of(recv, i), chunk, reduced, accumulate=i > 0, scratch=scratch)
    _sync(reduced)
    t1 = time.perf_counter()
    stats.decode_s += t1 - t0
    mine = scratch.get("mine", chunk_bytes, torch.uint8)
    codec.encode_into(reduced, mine, chunk, scratch=scratch)
    _sync(mine)
    stats.encode_s += time.perf_counter() - t1

    # Phase 2: all-gather the re-encoded chunks; every rank decodes the same n chunks, its own
    # included (from the bytes, not from ``reduced``), so that all ranks hold identical values.
    gathered = [torch.empty_like(mine) for _ in range(n)]
    allgather_opts = AllgatherOptions()
    if timeout is not None:
        allgather_opts.timeout = timeout
    _wait(pg.allgather([gathered], [mine], allgather_opts), timeout)
    t0 = time.perf_counter()
    for i, packed in enumerate(gathered):
        codec.decode_into(packed, chunk, chunk_of(tensor, i), scratch=scratch)
    _sync(tensor)
    stats.decode_s += time.perf_counter() - t0

    if error_feedback is not None and residual is not None:
        # Only now: had a collective failed, nothing was delivered and the old residual is
        # still owed. Even now only staged: the sync's verdict decides (ErrorFeedback.commit).
        error_feedback.stage(key, residual)
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
        #: With ``check_finite``: ``"sent"`` when this rank's own input held an inf or NaN
        #: (it then sent NaNs, so that every rank's result shows it), ``"received"`` when only
        #: the result did (another rank's input); None when all was finite.
        self.non_finite: str | None = None
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
    timeout: timedelta | None
    check_finite: bool
    then: Callable[[], None] | None


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one reduction (the largest magnitude, which is
    inf or NaN as soon as one value is)."""
    if t.numel() == 0:
        return True
    return bool(torch.isfinite(torch.linalg.vector_norm(t, ord=math.inf)))


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
        #: The thread's buffers, reused from one collective to the next (see Scratch).
        self._scratch: dict[torch.device, Scratch] = {}
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
        timeout: timedelta | None = None,
        check_finite: bool = False,
        then: Callable[[], None] | None = None,
    ) -> CompressedWork:
        """Queue a SUM all-reduce of ``tensor`` (then divided by ``divide_by``) in place.

        Do not touch ``tensor`` until the returned work is done. If the collective fails,
        ``on_error(e)`` is called and the work still completes; the tensor is then undefined.
        ``timeout``: the longest each collective may take (default: the process group's).
        ``check_finite``: check the input before it is sent and the result after it arrived
        (one reduction each) and say what was found in ``work.non_finite``; an input that is
        not finite is sent as NaNs (and leaves no residual), so that every rank's result is
        not finite either and all of them drop it alike. ``then``: run on the background
        thread after a successful all-reduce, before the work completes (e.g. copying a
        bucket's values back into the tensors it packs).
        """
        get_codec(dtype)  # fail here, in the caller, on a bad name
        _check_flat_fp32(tensor)
        ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        work = CompressedWork(tensor)
        job = _Job(
            pg,
            tensor,
            dtype,
            divide_by,
            error_feedback,
            key,
            on_error,
            ready,
            work,
            timeout,
            check_finite,
            then,
        )
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
        start = time.monotonic()
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
            late = (
                job.timeout is not None and time.monotonic() - start >= job.timeout.total_seconds()
            )
            if late:  # e.g. a collective aborted at the timeout without raising: not trusted
                raise TimeoutError("the collective ended past its timeout")
        except Exception as e:  # torchft semantics: record the error, complete normally
            elapsed = time.monotonic() - start
            if job.timeout is not None and elapsed >= job.timeout.total_seconds():
                e = TimeoutError(f"timed out after {elapsed:.1f}s: {e}")
            try:
                job.on_error(e)
            except Exception as handler_error:
                # Nobody else would see it: hand it to the waiter rather than hang or drop it.
                job.work.complete(handler_error)
                return
        job.work.complete()

    def _reduce(self, job: _Job) -> None:
        device = job.tensor.device
        scratch = self._scratch.get(device)
        if scratch is None:
            scratch = self._scratch[device] = Scratch(device)
        feedback = job.error_feedback
        if job.check_finite and not is_finite(job.tensor):
            # A value that is not finite would poison its whole block (its scale) and, through
            # error feedback, every later sync: send NaNs instead, so that every rank's result
            # says so, and keep no residual of it.
            job.work.non_finite = "sent"
            job.tensor.fill_(math.nan)
            feedback = None
        job.work.stats = compressed_all_reduce(
            job.pg,
            job.tensor,
            job.dtype,
            error_feedback=feedback,
            key=job.key,
            scratch=scratch,
            timeout=job.timeout,
        )
        if job.check_finite and job.work.non_finite is None and not is_finite(job.tensor):
            job.work.non_finite = "received"
        if job.divide_by != 1:
            job.tensor.div_(job.divide_by)
        if job.then is not None:
            job.then()
