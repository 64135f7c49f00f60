"""A custom args module for the semi-sync fault tests: the experiment's config and trainer, plus
fault-injection knobs, so that a test can SIGKILL a group at a chosen point.

Steps and syncs of a tiny model last milliseconds, too short to hit with a signal from outside.
With ``--fault_injection.stall_after_quorum=N`` the group stops for ``stall_seconds`` right after
its N-th quorum: it is then in the replica process group with its peers, whose all-reduce of
that sync waits for its contribution; killing it there is a death in the middle of a sync. With
``--fault_injection.stall_after_step=S`` it stops after step S (between two inner steps).
``--fault_injection.pause_file=PATH`` holds the group between two steps while PATH exists (it
stays alive and heartbeating), so a test can keep a survivor from running out of steps while a
killed peer restarts.

Use with ``--job.custom_args_module=tests.integration_tests.semi_sync_faults``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.config.job_config import JobConfig as CoreJobConfig
from torchtitan.experiments.fault_tolerance.job_config import JobConfig as SemiSyncJobConfig
from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
from torchtitan.tools.logging import logger

TRAINER = "tests.integration_tests.semi_sync_faults:StallingTrainer"
STALL_IN_SYNC = "[fault-injection] stalling inside sync"
STALL_AFTER_STEP = "[fault-injection] stalling after step"
PAUSED = "[fault-injection] paused after step"


@dataclass
class FaultInjection:
    """Test-only faults."""

    stall_after_quorum: int = 0
    """Stall right after this process's N-th quorum (1-based), before the sync's all-reduce.
    0: never."""

    stall_after_step: int = 0
    """Stall after this training step (and its checkpoint, if one is due). 0: never."""

    stall_seconds: float = 120.0
    """How long the stall lasts (the test kills the group during it)."""

    pause_file: str = ""
    """While this file exists, wait after each step. Empty: never."""


@dataclass
class JobConfig(SemiSyncJobConfig):
    fault_injection: FaultInjection = field(default_factory=FaultInjection)


class StallingTrainer(SemiSyncTrainer):
    def __init__(self, job_config: CoreJobConfig) -> None:
        super().__init__(job_config)
        self.faults: FaultInjection = job_config.fault_injection  # type: ignore[attr-defined]
        faults = self.faults
        if faults.stall_after_quorum <= 0 or self.ft is None:
            return
        manager = self.ft.manager
        start_quorum = manager.start_quorum
        quorums = 0

        def start_quorum_then_stall(*args: Any, **kwargs: Any) -> None:
            nonlocal quorums
            start_quorum(*args, **kwargs)
            quorums += 1
            if quorums == faults.stall_after_quorum:
                logger.info(
                    f"{STALL_IN_SYNC} (quorum {quorums}, {manager.num_participants()} groups) "
                    f"for {faults.stall_seconds:.0f}s"
                )
                time.sleep(faults.stall_seconds)

        manager.start_quorum = start_quorum_then_stall

    def after_step(self, result: Any) -> None:
        super().after_step(result)
        if self.train_state.step == self.faults.stall_after_step:
            logger.info(f"{STALL_AFTER_STEP} {self.train_state.step}")
            time.sleep(self.faults.stall_seconds)
        pause = Path(self.faults.pause_file) if self.faults.pause_file else None
        if pause is not None and pause.exists():
            logger.info(f"{PAUSED} {self.train_state.step}")
            while pause.exists():
                time.sleep(0.1)
            logger.info("[fault-injection] resumed")
