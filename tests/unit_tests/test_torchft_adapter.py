"""The adapter over torchft's internals is version-checked before the core builds anything of
torchft, so another torchft fails with one clear error instead of deep inside a quorum."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from torchtitan.components.ft import FaultToleranceError, build_ft_manager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.config import JobConfig


def fault_tolerant_config() -> JobConfig:
    config = JobConfig()
    config.fault_tolerance.enable = True
    config.fault_tolerance.group_size = 1
    config.fault_tolerance.lighthouse = "http://127.0.0.1:1"
    return config


def test_installed_torchft_is_the_one_the_adapter_was_written_for():
    tft.check_version()


def test_core_build_refuses_another_torchft_version(monkeypatch):
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        return "9.9.9" if name == "torchft" else real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(tft.TorchftVersionError, match="torchft==0.2.0") as info:
        build_ft_manager(fault_tolerant_config(), None, {})  # type: ignore[arg-type]
    assert isinstance(info.value, FaultToleranceError)  # one error line, exit 1
    assert "torchft_adapter.py" in str(info.value)


def test_core_build_without_fault_tolerance_checks_nothing(monkeypatch):
    def no_torchft(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_torchft)
    assert build_ft_manager(JobConfig(), None, {}) is None  # type: ignore[arg-type]


def test_errors_torchft_handles_itself_are_logged_in_one_line(caplog):
    """torchft's Manager logs a handled error (its process group could not be configured, or a
    collective timed out while it was waited on: a lighthouse restart mid-sync) with a traceback
    although the run goes on; the console gets one WARNING line instead, so a traceback there
    always means a crash. Its other errors keep their traceback."""
    tft.quiet_known_noise()
    tft.quiet_known_noise()  # a second call adds no second filter
    torchft_logger = logging.getLogger("torchft.manager")
    with caplog.at_level(logging.INFO, logger="torchft.manager"):
        for message in (
            "[1/0 - step 16] got exception in pg configure: %s",
            "got exception waiting for work %s",
            "unexpected: %s",
        ):
            try:
                raise RuntimeError("wait timeout after 5000ms, keys: /torchft/1/0/rebuild_1/0/1")
            except RuntimeError as e:
                torchft_logger.exception(message, e)
    *handled, other = caplog.records
    console = logging.Formatter("%(levelname)s %(message)s")
    for record in handled:
        assert console.format(record).count("\n") == 0 and record.levelname == "WARNING"
        assert "wait timeout after 5000ms" in record.getMessage()
        assert "(handled: not committed, retried at next quorum)" in record.getMessage()
    assert "got exception in pg configure" in handled[0].getMessage()
    assert "got exception waiting for work" in handled[1].getMessage()
    assert "Traceback" in console.format(other) and other.levelname == "ERROR"
