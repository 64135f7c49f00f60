"""Learning-rate schedule: linear warmup, an optional flat stretch, then decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import JobConfig


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of ``optimizer.lr`` before optimizer step ``step + 1`` (``step`` counts from 0).

    Warmup climbs linearly from ``1 / (warmup + 1)`` to 1 so the first step is never taken at
    lr 0. The last ``decay_steps`` steps fall from 1 to ``min_lr_factor``; steps in between are
    flat.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_start = total_steps - decay_steps
    if decay_steps <= 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, job_config: JobConfig) -> LambdaLR:
    """A ``LambdaLR`` over ``lr_factor``; its ``state_dict`` is the step count."""
    cfg = job_config.lr_scheduler
    total = job_config.training.steps
    warmup = min(cfg.warmup_steps, total)
    after_warmup = total - warmup
    if cfg.decay_ratio is None:
        decay_steps = after_warmup
    else:
        decay_steps = min(after_warmup, round(total * cfg.decay_ratio))

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=warmup,
            decay_steps=decay_steps,
            total_steps=total,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        )

    return LambdaLR(optimizer, factor)
