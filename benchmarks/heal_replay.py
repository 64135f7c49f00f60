"""Healing without the WAN: a group restarted from its own checkpoint replays the syncs it
missed, against a full heal in the same job, over an emulated WAN.

    sudo .venv/bin/python -m benchmarks.heal_replay            # the README's figures
    sudo .venv/bin/python -m benchmarks.heal_replay --smoke    # about a minute; the plumbing

One job per link rate, dtype and repeat (interleaved): DiLoCo across 2 replica groups, each in
its own network namespace with a ``tc tbf`` link of ``--rates`` Mbit/s (``benchmarks/netns.py``,
as in ``wan.py``; rate 0: the same namespaces and veths without shaping, as fast as the kernel
copies: the loopback-like baseline of the same job), group i pinned to core i. Group 1
checkpoints at every sync point. In one job, for each case in turn (``full``, then
``--missed`` K = 1, 3, 10):

1. group 1 is killed right after a checkpoint (the job's sync ``s``);
2. group 0 commits syncs ``s+1 .. s+K`` alone (``full``: K = 1);
3. group 0 is held after its next step (``--bench.pause_file``), group 1 restarts from its
   checkpoint (``full``: with ``heal_history_syncs=0``, so it asks for the whole state) and,
   once it has asked for its quorum, group 0 is let go;
4. group 1 heals at group 0's next sync. Measured: what the heal was, the bytes group 1
   received and the seconds from its request until everything arrived (``semi_sync.healed``:
   transfer, syncs replayed, ``bytes_received``, ``receive_s``; a replay's outer steps run
   while the averages arrive), and group 0's longest pause between two inner steps from its
   release until 2 syncs after the heal, with its quorum wait at the heal's sync.

After every heal both groups' global digests must agree at every sync they share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import ft_common as common
from benchmarks import netns, provenance
from benchmarks.timed_trainer import BENCH_PAUSED, BENCH_RESUMED, TIMING
from benchmarks.wan import LIGHTHOUSE_PORT, emulated_links, hostname_flag
from torchtitan.components.checkpoint import CHECKPOINT_SAVED
from torchtitan.experiments.fault_tolerance.events import (
    ASKING_FOR_QUORUM,
    GLOBAL_DIGEST,
    HEALED,
    SYNC,
)
from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.tools.cluster import LocalJob
from torchtitan.tools.events import Event, EventKind

#: Targets (the issues'): a replay's bytes against the same job's full heal, per dtype, for
#: K <= 3 and K = 10 missed syncs.
TARGETS = {"int4": {3: 0.10, 10: 0.30}, "sparse": {3: 0.01, 10: 0.03}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, one case (CI)")
    p.add_argument("--rates", type=float, nargs="+", default=[100.0, 1000.0],
                   help="link rates, Mbit/s (default 100 1000; 0: no shaping)")  # fmt: skip
    p.add_argument("--dtypes", nargs="+", default=["int8", "int4"],
                   choices=PSEUDO_GRAD_DTYPES,
                   help="fault_tolerance.pseudo_grad_dtype (default int8 int4; sparse with "
                   "its error feedback and outer momentum 0)")  # fmt: skip
    p.add_argument("--missed", type=int, nargs="+", default=[1, 3, 10],
                   help="syncs group 1 misses before it replays (default 1 3 10)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--sync-steps", type=int, default=4, help="H of DiLoCo")
    p.add_argument("--max-load", type=float, default=1.5,
                   help="before each job wait (<= 2 min) for load below this")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300, help="seconds per step of a case")
    p.add_argument("--out", type=Path, help=provenance.output_help("heal_replay.json"))
    p.add_argument("--png", type=Path, default=None, help="chart (default: --out, as .png)")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep every job's folder (logs, events) under this folder")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.flavor, args.rates, args.dtypes = "debugmodel_small", [100.0], ["int4"]
        args.missed, args.repeats, args.max_load = [2], 1, float("inf")
    args.out = args.out or provenance.default_output("heal_replay.json", args.smoke)
    args.png = args.png or args.out.with_suffix(".png")
    return args


def link(rate: float) -> str:
    """A link's name in the summary and the logs: ``100 Mbit/s``, or ``unshaped`` (rate 0)."""
    return f"{rate:g} Mbit/s" if rate else "unshaped"


class Watch:
    """Waits on the events of one job's groups as they are written."""

    def __init__(self, job: LocalJob, timeout: float) -> None:
        self.job = job
        self.events = common.GroupEvents(job)
        self.timeout = timeout

    def of(self, replica: int, kind: EventKind) -> list[Event]:
        return self.events.of(self.job.latest(replica), kind)

    def until(
        self, replica: int, kind: EventKind, where: Callable[[Event], bool] = lambda e: True,
        index: int = 0,
    ) -> Event:  # fmt: skip
        """The ``index``-th event of ``kind`` of the group's latest start for which ``where``
        holds (waited for)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            found = [e for e in self.of(replica, kind) if where(e)]
            if len(found) > index:
                return found[index]
            for r in sorted({0, replica}):  # the survivor, and the group waited on
                start = self.job.latest(r)
                if start.poll() is not None:
                    raise RuntimeError(f"group {r} exited ({start.returncode}):\n{start.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"group {replica}: no {kind.name} within {self.timeout:.0f}s")


def committed(number: int) -> Callable[[Event], bool]:
    return lambda e: bool(e["committed"]) and e.sync == number


def hold_at(pause: Path, sync: int | None) -> None:
    """Hold a group (``--bench.pause_file``) once it has committed ``sync`` (None: now)."""
    part = pause.with_suffix(".part")
    part.write_text("" if sync is None else str(sync))
    part.replace(pause)  # atomically: a half-written number would read as "now"


def one_case(
    watch: Watch,
    job: LocalJob,
    case: str,
    missed: int,
    pauses: tuple[Path, Path],
    group1: list[str],
) -> dict[str, Any]:
    """Stop group 1 right after its checkpoint at a sync ``s`` and kill it, let group 0
    commit ``missed`` syncs alone and hold it there, restart group 1 (``full``: asking for
    the whole state), let group 0 go, and measure the heal at its next sync."""
    pause0, pause1 = pauses
    s = max(e.sync or 0 for e in watch.of(0, SYNC) if e["committed"]) + 2
    held1 = len(watch.of(1, BENCH_PAUSED))
    hold_at(pause1, s)
    watch.until(1, BENCH_PAUSED, index=held1)
    checkpoint = watch.of(1, CHECKPOINT_SAVED)[-1]
    job.kill_group(1)
    pause1.unlink()
    held0 = len(watch.of(0, BENCH_PAUSED))
    hold_at(pause0, s + missed)
    watch.until(0, BENCH_PAUSED, index=held0)
    extra = ["--fault_tolerance.heal_history_syncs=0"] if case == "full" else []
    job.start_group(1, [*group1, *extra])
    watch.until(1, ASKING_FOR_QUORUM)
    time.sleep(0.5)  # its quorum request is at the lighthouse
    resumed = len(watch.of(0, BENCH_RESUMED))
    pause0.unlink()
    released = float(watch.until(0, BENCH_RESUMED, index=resumed)["t"])
    healed = watch.until(1, HEALED)
    number = int(healed.sync or 0)
    watch.until(1, SYNC, committed(number + 2))
    end = watch.until(0, SYNC, committed(number + 2))
    # Group 0's inner steps from its release to 2 syncs after the heal (monotonic clock).
    ends = [
        float(e["t"])
        for e in watch.of(0, TIMING)
        if float(e["t"]) >= released and int(e.step or 0) <= int(end.step or 0)
    ]
    gaps = [b - a for a, b in zip([released, *ends], ends, strict=False)] or [0.0]
    survivor_sync = watch.until(0, SYNC, committed(number))
    mine = {e.sync: e["digest"] for e in watch.of(1, GLOBAL_DIGEST)}
    theirs = {e.sync: e["digest"] for e in watch.of(0, GLOBAL_DIGEST)}
    shared = sorted(set(mine) & set(theirs))
    return {
        "case": case,
        "missed_syncs": missed,
        "checkpoint_step": checkpoint.step,
        "checkpoint_sync": s,
        "transfer": healed["transfer"],
        "replayed_syncs": healed["replayed_syncs"],
        "full_because": healed["full_because"],
        "heal_bytes": int(healed["bytes_received"]),
        "heal_receive_s": float(healed["receive_s"]),
        "survivor_longest_step_gap_s": round(max(gaps), 3),
        "survivor_steps_measured": len(ends),
        "survivor_quorum_wait_at_heal_s": round(float(survivor_sync["quorum_wait_s"]), 3),
        "heal_sync": number,
        "digests_agree": bool(shared) and all(mine[s] == theirs[s] for s in shared),
        "shared_digests": len(shared),
    }


def run_job(folder: Path, rate: float, dtype: str, args: argparse.Namespace) -> list[dict]:
    """One job, every case in turn (see the module docstring)."""
    train = [
        common.TIMED_MODULE,
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        "--training.steps=100000",
        "--metrics.log_freq=50",
        "--metrics.log_param_digest",
        "--validation.enable=false",
        "--metrics.cpu_peak_flops=-1",
        "--fault_tolerance.semi_sync_method=diloco",
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        *common.dtype_flags(dtype),
        f"--fault_tolerance.heal_history_syncs={max(args.missed)}",
        "--fault_tolerance.min_replica_size=1",
    ]
    pauses = (folder / "pause_group0", folder / "pause_group1")
    group1 = [
        f"--bench.pause_file={pauses[1]}",
        hostname_flag(1),
        "--checkpoint.enable",
        f"--checkpoint.interval={args.sync_steps}",
        "--checkpoint.keep_latest_k=2",
    ]
    cases = [("full", 1)] + [(f"K={k}", k) for k in args.missed]
    results = []
    links = emulated_links(2, rate or None, min_replicas=1, heartbeat_timeout_ms=2000)
    with links as (_, job_options):
        with common.trainer_job(folder, 2, train, **job_options) as job:
            job.start_lighthouse(LIGHTHOUSE_PORT)
            job.start_group(0, [hostname_flag(0), f"--bench.pause_file={pauses[0]}"])
            job.start_group(1, group1)
            watch = Watch(job, args.timeout)
            watch.until(0, SYNC, committed(2))
            for case, missed in cases:
                results.append(one_case(watch, job, case, missed, pauses, group1))
                if (
                    results[-1]["checkpoint_step"]
                    != results[-1]["checkpoint_sync"] * args.sync_steps
                ):
                    raise RuntimeError(f"group 1's checkpoint is not at its sync: {results[-1]}")
                r = results[-1]
                print(
                    f"[heal_replay] {link(rate):>14s} {dtype:7s} {case:5s} {r['transfer']:6s} "
                    f"replayed {r['replayed_syncs']} syncs, {r['heal_bytes'] / 2**20:8.2f} MiB "
                    f"in {r['heal_receive_s']:.2f}s; survivor's longest step gap "
                    f"{r['survivor_longest_step_gap_s']:.2f}s (quorum wait "
                    f"{r['survivor_quorum_wait_at_heal_s']:.2f}s); digests agree "
                    f"{r['digests_agree']}",
                    flush=True,
                )
    full = results[0]["heal_bytes"]
    for r in results:
        r["bytes_vs_full"] = round(r["heal_bytes"] / full, 4)
    return results


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rate, dtype and case: median and range over the repeats; and the targets."""
    rows: dict[str, Any] = {}
    for run in runs:
        for r in run["cases"]:
            key = f"{link(run['rate_mbit'])} {run['pseudo_grad_dtype']} {r['case']}"
            rows.setdefault(key, []).append(r)
    summary: dict[str, Any] = {}
    for key, found in rows.items():
        entry: dict[str, Any] = {"repeats": len(found)}
        for field in (
            "heal_bytes",
            "bytes_vs_full",
            "heal_receive_s",
            "survivor_longest_step_gap_s",
            "survivor_quorum_wait_at_heal_s",
        ):
            values = [r[field] for r in found]
            entry[field] = {
                "median": statistics.median(values), "min": min(values), "max": max(values)
            }  # fmt: skip
        entry["digests_agree"] = all(r["digests_agree"] for r in found)
        entry["transfers"] = sorted({r["transfer"] for r in found})
        summary[key] = entry
    # Each target per rate, dtype and K, over its repeats (met: 4 of 5, 3 of 3).
    reached: dict[str, list[bool]] = {}
    for run in runs:
        full = next(r for r in run["cases"] if r["case"] == "full")
        for r in run["cases"]:
            if r["case"] == "full":
                continue
            where = f"{link(run['rate_mbit'])} {run['pseudo_grad_dtype']} {r['case']}"
            if run["pseudo_grad_dtype"] in TARGETS:
                bounds = TARGETS[run["pseudo_grad_dtype"]]
                target = bounds[3] if r["missed_syncs"] <= 3 else bounds[10]
                reached.setdefault(f"{where}: bytes <= {target:g} x full", []).append(
                    r["bytes_vs_full"] <= target
                )
            reached.setdefault(f"{where}: survivor's longest pause <= the full heal's", []).append(
                r["survivor_longest_step_gap_s"] <= full["survivor_longest_step_gap_s"]
            )
    summary["targets"] = {
        **{k: common.repeats_verdict(v, "reached it") for k, v in reached.items()},
        "equal global digests after every heal": all(
            r["digests_agree"] for run in runs for r in run["cases"]
        ),
    }
    return summary


def plot(runs: list[dict[str, Any]], path: Path) -> str:
    """Bytes, seconds from the request to the last byte and the survivor's longest pause per
    case (median of the repeats, whiskers their range), per rate and dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG written"
    summary = summarize(runs)
    configs = sorted({(r["rate_mbit"], r["pseudo_grad_dtype"]) for r in runs})
    cases = [c["case"] for c in runs[0]["cases"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    width = 0.8 / max(1, len(configs))
    for j, (rate, dtype) in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(cases))]
        panels = (
            (axes[0], "heal_bytes", 2**20),
            (axes[1], "heal_receive_s", 1),
            (axes[2], "survivor_longest_step_gap_s", 1),
        )
        for ax, field, scale in panels:
            rows = [summary[f"{link(rate)} {dtype} {c}"][field] for c in cases]
            med = [r["median"] / scale for r in rows]
            err = [
                [(r["median"] - r["min"]) / scale for r in rows],
                [(r["max"] - r["median"]) / scale for r in rows],
            ]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=f"{link(rate)}, {dtype}")
    axes[0].set_ylabel("received by the restarted group (MiB)")
    axes[1].set_ylabel("seconds from the request to the last byte")
    axes[2].set_ylabel("survivor's longest pause between two steps (s)")
    for ax in axes:
        ax.set_xticks(range(len(cases)), [f"{c}\n(missed syncs)" if c != "full" else c
                                          for c in cases])  # fmt: skip
        ax.legend(fontsize=8)
    fig.suptitle("A full heal against replaying K missed syncs (DiLoCo, 2 groups; bars: median, "
                 "whiskers: range of the repeats)")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = netns.unavailable()
    if why is not None:
        print(f"[heal_replay] cannot emulate a WAN here: {why}", file=sys.stderr)
        return 2
    common.stop_cleanly_on_sigterm()
    command = provenance.command_line(__file__, argv)
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "heal_replay",
        "settings": {
            "method": "diloco, 1 fragment, 2 replica groups, min_replica_size 1",
            "flavor": args.flavor,
            "seq_len": args.seq_len,
            "local_batch_size": args.batch,
            "sync_steps_H": args.sync_steps,
            "heal_history_syncs": max(args.missed),
            "topology": "each group in its own network namespace; tc tbf on both ends of its "
            "veth (upload and download); no latency added (no netem here)",
            "pinning": "group i on core i, OMP_NUM_THREADS=1",
            "full": "group 1 restarted with heal_history_syncs=0: it asks for the whole state "
            "(model, AdamW moments, global copy, outer momentum, small state)",
            "heal_bytes": "tensor bytes group 1 received (semi_sync.healed bytes_received)",
            "heal_receive_s": "seconds from group 1's request until the state and every "
            "average arrived; a replay's outer steps run meanwhile (semi_sync.healed receive_s)",
            "survivor_longest_step_gap_s": "group 0's longest time between two inner steps "
            "from its release (group 1 asks for its quorum) until 2 syncs after the heal",
        },
        "targets": {
            f"{dtype}, K {'<=' if k == 3 else '='} {k}": f"bytes <= {v} x the same job's full heal"
            for dtype, bounds in TARGETS.items()
            for k, v in bounds.items()
        },
        "runs": runs,
    }
    plan = [
        (repeat, rate, dtype)
        for repeat in range(args.repeats)
        for rate in args.rates
        for dtype in args.dtypes
    ]
    kept = contextlib.nullcontext(str(args.keep)) if args.keep else None
    with kept or tempfile.TemporaryDirectory(prefix="heal_replay_") as tmp:
        for repeat, rate, dtype in plan:
            load = common.wait_for_quiet_machine(args.max_load, 120)
            folder = Path(tmp) / f"{dtype}_{rate:g}_{repeat}"
            cases = run_job(folder, rate, dtype, args)
            runs.append(
                {
                    "repeat": repeat,
                    "rate_mbit": rate,
                    "pseudo_grad_dtype": dtype,
                    "load_avg_1min_before": round(load, 2),
                    "load_avg_1min_after": round(common.load_average(), 2),
                    "cases": cases,
                }
            )
            result["summary"] = summarize(runs)
            provenance.write_result(args.out, result, command)  # partial results survive
    result["png"] = plot(runs, args.png)
    path = provenance.write_result(args.out, result, command)
    print(f"[heal_replay] wrote {path} and {result['png']}")
    print(json.dumps(result["summary"]["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
