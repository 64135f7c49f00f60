"""What the trainer needs to know about a model family, so that it stays model-agnostic."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.job_config import JobConfig


class ModelArgs(Protocol):
    """The hyper-parameters of one model size (a "flavor")."""

    n_layers: int

    def update_from_config(self, job_config: JobConfig, vocab_size: int) -> None:
        """Fill in what depends on the run: vocabulary size, maximum sequence length."""

    def num_flops_per_token(self, seq_len: int) -> tuple[int, float]:
        """(parameter count, training FLOPs per token: forward + backward)."""


class InitWeights(Protocol):
    """The call that initialises a built model (see :class:`TrainSpec`). The trainer holds the
    model as an ``nn.Module``, which types such attributes as Tensor | Module: it casts to this.
    """

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place; buffers go to ``buffer_device``."""


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainSpec:
    """A model family: its module class, its flavors, and how to parallelize it.

    ``model_cls(args)`` builds the model (on any device, including ``meta``);
    ``model.init_weights()`` initialises it; ``model(tokens)`` returns logits
    ``[batch, seq, vocab]``. ``parallelize_fn(model, dp_mesh, job_config)`` applies activation
    checkpointing, compile and FSDP2 over ``dp_mesh`` (None: a single rank) and returns the model.
    """

    name: str
    model_cls: type[nn.Module]
    model_args: Mapping[str, ModelArgs]
    parallelize_fn: Callable[[nn.Module, DeviceMesh | None, JobConfig], nn.Module]
    build_loss_fn: Callable[[JobConfig], LossFn]
