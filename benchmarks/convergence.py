"""Convergence at equal tokens: held-out loss of one group, synchronous DP, LocalSGD, DiLoCo and
Streaming DiLoCo on the embedded corpus.

    .venv/bin/python benchmarks/convergence.py             # the README's figures (~35 min)
    .venv/bin/python benchmarks/convergence.py --smoke     # seconds; checks the plumbing only
    .venv/bin/python benchmarks/convergence.py --sweep-outer-lr 0.5 1.0 \
        --sweep-outer-momentum 0.5 0.9                     # DiLoCo only, one run per pair

Setup (defaults): the debug Llama (4.85M parameters), sequences of 128 tokens, batches of 8 per
group, AdamW lr 2e-3 with 20 warmup steps and linear decay (the debug TOML), seed per run
(``--seeds``; model init and data order, the same in both groups).

* ``single_group``: one process without FT (1 thread), ``2 x --steps`` steps (so it sees as
  many tokens as two groups do in ``--steps``);
* ``sync_dp``: 2 groups, synchronous fault-tolerant DP (gradients averaged every step);
* ``localsgd``, ``diloco`` (outer Nesterov SGD, ``--outer-lr`` and ``--outer-momentum``),
  ``streaming_diloco`` (the same outer optimizer, 2 fragments, ``fragment_sync_delay=1``):
  2 groups, H = ``--sync-steps``.

``--sweep-outer-lr`` / ``--sweep-outer-momentum`` run DiLoCo alone for every pair of values
(seeds ``--seeds``) and write ``--sweep-out``: how the outer optimizer was chosen.

Evaluation is the trainer's own validation on the held-out split (``--validation.*``), at
every sync of the two-group runs (and at the same token counts for the single group). The
validation stream gives sample j to group j % 2: group 0's first K batches and group 1's first
K batches together are exactly the single group's first 2K batches, so the mean of the two
groups' losses (K batches each) and the single group's loss (2K batches) are over the same
held-out tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ft_common as common  # noqa: E402
import provenance  # noqa: E402

from torchtitan.tools.cluster import LocalJob  # noqa: E402
from torchtitan.trainer import VALIDATION  # noqa: E402

CONFIGS = ["single_group", "sync_dp", "localsgd", "diloco", "streaming_diloco"]
BASE_METHOD = {"sync_dp": "sync_ft", "localsgd": "localsgd", "diloco": "diloco",
               "streaming_diloco": "streaming_diloco"}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (CI)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=200, help="steps of each group (2-group runs)")
    p.add_argument("--sync-steps", type=int, default=20, help="H")
    p.add_argument("--eval-batches", type=int, default=10, help="K, per group")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD lr")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="its Nesterov momentum")
    p.add_argument("--sweep-outer-lr", type=float, nargs="+", help="sweep: DiLoCo only")
    p.add_argument("--sweep-outer-momentum", type=float, nargs="+", help="sweep: DiLoCo only")
    p.add_argument("--sweep-out", type=Path, help=provenance.output_help("convergence_sweep.json"))
    p.add_argument("--out", type=Path, help=provenance.output_help("convergence.json"))
    p.add_argument("--png", type=Path, help="chart (default: --out, as .png)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs in --out (same settings); run the rest")  # fmt: skip
    args = p.parse_args(argv)
    args.argv = argv
    if args.smoke:
        args.seeds, args.steps, args.sync_steps, args.eval_batches = [0], 8, 4, 2
        args.flavor, args.seq_len, args.batch = "debugmodel_small", 32, 2
    args.out = args.out or provenance.default_output("convergence.json", args.smoke)
    args.sweep_out = args.sweep_out or provenance.default_output(
        "convergence_sweep.json", args.smoke
    )
    args.png = args.png or args.out.with_suffix(".png")
    return args


def train_args(args: argparse.Namespace, seed: int, single: bool) -> list[str]:
    factor = 2 if single else 1
    return [
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--training.steps={factor * args.steps}",
        f"--training.seed={seed}",
        "--validation.enable",
        f"--validation.freq={factor * args.sync_steps}",
        f"--validation.steps={factor * args.eval_batches}",
        f"--validation.local_batch_size={args.batch}",
        f"--metrics.log_freq={factor * args.sync_steps}",
        "--metrics.cpu_peak_flops=-1",
    ]


def run_all(
    args: argparse.Namespace, tmp: Path, curves: dict[str, dict[int, dict[int, float]]], save
) -> None:
    """Fill ``curves`` ({config: {seed: {tokens: eval loss}}}) seed by seed, skipping the runs
    it already holds (``--reuse``); ``save(curves)`` after each run."""
    tokens_per_group_step = args.batch * args.seq_len
    for seed in args.seeds:
        for config in args.configs:
            if seed in curves.setdefault(config, {}):
                print(f"[convergence] {config} seed {seed}: reused", flush=True)
                continue
            if config == "single_group":
                # One process, one thread (like each group of the others), twice the steps.
                with LocalJob(tmp / f"single_seed{seed}") as job:
                    single = common.start_alone(
                        job, f"single_seed{seed}", train_args(args, seed, single=True)
                    )
                    common.wait_all([single], timeout=7200)
                losses = common.validation_losses(common.trainer_events(single, VALIDATION))
                curves[config][seed] = {
                    step * tokens_per_group_step: loss for step, loss in losses.items()
                }
            else:
                procs = common.run_method(
                    tmp / f"{config}_seed{seed}",
                    BASE_METHOD[config],
                    train_args(args, seed, single=False),
                    semi_sync_args=semi_sync_args(args),
                    timeout=7200,
                )
                per_group = [
                    common.validation_losses(common.trainer_events(p, VALIDATION)) for p in procs
                ]
                steps = sorted(set(per_group[0]) & set(per_group[1]))
                losses = {s: (per_group[0][s] + per_group[1][s]) / 2 for s in steps}
                curves[config][seed] = {
                    step * 2 * tokens_per_group_step: loss for step, loss in losses.items()
                }
            print(f"[convergence] {config} seed {seed}: {_last(losses)}", flush=True)
            save(curves)


def semi_sync_args(args: argparse.Namespace) -> list[str]:
    """Flags of the semi-sync runs (the outer optimizer's only matter to DiLoCo)."""
    return [
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        f"--fault_tolerance.outer_lr={args.outer_lr}",
        f"--fault_tolerance.outer_momentum={args.outer_momentum}",
    ]


def _last(losses: dict[int, float]) -> str:
    if not losses:
        return "no validation event"
    step = max(losses)
    return f"step {step} eval loss {losses[step]:.4f}"


def summarize(curves: dict[str, dict[int, dict[int, float]]]) -> dict[str, dict]:
    table = {}
    for config, by_seed in curves.items():
        finals = {seed: curve[max(curve)] for seed, curve in by_seed.items() if curve}
        table[config] = {
            "final_tokens": max(max(c) for c in by_seed.values()),
            "final_eval_loss_per_seed": {str(s): round(v, 4) for s, v in finals.items()},
            "final_eval_loss_mean": round(sum(finals.values()) / len(finals), 4),
        }
    if "sync_dp" in table:
        base = table["sync_dp"]["final_eval_loss_mean"]
        for row in table.values():
            row["ratio_to_sync_dp"] = round(row["final_eval_loss_mean"] / base, 4)
    return table


def plot(curves: dict[str, dict[int, dict[int, float]]], path: Path, title: str) -> str:
    """Eval loss vs tokens, one line per config (mean over seeds; seeds faint)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for config, by_seed in curves.items():
        tokens = sorted(set.intersection(*(set(c) for c in by_seed.values())))
        mean = [sum(c[t] for c in by_seed.values()) / len(by_seed) for t in tokens]
        (line,) = ax.plot([t / 1e6 for t in tokens], mean, marker="o", ms=3, label=config)
        if len(by_seed) > 1:
            for curve in by_seed.values():
                xs = sorted(curve)
                ax.plot([x / 1e6 for x in xs], [curve[x] for x in xs], color=line.get_color(),
                        alpha=0.25, lw=0.8)  # fmt: skip
    ax.set_xlabel("tokens seen by all groups together (millions)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    finals = [v for by_seed in curves.values() for c in by_seed.values() for v in c.values()]
    if finals:
        ax.set_ylim(min(finals) - 0.05, min(max(finals), min(finals) + 1.5))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def settings(args: argparse.Namespace) -> dict:
    return {
        "flavor": args.flavor,
        "seq_len": args.seq_len,
        "local_batch_size": args.batch,
        "steps_per_group_two_group_runs": args.steps,
        "steps_single_group": 2 * args.steps,
        "sync_steps_H": args.sync_steps,
        "eval": f"{args.eval_batches} batches of {args.batch} per group (single group: "
        f"{2 * args.eval_batches}), every {args.sync_steps} steps",
        "lr": "AdamW 2e-3, warmup 20, linear decay (debug_model.toml)",
        "outer_optimizer": f"SGD lr {args.outer_lr}, momentum {args.outer_momentum}, Nesterov",
        "streaming": "2 fragments, fragment_sync_delay=1",
        "threads": "1 per process; 2-group runs: group i on core i; single group unpinned",
    }


def same_run_settings(saved: dict, args: argparse.Namespace) -> bool:
    """Whether a saved result was run with these settings (the outer optimizer aside)."""
    old = saved.get("settings", {})
    return all(old.get(k) == v for k, v in settings(args).items() if k != "outer_optimizer")


def load_reusable(args: argparse.Namespace) -> dict[str, dict[int, dict[int, float]]]:
    """Curves of an earlier run with the same settings in ``--out`` (for ``--reuse``)."""
    if not args.reuse or not args.out.exists():
        return {}
    old = json.loads(args.out.read_text())
    if not same_run_settings(old, args):
        print("[convergence] --reuse: settings differ from the saved run; starting afresh")
        return {}
    # The outer optimizer only matters to the DiLoCo runs.
    same_outer = old["settings"].get("outer_optimizer") == settings(args)["outer_optimizer"]
    return {
        config: {int(seed): {int(t): v for t, v in c.items()} for seed, c in by_seed.items()}
        for config, by_seed in old.get("curves", {}).items()
        if config in args.configs and (same_outer or config not in ("diloco", "streaming_diloco"))
    }


def sweep(args: argparse.Namespace) -> int:
    """DiLoCo's final held-out loss for every (outer lr, outer momentum) pair, against the
    synchronous-DP figure of ``--out`` when it has the same settings (else ratio is n/a)."""
    load = common.load_average()
    base = None
    if args.out.exists():
        saved = json.loads(args.out.read_text())
        if same_run_settings(saved, args) and "sync_dp" in saved.get("summary", {}):
            per_seed = saved["summary"]["sync_dp"]["final_eval_loss_per_seed"]
            if all(str(s) in per_seed for s in args.seeds):
                base = sum(per_seed[str(s)] for s in args.seeds) / len(args.seeds)
    # A sweep extends the one in --sweep-out (same settings and seeds), never overwrites another.
    rows, commands = [], []
    if args.sweep_out.exists():
        old = json.loads(args.sweep_out.read_text())
        if not (same_run_settings(old, args) and old.get("seeds") == args.seeds):
            raise SystemExit(
                f"{args.sweep_out} holds a sweep with other settings or seeds: "
                "pass another --sweep-out (or delete it)"
            )
        rows, commands = old["rows"], old.get("commands") or [old["command"]]
    command = provenance.command_line(__file__, args.argv)
    commands.append(command)
    args.configs = ["diloco"]
    for momentum in args.sweep_outer_momentum or [args.outer_momentum]:
        for lr in args.sweep_outer_lr or [args.outer_lr]:
            args.outer_lr, args.outer_momentum = lr, momentum
            curves: dict[str, dict[int, dict[int, float]]] = {}
            with tempfile.TemporaryDirectory(prefix="convergence_sweep_") as tmp:
                run_all(args, Path(tmp), curves, lambda c: None)
            finals = [c[max(c)] for c in curves["diloco"].values()]
            final = sum(finals) / len(finals)
            row = {
                "outer_lr": lr,
                "outer_momentum": momentum,
                "final_eval_loss_per_seed": {
                    str(s): round(c[max(c)], 4) for s, c in curves["diloco"].items()
                },
                "final_eval_loss_mean": round(final, 4),
                "ratio_to_sync_dp": None if base is None else round(final / base, 4),
            }
            rows = [r for r in rows if (r["outer_lr"], r["outer_momentum"]) != (lr, momentum)] + [
                row
            ]
            print(
                f"[convergence] sweep outer lr {lr} momentum {momentum}: final eval loss "
                f"{final:.4f}  ratio to sync_dp {row['ratio_to_sync_dp']}",
                flush=True,
            )
            provenance.write_result(
                args.sweep_out,
                {
                    "benchmark": "convergence_outer_optimizer_sweep",
                    "commands": commands,
                    "settings": {
                        **settings(args),
                        "outer_optimizer": "swept (rows)",
                        "load_avg_1min_at_start": round(load, 2),
                    },
                    "seeds": args.seeds,
                    "sync_dp_final_eval_loss_mean": base,
                    "rows": rows,
                },
                command,
            )
    print(f"[convergence] wrote {args.sweep_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep_outer_lr or args.sweep_outer_momentum:
        return sweep(args)
    load = common.load_average()
    curves = load_reusable(args)
    command = provenance.command_line(__file__, argv)

    def save(curves: dict[str, dict[int, dict[int, float]]]) -> dict:
        done = {c: by_seed for c, by_seed in curves.items() if by_seed}
        result = {
            "benchmark": "convergence",
            "settings": {**settings(args), "load_avg_1min_at_start": round(load, 2)},
            "seeds": sorted({s for by_seed in done.values() for s in by_seed}),
            "summary": summarize(done),
            "target": {"diloco ratio_to_sync_dp": "<= 1.01"},
            "curves": {
                config: {
                    str(seed): {str(t): v for t, v in sorted(c.items())}
                    for seed, c in by_seed.items()
                }
                for config, by_seed in done.items()
            },
        }
        provenance.write_result(args.out, result, command)
        return result

    with tempfile.TemporaryDirectory(prefix="convergence_") as tmp:
        run_all(args, Path(tmp), curves, save)
    result = save(curves)
    title = (
        f"{args.flavor}, seq {args.seq_len}, batch {args.batch}/group, 2 groups x "
        f"{args.steps} steps, H={args.sync_steps}, seeds {result['seeds']}\n"
        f"DiLoCo outer SGD lr {args.outer_lr}, momentum {args.outer_momentum}"
        + (" (Nesterov)" if args.outer_momentum > 0 else "")
    )
    result["png"] = plot({c: curves[c] for c in args.configs if curves.get(c)}, args.png, title)
    provenance.write_result(args.out, result, command)
    for config, row in result["summary"].items():
        print(
            f"[convergence] {config:17s} final eval loss {row['final_eval_loss_mean']:.4f}"
            f"  ratio to sync_dp {row.get('ratio_to_sync_dp', float('nan')):.4f}"
        )
    print(f"[convergence] wrote {args.out} and {result['png']}")
    return 0


if __name__ == "__main__":
    common.stop_cleanly_on_sigterm()
    sys.exit(main())
