"""A custom args module for ``wan.py`` and ``recovery.py``: the trainers, with per-step timing.

    .venv/bin/python benchmarks/train_entry.py --job.custom_args_module=benchmarks.timed_trainer

Its config is the semi-sync experiment's; the trainer is the core one, or the semi-sync one
when ``fault_tolerance.semi_sync_method`` is set, each extended through its extension points.
After every committed step it logs

    [timing] step N compute_s C t T

``C``: seconds spent so far in forward + backward (``forward_backward``), gradient clipping
(``clip_gradients``) and the inner optimizer's own update (from a step pre-hook to the
optimizer's first post-hook, which runs before torchft's sync hooks), summed over all steps of
this process. ``T``: ``time.monotonic()`` at the end of the step (the same clock in every
process of the machine, also across network namespaces). Compute utilisation over steps (a, b]
is ``(C_b - C_a) / (T_b - T_a)``; everything else in that wall time (quorums, all-reduces,
waiting for peers, data loading, logging) is the non-compute part.

When this process heals, it logs

    [timing] heal recv_bytes B seconds S

(``B``: bytes of the tensors received; ``S``: time in torchft's ``recv_checkpoint``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig as CoreJobConfig
from torchtitan.experiments.fault_tolerance.job_config import JobConfig
from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
from torchtitan.tools.logging import logger
from torchtitan.trainer import StepResult, Trainer

__all__ = ["JobConfig", "TimedSemiSyncTrainer", "TimedTrainer", "trainer_for"]


def trainer_for(config: CoreJobConfig) -> str:
    if config.fault_tolerance.semi_sync_method:
        return "benchmarks.timed_trainer:TimedSemiSyncTrainer"
    return "benchmarks.timed_trainer:TimedTrainer"


def _time_heal_transfers() -> None:
    """Log the bytes and seconds of every checkpoint this process receives from a peer.

    The transport is built inside the core's ``build_ft_manager`` and offers no extension
    point, so its receive method is wrapped, once per process; the trainer is untouched.
    """
    from torchft.checkpointing.pg_transport import PGTransport

    receive = PGTransport.recv_checkpoint
    if getattr(receive, "logs_heal_timing", False):
        return

    def timed_receive(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        state = receive(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        leaves = torch.utils._pytree.tree_leaves(state)
        nbytes = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        logger.info(f"[timing] heal recv_bytes {nbytes} seconds {seconds:.3f}")
        return state

    timed_receive.logs_heal_timing = True  # type: ignore[attr-defined]
    PGTransport.recv_checkpoint = timed_receive  # type: ignore[method-assign]


class ComputeTiming:
    """Adds the ``[timing]`` lines to a trainer (mixed in before it)."""

    train_state: Any

    def __init__(self, job_config: CoreJobConfig) -> None:
        self.compute_s = 0.0  # before the base builds the optimizer, whose hooks add to it
        self._optimizer_step_start = 0.0
        _time_heal_transfers()
        super().__init__(job_config)  # type: ignore[call-arg]

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return super().forward_backward(inputs, labels)  # type: ignore[misc]
        finally:
            self.compute_s += time.perf_counter() - start

    def clip_gradients(self) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return super().clip_gradients()  # type: ignore[misc]
        finally:
            self.compute_s += time.perf_counter() - start

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = super().build_optimizer(model)  # type: ignore[misc]
        optimizer.register_step_pre_hook(self._optimizer_step_started)
        # The first post-hook: it runs before the sync hooks torchft registers later.
        optimizer.register_step_post_hook(self._optimizer_step_ended)
        return optimizer

    def _optimizer_step_started(self, *_: Any) -> None:
        self._optimizer_step_start = time.perf_counter()

    def _optimizer_step_ended(self, *_: Any) -> None:
        self.compute_s += time.perf_counter() - self._optimizer_step_start

    def after_step(self, result: StepResult) -> None:
        logger.info(
            f"[timing] step {self.train_state.step} compute_s {self.compute_s:.4f} "
            f"t {time.monotonic():.4f}"
        )
        super().after_step(result)  # type: ignore[misc]


class TimedTrainer(ComputeTiming, Trainer):
    """The core trainer (no FT, or synchronous FT) with timing lines."""


class TimedSemiSyncTrainer(ComputeTiming, SemiSyncTrainer):
    """The semi-sync trainer (LocalSGD, DiLoCo) with timing lines."""
