"""torchft's own INFO lines stay off a job's console unless RUST_LOG asks for them, and a
command run without the project's dependencies says in one line what to run instead."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.tools import dependencies, torchft_logs

REPO = Path(__file__).resolve().parents[2]

# A lighthouse and one replica's manager server: torchft's Rust side logs both at INFO (the
# manager its first line as it is built).
_START_TORCHFT = """
from datetime import timedelta
import torchtitan
from torchft._torchft import LighthouseServer, ManagerServer
from torchtitan.tools.cluster.lighthouse import lighthouse_status
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
port = lighthouse.address().rsplit(":", 1)[1]
# Served only once its server task runs, which logs first that it listens: that line is out
# before the shutdown below, on a machine of any speed.
lighthouse_status(f"http://127.0.0.1:{port}", 30.0)
manager = ManagerServer(
    replica_id="r0", lighthouse_addr=f"http://127.0.0.1:{port}", hostname="127.0.0.1",
    bind="127.0.0.1:0", store_addr="127.0.0.1:1", world_size=1,
    heartbeat_interval=timedelta(seconds=1), connect_timeout=timedelta(seconds=5),
    quorum_retries=0,
)
manager.shutdown()
lighthouse.shutdown()
"""


def _torchft_stderr(rust_log: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    if rust_log is not None:
        env["RUST_LOG"] = rust_log
    result = subprocess.run(
        [sys.executable, "-c", _START_TORCHFT], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_torchft_info_lines_are_off_by_default_and_come_back_with_rust_log_info() -> None:
    assert "[INFO] [torchft::" not in _torchft_stderr(None)
    shown = _torchft_stderr("info")
    assert "[INFO] [torchft::lighthouse]" in shown and "[INFO] [torchft::manager]" in shown


def test_torchft_python_loggers_follow_rust_log(monkeypatch: pytest.MonkeyPatch) -> None:
    torchft = logging.getLogger("torchft")
    monkeypatch.setattr(torchft, "handlers", [])
    monkeypatch.setattr(torchft, "level", logging.NOTSET)
    monkeypatch.setattr(torchft, "propagate", True)
    handler = logging.StreamHandler()
    monkeypatch.setenv("RUST_LOG", "warn")
    torchft_logs.show_python_loggers([handler])
    assert torchft.level == logging.NOTSET and torchft.handlers == []
    monkeypatch.setenv("RUST_LOG", "torchft=info")
    torchft_logs.show_python_loggers([handler])
    assert torchft.level == logging.INFO and torchft.handlers == [handler]
    assert not torchft.propagate


@pytest.mark.parametrize(
    "setting, shows",
    [("warn", False), ("error", False), ("WARN", False), ("info", True), ("DEBUG", True),
     ("trace", True), (None, True), ("", True), ("off", True), ("torchft=warn", True)],
)  # fmt: skip
def test_which_rust_log_values_let_info_through_as_torchft_reads_them(
    setting: str | None, shows: bool
) -> None:
    # torchft 0.2.0 takes one level word; anything else, or nothing, reads as info.
    assert torchft_logs.asks_for_info(setting) is shows


def test_the_lighthouse_logs_info_unless_the_user_chose_a_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RUST_LOG", raising=False)
    monkeypatch.delenv(torchft_logs.DEFAULTED, raising=False)
    torchft_logs.quiet_by_default()
    assert os.environ["RUST_LOG"] == "warn"
    assert torchft_logs.lighthouse_setting() == "info"  # our default is not the user's choice
    monkeypatch.setenv("RUST_LOG", "error")  # the user's, even beside the marker
    assert torchft_logs.lighthouse_setting() == "error"
    torchft_logs.quiet_by_default()
    assert os.environ["RUST_LOG"] == "error"
    monkeypatch.delenv(torchft_logs.DEFAULTED)
    monkeypatch.setenv("RUST_LOG", "warn")
    assert torchft_logs.lighthouse_setting() == "warn"


@pytest.mark.parametrize(
    "module, instead",
    [("torchtitan.train", "./run_train.sh"),
     ("torchtitan.experiments.fault_tolerance.launch.launcher", "./run_launcher.sh"),
     ("torchtitan.experiments.fault_tolerance.plan",
      ".venv/bin/python -m torchtitan.experiments.fault_tolerance.plan")],
)  # fmt: skip
def test_a_command_without_its_dependencies_says_what_to_run_in_one_line(
    module: str, instead: str
) -> None:
    # -S: no site-packages, as for a system python3 without the project's dependencies.
    result = subprocess.run(
        [sys.executable, "-S", "-m", module, "--help"], cwd=REPO, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{module}: torch, tyro, torchft not installed for ")
    assert f"run {instead}" in line


def test_only_this_package_s_commands_are_checked() -> None:
    assert dependencies.module_run(["python", "-m", "torchtitan.train", "-m", "x"], "-m") == (
        "torchtitan.train"
    )
    assert dependencies.module_run(["python", "-m", "pytest", "tests"], "-m") is None
    # An import from a script or another program: Python's own error, not an exit.
    assert (
        dependencies.module_run(["python", "script.py", "-m", "torchtitan.x"], "script.py") is None
    )
