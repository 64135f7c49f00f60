"""Learning-rate schedule: linear warmup, an optional flat stretch, then decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

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
    """Multiplier of ``optimizer.lr`` for optimizer step ``step + 1`` (``step`` counts from 0).

    Three stages, ``warmup_steps`` + stable + ``decay_steps`` = ``total_steps``:

    * warmup: ``(step + 1) / (warmup_steps + 1)``, i.e. ``1/(w+1), 2/(w+1), ..., w/(w+1)``;
    * stable: 1;
    * decay: from 1 towards ``min_lr_factor`` with progress ``1/(d+1), ..., d/(d+1)`` over the
      ``d = decay_steps`` last steps (linear: ``1 - progress``; sqrt: ``1 - sqrt(progress)``;
      cosine: ``(1 + cos(pi * progress)) / 2``, each scaled into ``[min_lr_factor, 1]``).

    Neither end of a ramp is a step: the first step is never taken at lr 0, and the last step
    is never taken at ``min_lr_factor`` (with the default 0, a step at lr 0 would be wasted
    compute). The decay reaches ``min_lr_factor`` exactly at ``step == total_steps``, i.e. the
    value the scheduler holds after the last step. (torchtitan's early schedule ran its last
    step at ``min_lr_factor``, i.e. at lr 0 by default; it too moved away from that in 2025.)
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_start = total_steps - decay_steps
    if decay_steps <= 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / (decay_steps + 1))
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type: {decay_type!r}; use linear, sqrt or cosine")
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


def move_schedule_to(scheduler: LRScheduler, steps_taken: int) -> None:
    """Set the optimizer's learning rate to what it is after ``steps_taken`` calls of
    ``scheduler.step()``: for a process whose progress through the schedule is not its own
    step count (a replica group taking fewer inner steps per period than the others)."""
    scheduler.last_epoch = steps_taken - 1
    scheduler.step()
