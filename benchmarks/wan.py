"""Compute utilisation over an emulated WAN: synchronous FT vs (Streaming, async) DiLoCo.

    sudo .venv/bin/python -m benchmarks.wan            # the README's figures (~10 min)
    sudo .venv/bin/python -m benchmarks.wan --smoke    # tens of seconds; checks the plumbing

Each replica group runs in its own network namespace, joined to the lighthouse's namespace by a
veth pair and a bridge; each group's link is shaped with ``tc tbf`` to ``--rates`` Mbit/s in
both directions (``benchmarks/netns.py``). This kernel has no ``netem``: no latency is added,
only bandwidth is limited. Groups bind and advertise their namespace address
(``--fault_tolerance.hostname=10.123.0.1x``, ``GLOO_SOCKET_IFNAME=wan0``). Group i is pinned to
core i (``taskset``), one thread each.

**Goodput** (``--goodput``): per group, the tokens of inner steps that reached a committed
global model (a dropped sync's period counts nothing) per wall-second, over the whole job
(from its first ``train.started`` to the group's last step) and in the steady state (the
window below), divided by the same group's tokens per second without fault tolerance. That
baseline (``no_ft_pair``) runs first in every repeat: every group's trainer at once, without
torchft, pinned and slowed (``--straggler``) as in the FT runs, for as many steps. The job's
goodput is the groups' summed goodput over their summed baselines. With ``--repeats`` the
summary gives the median and range of each.

Compute utilisation (a diagnostic) = time in forward/backward, gradient clipping and the inner
optimizer update ÷ wall time, per group, over the measured steps (the ``bench.timing`` events of the
trainers in ``benchmarks/timed_trainer.py``). Synchronous FT: the steps after the first
``--sync-ft-warmup``. Semi-sync: ``--periods`` + 1 periods of H steps are run and periods 2 to
``--periods`` measured, whole periods, each with one sync point (the first period warms up; the
last holds the end of training, where async DiLoCo's closing sync waits for its all-reduce).
Bytes per group per step: the payload (sync FT: the fp32 gradients of every parameter each
step; semi-sync: the ``bytes_sent`` of each ``semi_sync.sync`` event, summed, ÷ steps) and what
the group's interface actually sent
(its ``tx_bytes`` over the run ÷ steps, IP headers and lighthouse traffic included). ``no_ft``
(one group alone, no torchft) is the ceiling of the metric on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from benchmarks import ft_common as common
from benchmarks import netns, provenance
from benchmarks.timed_trainer import TIMING
from torchtitan.experiments.fault_tolerance.events import SYNC
from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.tools.cluster import Launch, LighthouseSettings, Process, ProcessSpec
from torchtitan.tools.events import Event
from torchtitan.trainer import TRAINING_STARTED

LIGHTHOUSE_PORT = 19610  # inside the hub namespace only (a fresh network stack: always free)
ORDER = ["no_ft", "sync_ft", "diloco", "streaming_diloco", "async_diloco", "async_dylu"]
#: Variants run only when named: DyLU without the speed probe of its first period.
VARIANTS = ["async_dylu_no_probe"]
#: The goodput baseline: every group's trainer without fault tolerance, all at once, pinned and
#: slowed (``--straggler``) as in the FT runs; run first in every repeat with ``--goodput``.
BASELINE = "no_ft_pair"
#: Where this file's figures are judged: wait shares against plan.py's verdict; goodput (a
#: ratio of wall-clock speeds between processes) is reported only.
JUDGED_BY = "benchmarks/headline.py"


def in_namespace(wan: netns.Wan, namespace: str) -> Launch:
    """Run a process inside ``namespace``."""

    def launch(spec: ProcessSpec) -> ProcessSpec:
        return ProcessSpec([*wan.exec_prefix(namespace), *spec.argv], spec.env)

    return launch


def group_in_its_namespace(wan: netns.Wan, index: int, spec: ProcessSpec) -> ProcessSpec:
    """Group ``index`` on core ``index``, in its namespace, gloo on the namespace's link."""
    spec = in_namespace(wan, wan.group_ns(index))(common.pin_to_core(index, spec))
    return ProcessSpec(spec.argv, {**spec.env, "GLOO_SOCKET_IFNAME": netns.GROUP_IFACE})


@contextlib.contextmanager
def emulated_links(
    groups: int,
    rate: float | None,
    *,
    min_replicas: int | None = None,
    heartbeat_timeout_ms: int = 5000,
) -> Iterator[tuple[netns.Wan, dict[str, Any]]]:
    """Namespaces and a link of ``rate`` Mbit/s (None: unshaped) per replica group, and the
    options of :func:`common.trainer_job` that launch the lighthouse in the hub namespace and
    group i in its own, on core i. Start the lighthouse on ``LIGHTHOUSE_PORT``; give group i
    :func:`hostname_flag`."""
    lighthouse = LighthouseSettings(
        min_replicas=groups if min_replicas is None else min_replicas,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        host=netns.HUB_IP,
    )
    with netns.Wan(groups, rate) as wan:
        yield (
            wan,
            {
                "lighthouse": lighthouse,
                "launch_group": functools.partial(group_in_its_namespace, wan),
                "launch_lighthouse": in_namespace(wan, wan.hub),
            },
        )


def hostname_flag(index: int) -> str:
    """The address group ``index`` tells its peers: its end of its link."""
    return f"--fault_tolerance.hostname={netns.group_ip(index)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and steps (CI)")
    p.add_argument("--rates", type=float, nargs="+", default=[100.0, 1000.0],
                   help="link rates to emulate, Mbit/s (default 100 1000)")  # fmt: skip
    p.add_argument("--methods", nargs="+", default=ORDER, choices=ORDER + VARIANTS,
                   help="default: all but async_dylu_no_probe (DyLU with "
                   "dylu_probe_steps=0)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each method and rate, interleaved; the summary takes the "
                   "median run (by utilisation)")  # fmt: skip
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sync-steps", type=int, default=20, help="H of DiLoCo and Streaming DiLoCo")
    p.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo fragments")
    p.add_argument("--delay", type=int, default=2, help="Streaming DiLoCo fragment_sync_delay")
    p.add_argument("--periods", type=int, default=3,
                   help="semi-sync: measured periods + 1 (one more runs after them)")  # fmt: skip
    p.add_argument("--straggler", type=float, default=1.0,
                   help="group 1 computes this many times the work of each step "
                   "(training.emulate_slowdown; 1: no straggler)")  # fmt: skip
    p.add_argument("--groups", type=int, default=2,
                   help="replica groups (group i on core i mod the cores: with more "
                   "groups than cores utilisation means little, bytes still do)")  # fmt: skip
    p.add_argument("--pseudo-grad-dtypes", nargs="+", default=["float32"],
                   choices=PSEUDO_GRAD_DTYPES,
                   help="fault_tolerance.pseudo_grad_dtype of the semi-sync methods; each "
                   "one is a run of every semi-sync method")  # fmt: skip
    p.add_argument("--error-feedback", action="store_true",
                   help="fault_tolerance.error_feedback (with a compressed dtype; sparse has "
                   "it always, and outer momentum 0)")  # fmt: skip
    p.add_argument("--sync-ft-steps", type=int, default=20)
    p.add_argument("--sync-ft-warmup", type=int, default=5)
    p.add_argument("--max-load", type=float, default=1.5,
                   help="before each run wait (<= 2 min) for load below this")  # fmt: skip
    p.add_argument("--out", type=Path, help=provenance.output_help("wan.json"))
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--png", type=Path, default=None, help="chart (default: --out, as .png)")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep every run's job folder (logs, events) under this folder")  # fmt: skip
    p.add_argument("--goodput", action="store_true",
                   help="in every repeat, first run the baseline (each group's trainer without "
                   "fault tolerance, all at once, pinned and slowed alike) and report each "
                   "run's goodput against it")  # fmt: skip
    p.add_argument("--summarize-only", action="store_true",
                   help="recompute the summary of the JSON at --out, run nothing")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.flavor, args.seq_len, args.batch = "debugmodel_small", 32, 2
        args.sync_steps, args.fragments, args.delay, args.periods = 4, 2, 1, 2
        args.sync_ft_steps, args.sync_ft_warmup = 4, 2
        args.rates = args.rates if argv and "--rates" in argv else [100.0]
        args.max_load = float("inf")
    args.pseudo_grad_dtype = args.pseudo_grad_dtypes[0]
    args.out = args.out or provenance.default_output("wan.json", args.smoke)
    args.png = args.png or args.out.with_suffix(".png")
    return args


def method_args(method: str, args: argparse.Namespace) -> tuple[list[str], int, int, int]:
    """(trainer flags, steps, warm-up steps, last measured step) of one method."""
    if method == BASELINE:  # as long as the semi-sync runs, the whole run measured
        return [], (args.periods + 1) * args.sync_steps, 1, (args.periods + 1) * args.sync_steps
    if method in ("no_ft", "sync_ft"):
        return [], args.sync_ft_steps, args.sync_ft_warmup, args.sync_ft_steps
    semi_sync_method = "async_diloco" if method.startswith("async") else "diloco"
    flags = [
        f"--fault_tolerance.semi_sync_method={semi_sync_method}",
        f"--fault_tolerance.sync_steps={args.sync_steps}",
    ]
    if method.startswith("async_dylu"):
        flags.append("--fault_tolerance.dynamic_local_steps")
    if method == "async_dylu_no_probe":
        flags.append("--fault_tolerance.dylu_probe_steps=0")
    flags += common.dtype_flags(args.pseudo_grad_dtype, args.error_feedback)
    if method == "streaming_diloco":
        flags += [
            f"--fault_tolerance.num_fragments={args.fragments}",
            f"--fault_tolerance.fragment_sync_delay={args.delay}",
        ]
    h = args.sync_steps
    return flags, (args.periods + 1) * h, h, args.periods * h


def straggler_args(method: str, group: int, args: argparse.Namespace) -> list[str]:
    """Group 1 is the straggler (``--straggler``), in every method with two groups and in the
    goodput baseline alike: real extra compute per step, not a sleep
    (``training.emulate_slowdown``, which works without fault tolerance too)."""
    if group != 1 or args.straggler == 1.0 or method == "no_ft":  # no_ft: group 0 alone
        return []
    return [f"--training.emulate_slowdown={args.straggler}"]


def sync_point_steps(method: str, events: Iterable[Event], h: int) -> list[int]:
    """The steps at which a semi-sync group passed its sync points. Blocking DiLoCo reports
    each sync at its sync point; async DiLoCo reports sync k at sync point k + 1 (the first
    sync point reports nothing: it comes after sync 1's ``inner_steps``, ``h`` unless DyLU's
    speed probe planned the first period) and the last sync once more at the end of
    training."""
    syncs = [e for e in events if e.name == SYNC.name and e.step is not None]
    steps = [e.step for e in syncs if e.step is not None]
    if method.startswith("async"):
        first = int(syncs[0].fields.get("inner_steps", h)) if syncs else h
        return [first, *steps[:-1]]
    return steps


def utilisation(events: Iterable[Event], warmup: int, last: int) -> dict[str, float]:
    """Compute utilisation over steps ``warmup`` + 1 .. ``last`` from a group's
    ``bench.timing`` events."""
    rows = {
        e.step: (e["compute_s"], e["t"])
        for e in events
        if e.name == TIMING.name and e.step is not None
    }
    if warmup not in rows or last not in rows:
        raise ValueError(f"no timing event of step {warmup} or {last} (have {sorted(rows)})")
    (c0, t0), (c1, t1) = rows[warmup], rows[last]
    return {
        "compute_utilisation": (c1 - c0) / (t1 - t0),
        "compute_s": c1 - c0,
        "wall_s": t1 - t0,
        "steps": last - warmup,
        "compute_s_per_step": (c1 - c0) / (last - warmup),
        "wall_s_per_step": (t1 - t0) / (last - warmup),
    }


def semi_sync_window(
    method: str, events: Iterable[Event], args: argparse.Namespace
) -> tuple[int, int]:
    """The steps that end a group's first period and its ``--periods``-th: the sync points
    that close a period (Streaming DiLoCo passes one per fragment in each period)."""
    points = sync_point_steps(method, events, args.sync_steps)
    per_period = args.fragments if method == "streaming_diloco" else 1
    return points[per_period - 1], points[args.periods * per_period - 1]


def whole_run_utilisation(events: Iterable[Event]) -> float:
    """Compute seconds over wall seconds from ``train.started`` to the last step: start-up
    after it, every period (the first, with its waits, too) and the closing sync count."""
    found = list(events)
    started = [e.time for e in found if e.name == TRAINING_STARTED.name]
    timings = [e for e in found if e.name == TIMING.name]
    if not started or not timings:
        raise ValueError("no train.started or bench.timing event")
    last = max(timings, key=lambda e: e.time)
    return float(last["compute_s"]) / (last.time - started[0])


def committed_tokens(
    method: str, events: Iterable[Event], tokens_per_step: int, h: int, fragments: int
) -> list[tuple[int, int]]:
    """(sync point step, tokens) of each committed sync of a semi-sync group: the tokens of
    the inner steps whose period ended in that sync (async DiLoCo: the sync's ``tokens``; a
    blocking method: its period's steps). A dropped sync's tokens count nowhere."""
    syncs = [e for e in events if e.name == SYNC.name and e.step is not None]
    points = sync_point_steps(method, syncs, h)
    found = []
    for point, e in zip(points, syncs, strict=False):
        if not e["committed"]:
            continue
        if method.startswith("async"):
            found.append((point, int(e["tokens"])))
        else:
            period = h // (fragments if method == "streaming_diloco" else 1)
            found.append((point, period * tokens_per_step))
    return found


def goodput(
    method: str,
    events: list[Event],
    job_start: float,
    window: tuple[int, int],
    args: argparse.Namespace,
) -> dict[str, float]:
    """A group's goodput in tokens per second: whole run (tokens that reached a committed
    global model, from the job's first ``train.started`` to this group's last step) and steady
    state (the committed syncs in ``window``, over its wall time). Synchronous FT and the
    baseline: every committed step's tokens."""
    tokens_per_step = args.batch * args.seq_len
    timings = {e.step: e for e in events if e.name == TIMING.name and e.step is not None}
    last = timings[max(timings)]
    if method in ("no_ft", "sync_ft", BASELINE):
        done = [(step, tokens_per_step) for step in sorted(timings)]
    else:
        done = committed_tokens(method, events, tokens_per_step, args.sync_steps, args.fragments)
    whole = sum(t for _, t in done) / (last.time - job_start)
    a, b = window
    in_window = sum(t for point, t in done if a < point <= b)
    steady = in_window / (timings[b].time - timings[a].time) if a in timings else 0.0
    return {"whole_run_tokens_per_s": whole, "steady_tokens_per_s": steady}


def group_figures(
    proc: Process,
    method: str,
    steps: int,
    window: tuple[int, int],
    tx_bytes: int,
    args: argparse.Namespace,
    job_start: float,
) -> dict[str, object]:
    """One group's compute utilisation, goodput, payload and wire bytes per step, from its
    events and its interface's ``tx_bytes`` over the run. Semi-sync: steady state over whole
    periods, from its first sync point to its ``--periods``-th (with DyLU a group's periods
    have its own lengths)."""
    events = common.trainer_events(proc, TIMING, SYNC, TRAINING_STARTED)
    if method not in ("no_ft", "sync_ft", BASELINE):
        window = semi_sync_window(method, events, args)
        steps = max(e.step for e in events if e.name == TIMING.name and e.step is not None)
    row: dict[str, object] = utilisation(events, *window)
    row["whole_run_utilisation"] = round(whole_run_utilisation(events), 4)
    row.update(goodput(method, events, job_start, window, args))
    started = [e for e in events if e.name == TRAINING_STARTED.name]
    n_params = started[0]["parameters"] if started else 0
    sent = [e for e in events if e.name == SYNC.name]
    syncs = [
        {"step": e.step, "committed": e["committed"], "ms": 1000 * e["seconds"],
         "mib": e["bytes_sent"] / 2**20, "inner_steps": e["inner_steps"],
         "weight": e["weight"],
         "compression_ms": None if e["compression_s"] is None else 1000 * e["compression_s"]}
        for e in sent
    ]  # fmt: skip
    if method == "sync_ft":
        payload_per_step = n_params * 4.0  # one fp32 gradient all-reduce per step
    elif method == "no_ft":
        payload_per_step = 0.0
    else:
        payload_per_step = sum(e["bytes_sent"] for e in sent) / steps
    row.update(
        wire_tx_bytes_per_sync=tx_bytes / len(sent) if sent else None,
        parameters=n_params,
        emulate_slowdown=started[0]["emulate_slowdown"] if started else None,
        payload_bytes_per_step=payload_per_step,
        wire_tx_bytes_per_step=tx_bytes / steps,
        syncs=syncs,
    )
    return row


def run_one(
    folder: Path, method: str, rate: float | None, args: argparse.Namespace
) -> dict[str, object]:
    flags, steps, warmup, last = method_args(method, args)
    train = [
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        f"--training.steps={steps}",
        "--metrics.log_freq=10",
        "--validation.enable=false",
        "--metrics.cpu_peak_flops=-1",
        common.TIMED_MODULE,
        *flags,
    ]
    groups = 1 if method == "no_ft" else args.groups
    alone = method in ("no_ft", BASELINE)
    with emulated_links(groups, rate) as (wan, job_options):
        with common.trainer_job(folder, groups, train, **job_options) as job:
            if alone:
                procs = [
                    common.start_alone(
                        job,
                        f"{method}_g{i}",
                        [*train, *straggler_args(method, i, args)],
                        functools.partial(group_in_its_namespace, wan, i),
                    )
                    for i in range(groups)
                ]
            else:
                job.start_lighthouse(LIGHTHOUSE_PORT)
                procs = [
                    job.start_group(
                        i,
                        [hostname_flag(i), *straggler_args(method, i, args)],
                    )
                    for i in range(groups)
                ]
            common.wait_all(procs, args.timeout)
        tx = [wan.tx_bytes(i) for i in range(groups)]
        qdisc = wan.qdisc(0) if rate is not None else ""
    job_start = min(e.time for proc in procs for e in common.trainer_events(proc, TRAINING_STARTED))
    per_group = [
        group_figures(proc, method, steps, (warmup, last), tx[i], args, job_start)
        for i, proc in enumerate(procs)
    ]
    mean = sum(g["compute_utilisation"] for g in per_group) / len(per_group)  # type: ignore[misc]
    return {
        "method": method,
        "rate_mbit": rate,
        "straggler": args.straggler,
        "groups_in_job": groups,
        "pseudo_grad_dtype": args.pseudo_grad_dtype if flags else None,
        "error_feedback": (args.error_feedback or args.pseudo_grad_dtype == "sparse")
        if flags
        else None,
        "steps": steps,
        "measured_steps": f"{warmup + 1}..{last}",
        "compute_utilisation": round(mean, 4),
        "payload_mib_per_group_per_step": round(
            sum(g["payload_bytes_per_step"] for g in per_group) / len(per_group) / 2**20,
            3,  # type: ignore[misc]
        ),
        "wire_tx_mib_per_group_per_step": round(
            sum(g["wire_tx_bytes_per_step"] for g in per_group) / len(per_group) / 2**20,
            3,  # type: ignore[misc]
        ),
        "min_group_utilisation": round(min(g["compute_utilisation"] for g in per_group), 4),  # type: ignore[type-var]
        "whole_run_utilisation": [g["whole_run_utilisation"] for g in per_group],
        "qdisc": qdisc,
        "groups": per_group,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize_only:  # recompute the summary of an existing JSON
        data = json.loads(args.out.read_text())
        data["summary"] = summarize(data["runs"])
        data["png"] = plot(data["runs"], args.png)
        data["goodput_png"] = plot_goodput(data["runs"], goodput_png(args.png))
        provenance.rewrite_result(args.out, data)  # the numbers are still that run's
        return 0
    why = netns.unavailable()
    if why is not None:
        print(f"[wan] cannot emulate a WAN here: {why}", file=sys.stderr)
        return 2
    command = provenance.command_line(__file__, argv)
    runs: list[dict[str, object]] = []
    result: dict[str, object] = {
        "benchmark": "wan",
        "settings": {
            "groups": args.groups,
            "pseudo_grad_dtypes": args.pseudo_grad_dtypes,
            "error_feedback": args.error_feedback,
            "topology": "each group in its own network namespace, veth to a bridge in the "
            "lighthouse's namespace; tc tbf on both ends of each veth (upload and download)",
            "latency": "none added: this kernel has tbf/htb but no netem, so only bandwidth "
            "is emulated (no RTT); real inter-continental links add 50-150 ms per round trip",
            "pinning": "group i on core i (taskset -c i), OMP_NUM_THREADS=1",
            "flavor": args.flavor,
            "seq_len": args.seq_len,
            "local_batch_size": args.batch,
            "sync_steps_H": args.sync_steps,
            "streaming": f"{args.fragments} fragments, fragment_sync_delay={args.delay}",
            "async_diloco": "async_update=eager (the default), 1 fragment",
            "async_dylu": "async_diloco with dynamic_local_steps (DyLU)",
            "async_dylu_no_probe": "the same with dylu_probe_steps=0 (no speed probe in the "
            "first period)",
            "whole_run_utilisation": "per group, compute seconds / wall seconds from "
            "train.started to its last step",
            "straggler": (
                f"group 1 computes {args.straggler:g}x the forward/backward work per step "
                "(training.emulate_slowdown: extra passes, real compute on its core)"
                if args.straggler != 1.0
                else "none"
            ),
            "sync_ft_steps": args.sync_ft_steps,
            "semi_sync_steps": (args.periods + 1) * args.sync_steps,
            "semi_sync_measured": f"periods 2..{args.periods} (steps {args.sync_steps + 1}.."
            f"{args.periods * args.sync_steps})",
            "compute": "forward+backward, gradient clipping, inner optimizer update "
            "(benchmarks/timed_trainer.py)",
        },
        "judged_by": JUDGED_BY,
        "runs": runs,
    }
    semi_sync = {"diloco", "streaming_diloco", "async_diloco", "async_dylu"}
    first = [BASELINE] if args.goodput else []
    plan = [
        (repeat, rate, method, dtype)
        for repeat in range(args.repeats)
        for rate in args.rates
        for method in (first if rate == args.rates[0] else []) + args.methods
        for dtype in (args.pseudo_grad_dtypes if method in semi_sync else ["float32"])
        # no network traffic: one rate is enough
        if method not in ("no_ft", BASELINE) or rate == args.rates[0]
    ]
    baseline: dict[str, object] | None = None
    kept = contextlib.nullcontext(str(args.keep)) if args.keep else None
    with kept or tempfile.TemporaryDirectory(prefix="wan_") as tmp:
        for repeat, rate, method, dtype in plan:
            load = common.wait_for_quiet_machine(args.max_load, 120)
            this = argparse.Namespace(**{**vars(args), "pseudo_grad_dtype": dtype})
            folder = Path(tmp) / f"{method}_{dtype}_{rate:g}_{repeat}"
            run = run_one(folder, method, rate, this)
            run["repeat"] = repeat
            run["load_avg_1min_before"] = round(load, 2)
            run["load_avg_1min_after"] = round(common.load_average(), 2)
            if method == BASELINE:
                baseline = run
            elif baseline is not None:
                add_goodput_ratios(run, baseline)
            runs.append(run)
            print(
                f"[wan] {rate:6g} Mbit/s {method:17s} {dtype:8s} (run {repeat + 1}/{args.repeats}) "
                f"compute utilisation "
                f"{run['compute_utilisation']:.3f} (whole run, per group: "
                f"{', '.join(f'{u:.3f}' for u in run['whole_run_utilisation'])})  payload "
                f"{run['payload_mib_per_group_per_step']:.2f} MiB/step  wire "
                f"{run['wire_tx_mib_per_group_per_step']:.2f} MiB/step  (load {load:.2f})"
                + goodput_line(run),
                flush=True,
            )
            result["summary"] = summarize(runs)
            # After every run: partial results survive.
            provenance.write_result(args.out, result, command)
    result["png"] = plot(runs, args.png)
    result["goodput_png"] = plot_goodput(runs, goodput_png(args.png))
    path = provenance.write_result(args.out, result, command)
    print(f"[wan] wrote {path}, {result['png']} and {result['goodput_png']}")
    return 0


def add_goodput_ratios(run: dict[str, object], baseline: dict[str, object]) -> None:
    """Each group's goodput divided by its baseline's tokens per second (the same group index
    of the repeat's baseline pair, whole run and steady state), and the job's (the groups'
    summed goodput over their summed baselines)."""
    groups, base = run["groups"], baseline["groups"]
    assert isinstance(groups, list) and isinstance(base, list)
    for g, b in zip(groups, base, strict=False):
        g["goodput_whole_run"] = round(g["whole_run_tokens_per_s"] / b["whole_run_tokens_per_s"], 4)
        g["goodput_steady"] = round(g["steady_tokens_per_s"] / b["steady_tokens_per_s"], 4)
    paired = base[: len(groups)]
    run["job_goodput_whole_run"] = round(
        sum(g["whole_run_tokens_per_s"] for g in groups)
        / sum(b["whole_run_tokens_per_s"] for b in paired),
        4,
    )
    run["job_goodput_steady"] = round(
        sum(g["steady_tokens_per_s"] for g in groups)
        / sum(b["steady_tokens_per_s"] for b in paired),
        4,
    )
    run["baseline_repeat"] = baseline["repeat"]


def goodput_line(run: dict[str, object]) -> str:
    groups = run["groups"]
    assert isinstance(groups, list)
    if "job_goodput_whole_run" not in run:
        return ""
    per_group = ", ".join(f"{g['goodput_whole_run']:.3f}/{g['goodput_steady']:.3f}" for g in groups)
    return f"  goodput whole/steady per group {per_group}, job {run['job_goodput_whole_run']:.3f}"


def plot(runs: list[dict[str, object]], path: Path) -> str:
    """Bar chart of compute utilisation per method and link rate (the median repeat); the
    PNG's path, or why none was written (matplotlib is the optional ``bench`` extra)."""
    runs = median_runs(runs)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    rates = sorted({float(r["rate_mbit"]) for r in runs if r["method"] != "no_ft"})  # type: ignore[arg-type]
    methods = [m for m in ORDER + VARIANTS if m != "no_ft" and any(r["method"] == m for r in runs)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(rates))
    for j, rate in enumerate(rates):
        values = [
            next((r["compute_utilisation"] for r in runs
                  if r["method"] == m and r["rate_mbit"] == rate), 0.0)
            for m in methods
        ]  # fmt: skip
        xs = [i + (j - (len(rates) - 1) / 2) * width for i in range(len(methods))]
        bars = ax.bar(xs, values, width, label=f"{rate:g} Mbit/s")  # type: ignore[arg-type]
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("compute utilisation")
    ax.set_title("2 replica groups over tc-tbf links (no latency)")
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def goodput_png(path: Path) -> Path:
    """Where the goodput chart goes: next to the utilisation chart."""
    return path.with_name(path.stem + "_goodput.png")


def run_label(run: dict[str, object]) -> str:
    """A bar's label: the method, and its pseudo-gradient dtype when not float32."""
    dtype = run.get("pseudo_grad_dtype")
    return str(run["method"]) + ("" if dtype in (None, "float32") else f"\n{dtype}")


def plot_goodput(runs: list[dict[str, object]], path: Path) -> str:
    """Bars of the job's goodput per method, dtype and link rate: whole run (solid) next to
    steady state (hatched), the median over repeats, whiskers from the lowest to the highest
    repeat; the PNG's path, or why none was written."""
    medians = [r for r in median_runs(runs) if r.get("repeats_goodput")]
    if not medians:
        return "no goodput measured (--goodput): no goodput PNG written"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    rates = sorted({float(r["rate_mbit"]) for r in medians})  # type: ignore[arg-type]
    labels = list(dict.fromkeys(run_label(r) for r in medians))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(labels) * len(rates)), 4.5))
    width = 0.8 / (2 * len(rates))
    for j, rate in enumerate(rates):
        for k, kind in enumerate(("job_whole_run", "job_steady")):
            xs, med, low, high = [], [], [], []
            for i, label in enumerate(labels):
                run = next((r for r in medians
                            if run_label(r) == label and r["rate_mbit"] == rate), None)  # fmt: skip
                if run is None:
                    continue
                spread = run["repeats_goodput"][kind]  # type: ignore[index]
                if spread is None:
                    continue
                xs.append(i + (2 * j + k - (2 * len(rates) - 1) / 2) * width)
                med.append(spread["median"])
                low.append(spread["median"] - spread["min"])
                high.append(spread["max"] - spread["median"])
            if not xs:
                continue
            window = "steady state" if k else "whole run"
            bars = ax.bar(xs, med, width, yerr=[low, high], capsize=2, color=f"C{j}",
                          hatch="//" if k else None, alpha=0.6 if k else 1.0,
                          label=f"{rate:g} Mbit/s, {window}")  # fmt: skip
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("job goodput (committed tokens/s ÷ no-FT tokens/s)")
    repeats = min(int(r["repeats_goodput"]["repeats"]) for r in medians)  # type: ignore[index]
    slowest = max(float(r.get("straggler") or 1.0) for r in medians)  # type: ignore[arg-type]
    straggler = f", group 1 at {slowest:g} x the work per step" if slowest != 1.0 else ""
    ax.set_title(f"2 replica groups over tc-tbf links{straggler}\nmedian of {repeats}+ "
                 "repeats, whiskers: their range", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def median_runs(runs: list[dict[str, object]]) -> list[dict[str, object]]:
    """Of the repeats of each method and rate, the run with the median utilisation (the lower
    middle one for an even count), in first-run order."""
    by_key: dict[tuple[object, object, object], list[dict[str, object]]] = {}
    for run in runs:
        key = (run["method"], run["rate_mbit"], run.get("pseudo_grad_dtype"))
        by_key.setdefault(key, []).append(run)
    picked = []
    for repeats in by_key.values():
        ordered = sorted(repeats, key=lambda r: float(r["compute_utilisation"]))  # type: ignore[arg-type]
        median = dict(ordered[(len(ordered) - 1) // 2])
        median["repeats_utilisation"] = [r["compute_utilisation"] for r in repeats]
        median["repeats_whole_run"] = [r.get("whole_run_utilisation") for r in repeats]
        if all("job_goodput_whole_run" in r for r in repeats):
            median["repeats_goodput"] = goodput_spread(repeats)
        picked.append(median)
    return picked


def goodput_spread(repeats: list[dict[str, object]]) -> dict[str, object]:
    """Median and range over the repeats of the job's whole-run goodput and of each group's
    whole-run and steady-state goodput."""

    def spread(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"median": ordered[(len(ordered) - 1) // 2], "min": ordered[0], "max": ordered[-1]}

    groups = [r["groups"] for r in repeats]
    count = min(len(g) for g in groups)  # type: ignore[arg-type]
    return {
        "repeats": len(repeats),
        "job_whole_run": spread([float(r["job_goodput_whole_run"]) for r in repeats]),  # type: ignore[arg-type]
        # (files written before the job's steady-state goodput was recorded have none)
        "job_steady": (
            spread([float(r["job_goodput_steady"]) for r in repeats])  # type: ignore[arg-type]
            if all("job_goodput_steady" in r for r in repeats)
            else None
        ),
        "job_whole_run_repeats": [r["job_goodput_whole_run"] for r in repeats],
        "per_group_whole_run": [
            spread([float(g[i]["goodput_whole_run"]) for g in groups])
            for i in range(count)  # type: ignore[index]
        ],
        "per_group_steady": [
            spread([float(g[i]["goodput_steady"]) for g in groups])
            for i in range(count)  # type: ignore[index]
        ],
    }


def summarize(runs: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """Per method and rate, of its median run: the measured utilisation, goodput and bytes
    (``headline.py`` judges the wait shares; goodput is reported). Where a ``no_ft`` run
    exists, also ``utilisation_at_no_ft_compute_speed``: the utilisation had each step's
    compute taken as long as in ``no_ft`` while the non-compute time per step stayed as
    measured, i.e. ``c0 / (c0 + (wall - compute) per step)`` (other load on the machine slows
    compute and so flatters the measured figure; this estimate corrects for that). With
    repeats, every repeat's utilisation is listed too."""
    summary: dict[str, dict[str, object]] = {}
    runs = median_runs(runs)
    base = [r for r in runs if r["method"] == "no_ft"]
    c0 = None
    if base:
        groups = base[0]["groups"]
        c0 = sum(g["compute_s_per_step"] for g in groups) / len(groups)  # type: ignore[misc,union-attr,arg-type]
    for run in runs:
        key = f"{run['method']}@{run['rate_mbit']:g}mbit"
        straggler = float(run.get("straggler", 1.0))  # type: ignore[arg-type]
        if run.get("pseudo_grad_dtype") not in (None, "float32"):
            key += f"_{run['pseudo_grad_dtype']}" + ("_ef" if run.get("error_feedback") else "")
        if run.get("groups_in_job", 2) not in (1, 2):
            key += f"_{run['groups_in_job']}groups"
        if straggler != 1.0:  # every group must keep computing: the slowest group counts
            key += f"_straggler{straggler:g}"
        groups = run["groups"]
        other = sum(g["wall_s_per_step"] - g["compute_s_per_step"] for g in groups) / len(groups)  # type: ignore[misc,union-attr,arg-type]
        summary[key] = {
            "compute_utilisation": run["compute_utilisation"],
            "repeats_utilisation": run["repeats_utilisation"],
            "per_group_utilisation": [g["compute_utilisation"] for g in groups],  # type: ignore[union-attr,index]
            "per_group_whole_run_utilisation": [g.get("whole_run_utilisation") for g in groups],  # type: ignore[union-attr]
            "goodput": run.get("repeats_goodput"),
            "repeats_per_group_whole_run_utilisation": run.get("repeats_whole_run"),
            "min_group_utilisation": run.get("min_group_utilisation"),
            "per_group_compute_s_per_step": [round(g["compute_s_per_step"], 4) for g in groups],  # type: ignore[union-attr,index]
            "per_group_inner_steps": [
                [s["inner_steps"] for s in g["syncs"]]
                for g in groups  # type: ignore[union-attr,index]
            ],
            "compute_s_per_step": round(
                sum(g["compute_s_per_step"] for g in groups) / len(groups),
                4,  # type: ignore[misc,union-attr,arg-type]
            ),
            "non_compute_s_per_step": round(other, 4),
            "utilisation_at_no_ft_compute_speed": (
                None if c0 is None else round(c0 / (c0 + max(other, 0.0)), 4)
            ),
            "payload_mib_per_group_per_step": run["payload_mib_per_group_per_step"],
            "wire_tx_bytes_per_group_per_sync": [g.get("wire_tx_bytes_per_sync") for g in groups],  # type: ignore[union-attr]
            "sync_ms_per_group": [
                [round(s["ms"], 1) for s in g["syncs"]]
                for g in groups  # type: ignore[union-attr,index]
            ],
            "compression_ms_per_group": [
                [s.get("compression_ms") for s in g["syncs"]]
                for g in groups  # type: ignore[union-attr,index]
            ],
            "wire_tx_mib_per_group_per_step": run["wire_tx_mib_per_group_per_step"],
        }
    return summary


if __name__ == "__main__":
    # SIGTERM (and SIGINT in a background shell) must unwind the namespaces and processes.
    common.stop_cleanly_on_sigterm()
    sys.exit(main())
