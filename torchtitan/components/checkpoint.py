"""Persistent checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<dump_folder>/<checkpoint.folder>[/replica_<R>]/step-<N>/``. A save is complete when
DCP has written its ``.metadata`` file (written last, after every rank's shards); a step folder
without it is a save that died part-way and is skipped with a warning. Anything else that cannot
be loaded (garbage, a different model) is an error: a run never starts fresh silently when a
checkpoint exists.

What is saved is the trainer's state registry (``Trainer.states``): model, optimizer, LR
scheduler, dataloader, train state, and whatever a subclass registers. The same registry feeds
torchft's healing, so there is one list of state, not two.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used."""


def checkpoint_folder(job_config: JobConfig) -> Path:
    """This job's checkpoint folder; each fault-tolerant replica group has its own."""
    folder = Path(job_config.job.dump_folder) / job_config.checkpoint.folder
    ft = job_config.fault_tolerance
    if ft.enable:
        folder = folder / f"replica_{ft.replica_id}"
    return folder


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        if (entry / ".metadata").is_file():
            steps.append(int(match.group(1)))
        else:
            logger.warning(f"Skipping {entry}: incomplete checkpoint (no .metadata)")
    return sorted(steps)


class CheckpointManager:
    """Saves ``states`` every ``checkpoint.interval`` steps and resumes from the newest save."""

    def __init__(self, job_config: JobConfig, states: dict[str, Stateful]) -> None:
        self.config = job_config.checkpoint
        self.enabled = self.config.enable
        self.folder = checkpoint_folder(job_config)
        self.states = states
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def should_save(self, step: int, last_step: bool) -> bool:
        return self.enabled and (last_step or step % self.config.interval == 0)

    def save(self, step: int) -> None:
        """Write a checkpoint of every registered state at ``step`` (all ranks call this)."""
        target = self.step_folder(step)
        if (target / ".metadata").is_file():
            return
        start = time.perf_counter()
        if self.is_main and target.exists():
            shutil.rmtree(target)  # a partial save of this step from an earlier crash
        if dist.is_initialized():
            dist.barrier()
        dcp.save(dict(self.states), checkpoint_id=str(target))
        logger.info(
            f"Saved checkpoint step {step} to {target} in {time.perf_counter() - start:.2f}s"
        )
        self._purge()

    def _purge(self) -> None:
        keep = self.config.keep_latest_k
        if keep <= 0 or not self.is_main:
            return
        for old in complete_steps(self.folder)[:-keep]:
            shutil.rmtree(self.step_folder(old), ignore_errors=True)

    def load(self) -> int | None:
        """Restore the newest (or ``checkpoint.load_step``) checkpoint; return its step.

        None when there is nothing to resume from. With no checkpoint of this run but an
        ``initial_load_path``, loads that (model only by default) and returns None: training
        then starts at step 1 from those weights.
        """
        if not self.enabled:
            return None
        steps = complete_steps(self.folder)
        if self.config.load_step >= 0:
            if self.config.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step: {self.config.load_step} has no complete checkpoint in "
                    f"{self.folder}; complete steps: {steps or 'none'}"
                )
            step = self.config.load_step
        elif steps:
            step = steps[-1]
        else:
            self._load_initial()
            return None
        keys = [k for k in self.states if k not in self.config.exclude_from_loading]
        self._load(self.step_folder(step), keys)
        logger.info(f"Resumed from checkpoint {self.step_folder(step)} (step {step})")
        return step

    def _load_initial(self) -> None:
        path = self.config.initial_load_path
        if not path:
            return
        if not (Path(path) / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint.initial_load_path: {path!r} is not a DCP checkpoint folder "
                "(no .metadata file in it)"
            )
        keys = ["model"] if self.config.initial_load_model_only else list(self.states)
        self._load(Path(path), keys)
        logger.info(f"Loaded initial weights ({', '.join(keys)}) from {path}")

    def _load(self, folder: Path, keys: list[str]) -> None:
        wanted: dict[str, Any] = {k: self.states[k] for k in keys}
        try:
            dcp.load(wanted, checkpoint_id=str(folder))
        except Exception as e:  # DCP raises many types; the user needs the folder and cause
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"Checkpoint {folder} cannot be loaded ({type(e).__name__}: {cause}). It is "
                "corrupt or was written by a different model/config. Move it away to start "
                f"fresh, or set checkpoint.load_step to another step in {folder.parent}."
            ) from e
