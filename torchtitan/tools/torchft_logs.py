"""torchft's own INFO output: off on a job's console by default, back with ``RUST_LOG=info``.

torchft 0.2.0's Rust side logs every quorum and every commit vote at INFO, several lines per
sync and group. Its level comes from ``RUST_LOG``, read once, when torchft is imported: one of
``error``, ``warn``, ``info``, ``debug``, ``trace``, anything else (or nothing) reading as
``info``. So :func:`quiet_by_default` runs when ``torchtitan`` is imported
(``torchtitan/__init__.py``), before any module of it imports torchft, and sets
``RUST_LOG=warn`` unless the user set it. torchft's Python loggers (``torchft.*``) log at INFO
too; they reach the console only when ``RUST_LOG`` lets torchft's INFO lines through
(:func:`show_python_loggers`). The lighthouse keeps its INFO lines: they go to its log file,
and to the console with the launcher's ``--show-lighthouse``.
"""

from __future__ import annotations

import logging
import os

VARIABLE = "RUST_LOG"
#: torchft's warnings and errors only.
QUIET = "warn"
#: Set beside ``RUST_LOG=warn`` by :func:`quiet_by_default`, so that the processes a job starts
#: (which inherit both) tell this default from a level the user chose.
DEFAULTED = "TORCHTITAN_RUST_LOG_DEFAULTED"
#: The levels torchft reads from ``RUST_LOG``; any other value reads as ``info``.
LEVELS = ("error", "warn", "info", "debug", "trace")


def users_setting() -> str | None:
    """``RUST_LOG`` as the user set it; None when unset or set by :func:`quiet_by_default`."""
    if os.environ.get(DEFAULTED) == os.environ.get(VARIABLE) == QUIET:
        return None
    return os.environ.get(VARIABLE)


def quiet_by_default() -> None:
    """``RUST_LOG=warn`` for this process and those it starts, unless the user set it."""
    if VARIABLE not in os.environ:
        os.environ[VARIABLE] = os.environ[DEFAULTED] = QUIET


def torchft_level(setting: str | None) -> str:
    """The level torchft's Rust side logs at under ``RUST_LOG=setting``."""
    value = (setting or "").strip().lower()
    return value if value in LEVELS else "info"


def asks_for_info(setting: str | None) -> bool:
    """Whether torchft prints its INFO lines under ``RUST_LOG=setting``."""
    return torchft_level(setting) in ("info", "debug", "trace")


def show_python_loggers(handlers: list[logging.Handler]) -> None:
    """When torchft's Rust side prints INFO, its Python loggers print their INFO lines too,
    through ``handlers`` (the project's console format; stderr when there are none)."""
    if asks_for_info(os.environ.get(VARIABLE)):
        torchft = logging.getLogger("torchft")
        torchft.setLevel(logging.INFO)
        torchft.handlers[:] = handlers or [logging.StreamHandler()]
        torchft.propagate = False


def lighthouse_setting() -> str:
    """The lighthouse's ``RUST_LOG``: the user's, else ``info`` (its log keeps every quorum)."""
    return users_setting() or "info"
