"""The launcher's pieces that need no training job: arguments and step lines."""

from __future__ import annotations

import pytest

from torchtitan.experiments.fault_tolerance import launcher
from torchtitan.tools.cluster import strip_ansi


def test_parse_args_splits_train_args_and_kill_specs():
    args = launcher.parse_args(["--groups", "3", "--kill", "1@10", "--kill", "2@4", "--",
                                "--training.steps=40"])  # fmt: skip
    assert args.groups == 3 and args.kill == [(1, 10), (2, 4)]
    assert args.train_args == ["--training.steps=40"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--kill", "1-10"],
        ["--kill", "5@10"],
        ["--groups", "0"],
        ["--ngpu", "0"],
        ["--min-replicas", "3"],
    ],
)
def test_parse_args_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(["--groups", "2", *argv])
    assert exit_info.value.code == 2
    assert argv[0].lstrip("-").split("-")[0] in capsys.readouterr().err


def test_step_line_is_found_in_coloured_output():
    line = "[group 1] 04:17:24 INFO \x1b[31mstep:    10\x1b[0m  \x1b[32mloss:   5.2964\x1b[0m"
    match = launcher._STEP_LINE.search(strip_ansi(line))
    assert match and match.group(1) == "10"
