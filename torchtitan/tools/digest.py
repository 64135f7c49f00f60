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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """Odd 64-bit multipliers, one per position of a chunk (made once per device)."""
    if device not in _WEIGHTS:
        golden = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / golden ratio, as a signed int64
        odd = torch.arange(_CHUNK, dtype=torch.int64, device=device) * 2 + 1
        _WEIGHTS[device] = odd * golden  # wraps modulo 2^64, still odd
    return _WEIGHTS[device]


def device_digest(tensors: Iterable[torch.Tensor]) -> int:
    """A 64-bit digest of the tensors' bits, computed where they live (no copy to the host),
    as a signed int64 value. Each chunk of 2^20 elements contributes the sum of
    ``bits * odd_weight(position)`` modulo 2^64, folded in order. Equal tensors give equal
    digests on any device and in any reduction order (integer sums wrap around exactly); a
    change of one element always changes the digest (an odd multiplier is invertible modulo
    2^64). Cheap enough to compare replica groups' parameters at every sync;
    :func:`tensor_digest` is the one written to logs."""
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        flat = t.detach().reshape(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()])
        weights = _weights(flat.device)
        for start in range(0, bits.numel(), _CHUNK):
            chunk = bits[start : start + _CHUNK]
            h = int((chunk.to(torch.int64) * weights[: chunk.numel()]).sum().item())
            total = (total * 1000003 + h + 1) % (1 << 64)
    return total - (1 << 64) if total >= (1 << 63) else total
