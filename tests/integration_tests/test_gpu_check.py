"""``scripts/gpu_check.sh``, the prepared GPU check, on this CPU: without CUDA it stops at once
and says so; ``GPU_CHECK_DRY_RUN=1`` runs its steps on the CPU (tiny) and writes its JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration_tests.train_runs import REPO
from torchtitan.tools.cluster.process_tree import kill_tree, process_state, process_tree

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
    async_int8, diloco_heal = report["two_groups"]
    assert async_int8["name"] == "two_groups_async_int8"
    assert async_int8["exit"] == 0 and async_int8["groups_agree"], async_int8
    assert set(async_int8["peak_memory_gib"]) == {"0", "1"}
    assert async_int8["syncs_committed"] > 0
    # Group 1 is killed and restarted; whether it comes back before group 0 ends (and heals)
    # depends on how fast this machine starts a process, so only the run itself is checked.
    assert diloco_heal["name"] == "two_groups_diloco_heal"
    assert diloco_heal["exit"] == 0 and set(diloco_heal["final_digests"]) == {"0", "1"}
    assert isinstance(diloco_heal["heals"], list)


def test_a_spent_budget_skips_the_runs_and_still_writes_the_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path),
         "--dry-run", "--budget-s", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["commit"] and "seconds" in report
    skipped = [report["cuda_tests"], *report["two_groups"], *report["throughput"]]
    assert len(skipped) == 4
    assert all(row["exit"] == "skipped: budget spent" for row in skipped), skipped


@pytest.mark.slow
def test_sigterm_stops_the_run_in_progress_and_its_processes_and_keeps_the_json(
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path),
         "--dry-run"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # The first two-group run: a launcher with a lighthouse and two groups under it.
        deadline = time.monotonic() + 120
        while len(process_tree(proc.pid)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.2)
        tree = process_tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["terminated"].startswith("SIGTERM during two_groups_async_int8"), report
    assert report["cuda_tests"]["exit"] == 0 and report["two_groups"] == []
    time.sleep(1)
    alive = [pid for pid in tree if process_state(pid) not in ("", "Z")]
    assert alive == [], f"left running: {alive}"
