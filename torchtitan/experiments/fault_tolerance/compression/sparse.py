"""The sparse codec: per chunk, the largest values only, a few bits each.

``pseudo_grad_dtype = "sparse"`` follows SparseLoCo (Sarfi et al., arXiv 2508.15706): each
chunk of ``chunk`` values (the last padded with zeros) keeps its ``keep`` values of largest
magnitude, each sent as a sign and a magnitude level, ``bits`` bits in all, plus the chunk's
``2 ** (bits - 1)`` fp32 levels. What is not sent is the error-feedback residual, added to the
rank's next pseudo-gradient: delivered later, not lost.

Layout for ``numel`` values (``n = ceil(numel / chunk)`` chunks), levels first to stay 4-byte
aligned:

* the levels, ``n * 2 ** (bits - 1)`` fp32 (native byte order), chunk after chunk;
* the codes, ``ceil(keep * bits / 8)`` bytes per chunk: per kept value its level's number in
  the low ``bits - 1`` bits and its sign (1: negative) in the top bit;
* the indices within the chunk, ``ceil(keep * index_bits / 8)`` bytes per chunk,
  ``index_bits = ceil(log2(chunk))`` (12 for 4,096).

Bits are packed least significant first. At the defaults (4,096, 64, 2) a chunk costs 8 + 16 +
96 = 120 bytes, 0.73 % of float32's 16,384. Encodings are all-gathered, so with ``n`` groups a
rank sends ``(n - 1) * 120 / 4096`` bytes per value against int4's ``2 * (n - 1) / n * 0.53``:
fewer than int4 up to 36 groups. Each rank decodes ``n`` encodings per sync, and a heal history
entry holds all ``n``.

Levels: a chunk's kept magnitudes fall into ``2 ** (bits - 1)`` equal bins between their
smallest and largest; a level is its bin's mean (the centre when empty). A chunk with fewer
nonzero values than ``keep`` keeps zeros too: with 2 bits or more they take level 0, exactly 0
(nothing drifts where the pseudo-gradient is 0). Decoding only selects a level and a sign: the
same bytes decode to the same values on every rank and device. Inputs must be finite: an inf or
NaN makes its chunk's levels NaN.
"""

from __future__ import annotations

import math

import torch

from torchtitan.experiments.fault_tolerance.compression.codecs import Codec, Scratch

#: The wire name of the defaults; other settings are named ``sparse-c{chunk}-k{keep}-b{bits}``.
SPARSE = "sparse"
DEFAULT_CHUNK, DEFAULT_KEEP, DEFAULT_BITS = 4096, 64, 2
#: Values encoded at a time (temporaries are a piece long). On a GPU, one default bucket (32 MiB
#: of fp32): a piece costs ~80 kernel launches, which at 1e9 values must not number thousands.
PIECE_VALUES = 4096 * 128
CUDA_PIECE_VALUES = 2**23


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
    """Top ``keep`` of every ``chunk`` values, ``bits`` bits each (layout: module docstring).

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
        self.piece_chunks = max(1, PIECE_VALUES // chunk)
        self.cuda_piece_chunks = max(1, CUDA_PIECE_VALUES // chunk)

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
