"""How a group started by ``loopback_torchrun`` ends when one of its ranks stops: real torchrun,
two local ranks, the real trainer entry point (``torchtitan.train``) with a trainer that stops
at once. A rank that stopped on an error it printed ends the group with that line and its exit
status; a crash keeps torchrun's failure report and its traceback.

This module is also the custom args module those ranks load (``JobConfig``, ``TRAINER``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Which rank stops, and how: ``reported`` (a FaultToleranceError, the trainer's one-line
#: error path) or ``crash`` (an exception the trainer does not expect).
STOP = "LOOPBACK_TEST_STOP"
REFUSAL = "every replica group must run the same number of ranks (NGPU)"
BUG = "a bug nobody reported"


@dataclasses.dataclass
class JobConfig:
    """No sections of its own: this module only names the trainer."""


TRAINER = f"{__name__}:StoppingTrainer"


class StoppingTrainer:
    """Rank 1 stops as ``LOOPBACK_TEST_STOP`` says while it is built; rank 0 trains nothing."""

    def __init__(self, config: Any) -> None:
        if os.environ.get("RANK") == "1":
            if os.environ[STOP] == "reported":
                from torchtitan.components.ft import FaultToleranceError

                raise FaultToleranceError(REFUSAL)
            raise RuntimeError(BUG)

    def train(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_group(stop: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torchtitan.tools.loopback_torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "--role=rank",
        "--tee=3",
        "-m",
        "torchtitan.train",
        f"--job.custom_args_module={__name__}",
        f"--job.dump_folder={tmp_path}",
    ]
    env = {**os.environ, STOP: stop, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_rank_that_reports_its_error_ends_the_group_with_that_line(tmp_path):
    result = run_group("reported", tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert REFUSAL in out, out
    for noise in ("Traceback", "ChildFailedError", "Root Cause"):
        assert noise not in out, out


def test_a_rank_that_crashes_keeps_torchruns_report_and_traceback(tmp_path):
    result = run_group("crash", tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "Traceback" in out and f"RuntimeError: {BUG}" in out, out
    assert "Root Cause" in out, out
