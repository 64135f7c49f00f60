"""Helpers to run ``./run_train.sh`` as a user would, in a subprocess, for integration tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.integration_tests import warm_start
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.tools.events import EVENTS_FOLDER, read_events

REPO = Path(__file__).resolve().parents[2]
RUN_TRAIN = str(REPO / "run_train.sh")
# The lines a user reads when a run fails: ``error: ...`` (a bad command line or config) or a
# log line at level ERROR (torchrun may prefix it with ``[rankR]:``).
ERROR_LINE = re.compile(r"^(error: |\S+ ERROR )")

# The debug model's smallest flavor on short sequences: seconds per run, even on 2 busy cores.
SMALL = [
    "--model.flavor=debugmodel_small",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.disable_color_printing",
    "--metrics.cpu_peak_flops=-1",  # mfu n/a: skips the start-up matmul measurement
]

# Generous: CI runs these alone, but a shared 2-core machine can be ten times slower.
TIMEOUT_S = 600


def train_env(**extra: str) -> dict[str, str]:
    """The environment of a run: this interpreter, no inherited torchrun/rank variables; the
    trainer starts warm when the tests' zygote runs (``warm_start.py``)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHON"] = sys.executable
    env.update(extra)
    return warm_start.launch(env)


def run_train(
    args: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``./run_train.sh ARGS`` to completion; stdout and stderr together in ``.stdout``."""
    return subprocess.run(
        [RUN_TRAIN, *args],
        cwd=REPO,
        env=env or train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def error_lines(output: str) -> list[str]:
    """The error lines of a run's output (see ``ERROR_LINE``)."""
    return [line for line in output.splitlines() if ERROR_LINE.match(line)]


def step_losses(dump_folder: Path, since: float | None = None) -> dict[int, float]:
    """``{step: loss}`` of the ``train.step`` events of a run without fault tolerance (its
    starts at or after ``since``, a ``time.time()``: default all)."""
    events = read_events(dump_folder / EVENTS_FOLDER, TRAIN_STEP, since=since)
    return {event.step: event["loss"] for event in events if event.step is not None}
