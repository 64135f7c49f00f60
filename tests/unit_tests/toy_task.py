"""The small regression task the gloo-group tests train on: a model whose tensors span the
bucket cases (one larger than a bucket, several packed into one, one that does not fit after
the others), its fragments, and one inner step."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.experiments.fault_tolerance.heal.history import HealHistory
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncDiLoCo
from torchtitan.experiments.fault_tolerance.methods.fragments import ModelFragment
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import OuterSGD
from torchtitan.experiments.fault_tolerance.methods.periodic import DiLoCo, LocalSGD

BUCKET = 300
PERIOD = 3

_SEEDING = threading.Lock()  # the groups' threads share torch's global generator


def make_model() -> nn.Module:
    """Tensors of 1024 (more than a bucket: in pieces of 300), then 64 + 128 + 2 (one bucket),
    120 + 60 + 60 + 1 (the next: 120 does not fit after 194). The same in every group."""
    with _SEEDING:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 2), nn.Tanh(), nn.Linear(2, 60),
            nn.Tanh(), nn.Linear(60, 1),
        )  # fmt: skip


def fragments_of(model: nn.Module, count: int) -> list[nn.Module]:
    """The model itself (``count`` 1), or two fragments: the first layer, and the rest."""
    if count == 1:
        return [model]
    named = list(model.named_parameters())
    return [ModelFragment(named[:2]), ModelFragment(named[2:])]


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: torch.Generator,
    target: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """One inner step on 8 samples of 16 random features drawn from ``data``, regressing
    ``target(x)``."""
    x = torch.randn(8, 16, generator=data)
    loss = F.mse_loss(model(x), target(x))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def fragment_count(method: str) -> int:
    """The fragments :func:`build_method` cuts the model into for ``method``."""
    return 2 if "streaming" in method else 1


def build_method(
    method: str,
    sync: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    outer_lr: float = 1.0,
    outer_momentum: float = 0.0,
    outer_momentum_every: int = 1,
    history: HealHistory | None = None,
) -> Any:
    """The method as the trainer builds it, syncing every ``PERIOD`` steps: ``localsgd``,
    ``diloco``, ``streaming_diloco`` (2 fragments), ``streaming_diloco_delayed`` (and
    ``fragment_sync_delay`` 1: a sync is prepared one step and performed the next), or
    ``async_<update>`` (``async_<update>_streaming``: 2 fragments); the outer optimizer is
    SGD, Nesterov when it has momentum; ``history``: the heal history a method that replays
    keeps its committed syncs in."""
    nesterov = outer_momentum > 0
    if method == "localsgd":
        return LocalSGD(sync, model, optimizer, PERIOD)
    if method.startswith("async_"):
        return AsyncDiLoCo(
            sync,
            fragments_of(model, fragment_count(method)),
            optimizer,
            # One sync point per fragment in PERIOD * fragments steps: every PERIOD steps.
            sync_steps=PERIOD * fragment_count(method),
            update=method.removeprefix("async_").removesuffix("_streaming"),
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            outer_nesterov=nesterov,
            outer_momentum_every=outer_momentum_every,
            state_device=torch.device("cpu"),
            tokens_per_step=10,
            history=history,
        )
    count = fragment_count(method)
    delay = 1 if method == "streaming_diloco_delayed" else 0
    outer = functools.partial(OuterSGD, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    return DiLoCo(
        sync,
        fragments_of(model, count),
        optimizer,
        outer,
        period=PERIOD,
        delay=delay,
        history=history,
    )
