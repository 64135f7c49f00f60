"""Smoke runs of ``benchmarks/wan.py`` (emulated WAN: network namespaces + ``tc tbf``) and
``benchmarks/recovery.py`` (SIGKILLed DiLoCo groups, soak), plus their accounting of the
trainers' events.

The WAN run needs root and ``ip``/``tc`` (it creates and deletes its own namespaces); it is
skipped, with the reason, where they are missing. The figures themselves are not checked (CI
machines are noisy); the real runs are in ``benchmarks/README.md``."""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.timed_trainer import HEAL_TRANSFER, TIMING
from torchtitan.experiments.fault_tolerance.events import GLOBAL_DIGEST, HEALED, SYNC
from torchtitan.tools.events import (
    EVENTS_FOLDER,
    Event,
    attach_event_file,
    detach_event_file,
    read_events,
)
from torchtitan.tools.logging import logger


def _module(name: str):  # noqa: ANN202
    return importlib.import_module(f"benchmarks.{name}")


def _timing(step: int, compute_s: float, t: float) -> Event:
    return Event(TIMING.name, step=step, fields={"compute_s": compute_s, "t": t})


# ---- pure helpers ------------------------------------------------------------------------


def test_utilisation_is_compute_over_wall_after_warmup() -> None:
    wan = _module("wan")
    events = [_timing(1, 0.5, 100.0), _timing(2, 1.0, 101.0), _timing(3, 1.5, 103.0)]
    events += [Event(SYNC.name, step=4, sync=1), _timing(4, 2.0, 104.0)]
    row = wan.utilisation(events, warmup=2, last=4)
    assert row["compute_utilisation"] == pytest.approx(1.0 / 3.0)
    assert row["steps"] == 2 and row["wall_s_per_step"] == pytest.approx(1.5)
    # The window ends where it is told (a semi-sync run's last period is not measured).
    assert wan.utilisation(events, warmup=1, last=3)["compute_utilisation"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        wan.utilisation(events, warmup=9, last=10)


def test_sync_points_of_blocking_and_async_groups() -> None:
    """Blocking DiLoCo reports each sync at its sync point; async DiLoCo reports sync k at
    sync point k + 1, and the last one again at the end (here DyLU periods of 4, 3, 3)."""
    wan = _module("wan")
    blocking = [Event(SYNC.name, step=s, sync=k) for k, s in enumerate((4, 8, 12), 1)]
    assert wan.sync_point_steps("diloco", blocking, 4) == [4, 8, 12]
    async_ = [Event(SYNC.name, step=s, sync=k) for k, s in enumerate((7, 10, 10), 1)]
    assert wan.sync_point_steps("async_dylu", async_, 4) == [4, 7, 10]
    # DyLU's speed probe planned the first period: 6 inner steps, reported with sync 1.
    probed = [
        Event(SYNC.name, step=s, sync=k, fields={"inner_steps": n})
        for k, (s, n) in enumerate(((9, 6), (12, 3), (12, 3)), 1)
    ]
    assert wan.sync_point_steps("async_dylu", probed, 4) == [6, 9, 12]


def test_the_steady_state_window_is_whole_periods_for_every_method() -> None:
    """Periods 2 and 3 of H = 20: steps 20..60. Streaming DiLoCo with 2 fragments passes a
    sync point every 10 steps, so its window ends at its sixth, not its third."""
    wan = _module("wan")
    args = SimpleNamespace(sync_steps=20, fragments=2, periods=3)
    streaming = [Event(SYNC.name, step=s, sync=k) for k, s in enumerate(range(10, 90, 10), 1)]
    assert wan.semi_sync_window("streaming_diloco", streaming, args) == (20, 60)
    blocking = [Event(SYNC.name, step=s, sync=k) for k, s in enumerate((20, 40, 60, 80), 1)]
    assert wan.semi_sync_window("diloco", blocking, args) == (20, 60)


def test_whole_run_utilisation_counts_from_the_start_to_the_last_step() -> None:
    """Compute 3 s of the 10 s from ``train.started`` to the last step (the first period's
    wait included), where the window of steps 2..4 alone would give 1.5 / 2."""
    wan = _module("wan")
    events = [Event("train.started", time=100.0)]
    for step, compute, t in ((1, 1.5, 106.0), (2, 2.0, 107.0), (3, 2.5, 108.0), (4, 3.0, 110.0)):
        events.append(Event(TIMING.name, step=step, fields={"compute_s": compute, "t": t}, time=t))
    assert wan.whole_run_utilisation(events) == pytest.approx(0.3)
    assert wan.utilisation(events, warmup=2, last=4)["compute_utilisation"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        wan.whole_run_utilisation(events[1:])


def _sync_event(step: int, committed: bool, tokens: int, inner_steps: int) -> Event:
    fields = {"committed": committed, "tokens": tokens, "inner_steps": inner_steps}
    return Event(SYNC.name, step=step, fields=fields)


def test_goodput_counts_the_tokens_of_committed_syncs_only() -> None:
    """Async DiLoCo, periods of 4 steps of 10 tokens: sync 2 was dropped, so its period's 40
    tokens count nowhere. Whole run: 80 tokens in the 10 s from the job's start (which is
    before this group's own); steady state, periods 2 and 3 (steps 4..12, 4 s): 40 tokens."""
    wan = _module("wan")
    events = [Event("train.started", time=101.0)]
    events += [
        Event(TIMING.name, step=s, fields={"compute_s": s * 0.5, "t": 0.0}, time=102.0 + s * 0.5)
        for s in range(1, 13)
    ]
    # Reported one sync point late; the last again at the end of training.
    events += [_sync_event(8, True, 40, 4), _sync_event(12, False, 40, 4)]
    events += [_sync_event(12, True, 40, 4)]
    found = wan.committed_tokens("async_dylu", events, 10, 4, 1)
    assert found == [(4, 40), (12, 40)]
    args = SimpleNamespace(batch=2, seq_len=5, sync_steps=4, fragments=1)
    rates = wan.goodput("async_dylu", events, 98.0, (4, 12), args)
    assert rates["whole_run_tokens_per_s"] == pytest.approx(80 / 10)
    assert rates["steady_tokens_per_s"] == pytest.approx(40 / 4)


def test_goodput_is_divided_by_the_same_groups_baseline() -> None:
    wan = _module("wan")
    run: dict[str, Any] = {
        "groups": [
            {"whole_run_tokens_per_s": 90.0, "steady_tokens_per_s": 95.0},
            {"whole_run_tokens_per_s": 40.0, "steady_tokens_per_s": 48.0},
        ]
    }
    baseline = {
        "repeat": 0,
        "groups": [
            {"whole_run_tokens_per_s": 100.0, "steady_tokens_per_s": 100.0},
            {"whole_run_tokens_per_s": 50.0, "steady_tokens_per_s": 50.0},
        ],
    }
    wan.add_goodput_ratios(run, baseline)
    assert [g["goodput_whole_run"] for g in run["groups"]] == [0.9, 0.8]
    assert [g["goodput_steady"] for g in run["groups"]] == [0.95, 0.96]
    assert run["job_goodput_whole_run"] == pytest.approx(130 / 150, abs=1e-4)
    assert run["job_goodput_steady"] == pytest.approx(143 / 150, abs=1e-4)
    spread = wan.goodput_spread([run, {**run, "job_goodput_whole_run": 0.5}])
    assert spread["job_whole_run"] == {
        "median": 0.5,
        "min": 0.5,
        "max": run["job_goodput_whole_run"],
    }
    assert spread["job_whole_run_repeats"] == [run["job_goodput_whole_run"], 0.5]


def test_repeats_are_summarized_by_their_median_run() -> None:
    wan = _module("wan")
    runs = [
        {"method": "diloco", "rate_mbit": 100.0, "compute_utilisation": u, "repeat": i}
        for i, u in enumerate([0.90, 0.80, 0.95])
    ]
    runs.append({"method": "no_ft", "rate_mbit": 100.0, "compute_utilisation": 0.99, "repeat": 0})
    picked = wan.median_runs(runs)
    assert [(r["method"], r["compute_utilisation"]) for r in picked] == [
        ("diloco", 0.90),
        ("no_ft", 0.99),
    ]
    assert picked[0]["repeats_utilisation"] == [0.90, 0.80, 0.95]


def test_the_timed_trainer_keeps_its_console_lines() -> None:
    line = TIMING.render({"step": 7, "compute_s": 1.23456, "t": 100.5})
    assert line == "[timing] step 7 compute_s 1.2346 t 100.5000"
    line = HEAL_TRANSFER.render({"bytes": 4096, "seconds": 0.01234})
    assert line == "[timing] heal recv_bytes 4096 seconds 0.012"


def test_tbf_bucket_holds_at_least_a_timer_tick() -> None:
    netns = _module("netns")
    assert netns.tbf_args(100) == [
        "tbf", "rate", "100mbit", "burst", "125000", "latency", "50ms"
    ]  # fmt: skip
    assert netns.tbf_args(1)[4] == str(64 * 1024)


def _sync(step: int, committed: bool = True) -> list[Event]:
    return [Event(SYNC.name, step=step, sync=step, fields={"committed": committed})]


def _steps(first: int, last: int) -> list[Event]:
    return [_timing(s, 0.1, float(s)) for s in range(first, last + 1)]


def test_step_accounting_counts_periods_by_their_sync() -> None:
    rec = _module("recovery")
    # Period 1 committed, period 2 failed, then 2 steps of an unfinished period.
    events = _steps(1, 3) + _sync(4) + _steps(4, 7) + _sync(8, False) + _steps(8, 10)
    killed = rec.step_accounting(events, finished_by_us=False)
    assert killed == {
        "attempted_steps": 4 + 4 + 2,
        "committed_steps": 4,
        "attempted_syncs": 2,
        "committed_syncs": 1,
        "unfinished_period_steps": 0,
    }
    stopped = rec.step_accounting(events, finished_by_us=True)
    assert stopped["attempted_steps"] == 8 and stopped["unfinished_period_steps"] == 2
    # A restarted group's first period is overwritten by its heal: not committed work.
    heal = Event(HEALED.name, step=40, sync=10, fields={"peer": 0, "case": "join_sync"})
    healed = _steps(1, 3) + [heal] + _sync(40) + _steps(40, 43) + _sync(44)
    acc = rec.step_accounting(healed, finished_by_us=True)
    assert (acc["attempted_steps"], acc["committed_steps"]) == (8, 4)


def _digests(*pairs: tuple[int, str]) -> list[Event]:
    return [Event(GLOBAL_DIGEST.name, sync=k, fields={"digest": d}) for k, d in pairs]


def test_divergence_compares_syncs_reported_by_both_groups() -> None:
    rec = _module("recovery")
    starts = [
        (0, _digests((1, "aa"), (2, "bb"))),
        (1, _digests((2, "bb"), (3, "cc"))),
        (1, _digests((4, "dd"))),
        (0, _digests((3, "cc"), (4, "de"))),
    ]
    result = rec.divergence(starts)
    assert result == {"syncs_logged": 4, "syncs_compared": 3, "mismatched": [4]}


# ---- smoke runs (real processes) -----------------------------------------------------------


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_wan_smoke_shapes_links_and_reports_utilisation(tmp_path: Path) -> None:
    netns = _module("netns")
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"emulated WAN unavailable: {why}")
    out = tmp_path / "wan.json"
    argv = ["--smoke", "--methods", "diloco", "async_dylu", "--straggler", "2", "--goodput",
            "--out", str(out)]  # fmt: skip
    assert _module("wan").main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["runs"]] == ["no_ft_pair", "diloco", "async_dylu"]
    assert "2x" in data["settings"]["straggler"]
    # The straggler's baseline ran with the straggler's slowdown (what its trainer reported,
    # not a timing: a loaded machine may make either group the slower one).
    assert [g["emulate_slowdown"] for g in data["runs"][0]["groups"]] == [1.0, 2.0]
    assert all(r["groups"][1]["emulate_slowdown"] == 2.0 for r in data["runs"])
    for run in data["runs"][1:]:
        assert run["job_goodput_whole_run"] > 0
        assert all(g["goodput_whole_run"] > 0 and g["goodput_steady"] > 0 for g in run["groups"])
    if data["png"].endswith(".png"):  # matplotlib installed: the goodput chart too
        assert Path(data["goodput_png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["summary"]["async_dylu@100mbit_straggler2"]["goodput"]["repeats"] == 1
    data["runs"] = data["runs"][1:]  # the rest as before
    summary = data["summary"]["async_dylu@100mbit_straggler2"]
    assert "target" not in summary and len(summary["per_group_utilisation"]) == 2
    for run in data["runs"]:
        assert run["rate_mbit"] == 100
        assert "tbf" in run["qdisc"] and "100Mbit" in run["qdisc"]
        assert 0 < run["compute_utilisation"] <= 1.05
        assert all(s["committed"] for g in run["groups"] for s in g["syncs"])
    # float32 DiLoCo: every sync carries the whole model's parameters in fp32, and the wire
    # carries at least that (each of two groups sends its half twice in a ring all-reduce).
    diloco = next(r for r in data["runs"] if r["method"] == "diloco")
    for group in diloco["groups"]:
        model_bytes = group["parameters"] * 4
        assert model_bytes > 0 and group["syncs"]
        assert all(s["mib"] * 2**20 == model_bytes for s in group["syncs"]), group["syncs"]
        assert group["wire_tx_bytes_per_sync"] >= 0.9 * model_bytes
    assert "netem" in data["settings"]["latency"]
    # int8 pseudo-gradients: the interfaces' counters see a fraction of float32's bytes.
    out8 = tmp_path / "wan_int8.json"
    argv8 = ["--smoke", "--methods", "diloco", "--pseudo-grad-dtypes", "int8", "--out", str(out8)]
    assert _module("wan").main(argv8) == 0
    (run8,) = _read_runs(out8)
    fp32 = next(r for r in data["runs"] if r["method"] == "diloco")
    per_sync = [[g["wire_tx_bytes_per_sync"] for g in r["groups"]] for r in (fp32, run8)]
    assert run8["pseudo_grad_dtype"] == "int8"
    assert all(b8 < 0.5 * b32 for b32, b8 in zip(*per_sync, strict=True)), per_sync
    assert netns.leftover_namespaces(f"ttwan{os.getpid() % 100000}-") == []


def _read_runs(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["runs"]


def _print_log_tails(folder: Path, lines: int = 40) -> None:
    """Every log under ``folder`` (lighthouse and each start of each group), its last lines:
    what a failed run of a multi-process benchmark leaves to read in the test's report."""
    for log in sorted(folder.rglob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"==== {log.relative_to(folder)} (last {len(tail)} lines)", *tail, sep="\n")


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_recovery_smoke_heals_and_soaks_without_divergence(tmp_path: Path) -> None:
    out, logs = tmp_path / "recovery.json", tmp_path / "logs"
    try:
        code = _module("recovery").main(["--smoke", "--out", str(out), "--logs", str(logs)])
    except BaseException:
        _print_log_tails(logs)  # kept under pytest's tmp_path too
        raise
    assert code == 0
    data = json.loads(out.read_text())
    sample, joiner = data["recovery"]["samples"]
    # A heal carries at least the model and AdamW's two moments, in fp32.
    from torchtitan.models.llama3 import llama3_configs

    params = llama3_configs[data["settings"]["flavor"]].num_params()
    assert sample["healed_line"] and sample["heal_bytes"] >= 3 * 4 * params
    assert sample["survivor_next_committed_sync_after_kill_s"] > 0
    # A restarted group killed right after its heal: the survivor still commits a sync.
    assert joiner["joiner_had_healed"] and joiner["survivor_next_committed_sync_after_kill_s"] > 0
    assert "long_period" not in data  # not in a smoke run (see recovery.parse_args)
    # Group 2 of 3 killed inside an async int4 sync: both survivors commit again in seconds
    # (the collective timeout stays at its default, 300 s).
    stalls = data["async_kill"]["survivor_stall_s"]
    assert stalls["n"] == 2 and 0 < stalls["max"] < 60, data["async_kill"]
    soak = data["soak"]
    assert soak["minutes"] == 0.1  # the smoke's soak
    assert soak["kills"], "the soak killed no group"
    assert all(k["victim_steps_since_start"] >= 0 for k in soak["kills"])
    assert "--fault_tolerance.process_group_timeout_ms=10000" in data["settings"]["ft_args"]
    assert soak["divergence"]["mismatched"] == [] and soak["crashes"] == []
    assert 0 < soak["committed_over_attempted_steps"] <= 1
    # Goodput counts the whole soak job's wall time against a no-FT baseline taken before and
    # after it, in this invocation.
    rates = soak["no_ft_steps_per_s"]
    assert len(rates["before"]) == len(rates["after"]) == 2 and min(rates["before"]) > 0
    assert soak["wall_s_from_job_start"] > soak["wall_s_before_the_first_kill_window"] > 0
    baseline = [(b + a) / 2 for b, a in zip(rates["before"], rates["after"], strict=True)]
    expected = soak["totals"]["committed_steps"] / soak["wall_s_from_job_start"] / sum(baseline)
    assert soak["goodput_with_downtime"] == pytest.approx(expected, abs=1e-4)


def test_goodput_with_downtime_divides_by_the_whole_wall_time() -> None:
    recovery = _module("recovery")
    # 2 groups of 10 steps/s for 100 s could commit 2000 steps; 1500 were committed.
    assert recovery.goodput_with_downtime(1500, 100.0, [10.0, 10.0]) == pytest.approx(0.75)
    flags = ["--fault_tolerance.semi_sync_method=diloco", "--training.steps=1000000", "--x=1"]
    assert recovery.without_ft(flags, 300) == ["--x=1", "--training.steps=300"]


def test_the_rejoin_wait_is_read_from_the_sync_event(tmp_path: Path) -> None:
    recovery = _module("recovery")
    sync: dict[str, Any] = dict(method="diloco", fragment=0, fragments=1, seconds=0.612,
                                bytes_sent=19_419_136, quorum_id=4, pseudo_grad_norm=75.3401,
                                agreement=None, uncommitted_in_a_row=0)  # fmt: skip
    level = logger.level
    logger.setLevel(logging.INFO)  # emit() skips a kind whose level is not enabled
    handler = attach_event_file(tmp_path, replica=0, rank=0)
    try:
        SYNC.emit(step=300, sync=1, committed=True, groups=1, quorum_wait_s=0.01, **sync)
        SYNC.emit(step=600, sync=2, committed=True, groups=2, quorum_wait_s=0.58, **sync)
    finally:
        detach_event_file(handler)
        logger.setLevel(level)
    events = read_events(tmp_path / EVENTS_FOLDER)
    assert recovery.sync_quorum_waits(events) == [(1, 1, 0.01), (2, 2, 0.58)]
    # Committed syncs carry the step's timing, which follows the sync.
    timed = [events[0], _timing(300, 1.0, 50.0), events[1], _timing(600, 2.0, 80.0)]
    assert recovery.committed_sync_after(timed, 60.0) == (600, 80.0, 612.0, 2)
    assert recovery.committed_sync_after(timed, 90.0) is None


def test_the_survivors_recovery_is_a_sync_without_the_killed_group() -> None:
    """A kill right after the victim's part in a sync: the survivor commits that sync (both
    groups) a moment after the kill. Its recovery is a later sync that the victim took no part
    in (seen in the recovery smoke: 0.0 s, 2 groups, instead of 2.1 s)."""
    recovery = _module("recovery")

    def sync(step: int, quorum: int, groups: int) -> Event:
        return Event(SYNC.name, step=step, sync=step // 4,
                     fields=dict(committed=True, seconds=0.007, groups=groups,
                                 quorum_id=quorum))  # fmt: skip

    # A running group, killed at 10.0 right after it logged its part in sync 176 (quorum 3).
    victim = [sync(172, 3, 2), _timing(172, 1.0, 9.97), sync(176, 3, 2)]
    survivor = [sync(176, 3, 2), _timing(176, 1.0, 10.0005),
                sync(180, 4, 1), _timing(180, 1.0, 12.1)]  # fmt: skip
    dead = recovery.quorums_of(victim)
    assert dead == {3}
    assert recovery.committed_sync_after(survivor, 10.0) == (176, 10.0005, 7.0, 2)
    assert recovery.recovery_sync(survivor, 10.0, dead, 2) == (180, 12.1, 7.0, 1)
    # A joiner killed after its part in its first sync (quorum 5), before it logged it: no
    # quorum of its own to leave out, but a sync of both groups before the group's next start
    # can only have been with it.
    joined = [sync(200, 5, 2), _timing(200, 1.0, 20.001),
              sync(204, 6, 1), _timing(204, 1.0, 22.2)]  # fmt: skip
    assert recovery.recovery_sync(joined, 20.0, set(), 2) == (204, 22.2, 7.0, 1)
    # Restarted again at 21.0 and in the survivor's next sync: that one counts.
    rejoined = [sync(200, 5, 2), _timing(200, 1.0, 20.001),
                sync(204, 7, 2), _timing(204, 1.0, 26.0)]  # fmt: skip
    assert recovery.recovery_sync(rejoined, 20.0, set(), 2, back_at=21.0) == (204, 26.0, 7.0, 2)
    assert recovery.recovery_sync(rejoined, 20.0, set(), 2) is None


def test_heal_replay_names_rate_0_unshaped() -> None:
    heal_replay = _module("heal_replay")
    assert [heal_replay.link(r) for r in (0.0, 100.0, 1000.0)] == [
        "unshaped", "100 Mbit/s", "1000 Mbit/s"
    ]  # fmt: skip


def test_heal_replay_judges_each_case_by_its_repeats() -> None:
    """Each target is judged per link, dtype and K over that case's repeats: one repeat of
    three that pauses the survivor longer than its job's full heal misses that case only."""
    heal_replay = _module("heal_replay")

    def case(name: str, missed: int, ratio: float, gap: float) -> dict[str, object]:
        return {"case": name, "missed_syncs": missed, "bytes_vs_full": ratio, "heal_bytes": 1,
                "heal_receive_s": 0.1, "survivor_longest_step_gap_s": gap,
                "survivor_quorum_wait_at_heal_s": 0.1, "digests_agree": True,
                "transfer": "replay"}  # fmt: skip

    runs = [
        {
            "rate_mbit": 100.0,
            "pseudo_grad_dtype": "int4",
            "cases": [
                case("full", 1, 1.0, 1.0),
                case("K=3", 3, 0.08, gap),
                case("K=10", 10, 0.27, 0.5),
            ],
        }  # fmt: skip
        for gap in (0.9, 1.1, 0.9)
    ]
    targets = heal_replay.summarize(runs)["targets"]
    pause = "survivor's longest pause <= the full heal's"
    assert targets[f"100 Mbit/s int4 K=3: {pause}"] == "missed: 2 of 3 repeats reached it"
    assert targets[f"100 Mbit/s int4 K=10: {pause}"] == "met: 3 of 3 repeats reached it"
    assert targets["100 Mbit/s int4 K=3: bytes <= 0.1 x full"] == "met: 3 of 3 repeats reached it"
    assert targets["equal global digests after every heal"] is True


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_heal_replay_smoke_replays_fewer_bytes_than_a_full_heal(tmp_path: Path) -> None:
    """One job over an emulated 100 Mbit/s link: a full heal, then a restart 2 syncs behind
    that replays exactly those 2 syncs (int4) in far fewer bytes; digests agree after both."""
    netns = _module("netns")
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"emulated WAN unavailable: {why}")
    out = tmp_path / "heal_replay.json"
    assert _module("heal_replay").main(["--smoke", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    full, replayed = run["cases"]
    assert full["transfer"] == "full" and full["replayed_syncs"] == 0
    assert replayed["transfer"] == "replay" and replayed["replayed_syncs"] == 2
    assert replayed["heal_bytes"] < 0.2 * full["heal_bytes"], run
    assert full["digests_agree"] and replayed["digests_agree"]


@pytest.mark.usefixtures("warm_benchmark_trainers")
def test_convergence_over_a_link_records_loss_against_wall_clock_per_config(
    tmp_path: Path,
) -> None:
    """``convergence.py --rate`` without a straggler: each config's held-out loss against
    wall-clock seconds, both groups behind their own emulated link."""
    netns = _module("netns")
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"emulated WAN unavailable: {why}")
    out = tmp_path / "link.json"
    argv = ["--smoke", "--rate", "100", "--configs", "diloco", "async_eager_int8",
            "--out", str(out), "--png", str(tmp_path / "link.png")]  # fmt: skip
    assert _module("convergence").main(argv) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "convergence_link" and "100 Mbit/s" in data["settings"]["link"]
    for config in ("diloco", "async_eager_int8"):
        curve = data["curves"][config]["0"]["curve"]
        assert curve and all(float(t) > 0 for t in curve), config
        assert data["summary"][config]["final_s_per_seed"]["0"] == max(map(float, curve))


def test_sites_smoke_kills_a_group_of_a_site_and_counts_each_sites_bytes(tmp_path: Path) -> None:
    """benchmarks/sites.py: one kill of a group of site 0 and the bytes runs with 1 and 2
    groups per site, on emulated links; the figures' plumbing, not their values."""
    netns = _module("netns")
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    out = tmp_path / "sites.json"
    assert _module("sites").main(["--smoke", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    (kill,) = result["kills"]
    assert kill["digests_equal"] and kill["share"] is not None and kill["window_s"] > 0
    assert [r["groups_per_site"] for r in result["bytes"]] == [1, 2]
    for run in result["bytes"]:
        assert run["digests_equal"] and run["syncs"] >= 1
        assert run["payload_bytes_per_sync"][0] == result["bytes"][0]["payload_bytes_per_sync"][0]
    assert not netns.leftover_namespaces("ttwan")
