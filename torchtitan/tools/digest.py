"""Digests of tensors, to check that replica groups hold bit-identical parameters."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def tensor_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (first 16 hex digits) of the tensors' bytes, in order. DTensors contribute
    their local shard, so rank r of every group can be compared with rank r of the others."""
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        t = t.detach().to("cpu").contiguous()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


#: 64-bit words per chunk of a digest.
_CHUNK = 1 << 20
_WRAP = 1 << 64
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """Odd 64-bit multipliers, one per position of a chunk (made once per device)."""
    if device not in _WEIGHTS:
        golden = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / golden ratio, as a signed int64
        odd = torch.arange(_CHUNK, dtype=torch.int64, device=device) * 2 + 1
        _WEIGHTS[device] = odd * golden  # wraps modulo 2^64, still odd
    return _WEIGHTS[device]


def device_digest(tensors: Iterable[torch.Tensor]) -> int:
    """A 64-bit digest of the tensors' bytes, computed where they live (no copy to the host),
    as a signed int64 value. A tensor's bytes are read as 64-bit words (the last, short one
    padded with zeros); each chunk of 2^20 words contributes the sum of ``word *
    odd_weight(position)`` modulo 2^64 (:func:`chunk_hashes`), folded in order
    (:func:`fold_digest`). Equal tensors give equal digests on any device and in any
    reduction order (integer sums wrap around exactly); a change of one word always changes
    the digest (an odd multiplier is invertible modulo 2^64). On the CPU a chunk is one
    ``torch.dot`` (no temporary): cheap enough to compare replica groups' parameters at every
    sync; :func:`tensor_digest` is the one written to logs."""
    return fold_digest(h for t in tensors for h in chunk_hashes(t))


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t``'s bytes as int64 words, and the last short word padded with zeros (or None)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    flat = t.detach().reshape(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    if flat.storage_offset() % 8:  # not on a word boundary of its storage: hash a copy
        flat = flat.clone()
    tail = None
    if whole < flat.numel():
        tail = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        tail[: flat.numel() - whole] = flat[whole:]
        tail = tail.view(torch.int64)
    return flat[:whole].view(torch.int64), tail


def _weighted_sum(words: torch.Tensor, weights: torch.Tensor, scratch: torch.Tensor | None) -> int:
    """``sum(words * weights)`` modulo 2^64: a ``dot`` on the CPU (integer, no temporary),
    a product and a sum elsewhere (``scratch``: room for the product, or None)."""
    if words.device.type == "cpu":
        return int(torch.dot(words, weights)) % _WRAP
    product = words * weights if scratch is None else torch.mul(words, weights, out=scratch)
    return int(product.sum().item()) % _WRAP


def chunk_hashes(t: torch.Tensor) -> list[int]:
    """The hash of each chunk of 2^20 words of ``t``'s bytes (modulo 2^64), in order."""
    words, tail = _words(t)
    weights = _weights(words.device)
    hashes = [
        _weighted_sum(chunk, weights[: chunk.numel()], None)
        for chunk in (words.split(_CHUNK) if words.numel() else ())
    ]
    if tail is not None:
        position = words.numel() % _CHUNK
        if position == 0:
            hashes.append(0)
        hashes[-1] = hashes[-1] + _weighted_sum(tail, weights[position : position + 1], None)
        hashes[-1] %= _WRAP
    return hashes


def fold_digest(hashes: Iterable[int]) -> int:
    """The digest of tensors whose chunk hashes (:func:`chunk_hashes`) are ``hashes``, in order:
    a fold, so that tensors hashed apart (or piece by piece) digest as one sequence."""
    total = 0
    for h in hashes:
        total = (total * 1000003 + h + 1) % _WRAP
    return total - _WRAP if total >= (1 << 63) else total


class PieceHashes:
    """The chunk hashes of a tensor of ``numel`` elements (``element_size`` bytes each), taken
    piece by piece while a pass over it has each piece in cache (:meth:`add`). A piece starts
    on a word and lies within one chunk; only the tensor's last piece may end in a short
    word."""

    def __init__(self, numel: int, element_size: int, device: torch.device) -> None:
        self.hashes = [0] * -(-numel * element_size // (8 * _CHUNK))
        self._element_size = element_size
        self._weights = _weights(device)

    def add(self, start: int, piece: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """Hash ``piece``, the elements ``start..`` of the tensor; ``scratch``: room for as
        many int64 values as the piece has words (only used off the CPU)."""
        first, remainder = divmod(start * self._element_size, 8)
        if remainder:
            raise ValueError(f"a piece at element {start} does not start on a 64-bit word")
        if piece.numel() % 2 == 0 and piece.element_size() == 4 and piece.is_contiguous():
            words, tail = piece.view(torch.int64), None  # the common case, without _words
        else:
            words, tail = _words(piece)
        offset = first % _CHUNK
        if offset + words.numel() + (tail is not None) > _CHUNK:
            raise ValueError(f"a piece at element {start} crosses a chunk of the digest")
        index = first // _CHUNK
        if index >= len(self.hashes):  # an empty piece at the end
            return
        found = _weighted_sum(words, self._weights[offset : offset + words.numel()], scratch)
        if tail is not None:
            position = offset + words.numel()
            found += _weighted_sum(tail, self._weights[position : position + 1], None)
        self.hashes[index] = (self.hashes[index] + found) % _WRAP
