"""A custom args module for the FSDP2 test: one process that trains on exactly the batches that
``union_batch.ranks`` data-parallel ranks read together.

Run as ``./run_train.sh --job.custom_args_module=tests.integration_tests.union_batch_trainer``.
Each step concatenates the next batch of every rank's own dataloader (rank ``r`` of ``ranks``,
``local_batch_size`` sequences each), so one step sees the same sequences as one step of a
``ranks``-rank job, and its mean loss and gradient are what FSDP2's averaging computes there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from torchtitan.config import ConfigError
from torchtitan.config import JobConfig as CoreJobConfig
from torchtitan.datasets.text import build_dataloader
from torchtitan.trainer import Trainer


@dataclass
class UnionBatch:
    """The data-parallel job whose batches the single process reproduces."""

    ranks: int = 2
    """Data-parallel ranks whose batches make up one step of this process."""

    def validate(self, config: CoreJobConfig) -> None:
        if self.ranks < 1:
            raise ConfigError("union_batch.ranks", self.ranks, "must be >= 1")


@dataclass
class JobConfig:
    union_batch: UnionBatch = field(default_factory=UnionBatch)


class UnionBatchTrainer(Trainer):
    """The core trainer, fed with the union of ``union_batch.ranks`` ranks' batches."""

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ranks = self.job_config.union_batch.ranks  # type: ignore[attr-defined]
        loaders = [
            build_dataloader(self.job_config, self.tokenizer, rank, ranks, split="train")
            for rank in range(ranks)
        ]
        for parts in zip(*loaders, strict=True):
            inputs = torch.cat([inputs for inputs, _ in parts])
            labels = torch.cat([labels for _, labels in parts])
            yield inputs.to(self.device), labels.to(self.device)


TRAINER = "tests.integration_tests.union_batch_trainer:UnionBatchTrainer"
