"""Makes a long quorum wait visible, without making a short one noisy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator


def report_times(schedule: tuple[float, ...], then_every_s: float) -> Iterator[float]:
    """When a wait is reported, in seconds since it began: ``schedule``, then every
    ``then_every_s`` after its last entry."""
    yield from schedule
    last = schedule[-1]
    while True:
        last += then_every_s
        yield last


class QuorumWaitWatchdog:
    """Reports, from a thread, while the trainer is blocked waiting for a quorum: calls
    ``report(waited_s)`` at each of :func:`report_times` (the caller logs it: ``FTManager``
    emits an ``ft.quorum_waiting`` event)."""

    #: After 5 s, then at 10, 20, 40 and 60 s, then every 60 s (the one place this is said).
    SCHEDULE_S: tuple[float, ...] = (5.0, 10.0, 20.0, 40.0, 60.0)
    THEN_EVERY_S = 60.0

    def __init__(self, report: Callable[[float], object], tick_s: float = 0.25) -> None:
        self._report = report
        self._tick_s = tick_s
        self._since: float | None = None
        self._due = report_times(self.SCHEDULE_S, self.THEN_EVERY_S)
        self._next_report = next(self._due)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.reports = 0
        self._thread = threading.Thread(target=self._run, name="ft-watchdog", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """The trainer starts waiting (no-op if it already is)."""
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()
                self._due = report_times(self.SCHEDULE_S, self.THEN_EVERY_S)
                self._next_report = next(self._due)

    def end(self) -> float:
        """The wait is over; returns how long it lasted."""
        with self._lock:
            since, self._since = self._since, None
        return 0.0 if since is None else time.monotonic() - since

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            with self._lock:
                if self._since is None:
                    continue
                waited = time.monotonic() - self._since
                if waited < self._next_report:
                    continue
                self._next_report = next(self._due)
            self.reports += 1
            self._report(waited)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
