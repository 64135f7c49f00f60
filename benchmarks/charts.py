"""The charts of ``benchmarks/README.md``, drawn from the result files.

    .venv/bin/python -m benchmarks.charts                  # redraw them all
    .venv/bin/python -m benchmarks.results_index --write   # the same, with the two tables

Each chart has a function that reads its series from the JSON (tested without matplotlib) and
one that draws them. matplotlib is the optional ``bench`` extra (``pip install -e '.[bench]'``);
without it nothing is drawn and the reason is printed.

* ``link_speed.png``: job goodput and wait share against link speed, per method and dtype
  (``wan.json``: every method at 10 and 100 Mbit/s in one invocation), with the blocking idle
  share ``plan.py`` predicts;
* ``loss_over_link.png``: held-out loss against wall-clock behind a slow link, per method and
  dtype (``convergence_link.json``, ``convergence.py --rate``);
* ``loss_vs_time.png``: held-out loss against wall-clock with a 2x straggler over 100 Mbit/s
  links (``convergence_straggler.json``);
* ``bytes_per_sync.png``: bytes per sync per dtype, measured (veth counters) against
  ``plan.py``'s arithmetic (``wan_compression_share.json``);
* ``heal.png``: a restarted group's heal, full against replaying K missed syncs: bytes and
  time at 100 Mbit/s (``heal_replay.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.provenance import RESULTS
from torchtitan.experiments.fault_tolerance.plan import Plan

Result = dict[str, Any]
#: (method, dtype) rows of the link-speed chart, in the order of the legend.
LINK_ROWS = [
    ("diloco", "float32"), ("diloco", "int8"), ("streaming_diloco", "float32"),
    ("streaming_diloco", "int8"), ("async_diloco", "float32"), ("async_diloco", "int8"),
    ("async_dylu", "float32"), ("async_dylu", "int8"),
]  # fmt: skip
LABELS = {"diloco": "DiLoCo", "streaming_diloco": "Streaming DiLoCo",
          "async_diloco": "async DiLoCo", "async_dylu": "async + DyLU"}  # fmt: skip


def _load(folder: Path, name: str) -> Result:
    return json.loads((folder / name).read_text())


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def link_speed_series(wan: Result) -> dict[tuple[str, str], dict[str, dict[float, tuple]]]:
    """Per (method, dtype): ``goodput`` and ``wait`` per link speed, as (median, min, max) over
    the repeats. Wait share: per repeat, the larger of the two groups' shares of wall time
    outside compute over the measured periods."""
    out: dict[tuple[str, str], dict[str, dict[float, tuple]]] = {}
    for method, dtype in LINK_ROWS:
        runs = [r for r in wan["runs"]
                if r["method"] == method and r.get("pseudo_grad_dtype") == dtype]  # fmt: skip
        if not runs:
            continue
        row: dict[str, dict[float, tuple]] = {"goodput": {}, "wait": {}}
        for rate in sorted({float(r["rate_mbit"]) for r in runs}):
            at = [r for r in runs if r["rate_mbit"] == rate]
            row["goodput"][rate] = _spread([r["job_goodput_whole_run"] for r in at])
            row["wait"][rate] = _spread(
                [1 - min(g["compute_utilisation"] for g in r["groups"]) for r in at]
            )
        out[method, dtype] = row
    return out


def planned_idle(wan: Result, dtype: str, rate: float) -> float:
    """``plan.py``'s blocking idle share for the benchmark's model, period and measured step."""
    runs = [r for r in wan["runs"] if r["method"] == "diloco" and r["rate_mbit"] == rate
            and r.get("pseudo_grad_dtype") == dtype]  # fmt: skip
    step_s = statistics.median(g["compute_s_per_step"] for r in runs for g in r["groups"])
    params = runs[0]["groups"][0]["parameters"]
    plan = Plan(params=params, step_s=step_s, link_mbit=rate, groups=2,
                sync_steps=int(wan["settings"]["sync_steps_H"]))  # fmt: skip
    return plan.idle_share(dtype)


def loss_series(straggler: Result) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per method and seed: (seconds since the start, held-out loss) at group 0's syncs."""
    return {
        method: {
            seed: sorted((float(t), loss) for t, loss in run["curve"].items())
            for seed, run in by_seed.items()
        }
        for method, by_seed in straggler["curves"].items()
    }


def bytes_series(share: Result) -> dict[str, tuple[float, float]]:
    """Per dtype: (measured MB per sync and group, median over runs; ``plan.py``'s MB)."""
    out = {}
    for dtype in ("float32", "int8", "int4"):
        runs = [r for r in share["runs"] if r["pseudo_grad_dtype"] == dtype]
        sent = statistics.median(g["wire_tx_bytes_per_sync"] for r in runs for g in r["groups"])
        params = runs[0]["groups"][0]["parameters"]
        planned = Plan(params=params, step_s=1.0, link_mbit=100.0, groups=2, sync_steps=1)
        out[dtype] = (sent / 1e6, planned.sync_bytes(dtype) / 1e6)
    return out


def heal_series(heal: Result, rate: float = 100.0) -> dict[str, dict[str, tuple]]:
    """Per dtype and case (full, K=1, K=3, K=10): MB received and seconds from the request,
    (median, min, max) over the repeats, at ``rate``."""
    out: dict[str, dict[str, tuple]] = {}
    for dtype in ("int8", "int4"):
        cases: dict[str, dict[str, list[float]]] = {}
        for run in heal["runs"]:
            if run["rate_mbit"] != rate or run["pseudo_grad_dtype"] != dtype:
                continue
            for c in run["cases"]:
                into = cases.setdefault(c["case"], {"mb": [], "s": []})
                into["mb"].append(c["heal_bytes"] / 1e6)
                into["s"].append(c["heal_receive_s"])
        out[dtype] = {case: (_spread(v["mb"]), _spread(v["s"])) for case, v in cases.items()}
    return out


# ---- drawing ---------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _errorbar(ax: Any, xs: list[float], spreads: list[tuple], **style: Any) -> None:
    medians = [s[0] for s in spreads]
    low = [s[0] - s[1] for s in spreads]
    high = [s[2] - s[0] for s in spreads]
    ax.errorbar(xs, medians, yerr=[low, high], capsize=3, marker="o", ms=4, **style)


def draw_link_speed(folder: Path, out: Path) -> Path:
    wan = _load(folder, "wan.json")
    series = link_speed_series(wan)
    plt = _pyplot()
    fig, (good, wait) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for index, ((method, dtype), row) in enumerate(series.items()):
        style = {"color": f"C{index // 2}", "ls": "-" if dtype == "float32" else "--",
                 "label": f"{LABELS[method]}, {dtype}"}  # fmt: skip
        rates = sorted(row["goodput"])
        _errorbar(good, rates, [row["goodput"][r] for r in rates], **style)
        _errorbar(wait, rates, [row["wait"][r] for r in rates], **style)
    for dtype, ls in (("float32", "-"), ("int8", "--")):
        rates = sorted(series["diloco", dtype]["wait"])
        wait.plot(rates, [planned_idle(wan, dtype, r) for r in rates], color="k", lw=0.8,
                  ls=ls, alpha=0.6, label=f"plan.py: blocking idle, {dtype}")  # fmt: skip
    for ax, label in ((good, "job goodput / no FT, same repeat"),
                      (wait, "wait share of wall time (steady state)")):  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks([10, 100], ["10", "100"])
        ax.set_xlabel("link per group (Mbit/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    good.set_ylim(0, 1.05 * max(s[2] for row in series.values() for s in row["goodput"].values()))
    wait.set_ylim(0, 0.75)
    wait.legend(fontsize=7, loc="upper right")
    repeats = len({r["repeat"] for r in wan["runs"]})
    fig.suptitle("2 groups, debug model (4.85 M), H=20, median and range of "
                 f"{repeats} repeats; wan.json", fontsize=10)  # fmt: skip
    return _save(fig, plt, out / "link_speed.png")


#: Legend names of the wall-clock charts' runs.
RUN_NAMES = {
    "async_dylu": "async + DyLU", "async_diloco": "async DiLoCo", "async_eager": "async DiLoCo",
    "async_eager_int8": "async DiLoCo, int8", "diloco": "DiLoCo", "diloco_int8": "DiLoCo, int8",
    "diloco_int4_ef": "DiLoCo, int4+EF", "streaming_diloco": "Streaming DiLoCo",
    "diloco_equal_steps": "DiLoCo, same steps",
}  # fmt: skip


def _draw_loss(result: Result, title: str, path: Path, names: dict[str, str]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    finals = []
    for index, (method, by_seed) in enumerate(loss_series(result).items()):
        for n, points in enumerate(by_seed.values()):
            finals.append(points[-1][1])
            ax.plot([t for t, _ in points], [v for _, v in points], color=f"C{index}", lw=1,
                    alpha=0.8, label=names.get(method, method) if n == 0 else None)  # fmt: skip
    ax.set_xlabel("wall-clock seconds since the start")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_ylim(min(finals) - 0.1, min(finals) + 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    return _save(fig, plt, path)


def draw_loss_vs_time(folder: Path, out: Path) -> Path:
    names = {**RUN_NAMES, "diloco": "DiLoCo, same wall time"}
    title = ("group 1 at half speed, 100 Mbit/s links, debugmodel_small, 3 seeds; "
             "convergence_straggler.json")  # fmt: skip
    return _draw_loss(_load(folder, "convergence_straggler.json"), title,
                      out / "loss_vs_time.png", names)  # fmt: skip


def draw_loss_over_link(folder: Path, out: Path) -> Path | None:
    """Held-out loss against wall-clock behind a slow link per method and dtype
    (``convergence.py --rate``); None where no such file has been measured."""
    if not (folder / "convergence_link.json").exists():
        return None
    result = _load(folder, "convergence_link.json")
    title = (f"{result['settings']['link']}, {result['settings']['flavor']}, "
             f"seeds {result['settings']['seeds']}; convergence_link.json")  # fmt: skip
    return _draw_loss(result, title, out / "loss_over_link.png", RUN_NAMES)


def draw_bytes_per_sync(folder: Path, out: Path) -> Path:
    series = bytes_series(_load(folder, "wan_compression_share.json"))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=110)
    dtypes = list(series)
    bars = ax.bar(dtypes, [series[d][0] for d in dtypes], color="C0", label="measured (veth)")
    ax.bar_label(bars, labels=[f"{series[d][0]:.2f} MB\n{series[d][0] / series['float32'][0]:.3f}x"
                               for d in dtypes], fontsize=8)  # fmt: skip
    ax.scatter(dtypes, [series[d][1] for d in dtypes], color="k", marker="_", s=400, zorder=3,
               label="plan.py")  # fmt: skip
    ax.set_ylabel("MB sent per sync and group")
    ax.set_ylim(0, max(v[0] for v in series.values()) * 1.3)
    ax.legend()
    ax.set_title("blocking DiLoCo, 2 groups, 4.85 M parameters; wan_compression_share.json",
                 fontsize=9)  # fmt: skip
    return _save(fig, plt, out / "bytes_per_sync.png")


def draw_heal(folder: Path, out: Path) -> Path:
    series = heal_series(_load(folder, "heal_replay.json"))
    plt = _pyplot()
    fig, (size, time) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    cases = ["full", "K=1", "K=3", "K=10"]
    width = 0.38
    for j, dtype in enumerate(series):
        xs = [i + (j - 0.5) * width for i in range(len(cases))]
        for ax, k in ((size, 0), (time, 1)):
            spreads = [series[dtype][c][k] for c in cases]
            bars = ax.bar(
                xs,
                [s[0] for s in spreads],
                width,
                color=f"C{j}",
                label=f"{dtype} history" if k == 0 else None,
                yerr=[[s[0] - s[1] for s in spreads], [s[2] - s[0] for s in spreads]],
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
    for ax, label in ((size, "MB received"), (time, "seconds from the request, 100 Mbit/s")):
        ax.set_xticks(range(len(cases)), ["full heal", "replay 1", "replay 3", "replay 10"])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    size.legend()
    fig.suptitle("a group restarted K syncs behind: full heal against replaying the missed "
                 "syncs (5 repeats); heal_replay.json", fontsize=10)  # fmt: skip
    return _save(fig, plt, out / "heal.png")


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


DRAWINGS = [draw_link_speed, draw_loss_over_link, draw_loss_vs_time, draw_bytes_per_sync,
            draw_heal]  # fmt: skip


def draw_all(folder: Path = RESULTS, out: Path | None = None) -> list[str]:
    """Every chart (into ``out``, default ``folder``); what was written, or why nothing was."""
    try:
        _pyplot()
    except ImportError:
        return ["matplotlib is not installed (pip install -e '.[bench]'): no chart drawn"]
    drawn = (draw(folder, out or folder) for draw in DRAWINGS)
    return [str(path) for path in drawn if path is not None]


if __name__ == "__main__":
    print("\n".join(draw_all()))
    sys.exit(0)
