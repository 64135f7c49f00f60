"""The tests' warm starts (``warm_start.py``) train as a cold start does, and a warm group's
process behaves as the trainer it stands for: it exits as the trainer did, and killing it kills
the trainer."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration_tests import warm_start
from tests.integration_tests.harness import FAST_ARGS, PACED_ARGS, FTJob, per_step
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.tools.cluster import ProcessSpec
from torchtitan.trainer import PARAM_DIGEST


@pytest.fixture(autouse=True)
def _zygote_runs() -> None:
    if warm_start.SOCKET_ENV not in os.environ:  # set by conftest's session fixture
        pytest.skip("no zygote: TORCHTITAN_TEST_COLD_START=1")


def test_a_warm_trainer_trains_bit_for_bit_as_a_cold_one(tmp_path: Path) -> None:
    """One group, 4 steps, started cold and then warm: the same parameters after every step.
    The cold trainer is the process the job started (run_train.sh execs it); the warm one is
    another, forked by the zygote."""
    digests = {}
    for warm in (False, True):
        job = FTJob(
            tmp_path / ("warm" if warm else "cold"),
            groups=1,
            train_args=[*FAST_ARGS, "--training.steps=4"],
            warm=warm,
        ).run_to_end()
        events = job.events(0, PARAM_DIGEST)
        digests[warm] = per_step(events, "digest")
        assert ({e.pid for e in events} == {job.latest(0).pid}) is not warm
    assert sorted(digests[True]) == [1, 2, 3, 4]
    assert digests[True] == digests[False]


def test_a_warm_group_exits_as_its_trainer_and_dies_with_it(tmp_path: Path) -> None:
    """The trainer SIGKILLed: the group's process ends killed by SIGKILL too. The group's
    process SIGKILLed (as tests crash a group): its trainer is gone at once."""
    job = FTJob(tmp_path, groups=2, train_args=[*FAST_ARGS, *PACED_ARGS, "--training.steps=200"])
    with job:
        job.start()
        trainers = []
        for r in range(2):
            (step,) = job.wait_for_event(r, TRAIN_STEP, timeout=240, where=lambda e: e.step == 2)
            assert step.pid != job.latest(r).pid and step.pid in job.group_pids(r)
            trainers.append(step.pid)
        os.kill(trainers[0], signal.SIGKILL)
        assert job.latest(0).wait(30) == -signal.SIGKILL
        job.kill_group(1)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{trainers[1]}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{trainers[1]}"), "the killed group's trainer lives on"


def test_a_warm_trainer_takes_its_group_process_s_pinning(tmp_path: Path) -> None:
    """A group started as ``taskset -c 0 <python> ...`` (as the benchmarks pin groups): its
    warm trainer runs on core 0 only, as a cold one would. (Its network namespace follows the
    same way: the WAN smoke runs, ``test_benchmarks_wan_smoke.py``, whose warm trainers reach
    their lighthouse only from inside their namespaces.)"""
    job = FTJob(tmp_path, groups=1, train_args=[*FAST_ARGS, *PACED_ARGS, "--training.steps=200"])
    warm = job.launch_group
    job.launch_group = lambda replica_id, spec: warm(
        replica_id, ProcessSpec(["taskset", "-c", "0", *spec.argv], spec.env)
    )
    with job:
        job.start()
        (step,) = job.wait_for_event(0, TRAIN_STEP, timeout=240, where=lambda e: e.step == 2)
        assert step.pid != job.latest(0).pid
        assert os.sched_getaffinity(step.pid) == {0}
