"""Convergence at equal tokens: held-out loss of one group, synchronous DP, LocalSGD, DiLoCo,
Streaming DiLoCo and async DiLoCo on the embedded corpus; or, with a straggler, against time.

    .venv/bin/python -m benchmarks.convergence --sweep-lr 1e-3 2e-3 4e-3 8e-3 1.6e-2 3.2e-2
    .venv/bin/python -m benchmarks.convergence --from-sweep --sweep-outer-lr 0.5 0.7 1.0 \
        --sweep-outer-momentum 0.0 0.9          # DiLoCo's outer optimizer, at DP's best lr
    .venv/bin/python -m benchmarks.convergence --from-sweep --sweep-method async_eager \
        --sweep-outer-lr 0.5 1.0 --sweep-outer-momentum 0.0 0.5    # async DiLoCo's own
    .venv/bin/python -m benchmarks.convergence --from-sweep --sweep-method diloco_sparse \
        --sweep-outer-lr 0.5 0.7 1.0                                # sparse's (momentum 0)
    .venv/bin/python -m benchmarks.convergence --from-sweep      # the report (seeds 1 2 3)
    .venv/bin/python -m benchmarks.convergence --from-sweep --straggler 2
    .venv/bin/python -m benchmarks.convergence --smoke     # seconds; checks the plumbing only

Setup (defaults): the small debug Llama (``debugmodel_small``, 0.13 M parameters: at 600 steps
of 2 groups it sees 9.3 tokens per parameter, on fresh text: the corpus has 1.67 M training
tokens), sequences of 128 tokens, batches of 8 per group, AdamW (``--lr``) with 20 warmup steps
and linear decay, seed per run (``--seeds``; model init and data order, the same in both
groups).

How the hyperparameters are chosen, fairly: synchronous DP's learning rate
(``--sweep-lr``), blocking DiLoCo's outer optimizer and async DiLoCo's
(``--sweep-outer-lr`` x ``--sweep-outer-momentum``, ``--sweep-method diloco`` or
``async_eager``; sparse's outer lr at momentum 0, ``--sweep-method diloco_sparse``, used by
both sparse rows; at DP's best learning rate, which is every method's inner learning rate)
each get a sweep of their own, on seeds ``--sweep-seeds`` (default 0) and on the *selection*
half of the held-out documents. ``--from-sweep`` takes the best of each from the sweep file
(where the file has no async sweep, async DiLoCo takes ``--async-outer-*``, else blocking
DiLoCo's choice). The report runs other seeds (default 1, 2, 3) and evaluates on the *test*
half, which no choice has seen. The embedded corpus's held-out documents are split into the
two halves by size, so that each holds about 57 k tokens (``held_out_halves``).

* ``single_group``: one process without FT (1 thread), ``2 x --steps`` steps (so it sees as
  many tokens as two groups do in ``--steps``);
* ``sync_dp``: 2 groups, synchronous fault-tolerant DP (gradients averaged every step);
* ``localsgd``, ``diloco`` (outer Nesterov SGD, ``--outer-lr`` and ``--outer-momentum``),
  ``streaming_diloco`` (the same outer optimizer, 2 fragments, ``fragment_sync_delay=1``):
  2 groups, H = ``--sync-steps``.
* ``async_eager``, ``async_delayed``: async DiLoCo (``semi_sync_method=async_diloco``,
  ``async_update`` eager or delayed), async DiLoCo's outer optimizer (``--async-outer-lr``,
  ``--async-outer-momentum``), 1 fragment;
* ``async_eager_share``: async DiLoCo with ``async_update=eager_share`` (the group's share of
  the average applied at once, the others' when it arrives);
* ``async_eager_dn``, ``async_delayed_dn``: the same with Delayed Nesterov
  (``outer_momentum_every=2``, momentum ``--dn-momentum``);
* ``diloco_int8``, ``diloco_int4_ef``, ``diloco_sparse``: DiLoCo with compressed
  pseudo-gradients (int8; int4 with error feedback; sparse at its defaults, with error
  feedback); ``async_eager_sparse``: async DiLoCo (eager) with sparse. These and the async
  rows add ``ratio_to_diloco``, and the async compressed rows ``ratio_to_async_eager``.

Every figure says its tokens per parameter; every mean over seeds comes with its range, and
every ratio with the range of the per-seed ratios.

``--straggler F`` runs a different comparison: group 1 computes F times the work of each step
(``training.emulate_slowdown``), and blocking DiLoCo (``diloco``) is compared with async
DiLoCo with DyLU (``async_dylu``) by group 0's final held-out loss when both end at the same
wall-clock time (async DiLoCo without DyLU, ``async_diloco``, is shown too). Async DiLoCo
runs ``--steps``; blocking DiLoCo, whose fast group waits for
the straggler at every sync, first runs ``--steps`` too (to measure its seconds per step),
then runs again with a schedule of its own (warmup and decay over fewer steps, a multiple of
H) sized to end when async DiLoCo ended. Final losses are compared, measured at the end of
each run: nothing is interpolated. It writes ``convergence_straggler.json`` and a plot of
loss against seconds. ``--rate R`` (root) puts each group behind its own emulated link of R
Mbit/s, as ``wan.py`` does; without it the groups talk over loopback.

Evaluation is the trainer's own validation (``--validation.*``) at every sync of the
two-group runs (and at the same token counts for the single group), on the held-out half
``--eval-split`` (report: ``test``; sweeps: ``select``). The validation stream gives sample j
to group j % 2: group 0's first K batches and group 1's first K batches together are exactly
the single group's first 2K batches, so the mean of the two groups' losses (K batches each)
and the single group's loss (2K batches) are over the same held-out tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import ft_common as common
from benchmarks import netns, provenance, wan
from torchtitan.datasets.corpus import corpus_documents
from torchtitan.tools.cluster import LocalJob
from torchtitan.trainer import TRAINING_FINISHED, TRAINING_STARTED, VALIDATION

CONFIGS = ["single_group", "sync_dp", "localsgd", "diloco", "streaming_diloco", "async_eager",
           "async_delayed", "async_eager_share", "async_eager_dn", "async_delayed_dn",
           "diloco_int8", "diloco_int4_ef", "async_eager_int8", "diloco_sparse",
           "async_eager_sparse"]  # fmt: skip
#: The report's default rows: the comparisons the README's targets are about.
REPORT_CONFIGS = ["single_group", "sync_dp", "localsgd", "diloco", "streaming_diloco",
                  "async_eager", "diloco_int8", "diloco_int4_ef", "diloco_sparse",
                  "async_eager_sparse"]  # fmt: skip
BASE_METHOD = {"sync_dp": "sync_ft", "localsgd": "localsgd", "diloco": "diloco",
               "streaming_diloco": "streaming_diloco", "async_eager": "async_diloco",
               "async_delayed": "async_delayed", "async_eager_share": "async_eager_share",
               "async_eager_dn": "async_eager_dn",
               "async_delayed_dn": "async_delayed_dn", "async_dylu": "async_dylu",
               "diloco_int8": "diloco_int8", "diloco_int4_ef": "diloco_int4_ef",
               "async_eager_int8": "async_diloco_int8", "diloco_sparse": "diloco_sparse",
               "async_eager_sparse": "async_diloco_sparse"}  # fmt: skip
#: With --straggler: blocking DiLoCo against async DiLoCo with DyLU.
STRAGGLER_CONFIGS = ["diloco", "async_eager", "async_dylu"]
#: With --rate alone: held-out loss against wall-clock behind a slow link, per method and dtype.
LINK_CONFIGS = ["diloco", "diloco_int8", "diloco_int4_ef", "streaming_diloco", "async_eager",
                "async_eager_int8"]  # fmt: skip
#: The methods whose outer optimizer gets a sweep of its own (``--sweep-method``): blocking
#: DiLoCo's is used by every DiLoCo row, async DiLoCo's by the ``async_*`` rows.
OUTER_SWEPT = ("diloco", "async_eager", "diloco_sparse")
#: The halves of the held-out documents: ``select`` for the sweeps, ``test`` for the report.
EVAL_SPLITS = ("select", "test")
TARGETS = {
    "diloco ratio_to_sync_dp": "<= 1.01",
    "async_eager ratio_to_diloco": "<= 1.02",
    "diloco_int8 ratio_to_diloco": "<= 1.01",
    "diloco_int4_ef ratio_to_diloco": "<= 1.02",
    "diloco_sparse ratio_to_diloco": "<= 1.02",
}

Curves = dict[str, dict[int, dict[int, float]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (CI)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="the report's seeds")
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=[0],
                   help="the sweeps' seeds (kept apart from the report's)")  # fmt: skip
    p.add_argument("--steps", type=int, default=600, help="steps of each group (2-group runs)")
    p.add_argument("--sync-steps", type=int, default=20, help="H")
    p.add_argument("--eval-batches", type=int, default=20, help="K, per group")
    p.add_argument("--eval-split", choices=EVAL_SPLITS, default="test",
                   help="the held-out half the report evaluates on (sweeps: select)")  # fmt: skip
    p.add_argument("--flavor", default="debugmodel_small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--configs", nargs="+", choices=CONFIGS,
                   help=f"default: {' '.join(REPORT_CONFIGS)}; with --rate alone: "
                   f"{' '.join(LINK_CONFIGS)}")  # fmt: skip
    p.add_argument("--lr", type=float, default=2e-3,
                   help="AdamW's peak learning rate (every method's inner lr)")  # fmt: skip
    p.add_argument("--outer-lr", type=float, default=0.7,
                   help="the outer SGD lr of DiLoCo, Streaming and compressed DiLoCo")  # fmt: skip
    p.add_argument("--outer-momentum", type=float, default=0.0,
                   help="its Nesterov momentum (0: plain SGD)")  # fmt: skip
    p.add_argument("--async-outer-lr", type=float, default=None,
                   help="async DiLoCo's outer SGD lr; default: --outer-lr")  # fmt: skip
    p.add_argument("--async-outer-momentum", type=float, default=None,
                   help="its Nesterov momentum (the *_dn rows: --dn-momentum); default: "
                   "--outer-momentum")  # fmt: skip
    p.add_argument("--sparse-outer-lr", type=float, default=None,
                   help="outer lr of the *_sparse rows, whose outer momentum is 0 (the "
                   "residual's decay takes its place); default: --outer-lr")  # fmt: skip
    p.add_argument(
        "--dn-momentum",
        type=float,
        default=0.9,
        help="the *_dn rows: Delayed Nesterov's momentum (every 2 outer steps)",
    )
    p.add_argument("--sweep-lr", type=float, nargs="+",
                   help="sweep: synchronous DP alone, one run per learning rate")  # fmt: skip
    p.add_argument("--sweep-outer-lr", type=float, nargs="+",
                   help="sweep: the outer optimizer of --sweep-method alone, one run per "
                   "(outer lr, outer momentum) pair, at --lr")  # fmt: skip
    p.add_argument("--sweep-outer-momentum", type=float, nargs="+",
                   help="sweep: the outer momenta of those pairs")  # fmt: skip
    p.add_argument("--sweep-method", choices=OUTER_SWEPT,
                   help="whose outer optimizer --sweep-outer-* tunes: blocking DiLoCo's (used "
                   "by every DiLoCo row; the default) or async DiLoCo's (used by the async_* "
                   "rows)")  # fmt: skip
    p.add_argument("--sweep-out", type=Path, help=provenance.output_help("convergence_sweep.json"))
    p.add_argument("--from-sweep", action="store_true",
                   help="take --lr (synchronous DP's best), --outer-lr / --outer-momentum "
                   "(DiLoCo's best at that lr) and --async-outer-lr / --async-outer-momentum "
                   "(async DiLoCo's best at that lr, where the file has an async sweep; "
                   "without one, async DiLoCo takes what --async-outer-* say, else DiLoCo's "
                   "choice) from --sweep-out")  # fmt: skip
    p.add_argument("--out", type=Path, help=provenance.output_help("convergence.json"))
    p.add_argument("--png", type=Path, help="chart (default: --out, as .png)")
    p.add_argument("--straggler", type=float, default=None,
                   help="group 1 computes this many times the work per step "
                   "(training.emulate_slowdown): compare blocking DiLoCo and async "
                   "DiLoCo with DyLU by held-out loss at the same wall-clock time")  # fmt: skip
    p.add_argument("--rate", type=float, default=None,
                   help="each group behind its own emulated link of this many Mbit/s "
                   "(benchmarks/netns.py; needs root); default: loopback. Without "
                   "--straggler: held-out loss against wall-clock per config "
                   "(convergence_link.json)")  # fmt: skip
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs in --out (same settings); run the rest")  # fmt: skip
    args = p.parse_args(argv)
    args.argv = argv
    if args.smoke:
        args.seeds, args.sweep_seeds, args.steps, args.sync_steps = [0], [0], 8, 4
        args.eval_batches, args.flavor, args.seq_len, args.batch = 2, "debugmodel_small", 32, 2
    args.link = args.rate is not None and args.straggler is None
    if args.straggler is not None:
        args.configs = STRAGGLER_CONFIGS
    elif args.link:
        args.configs = args.configs or LINK_CONFIGS
        if not_semi_sync := [c for c in args.configs if c not in BASE_METHOD or c == "sync_dp"]:
            p.error(f"--rate: {', '.join(not_semi_sync)} trains no 2-group semi-sync run")
    args.configs = args.configs or REPORT_CONFIGS
    if args.rate is not None and (why := netns.unavailable()):
        p.error(f"--rate: no emulated links here: {why}")
    outer_sweep = args.sweep_outer_lr or args.sweep_outer_momentum
    if args.sweep_method is not None and not outer_sweep:
        p.error("--sweep-method needs --sweep-outer-lr and/or --sweep-outer-momentum")
    if args.sweep_lr and outer_sweep:
        p.error("--sweep-lr and --sweep-outer-*: one sweep per command (DP's lr first)")
    args.sweep_method = args.sweep_method or "diloco"
    name = ("convergence_straggler.json" if args.straggler is not None
            else "convergence_link.json" if args.link else "convergence.json")  # fmt: skip
    args.out = args.out or provenance.default_output(name, args.smoke)
    args.sweep_out = args.sweep_out or provenance.default_output(
        "convergence_sweep.json", args.smoke
    )
    args.png = args.png or args.out.with_suffix(".png")
    args.parameters = None  # the model's, from the first run's train.started
    return args


def sparse_outer_lr(args: argparse.Namespace) -> float:
    """The sparse rows' outer lr (their outer momentum is 0: the residual's decay takes its
    place): ``--sparse-outer-lr`` where given (or chosen by ``--from-sweep``), else DiLoCo's."""
    return args.outer_lr if args.sparse_outer_lr is None else args.sparse_outer_lr


def async_outer(args: argparse.Namespace) -> tuple[float, float]:
    """Async DiLoCo's outer (lr, momentum): ``--async-outer-*`` where given (or chosen by
    ``--from-sweep``), else blocking DiLoCo's."""
    lr = args.outer_lr if args.async_outer_lr is None else args.async_outer_lr
    momentum = (
        args.outer_momentum if args.async_outer_momentum is None else args.async_outer_momentum
    )
    return lr, momentum


def held_out_halves(folder: Path) -> dict[str, Path]:
    """The embedded corpus's held-out documents as two folders of ``.txt`` files,
    ``select`` and ``test``: the largest document first, each to the half with fewer bytes so
    far (a fixed rule on a fixed corpus: the same halves in every run)."""
    halves: dict[str, list[str]] = {name: [] for name in EVAL_SPLITS}
    size = dict.fromkeys(EVAL_SPLITS, 0)
    docs = sorted(corpus_documents("validation"), key=lambda d: (-len(d.text.encode()), d.title))
    for doc in docs:
        name = min(EVAL_SPLITS, key=lambda n: (size[n], EVAL_SPLITS.index(n)))
        halves[name].append(doc.text)
        size[name] += len(doc.text.encode())
    paths = {}
    for name, texts in halves.items():
        path = folder / f"held_out_{name}"
        path.mkdir(parents=True, exist_ok=True)
        for index, text in enumerate(texts):
            (path / f"doc{index:03d}.txt").write_text(text)
        paths[name] = path
    return paths


def train_args(
    args: argparse.Namespace, seed: int, single: bool, eval_folder: Path, steps: int | None = None
) -> list[str]:
    factor = 2 if single else 1
    steps = args.steps if steps is None else steps
    return [
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--training.steps={factor * steps}",
        f"--training.seed={seed}",
        f"--optimizer.lr={args.lr}",
        "--validation.enable",
        "--validation.dataset=local",
        f"--validation.dataset_path={eval_folder}",
        f"--validation.freq={factor * args.sync_steps}",
        f"--validation.steps={factor * args.eval_batches}",
        f"--validation.local_batch_size={args.batch}",
        f"--metrics.log_freq={factor * args.sync_steps}",
        "--metrics.cpu_peak_flops=-1",
    ]


def _note_parameters(args: argparse.Namespace, proc: object) -> None:
    started = common.trainer_events(proc, TRAINING_STARTED)  # type: ignore[arg-type]
    if started and args.parameters is None:
        args.parameters = started[0]["parameters"]


def run_all(args: argparse.Namespace, tmp: Path, curves: Curves, save, split: str) -> None:
    """Fill ``curves`` ({config: {seed: {tokens: eval loss}}}) seed by seed on the held-out
    half ``split``, skipping the runs it already holds (``--reuse``); ``save(curves)`` after
    each run."""
    tokens_per_group_step = args.batch * args.seq_len
    eval_folder = held_out_halves(tmp)[split]
    for seed in args.seeds:
        for config in args.configs:
            if seed in curves.setdefault(config, {}):
                print(f"[convergence] {config} seed {seed}: reused", flush=True)
                continue
            if config == "single_group":
                # One process, one thread (like each group of the others), twice the steps.
                with LocalJob(tmp / f"single_seed{seed}") as job:
                    single = common.start_alone(
                        job, f"single_seed{seed}", train_args(args, seed, True, eval_folder)
                    )
                    common.wait_all([single], timeout=7200)
                losses = common.validation_losses(common.trainer_events(single, VALIDATION))
                _note_parameters(args, single)
                curves[config][seed] = {
                    step * tokens_per_group_step: loss for step, loss in losses.items()
                }
            else:
                procs = common.run_method(
                    tmp / f"{config}_seed{seed}",
                    BASE_METHOD[config],
                    train_args(args, seed, False, eval_folder),
                    semi_sync_args=semi_sync_args(args, config),
                    timeout=7200,
                )
                _note_parameters(args, procs[0])
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


def semi_sync_args(args: argparse.Namespace, config: str) -> list[str]:
    """Flags of the semi-sync runs of ``config``: the async rows (``async_*``) take async
    DiLoCo's outer optimizer, the other DiLoCo rows blocking DiLoCo's; the Delayed Nesterov
    rows (``*_dn``) take ``--dn-momentum``, which that optimizer needs."""
    if config == "localsgd":  # no outer optimizer: the trainer refuses its fields
        return [f"--fault_tolerance.sync_steps={args.sync_steps}"]
    if config.endswith("_sparse"):
        lr, momentum = sparse_outer_lr(args), 0.0
    elif config.startswith("async"):
        lr, momentum = async_outer(args)
    else:
        lr, momentum = args.outer_lr, args.outer_momentum
    if config.endswith("_dn"):
        momentum = args.dn_momentum
    return [
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        f"--fault_tolerance.outer_lr={lr}",
        f"--fault_tolerance.outer_momentum={momentum}",
    ]


def _last(losses: dict[int, float]) -> str:
    if not losses:
        return "no validation event"
    step = max(losses)
    return f"step {step} eval loss {losses[step]:.4f}"


def _ratio(row: dict, base: dict, name: str) -> None:
    """``row[name]``: the ratio of the means, and ``row[name + '_range']``: the range of the
    per-seed ratios over the seeds both rows have."""
    row[name] = round(row["final_eval_loss_mean"] / base["final_eval_loss_mean"], 4)
    mine, theirs = row["final_eval_loss_per_seed"], base["final_eval_loss_per_seed"]
    per_seed = [mine[s] / theirs[s] for s in mine if s in theirs]
    row[name + "_range"] = [round(min(per_seed), 4), round(max(per_seed), 4)]


def summarize(curves: Curves, parameters: int | None = None) -> dict[str, dict]:
    """Per config: the final held-out loss per seed, its mean and range, the tokens (and,
    given ``parameters``, tokens per parameter) it was reached at, and its ratios to
    synchronous DP (and, for the async and compressed rows, to DiLoCo)."""
    table = {}
    for config, by_seed in curves.items():
        finals = {seed: curve[max(curve)] for seed, curve in by_seed.items() if curve}
        tokens = max(max(c) for c in by_seed.values())
        table[config] = {
            "final_tokens": tokens,
            "tokens_per_parameter": None if not parameters else round(tokens / parameters, 2),
            "final_eval_loss_per_seed": {str(s): round(v, 4) for s, v in finals.items()},
            "final_eval_loss_mean": round(sum(finals.values()) / len(finals), 4),
            "final_eval_loss_range": [
                round(min(finals.values()), 4),
                round(max(finals.values()), 4),
            ],  # fmt: skip
        }
    if "sync_dp" in table:
        for row in table.values():
            _ratio(row, table["sync_dp"], "ratio_to_sync_dp")
    if "diloco" in table:
        for config, row in table.items():
            if config.startswith("async") or config.startswith("diloco_"):
                _ratio(row, table["diloco"], "ratio_to_diloco")
    if "async_eager" in table:
        for config, row in table.items():
            if config.startswith("async_eager_"):
                _ratio(row, table["async_eager"], "ratio_to_async_eager")
    return table


def verdicts(summary: dict[str, dict]) -> dict[str, str]:
    """Each target: met when the mean meets it *and* every seed's ratio does ("met"), else
    "missed", with the figures."""
    out = {}
    for key, bound in TARGETS.items():
        config, ratio = key.split(" ")
        row = summary.get(config)
        if row is None or ratio not in row:
            continue
        limit = float(bound.split()[-1])
        low, high = row[ratio + "_range"]
        met = row[ratio] <= limit and high <= limit
        out[key] = (
            f"{'met' if met else 'missed'}: {row[ratio]} (seeds {low}-{high}) against {bound}"
        )
    return out


def plot(curves: Curves, path: Path, title: str) -> str:
    """Eval loss vs tokens, one line per config (mean over seeds; seeds faint); past the ten
    colours of the cycle, the lines are dashed, so no two configs look alike."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for index, (config, by_seed) in enumerate(curves.items()):
        tokens = sorted(set.intersection(*(set(c) for c in by_seed.values())))
        mean = [sum(c[t] for c in by_seed.values()) / len(by_seed) for t in tokens]
        (line,) = ax.plot([t / 1e6 for t in tokens], mean, marker="o", ms=3, label=config,
                          color=f"C{index % 10}", ls=("-", "--", ":")[index // 10 % 3])  # fmt: skip
        if len(by_seed) > 1:
            for curve in by_seed.values():
                xs = sorted(curve)
                ax.plot([x / 1e6 for x in xs], [curve[x] for x in xs], color=line.get_color(),
                        alpha=0.25, lw=0.8)  # fmt: skip
    ax.set_xlabel("tokens seen by all groups together (millions)")
    ax.set_ylabel("held-out loss, test half (nats/token)")
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
        "lr": f"AdamW {args.lr:g}, warmup 20, linear decay to 0",
        "outer_optimizer": f"SGD lr {args.outer_lr}, momentum {args.outer_momentum}, Nesterov",
        "async_outer_optimizer": "SGD lr {}, momentum {}, Nesterov".format(*async_outer(args)),
        "sparse_outer_optimizer": f"SGD lr {sparse_outer_lr(args)}, momentum 0 (residual decay "
        "0.9, the field's default)",
        "delayed_nesterov_rows": f"momentum {args.dn_momentum}, applied every 2 outer steps",
        "streaming": "2 fragments, fragment_sync_delay=1",
        "threads": "1 per process; 2-group runs: group i on core i; single group unpinned",
    }


#: Settings that the hyperparameters under comparison may change between runs.
TUNED = ("lr", "outer_optimizer", "async_outer_optimizer", "sparse_outer_optimizer",
         "delayed_nesterov_rows")  # fmt: skip


def same_run_settings(saved: dict, args: argparse.Namespace) -> bool:
    """Whether a saved result was run with these settings (the tuned ones aside)."""
    old = saved.get("settings", {})
    return all(old.get(k) == v for k, v in settings(args).items() if k not in TUNED)


def load_reusable(args: argparse.Namespace) -> Curves:
    """Curves of an earlier run with the same settings and split in ``--out`` (``--reuse``)."""
    if not args.reuse or not args.out.exists():
        return {}
    old = json.loads(args.out.read_text())
    if not same_run_settings(old, args) or old.get("eval_split") != args.eval_split:
        print("[convergence] --reuse: settings differ from the saved run; starting afresh")
        return {}
    now = settings(args)

    def same(key: str) -> bool:
        return old["settings"].get(key) == now[key]

    def reusable(config: str) -> bool:
        if config in ("single_group", "sync_dp", "localsgd"):
            return True  # no outer optimizer
        outer = "async_outer_optimizer" if config.startswith("async") else "outer_optimizer"
        return same(outer) and (not config.endswith("_dn") or same("delayed_nesterov_rows"))

    return {
        config: {int(seed): {int(t): v for t, v in c.items()} for seed, c in by_seed.items()}
        for config, by_seed in old.get("curves", {}).items()
        if config in args.configs and same("lr") and reusable(config)
    }


# ---- the sweeps ----------------------------------------------------------------------------


def _row_key(row: dict) -> tuple:
    return (row["config"], row["lr"], row.get("outer_lr"), row.get("outer_momentum"))


def best_rows(rows: list[dict]) -> tuple[dict | None, dict[str, dict]]:
    """Synchronous DP's best row, and for each method of ``OUTER_SWEPT`` that the rows sweep,
    its best row at that row's learning rate."""
    dp = [r for r in rows if r["config"] == "sync_dp"]
    best_dp = min(dp, key=lambda r: r["final_eval_loss_mean"]) if dp else None
    best_outer = {}
    for method in OUTER_SWEPT:
        swept = [r for r in rows if r["config"] == method and best_dp and r["lr"] == best_dp["lr"]]
        if swept:
            best_outer[method] = min(swept, key=lambda r: r["final_eval_loss_mean"])
    return best_dp, best_outer


def take_from_sweep(args: argparse.Namespace) -> dict[str, object]:
    """``--from-sweep``: set ``args.lr`` and the outer optimizer from the sweep file's best
    rows; returns what was chosen and from where (for the result's settings)."""
    if not args.sweep_out.exists():
        raise SystemExit(f"--from-sweep: {args.sweep_out} does not exist: run a sweep first")
    saved = json.loads(args.sweep_out.read_text())
    if not same_run_settings(saved, args):
        raise SystemExit(f"--from-sweep: {args.sweep_out} was swept with other settings")
    best_dp, best_outer = best_rows(saved["rows"])
    if best_dp is None:
        raise SystemExit(f"--from-sweep: {args.sweep_out} has no sync_dp row (--sweep-lr)")
    args.lr = best_dp["lr"]
    chosen: dict[str, object] = {"lr": args.lr, "sync_dp_runs_swept": sum(
        r["config"] == "sync_dp" for r in saved["rows"])}  # fmt: skip
    if "diloco" in best_outer:
        best = best_outer["diloco"]
        args.outer_lr, args.outer_momentum = best["outer_lr"], best["outer_momentum"]
        chosen.update(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                      diloco_runs_swept=sum(r["config"] == "diloco" and r["lr"] == args.lr
                                            for r in saved["rows"]))  # fmt: skip
    if "async_eager" in best_outer:
        best = best_outer["async_eager"]
        args.async_outer_lr, args.async_outer_momentum = best["outer_lr"], best["outer_momentum"]
        chosen.update(async_outer_lr=args.async_outer_lr,
                      async_outer_momentum=args.async_outer_momentum,
                      async_runs_swept=sum(r["config"] == "async_eager" and r["lr"] == args.lr
                                           for r in saved["rows"]))  # fmt: skip
    elif args.async_outer_lr is None and args.async_outer_momentum is None:
        chosen.update(async_outer_optimizer="DiLoCo's: the file has no async_eager sweep")
    else:  # no sweep of its own: what the command line says, DiLoCo's where it is silent
        chosen.update(async_outer_optimizer="the command line's (--async-outer-*; DiLoCo's "
                      "where not given): the file has no async_eager sweep")  # fmt: skip
    if "diloco_sparse" in best_outer:
        args.sparse_outer_lr = best_outer["diloco_sparse"]["outer_lr"]
        chosen.update(sparse_outer_lr=args.sparse_outer_lr,
                      sparse_runs_swept=sum(r["config"] == "diloco_sparse" and r["lr"] == args.lr
                                            for r in saved["rows"]))  # fmt: skip
    chosen.update(sweep_file=str(args.sweep_out), sweep_seeds=saved["seeds"],
                  sweep_eval_split=saved.get("eval_split"))  # fmt: skip
    return chosen


def sweep(args: argparse.Namespace) -> int:
    """On the sweep seeds and the selection half: synchronous DP's final held-out loss for
    every learning rate (``--sweep-lr``), or ``--sweep-method``'s (blocking or async DiLoCo)
    for every (outer lr, outer momentum) pair at ``--lr``; the outer optimizers' rows are
    rated against the file's best DP row."""
    load = common.load_average()
    rows: list[dict] = []
    commands: list[str] = []
    if args.sweep_out.exists():
        old = json.loads(args.sweep_out.read_text())
        if not (same_run_settings(old, args) and old.get("seeds") == args.sweep_seeds):
            raise SystemExit(
                f"{args.sweep_out} holds a sweep with other settings or seeds: "
                "pass another --sweep-out (or delete it)"
            )
        rows, commands = old["rows"], old.get("commands") or [old["command"]]
    command = provenance.command_line(__file__, args.argv)
    commands.append(command)
    args.seeds = args.sweep_seeds
    if args.sweep_lr:
        args.configs = ["sync_dp"]
        points = [(lr, None, None) for lr in args.sweep_lr]
    else:
        args.configs = [args.sweep_method]
        # A grid given in one dimension only: the other at the swept method's own setting.
        lr0, momentum0 = (
            async_outer(args) if args.sweep_method == "async_eager"
            else (sparse_outer_lr(args), 0.0) if args.sweep_method == "diloco_sparse"
            else (args.outer_lr, args.outer_momentum)
        )  # fmt: skip
        points = [
            (args.lr, lr, momentum)
            for momentum in args.sweep_outer_momentum or [momentum0]
            for lr in args.sweep_outer_lr or [lr0]
        ]
    for lr, outer_lr, momentum in points:
        args.lr = lr
        if outer_lr is not None:
            args.outer_lr, args.outer_momentum = outer_lr, momentum
            args.async_outer_lr, args.async_outer_momentum = outer_lr, momentum
            args.sparse_outer_lr = outer_lr
        curves: Curves = {}
        with tempfile.TemporaryDirectory(prefix="convergence_sweep_") as tmp:
            run_all(args, Path(tmp), curves, lambda c: None, "select")
        (config,) = args.configs
        finals = {s: c[max(c)] for s, c in curves[config].items()}
        row: dict[str, object] = {"config": config, "lr": lr}
        if outer_lr is not None:
            row.update(outer_lr=outer_lr, outer_momentum=momentum)
        row.update(
            final_eval_loss_per_seed={str(s): round(v, 4) for s, v in finals.items()},
            final_eval_loss_mean=round(sum(finals.values()) / len(finals), 4),
        )
        rows = [r for r in rows if _row_key(r) != _row_key(row)] + [row]
        best_dp, _ = best_rows(rows)
        for r in rows:
            same_lr = best_dp is not None and r["lr"] == best_dp["lr"]
            r["ratio_to_best_sync_dp"] = (
                round(r["final_eval_loss_mean"] / best_dp["final_eval_loss_mean"], 4)  # type: ignore[index]
                if r["config"] in OUTER_SWEPT and same_lr
                else None
            )
        print(
            f"[convergence] sweep {config} lr {lr:g}"
            + ("" if outer_lr is None else f" outer lr {outer_lr} momentum {momentum}")
            + f": final eval loss (select half) {row['final_eval_loss_mean']:.4f}",
            flush=True,
        )
        provenance.write_result(
            args.sweep_out,
            {
                "benchmark": "convergence_sweep",
                "commands": commands,
                "settings": {
                    **settings(args),
                    "lr": "swept (rows)",
                    "outer_optimizer": "swept (rows)",
                    "async_outer_optimizer": "swept (rows)",
                    "load_avg_1min_at_start": round(load, 2),
                },
                "parameters": args.parameters,
                "seeds": args.sweep_seeds,
                "eval_split": "select",
                "rows": rows,
            },
            command,
        )
    print(f"[convergence] wrote {args.sweep_out}")
    return 0


# ---- a straggler: equal wall-clock time ------------------------------------------------------


def _group0_curve(
    args: argparse.Namespace, tmp: Path, config: str, seed: int, steps: int, eval_folder: Path
) -> dict[str, Any]:
    """One run, group 1 a straggler (with ``--rate``, each group behind its own link of that
    many Mbit/s): ``{"steps": steps, "curve": {seconds since group 0's start of training: its
    held-out loss}, "group_steps": [the steps each group trained], "tokens": their tokens}``.
    With DyLU the groups train other step counts than ``steps``."""
    slowdown = [] if args.straggler is None else [f"--training.emulate_slowdown={args.straggler}"]
    with contextlib.ExitStack() as stack:
        job_options: dict = {}
        group_args: list[list[str]] = [[], slowdown]
        if args.rate is not None:
            _, job_options = stack.enter_context(wan.emulated_links(2, args.rate))
            group_args = [[wan.hostname_flag(0)], [wan.hostname_flag(1), *slowdown]]
        procs = common.run_method(
            tmp / f"{config}_seed{seed}_{steps}steps",
            BASE_METHOD[config],
            train_args(args, seed, False, eval_folder, steps=steps),
            semi_sync_args=semi_sync_args(args, config),
            group_args=group_args,
            timeout=7200,
            job_options=job_options,
            lighthouse_port=wan.LIGHTHOUSE_PORT if args.rate is not None else None,
        )
    _note_parameters(args, procs[0])
    events = common.trainer_events(procs[0], VALIDATION, TRAINING_STARTED)
    start = next(e.time for e in events if e.name == TRAINING_STARTED.name)
    group_steps = [common.trainer_events(p, TRAINING_FINISHED)[-1].step for p in procs]
    return {
        "steps": steps,
        "curve": {round(e.time - start, 2): e["loss"] for e in events if e.name == VALIDATION.name},
        "group_steps": group_steps,
        "tokens": sum(group_steps) * args.batch * args.seq_len,
    }


def own_schedule_steps(steps: int, seconds: float, target_s: float, h: int) -> int:
    """Steps that end near ``target_s`` at this run's pace (``steps`` in ``seconds``): a
    multiple of H, at least one period."""
    return max(h, round(steps * target_s / seconds / h) * h)


def straggler_curves(args: argparse.Namespace, tmp: Path) -> dict[str, dict[int, dict]]:
    """Per seed: async DiLoCo + DyLU and async DiLoCo without it over ``--steps``; blocking
    DiLoCo over ``--steps`` (``diloco_equal_steps``) and over its own shorter schedule
    (``diloco``) sized to end when async DiLoCo + DyLU ended.
    {config: {seed: {"steps": n, "curve": {s: loss}}}}."""
    eval_folder = held_out_halves(tmp)[args.eval_split]
    runs: dict[str, dict[int, dict]] = {
        "async_dylu": {}, "async_diloco": {}, "diloco_equal_steps": {}, "diloco": {}
    }  # fmt: skip
    for seed in args.seeds:
        fast = _group0_curve(args, tmp, "async_dylu", seed, args.steps, eval_folder)
        runs["async_diloco"][seed] = _group0_curve(
            args, tmp, "async_eager", seed, args.steps, eval_folder
        )
        equal = _group0_curve(args, tmp, "diloco", seed, args.steps, eval_folder)
        steps = own_schedule_steps(
            args.steps, max(equal["curve"]), max(fast["curve"]), args.sync_steps
        )
        runs["diloco"][seed] = _group0_curve(args, tmp, "diloco", seed, steps, eval_folder)
        runs["async_dylu"][seed] = fast
        runs["diloco_equal_steps"][seed] = equal
        for name in runs:
            curve = runs[name][seed]["curve"]
            end = max(curve)
            print(
                f"[convergence] straggler {name} seed {seed}: {runs[name][seed]['steps']} steps, "
                f"eval loss {curve[end]:.4f} after {end:.0f} s",
                flush=True,
            )
    return runs


def straggler_summary(
    runs: dict[str, dict[int, dict]], parameters: int | None = None
) -> dict[str, object]:
    """Per seed, each run's final loss, its steps and when it ended (and, where the run says
    what it trained, each group's steps and the tokens per parameter); the mean and range
    over seeds; the target: async DiLoCo + DyLU ends lower than blocking DiLoCo on a
    schedule that ends at about the same time (every seed)."""
    per_seed: dict[str, dict] = {}
    for seed in runs["async_dylu"]:
        per_seed[str(seed)] = {}
        for name, by_seed in runs.items():
            run = by_seed[seed]
            row = {
                "steps": run["steps"],
                "final_loss": round(run["curve"][max(run["curve"])], 4),
                "final_s": max(run["curve"]),
            }
            if "group_steps" in run:
                row["group_steps"] = run["group_steps"]
                if parameters:
                    row["tokens_per_parameter"] = round(run["tokens"] / parameters, 2)
            per_seed[str(seed)][name] = row
    summary: dict[str, object] = {"per_seed": per_seed}
    for name in runs:
        losses = [row[name]["final_loss"] for row in per_seed.values()]
        ends = [row[name]["final_s"] for row in per_seed.values()]
        summary[name] = {
            "final_loss_mean": round(sum(losses) / len(losses), 4),
            "final_loss_range": [min(losses), max(losses)],
            "final_s_range": [min(ends), max(ends)],
        }
        per_parameter = [row[name].get("tokens_per_parameter") for row in per_seed.values()]
        if None not in per_parameter:
            summary[name]["tokens_per_parameter_range"] = [min(per_parameter), max(per_parameter)]
    gaps = [row["diloco"]["final_s"] / row["async_dylu"]["final_s"] for row in per_seed.values()]
    summary["blocking_end_over_async_end_range"] = [round(min(gaps), 3), round(max(gaps), 3)]
    summary["target_met"] = all(
        row["async_dylu"]["final_loss"] < row["diloco"]["final_loss"] for row in per_seed.values()
    )
    return summary


def plot_wall_clock(runs: dict[str, dict[int, dict]], path: Path, title: str) -> str:
    """Held-out loss vs wall-clock seconds, one line per run and seed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for index, (name, by_seed) in enumerate(runs.items()):
        for n, (_, run) in enumerate(sorted(by_seed.items())):
            curve = run["curve"]
            xs = sorted(curve)
            ax.plot(xs, [curve[x] for x in xs], color=f"C{index}", marker="o", ms=3,
                    alpha=1.0 if n == 0 else 0.5, ls="--" if name.endswith("steps") else "-",
                    label=name if n == 0 else None)  # fmt: skip
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


def wall_clock_json(runs: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict]]:
    """The wall-clock runs as their result file holds them: seeds and seconds as strings,
    each curve in time order."""
    return {
        config: {
            str(seed): {
                **{k: v for k, v in run.items() if k != "curve"},
                "curve": {str(t): v for t, v in sorted(run["curve"].items())},
            }
            for seed, run in by_seed.items()
        }
        for config, by_seed in runs.items()
    }


def link_text(rate: float | None) -> str:
    return "loopback" if rate is None else f"{rate:g} Mbit/s per group (tc tbf)"


def straggler_main(args: argparse.Namespace, argv: list[str] | None, chosen: dict) -> int:
    load = common.load_average()
    with tempfile.TemporaryDirectory(prefix="convergence_straggler_") as tmp:
        runs = straggler_curves(args, Path(tmp))
    title = (
        f"{args.flavor}, 2 groups, group 1 at {args.straggler:g}x the work per step, "
        f"H={args.sync_steps}\n{link_text(args.rate)}, seeds {args.seeds}, async {args.steps} "
        "steps\nblocking DiLoCo on its own schedule (solid) and at equal steps (dashed)"
    )
    result = {
        "benchmark": "convergence_straggler",
        "settings": {
            **settings(args),
            "straggler": f"group 1: training.emulate_slowdown={args.straggler}",
            "link": link_text(args.rate),
            "loss": "group 0's held-out loss (K batches), at each of its sync points",
            "chosen_from_sweep": chosen or None,
            "load_avg_1min_at_start": round(load, 2),
        },
        "parameters": args.parameters,
        "eval_split": args.eval_split,
        "summary": straggler_summary(runs, args.parameters),
        "target": "async_dylu's final loss below blocking diloco's, on a schedule of its own "
        "that ends at about the same wall-clock time, for every seed",
        "curves": wall_clock_json(runs),
        "png": plot_wall_clock(runs, args.png, title),
    }
    path = provenance.write_result(args.out, result, provenance.command_line(__file__, argv))
    summary = result["summary"]
    for name in runs:
        print(f"[convergence] straggler {name}: {json.dumps(summary[name])}")
    print(f"[convergence] wrote {path} and {result['png']}")
    return 0


def link_main(args: argparse.Namespace, argv: list[str] | None, chosen: dict) -> int:
    """Every config for ``--steps`` per seed, each group behind its own ``--rate`` link: group
    0's held-out loss against wall-clock seconds (the chart of a method and dtype on a slow
    link: what a sync's wait costs in time to a loss, not in tokens)."""
    load = common.load_average()
    runs: dict[str, dict[int, dict]] = {config: {} for config in args.configs}
    with tempfile.TemporaryDirectory(prefix="convergence_link_") as tmp:
        eval_folder = held_out_halves(Path(tmp))[args.eval_split]
        for seed in args.seeds:
            for config in args.configs:
                run = _group0_curve(args, Path(tmp), config, seed, args.steps, eval_folder)
                runs[config][seed] = run
                end = max(run["curve"])
                print(f"[convergence] {link_text(args.rate)} {config} seed {seed}: eval loss "
                      f"{run['curve'][end]:.4f} after {end:.0f} s", flush=True)  # fmt: skip
    summary = {}
    for config, by_seed in runs.items():
        ends = {str(seed): max(run["curve"]) for seed, run in by_seed.items()}
        summary[config] = {
            "final_loss_per_seed": {s: by_seed[int(s)]["curve"][end] for s, end in ends.items()},
            "final_s_per_seed": ends,
        }
    title = (f"{args.flavor}, 2 groups x {args.steps} steps, H={args.sync_steps}, "
             f"{link_text(args.rate)}, seeds {args.seeds}")  # fmt: skip
    result = {
        "benchmark": "convergence_link",
        "settings": {
            **settings(args),
            "link": link_text(args.rate),
            "seeds": args.seeds,
            "loss": "group 0's held-out loss (K batches), at each of its sync points",
            "chosen_from_sweep": chosen or None,
            "load_avg_1min_at_start": round(load, 2),
        },
        "parameters": args.parameters,
        "eval_split": args.eval_split,
        "summary": summary,
        "curves": wall_clock_json(runs),
        "png": plot_wall_clock(runs, args.png, title),
    }
    path = provenance.write_result(args.out, result, provenance.command_line(__file__, argv))
    print(f"[convergence] wrote {path} and {result['png']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = take_from_sweep(args) if args.from_sweep else {}
    if args.sweep_lr or args.sweep_outer_lr or args.sweep_outer_momentum:
        return sweep(args)
    if args.straggler is not None:
        return straggler_main(args, argv, chosen)
    if args.link:
        return link_main(args, argv, chosen)
    load = common.load_average()
    curves = load_reusable(args)
    command = provenance.command_line(__file__, argv)

    def save(curves: Curves) -> dict:
        done = {c: by_seed for c, by_seed in curves.items() if by_seed}
        summary = summarize(done, args.parameters)
        result = {
            "benchmark": "convergence",
            "settings": {
                **settings(args),
                "chosen_from_sweep": chosen or None,
                "load_avg_1min_at_start": round(load, 2),
            },
            "parameters": args.parameters,
            "eval_split": args.eval_split,
            "seeds": sorted({s for by_seed in done.values() for s in by_seed}),
            "summary": summary,
            "target": TARGETS,
            "verdicts": verdicts(summary),
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
        run_all(args, Path(tmp), curves, save, args.eval_split)
    result = save(curves)
    title = (
        f"{args.flavor}, seq {args.seq_len}, batch {args.batch}/group, 2 groups x "
        f"{args.steps} steps, H={args.sync_steps}, seeds {result['seeds']}, AdamW {args.lr:g}\n"
        f"outer SGD (Nesterov): DiLoCo lr {args.outer_lr}, momentum {args.outer_momentum}; "
        "async lr {}, momentum {}".format(*async_outer(args))
    )
    result["png"] = plot({c: curves[c] for c in args.configs if curves.get(c)}, args.png, title)
    provenance.write_result(args.out, result, command)
    for config, row in result["summary"].items():
        print(
            f"[convergence] {config:17s} final eval loss {row['final_eval_loss_mean']:.4f} "
            f"({row['final_eval_loss_range'][0]:.4f}-{row['final_eval_loss_range'][1]:.4f}, "
            f"{row['tokens_per_parameter']} tokens/parameter)"
            f"  ratio to sync_dp {row.get('ratio_to_sync_dp', float('nan')):.4f}"
        )
    for key, verdict in result["verdicts"].items():
        print(f"[convergence] {key}: {verdict}")
    print(f"[convergence] wrote {args.out} and {result['png']}")
    return 0


if __name__ == "__main__":
    common.stop_cleanly_on_sigterm()
    sys.exit(main())
