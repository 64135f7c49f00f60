"""Fixtures shared by the unit tests: what the project logger recorded during a test."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from torchtitan.tools.events import Event, event_of
from torchtitan.tools.logging import logger


def _capture(keep: Callable[[logging.LogRecord], Any]) -> Iterator[list[Any]]:
    """Everything ``keep`` returns (other than None) for the records logged at INFO or above
    while the test runs."""
    found: list[Any] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept = keep(record)
            if kept is not None:
                found.append(kept)

    handler = Keep()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield found
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """The project logger's records during the test."""
    yield from _capture(lambda record: record)


@pytest.fixture
def events() -> Iterator[list[Event]]:
    """The events emitted during the test."""
    yield from _capture(event_of)
