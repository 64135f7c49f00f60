"""Structured events: each fact a run reports (a step, a sync, a heal, a stall, a change of the
quorum, a checkpoint) is one event with a name, the step and/or sync number it belongs to, and
fields. The file format and every event name with its fields: ``docs/design.md`` ("Events").

A kind of event is declared once, next to the code that emits it, with the console line it
renders to (a ``str.format`` template over ``step``, ``sync`` and the fields, or a function)::

    SAVED = EventKind("checkpoint.saved", "Saved checkpoint step {step} to {folder}")
    SAVED.emit(step=12, folder="/dump/checkpoint/step-12")

Emitting is one call on the project logger: the record's message is the rendered line and the
record also carries the :class:`Event`, so the console and the event file cannot disagree.
:class:`EventFile` (a logging handler that the trainer attaches when training starts) appends
each such record as one JSON line to this rank's file; :func:`read_events` reads them back,
:class:`EventTail` follows one file as it grows.
Tests and benchmarks read events, never the console text, so a line's wording may change.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

#: The folder of the event files, under the job's dump folder.
EVENTS_FOLDER = "events"

# The attribute of a log record that holds its event (``logging``'s ``extra=``).
_RECORD_ATTRIBUTE = "event"

#: How an event kind renders its line: a ``str.format`` template, or a function of the values
#: (``step``, ``sync`` and the fields) and of whether the console shows colours.
LineTemplate = str | Callable[[dict[str, Any], bool], str]


@dataclass(frozen=True)
class Event:
    """One event. ``time`` (seconds since the epoch), ``replica``, ``rank`` and ``pid`` are set
    when it is read back from a file (``replica`` is None without fault tolerance)."""

    name: str
    step: int | None = None
    sync: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0
    replica: int | None = None
    rank: int = 0
    pid: int = 0

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


@dataclass(frozen=True)
class EventKind:
    """A kind of event: its name, its console line, and the level it is logged at."""

    name: str
    line: LineTemplate
    level: int = logging.INFO

    def render(self, values: dict[str, Any], color: bool = False) -> str:
        if isinstance(self.line, str):
            return self.line.format(**values)
        return self.line(values, color)

    def emit(
        self,
        *,
        step: int | None = None,
        sync: int | None = None,
        color: bool = False,
        **fields: Any,
    ) -> None:
        """Log the event's line on the project logger, the event attached to the record.
        ``color``: the line may use terminal colours (the event itself has none)."""
        if not logger.isEnabledFor(self.level):
            return
        line = self.render({"step": step, "sync": sync, **fields}, color)
        event = Event(self.name, step, sync, fields)
        logger.log(self.level, line, extra={_RECORD_ATTRIBUTE: event})


def event_of(record: logging.LogRecord) -> Event | None:
    """The event a log record carries, if any (for handlers, and tests that capture records)."""
    event = getattr(record, _RECORD_ATTRIBUTE, None)
    return event if isinstance(event, Event) else None


def event_file_path(dump_folder: str | os.PathLike[str], replica: int | None, rank: int) -> Path:
    """``<dump_folder>/events/replica_<R>_rank_<r>.jsonl``, or ``rank_<r>.jsonl`` without
    fault tolerance (``replica`` None)."""
    name = f"rank_{rank}.jsonl" if replica is None else f"replica_{replica}_rank_{rank}.jsonl"
    return Path(dump_folder) / EVENTS_FOLDER / name


class EventFile(logging.Handler):
    """A handler of the project logger that appends every record carrying an event to
    ``path``, one JSON object per line, flushed as it is written. Each process appends (a
    restarted one adds to what the previous start wrote); each line is one ``write`` of an
    append-only descriptor, so readers never see half a line unless the process was killed
    in the middle of it."""

    def __init__(self, path: Path, replica: int | None, rank: int) -> None:
        super().__init__()
        self.path = path
        self.replica = replica
        self.rank = rank
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if not _ends_a_line(path):
            os.write(self._fd, b"\n")  # after a line torn by a kill: start a fresh one

    def emit(self, record: logging.LogRecord) -> None:
        event = event_of(record)
        if event is None or self._fd < 0:
            return
        entry: dict[str, Any] = {"event": event.name, "time": record.created}
        if self.replica is not None:
            entry["replica"] = self.replica
        entry.update(rank=self.rank, pid=record.process)
        if event.step is not None:
            entry["step"] = event.step
        if event.sync is not None:
            entry["sync"] = event.sync
        entry["fields"] = event.fields
        try:
            data = (json.dumps(entry, default=str) + "\n").encode()
            while data:
                data = data[os.write(self._fd, data) :]
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        finally:
            self.release()
        super().close()


def attach_event_file(
    dump_folder: str | os.PathLike[str], replica: int | None, rank: int
) -> EventFile:
    """Start writing this rank's events (see :func:`event_file_path`); returns the handler, to
    pass to :func:`detach_event_file` at the end."""
    handler = EventFile(event_file_path(dump_folder, replica, rank), replica, rank)
    logger.addHandler(handler)
    return handler


def detach_event_file(handler: EventFile) -> None:
    logger.removeHandler(handler)
    handler.close()


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_events(
    source: str | os.PathLike[str],
    name: str | EventKind | None = None,
    *,
    replica: int | None = None,
    rank: int | None = None,
    since: float | None = None,
) -> list[Event]:
    """The events of one event file, or of every ``*.jsonl`` file in a folder (e.g.
    ``<dump_folder>/events``), oldest first. Filters: ``name`` (or a kind), ``replica``,
    ``rank``, and ``since`` (events at or after this ``time.time()``, e.g. those of a start
    that began then). A missing file or folder has no events. A line that is not JSON (torn
    when its process was killed while writing it) is skipped."""
    path = Path(source)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path] if path.is_file() else []
    wanted = name.name if isinstance(name, EventKind) else name
    found = [
        event
        for event in _parse(files)
        if (wanted is None or event.name == wanted)
        and (replica is None or event.replica == replica)
        and (rank is None or event.rank == rank)
        and (since is None or event.time >= since)
    ]
    return sorted(found, key=lambda event: event.time)


def _parse(files: Iterable[Path]) -> Iterable[Event]:
    for file in files:
        for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
            event = _event_of_line(line)
            if event is not None:
                yield event


def _event_of_line(line: str) -> Event | None:
    """The event of one line of an event file; None for a line that is not one (torn)."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(entry, dict) or "event" not in entry:
        return None
    return Event(
        name=entry["event"],
        step=entry.get("step"),
        sync=entry.get("sync"),
        fields=entry.get("fields", {}),
        time=entry.get("time", 0.0),
        replica=entry.get("replica"),
        rank=entry.get("rank", 0),
        pid=entry.get("pid", 0),
    )


class EventTail:
    """Follows one event file as it grows, for a program that acts on a running job's events
    (the launcher's ``--kill R@S``, a benchmark waiting for a sync): each :meth:`read` returns
    the events appended since the previous one, starting from the end of what the file holds
    when the tail is made (events of earlier starts and earlier jobs are skipped), or from its
    beginning with ``whole_file``. Re-reading the whole file with :func:`read_events` at every
    poll would cost time in proportion to everything it holds. A line still being written is
    kept back until it is complete; a torn one is skipped."""

    def __init__(self, path: str | os.PathLike[str], whole_file: bool = False) -> None:
        self.path = Path(path)
        self._offset = self.path.stat().st_size if self.path.is_file() and not whole_file else 0
        self._partial = b""

    def read(self, name: str | EventKind | None = None) -> list[Event]:
        """The events (of ``name``, or a kind; the others are passed over) completed since
        the last read, oldest first."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        wanted = name.name if isinstance(name, EventKind) else name
        events = (_event_of_line(line.decode("utf-8", errors="replace")) for line in lines)
        return [e for e in events if e is not None and (wanted is None or e.name == wanted)]
