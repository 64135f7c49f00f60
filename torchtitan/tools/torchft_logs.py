"""torchft's own INFO output: off on a job's console by default, back with ``RUST_LOG=info``.

torchft 0.2.0's Rust side logs every quorum and every commit vote at INFO, several lines per
sync and group. Its level comes from ``RUST_LOG``, read once, when torchft is imported; so
:func:`quiet_by_default` runs when ``torchtitan`` is imported (``torchtitan/__init__.py``),
before any module of it imports torchft, and sets ``RUST_LOG=warn`` unless the user set it.
torchft's Python loggers (``torchft.*``) log at INFO too; they reach the console only when
``RUST_LOG`` asks for INFO or more (:func:`show_python_loggers`). The lighthouse keeps its
INFO lines: they go to its log file, and to the console with the launcher's
``--show-lighthouse``.
"""

from __future__ import annotations

import logging
import os

VARIABLE = "RUST_LOG"
#: torchft's warnings and errors only.
QUIET = "warn"
#: ``RUST_LOG`` as the user gave it (None: not set), before :func:`quiet_by_default`.
USERS_SETTING = os.environ.get(VARIABLE)


def quiet_by_default() -> None:
    """``RUST_LOG=warn`` for this process and those it starts, unless the user set it."""
    os.environ.setdefault(VARIABLE, QUIET)


def asks_for_info(setting: str | None) -> bool:
    """Whether a ``RUST_LOG`` value lets INFO lines through (``info``, ``debug``, ``trace``,
    alone or in a directive such as ``torchft=info``)."""
    return setting is not None and any(
        level in setting.lower() for level in ("info", "debug", "trace")
    )


def show_python_loggers(handlers: list[logging.Handler]) -> None:
    """With ``RUST_LOG`` at INFO or more, torchft's Python loggers log their INFO lines through
    ``handlers`` (the project's console format); otherwise they stay at Python's default
    (warnings and errors)."""
    if asks_for_info(os.environ.get(VARIABLE)):
        torchft = logging.getLogger("torchft")
        torchft.setLevel(logging.INFO)
        torchft.handlers[:] = handlers
        torchft.propagate = False


def lighthouse_setting() -> str:
    """The lighthouse's ``RUST_LOG``: the user's, else ``info`` (its log keeps every quorum)."""
    return USERS_SETTING if USERS_SETTING is not None else "info"
