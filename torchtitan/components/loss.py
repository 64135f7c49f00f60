"""The training loss: next-token cross-entropy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.protocols.train_spec import LossFn

IGNORE_INDEX = -100
"""Label value excluded from the loss (padding, masked prompt tokens)."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens whose label is not ``IGNORE_INDEX``.

    ``logits``: ``[..., vocab]`` (any float dtype; computed in float32), ``labels``: ``[...]``.
    Returns a float32 scalar (NaN when every label is ignored).
    """
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX
    )


def build_cross_entropy_loss(job_config: JobConfig) -> LossFn:
    """The loss function of a train spec; the config has no loss options yet."""
    del job_config
    return cross_entropy_loss
