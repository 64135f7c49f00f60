"""The inner optimizer, built from ``[optimizer]``, with a checkpointable state."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.config.job_config import JobConfig


class OptimizerState:
    """Checkpoint/heal view of an optimizer: full-tensor-free, FSDP2-aware state dict.

    Going through ``torch.distributed.checkpoint.state_dict`` keys the state by parameter FQN
    (not by position) and keeps DTensor shards as they are, so DCP can reshard them.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(
            self.model, self.optimizer, state_dict, options=StateDictOptions(strict=True)
        )


def build_optimizer(model: nn.Module, job_config: JobConfig) -> torch.optim.Optimizer:
    """AdamW, Adam or SGD over all parameters of ``model``, per ``[optimizer]``."""
    cfg = job_config.optimizer
    impl = {
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[cfg.implementation]
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name in ("AdamW", "Adam"):
        cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        return cls(
            params,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **impl,
        )
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **impl
    )
