"""``scripts/gpu_check.sh``, the prepared GPU check, on this CPU: without CUDA (or with ``--gpus
2`` and fewer GPUs) it stops at once and says so; ``GPU_CHECK_DRY_RUN=1`` runs its steps on the
CPU (tiny), for one GPU or two, and writes its JSON."""

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


def test_two_gpus_on_a_machine_with_one_stop_at_once_and_say_so(tmp_path: Path) -> None:
    """A Python that sees one CUDA device (a stand-in: the check asks it nothing else)."""
    one_gpu = tmp_path / "python"
    one_gpu.write_text("#!/bin/sh\necho 1\n")
    one_gpu.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k != "GPU_CHECK_DRY_RUN"},
           "PYTHON": str(one_gpu)}  # fmt: skip
    done = subprocess.run([str(SCRIPT), "--gpus", "2", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("gpu_check: --gpus 2 needs 2 CUDA devices; torch sees 1"), (
        done.stdout
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with fewer GPUs")
def test_gpu_check_py_refuses_two_gpus_it_does_not_see(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "out"),
         "--gpus", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "--gpus 2 needs 2 CUDA devices" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_dry_run_on_the_cpu_runs_every_step_and_writes_its_json(tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=400,
        env={**os.environ, "GPU_CHECK_DRY_RUN": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 345  # the wrapper's hard limit
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["gpus"] == 1 and "terminated" not in report
    tests = report["cuda_tests"]
    # Only the tests that need CUDA, which skip here (pytest exits 0 when all skip); the whole
    # files' tests that need no CUDA pass.
    assert tests["exit"] == 0 and tests["failed"] == 0 and tests["error"] == 0
    assert tests["skipped"] >= 20 and tests["not_there"] == []
    # Skipped without CUDA: they wrote no figures, and the JSON says each one skipped.
    assert tests["sync_wait"] is None and tests["nccl_semantics"] is None
    shown, not_here = report["covers"]["one_gpu"], report["covers"]["needs_two_gpus"]
    assert {"nccl_abort_path", "exchange_after_arrival", "probe_beside_training",
            "versions_and_modes", "sync_wait"} <= set(shown)  # fmt: skip
    for name, entry in shown.items():
        assert entry["outcome"].startswith("skipped: needs CUDA and nccl"), (name, entry)
        assert entry["test"] in tests["outcomes"], name
    assert "kill_over_nccl" in not_here
    assert not_here["kill_over_nccl"]["check"] == "scripts/gpu_check.sh --gpus 2"
    assert "two_groups_nccl" not in report.get("not_run", {})
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


@pytest.mark.slow
def test_a_two_gpu_dry_run_kills_a_group_and_the_survivor_syncs_on(tmp_path: Path) -> None:
    """``--gpus 2``'s steps on the CPU: gloo and the tiny model in place of nccl and a GPU per
    group."""
    started = time.monotonic()
    done = subprocess.run(
        [str(SCRIPT), "--gpus", "2", str(tmp_path)], capture_output=True, text=True,
        timeout=400, env={**os.environ, "GPU_CHECK_DRY_RUN": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 345  # the wrapper's hard limit
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["gpus"] == 2 and "terminated" not in report
    assert "cuda_tests" not in report and report["throughput"] == []
    killed, int8 = report["two_groups"]
    assert killed["name"] == "two_groups_nccl_diloco_kill" and killed["backend"] == "gloo"
    assert killed["exit"] == 0, killed
    verdict = killed["kill"]
    assert verdict["group_1_killed_at_step"] >= 4 and verdict["group_1_restarts"] == 1, verdict
    assert verdict["survivor_syncs_after_the_kill"]["committed"] > 0, verdict
    assert verdict["survivor_kept_running"] and verdict["final_digests_equal"], verdict
    # Whether the restarted group came back before group 0 ended (and healed) depends on how
    # fast this machine starts a process: only that it is said.
    assert isinstance(verdict["restarted_group_healed"], bool)
    assert int8["name"] == "two_groups_nccl_async_int8"
    assert int8["exit"] == 0 and int8["groups_agree"] and int8["syncs_committed"] > 0, int8
    shown = report["covers"]["two_gpus"]
    assert set(shown) == {"kill_over_nccl", "heal_over_nccl", "compressed_transfers_over_nccl"}
    assert shown["kill_over_nccl"]["verdict"]["note"].startswith("dry run")
    assert shown["kill_over_nccl"]["verdict"]["survivor_kept_running"] is True
    assert shown["heal_over_nccl"]["verdict"]["heals"] == killed["heals"]
    assert shown["compressed_transfers_over_nccl"]["verdict"]["exit"] == 0


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
    assert all(entry["outcome"] == "not run" for entry in report["covers"]["one_gpu"].values())


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("dry", [False, True])
def test_the_runs_timeouts_add_up_to_less_than_the_budget(dry: bool, gpus: int) -> None:
    """Every run fits even when each one runs to its limit: the default budget (295 s) less
    the start-up (torch's import, the matmul rate) and the budget's margin."""
    gpu_check = _load_gpu_check()
    listed = gpu_check.runs(dry, gpus)
    if gpus == 1:
        assert [kind for kind, _ in listed][:2] == ["cuda_tests", "outer_step"]
    else:  # the kill over nccl first; each group on a GPU of its own
        assert [spec["name"] for _, spec in listed][0] == "two_groups_nccl_diloco_kill"
        assert all(spec["backend"] == ("gloo" if dry else "nccl") for _, spec in listed)
        assert all(("--gpus-per-group" in spec["launcher_args"]) != dry for _, spec in listed)
    assert sum(spec["timeout_s"] for _, spec in listed) <= 295 - 15
    assert gpu_check.parse_args(["--out", "x"]).budget_s == 295


def test_the_nccl_semantics_tests_run_whole_and_last_with_their_figures() -> None:
    """Last: their last test aborts a communicator. Every test ``covers`` names exists."""
    _load_gpu_check()
    import gpu_check_runs as runs

    assert runs.CUDA_TESTS[-1] == runs.NCCL_SEMANTICS and runs.NCCL_SEMANTICS in runs.WHOLE_FILES
    assert runs.TEST_FIGURES["nccl_semantics"] == "nccl_semantics.json"
    for test, _ in runs.ONE_GPU_COVERS.values():
        path, name = test.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), test
    assert set(runs.TWO_GPU_COVERS) == set(runs.NEEDS_TWO_GPUS)
    two_gpu_runs = {spec["name"] for _, spec in runs.runs(False, 2)}
    assert {run for run, _ in runs.TWO_GPU_COVERS.values()} <= two_gpu_runs


def test_the_outcomes_of_the_cuda_tests_are_read_from_junit(tmp_path: Path) -> None:
    gpu_check = _load_gpu_check()
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.unit_tests.test_a" name="test_ok" time="0.1"/>'
        '<testcase classname="tests.unit_tests.test_a" name="test_skip" time="0">'
        '<skipped type="pytest.skip" message="needs CUDA and nccl">x</skipped></testcase>'
        '<testcase classname="tests.unit_tests.test_b" name="test_bad[1]" time="0">'
        '<failure message="AssertionError: assert 1 == 2">trace</failure></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.test_outcomes(junit) == {
        "tests/unit_tests/test_a.py::test_ok": "passed",
        "tests/unit_tests/test_a.py::test_skip": "skipped: needs CUDA and nccl",
        "tests/unit_tests/test_b.py::test_bad[1]": "failed: AssertionError: assert 1 == 2",
    }
    assert gpu_check.test_outcomes(tmp_path / "missing.xml") == {}


def test_a_kill_is_judged_from_the_groups_events(tmp_path: Path) -> None:
    """Group 1 killed after step 10 and restarted (a new pid); group 0 commits a sync after."""
    gpu_check = _load_gpu_check()
    lines = [
        {"event": "train.step", "time": 1.0, "replica": 1, "pid": 11, "step": 9},
        {"event": "train.step", "time": 2.0, "replica": 1, "pid": 11, "step": 10},
        {"event": "semi_sync.sync", "time": 1.5, "replica": 0, "pid": 10, "sync": 2,
         "fields": {"committed": True}},
        {"event": "semi_sync.sync", "time": 3.0, "replica": 0, "pid": 10, "sync": 3,
         "fields": {"committed": False}},
        {"event": "train.step", "time": 6.0, "replica": 1, "pid": 12, "step": 15},
        {"event": "semi_sync.sync", "time": 7.0, "replica": 0, "pid": 10, "sync": 4,
         "fields": {"committed": True}},
    ]  # fmt: skip
    folder = tmp_path / "events"
    folder.mkdir()
    (folder / "all.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = {"exit": 0, "final_digests": {0: "ab", 1: "ab"}, "groups_agree": True,
           "heals": [{"replica": 1, "sync": 4}]}  # fmt: skip
    assert gpu_check.kill_verdict(row, tmp_path) == {
        "group_1_killed_at_step": 10,
        "group_1_restarts": 1,
        "survivor_syncs_after_the_kill": {"committed": 1, "not_committed": 1},
        "survivor_kept_running": True,
        "restarted_group_healed": True,
        "final_digests_equal": True,
    }
    assert not gpu_check.kill_verdict({**row, "exit": 1}, tmp_path)["survivor_kept_running"]


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
