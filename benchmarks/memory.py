"""Peak resident memory of DiLoCo (and the other methods) against training without FT.

    .venv/bin/python -m benchmarks.memory            # the README's figures (~8 min)
    .venv/bin/python -m benchmarks.memory --smoke    # seconds; checks the plumbing only

The model is ``bench_1024x8`` (``benchmarks/train_entry.py``: dim 1024, 8 layers, 16 heads,
8 kv heads, byte vocabulary; 94.9M parameters, 380 MB in fp32) with sequences of 64 tokens and
batches of 2, so parameters, gradients and AdamW state (4 x 380 MB) dominate the resident set
and activations are small. Each method runs 2 groups (one process each, one thread each);
the figure per method is the median over groups and repeats of each process's peak resident
set (``wait4``'s ``ru_maxrss``).

DiLoCo keeps a global copy of the parameters and the outer optimizer's momentum: 2 x parameter
bytes is its floor. Each semi-sync method also says what it held beside the model, by kind
(the ``semi_sync.outer_state`` event: global copy, async DiLoCo's period start, momentum, and
the buffers a sync holds while it runs), reported over the parameter bytes as
``outer_state_over_param_bytes``. ``extra / param_bytes`` is reported against ``no_ft`` (the
target) and against ``sync_ft`` (which removes torchft's fixed cost: manager, process group,
threads). A smaller model (``bench_512x8``, 25.4M parameters) is run for no-FT and DiLoCo as
well: the slope of the extra between the two sizes separates the per-parameter cost from fixed
costs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks import ft_common as common
from benchmarks import provenance
from benchmarks.train_entry import BENCH_FLAVORS
from torchtitan.experiments.fault_tolerance.events import OUTER_STATE, OUTER_STATE_KINDS

# method name -> (base method of ft_common.METHODS, extra semi-sync flags)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "no_ft": ("no_ft", []),
    "sync_ft": ("sync_ft", []),
    "localsgd": ("localsgd", ["--fault_tolerance.sync_steps=4"]),
    # The method's own state only: the heal history is measured apart (below).
    "diloco": (
        "diloco",
        ["--fault_tolerance.sync_steps=4", "--fault_tolerance.heal_history_syncs=0"],
    ),
    # The heal history's cost: the last K averages in CPU memory, as they travelled (fp32: K x
    # parameter bytes; int4: about K x 0.13 x parameter bytes). Syncs are more frequent here so
    # that the 8 steps fill it.
    "diloco_sync_every_2": (
        "diloco",
        ["--fault_tolerance.sync_steps=2", "--fault_tolerance.heal_history_syncs=0"],
    ),
    "diloco_heal_history_3": (
        "diloco",
        ["--fault_tolerance.sync_steps=2", "--fault_tolerance.heal_history_syncs=3"],
    ),
    "diloco_int4": (
        "diloco",
        [
            "--fault_tolerance.sync_steps=1",
            "--fault_tolerance.pseudo_grad_dtype=int4",
            "--fault_tolerance.heal_history_syncs=0",
        ],
    ),
    "diloco_int4_heal_history_8": (
        "diloco",
        [
            "--fault_tolerance.sync_steps=1",
            "--fault_tolerance.pseudo_grad_dtype=int4",
            "--fault_tolerance.heal_history_syncs=8",
        ],
    ),
    "streaming_diloco_2_fragments": (
        "streaming_diloco",
        # 2 fragments, delay 1 (ft_common.METHODS); no heal history, as for diloco
        ["--fault_tolerance.sync_steps=4", "--fault_tolerance.heal_history_syncs=0"],
    ),
    "streaming_diloco_4_fragments": (
        "diloco",
        [
            "--fault_tolerance.sync_steps=8",
            "--fault_tolerance.num_fragments=4",
            "--fault_tolerance.fragment_sync_delay=1",
            "--fault_tolerance.heal_history_syncs=0",
        ],
    ),
    # Global copy, outer momentum, the start of the local period and the all-reduce buffer in
    # flight: 4 x parameter bytes, on the CPU whatever outer_state_device says (no GPU here).
    "async_diloco": (
        "async_diloco",
        ["--fault_tolerance.sync_steps=4", "--fault_tolerance.heal_history_syncs=0"],
    ),
}
SLOPE_VARIANTS = ["no_ft", "diloco"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (CI)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--flavor", default="bench_1024x8")
    p.add_argument("--small-flavor", default="bench_512x8", help="second size, for the slope")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--out", type=Path, help=provenance.output_help("memory.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.seq_len = 1, 4, 32
        args.flavor, args.small_flavor = "debugmodel_small", None
        args.variants = ["no_ft", "diloco"]
        args.max_load = float("inf")
    for needed in ("no_ft", "diloco"):
        if needed not in args.variants:
            args.variants.insert(0, needed)
    args.out = args.out or provenance.default_output("memory.json", args.smoke)
    return args


def param_count(flavor: str) -> int:
    from torchtitan.models.llama3 import llama3_configs

    args = BENCH_FLAVORS.get(flavor) or llama3_configs[flavor]
    return args.num_params()


def measure(
    tmp: Path, flavor: str, variants: list[str], args: argparse.Namespace
) -> tuple[list[dict], dict[str, float]]:
    train_args = [
        f"--model.flavor={flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--training.steps={args.steps}",
        "--metrics.log_freq=1",
        "--validation.enable=false",
        "--metrics.cpu_peak_flops=-1",
        "--lr_scheduler.warmup_steps=2",
    ]
    runs = []
    for repeat in range(args.repeats):
        for name in variants:
            base, semi = VARIANTS[name]
            load = common.wait_for_quiet_machine(args.max_load, 120)
            procs = common.run_method(
                tmp / flavor / f"r{repeat}" / name, base, train_args, semi_sync_args=semi
            )
            rss = [p.max_rss_mib for p in procs]
            run = {
                "flavor": flavor,
                "variant": name,
                "repeat": repeat,
                "load_avg_1min_before": round(load, 2),
                "max_rss_mib_per_group": rss,
            }
            held = [common.trainer_events(p, OUTER_STATE) for p in procs]
            if all(held):  # a semi-sync method: what it says it held, by kind (rank 0)
                run["outer_state_mib_per_group"] = [
                    {
                        k: e[-1][f"{k}_mib"]
                        for k in OUTER_STATE_KINDS
                        if e[-1][f"{k}_mib"] is not None
                    }
                    for e in held
                ]
            runs.append(run)
            print(f"[memory] {flavor} {name:30s} peak RSS MiB {rss}", flush=True)
    medians = {
        name: common.median(
            [m for r in runs if r["variant"] == name for m in r["max_rss_mib_per_group"]]
        )
        for name in variants
    }
    return runs, medians


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n_params = param_count(args.flavor)
    param_mib = n_params * 4 / 2**20
    with tempfile.TemporaryDirectory(prefix="memory_") as tmp:
        runs, medians = measure(Path(tmp), args.flavor, args.variants, args)
        small = None
        if args.small_flavor:
            small_runs, small_medians = measure(Path(tmp), args.small_flavor, SLOPE_VARIANTS, args)
            runs += small_runs
            small = {"flavor": args.small_flavor, "params": param_count(args.small_flavor)}
            small["median_max_rss_mib"] = small_medians
    table = {}
    for name, rss in medians.items():
        table[name] = {
            "median_max_rss_mib": round(rss, 1),
            "extra_vs_no_ft_mib": round(rss - medians["no_ft"], 1),
            "extra_vs_no_ft_over_param_bytes": round((rss - medians["no_ft"]) / param_mib, 3),
        }
        if "sync_ft" in medians:
            table[name]["extra_vs_sync_ft_over_param_bytes"] = round(
                (rss - medians["sync_ft"]) / param_mib, 3
            )
    for name, row in table.items():  # what each method says it held, by kind (big model)
        held = [
            group
            for r in runs
            if r["variant"] == name and r["flavor"] == args.flavor
            for group in r.get("outer_state_mib_per_group", [])
        ]
        if held:
            row["outer_state_over_param_bytes"] = {
                k: round(common.median([g[k] for g in held]) / param_mib, 3) for k in held[0]
            }
    slope = None
    if small is not None:
        small_mib = small["params"] * 4 / 2**20
        extra_big = medians["diloco"] - medians["no_ft"]
        sm = small["median_max_rss_mib"]
        extra_small = sm["diloco"] - sm["no_ft"]
        slope = round((extra_big - extra_small) / (param_mib - small_mib), 3)
        small["param_mib"] = round(small_mib, 1)
    result = {
        "benchmark": "memory",
        "settings": {
            "flavor": args.flavor,
            "params": n_params,
            "param_mib_fp32": round(param_mib, 1),
            "seq_len": args.seq_len,
            "local_batch_size": args.batch,
            "steps": args.steps,
            "groups": 2,
            "threads_per_group": 1,
            "repeats": args.repeats,
            "variants": {k: VARIANTS[k] for k in args.variants},
        },
        "summary": table,
        "diloco_extra_per_param_byte_slope": slope,
        "small_model": small,
        "target": {"diloco extra_vs_no_ft_over_param_bytes": "<= 2.1 (floor 2)"},
        "runs": runs,
    }
    path = provenance.write_result(args.out, result, provenance.command_line(__file__, argv))
    for name, row in table.items():
        kinds = row.get("outer_state_over_param_bytes", {})
        held = "  held: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) if kinds else ""
        print(
            f"[memory] {name:30s} peak {row['median_max_rss_mib']:8.1f} MiB  extra/params "
            f"{row['extra_vs_no_ft_over_param_bytes']:.3f}{held}"
        )
    if slope is not None:
        print(f"[memory] DiLoCo extra per parameter byte (slope over two sizes): {slope:.3f}")
    print(f"[memory] wrote {path}")
    return 0


if __name__ == "__main__":
    common.stop_cleanly_on_sigterm()
    sys.exit(main())
