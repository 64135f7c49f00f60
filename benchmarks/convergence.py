"""Convergence at equal tokens: held-out loss of one group, synchronous DP, LocalSGD, DiLoCo,
Streaming DiLoCo and async DiLoCo on the embedded corpus; or, with a straggler, against time.

    .venv/bin/python -m benchmarks.convergence             # the README's figures (~35 min)
    .venv/bin/python -m benchmarks.convergence --smoke     # seconds; checks the plumbing only
    .venv/bin/python -m benchmarks.convergence --straggler 2   # blocking vs async + DyLU
    .venv/bin/python -m benchmarks.convergence --sweep-outer-lr 0.5 1.0 \
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

* ``async_eager``, ``async_delayed``: async DiLoCo (``semi_sync_method=async_diloco``,
  ``async_update`` eager or delayed), the same outer optimizer, 1 fragment;
* ``async_eager_share``: async DiLoCo with ``async_update=eager_share`` (the group's share of
  the average applied at once, the others' when it arrives);
* ``async_eager_dn``, ``async_delayed_dn``: the same with Delayed Nesterov
  (``outer_momentum_every=2``, momentum ``--dn-momentum``);
* ``diloco_int8``, ``diloco_int4_ef``: DiLoCo with compressed pseudo-gradients (int8; int4
  with error feedback). These and the async rows add ``ratio_to_diloco``.

``--straggler F`` runs a different comparison: group 1 computes F times the work of each step
(``training.emulate_slowdown``), and blocking DiLoCo (``diloco``) is compared with async
DiLoCo with DyLU (``async_dylu``) by group 0's held-out loss against wall-clock time (seconds
since its start of training; it evaluates at each of its sync points). The summary gives each
method's loss when the faster of the two runs ended (equal wall-clock time). It writes
``convergence_straggler.json`` and a plot of loss against seconds.

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

from benchmarks import ft_common as common
from benchmarks import provenance
from torchtitan.tools.cluster import LocalJob
from torchtitan.trainer import TRAINING_STARTED, VALIDATION

CONFIGS = ["single_group", "sync_dp", "localsgd", "diloco", "streaming_diloco", "async_eager",
           "async_delayed", "async_eager_share", "async_eager_dn", "async_delayed_dn",
           "diloco_int8", "diloco_int4_ef"]  # fmt: skip
BASE_METHOD = {"sync_dp": "sync_ft", "localsgd": "localsgd", "diloco": "diloco",
               "streaming_diloco": "streaming_diloco", "async_eager": "async_diloco",
               "async_delayed": "async_delayed", "async_eager_share": "async_eager_share",
               "async_eager_dn": "async_eager_dn",
               "async_delayed_dn": "async_delayed_dn", "async_dylu": "async_dylu",
               "diloco_int8": "diloco_int8", "diloco_int4_ef": "diloco_int4_ef"}  # fmt: skip
#: With --straggler: blocking DiLoCo against async DiLoCo with DyLU.
STRAGGLER_CONFIGS = ["diloco", "async_dylu"]


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
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=0.0,
        help="its Nesterov momentum (0: the best of the sweep at this length)",
    )
    p.add_argument(
        "--dn-momentum",
        type=float,
        default=0.9,
        help="the *_dn rows: Delayed Nesterov's momentum (every 2 outer steps)",
    )
    p.add_argument("--sweep-outer-lr", type=float, nargs="+", help="sweep: DiLoCo only")
    p.add_argument("--sweep-outer-momentum", type=float, nargs="+", help="sweep: DiLoCo only")
    p.add_argument("--sweep-out", type=Path, help=provenance.output_help("convergence_sweep.json"))
    p.add_argument("--out", type=Path, help=provenance.output_help("convergence.json"))
    p.add_argument("--png", type=Path, help="chart (default: --out, as .png)")
    p.add_argument("--straggler", type=float, default=None,
                   help="group 1 computes this many times the work per step "
                   "(training.emulate_slowdown): compare blocking DiLoCo and async "
                   "DiLoCo with DyLU by held-out loss against wall-clock time")  # fmt: skip
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs in --out (same settings); run the rest")  # fmt: skip
    args = p.parse_args(argv)
    args.argv = argv
    if args.smoke:
        args.seeds, args.steps, args.sync_steps, args.eval_batches = [0], 8, 4, 2
        args.flavor, args.seq_len, args.batch = "debugmodel_small", 32, 2
    if args.straggler is not None:
        args.configs = STRAGGLER_CONFIGS
    name = "convergence.json" if args.straggler is None else "convergence_straggler.json"
    args.out = args.out or provenance.default_output(name, args.smoke)
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
                    semi_sync_args=semi_sync_args(args, config),
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


def semi_sync_args(args: argparse.Namespace, config: str = "diloco") -> list[str]:
    """Flags of the semi-sync runs (the outer optimizer's only matter to DiLoCo); the
    Delayed Nesterov rows (``*_dn``) take ``--dn-momentum``, which that optimizer needs."""
    momentum = args.dn_momentum if config.endswith("_dn") else args.outer_momentum
    return [
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        f"--fault_tolerance.outer_lr={args.outer_lr}",
        f"--fault_tolerance.outer_momentum={momentum}",
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
    if "diloco" in table:
        base = table["diloco"]["final_eval_loss_mean"]
        for config, row in table.items():
            if config.startswith("async") or config.startswith("diloco_"):
                row["ratio_to_diloco"] = round(row["final_eval_loss_mean"] / base, 4)
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
        "delayed_nesterov_rows": f"momentum {args.dn_momentum}, applied every 2 outer steps",
        "streaming": "2 fragments, fragment_sync_delay=1",
        "threads": "1 per process; 2-group runs: group i on core i; single group unpinned",
    }


def same_run_settings(saved: dict, args: argparse.Namespace) -> bool:
    """Whether a saved result was run with these settings (the outer optimizer aside)."""
    old = saved.get("settings", {})
    outer = ("outer_optimizer", "delayed_nesterov_rows")
    return all(old.get(k) == v for k, v in settings(args).items() if k not in outer)


def load_reusable(args: argparse.Namespace) -> dict[str, dict[int, dict[int, float]]]:
    """Curves of an earlier run with the same settings in ``--out`` (for ``--reuse``)."""
    if not args.reuse or not args.out.exists():
        return {}
    old = json.loads(args.out.read_text())
    if not same_run_settings(old, args):
        print("[convergence] --reuse: settings differ from the saved run; starting afresh")
        return {}
    # The outer optimizer matters to every run but these.
    outer = ("outer_optimizer", "delayed_nesterov_rows")
    same_outer = all(old["settings"].get(k) == settings(args)[k] for k in outer)
    return {
        config: {int(seed): {int(t): v for t, v in c.items()} for seed, c in by_seed.items()}
        for config, by_seed in old.get("curves", {}).items()
        if config in args.configs
        and (same_outer or config in ("single_group", "sync_dp", "localsgd"))
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


def straggler_curves(
    args: argparse.Namespace, tmp: Path
) -> dict[str, dict[int, dict[float, float]]]:
    """{config: {seed: {wall seconds: held-out loss}}} of group 0 (the fast group) with group
    1 a straggler; seconds from group 0's start of training to each validation."""
    curves: dict[str, dict[int, dict[float, float]]] = {}
    slow = [[], [f"--training.emulate_slowdown={args.straggler}"]]
    for seed in args.seeds:
        for config in args.configs:
            procs = common.run_method(
                tmp / f"{config}_seed{seed}",
                BASE_METHOD[config],
                train_args(args, seed, single=False),
                semi_sync_args=semi_sync_args(args),
                group_args=slow,
                timeout=7200,
            )
            events = common.trainer_events(procs[0], VALIDATION, TRAINING_STARTED)
            start = next(e.time for e in events if e.name == TRAINING_STARTED.name)
            curve = {
                round(e.time - start, 2): e["loss"] for e in events if e.name == VALIDATION.name
            }
            curves.setdefault(config, {})[seed] = curve
            end = max(curve)
            print(
                f"[convergence] straggler {config} seed {seed}: eval loss {curve[end]:.4f} "
                f"after {end:.0f} s",
                flush=True,
            )
    return curves


def loss_at(curve: dict[float, float], seconds: float) -> float | None:
    """The last held-out loss measured at or before ``seconds`` (None: none by then)."""
    before = [t for t in curve if t <= seconds]
    return round(curve[max(before)], 4) if before else None


def straggler_summary(curves: dict[str, dict[int, dict[float, float]]]) -> dict[str, object]:
    """Per seed, both methods' loss when the first of them finished (equal wall-clock time),
    and each one's final loss and time."""
    per_seed = {}
    for seed in curves[STRAGGLER_CONFIGS[0]]:
        runs = {c: curves[c][seed] for c in STRAGGLER_CONFIGS}
        equal = min(max(curve) for curve in runs.values())
        per_seed[str(seed)] = {
            "equal_wall_clock_s": equal,
            **{
                c: {
                    "loss_at_equal_wall_clock": loss_at(curve, equal),
                    "final_loss": round(curve[max(curve)], 4),
                    "final_s": max(curve),
                }
                for c, curve in runs.items()
            },
        }
    mean: dict[str, float | None] = {}
    for c in STRAGGLER_CONFIGS:
        values = [row[c]["loss_at_equal_wall_clock"] for row in per_seed.values()]
        mean[c] = None if None in values else round(sum(values) / len(values), 4)
    fast, blocking = mean["async_dylu"], mean["diloco"]
    return {
        "per_seed": per_seed,
        "mean_loss_at_equal_wall_clock": mean,
        # Blocking DiLoCo with no evaluation by then is still at its initial loss.
        "target_met": None if fast is None else blocking is None or fast < blocking,
    }


def plot_wall_clock(
    curves: dict[str, dict[int, dict[float, float]]], path: Path, title: str
) -> str:
    """Held-out loss vs wall-clock seconds, one line per config and seed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for index, (config, by_seed) in enumerate(curves.items()):
        for n, (_, curve) in enumerate(sorted(by_seed.items())):
            xs = sorted(curve)
            ax.plot(xs, [curve[x] for x in xs], color=f"C{index}", marker="o", ms=3,
                    alpha=1.0 if n == 0 else 0.5,
                    label=config if n == 0 else None)  # fmt: skip
    ax.set_xlabel("wall-clock seconds since the start of training")
    ax.set_ylabel("held-out loss of group 0 (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def straggler_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    load = common.load_average()
    with tempfile.TemporaryDirectory(prefix="convergence_straggler_") as tmp:
        curves = straggler_curves(args, Path(tmp))
    title = (
        f"{args.flavor}, 2 groups, group 1 at {args.straggler:g}x the work per step, "
        f"H={args.sync_steps}, {args.steps} steps of the fast group, seeds {args.seeds}"
    )
    result = {
        "benchmark": "convergence_straggler",
        "settings": {
            **settings(args),
            "straggler": f"group 1: training.emulate_slowdown={args.straggler}",
            "loss": "group 0's held-out loss (K batches), at each of its sync points",
            "load_avg_1min_at_start": round(load, 2),
        },
        "summary": straggler_summary(curves),
        "target": "async_dylu's loss at equal wall-clock time below diloco's",
        "curves": {
            c: {
                str(seed): {str(t): v for t, v in sorted(curve.items())}
                for seed, curve in by_seed.items()
            }
            for c, by_seed in curves.items()
        },  # fmt: skip
        "png": plot_wall_clock(curves, args.png, title),
    }
    path = provenance.write_result(args.out, result, provenance.command_line(__file__, argv))
    summary = result["summary"]
    print(f"[convergence] straggler: {json.dumps(summary['mean_loss_at_equal_wall_clock'])}")  # type: ignore[index]
    print(f"[convergence] wrote {path} and {result['png']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep_outer_lr or args.sweep_outer_momentum:
        return sweep(args)
    if args.straggler is not None:
        return straggler_main(args, argv)
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
            "target": {
                "diloco ratio_to_sync_dp": "<= 1.01",
                "async_eager ratio_to_diloco": "<= 1.02",
                "diloco_int8 ratio_to_diloco": "<= 1.01",
                "diloco_int4_ef ratio_to_diloco": "<= 1.02",
            },
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
