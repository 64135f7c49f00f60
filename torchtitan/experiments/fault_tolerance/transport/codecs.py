"""Codecs: how a flat fp32 tensor of ``numel`` elements travels as one uint8 tensor.

The names are ``fault_tolerance.pseudo_grad_dtype``'s choices:

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
``ENCODE_PIECE_VALUES`` values at a time (:class:`Scratch`) and can compute what it dropped (the
error-feedback residual) without decoding its own bytes. Inputs must be finite: an inf or NaN
makes its block's scale non-finite.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from torchtitan.tools.exact_division import divide_, divided
from torchtitan.tools.scratch import Scratch

# Elements per quantization block: one fp32 scale per block costs 4 / BLOCK bytes per element
# (0.03 for 128), small next to the 1 or 0.5 bytes of the values themselves.
BLOCK = 128

#: The smallest scale of a block that is not all zeros: the smallest normal fp32. With a
#: subnormal scale, absmax / scale could exceed qmax (a subnormal has fewer significant bits);
#: only blocks whose values are all below qmax * 1.2e-38 in magnitude get this coarser step.
SMALLEST_SCALE = torch.finfo(torch.float32).tiny

#: Values a codec handles at a time (a multiple of BLOCK, so of 2 too). Every temporary of an
#: encode or decode is at most one piece long and is reused for the next piece (:class:`Scratch`).
ENCODE_PIECE_VALUES = 4096 * BLOCK


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
        for start in range(0, k, ENCODE_PIECE_VALUES):
            end = min(k, start + ENCODE_PIECE_VALUES)
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
        for start in range(0, out.numel(), ENCODE_PIECE_VALUES):
            end = min(out.numel(), start + ENCODE_PIECE_VALUES)
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
#: The wire dtypes by name (``pseudo_grad_dtype``'s choices); sparse ones are built on demand.
CODEC_NAMES = (*_CODECS, "sparse")


def get_codec(dtype: str) -> Codec:
    """The codec of a ``pseudo_grad_dtype`` name or a sparse wire dtype (``sparse_name``)."""
    codec = _CODECS.get(dtype)
    if codec is not None:
        return codec
    settings = parse_sparse_name(dtype)
    if settings is None:
        raise ValueError(
            f"unknown pseudo-gradient dtype {dtype!r}; expected one of {CODEC_NAMES} or a "
            "sparse name with settings (sparse_name)"
        )
    codec = _CODECS[dtype] = SparseCodec(*settings)
    return codec


# ---- The sparse codec --------------------------------------------------------------------------
#
# The sparse codec: per chunk, the largest values only, a few bits each.
#
# ``pseudo_grad_dtype = "sparse"`` follows SparseLoCo (Sarfi et al., arXiv 2508.15706): each
# chunk of ``chunk`` values (the last padded with zeros) keeps its ``keep`` values of largest
# magnitude, each sent as a sign and a magnitude level, ``bits`` bits in all, plus the chunk's
# ``2 ** (bits - 1)`` fp32 levels. What is not sent is the error-feedback residual, added to the
# rank's next pseudo-gradient: delivered later, not lost.
#
# Layout for ``numel`` values (``n = ceil(numel / chunk)`` chunks), levels first to stay 4-byte
# aligned:
#
# * the levels, ``n * 2 ** (bits - 1)`` fp32 (native byte order), chunk after chunk;
# * the codes, ``ceil(keep * bits / 8)`` bytes per chunk: per kept value its level's number in
#   the low ``bits - 1`` bits and its sign (1: negative) in the top bit;
# * the indices within the chunk, ``ceil(keep * index_bits / 8)`` bytes per chunk,
#   ``index_bits = ceil(log2(chunk))`` (12 for 4,096).
#
# Bits are packed least significant first. At the defaults (4,096, 64, 2) a chunk costs 8 + 16 +
# 96 = 120 bytes, 0.73 % of float32's 16,384. Encodings are all-gathered, so with ``n`` groups a
# rank sends ``(n - 1) * 120 / 4096`` bytes per value against int4's ``2 * (n - 1) / n * 0.53``:
# fewer than int4 up to 36 groups. Each rank decodes ``n`` encodings per sync, and a heal history
# entry holds all ``n``.
#
# Levels: a chunk's kept magnitudes fall into ``2 ** (bits - 1)`` equal bins between their
# smallest and largest; a level is its bin's mean (the centre when empty). A chunk with fewer
# nonzero values than ``keep`` keeps zeros too: with 2 bits or more they take level 0, exactly 0
# (nothing drifts where the pseudo-gradient is 0). Decoding only selects a level and a sign: the
# same bytes decode to the same values on every rank and device. Inputs must be finite: an inf or
# NaN makes its chunk's levels NaN.

#: The wire name of the defaults; other settings are named ``sparse-c{chunk}-k{keep}-b{bits}``.
SPARSE = "sparse"
DEFAULT_CHUNK, DEFAULT_KEEP, DEFAULT_BITS = 4096, 64, 2
#: Values the sparse codec encodes at a time on a GPU: one default bucket (32 MiB of fp32), as a
#: piece costs ~80 kernel launches, which at 1e9 values must not number thousands.
CUDA_ENCODE_PIECE_VALUES = 2**23


def sparse_name(chunk: int, keep: int, bits: int) -> str:
    """The wire dtype of the sparse codec with these settings (``sparse`` at the defaults)."""
    if (chunk, keep, bits) == (DEFAULT_CHUNK, DEFAULT_KEEP, DEFAULT_BITS):
        return SPARSE
    return f"{SPARSE}-c{chunk}-k{keep}-b{bits}"


def parse_sparse_name(name: str) -> tuple[int, int, int] | None:
    """``(chunk, keep, bits)`` of a wire dtype made by :func:`sparse_name`, None for another."""
    if name == SPARSE:
        return DEFAULT_CHUNK, DEFAULT_KEEP, DEFAULT_BITS
    prefix = f"{SPARSE}-c"
    if not name.startswith(prefix):
        return None
    try:
        chunk, rest = name.removeprefix(prefix).split("-k")
        keep, bits = rest.split("-b")
        return int(chunk), int(keep), int(bits)
    except ValueError:
        return None


def _pack_bits(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """``values`` ([rows, count] non-negative ints below ``2 ** bits``) into ``out`` ([rows,
    nbytes] uint8), each row's bits least significant first, the last byte's high bits 0."""
    rows, nbytes = out.shape
    shifts = torch.arange(bits, dtype=torch.int32, device=values.device)
    spread = torch.bitwise_and(values.int().unsqueeze(-1) >> shifts, 1).view(rows, -1)
    padded = torch.nn.functional.pad(spread, (0, nbytes * 8 - spread.shape[1]))
    weights = torch.arange(8, dtype=torch.int32, device=values.device)
    out.copy_((padded.view(rows, nbytes, 8) << weights).sum(-1, dtype=torch.int32))


def _unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` values per row that :func:`_pack_bits` wrote into ``packed``, as int64
    (what gather and scatter take)."""
    rows = packed.shape[0]
    weights = torch.arange(8, dtype=torch.int32, device=packed.device)
    spread = torch.bitwise_and(packed.int().unsqueeze(-1) >> weights, 1).view(rows, -1)
    shifts = torch.arange(bits, dtype=torch.int32, device=packed.device)
    values = spread[:, : count * bits].view(rows, count, bits) << shifts
    return values.sum(-1, dtype=torch.int64)


class SparseCodec(Codec):
    """Top ``keep`` of every ``chunk`` values, ``bits`` bits each (layout: the comment above).

    The sum of two encodings is not an encoding (:attr:`gathers`): every rank all-gathers the
    encodings and decodes and adds all of them.
    """

    gathers = True

    def __init__(
        self, chunk: int = DEFAULT_CHUNK, keep: int = DEFAULT_KEEP, bits: int = DEFAULT_BITS
    ) -> None:
        if chunk < 2:
            raise ValueError(f"sparse chunk must be >= 2, got {chunk}")
        if not 1 <= keep <= chunk:
            raise ValueError(f"sparse keep must be in [1, chunk={chunk}], got {keep}")
        if not 1 <= bits <= 4:
            raise ValueError(f"sparse value bits must be in [1, 4], got {bits}")
        self.chunk, self.keep, self.bits = chunk, keep, bits
        self.name = sparse_name(chunk, keep, bits)
        self.levels = 2 ** (bits - 1)
        self.index_bits = math.ceil(math.log2(chunk))
        self.code_bytes = math.ceil(keep * bits / 8)
        self.index_bytes = math.ceil(keep * self.index_bits / 8)
        #: Chunks per piece on the CPU and on a GPU.
        self.piece_chunks = max(1, ENCODE_PIECE_VALUES // chunk)
        self.cuda_piece_chunks = max(1, CUDA_ENCODE_PIECE_VALUES // chunk)

    def chunk_bytes(self) -> int:
        """Bytes of one chunk's record: its levels, codes and indices."""
        return 4 * self.levels + self.code_bytes + self.index_bytes

    def wire_bytes(self, numel: int) -> int:
        return math.ceil(numel / self.chunk) * self.chunk_bytes()

    def _split(
        self, packed: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The levels ([chunks, levels] bytes as fp32 source), codes and indices of an encoding."""
        n = math.ceil(numel / self.chunk)
        level_end = 4 * self.levels * n
        code_end = level_end + self.code_bytes * n
        return packed[:level_end], packed[level_end:code_end], packed[code_end:]

    def _per_piece(self, device: torch.device) -> int:
        return self.cuda_piece_chunks if device.type == "cuda" else self.piece_chunks

    def _encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        residual: torch.Tensor | None,
        scratch: Scratch,
    ) -> None:
        level_bytes, codes, indices = self._split(out, numel)
        levels = level_bytes.view(torch.float32)
        chunks = math.ceil(numel / self.chunk)
        per_piece = self._per_piece(out.device)
        for first in range(0, chunks, per_piece):
            last = min(chunks, first + per_piece)
            start, end = first * self.chunk, min(x.numel(), last * self.chunk)
            rows = last - first
            self._encode_piece(
                x[start:end] if start < x.numel() else x[:0],
                levels[first * self.levels : last * self.levels].view(rows, self.levels),
                codes[first * self.code_bytes : last * self.code_bytes].view(rows, -1),
                indices[first * self.index_bytes : last * self.index_bytes].view(rows, -1),
                None if residual is None or start >= x.numel() else residual[start:end],
                scratch,
            )

    def _encode_piece(
        self,
        x: torch.Tensor,
        levels: torch.Tensor,
        codes: torch.Tensor,
        indices: torch.Tensor,
        residual: torch.Tensor | None,
        scratch: Scratch,
    ) -> None:
        rows, chunk = levels.shape[0], self.chunk
        whole = rows * chunk
        if x.numel() == whole:
            blocks = x.view(rows, chunk)
        else:  # the tensor's end: zeros, which are kept only where a chunk has few others
            padded = scratch.get("padded", whole, torch.float32)
            padded[: x.numel()].copy_(x)
            padded[x.numel() :].zero_()
            blocks = padded.view(rows, chunk)
        magnitude = scratch.get("magnitude", whole, torch.float32).view(rows, chunk)
        torch.abs(blocks, out=magnitude)
        top, index = torch.topk(magnitude, self.keep, dim=1, sorted=False)
        kept = torch.gather(blocks, 1, index)
        negative = kept < 0
        level_of, chunk_levels = self._levels(top)
        levels.copy_(chunk_levels)
        decoded = torch.gather(chunk_levels, 1, level_of)
        decoded = torch.where(negative, -decoded, decoded)  # negation is exact
        _pack_bits(level_of | (negative.long() << (self.bits - 1)), self.bits, codes)
        _pack_bits(index, self.index_bits, indices)
        if residual is not None:
            # Everything not sent: x itself where nothing was kept, x - decoded where it was.
            if x.numel() == whole:
                dropped = residual.view(rows, chunk)
                dropped.copy_(blocks)
            else:
                dropped = magnitude  # free again: a padded piece's residual is built here
                dropped.copy_(blocks)
            dropped.scatter_(1, index, kept - decoded)
            if dropped is magnitude:
                residual.copy_(dropped.view(-1)[: x.numel()])

    def _levels(self, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each kept magnitude's level number ([rows, keep] int64) and each chunk's levels
        ([rows, levels] fp32), as the module docstring describes."""
        lo = top.amin(dim=1, keepdim=True)
        hi = top.amax(dim=1, keepdim=True)
        if self.levels == 1:
            return torch.zeros_like(top, dtype=torch.long), top.mean(dim=1, keepdim=True)
        keeps_zeros = lo == 0
        nonzero = top > 0
        # Where zeros are kept, the bins span the nonzero magnitudes and start at level 1.
        base = torch.where(keeps_zeros, torch.where(nonzero, top, hi).amin(dim=1, keepdim=True), lo)
        first = keeps_zeros.long()
        bins = self.levels - first
        width = hi - base
        position = (top - base) / torch.where(width > 0, width, 1.0) * bins
        # NaN (a non-finite input) and a chunk of equal magnitudes go to the first bin.
        position = torch.where(torch.isfinite(position), position, 0.0)
        level_of = torch.minimum(position.floor().clamp(min=0).long(), bins - 1) + first
        level_of = torch.where(keeps_zeros & ~nonzero, 0, level_of)
        # A one-hot sum, not scatter_add_: deterministic on every device.
        numbers = torch.arange(self.levels, device=top.device)
        member = (level_of.unsqueeze(-1) == numbers).to(top.dtype)
        sums = (top.unsqueeze(-1) * member).sum(dim=1)
        counts = member.sum(dim=1)
        centres = base + width * ((numbers - first + 0.5) / bins)
        means = sums / counts.clamp(min=1)
        levels = torch.where(counts > 0, means, centres)
        return level_of, torch.where(keeps_zeros & (numbers == 0), 0.0, levels)

    def _decode(
        self,
        packed: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        accumulate: bool,
        scratch: Scratch,
    ) -> None:
        level_bytes, codes, indices = self._split(packed, numel)
        chunk = self.chunk
        levels = level_bytes
        if levels.storage_offset() % 4 != 0:
            levels = levels.clone()
        levels = levels.view(torch.float32)
        chunks, per_piece = math.ceil(out.numel() / chunk), self._per_piece(out.device)
        for first in range(0, chunks, per_piece):
            last = min(chunks, first + per_piece)
            rows = last - first
            start, end = first * chunk, min(out.numel(), last * chunk)
            level_of = _unpack_bits(
                codes[first * self.code_bytes : last * self.code_bytes].view(rows, -1),
                self.bits,
                self.keep,
            )
            index = _unpack_bits(
                indices[first * self.index_bytes : last * self.index_bytes].view(rows, -1),
                self.index_bits,
                self.keep,
            )
            negative = (level_of >> (self.bits - 1)).bool()
            chunk_levels = levels[first * self.levels : last * self.levels].view(rows, -1)
            decoded = torch.gather(chunk_levels, 1, level_of & (self.levels - 1))
            decoded = torch.where(negative, -decoded, decoded)
            target = out[start:end]
            whole = target.numel() == rows * chunk
            if whole:
                blocks = target.view(rows, chunk)
            else:  # the end of the tensor, or of the part asked for: through a padded buffer
                blocks = scratch.get("decoded", rows * chunk, torch.float32).view(rows, chunk)
                blocks.view(-1)[: target.numel()].copy_(target)
                blocks.view(-1)[target.numel() :].zero_()
            if accumulate:
                # Each index once per chunk: one fp32 addition per value sent, in order.
                decoded = torch.gather(blocks, 1, index).add_(decoded)
            else:
                blocks.zero_()
            blocks.scatter_(1, index, decoded)
            if not whole:
                target.copy_(blocks.view(-1)[: target.numel()])
