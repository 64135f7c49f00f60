"""Throughput cost of fault tolerance: 2 replica groups, each pinned to its own core.

    .venv/bin/python -m benchmarks.ft_overhead            # the README's figures (~15 min)
    .venv/bin/python -m benchmarks.ft_overhead --smoke    # seconds; checks the plumbing only

Methods, each with 2 groups of 1 process (``taskset -c 0`` and ``-c 1``, OMP_NUM_THREADS=1):

* ``no_ft``: two independent trainers (no lighthouse, no torchft), pinned the same way;
* ``sync_ft``: synchronous fault-tolerant data parallel (gradients all-reduced every step);
* ``localsgd``, ``diloco``: sync every ``--sync-steps`` (H) inner steps;
* ``streaming_diloco``: DiLoCo with 2 fragments, one syncing every H/2 steps, overlapped with
  1 inner step (``fragment_sync_delay=1``).

Tokens/s per group is taken from the trainers' own step events over the steps after the first
sync period (``--warmup-steps``), as total tokens over total time, so sync steps count with
their real duration. Each repeat runs every method once (in rotated order); the ratio to
``no_ft`` is taken within each repeat, and the JSON reports medians over repeats.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks import ft_common as common
from benchmarks import provenance
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import SYNC

ORDER = ["no_ft", "sync_ft", "localsgd", "diloco", "streaming_diloco"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (CI)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=20, help="steps left out of tokens/s")
    p.add_argument("--sync-steps", type=int, default=20, help="H of LocalSGD and DiLoCo")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--methods", nargs="+", default=ORDER, choices=ORDER)
    p.add_argument("--max-load", type=float, default=1.5,
                   help="before each run wait (<= 2 min) for load below this")  # fmt: skip
    p.add_argument("--out", type=Path, help=provenance.output_help("ft_overhead.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.warmup_steps, args.sync_steps = 1, 8, 4, 4
        args.flavor, args.seq_len, args.batch = "debugmodel_small", 32, 2
        args.max_load = float("inf")
    if "no_ft" not in args.methods:
        args.methods = ["no_ft", *args.methods]
    args.out = args.out or provenance.default_output("ft_overhead.json", args.smoke)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train_args = [
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--training.steps={args.steps}",
        "--metrics.log_freq=10" if not args.smoke else "--metrics.log_freq=2",
        "--validation.enable=false",
        "--metrics.cpu_peak_flops=-1",
    ]
    semi = [f"--fault_tolerance.sync_steps={args.sync_steps}"]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ft_overhead_") as tmp:
        for repeat in range(args.repeats):
            methods = args.methods[repeat % len(args.methods) :]
            methods += args.methods[: repeat % len(args.methods)]
            for method in methods:
                load = common.wait_for_quiet_machine(args.max_load, 120)
                procs = common.run_method(
                    Path(tmp) / f"r{repeat}" / method, method, train_args, semi_sync_args=semi
                )
                groups = []
                for proc in procs:
                    events = common.trainer_events(proc, TRAIN_STEP, SYNC)
                    groups.append(
                        {
                            "tokens_per_s": common.interval_tokens_per_second(
                                common.step_rows(events), args.warmup_steps
                            ),
                            "max_rss_mib": proc.max_rss_mib,
                            "sync_ms": common.sync_times_ms(events),
                        }
                    )
                tps = [g["tokens_per_s"] for g in groups]
                runs.append(
                    {
                        "repeat": repeat,
                        "method": method,
                        "load_avg_1min_before": round(load, 2),
                        "tokens_per_s_per_group": sum(tps) / len(tps),
                        "groups": groups,
                    }
                )
                print(
                    f"[ft_overhead] repeat {repeat} {method:17s} tokens/s per group "
                    f"{sum(tps) / len(tps):8.1f}  (load {load:.2f})",
                    flush=True,
                )
    summary = summarize(runs, args.methods)
    result = {
        "benchmark": "ft_overhead",
        "settings": {
            "groups": 2,
            "pinning": "group i on core i (taskset -c i), OMP_NUM_THREADS=1",
            "flavor": args.flavor,
            "seq_len": args.seq_len,
            "local_batch_size": args.batch,
            "steps": args.steps,
            "measured_steps": f"{args.warmup_steps + 1}..{args.steps}",
            "sync_steps_H": args.sync_steps,
            "streaming": "2 fragments, fragment_sync_delay=1",
            "repeats": args.repeats,
        },
        "summary": summary,
        # Tokens/s between processes moves with the machine's speed: reported, not judged.
        "target": None,
        "runs": runs,
    }
    path = provenance.write_result(args.out, result, provenance.command_line(__file__, argv))
    for method, row in summary.items():
        print(
            f"[ft_overhead] {method:17s} median tokens/s per group {row['tokens_per_s']:8.1f}"
            f"  ratio to no_ft {row['ratio_to_no_ft']:.3f}"
        )
    print(f"[ft_overhead] wrote {path}")
    return 0


def summarize(runs: list[dict], methods: list[str]) -> dict[str, dict]:
    baseline = {r["repeat"]: r["tokens_per_s_per_group"] for r in runs if r["method"] == "no_ft"}
    summary = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        ratios = [r["tokens_per_s_per_group"] / baseline[r["repeat"]] for r in mine]
        syncs = [ms for r in mine for g in r["groups"] for ms in g["sync_ms"]]
        summary[method] = {
            "tokens_per_s": round(common.median([r["tokens_per_s_per_group"] for r in mine]), 1),
            "ratio_to_no_ft": round(common.median(ratios), 4),
            "ratios_per_repeat": [round(x, 4) for x in ratios],
            "median_sync_ms": common.median(syncs) if syncs else None,
        }
    return summary


if __name__ == "__main__":
    common.stop_cleanly_on_sigterm()
    sys.exit(main())
