"""A custom args module for ``wan.py`` and ``recovery.py``: the trainers, with per-step timing.

    .venv/bin/python -m benchmarks.train_entry --job.custom_args_module=benchmarks.timed_trainer

Its config is the semi-sync experiment's; the trainer is the core one, or the semi-sync one
when ``fault_tolerance.semi_sync_method`` is set, each extended through its extension points.
After every committed step it emits the event ``bench.timing`` (``TIMING``), whose line is

    [timing] step N compute_s C t T

``C`` (field ``compute_s``): seconds spent so far in forward + backward
(``forward_backward``), gradient clipping (``clip_gradients``) and the inner optimizer's own
update (from a step pre-hook to the optimizer's first post-hook, which runs before torchft's
sync hooks), summed over all steps of this process. ``T`` (field ``t``): ``time.monotonic()``
at the end of the step (the same clock in every process of the machine, also across network
namespaces). Compute utilisation over steps (a, b] is ``(C_b - C_a) / (T_b - T_a)``;
everything else in that wall time (quorums, all-reduces, waiting for peers, data loading,
logging) is the non-compute part.

When this process heals, it emits ``bench.heal_transfer`` (``HEAL_TRANSFER``)

    [timing] heal recv_bytes B seconds S

(field ``bytes``: of the tensors received; ``seconds``: time in torchft's ``recv_checkpoint``).
With ``--bench.pause_file=PATH`` a trainer waits after a step while PATH exists (alive and
heartbeating), and says so (``bench.paused`` / ``bench.resumed``, with ``t``): at once if PATH is
empty, or once its torchft Manager has committed N steps or syncs if PATH holds the number N.
A benchmark holds a group at a chosen sync that way (write the file atomically).

The benchmarks read these events from the trainers' event files (``torchtitan.tools.events``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig as CoreJobConfig
from torchtitan.experiments.fault_tolerance.job_config import JobConfig as SemiSyncJobConfig
from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
from torchtitan.tools.events import EventKind
from torchtitan.trainer import StepResult, Trainer

__all__ = [
    "BENCH_PAUSED",
    "BENCH_RESUMED",
    "HEAL_TRANSFER",
    "TIMING",
    "JobConfig",
    "TimedSemiSyncTrainer",
    "TimedTrainer",
    "trainer_for",
]

#: After each committed step: ``compute_s`` so far in this process, ``t`` (``time.monotonic()``,
#: comparable across the machine's processes) at the step's end.
TIMING = EventKind("bench.timing", "[timing] step {step} compute_s {compute_s:.4f} t {t:.4f}")
#: A checkpoint received from a peer (a heal): ``bytes`` of its tensors, ``seconds`` to receive.
HEAL_TRANSFER = EventKind(
    "bench.heal_transfer", "[timing] heal recv_bytes {bytes} seconds {seconds:.3f}"
)


#: The trainer waits after step ``step`` while ``--bench.pause_file`` exists; ``t`` as above.
BENCH_PAUSED = EventKind("bench.paused", "[timing] paused after step {step} t {t:.4f}")
BENCH_RESUMED = EventKind("bench.resumed", "[timing] resumed t {t:.4f}")


@dataclass
class Bench:
    """Benchmark-only knobs."""

    pause_file: str = ""
    """While this file exists, wait after each step; if it holds a number N, only once the
    Manager has committed N steps or syncs (empty field: never)."""


@dataclass
class JobConfig(SemiSyncJobConfig):
    bench: Bench = field(default_factory=Bench)


def trainer_for(config: CoreJobConfig) -> str:
    if config.fault_tolerance.semi_sync_method:
        return "benchmarks.timed_trainer:TimedSemiSyncTrainer"
    return "benchmarks.timed_trainer:TimedTrainer"


def _time_heal_transfers() -> None:
    """Report the bytes and seconds of every checkpoint this process receives from a peer.

    The transport is built inside the core's ``build_ft_manager`` and offers no extension
    point, so its receive method is wrapped, once per process; the trainer is untouched.
    """
    from torchft.checkpointing.pg_transport import PGTransport

    receive = PGTransport.recv_checkpoint
    if getattr(receive, "reports_heal_timing", False):
        return

    def timed_receive(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        state = receive(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        leaves = torch.utils._pytree.tree_leaves(state)
        nbytes = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        HEAL_TRANSFER.emit(bytes=nbytes, seconds=seconds)
        return state

    timed_receive.reports_heal_timing = True  # type: ignore[attr-defined]
    PGTransport.recv_checkpoint = timed_receive  # type: ignore[method-assign]


class ComputeTiming:
    """Adds the timing events to a trainer (mixed in before it)."""

    train_state: Any

    def __init__(self, job_config: CoreJobConfig) -> None:
        self.compute_s = 0.0  # before the base builds the optimizer, whose hooks add to it
        self._optimizer_step_start = 0.0
        bench = getattr(job_config, "bench", Bench())
        self._pause = Path(bench.pause_file) if bench.pause_file else None
        _time_heal_transfers()
        super().__init__(job_config)  # type: ignore[call-arg]

    def _pause_due(self) -> bool:
        """An empty pause file holds the trainer now; one that holds a number N, once its
        torchft Manager has committed N steps or syncs."""
        assert self._pause is not None
        text = self._pause.read_text().strip()
        if not text:
            return True
        ft = getattr(self, "ft", None)
        done = ft.manager.current_step() if ft is not None and ft.started else 0
        return done >= int(text)

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
        TIMING.emit(step=self.train_state.step, compute_s=self.compute_s, t=time.monotonic())
        super().after_step(result)  # type: ignore[misc]
        if self._pause is not None and self._pause.exists() and self._pause_due():
            BENCH_PAUSED.emit(step=self.train_state.step, t=time.monotonic())
            while self._pause.exists():
                time.sleep(0.05)
            BENCH_RESUMED.emit(t=time.monotonic())


class TimedTrainer(ComputeTiming, Trainer):
    """The core trainer (no FT, or synchronous FT) with timing events."""


class TimedSemiSyncTrainer(ComputeTiming, SemiSyncTrainer):
    """The semi-sync trainer (LocalSGD, DiLoCo) with timing events."""
