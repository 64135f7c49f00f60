"""Training throughput of the debug model on CPU: tokens/s, peak memory, matmul peak and MFU.

    .venv/bin/python -m benchmarks.throughput               # 40 steps of the debug TOML (~1 min)
    .venv/bin/python -m benchmarks.throughput --steps 100
    .venv/bin/python -m benchmarks.throughput --smoke       # seconds; checks the plumbing only

The trainer runs as a user runs it (``python -m torchtitan.train`` with
``torchtitan/models/llama3/train_configs/debug_model.toml``: Llama 3 ``debugmodel``, sequences
of 256, batches of 8) on CPU in a subprocess, without validation or checkpoints, logging every
step. Its per-step figures come from ``<dump_folder>/metrics.jsonl`` (and the peak it measured
at start-up from its ``train.started`` event):

* ``tokens_per_s``: median over the steps after ``--warmup`` (the first steps pay for thread
  pools, allocator growth and the data pipeline's start);
* ``peak_rss_gib``: the trainer process's peak resident set (``ru_maxrss``);
* ``matmul_peak_flops``: float32 ``torch.mm`` peak of this machine, measured here before the
  run over a longer window than the trainer's start-up measurement (see
  ``torchtitan.components.metrics.measure_matmul_peak_flops``);
* ``mfu_pct``: median tokens/s x model FLOPs per token / that peak. The trainer's own figure
  (``trainer_mfu_pct``, against the peak it measured at start-up) is reported next to it.

The result is printed and written as JSON (default ``benchmarks/results/throughput.json``; a
smoke run's goes to a temporary folder), with the machine and commit it was measured on.
On a machine shared with other jobs every figure is noisy; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import provenance
from torchtitan.components.metrics import (
    cpu_threads,
    measure_matmul_peak_flops,
    read_metrics,
)
from torchtitan.tools.events import EVENTS_FOLDER, read_events

REPO = Path(__file__).resolve().parents[1]

DEBUG_TOML = REPO / "torchtitan/models/llama3/train_configs/debug_model.toml"
# The name of torchtitan.trainer.TRAINING_STARTED (its test checks that they agree): importing
# the trainer module here would cost seconds, and the trainer runs in a subprocess.
TRAINING_STARTED = "train.started"

# Smoke mode: the smallest flavor on short sequences, a handful of steps.
SMOKE_ARGS = [
    "--model.flavor=debugmodel_small",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
]


def run_trainer(args: list[str], dump: Path, timeout: float) -> float:
    """Run the trainer to completion; returns its wall seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [
        sys.executable,
        "-m",
        "torchtitan.train",
        f"--job.config_file={DEBUG_TOML}",
        f"--job.dump_folder={dump}",
        "--training.device=cpu",
        "--validation.enable=false",
        "--checkpoint.enable=false",
        "--metrics.log_freq=1",
        "--metrics.disable_color_printing",
        *args,
    ]
    start = time.perf_counter()
    result = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.stderr.write(result.stdout)
        raise SystemExit(f"the trainer failed (exit status {result.returncode}); output above")
    return wall


def summarize(
    steps: dict[int, dict[str, Any]], warmup: int, peak_flops: float
) -> dict[str, float | int]:
    """The benchmark's figures from the trainer's per-step metrics."""
    measured = [steps[s] for s in sorted(steps) if s > warmup and "train/tps" in steps[s]]
    if not measured:
        raise SystemExit(f"no step after the {warmup} warm-up steps: raise --steps")
    tps = statistics.median(r["train/tps"] for r in measured)
    # tflops = tps * FLOPs per token / 1e12 on every line: the model's FLOPs per token.
    flops_per_token = measured[0]["train/tflops"] * 1e12 / measured[0]["train/tps"]
    summary: dict[str, float | int] = {
        "measured_steps": len(measured),
        "tokens_per_s": tps,
        "tokens_per_s_min": min(r["train/tps"] for r in measured),
        "tokens_per_s_max": max(r["train/tps"] for r in measured),
        "flops_per_token": flops_per_token,
        "achieved_tflops": tps * flops_per_token / 1e12,
        "peak_rss_gib": max(r["train/memory_gib"] for r in steps.values()),
        "matmul_peak_flops": peak_flops,
        "mfu_pct": 100 * tps * flops_per_token / peak_flops,
        "first_loss": steps[min(steps)]["train/loss"],
        "last_loss": steps[max(steps)]["train/loss"],
    }
    trainer_mfu = [r["train/mfu_pct"] for r in measured if "train/mfu_pct" in r]
    if trainer_mfu:
        summary["trainer_mfu_pct"] = statistics.median(trainer_mfu)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps to run")
    parser.add_argument(
        "--warmup", type=int, default=None, help="first steps left out (default 5; smoke 2)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps: seconds")
    parser.add_argument(
        "--peak-seconds",
        type=float,
        default=None,
        help="window of the matmul peak measurement (default 2; smoke 0.2)",
    )
    parser.add_argument(
        "--output", type=Path, help="result JSON; " + provenance.output_help("throughput.json")
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds before the trainer is given up"
    )
    parser.add_argument("trainer_args", nargs="*", help="extra --section.field=value flags")
    opts = parser.parse_args(argv)
    result_path = opts.output or provenance.default_output("throughput.json", opts.smoke)
    steps = 6 if opts.smoke and opts.steps == 40 else opts.steps
    warmup = opts.warmup if opts.warmup is not None else (2 if opts.smoke else 5)
    window = opts.peak_seconds if opts.peak_seconds is not None else (0.2 if opts.smoke else 2.0)
    if steps <= warmup:
        parser.error(f"--steps ({steps}) must be larger than --warmup ({warmup})")

    peak = measure_matmul_peak_flops(torch.device("cpu"), seconds=window)
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s float32 ({cpu_threads()} threads)", flush=True)

    args = [f"--training.steps={steps}", *(SMOKE_ARGS if opts.smoke else []), *opts.trainer_args]
    with tempfile.TemporaryDirectory(prefix="throughput_") as dump:
        wall = run_trainer(args, Path(dump), opts.timeout)
        per_step = read_metrics(Path(dump) / "metrics.jsonl")
        started = read_events(Path(dump) / EVENTS_FOLDER, TRAINING_STARTED)
    summary = summarize(per_step, warmup, peak)
    result = {
        "benchmark": "throughput",
        "mode": "smoke" if opts.smoke else "full",
        "config": str(DEBUG_TOML.relative_to(REPO)),
        "trainer_args": args,
        "steps": steps,
        "warmup_steps": warmup,
        "wall_s": wall,
        **summary,
        "trainer_matmul_peak_flops": started[0]["peak_flops"] if started else None,
        "threads": cpu_threads(),
    }
    print(
        f"tokens/s: {summary['tokens_per_s']:,.0f} (median of {summary['measured_steps']} steps;"
        f" min {summary['tokens_per_s_min']:,.0f}, max {summary['tokens_per_s_max']:,.0f})\n"
        f"peak RSS: {summary['peak_rss_gib']:.2f} GiB\n"
        f"MFU: {summary['mfu_pct']:.1f}% of {peak / 1e9:.1f} GFLOP/s "
        f"({summary['achieved_tflops'] * 1e3:.1f} GFLOP/s achieved; the trainer's own figure: "
        f"{summary.get('trainer_mfu_pct', float('nan')):.1f}%)\n"
        f"loss: {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} in {steps} steps, "
        f"{wall:.1f}s wall",
        flush=True,
    )
    provenance.write_result(result_path, result, provenance.command_line(__file__, argv))
    print(f"wrote {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
