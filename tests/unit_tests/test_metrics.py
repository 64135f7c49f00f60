"""MetricsProcessor's JSONL record and the CPU matmul peak behind mfu."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan.components.metrics import (
    MetricsProcessor,
    measure_matmul_peak_flops,
    metrics_file,
    read_metrics,
)
from torchtitan.config.job_config import JobConfig


def _processor(path: Path | None) -> MetricsProcessor:
    config = JobConfig()
    config.metrics.cpu_peak_flops = -1  # mfu n/a: no measurement
    config.metrics.disable_color_printing = True
    return MetricsProcessor(config, torch.device("cpu"), 1000.0, None, path)


def _log_steps(metrics: MetricsProcessor, steps: range, loss: float) -> None:
    for step in steps:
        metrics.count(64)
        metrics.log_step(step, loss + step / 3, 0.5)


def test_jsonl_holds_every_logged_value_unrounded(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = _processor(path)
    metrics.start(0)
    _log_steps(metrics, range(1, 4), loss=5.0)
    metrics.write_scalars(3, {"validation/loss": 4.25})
    metrics.close()
    history = read_metrics(path)
    assert sorted(history) == [1, 2, 3]
    assert history[2]["train/loss"] == 5.0 + 2 / 3  # bit for bit, not the printed 4 decimals
    assert history[3]["validation/loss"] == 4.25
    assert {"train/grad_norm", "train/tps", "train/memory_gib"} <= set(history[1])
    assert "train/mfu_pct" not in history[1]  # no peak: no mfu


def test_resume_drops_the_records_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = _processor(path)
    first.start(0)
    _log_steps(first, range(1, 8), loss=5.0)  # the run dies after step 7; checkpoint at 5
    first.close()
    with path.open("a") as f:
        f.write('{"step": 8, "train/lo')  # torn by the kill

    resumed = _processor(path)
    resumed.start(5)
    _log_steps(resumed, range(6, 9), loss=1.0)
    resumed.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6, 7, 8]
    history = read_metrics(path)
    assert history[5]["train/loss"] == 5.0 + 5 / 3
    assert history[6]["train/loss"] == 1.0 + 6 / 3


def test_a_fresh_start_replaces_an_old_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 9.0}\n{"step": 2, "train/loss": 9.0}\n')
    metrics = _processor(path)
    metrics.start(0)
    _log_steps(metrics, range(1, 2), loss=5.0)
    metrics.close()
    assert sorted(read_metrics(path)) == [1]


def test_no_file_without_a_path(tmp_path: Path) -> None:
    metrics = _processor(None)
    metrics.start(0)
    _log_steps(metrics, range(1, 3), loss=5.0)
    metrics.close()
    assert not list(tmp_path.iterdir())


def test_metrics_file_per_replica_group() -> None:
    config = JobConfig()
    config.job.dump_folder = "/runs/a"
    assert metrics_file(config) == Path("/runs/a/metrics.jsonl")
    config.fault_tolerance.enable = True
    config.fault_tolerance.replica_id = 3
    assert metrics_file(config) == Path("/runs/a/metrics_replica_3.jsonl")


def test_a_torn_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/lo\n{"step": 2, "train/loss": 1.0}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)


def test_cpu_peak_is_positive_and_leaves_the_thread_count_alone() -> None:
    threads = torch.get_num_threads()
    peak = measure_matmul_peak_flops(torch.device("cpu"), sizes=(64, 128), seconds=0.05)
    assert torch.get_num_threads() == threads
    # Any CPU this runs on does more than 0.1 GFLOP/s, and none 100 TFLOP/s in float32.
    assert 1e8 < peak < 1e14


def test_the_step_line_is_coloured_only_for_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piped log (the launcher's, a CI log) carries no escape codes; NO_COLOR and the field
    turn them off on a terminal too."""
    import io
    import sys

    from torchtitan.components.metrics import use_color

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not use_color(False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert use_color(False)
    assert not use_color(True)
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(False)
