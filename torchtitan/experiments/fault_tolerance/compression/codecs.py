"""Codecs: how a flat fp32 tensor of ``numel`` elements travels as one uint8 tensor.

The names are ``fault_tolerance.pseudo_grad_dtype``'s choices (``PSEUDO_GRAD_DTYPES``):

* ``float32``: the raw fp32 bytes (``4 * numel``).
* ``bfloat16``: the raw bf16 bytes of ``x.to(torch.bfloat16)`` (``2 * numel``).
* ``int8``: blocks of ``BLOCK`` (128) consecutive elements, the last one possibly short. Layout:
  ``ceil(numel / BLOCK)`` fp32 scales (native byte order), then ``numel`` int8 values. A block's
  scale is ``absmax / 127`` (at least ``SMALLEST_SCALE``, the smallest normal fp32) and
  ``q = round(x / scale)`` (round half to even), which lies in ``[-127, 127]``; a zero block
  gets scale 0 and decodes to zeros. Decoding is ``q * scale``.
* ``int4``: the same with ``scale = absmax / 7`` and ``q`` in ``[-7, 7]``. Layout: the fp32
  scales, then ``ceil(numel / 2)`` bytes, two values per byte, element ``2i`` in the low nibble
  and ``2i + 1`` in the high nibble, each stored as ``q + 8`` (an odd tail is padded with 8).

The scales come first so that they sit 4-byte aligned. Decoding is an exact cast (for int4
also an exact subtraction of 8) followed by one IEEE fp32 multiply per element: the same bytes
decode to the same values on every rank and device. An encode goes through the tensor
``PIECE`` values at a time (:class:`Scratch`) and can compute what it dropped (the
error-feedback residual) without decoding its own bytes. Inputs must be finite: an inf or NaN
makes its block's scale non-finite.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.tools.exact_division import divide_, divided

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
    elements) and :func:`compressed_all_reduce`'s wire buffers. On the CPU, faulting in a fresh
    buffer's pages costs more than the arithmetic done in it (an int4 encode of 4.85 M values:
    24 ms, 6 ms reusing). One ``Scratch`` serves one thread.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements (contents undefined), kept as ``name``."""
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:numel]


def _view_as(buf: Tensor, dtype: torch.dtype) -> Tensor:
    """``buf`` (1-D uint8) reinterpreted as ``dtype``; copied first if it is not aligned for it,
    since a dtype view needs the start of the slice on an element boundary."""
    if buf.storage_offset() % dtype.itemsize != 0:
        buf = buf.clone()
    return buf.view(dtype)


def check_flat_fp32(x: Tensor, what: str = "") -> None:
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"{what}expected a contiguous 1-D float32 tensor, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )


def _require_little_endian() -> None:
    """int4 (un)packing views int16 pairs as their two bytes, low byte first."""
    if sys.byteorder != "little":
        raise RuntimeError("pseudo_grad_dtype=int4 needs a little-endian host")


class Codec(ABC):
    """Encodes a flat fp32 tensor into one uint8 tensor and back: ``encode``/``decode``, or
    ``encode_into``/``decode_into``, which write into given buffers, take the tensor's tail as
    zeros, compute the error-feedback residual and add a decoded chunk to a sum in one pass."""

    name: str = ""
    #: Whether encodings are all-gathered and each rank sums them (``sparse``), rather than
    #: reduced chunk by chunk and re-encoded (every other codec).
    gathers: bool = False

    @abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """The exact size in bytes of ``encode`` of ``numel`` elements."""

    def encode(self, x: Tensor) -> Tensor:
        """``x`` (1-D contiguous fp32) as a new uint8 tensor of ``wire_bytes(x.numel())``."""
        check_flat_fp32(x)
        out = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        self.encode_into(x, out, x.numel())
        return out

    def decode(self, packed: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        """The ``numel`` fp32 values encoded in ``packed`` (written into ``out`` if given)."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=packed.device)
        elif out.numel() != numel:
            raise ValueError(f"out has {out.numel()} elements, expected {numel}")
        self.decode_into(packed, numel, out)
        return out

    def encode_into(
        self,
        x: Tensor,
        out: Tensor,
        numel: int,
        *,
        residual: Tensor | None = None,
        scratch: Scratch | None = None,
    ) -> None:
        """Encode ``numel`` values, ``x`` followed by ``numel - x.numel()`` zeros, into ``out``
        (``wire_bytes(numel)`` uint8, starting 4-byte aligned). With ``residual`` (fp32 like
        ``x``), store in it ``x`` minus what ``out`` decodes to, bit for bit."""
        check_flat_fp32(x)
        if x.numel() > numel:
            raise ValueError(f"{self.name}: {x.numel()} values do not fit in {numel}")
        self._check_packed(out, numel)
        if out.storage_offset() % 4 != 0:
            raise ValueError(f"{self.name}: out must start 4-byte aligned")
        if residual is not None:
            check_flat_fp32(residual, "residual: ")
            if residual.numel() != x.numel():
                raise ValueError(f"residual has {residual.numel()} elements, x {x.numel()}")
        self._encode(x, out, numel, residual, scratch or Scratch(x.device))

    def decode_into(
        self,
        packed: Tensor,
        numel: int,
        out: Tensor,
        *,
        accumulate: bool = False,
        scratch: Scratch | None = None,
    ) -> None:
        """The first ``out.numel()`` (at most ``numel``) of the ``numel`` values encoded in
        ``packed``, written into ``out`` (1-D contiguous fp32), or added to it with
        ``accumulate`` (one fp32 addition per element)."""
        self._check_packed(packed, numel)
        check_flat_fp32(out, "out: ")
        if out.numel() > numel:
            raise ValueError(f"out has {out.numel()} elements, more than the {numel} encoded")
        if out.numel() == 0:
            return
        self._decode(packed, numel, out, accumulate, scratch or Scratch(out.device))

    @abstractmethod
    def _encode(
        self, x: Tensor, out: Tensor, numel: int, residual: Tensor | None, scratch: Scratch
    ) -> None:
        """``encode_into`` once its arguments are checked and the tensor is not empty."""

    @abstractmethod
    def _decode(
        self, packed: Tensor, numel: int, out: Tensor, accumulate: bool, scratch: Scratch
    ) -> None:
        """``decode_into`` once its arguments are checked and the output is not empty."""

    def _check_packed(self, packed: Tensor, numel: int) -> None:
        expected = self.wire_bytes(numel)
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
            raise ValueError(
                f"{self.name}: expected {expected} uint8 bytes for {numel} elements, "
                f"got {packed.dtype} of shape {tuple(packed.shape)}"
            )


class CastCodec(Codec):
    """``x`` cast to ``float32`` (a copy) or ``bfloat16`` (round to nearest even), raw; casting
    back is exact."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")

    def wire_bytes(self, numel: int) -> int:
        return self.dtype.itemsize * numel

    def _encode(
        self, x: Tensor, out: Tensor, numel: int, residual: Tensor | None, scratch: Scratch
    ) -> None:
        size = self.dtype.itemsize * x.numel()
        values = out[:size].view(self.dtype)
        values.copy_(x)
        out[size:].zero_()
        if residual is not None:
            residual.copy_(values)  # the decoded value (exact)
            torch.sub(x, residual, out=residual)

    def _decode(
        self, packed: Tensor, numel: int, out: Tensor, accumulate: bool, scratch: Scratch
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

    def scales(self, x: Tensor) -> Tensor:
        """The per-block scales ``encode`` stores for ``x``: absmax / qmax, at least
        ``SMALLEST_SCALE`` unless the block is all zeros."""
        check_flat_fp32(x)
        nblocks = math.ceil(x.numel() / BLOCK)
        padded = torch.nn.functional.pad(x, (0, nblocks * BLOCK - x.numel()))
        absmax = padded.view(nblocks, BLOCK).abs().amax(dim=1)
        return torch.where(absmax > 0, divided(absmax, self.qmax).clamp(min=SMALLEST_SCALE), 0.0)

    def _split(self, packed: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """The scales and the payload bytes of an encoding of ``numel`` values."""
        nblocks = math.ceil(numel / BLOCK)
        return packed[: 4 * nblocks], packed[4 * nblocks :]

    def _piece(
        self, scales: Tensor, payload: Tensor, start: int, end: int
    ) -> tuple[Tensor, Tensor]:
        """The scales and payload bytes of the values ``start:end`` (``start``: a block's)."""
        per_byte = self._per_byte
        return (
            scales[start // BLOCK : math.ceil(end / BLOCK)],
            payload[start // per_byte : math.ceil(end / per_byte)],
        )

    def _encode(
        self, x: Tensor, out: Tensor, numel: int, residual: Tensor | None, scratch: Scratch
    ) -> None:
        scale_bytes, payload = self._split(out, numel)
        scales = scale_bytes.view(torch.float32)
        k = x.numel()
        # What lies past x encodes zeros: scale 0, every value 0.
        scales[math.ceil(k / BLOCK) :].zero_()
        payload[self._payload_bytes(k) :].fill_(self._zero_byte)
        for start in range(0, k, PIECE):
            end = min(k, start + PIECE)
            piece_scales, piece_payload = self._piece(scales, payload, start, end)
            piece_residual = None if residual is None else residual[start:end]
            self._encode_piece(x[start:end], piece_scales, piece_payload, piece_residual, scratch)

    def _encode_piece(
        self, x: Tensor, scales: Tensor, payload: Tensor, residual: Tensor | None, scratch: Scratch
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
        divide_(scales, self.qmax)  # not scales.div_(qmax): CUDA would multiply by 1/qmax
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
    def _pack_nibbles(values: Tensor, payload: Tensor, scratch: Scratch) -> None:
        """Pack ``values`` (integers -7..7 in fp32, an even count) into ``payload``, one pair
        per byte, ``(even + 8) | (odd + 8) << 4``. Done on int16 pairs of int8 (on the CPU a
        cast from fp32 to int8 is fast, one to uint8 is not), whose low nibble is the value's
        two's complement: ``nibble ^ 8`` is ``value + 8`` mod 16."""
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
    def _unpack_nibbles(payload: Tensor, out: Tensor, scratch: Scratch) -> None:
        """``out`` (at most 2 per byte) = the nibbles of ``payload``, low one first, minus 8,
        spread to int16 pairs in the values' order, then cast to fp32 in one pass."""
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
        self, packed: Tensor, numel: int, out: Tensor, accumulate: bool, scratch: Scratch
    ) -> None:
        scale_bytes, payload = self._split(packed, numel)
        scales = _view_as(scale_bytes, torch.float32)
        for start in range(0, out.numel(), PIECE):
            end = min(out.numel(), start + PIECE)
            target = out[start:end]
            if accumulate:
                target = scratch.get("decoded", end - start, torch.float32)
            piece_scales, piece_payload = self._piece(scales, payload, start, end)
            self._decode_piece(piece_payload, piece_scales, target, scratch)
            if accumulate:
                out[start:end].add_(target)

    def _decode_piece(self, payload: Tensor, scales: Tensor, out: Tensor, scratch: Scratch) -> None:
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
    """The codec of a ``PSEUDO_GRAD_DTYPES`` name or a sparse wire dtype (``sparse_name``)."""
    codec = _CODECS.get(dtype)
    if codec is not None:
        return codec
    # Imported here: the sparse codec builds on this module's Codec.
    from torchtitan.experiments.fault_tolerance.compression.sparse import (
        SparseCodec,
        parse_sparse_name,
    )

    settings = parse_sparse_name(dtype)
    if settings is None:
        raise ValueError(
            f"unknown pseudo-gradient dtype {dtype!r}; expected one of {PSEUDO_GRAD_DTYPES}"
        )
    codec = _CODECS[dtype] = SparseCodec(*settings)
    return codec
