"""Smoke runs of the fault-tolerance benchmarks (``benchmarks/{peer_throughput,ft_overhead,
memory,convergence}.py --smoke``): each starts real trainer processes (and a lighthouse) on a
tiny model for a few steps and must write a JSON with the figures the README quotes. The
numbers themselves are not checked: CI machines are noisy; the real runs are in the README."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def _module(name: str):  # noqa: ANN202
    return importlib.import_module(name)


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


def test_step_validation_and_sync_lines_are_parsed() -> None:
    common = _module("ft_common")
    text = (
        "04:23:59 INFO \x1b[31mstep:    20\x1b[0m  \x1b[32mloss:   3.5304\x1b[0m  grad_norm:  "
        "2.2574  memory:  0.42 GiB  tps: 1,069  tflops: 0.032  mfu: 31.6%\n"
        "04:24:00 INFO validation: step 20  loss: 3.4567  (0.4s)\n"
        "04:24:00 INFO [semi-sync] step 20 sync: diloco fragment 0/1  committed  time 153 ms  "
        "sent 18.52 MiB  groups 2\n"
    )
    assert common.step_lines(text) == [
        {"step": 20, "loss": 3.5304, "memory_gib": 0.42, "tps": 1069.0}
    ]
    assert common.validation_losses(text) == {20: 3.4567}
    assert common.sync_times_ms(text) == [153]


def test_peer_step_lines_are_parsed() -> None:
    peer = _module("peer_throughput")
    line = (
        "[titan] 2026-11-30 04:23:48,161 - root - INFO - step:  2  loss:  5.69543  grad_norm:  "
        "2.4426  memory:  0.62GiB(2.64%)  tps: 1,411  tflops: 0.01  mfu: 0.00%"
    )
    match = peer.PEER_STEP.search(line)
    assert match is not None and (match.group(1), match.group(2)) == ("2", "1,411")


def test_convergence_summary_ratios_to_sync_dp() -> None:
    conv = _module("convergence")
    curves = {
        "sync_dp": {0: {100: 3.0, 200: 2.0}, 1: {100: 3.0, 200: 2.2}},
        "diloco": {0: {100: 3.1, 200: 2.1}, 1: {100: 3.1, 200: 2.1}},
    }
    table = conv.summarize(curves)
    assert table["sync_dp"]["final_eval_loss_mean"] == pytest.approx(2.1)
    assert table["diloco"]["ratio_to_sync_dp"] == pytest.approx(1.0)
    assert table["diloco"]["final_tokens"] == 200


# ---- smoke runs (real processes) -----------------------------------------------------------


def test_peer_throughput_smoke_measures_ours_and_the_matmul_peak(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    assert _module("peer_throughput").main(["--smoke", "--no-peer", "--out", str(out)]) == 0
    summary = _read(out)["summary"]
    assert summary["ours_tokens_per_s"] > 0
    assert summary["mm_peak_gflops"]["fp32"] > 0 and summary["mm_peak_gflops"]["bf16"] > 0
    assert 0 < summary["ours_mfu_pct_vs_fp32_mm_peak"]


def test_ft_overhead_smoke_reports_ratio_to_no_ft(tmp_path: Path) -> None:
    out = tmp_path / "ft.json"
    assert _module("ft_overhead").main(["--smoke", "--methods", "diloco", "--out", str(out)]) == 0
    summary = _read(out)["summary"]
    assert set(summary) == {"no_ft", "diloco"}
    assert summary["no_ft"]["ratio_to_no_ft"] == 1.0
    assert summary["diloco"]["tokens_per_s"] > 0
    assert summary["diloco"]["median_sync_ms"] is not None  # the groups did sync


def test_memory_smoke_reports_extra_over_parameter_bytes(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    assert _module("memory").main(["--smoke", "--out", str(out)]) == 0
    data = _read(out)
    assert data["summary"]["no_ft"]["extra_vs_no_ft_over_param_bytes"] == 0
    assert data["summary"]["diloco"]["median_max_rss_mib"] > 0


def test_convergence_smoke_writes_curves_and_png_then_rates_a_sweep(tmp_path: Path) -> None:
    out, png = tmp_path / "conv.json", tmp_path / "conv.png"
    conv = _module("convergence")
    args = ["--smoke", "--configs", "single_group", "sync_dp", "diloco"]
    assert conv.main([*args, "--out", str(out), "--png", str(png)]) == 0
    data = _read(out)
    # Equal tokens: the single group's eval points fall on the two-group runs' token counts.
    assert set(data["curves"]["single_group"]["0"]) == set(data["curves"]["diloco"]["0"])
    assert data["summary"]["sync_dp"]["ratio_to_sync_dp"] == 1.0
    if data["png"].endswith(".png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The outer-lr sweep, rated against the synchronous DP run just made.
    sweep_out = tmp_path / "sweep.json"
    sweep = ["--sweep-outer-lr", "0.5", "1.0", "--sweep-outer-momentum", "0.0"]
    assert conv.main(["--smoke", *sweep, "--out", str(out), "--sweep-out", str(sweep_out)]) == 0
    rows = _read(sweep_out)["rows"]
    assert [(r["outer_lr"], r["outer_momentum"]) for r in rows] == [(0.5, 0.0), (1.0, 0.0)]
    base = _read(out)["summary"]["sync_dp"]["final_eval_loss_mean"]
    for row in rows:
        assert row["ratio_to_sync_dp"] == pytest.approx(row["final_eval_loss_mean"] / base, 1e-3)
