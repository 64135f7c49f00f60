"""The launcher's pieces that need no training job: arguments, step lines, process trees."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from torchtitan.experiments.fault_tolerance import launcher


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
    match = launcher._STEP_LINE.search(launcher._ANSI.sub("", line))
    assert match and match.group(1) == "10"


def test_kill_tree_kills_children_in_other_sessions():
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{launcher.JOB_ENV: marker})
    # A parent whose child starts its own session, as torchrun does with its workers.
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(launcher.process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = launcher.process_tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        assert sorted(launcher.processes_with_env(launcher.JOB_ENV, marker)) == sorted(tree)
        launcher.kill_tree(parent.pid)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while launcher.processes_with_env(launcher.JOB_ENV, marker):
            assert time.monotonic() < deadline, "the child survived"
            time.sleep(0.05)
    finally:
        for pid in launcher.processes_with_env(launcher.JOB_ENV, marker):
            os.kill(pid, 9)
        if parent.poll() is None:
            parent.kill()
        parent.wait()
