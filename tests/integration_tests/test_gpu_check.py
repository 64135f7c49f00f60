"""``scripts/gpu_check.sh``, the prepared GPU check, on this CPU: without CUDA it stops at once
and says so; ``GPU_CHECK_DRY_RUN=1`` runs its steps on the CPU (tiny) and writes its JSON."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
    started = time.monotonic()
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=400,
        env={**os.environ, "GPU_CHECK_DRY_RUN": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 330  # the wrapper's hard limit
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and "terminated" not in report
    tests = report["cuda_tests"]
    # Only the tests that need CUDA, which skip here (pytest exits 0 when all skip); the whole
    # files' tests that need no CUDA pass.
    assert tests["exit"] == 0 and tests["failed"] == 0 and tests["error"] == 0
    assert tests["skipped"] >= 15 and tests["not_there"] == []
    assert tests["sync_wait"] is None  # skipped without CUDA: it wrote no figures
    outer = report["outer_step"]
    assert outer["exit"] == 0, outer
    assert outer["host_s"] > 0 and outer["memcpy_s"] > 0 and outer["rss_bytes"] > 0, outer
    (eager,) = report["throughput"]
    assert eager["exit"] == 0 and eager["tokens_per_s"] > 0 and eager["parameters"] > 0
    compiled, diloco_heal = report["two_groups"]
    assert compiled["name"] == "two_groups_async_int8_bf16_compile"
    assert compiled["exit"] == 0 and compiled["groups_agree"] and compiled["ran"], compiled
    assert compiled["compiled_blocks_per_process"] == [2, 2]
    assert set(compiled["peak_memory_gib"]) == {"0", "1"}
    assert compiled["syncs_committed"] > 0
    assert all(rate > 0 for rate in compiled["steps_per_s"].values()), compiled
    # Group 1 is killed and restarted; whether it comes back before group 0 ends (and heals)
    # depends on how fast this machine starts a process, so only the run itself is checked.
    assert diloco_heal["name"] == "two_groups_diloco_heal"
    assert diloco_heal["exit"] == 0 and set(diloco_heal["final_digests"]) == {"0", "1"}
    assert isinstance(diloco_heal["heals"], list)
    assert diloco_heal["heal_cuda_over_gloo"].startswith("not checked")


def test_a_spent_budget_skips_the_runs_and_still_writes_the_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path),
         "--dry-run", "--budget-s", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["commit"] and "seconds" in report
    skipped = [report["cuda_tests"], report["outer_step"], *report["two_groups"],
               *report["throughput"]]  # fmt: skip
    assert len(skipped) == 5
    assert all(row["exit"] == "skipped: budget spent" for row in skipped), skipped


@pytest.mark.parametrize("dry", [False, True])
def test_the_runs_timeouts_add_up_to_less_than_the_budget(dry: bool) -> None:
    """Every run fits even when each one runs to its limit: the default budget (280 s) less
    the start-up (torch's import, the matmul rate) and the budget's margin."""
    gpu_check = _load_gpu_check()
    listed = gpu_check.runs(dry)
    assert [kind for kind, _ in listed][:2] == ["cuda_tests", "outer_step"]
    assert sum(spec["timeout_s"] for _, spec in listed) <= 280 - 15
    assert gpu_check.parse_args(["--out", "x"]).budget_s == 280


def test_a_heal_that_gloo_cannot_carry_is_said_so_not_failed(tmp_path: Path) -> None:
    gpu_check = _load_gpu_check()
    log = tmp_path / "heal.log"
    log.write_text(
        "[group 1] INFO starting\n"
        "[group 1] ERROR heal failed: RuntimeError: [gloo/transport/tcp/pair.cc:534] writev "
        "[127.0.0.1]:41234: Bad address\n"
    )
    row = {"heals": [], "exit": "timeout"}
    verdict = gpu_check.heal_verdict(row, log, dry=False)
    assert verdict["heal_cuda_over_gloo"] == "unsupported"
    assert "Bad address" in verdict["why"]
    assert gpu_check.heal_verdict({**row, "heals": [{"replica": 1}]}, log, dry=False) == {
        "heal_cuda_over_gloo": "healed"
    }
    log.write_text("[group 1] INFO process_group=gloo on cuda:0\n")  # no error: no verdict
    assert gpu_check.heal_verdict(row, log, dry=False)["heal_cuda_over_gloo"] == "failed"
    assert gpu_check.heal_verdict({**row, "exit": 0}, log, dry=False)[
        "heal_cuda_over_gloo"
    ].startswith("not exercised")


def test_the_outer_step_figures_are_found_at_the_top_or_in_its_summary() -> None:
    gpu_check = _load_gpu_check()
    top = {"host_s": 1.5, "pinned_bytes": 10}
    assert gpu_check.outer_step_figure(top, "host_s") == 1.5
    runs = [{"ratio": [3.0, 5.0]}, {"ratio": [4.0]}]
    nested = {"versions": {"this": {"host_s_median": 2.0, "rss_bytes_max": 7, "runs": runs}}}
    assert gpu_check.outer_step_figure(nested, "host_s") == 2.0
    assert gpu_check.outer_step_figure(nested, "rss_bytes") == 7
    assert gpu_check.outer_step_figure(nested, "ratio") == 4.0
    assert gpu_check.outer_step_figure(nested, "pinned_bytes") is None


def _load_gpu_check() -> Any:
    """``scripts/gpu_check.py`` as a module (its runs come from ``scripts/gpu_check_runs.py``
    beside it)."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module("gpu_check")


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
    assert report["terminated"].startswith("SIGTERM during two_groups_async_int8_bf16_compile")
    assert report["cuda_tests"]["exit"] == 0 and report["outer_step"]["exit"] == 0
    assert report["two_groups"] == []
    time.sleep(1)
    alive = [pid for pid in tree if process_state(pid) not in ("", "Z")]
    assert alive == [], f"left running: {alive}"
