"""``torchtitan.tools.cluster``: process trees, a job's processes and their environment, the
lighthouse's life cycle and the fault-injection schedules. Groups here are small Python
scripts standing in for ``run_train.sh``; the lighthouse is the real ``torchft_lighthouse``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from torchtitan.tools.cluster import (
    JOB_ENV,
    LocalJob,
    PeriodicKills,
    ProcessSpec,
    Restarts,
    StepKills,
    kill_tree,
    process_tree,
    processes_with_env,
)

# A parent whose child starts a session of its own, as torchrun does with its workers.
PARENT_OF_A_DETACHED_CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
    "start_new_session=True); time.sleep(60)"
)
# A stand-in group: writes its arguments and environment as JSON to the file named in argv[1].
RECORD_ARGS_AND_ENV = (
    "import json, os, sys; json.dump({'argv': sys.argv[2:], 'env': dict(os.environ)}, "
    "open(sys.argv[1], 'w'))"
)


def _wait_until(condition, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_kill_tree_kills_children_in_other_sessions():
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{JOB_ENV: marker})
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_OF_A_DETACHED_CHILD], env=env, start_new_session=True
    )
    try:
        _wait_until(lambda: len(process_tree(parent.pid)) >= 2)
        tree = process_tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        assert sorted(processes_with_env(JOB_ENV, marker)) == sorted(tree)
        kill_tree(parent.pid)
        parent.wait(timeout=10)
        _wait_until(lambda: not processes_with_env(JOB_ENV, marker), timeout=10)
    finally:
        for pid in processes_with_env(JOB_ENV, marker):
            os.kill(pid, 9)
        if parent.poll() is None:
            parent.kill()
        parent.wait()


def test_closing_after_an_error_kills_every_process_of_the_job(tmp_path: Path):
    entry = [sys.executable, "-c", PARENT_OF_A_DETACHED_CHILD]
    with pytest.raises(RuntimeError, match="a failing test"):
        with LocalJob(tmp_path, groups=2, entry=entry) as job:
            job.lighthouse_address = "http://127.0.0.1:1"  # the stand-ins never call it
            for replica_id in range(2):
                job.start_group(replica_id)
            _wait_until(lambda: len(job.pids()) == 4)
            raise RuntimeError("a failing test")
    assert processes_with_env(JOB_ENV, job.job_id) == []
    assert all(not p.alive() for p in job.processes)


def test_a_group_gets_its_flags_environment_and_a_log_per_start(tmp_path: Path):
    record = tmp_path / "record.json"
    job = LocalJob(
        tmp_path,
        groups=3,
        ngpu=2,
        threads=1,
        log_all_ranks=True,
        train_args=["--training.steps=5"],
        entry=[sys.executable, "-c", RECORD_ARGS_AND_ENV, str(record)],
    )
    with job:
        job.lighthouse_address = "http://127.0.0.1:1234"
        first = job.start_group(2, ["--metrics.log_freq=1"])
        assert first.wait(60) == 0
        seen = json.loads(record.read_text())
        second = job.start_group(2)
        assert second.wait(60) == 0
    assert seen["argv"] == [
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id=2",
        "--fault_tolerance.group_size=3",
        "--training.steps=5",
        "--metrics.log_freq=1",
    ]
    env = seen["env"]
    assert env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:1234"
    assert env["TORCHFT_MANAGER_PORT"] == "0"  # bound where the kernel picks, as it binds
    assert (env["NGPU"], env["LOG_RANK"], env["OMP_NUM_THREADS"]) == ("2", "0,1", "1")
    assert env["PYTHONUNBUFFERED"] == "1" and env[JOB_ENV] == job.job_id
    assert [p.log.name for p in job.starts[2]] == ["group2_start0.log", "group2_start1.log"]
    assert first.max_rss_mib is not None and first.max_rss_mib > 0


def test_the_launch_hook_decides_how_a_group_is_started(tmp_path: Path):
    record = tmp_path / "record.json"

    def under_env(replica_id: int, spec: ProcessSpec) -> ProcessSpec:
        # As a benchmark prefixes ``ip netns exec NS`` or ``taskset -c CPU``.
        return ProcessSpec(["env", f"WHICH_GROUP={replica_id}", *spec.argv], spec.env)

    entry = [sys.executable, "-c", RECORD_ARGS_AND_ENV, str(record)]
    with LocalJob(tmp_path, entry=entry, launch_group=under_env) as job:
        assert job.start_group(1).wait(60) == 0
    assert json.loads(record.read_text())["env"]["WHICH_GROUP"] == "1"


def test_a_log_is_followed_line_by_line_until_the_process_exits(tmp_path: Path):
    code = "import time\nfor i in range(3):\n    print(f'line {i}', flush=True); time.sleep(0.1)\n"
    code += "print('no newline at the end', end='')"
    with LocalJob(tmp_path) as job:
        process = job.start_process("printer", [sys.executable, "-c", code])
        lines = list(process.lines())
    assert lines == ["line 0\n", "line 1\n", "line 2\n", "no newline at the end"]
    assert process.returncode == 0


def test_the_lighthouse_is_restarted_on_its_address(tmp_path: Path):
    with LocalJob(tmp_path) as job:
        address = job.start_lighthouse()
        assert address.startswith("http://127.0.0.1:")
        assert job.groups_waiting() == 0
        port = job.kill_lighthouse()
        assert not job.lighthouse.alive()  # type: ignore[union-attr]
        with pytest.raises(OSError):
            job.groups_waiting()
        assert job.restart_lighthouse() == address == f"http://127.0.0.1:{port}"
        assert job.groups_waiting() == 0
        assert [p.log.name for p in job.processes] == [
            "lighthouse_start0.log",
            "lighthouse_start1.log",
        ]
    assert not job.lighthouse.alive()  # type: ignore[union-attr]


def test_a_lighthouse_that_cannot_start_is_reported_with_its_log(tmp_path: Path):
    with LocalJob(tmp_path) as job:
        job.start_lighthouse()
        with pytest.raises(RuntimeError, match="Address already in use"):
            job.start_lighthouse(job.lighthouse_port)  # the port is taken


def test_step_kills_fire_once_at_or_after_their_step():
    kills = StepKills([(1, 10)])
    assert not kills.due(1, 9) and not kills.due(0, 10)
    assert kills.due(1, 12)
    assert not kills.due(1, 13)


def test_periodic_kills_are_repeatable_from_their_seed():
    kills = PeriodicKills(every_s=10.0, seed=3, now=100.0, jitter=0.5)
    rng = random.Random(3)
    assert kills.next_at == pytest.approx(100.0 + 10.0 * rng.uniform(0.5, 1.5))
    assert not kills.due(kills.next_at - 0.1) and kills.due(kills.next_at)
    assert kills.choose([0, 1]) == rng.choice([0, 1])
    kills.reschedule(200.0, delay_s=1.0)
    assert kills.next_at == 201.0
    steady = PeriodicKills(every_s=5.0, seed=0, now=0.0)
    assert steady.next_at == 5.0
    assert PeriodicKills(every_s=0.0, seed=0, now=0.0).due(1e9) is False


def test_restarts_fall_due_after_their_delay():
    restarts = Restarts(after_s=5.0)
    restarts.schedule(1, killed_at=10.0)
    assert restarts.pending(1) and not restarts.due(1, 14.9)
    assert restarts.take_due(15.0) == [1]
    assert not restarts.pending(1)
    restarts.schedule(0, killed_at=0.0)
    restarts.cancel(0)
    assert restarts.take_due(100.0) == []
