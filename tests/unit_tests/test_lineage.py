"""A group's lineage (the last sync shared with other groups, the syncs alone since) and which
group's final model is the job's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.unit_tests.test_benchmarks_ft_smoke import event_file
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.launch import launcher, supervisor
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage, job_model


def test_a_shared_sync_resets_the_solo_count_and_a_solo_one_counts() -> None:
    lineage = Lineage()
    lineage.committed(1, groups=2)
    lineage.committed(2, groups=2)
    assert (lineage.last_shared_sync, lineage.solo_syncs, lineage.solo_since) == (2, 0, 0.0)
    lineage.committed(3, groups=1)
    first_alone = lineage.solo_since
    lineage.committed(4, groups=1)
    assert (lineage.last_shared_sync, lineage.solo_syncs) == (2, 2) and first_alone > 0
    assert lineage.solo_since == first_alone  # when it went on alone, not the latest
    copy = Lineage()
    copy.load_state_dict(lineage.state_dict())
    assert copy == lineage
    lineage.committed(5, groups=3)
    assert (lineage.last_shared_sync, lineage.solo_syncs, lineage.solo_since) == (5, 0, 0.0)


def _final(shared: int | None, solo: int, since: float | None, digest: str) -> dict:
    return {"last_shared_sync": shared, "solo_syncs": solo, "solo_since": since, "digest": digest}


def test_the_job_model_is_the_group_that_carried_the_job_on() -> None:
    assert job_model({}) is None
    same = {0: _final(9, 0, None, "a"), 1: _final(9, 0, None, "a")}
    assert job_model(same) == 0
    # Group 1 hung, came back after group 0 finished and trained alone from sync 5: group 0
    # went on alone first (while group 1 was away), so its model is the job's.
    forked = {0: _final(5, 7, 100.0, "a"), 1: _final(5, 8, 160.0, "b")}
    assert job_model(forked) == 0
    assert job_model({0: _final(5, 7, 100.0, "a"), 1: _final(6, 1, 200.0, "b")}) == 1
    # A group that never trained alone since its last shared sync wins over a lone one.
    assert job_model({0: _final(5, 3, 50.0, "a"), 1: _final(9, 0, None, "b")}) == 1


def _finish(dump: Path, replica: int, **fields: object) -> None:
    with event_file(dump, replica=replica):
        events.FINAL_MODEL.emit(
            step=20, sync=fields.pop("sync", 5), method="diloco", closing_sync_steps=0,
            dropped_inner_steps=None, **fields,
        )  # fmt: skip


def test_the_launcher_names_the_job_model_when_final_models_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert supervisor.FINAL_MODEL_EVENT == events.FINAL_MODEL.name  # without importing torch
    args = launcher.parse_args(["--groups", "2", "--", f"--job.dump_folder={tmp_path}"])
    run = supervisor.Supervisor(args, tmp_path / "logs")
    for group in run.groups:
        group.done = True
        group.process = type("Start", (), {"started_at": 0.0})()  # type: ignore[assignment]
    _finish(tmp_path, 0, last_shared_sync=3, solo_syncs=2, solo_since=10.0, digest="d0")
    _finish(tmp_path, 1, last_shared_sync=3, solo_syncs=4, solo_since=20.0, digest="d1")
    run.summarize_final_models()
    out = capsys.readouterr().out
    assert "final models DIFFER: the job's model is group 0's" in out
    assert "final model of group 1: digest d1, last sync shared with other groups #3" in out
    time.sleep(0.01)
    for group in run.groups:  # a later start of each: only its events count
        group.process.started_at = time.time()  # type: ignore[union-attr]
    _finish(tmp_path, 0, last_shared_sync=5, solo_syncs=0, solo_since=None, digest="same")
    _finish(tmp_path, 1, last_shared_sync=5, solo_syncs=0, solo_since=None, digest="same")
    run.summarize_final_models()
    assert "final models: group(s) [0, 1] identical (digest same)" in capsys.readouterr().out
