"""The per-step log line and TensorBoard scalars.

``step: N  loss: X  grad_norm: X  memory: X GiB  tps: X  tflops: X  mfu: X%``: ``tps`` is
tokens per second on this rank, ``tflops`` the model FLOPs per second it achieved, ``mfu`` that
divided by the device's peak. On CPU, memory is the process's peak resident set and the peak is
a float32 matmul measured at start-up (``metrics.cpu_peak_flops``).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets, without sparsity).
_GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


def measure_matmul_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 8
) -> float:
    """Best FLOP/s of a square ``torch.mm`` on ``device``: a practical peak of this machine."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool start, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device, job_config: JobConfig) -> float | None:
    """Peak FLOP/s used for mfu, or None when unknown (mfu is then printed as n/a)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK_BF16.items():
            if key in name:
                return value
        return None
    configured = job_config.metrics.cpu_peak_flops
    if configured < 0:
        return None
    return configured if configured > 0 else measure_matmul_peak_flops(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory reserved, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsProcessor:
    """Accumulates tokens and time between log steps; prints the step line; writes TensorBoard."""

    def __init__(
        self,
        job_config: JobConfig,
        device: torch.device,
        flops_per_token: float,
        tb_folder: Path | None,
    ) -> None:
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device, job_config)
        self.color = not job_config.metrics.disable_color_printing
        self.writer = None
        if tb_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tb_folder))
        self.tokens = 0
        self.last_time = time.perf_counter()

    def count(self, tokens: int) -> None:
        """Add the tokens of one step (counted toward tps until the next log line)."""
        self.tokens += tokens

    def log_step(self, step: int, loss: float, grad_norm: float, extra: str = "") -> dict:
        """Print the step line and write its scalars; returns them."""
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        tps = self.tokens / elapsed
        flops = tps * self.flops_per_token
        memory = peak_memory_gib(self.device)
        values = {
            "loss": loss,
            "grad_norm": grad_norm,
            "memory_gib": memory,
            "tps": tps,
            "tflops": flops / 1e12,
        }
        mfu = "n/a"
        if self.peak:
            values["mfu_pct"] = 100 * flops / self.peak
            mfu = f"{values['mfu_pct']:.1f}%"
        if self.color:
            head = f"\033[31mstep: {step:>5}\033[0m  \033[32mloss: {loss:8.4f}\033[0m"
        else:
            head = f"step: {step:>5}  loss: {loss:8.4f}"
        logger.info(
            f"{head}  grad_norm: {grad_norm:7.4f}  memory: {memory:5.2f} GiB  "
            f"tps: {tps:,.0f}  tflops: {flops / 1e12:.3f}  mfu: {mfu}{extra}"
        )
        self.write_scalars(step, {f"train/{k}": v for k, v in values.items()})
        self.tokens = 0
        self.last_time = now
        return values

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (validation, checkpointing) out of the next tps figure."""
        self.last_time += seconds

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Write scalars to TensorBoard (no-op when it is off)."""
        if self.writer is None:
            return
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
