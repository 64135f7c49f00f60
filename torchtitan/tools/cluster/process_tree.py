"""Finding and killing the processes of a job, each by PID.

A replica group is more than its first process: ``torchrun`` starts its workers in sessions of
their own, so signalling the group's process group (or session) misses them. The whole tree is
collected from ``/proc`` first and then signalled PID by PID; a worker that outlived its parent
(re-parented to init, out of every tree) is found by a marker in its environment.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state, parent pid, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None  # it exited while we looked
    # Field 2, the command name, may contain spaces and parentheses: the fields after it
    # start after its closing parenthesis.
    return stat[stat.rfind(")") + 2 :].split()


def process_state(pid: int) -> str:
    """The process's state letter (``R``, ``S``, ``Z`` for a zombie not yet reaped, ...);
    ``""`` once it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else ""


def _parent_of_each_process() -> dict[int, int]:
    """{pid: parent pid} of every process visible in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            parents[int(entry)] = int(fields[1])
    return parents


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_of_each_process().items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of this user's processes (this one excepted) whose environment holds
    ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue  # another user's, or it exited
    return found


def signal_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each PID; one that has exited meanwhile is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid`` and every descendant. The tree is collected before the first signal: a
    child whose parent dies is re-parented at once and would no longer be found under it."""
    signal_pids(process_tree(pid), sig)
