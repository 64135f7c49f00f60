"""``scripts/gpu_check.sh``, the prepared GPU check, on this CPU: without CUDA it stops at once
and says so; ``GPU_CHECK_DRY_RUN=1`` runs its steps on the CPU (tiny) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.integration_tests.train_runs import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_stops_at_once_and_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_DRY_RUN"}
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("gpu_check: no CUDA device here"), done.stdout
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
def test_a_dry_run_on_the_cpu_runs_every_step_and_writes_its_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=400,
        env={**os.environ, "GPU_CHECK_DRY_RUN": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    tests = report["cuda_tests"]
    # Only the tests that need CUDA, which skip here (pytest exits 0 when all skip).
    assert tests["exit"] == 0 and tests["failed"] == 0 and tests["passed"] == 0
    assert tests["skipped"] >= 15
    (eager,) = report["throughput"]
    assert eager["exit"] == 0 and eager["tokens_per_s"] > 0 and eager["parameters"] > 0
    for run in report["two_groups"]:
        assert run["exit"] == 0 and run["groups_agree"], run
        assert set(run["peak_memory_gib"]) == {"0", "1"}
    assert [r["outer_state_device"] for r in report["two_groups"]] == ["cpu"]
