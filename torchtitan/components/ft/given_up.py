"""Collectives given up while still blocked, and how a process exits with them.

When a peer of a collective is known to be gone (the lighthouse dropped it), the trainer stops
waiting for the collective: the sync fails and training goes on. On gloo the collective itself
cannot be cancelled: its thread stays blocked until the collective's own timeout (minutes, for
a sync's transfer), and so does the thread that releases its process group (gloo's destructor
waits for it). Those threads carry a name made by :func:`thread_name`.

If the process exits while one is still blocked, the interpreter's teardown aborts it (SIGABRT:
a C++ thread still inside gloo) after a run that succeeded. :func:`exit_if_blocked` exits
without that teardown instead, keeping the run's exit status.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from torchtitan.tools.logging import logger

_PREFIX = "ft-given-up-"


def thread_name(what: str) -> str:
    """The name of a thread that may stay blocked in a collective given up (``what``)."""
    return f"{_PREFIX}{what}"


def blocked() -> list[str]:
    """The threads still blocked in a collective given up, by name."""
    return [t.name for t in threading.enumerate() if t.name.startswith(_PREFIX) and t.is_alive()]


def exit_if_blocked(status: int) -> None:
    """Exit now with ``status``, skipping the interpreter's teardown, if a thread is still
    blocked in a collective given up; return otherwise. Logs and standard streams are
    flushed first."""
    still = blocked()
    if not still:
        return
    logger.info(
        f"[ft] exiting past {len(still)} thread(s) still blocked in collectives given up "
        "(a peer that is gone); they end with the process"
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
