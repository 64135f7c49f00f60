"""Smoke runs of the fault-tolerance benchmarks (``benchmarks/{peer_throughput,ft_overhead,
memory,convergence}.py --smoke``): each starts real trainer processes (and a lighthouse) on a
tiny model for a few steps and must write a JSON with the figures the README quotes. The
numbers themselves are not checked: CI machines are noisy; the real runs are in the README.
What the benchmarks read from the trainers is their events, checked here on events written
by the real event kinds and event file."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import SYNC
from torchtitan.tools.cluster import LocalJob
from torchtitan.tools.events import (
    EVENTS_FOLDER,
    EventFile,
    attach_event_file,
    detach_event_file,
    read_events,
)
from torchtitan.tools.logging import logger
from torchtitan.trainer import VALIDATION


def _module(name: str):  # noqa: ANN202
    return importlib.import_module(f"benchmarks.{name}")


def _read(path: Path) -> dict:
    assert path.exists(), f"{path} was not written"
    return json.loads(path.read_text())


# ---- pure helpers ------------------------------------------------------------------------


def test_tokens_per_second_weighs_slow_intervals_by_their_time() -> None:
    common = _module("ft_common")
    lines = [{"step": 10, "tps": 1000.0}, {"step": 20, "tps": 1000.0}, {"step": 30, "tps": 500.0}]
    # Intervals 20 and 30 carry equal tokens: 2 intervals in 1/1000 + 1/500 of the time.
    assert common.interval_tokens_per_second(lines, after_step=10) == pytest.approx(666.667, 1e-4)
    with pytest.raises(ValueError):
        common.interval_tokens_per_second(lines, after_step=30)


@contextlib.contextmanager
def event_file(dump: Path, replica: int | None) -> Iterator[EventFile]:
    """Events emitted inside go to rank 0's file under ``dump``, as in a trainer."""
    level = logger.level
    logger.setLevel(logging.INFO)  # emit() skips a kind whose level is not enabled
    handler = attach_event_file(dump, replica, rank=0)
    try:
        yield handler
    finally:
        detach_event_file(handler)
        logger.setLevel(level)


def emit_step(step: int, tps: float, loss: float = 3.5) -> None:
    TRAIN_STEP.emit(step=step, loss=loss, grad_norm=2.25, memory_gib=0.42, tps=tps,
                    tflops=0.03, mfu_pct=None, groups=2)  # fmt: skip


def emit_sync(step: int, committed: bool = True, seconds: float = 0.153) -> None:
    SYNC.emit(step=step, sync=step // 4, method="diloco", fragment=0, fragments=1,
              committed=committed, seconds=seconds, bytes_sent=18 * 2**20, groups=2,
              quorum_id=1, pseudo_grad_norm=None, quorum_wait_s=0.01, agreement=None,
              uncommitted_in_a_row=0)  # fmt: skip


def test_steps_validations_and_syncs_are_read_from_events(tmp_path: Path) -> None:
    common = _module("ft_common")
    with event_file(tmp_path, replica=0):
        emit_step(20, tps=1069.4, loss=3.5304)
        VALIDATION.emit(step=20, loss=3.4567, seconds=0.4)
        emit_sync(20, committed=True, seconds=0.153)
        emit_sync(24, committed=False, seconds=2.5)
        logger.info("step:    21  loss: 9.9  (a plain line is no step)")
    events = read_events(tmp_path / EVENTS_FOLDER)
    # tps unrounded (the console line shows 1,069); sync times in ms, committed or not.
    assert common.step_rows(events) == [
        {"step": 20, "loss": 3.5304, "memory_gib": 0.42, "tps": 1069.4}
    ]
    assert common.validation_losses(events) == {20: 3.4567}
    assert common.sync_times_ms(events) == pytest.approx([153.0, 2500.0])


@dataclass
class FakeStart:
    """What the readers use of a started trainer (``torchtitan.tools.cluster.Process``)."""

    name: str
    log: Path
    started_at: float
    replica_id: int | None = None


def test_a_start_of_a_group_has_the_events_between_its_start_and_the_next(
    tmp_path: Path,
) -> None:
    common = _module("ft_common")
    dump = tmp_path / common.GROUPS_DUMP
    job = LocalJob(tmp_path)
    first = FakeStart("group1_start0", tmp_path / "group1_start0.log", time.time(), 1)
    job.starts[1] = [first]  # type: ignore[list-item]  # what the readers use of a Process
    events = common.GroupEvents(job)
    with event_file(dump, replica=1):
        emit_step(1, tps=100.0)
        emit_sync(4)
    with event_file(dump, replica=0):
        emit_step(1, tps=300.0)  # another group's
    assert [e.step for e in events.of(first, TRAIN_STEP)] == [1]
    time.sleep(0.01)
    second = FakeStart("group1_start1", tmp_path / "group1_start1.log", time.time(), 1)
    job.starts[1].append(second)  # type: ignore[arg-type]  # as above
    with event_file(dump, replica=1):  # a restart appends to the group's file
        emit_step(5, tps=200.0)
        emit_step(6, tps=200.0)
    assert [e.step for e in events.of(first)] == [1, 4]
    assert [e.step for e in events.of(second, TRAIN_STEP)] == [5, 6]
    # Read at once: the latest start of a group (its events since its start), a trainer alone.
    assert [e.step for e in common.trainer_events(second)] == [5, 6]
    alone = FakeStart("no_ft_g0", tmp_path / "no_ft_g0.log", first.started_at)
    with event_file(tmp_path / "no_ft_g0", replica=None):
        emit_step(2, tps=400.0)
    assert common.step_rows(common.trainer_events(alone)) == [
        {"step": 2, "loss": 3.5, "memory_gib": 0.42, "tps": 400.0}
    ]


def test_peer_step_lines_are_parsed() -> None:
    peer = _module("peer_throughput")
    line = (
        "[titan] 2026-11-30 04:23:48,161 - root - INFO - step:  2  loss:  5.69543  grad_norm:  "
        "2.4426  memory:  0.62GiB(2.64%)  tps: 1,411  tflops: 0.01  mfu: 0.00%"
    )
    match = peer.PEER_STEP.search(line)
    assert match is not None and (match.group(1), match.group(2)) == ("2", "1,411")


def test_convergence_summary_ratios_to_sync_dp_with_ranges_and_tokens_per_parameter() -> None:
    conv = _module("convergence")
    curves = {
        "sync_dp": {0: {100: 3.0, 200: 2.0}, 1: {100: 3.0, 200: 2.2}},
        "diloco": {0: {100: 3.1, 200: 2.1}, 1: {100: 3.1, 200: 2.1}},
    }
    table = conv.summarize(curves, parameters=50)
    assert table["sync_dp"]["final_eval_loss_mean"] == pytest.approx(2.1)
    assert table["sync_dp"]["final_eval_loss_range"] == [2.0, 2.2]
    assert table["diloco"]["ratio_to_sync_dp"] == pytest.approx(1.0)
    # The per-seed ratios: 2.1 / 2.0 and 2.1 / 2.2.
    assert table["diloco"]["ratio_to_sync_dp_range"] == pytest.approx([0.9545, 1.05])
    assert table["diloco"]["final_tokens"] == 200
    assert table["diloco"]["tokens_per_parameter"] == 4.0
    # A target is met only when the mean and every seed meet it.
    verdicts = conv.verdicts(table)
    assert verdicts["diloco ratio_to_sync_dp"].startswith("missed: 1.0 (seeds 0.9545-1.05)")


def test_held_out_halves_split_the_held_out_documents_in_two_fixed_halves(tmp_path: Path) -> None:
    conv = _module("convergence")
    from torchtitan.datasets.corpus import corpus_documents

    halves = conv.held_out_halves(tmp_path / "a")
    again = conv.held_out_halves(tmp_path / "b")
    texts = {n: sorted(f.read_text() for f in p.iterdir()) for n, p in halves.items()}
    assert texts == {n: sorted(f.read_text() for f in p.iterdir()) for n, p in again.items()}
    held_out = sorted(d.text for d in corpus_documents("validation"))
    assert sorted(texts["select"] + texts["test"]) == held_out  # every document, once
    sizes = [sum(len(t.encode()) for t in texts[n]) for n in ("select", "test")]
    assert abs(sizes[0] - sizes[1]) < 0.05 * sum(sizes), sizes


def test_the_sweeps_pick_dp_s_best_lr_and_diloco_s_best_outer_optimizer_at_that_lr(
    tmp_path: Path,
) -> None:
    conv = _module("convergence")
    rows = [
        {"config": "sync_dp", "lr": 1e-3, "final_eval_loss_mean": 2.5},
        {"config": "sync_dp", "lr": 4e-3, "final_eval_loss_mean": 2.2},
        {"config": "diloco", "lr": 1e-3, "outer_lr": 0.7, "outer_momentum": 0.0,
         "final_eval_loss_mean": 2.0},  # the best loss, but at another inner lr
        {"config": "diloco", "lr": 4e-3, "outer_lr": 0.7, "outer_momentum": 0.9,
         "final_eval_loss_mean": 2.3},
        {"config": "diloco", "lr": 4e-3, "outer_lr": 1.0, "outer_momentum": 0.0,
         "final_eval_loss_mean": 2.25},
    ]  # fmt: skip
    smoke = conv.parse_args(["--smoke"])
    sweep_out = tmp_path / "sweep.json"
    sweep_out.write_text(json.dumps({"settings": conv.settings(smoke), "rows": rows,
                                     "seeds": [0], "eval_split": "select"}))  # fmt: skip
    args = conv.parse_args(["--smoke", "--sweep-out", str(sweep_out)])
    chosen = conv.take_from_sweep(args)
    assert (args.lr, args.outer_lr, args.outer_momentum) == (4e-3, 1.0, 0.0)
    assert chosen["sync_dp_runs_swept"] == 2 and chosen["diloco_runs_swept"] == 2
    assert chosen["sweep_eval_split"] == "select"
    # Without a sweep of its own, async DiLoCo runs with blocking DiLoCo's choice, and says so;
    # what the command line gives it is kept.
    assert conv.async_outer(args) == (1.0, 0.0)
    assert chosen["async_outer_optimizer"].startswith("DiLoCo's")
    args = conv.parse_args(["--smoke", "--sweep-out", str(sweep_out), "--async-outer-lr", "0.3"])
    chosen = conv.take_from_sweep(args)
    assert conv.async_outer(args) == (0.3, 0.0)
    assert chosen["async_outer_optimizer"].startswith("the command line's")
    # With one, each takes its own best at DP's best lr.
    rows += [
        {"config": "async_eager", "lr": 4e-3, "outer_lr": 0.5, "outer_momentum": 0.0,
         "final_eval_loss_mean": 2.28},
        {"config": "async_eager", "lr": 4e-3, "outer_lr": 0.7, "outer_momentum": 0.5,
         "final_eval_loss_mean": 2.35},
        {"config": "async_eager", "lr": 1e-3, "outer_lr": 1.0, "outer_momentum": 0.9,
         "final_eval_loss_mean": 1.9},  # another inner lr
    ]  # fmt: skip
    sweep_out.write_text(json.dumps({"settings": conv.settings(smoke), "rows": rows,
                                     "seeds": [0], "eval_split": "select"}))  # fmt: skip
    args = conv.parse_args(["--smoke", "--sweep-out", str(sweep_out)])
    chosen = conv.take_from_sweep(args)
    assert (args.outer_lr, args.outer_momentum) == (1.0, 0.0)
    assert conv.async_outer(args) == (0.5, 0.0)
    assert chosen["async_runs_swept"] == 2 and chosen["diloco_runs_swept"] == 2
    assert "--fault_tolerance.outer_lr=0.5" in conv.semi_sync_args(args, "async_dylu")
    assert "--fault_tolerance.outer_lr=1.0" in conv.semi_sync_args(args, "diloco_int8")


def test_straggler_summary_compares_final_losses_of_runs_that_end_together() -> None:
    conv = _module("convergence")
    runs = {
        "async_dylu": {0: {"steps": 60, "curve": {10.0: 3.0, 30.0: 2.4, 45.0: 2.2}}},
        "diloco_equal_steps": {0: {"steps": 60, "curve": {40.0: 2.5, 80.0: 2.0}}},
        "diloco": {0: {"steps": 40, "curve": {20.0: 2.6, 46.0: 2.3}}},
    }
    summary = conv.straggler_summary(runs)
    row = summary["per_seed"]["0"]
    assert row["diloco"] == {"steps": 40, "final_loss": 2.3, "final_s": 46.0}
    assert row["async_dylu"]["final_loss"] == 2.2
    assert summary["blocking_end_over_async_end_range"] == [1.022, 1.022]
    assert summary["target_met"] is True
    # Blocking DiLoCo's own schedule: the steps that end at async's end at its measured pace.
    assert conv.own_schedule_steps(60, 80.0, 45.0, 10) == 30
    assert conv.own_schedule_steps(60, 800.0, 45.0, 10) == 10  # at least one period
    # Runs that say what each group trained get their tokens per parameter (DyLU's groups
    # train other step counts than --steps).
    runs["async_dylu"][0].update(group_steps=[70, 35], tokens=105 * 64)
    runs["diloco"][0].update(group_steps=[40, 40], tokens=80 * 64)
    runs["diloco_equal_steps"][0].update(group_steps=[60, 60], tokens=120 * 64)
    summary = conv.straggler_summary(runs, parameters=640)
    assert summary["per_seed"]["0"]["async_dylu"]["group_steps"] == [70, 35]
    assert summary["per_seed"]["0"]["async_dylu"]["tokens_per_parameter"] == 10.5
    assert summary["diloco"]["tokens_per_parameter_range"] == [8.0, 8.0]


def test_localsgd_gets_no_outer_optimizer_flags() -> None:
    conv = _module("convergence")
    args = conv.parse_args(["--smoke", "--outer-lr", "0.5", "--outer-momentum", "0.5"])
    assert conv.semi_sync_args(args, "localsgd") == ["--fault_tolerance.sync_steps=4"]
    assert "--fault_tolerance.outer_lr=0.5" in conv.semi_sync_args(args, "diloco")
    # Async DiLoCo's outer optimizer: its own where given, else blocking DiLoCo's; the Delayed
    # Nesterov rows take its lr with --dn-momentum.
    assert conv.semi_sync_args(args, "async_eager") == conv.semi_sync_args(args, "diloco")
    args = conv.parse_args(["--smoke", "--outer-lr", "0.5", "--async-outer-lr", "0.9",
                            "--async-outer-momentum", "0.0", "--dn-momentum", "0.8"])  # fmt: skip
    assert conv.semi_sync_args(args, "async_eager")[1:] == [
        "--fault_tolerance.outer_lr=0.9", "--fault_tolerance.outer_momentum=0.0"]  # fmt: skip
    assert conv.semi_sync_args(args, "async_delayed_dn")[1:] == [
        "--fault_tolerance.outer_lr=0.9", "--fault_tolerance.outer_momentum=0.8"]  # fmt: skip


def test_convergence_summary_rates_async_against_diloco() -> None:
    conv = _module("convergence")
    curves = {"diloco": {0: {100: 2.0}}, "async_eager": {0: {100: 2.04}}}
    assert conv.summarize(curves)["async_eager"]["ratio_to_diloco"] == pytest.approx(1.02)


# ---- smoke runs (real processes) -----------------------------------------------------------


def test_peer_throughput_smoke_measures_ours_and_the_matmul_peak(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    assert _module("peer_throughput").main(["--smoke", "--no-peer", "--out", str(out)]) == 0
    data = _read(out)
    summary, settings = data["summary"], data["settings"]
    (run,) = data["runs"]
    # Tokens/s over the measured steps: a time-weighted mean of their rates, so within them.
    first_measured = int(settings["measured_steps"].split("..")[0])
    rates = [tps for step, tps in run["ours"]["step_tps"] if step >= first_measured]
    assert rates and min(rates) - 0.1 <= summary["ours_tokens_per_s"] <= max(rates) + 0.1
    from torchtitan.models.llama3 import llama3_configs

    _, flops = llama3_configs["debugmodel"].num_flops_per_token(settings["seq_len"])
    assert settings["flops_per_token"] == flops
    # The peak unrounded (the summary's is rounded to 0.1 GFLOP/s); a smoke run measures once.
    peak = max(data["mm_peak_gflops_before"]["fp32"], data["mm_peak_gflops_after"]["fp32"]) * 1e9
    mfu = 100 * run["ours"]["tokens_per_s"] * flops / peak
    assert summary["ours_mfu_pct_vs_fp32_mm_peak"] == pytest.approx(mfu, abs=0.051)
    assert summary["mm_peak_gflops"]["bf16"] > 0


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_ft_overhead_smoke_reports_ratio_to_no_ft(tmp_path: Path) -> None:
    out = tmp_path / "ft.json"
    assert _module("ft_overhead").main(["--smoke", "--methods", "diloco", "--out", str(out)]) == 0
    data = _read(out)
    summary, settings = data["summary"], data["settings"]
    assert set(summary) == {"no_ft", "diloco"}
    runs = {r["method"]: r for r in data["runs"]}
    # Every group of the DiLoCo run synced once per period, the groups without FT never (the
    # ratios pair runs of the same repeat: test_ft_overhead_ratios_pair_runs_of_the_same_repeat).
    ratio = runs["diloco"]["tokens_per_s_per_group"] / runs["no_ft"]["tokens_per_s_per_group"]
    assert summary["diloco"]["ratios_per_repeat"] == [round(ratio, 4)]
    assert summary["no_ft"]["ratio_to_no_ft"] == 1.0
    periods = settings["steps"] // settings["sync_steps_H"]
    assert [len(g["sync_ms"]) for g in runs["diloco"]["groups"]] == [periods] * 2
    assert [len(g["sync_ms"]) for g in runs["no_ft"]["groups"]] == [0, 0]


def test_ft_overhead_ratios_pair_runs_of_the_same_repeat() -> None:
    """Two repeats on a machine whose speed changed between them: each ratio is against the
    baseline of its own repeat, and the summary is their median."""
    ft = _module("ft_overhead")
    runs = [
        {"repeat": 0, "method": "no_ft", "tokens_per_s_per_group": 1000.0, "groups": []},
        {"repeat": 0, "method": "diloco", "tokens_per_s_per_group": 950.0, "groups": []},
        {"repeat": 1, "method": "diloco", "tokens_per_s_per_group": 450.0, "groups": []},
        {"repeat": 1, "method": "no_ft", "tokens_per_s_per_group": 500.0, "groups": []},
    ]
    summary = ft.summarize(runs, ["no_ft", "diloco"])
    assert summary["diloco"]["ratios_per_repeat"] == [0.95, 0.9]
    assert summary["diloco"]["ratio_to_no_ft"] == pytest.approx(0.925)
    assert summary["no_ft"]["ratios_per_repeat"] == [1.0, 1.0]


def test_memory_smoke_reports_extra_over_parameter_bytes(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    assert _module("memory").main(["--smoke", "--out", str(out)]) == 0
    data = _read(out)
    summary, runs = data["summary"], data["runs"]
    assert summary["no_ft"]["extra_vs_no_ft_over_param_bytes"] == 0
    # Each variant's figure is the median of its groups' peaks, the extra is over no_ft's, per
    # fp32 byte of the model's parameters.
    median = {
        name: _module("ft_common").median(
            [m for r in runs if r["variant"] == name for m in r["max_rss_mib_per_group"]]
        )
        for name in ("no_ft", "diloco")
    }
    assert all(len(r["max_rss_mib_per_group"]) == 2 for r in runs)
    assert summary["diloco"]["median_max_rss_mib"] == round(median["diloco"], 1)
    from torchtitan.models.llama3 import llama3_configs

    param_mib = llama3_configs[data["settings"]["flavor"]].num_params() * 4 / 2**20
    extra = (median["diloco"] - median["no_ft"]) / param_mib
    assert summary["diloco"]["extra_vs_no_ft_over_param_bytes"] == round(extra, 3)
    # What DiLoCo says it held, by kind: a global copy and a momentum of the parameters' size,
    # and the pseudo-gradient of a sync (the debug model's parameters are all fp32).
    assert summary["diloco"]["outer_state_over_param_bytes"] == pytest.approx(
        {"global_copy": 1.0, "momentum": 1.0, "buffers": 1.0}, abs=1e-3
    )
    assert "outer_state_over_param_bytes" not in summary["no_ft"]


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_convergence_smoke_sweeps_then_reports_on_the_test_half(tmp_path: Path) -> None:
    out, png = tmp_path / "conv.json", tmp_path / "conv.png"
    sweep_out = tmp_path / "sweep.json"
    conv = _module("convergence")
    files = ["--out", str(out), "--sweep-out", str(sweep_out)]
    # DP's learning rate, then DiLoCo's outer optimizer at DP's best, on the selection half:
    # one point each (choosing among several: the sweep test below, on scripted losses).
    assert conv.main(["--smoke", "--sweep-lr", "4e-3", *files]) == 0
    assert conv.main(["--smoke", "--from-sweep", "--sweep-outer-lr", "0.5", *files]) == 0
    sweep = _read(sweep_out)
    assert [(r["config"], r["lr"]) for r in sweep["rows"]][:1] == [("sync_dp", 4e-3)]
    assert sweep["eval_split"] == "select" and sweep["parameters"] > 0
    best_dp = sweep["rows"][0]
    (diloco,) = [r for r in sweep["rows"] if r["config"] == "diloco"]
    assert diloco["lr"] == best_dp["lr"] and diloco["outer_lr"] == 0.5
    assert diloco["ratio_to_best_sync_dp"] == pytest.approx(
        diloco["final_eval_loss_mean"] / best_dp["final_eval_loss_mean"], 1e-3
    )
    # The report takes both choices and evaluates on the other half.
    args = ["--smoke", "--from-sweep", "--configs", "single_group", "sync_dp"]
    assert conv.main([*args, *files, "--png", str(png)]) == 0
    data = _read(out)
    assert data["eval_split"] == "test"
    assert data["settings"]["chosen_from_sweep"]["lr"] == best_dp["lr"]
    assert data["settings"]["lr"].startswith(f"AdamW {best_dp['lr']:g}")
    # Equal tokens: the single group's eval points fall on the two-group runs' token counts.
    assert set(data["curves"]["single_group"]["0"]) == set(data["curves"]["sync_dp"]["0"])
    assert len(data["curves"]["sync_dp"]["0"]) == 2  # an evaluation at each sync
    assert data["summary"]["sync_dp"]["ratio_to_sync_dp"] == 1.0
    assert data["summary"]["sync_dp"]["tokens_per_parameter"] > 0
    # The test half is not the selection half: the same DP run scores differently on them.
    assert data["summary"]["sync_dp"]["final_eval_loss_mean"] != best_dp["final_eval_loss_mean"]
    if data["png"].endswith(".png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_convergence_straggler_smoke_gives_blocking_diloco_its_own_schedule(
    tmp_path: Path,
) -> None:
    out, png = tmp_path / "straggler.json", tmp_path / "straggler.png"
    conv = _module("convergence")
    assert conv.main(["--smoke", "--straggler", "2", "--out", str(out), "--png", str(png)]) == 0
    data = _read(out)
    assert set(data["curves"]) == {"async_dylu", "async_diloco", "diloco_equal_steps", "diloco"}
    row = data["summary"]["per_seed"]["0"]
    assert row["async_dylu"]["steps"] == row["diloco_equal_steps"]["steps"] == 8
    # Its own schedule: the steps its measured pace fits into async's time, in periods of H.
    steps = conv.own_schedule_steps(8, row["diloco_equal_steps"]["final_s"],
                                    row["async_dylu"]["final_s"], 4)  # fmt: skip
    assert row["diloco"]["steps"] == steps and steps % 4 == 0
    assert "emulate_slowdown=2" in data["settings"]["straggler"]


def test_a_sweep_rates_each_pair_against_the_best_dp_row_and_extends_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conv = _module("convergence")
    out, sweep_out = tmp_path / "conv.json", tmp_path / "sweep.json"
    runs: list[tuple[str, float, float, float]] = []

    def run_all(
        args: argparse.Namespace, tmp: Path, curves: dict[str, dict], save: object, split: str
    ) -> None:
        # A run whose final loss tells its settings apart; sweeps evaluate on "select".
        assert split == "select"
        (config,) = args.configs
        runs.append((config, args.lr, args.outer_lr, args.outer_momentum))
        final = 2.0 + 100 * abs(args.lr - 2e-3)
        if config == "diloco":
            final += args.outer_lr / 2 + args.outer_momentum / 10
        if config == "async_eager":  # its own sweep reads its own fields
            final += abs(args.async_outer_lr - 1.0) / 4 + args.async_outer_momentum
        curves[config] = {0: {64: 3.0, 128: final}}

    monkeypatch.setattr(conv, "run_all", run_all)
    files = ["--out", str(out), "--sweep-out", str(sweep_out)]
    assert conv.main(["--smoke", "--sweep-lr", "1e-3", "2e-3", *files]) == 0
    grid = ["--sweep-outer-lr", "0.5", "1.0", "--sweep-outer-momentum", "0.0", "0.9"]
    assert conv.main(["--smoke", "--from-sweep", *grid, *files]) == 0
    pairs = [(0.5, 0.0), (1.0, 0.0), (0.5, 0.9), (1.0, 0.9)]
    assert runs == [("sync_dp", 1e-3, 0.7, 0.0), ("sync_dp", 2e-3, 0.7, 0.0)] + [
        ("diloco", 2e-3, lr, m) for lr, m in pairs
    ]
    rows = [r for r in _read(sweep_out)["rows"] if r["config"] == "diloco"]
    assert [(r["outer_lr"], r["outer_momentum"]) for r in rows] == pairs
    assert [r["ratio_to_best_sync_dp"] for r in rows] == pytest.approx([1.125, 1.25, 1.17, 1.295])
    # Another sweep with the same settings adds its pairs (a pair run again moves to the end).
    more = ["--sweep-outer-lr", "0.5", "2.0", "--sweep-outer-momentum", "0.9"]
    assert conv.main(["--smoke", "--from-sweep", *more, *files]) == 0
    rows = [r for r in _read(sweep_out)["rows"] if r["config"] == "diloco"]
    again = [(0.5, 0.0), (1.0, 0.0), (1.0, 0.9), (0.5, 0.9), (2.0, 0.9)]
    assert [(r["outer_lr"], r["outer_momentum"]) for r in rows] == again
    assert len(_read(sweep_out)["commands"]) == 3
    # The choice for the report: DP's best lr, DiLoCo's best pair at it.
    args = conv.parse_args(["--smoke", *files])
    conv.take_from_sweep(args)
    assert (args.lr, args.outer_lr, args.outer_momentum) == (2e-3, 0.5, 0.0)
    # Async DiLoCo's outer optimizer gets a sweep of its own, in the same file.
    runs.clear()
    async_grid = ["--sweep-method", "async_eager", "--sweep-outer-lr", "0.7", "1.0",
                  "--sweep-outer-momentum", "0.0"]  # fmt: skip
    assert conv.main(["--smoke", "--from-sweep", *async_grid, *files]) == 0
    assert runs == [("async_eager", 2e-3, 0.7, 0.0), ("async_eager", 2e-3, 1.0, 0.0)]
    rows = [r for r in _read(sweep_out)["rows"] if r["config"] == "async_eager"]
    assert [r["ratio_to_best_sync_dp"] for r in rows] == pytest.approx([1.0375, 1.0])
    args = conv.parse_args(["--smoke", *files])
    conv.take_from_sweep(args)
    assert (args.outer_lr, args.outer_momentum) == (0.5, 0.0)  # DiLoCo's own, unchanged
    assert conv.async_outer(args) == (1.0, 0.0)
    # A grid in one dimension: the other at the swept method's own (async's) setting.
    runs.clear()
    one_dim = ["--sweep-method", "async_eager", "--sweep-outer-lr", "0.7",
               "--async-outer-momentum", "0.3"]  # fmt: skip
    assert conv.main(["--smoke", *one_dim, "--lr", "2e-3", *files]) == 0
    assert runs == [("async_eager", 2e-3, 0.7, 0.3)]
    # --sweep-method says whose sweep; alone, or beside DP's sweep, it is an error.
    for bad in (["--sweep-method", "async_eager"], ["--sweep-lr", "1e-3", "--sweep-outer-lr", "1"]):
        with pytest.raises(SystemExit):
            conv.parse_args(["--smoke", *bad])
