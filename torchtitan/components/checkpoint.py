"""Persistent checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<dump_folder>/<checkpoint.folder>[/replica_<R>]/step-<N>/``. A save is complete when
its ``checksums.json`` is written (the XXH3-64 digest of every item, each rank's of the items it
wrote, after DCP's ``.metadata``; ``checksums.py``); a step folder without it is a save that
died part-way and is skipped with a warning (and deleted by the next purge of
``keep_latest_k``). Every file's presence and size, and ``.metadata``'s digest, are checked
before DCP opens the folder, and every item's digest as it is read, before its value reaches a
state. A checkpoint that fails (a flipped byte, a truncated or missing file) is never trained
on: the newest older checkpoint that passes is loaded over it instead, with a warning naming the
folder, the file and the rank; with ``checkpoint.load_step`` naming the bad one, or when none
passes, the run stops with an error (:class:`CorruptCheckpointError`). Checkpoints written
before checksums existed load unverified, with a note. Anything else that cannot be loaded
(garbage, a different model) is a :class:`CheckpointError` naming the folder and the cause: a
run never starts fresh silently when a checkpoint exists, and never trains on a half-loaded one.

What is saved is the trainer's state registry (``Trainer.states``): model, optimizer, LR
scheduler, dataloader, train state, and whatever a subclass registers. The same registry feeds
torchft's healing, so there is one list of state, not two.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components import checksums
from torchtitan.config.job_config import ConfigError, JobConfig
from torchtitan.tools.events import EventKind
from torchtitan.tools.logging import logger

_STEP_DIR = re.compile(r"^step-(\d+)$")

CHECKPOINT_SAVED = EventKind(
    "checkpoint.saved", "Saved checkpoint step {step} to {folder} in {seconds:.2f}s"
)
CHECKPOINT_RESUMED = EventKind(
    "checkpoint.resumed", "Resumed from checkpoint {folder} (step {step})"
)
#: A checkpoint failed its checksums and was not loaded (``problem``: the folder, the file and
#: the rank that wrote it).
CHECKPOINT_REJECTED = EventKind(
    "checkpoint.rejected", "Not loading a corrupt checkpoint: {problem}", logging.WARNING
)
#: A checkpoint written before checksums existed was loaded without a check.
CHECKPOINT_UNVERIFIED = EventKind(
    "checkpoint.unverified",
    "Checkpoint {folder} has no checksums (written before they existed): loaded unverified",
    logging.WARNING,
)
#: ``checkpoint.initial_load_path`` was loaded (``states``: the states taken from it).
INITIAL_WEIGHTS_LOADED = EventKind(
    "checkpoint.initial_loaded",
    lambda v, _: f"Loaded initial weights ({', '.join(v['states'])}) from {v['path']}",
)


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used."""


class CorruptCheckpointError(CheckpointError):
    """No checkpoint that could be loaded passed its checksums."""


def checkpoint_folder(job_config: JobConfig) -> Path:
    """This job's checkpoint folder; each fault-tolerant replica group has its own."""
    folder = Path(job_config.job.dump_folder) / job_config.checkpoint.folder
    ft = job_config.fault_tolerance
    if ft.enable:
        folder = folder / f"replica_{ft.replica_id}"
    return folder


def is_complete(folder: Path) -> bool:
    """Whether a step folder holds a finished save: DCP's ``.metadata``, and the checksums a
    checksummed save writes last (a save from before checksums has only the former)."""
    return (folder / checksums.METADATA).is_file() and checksums.state(folder) != "pending"


def scan_steps(folder: Path) -> tuple[list[int], list[int]]:
    """(complete, incomplete) checkpoint steps in ``folder``, each oldest first."""
    complete: list[int] = []
    incomplete: list[int] = []
    if folder.is_dir():
        for entry in folder.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match is None or not entry.is_dir():
                continue
            (complete if is_complete(entry) else incomplete).append(int(match.group(1)))
    return sorted(complete), sorted(incomplete)


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, oldest first; warns about each step
    folder without ``.metadata`` (a save that died part-way), which is skipped."""
    complete, incomplete = scan_steps(folder)
    for step in incomplete:
        logger.warning(
            f"Skipping {folder / f'step-{step}'}: incomplete checkpoint (a save that did not "
            f"finish: no .metadata or no {checksums.MANIFEST})"
        )
    return complete


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[list[logging.LogRecord]]:
    """Hold back DCP's own chatter for the length of one save or load.

    DCP logs on the root logger, with full tracebacks, before it raises (we raise one clear
    error instead), and warns on every call in a process without torch.distributed. The
    records it logs are collected in the yielded list instead of printed.
    """
    root = logging.getLogger()
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    root.addFilter(hold)  # a logger's filter sees only records logged on it: DCP's, not ours
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield held
    finally:
        root.removeFilter(hold)


def _release(held: list[logging.LogRecord]) -> None:
    for record in held:  # one line each, without DCP's tracebacks
        logger.log(record.levelno, f"DCP: {record.getMessage()}")


def _cause(error: BaseException) -> str:
    """One line: the exception that went wrong first (DCP wraps each rank's in its own)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _checksum_error(error: BaseException) -> checksums.ItemChecksumError | None:
    """The first rank's checksum failure in what DCP raised (it wraps every rank's)."""
    if isinstance(error, checksums.ItemChecksumError):
        return error
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, checksums.ItemChecksumError):
                return found
    return None


class CheckpointManager:
    """Saves ``states`` every ``checkpoint.interval`` steps and resumes from the newest save."""

    def __init__(self, job_config: JobConfig, states: dict[str, Stateful]) -> None:
        self.config = job_config.checkpoint
        self.enabled = self.config.enable
        self.folder = checkpoint_folder(job_config)
        self.states = states
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        #: Checkpoints that failed their checksums at load: a new save of their step replaces
        #: them (they are left alone otherwise, to be restored from a copy).
        self.rejected: set[Path] = set()

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def should_save(self, step: int, last_step: bool) -> bool:
        return self.enabled and (last_step or step % self.config.interval == 0)

    def save(self, step: int) -> None:
        """Write a checkpoint of every registered state at ``step`` (all ranks call this).

        A step that already has a complete checkpoint is not written again, unless it failed
        its checksums at load (it is replaced). Every rank
        checksums the files it wrote; the manifest (``checksums.json``) is written last. A
        failed write raises :class:`CheckpointError`; the partial folder it leaves is skipped
        on resume.
        """
        target = self.step_folder(step)
        if is_complete(target) and target not in self.rejected:
            return
        start = time.perf_counter()
        if self.is_main:
            if target.exists():
                shutil.rmtree(target)  # a partial save of this step from an earlier crash
            checksums.begin(target)
        if dist.is_initialized():
            dist.barrier()
        try:
            writer = checksums.ChecksummingWriter(target)
            with _quiet_dcp() as held:
                dcp.save(dict(self.states), storage_writer=writer)
            checksums.write_manifest(target, writer.written)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"Saving checkpoint step {step} to {target} failed ({_cause(e)})"
            ) from e
        _release(held)
        CHECKPOINT_SAVED.emit(step=step, folder=str(target), seconds=time.perf_counter() - start)
        self._purge()

    def _purge(self) -> None:
        """Keep the newest ``keep_latest_k`` complete checkpoints; delete older ones and any
        partial save older than the newest complete one (it can no longer be finished)."""
        keep = self.config.keep_latest_k
        if keep <= 0 or not self.is_main:
            return
        complete, incomplete = scan_steps(self.folder)
        newest = complete[-1] if complete else -1
        for old in complete[:-keep] + [s for s in incomplete if s < newest]:
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
        asked = self.config.load_step >= 0
        if asked:
            if self.config.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step: {self.config.load_step} has no complete checkpoint in "
                    f"{self.folder}; complete steps: {steps or 'none'}"
                )
            candidates = [self.config.load_step]
        elif steps:
            candidates = steps[::-1]  # the newest first; older ones if it fails its checksums
        else:
            self._load_initial()
            return None
        problems = []
        for step in candidates:
            folder = self.step_folder(step)
            problem = checksums.verify(folder)
            if problem is None:
                try:
                    self._load(folder, self._keys_to_load())
                    CHECKPOINT_RESUMED.emit(step=step, folder=str(folder))
                    return step
                except CorruptCheckpointError as e:  # an item failed its checksum as read
                    problem = str(e)
            CHECKPOINT_REJECTED.emit(problem=problem)
            self.rejected.add(folder)
            problems.append(problem)
        reason = (
            "checkpoint.load_step asked for it"
            if asked
            else f"no other checkpoint in {self.folder} passes its checksums"
        )
        raise CorruptCheckpointError(
            f"{problems[0]}; {reason}. Restore the folder from a copy, or set "
            "checkpoint.load_step to a checkpoint that is intact (or move the bad ones away to "
            "start fresh)."
        )

    def _load_initial(self) -> None:
        path = self.config.initial_load_path
        if not path:
            return
        if not (Path(path) / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint.initial_load_path: {path!r} is not a DCP checkpoint folder "
                "(no .metadata file in it)"
            )
        keys = ["model"] if self.config.initial_load_model_only else self._keys_to_load()
        problem = checksums.verify(Path(path))
        if problem is None:
            try:
                self._load(Path(path), keys)
            except CorruptCheckpointError as e:
                problem = str(e)
        if problem is not None:
            raise CorruptCheckpointError(f"checkpoint.initial_load_path: {problem}")
        INITIAL_WEIGHTS_LOADED.emit(states=keys, path=str(path))

    def _keys_to_load(self) -> list[str]:
        """Every registered state but those in ``checkpoint.exclude_from_loading``."""
        unknown = [k for k in self.config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ConfigError(
                "checkpoint.exclude_from_loading",
                self.config.exclude_from_loading,
                f"{', '.join(map(repr, unknown))} is no state of this run; its states are: "
                f"{', '.join(self.states)}",
            )
        return [k for k in self.states if k not in self.config.exclude_from_loading]

    def _load(self, folder: Path, keys: list[str]) -> None:
        """Load ``keys`` of the registry from ``folder``; CheckpointError naming the cause, or
        CorruptCheckpointError (the problem line alone) when an item fails its checksum as it
        is read. Then the states may hold some of the checkpoint's verified values: the caller
        loads another checkpoint over them, heals, or stops."""
        advice = (
            f"Move it away to start fresh, or set checkpoint.load_step to another step in "
            f"{folder.parent}."
        )
        try:
            # DCP's own error for unreadable metadata is a wall of text about rank-local
            # fallbacks; this is the common case of a damaged checkpoint, so say it plainly.
            metadata = dcp.FileSystemReader(str(folder)).read_metadata()
        except Exception as e:
            raise CheckpointError(
                f"Checkpoint {folder} cannot be loaded: its .metadata file is unreadable "
                f"({_cause(e)}). {advice}"
            ) from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"Checkpoint {folder} cannot be loaded: its .metadata file holds a "
                f"{type(metadata).__name__}, not DCP metadata. {advice}"
            )
        if checksums.state(folder) == "legacy":
            CHECKPOINT_UNVERIFIED.emit(folder=str(folder))
        wanted: dict[str, Any] = {k: self.states[k] for k in keys}
        try:
            with _quiet_dcp() as held:
                dcp.load(wanted, checkpoint_id=str(folder), storage_reader=checksums.reader(folder))
        # DCP raises many types, and CheckpointException is not even an Exception: the user
        # needs the folder and the first cause.
        except (Exception, CheckpointException) as e:
            mismatch = _checksum_error(e)
            if mismatch is not None:
                raise CorruptCheckpointError(str(mismatch)) from e
            raise CheckpointError(
                f"Checkpoint {folder} cannot be loaded ({_cause(e)}). It is corrupt, or was "
                "written by a different model or config (a state missing from it can be "
                f"skipped with checkpoint.exclude_from_loading). {advice}"
            ) from e
        _release(held)
