"""The learning-rate schedule: warmup, stable stretch, decay shapes, decay_ratio, min_lr_factor."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_scheduler, lr_factor, move_schedule_to
from torchtitan.config.job_config import JobConfig


def _config(steps: int, warmup: int, **scheduler: object) -> JobConfig:
    config = JobConfig()
    config.training.steps = steps
    config.lr_scheduler.warmup_steps = warmup
    for name, value in scheduler.items():
        setattr(config.lr_scheduler, name, value)
    return config


def _lrs_of_steps(config: JobConfig, base_lr: float = 1.0) -> list[float]:
    """The lr each optimizer step runs at, driven as the trainer drives it (step, then
    scheduler.step()), plus the lr the scheduler holds after the last step."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base_lr)
    scheduler = build_lr_scheduler(optimizer, config)
    lrs = []
    for _ in range(config.training.steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return [*lrs, optimizer.param_groups[0]["lr"]]


def test_warmup_stable_and_linear_decay_step_by_step() -> None:
    config = _config(steps=8, warmup=2, decay_ratio=0.5)
    lrs = _lrs_of_steps(config)
    expected = [1 / 3, 2 / 3, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2]
    assert lrs[:-1] == pytest.approx(expected)
    assert lrs[-1] == pytest.approx(0.0)  # reached only after the last step


def test_no_step_runs_at_lr_zero() -> None:
    """The first step is not wasted at lr 0 by the warmup, nor the last one by the decay to
    ``min_lr_factor=0`` (the early torchtitan schedule ran its last step at lr 0)."""
    for decay_type in ("linear", "sqrt", "cosine"):
        lrs = _lrs_of_steps(_config(steps=20, warmup=5, decay_type=decay_type))
        assert all(lr > 0 for lr in lrs[:-1]), (decay_type, lrs)
        assert lrs[-1] == pytest.approx(0.0), decay_type


def test_last_step_with_no_warmup_and_decay_over_all_steps() -> None:
    lrs = _lrs_of_steps(_config(steps=4, warmup=0))
    assert lrs == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0])


@pytest.mark.parametrize(
    ("decay_type", "at_half"),
    [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)],
)
def test_decay_shapes(decay_type: str, at_half: float) -> None:
    # 9 decay steps: progress of the 5th is 5/10 = 0.5.
    factor = lr_factor(
        4,
        warmup_steps=0,
        decay_steps=9,
        total_steps=9,
        decay_type=decay_type,
        min_lr_factor=0.0,
    )
    assert factor == pytest.approx(at_half)
    lrs = _lrs_of_steps(_config(steps=9, warmup=0, decay_type=decay_type))
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False)), lrs  # strictly falling


def test_cosine_is_above_linear_early_and_below_late() -> None:
    cosine = _lrs_of_steps(_config(steps=21, warmup=0, decay_type="cosine"))
    linear = _lrs_of_steps(_config(steps=21, warmup=0, decay_type="linear"))
    assert cosine[2] > linear[2] and cosine[-3] < linear[-3]


def test_decay_ratio_sets_the_stable_stretch() -> None:
    lrs = _lrs_of_steps(_config(steps=10, warmup=2, decay_ratio=0.3))[:-1]
    assert lrs[2:7] == [1.0] * 5  # steps 3..7 stable
    assert lrs[7:] == pytest.approx([0.75, 0.5, 0.25])  # 3 decay steps


def test_decay_ratio_zero_is_constant_after_warmup() -> None:
    lrs = _lrs_of_steps(_config(steps=6, warmup=2, decay_ratio=0.0))
    assert lrs[2:] == [1.0] * 5


def test_decay_ratio_larger_than_what_warmup_leaves_is_clamped() -> None:
    lrs = _lrs_of_steps(_config(steps=6, warmup=2, decay_ratio=1.0))[:-1]
    assert lrs[:2] == pytest.approx([1 / 3, 2 / 3])  # warmup intact
    assert lrs[2:] == pytest.approx([0.8, 0.6, 0.4, 0.2])  # decay over the 4 steps left


def test_min_lr_factor_is_the_floor_reached_after_the_last_step() -> None:
    lrs = _lrs_of_steps(_config(steps=5, warmup=0, min_lr_factor=0.1), base_lr=2.0)
    assert lrs[-1] == pytest.approx(0.2)
    assert min(lrs[:-1]) > 0.2
    assert lrs[:-1] == pytest.approx([2.0 * (0.1 + 0.9 * (1 - k / 6)) for k in range(1, 6)])


def test_warmup_longer_than_training_is_all_warmup() -> None:
    lrs = _lrs_of_steps(_config(steps=3, warmup=10))
    assert lrs[:-1] == pytest.approx([1 / 4, 2 / 4, 3 / 4])


def test_state_dict_resumes_the_schedule() -> None:
    config = _config(steps=10, warmup=3)
    expected = _lrs_of_steps(config)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, config)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()

    fresh_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = build_lr_scheduler(fresh_optimizer, config)
    fresh.load_state_dict(state)
    fresh_optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]  # optimizer's own
    resumed = []
    for _ in range(6):
        resumed.append(fresh_optimizer.param_groups[0]["lr"])
        fresh_optimizer.step()
        fresh.step()
    assert resumed == pytest.approx(expected[4:10])


def test_move_schedule_to_gives_the_lr_of_that_many_steps_in_any_order() -> None:
    config = _config(steps=10, warmup=3, decay_ratio=0.5)
    expected = _lrs_of_steps(config)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, config)
    optimizer.step()  # as in training: the schedule moves after an optimizer step
    for steps_taken in (4, 0, 10, 7, 7, 1):
        move_schedule_to(scheduler, steps_taken)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected[steps_taken])
        assert scheduler.state_dict()["last_epoch"] == steps_taken
