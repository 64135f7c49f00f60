"""Structured events: one logging call gives the console line and the event; the event file
holds one JSON line per event, appended across restarts; the reader selects by name, group,
rank and start. Every event kind the project declares is documented."""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.tools.events import (
    EventKind,
    EventTail,
    attach_event_file,
    detach_event_file,
    event_file_path,
    event_of,
    read_events,
)
from torchtitan.tools.logging import logger

REPO = Path(__file__).resolve().parents[2]
SAVED = EventKind("test.saved", "saved step {step} to {folder}")
WAITING = EventKind("test.waiting", "waiting for sync #{sync}", logging.WARNING)

# The modules that declare the project's event kinds.
EMITTING_MODULES = [
    "torchtitan.train",
    "torchtitan.trainer",
    "torchtitan.components.metrics",
    "torchtitan.components.checkpoint",
    "torchtitan.components.ft.build",
    "torchtitan.components.ft.manager",
    "torchtitan.experiments.fault_tolerance.events",
]


def test_one_call_gives_the_line_and_the_event(records: list[logging.LogRecord]) -> None:
    SAVED.emit(step=12, folder="/dump/step-12")
    WAITING.emit(sync=3)
    assert [r.getMessage() for r in records] == [
        "saved step 12 to /dump/step-12",
        "waiting for sync #3",
    ]
    assert records[1].levelno == logging.WARNING
    saved = event_of(records[0])
    assert saved is not None and saved.name == "test.saved"
    assert (saved.step, saved.sync, saved.fields) == (12, None, {"folder": "/dump/step-12"})


def test_plain_log_lines_carry_no_event(records: list[logging.LogRecord]) -> None:
    logger.info("just text")
    assert event_of(records[0]) is None


def test_the_step_line_keeps_its_text_and_colours() -> None:
    values = {
        "step": 7,
        "loss": 5.25,
        "grad_norm": 0.5,
        "memory_gib": 1.5,
        "tps": 12345.6,
        "tflops": 0.0123,
        "mfu_pct": None,
        "groups": 2,
    }
    plain = "step:     7  loss:   5.2500  grad_norm:  0.5000  memory:  1.50 GiB  tps: 12,346  "
    plain += "tflops: 0.012  mfu: n/a  groups: 2"
    assert TRAIN_STEP.render(values) == plain
    colored = TRAIN_STEP.render({**values, "mfu_pct": 41.25, "groups": None}, color=True)
    assert colored.startswith("\033[31mstep:     7\033[0m  \033[32mloss:   5.2500\033[0m  ")
    assert colored.endswith("mfu: 41.2%")


def test_the_event_file_appends_each_start_and_reads_back(tmp_path: Path) -> None:
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        first = attach_event_file(tmp_path, replica=1, rank=0)
        SAVED.emit(step=5, folder="a")
        logger.info("not an event")
        detach_event_file(first)
        SAVED.emit(step=6, folder="after detach")  # nobody writes it
        # A start killed in the middle of a line leaves it torn; the next start appends.
        path = event_file_path(tmp_path, 1, 0)
        with path.open("a") as f:
            f.write('{"event": "test.saved", "ti')
        second_start = time.time()
        second = attach_event_file(tmp_path, replica=1, rank=0)
        other_rank = attach_event_file(tmp_path, replica=1, rank=1)
        SAVED.emit(step=10, folder="b")
        WAITING.emit(sync=4)
        detach_event_file(second)
        detach_event_file(other_rank)
    finally:
        logger.setLevel(level)

    assert path == tmp_path / "events" / "replica_1_rank_0.jsonl"
    assert len(path.read_text().splitlines()) == 4  # 3 events and the torn line
    saved = read_events(path, SAVED)
    assert [(e.step, e["folder"]) for e in saved] == [(5, "a"), (10, "b")]
    assert saved[0].replica == 1 and saved[0].rank == 0 and saved[0].time > 0 and saved[0].pid
    folder = tmp_path / "events"
    assert [e.rank for e in read_events(folder, "test.saved", since=second_start)] == [0, 1]
    assert [e.sync for e in read_events(folder, WAITING, rank=1)] == [4]
    assert read_events(folder, SAVED, replica=0) == []
    assert read_events(tmp_path / "missing") == []


def test_a_tail_reads_what_was_appended_since_it_last_looked(tmp_path: Path) -> None:
    path = event_file_path(tmp_path, 0, 0)
    missing = EventTail(path)
    assert missing.read() == []  # no file yet
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        handler = attach_event_file(tmp_path, replica=0, rank=0)
        SAVED.emit(step=1, folder="a")
        new = EventTail(path)  # from the end: step 1 was there before it
        whole = EventTail(path, whole_file=True)
        SAVED.emit(step=2, folder="b")
        WAITING.emit(sync=3)
        assert [e.step for e in missing.read()] == [1, 2, None]
        assert [e.step for e in new.read(SAVED)] == [2]  # the others are passed over
        assert [e.step for e in whole.read("test.saved")] == [1, 2]
        with path.open("a") as f:  # a line being written: held back until it is complete
            f.write('{"event": "test.saved", "time": 1.0, "rank": 0, "pid": 1, "st')
        assert new.read() == []
        with path.open("a") as f:
            f.write('ep": 4, "fields": {}}\n{"torn\n')
        assert [(e.name, e.step) for e in new.read()] == [("test.saved", 4)]
        assert new.read() == []
        detach_event_file(handler)
    finally:
        logger.setLevel(level)


def test_a_run_without_fault_tolerance_writes_per_rank_files(tmp_path: Path) -> None:
    assert event_file_path(tmp_path, None, 3) == tmp_path / "events" / "rank_3.jsonl"


def test_every_declared_event_kind_is_documented() -> None:
    docs = (REPO / "docs" / "design.md").read_text()
    kinds = [
        value
        for name in EMITTING_MODULES
        for value in vars(importlib.import_module(name)).values()
        if isinstance(value, EventKind)
    ]
    assert len(kinds) > 20
    missing = sorted({k.name for k in kinds if f"`{k.name}`" not in docs})
    assert not missing, f"event kinds not documented in docs/design.md: {missing}"
