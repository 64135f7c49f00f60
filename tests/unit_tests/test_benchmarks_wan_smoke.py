"""Smoke runs of ``benchmarks/wan.py`` (emulated WAN: network namespaces + ``tc tbf``) and
``benchmarks/recovery.py`` (SIGKILLed DiLoCo groups, soak), plus their log accounting.

The WAN run needs root and ``ip``/``tc`` (it creates and deletes its own namespaces); it is
skipped, with the reason, where they are missing. The figures themselves are not checked (CI
machines are noisy); the real runs are in ``benchmarks/README.md``."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def _module(name: str):  # noqa: ANN202
    return importlib.import_module(name)


# ---- pure helpers ------------------------------------------------------------------------


def test_utilisation_is_compute_over_wall_after_warmup() -> None:
    wan = _module("wan")
    text = (
        "[timing] step 1 compute_s 0.5000 t 100.0000\n"
        "[timing] step 2 compute_s 1.0000 t 101.0000\n"
        "[timing] step 3 compute_s 1.5000 t 103.0000\n"
        "[timing] step 4 compute_s 2.0000 t 104.0000\n"
    )
    row = wan.utilisation(text, warmup=2)
    assert row["compute_utilisation"] == pytest.approx(1.0 / 3.0)
    assert row["steps"] == 2 and row["wall_s_per_step"] == pytest.approx(1.5)
    with pytest.raises(ValueError):
        wan.utilisation(text, warmup=9)


def test_tbf_bucket_holds_at_least_a_timer_tick() -> None:
    netns = _module("netns")
    assert netns.tbf_args(100) == [
        "tbf", "rate", "100mbit", "burst", "125000", "latency", "50ms"
    ]  # fmt: skip
    assert netns.tbf_args(1)[4] == str(64 * 1024)


def _sync(step: int, committed: bool = True) -> str:
    verdict = "committed" if committed else "NOT committed"
    return (
        f"[semi-sync] step {step} sync: diloco fragment 0/1  {verdict}  time 5 ms  sent 1.00 MiB"
        f"  groups 2  quorum 1  pseudo_grad_norm n/a  sync #{step}\n"
    )


def _steps(first: int, last: int) -> str:
    return "".join(f"[timing] step {s} compute_s 0.1 t {s}.0\n" for s in range(first, last + 1))


def test_step_accounting_counts_periods_by_their_sync() -> None:
    rec = _module("recovery")
    # Period 1 committed, period 2 failed, then 2 steps of an unfinished period.
    text = _steps(1, 3) + _sync(4) + _steps(4, 7) + _sync(8, False) + _steps(8, 10)
    killed = rec.step_accounting(text, finished_by_us=False)
    assert killed == {
        "attempted_steps": 4 + 4 + 2,
        "committed_steps": 4,
        "attempted_syncs": 2,
        "committed_syncs": 1,
        "unfinished_period_steps": 0,
    }
    stopped = rec.step_accounting(text, finished_by_us=True)
    assert stopped["attempted_steps"] == 8 and stopped["unfinished_period_steps"] == 2
    # A restarted group's first period is overwritten by its heal: not committed work.
    healed = _steps(1, 3) + "[semi-sync] healed from a live peer (replica group 0)\n"
    healed += _sync(40) + _steps(40, 43) + _sync(44)
    acc = rec.step_accounting(healed, finished_by_us=True)
    assert (acc["attempted_steps"], acc["committed_steps"]) == (8, 4)


def test_divergence_compares_syncs_logged_by_both_groups(tmp_path: Path) -> None:
    rec = _module("recovery")

    class FakeStart:
        def __init__(self, replica_id: int, text: str) -> None:
            self.replica_id, self._text = replica_id, text

        def text(self) -> str:
            return self._text

    starts = [
        FakeStart(0, "global_digest sync 1: aa\nglobal_digest sync 2: bb\n"),
        FakeStart(1, "global_digest sync 2: bb\nglobal_digest sync 3: cc\n"),
        FakeStart(1, "global_digest sync 4: dd\n"),
        FakeStart(0, "global_digest sync 3: cc\nglobal_digest sync 4: de\n"),
    ]
    result = rec.divergence(starts)
    assert result == {"syncs_logged": 4, "syncs_compared": 3, "mismatched": [4]}


# ---- smoke runs (real processes) -----------------------------------------------------------


def test_wan_smoke_shapes_links_and_reports_utilisation(tmp_path: Path) -> None:
    netns = _module("netns")
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"emulated WAN unavailable: {why}")
    out = tmp_path / "wan.json"
    assert _module("wan").main(["--smoke", "--methods", "diloco", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["method"] == "diloco" and run["rate_mbit"] == 100
    assert "tbf" in run["qdisc"] and "100Mbit" in run["qdisc"]
    assert 0 < run["compute_utilisation"] <= 1.05
    assert run["payload_mib_per_group_per_step"] > 0
    assert run["wire_tx_mib_per_group_per_step"] > 0
    assert all(s["committed"] for g in run["groups"] for s in g["syncs"])
    assert "netem" in data["settings"]["latency"]
    assert netns.leftover_namespaces(f"ttwan{os.getpid() % 100000}-") == []


def test_recovery_smoke_heals_and_soaks_without_divergence(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    args = ["--smoke", "--minutes", "0.25", "--kill-every", "7", "--out", str(out)]
    assert _module("recovery").main(args) == 0
    data = json.loads(out.read_text())
    sample, joiner = data["recovery"]["samples"]
    assert sample["healed_line"] and sample["heal_bytes"] > 0
    assert sample["survivor_next_committed_sync_after_kill_s"] > 0
    # A restarted group killed right after its heal: the survivor still commits a sync.
    assert joiner["joiner_had_healed"] and joiner["survivor_next_committed_sync_after_kill_s"] > 0
    assert "long_period" not in data  # not in a smoke run (see recovery.parse_args)
    soak = data["soak"]
    assert soak["kills"], "the soak killed no group"
    assert all(k["victim_steps_since_start"] >= 0 for k in soak["kills"])
    assert "--fault_tolerance.process_group_timeout_ms=10000" in data["settings"]["ft_args"]
    assert soak["divergence"]["mismatched"] == [] and soak["crashes"] == []
    assert 0 < soak["committed_over_attempted_steps"] <= 1


def test_the_rejoin_wait_is_read_from_the_sync_line() -> None:
    recovery = _module("recovery")
    line = (
        "12:52:56 INFO [semi-sync] step 600 sync: diloco fragment 0/1  committed  time 612 ms  "
        "sent 18.52 MiB  groups 2  quorum 4  pseudo_grad_norm 75.3401  sync #2  "
        "quorum_wait 0.58s"
    )
    match = recovery.QUORUM_WAIT.search(line)
    assert match and match.groups() == ("600", "2", "2", "0.58")
