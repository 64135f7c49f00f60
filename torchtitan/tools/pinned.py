"""Host tensors pinned at their exact size, for state that lives beside a GPU for a whole job.

``tensor.pin_memory()`` and ``torch.empty(..., pin_memory=True)`` take memory from torch's
caching host allocator, which rounds every block up to a power of two (about +10 % over the
parameter shapes of an 8B model's shard, up to +100 % for one tensor) and keeps the blocks of
non-blocking device-to-host copies cached for the rest of the process. Here the memory is a
plain host allocation, page-locked in place (``cudaHostRegister``) for as long as the tensor
lives, so a job's pinned host memory is what its state needs and no more.
"""

from __future__ import annotations

import weakref

import torch

#: Bytes page-locked through :func:`host_tensor` and not yet released (for benchmarks).
registered_bytes = 0


def host_tensor(shape: torch.Size | tuple[int, ...], *, pinned: bool) -> torch.Tensor:
    """An uninitialized fp32 host tensor of ``shape``; ``pinned``: page-locked at its exact
    size when CUDA is available (a GPU copies to and from it without staging, and a
    non-blocking copy does not block the host)."""
    tensor = torch.empty(shape, dtype=torch.float32)
    if pinned and tensor.numel() and torch.cuda.is_available():
        _page_lock(tensor)
    return tensor


def _page_lock(tensor: torch.Tensor) -> None:
    global registered_bytes
    cudart = torch.cuda.cudart()
    pointer, size = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    status = cudart.cudaHostRegister(pointer, size, 0)
    if int(status) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {size} bytes of host memory failed (CUDA error "
            f"{int(status)}): the host may be out of memory it can page-lock"
        )
    registered_bytes += size
    weakref.finalize(tensor, _release, cudart, pointer, size)


def _release(cudart: object, pointer: int, size: int) -> None:
    global registered_bytes
    cudart.cudaHostUnregister(pointer)  # type: ignore[attr-defined]  # torch's cudart module
    registered_bytes -= size
