"""The benchmarks' headline table judges only figures the machine's speed cannot move, and the
README's charts are drawn from the result files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import charts, headline
from benchmarks.provenance import RESULTS

DECIDABLE = {"bytes", "wait", "host", "loss", "count"}


def test_every_target_is_judged_by_a_decidable_kind_and_the_rest_is_reported() -> None:
    for figure in headline.FIGURES:
        if figure.target is not None:
            assert figure.kind in DECIDABLE, figure.what
        assert figure.kind in DECIDABLE | {"reported"}, figure.what
        if figure.kind == "reported":
            assert figure.target is None, figure.what
    # Wall-clock ratios between processes are never judged.
    for figure in headline.FIGURES:
        if "goodput" in figure.what or "tokens/s" in figure.what:
            assert figure.target is None, figure.what


def test_every_figure_reads_values_from_its_file() -> None:
    for figure in headline.FIGURES:
        values = figure.values(json.loads((RESULTS / figure.file).read_text()))
        assert values and all(isinstance(v, float | int) for v in values), figure.what


def _figure(values: list[float], target: tuple[str, float] | None, every: bool = False):
    return headline.Figure("x", "x.json", lambda _: values, "wait" if target else "reported",
                           target, every)  # fmt: skip


def _cells(figure: headline.Figure, tmp_path: Path) -> list[str]:
    (tmp_path / "x.json").write_text("{}")
    return [c.strip() for c in figure.row(tmp_path).strip("|").split("|")]


def test_a_figure_is_met_by_its_median_or_by_every_seed(tmp_path: Path) -> None:
    median_rule = _cells(_figure([0.01, 0.02, 0.09], ("<=", 0.05)), tmp_path)
    assert median_rule[2:6] == ["0.020", "0.010-0.090 (3)", "<= 0.050", "met, 2 of 3"]
    every_seed = _cells(_figure([0.99, 1.0, 1.02], ("<=", 1.01), every=True), tmp_path)
    assert every_seed[5] == "**missed**, 2 of 3"
    at_least = _cells(_figure([0.3, 0.5, 0.6], (">=", 0.4)), tmp_path)
    assert at_least[5] == "met, 2 of 3"
    reported = _cells(_figure([0.8, 0.9], None), tmp_path)
    assert reported[4:6] == ["none", "reported"]


def test_a_wait_share_is_the_waitier_group_s_time_outside_compute() -> None:
    run = {"method": "async_diloco", "rate_mbit": 100.0, "pseudo_grad_dtype": "float32",
           "groups": [{"compute_utilisation": 0.97}, {"compute_utilisation": 0.90}]}  # fmt: skip
    other = {**run, "rate_mbit": 10.0}
    values = headline.steady_wait("async_diloco", 100.0)({"runs": [run, other]})
    assert values == [pytest.approx(0.10)]


def test_bytes_per_sync_are_taken_against_float32_of_the_same_repeat() -> None:
    def run(dtype: str, repeat: int, sent: float) -> dict:
        return {"pseudo_grad_dtype": dtype, "repeat": repeat,
                "groups": [{"wire_tx_bytes_per_sync": sent}] * 2}  # fmt: skip

    result = {"runs": [run("float32", 0, 100.0), run("int8", 0, 26.0),
                       run("float32", 1, 200.0), run("int8", 1, 50.0)]}  # fmt: skip
    assert headline.bytes_vs_float32("int8")(result) == [0.26, 0.25]


def test_the_charts_series_come_from_the_result_files() -> None:
    wan = json.loads((RESULTS / "wan.json").read_text())
    link = charts.link_speed_series(wan)
    assert set(link["diloco", "float32"]["goodput"]) == {10.0, 100.0}
    slow, fast = (link["diloco", "float32"]["wait"][r][0] for r in (10.0, 100.0))
    assert slow > fast  # blocking DiLoCo waits longer on the slower link
    assert (
        0 < charts.planned_idle(wan, "float32", 100.0) < charts.planned_idle(wan, "float32", 10.0)
    )
    sent = charts.bytes_series(json.loads((RESULTS / "wan_compression_share.json").read_text()))
    for dtype, (measured, planned) in sent.items():
        assert measured == pytest.approx(planned, rel=0.05), dtype  # plan.py's arithmetic holds
    heal = charts.heal_series(json.loads((RESULTS / "heal_replay.json").read_text()))
    assert heal["int4"]["K=3"][0][0] < heal["int4"]["full"][0][0]
    losses = charts.loss_series(json.loads((RESULTS / "convergence_straggler.json").read_text()))
    assert all(len(by_seed) == 3 for by_seed in losses.values())


def test_the_charts_are_drawn_from_the_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = charts.draw_all(RESULTS, tmp_path)
    measured = (RESULTS / "convergence_link.json").exists()  # the only chart of an optional file
    assert len(written) == len(charts.DRAWINGS) - (0 if measured else 1)
    for path in written:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
