"""Smoke run of ``python -m benchmarks.throughput --smoke``: a real trainer subprocess on the
smallest model for a few steps must write a JSON with every figure. The numbers are only checked for
sanity: CI machines are noisy."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_tests.fresh_interpreter import run_python
from torchtitan.trainer import TRAINING_STARTED

REPO = Path(__file__).resolve().parents[2]


def run_smoke(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> --smoke ARGS`` to its end; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{Path(script).stem}", "--smoke", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,  # seconds when idle; generous for a busy 2-core machine
    )
    assert result.returncode == 0, result.stdout
    return result


def test_throughput_smoke_writes_its_figures(tmp_path: Path) -> None:
    output = tmp_path / "throughput.json"
    result = run_smoke("throughput.py", "--output", str(output))
    assert "tokens/s:" in result.stdout and "MFU:" in result.stdout, result.stdout
    figures = json.loads(output.read_text())
    assert figures["mode"] == "smoke"
    assert figures["measured_steps"] == figures["steps"] - figures["warmup_steps"] > 0
    # The median of the measured steps lies between their slowest and fastest.
    low, high = figures["tokens_per_s_min"], figures["tokens_per_s_max"]
    assert 0 < low <= figures["tokens_per_s"] <= high
    # FLOPs per token as the model counts them at the run's sequence length (read back from
    # the trainer's step lines: a benchmark that read the wrong field or the wrong model fails).
    from torchtitan.models.llama3 import llama3_configs

    seq_len = int(next(a for a in figures["trainer_args"] if "seq_len" in a).split("=")[1])
    _, model_flops = llama3_configs["debugmodel_small"].num_flops_per_token(seq_len)
    assert figures["flops_per_token"] == pytest.approx(model_flops, rel=0.02)
    mfu = 100 * figures["tokens_per_s"] * figures["flops_per_token"] / figures["matmul_peak_flops"]
    assert figures["mfu_pct"] == pytest.approx(mfu) and 0 < mfu < 100
    assert 0 < figures["peak_rss_gib"] < 16
    assert figures["trainer_matmul_peak_flops"] > 1e8  # read from its train.started event
    benchmark = importlib.import_module("benchmarks.throughput")
    assert benchmark.TRAINING_STARTED == TRAINING_STARTED.name


def test_train_entry_lets_a_config_name_the_benchmark_flavors() -> None:
    """The memory benchmark's wide models (``benchmarks/train_entry.py``) pass the config's
    flavor check and build (in a subprocess: registering them changes this process's tables)."""
    code = (
        "from benchmarks import train_entry\n"
        "from torchtitan.config.manager import ConfigManager\n"
        "train_entry.register_flavors()\n"
        "for flavor in train_entry.BENCH_FLAVORS:\n"
        "    config = ConfigManager().parse_args([f'--model.flavor={flavor}'])\n"
        "    print(config.model.flavor)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["bench_1024x8", "bench_512x8"]


def test_checkpoint_checksums_smoke_compares_the_same_states(tmp_path: Path) -> None:
    """The states saved are the model and both AdamW moments (3x the parameter bytes), and
    the overhead reported is the checksummed time over the plain one of the same repeat."""
    output = tmp_path / "checkpoint_checksums.json"
    run_smoke("checkpoint_checksums.py", "--out", str(output))
    (size,) = json.loads(output.read_text())["sizes"]
    from torchtitan.models import get_train_spec

    spec = get_train_spec("llama3")
    params = sum(p.numel() for p in spec.model_cls(spec.model_args[size["flavor"]]).parameters())
    assert size["state_bytes"] == 3 * 4 * params
    (repeat,) = size["repeats"]
    for what in ("save", "load"):
        ratio = repeat[f"checksummed_{what}_s"] / repeat[f"plain_{what}_s"] - 1
        assert abs(size[what]["overhead"]["median"] - ratio) < 1e-12


def test_outer_step_smoke_times_this_code_and_a_baseline_in_one_run(tmp_path: Path) -> None:
    """Every version's figures from subprocesses of one run, each timing the code it names:
    this checkout's with its own threads and with one, and a baseline commit's (HEAD here)."""
    output = tmp_path / "outer_step.json"
    run_smoke("outer_step.py", "--json", str(output), "--baseline", "HEAD")
    figures = json.loads(output.read_text())
    versions = figures["versions"]
    assert set(versions) == {"this", "this_1_thread", "HEAD"}
    assert versions["this"]["runs"][0]["code"] == str(REPO)
    assert versions["HEAD"]["runs"][0]["code"] != str(REPO)  # a git archive of HEAD
    assert versions["this_1_thread"]["runs"][0]["outer_step_threads"] == 1
    for summary in versions.values():
        assert all(r > 0 for run in summary["runs"] for r in run["ratio"])
