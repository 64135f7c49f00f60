"""One process of a local job: how it is started, its log file, its exit and its peak memory."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (the trainer colours its step lines)."""
    return _ANSI.sub("", text)


@dataclass
class ProcessSpec:
    """What to run: the command line and its whole environment."""

    argv: list[str]
    env: dict[str, str]


#: How a process is started: takes the spec the job built and returns the one to run, e.g. with
#: a prefix (``taskset -c 0 ...``, ``ip netns exec NS ...``) or more environment.
Launch = Callable[[ProcessSpec], ProcessSpec]


def as_built(spec: ProcessSpec) -> ProcessSpec:
    """The default launch: run the spec unchanged."""
    return spec


class Process:
    """A started process and its log (stdout and stderr together).

    Reap it only through :meth:`poll` or :meth:`wait` (not ``popen.wait``): they collect its
    peak resident set with the exit status, which ``subprocess`` would throw away. Safe to call
    from several threads.
    """

    def __init__(
        self, name: str, popen: subprocess.Popen, log: Path, replica_id: int | None = None
    ) -> None:
        self.name = name
        self.popen = popen
        self.log = log
        self.replica_id = replica_id
        self.started = time.monotonic()
        #: The same moment by the wall clock (``time.time()``), the clock of event files.
        self.started_at = time.time()
        #: When the job killed it on purpose (``time.monotonic()``); None if it was not.
        self.killed_at: float | None = None
        self.returncode: int | None = None
        #: Peak resident set of the process and its waited-for children, MiB (after exit).
        self.max_rss_mib: float | None = None
        self._reaping = threading.Lock()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        with self._reaping:
            if self.returncode is not None:
                return self.returncode
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid == 0:
                return None
            self.returncode = os.waitstatus_to_exitcode(status)
            self.popen.returncode = self.returncode  # Popen must not wait for it again
            self.max_rss_mib = usage.ru_maxrss / 1024  # KiB on Linux
            return self.returncode

    def alive(self) -> bool:
        return self.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for the exit; raises ``TimeoutError`` with the log's tail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} still running after {timeout:.0f}s:\n{self.tail()}"
                )
            time.sleep(0.05)
        return code

    def text(self) -> str:
        """The log so far, without colour codes."""
        return strip_ansi(self.log.read_text(errors="replace")) if self.log.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def lines(self, poll_s: float = 0.05) -> Iterator[str]:
        """The log's lines (colour codes kept) as they are written, until the process has
        exited and its log is read to the end."""
        with open(self.log, errors="replace") as f:
            partial = ""
            while True:
                partial += f.readline()
                if partial.endswith("\n"):
                    yield partial
                    partial = ""
                elif self.poll() is None:
                    time.sleep(poll_s)
                else:
                    # It has exited: what it wrote is all in the file now.
                    yield from (partial + f.read()).splitlines(keepends=True)
                    return


def start(
    name: str, spec: ProcessSpec, log: Path, cwd: Path, replica_id: int | None = None
) -> Process:
    """Start ``spec`` with its output in ``log``. Each process leads a session of its own, so
    that a Ctrl-C in the terminal reaches only the one who started it (which then stops the
    job in order), and it never reads the terminal."""
    with open(log, "w") as out:
        popen = subprocess.Popen(
            spec.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=spec.env, cwd=cwd, start_new_session=True,
        )  # fmt: skip
    return Process(name, popen, log, replica_id)
