"""Division that rounds alike on every device.

A CUDA kernel dividing by a Python number (or a CPU scalar) multiplies by its reciprocal,
computed once in fp32: ``x * (1 / d)`` is rounded twice and differs from ``x / d`` in the last
bit for some ``x`` (for ``d = 7``, about half of the values). The CPU divides. Groups whose
pseudo-gradients, scales or averages are computed on different devices (or a restart that
divides on the CPU what the uninterrupted run divided on the GPU) would then disagree bit for
bit. A divisor that lives on the tensor's own device is divided by, on both.
"""

from __future__ import annotations

import torch


def divisor_like(tensor: torch.Tensor, divisor: float) -> torch.Tensor:
    """``divisor`` as a 0-dim tensor of ``tensor``'s dtype on its device (a fill kernel on a
    GPU: no copy from the host, nothing waited for)."""
    return torch.full((), divisor, dtype=tensor.dtype, device=tensor.device)


def divide_(tensor: torch.Tensor, divisor: float) -> torch.Tensor:
    """``tensor /= divisor`` in place, one IEEE rounding per value on every device."""
    # out=, not div_: the same bits, and on the CPU div_ by a 0-dim tensor takes 2.5x as long.
    return torch.div(tensor, divisor_like(tensor, divisor), out=tensor)


def divided(tensor: torch.Tensor, divisor: float) -> torch.Tensor:
    """``tensor / divisor`` as a new tensor, one IEEE rounding per value on every device."""
    return torch.div(tensor, divisor_like(tensor, divisor))
