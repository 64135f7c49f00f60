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
