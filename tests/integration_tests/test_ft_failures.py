"""What a replica group does when it cannot train: it fails clearly or waits visibly, never
hangs and never trains alone when it must not.

* No lighthouse: the group exits 1 within ``connect_timeout_s`` (plus start-up) with one error
  naming the address and the field.
* ``min_replica_size=2`` and one group dies: the survivor commits nothing alone; it logs that it
  waits (a few lines, not one per poll); when the dead group comes back both go on, identical.
* A new job whose other group never comes: the first group waits for it (saying so) and gives up
  after ``quorum_timeout_s`` with an error naming the field.
"""

from __future__ import annotations

import time

from tests.integration_tests.harness import FAST_ARGS, PACED_ARGS, per_step
from torchtitan.components.ft.manager import QUORUM_FORMED, QUORUM_WAITING
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.tools.cluster import free_port
from torchtitan.trainer import PARAM_DIGEST


def test_no_lighthouse_fails_with_clear_error(ft_job):
    job = ft_job(groups=2)
    port = free_port()  # nothing listens there
    job.lighthouse_address = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    job.start_group(0, ["--fault_tolerance.connect_timeout_s=3", "--training.steps=5"])
    code = job.wait_exit(0, timeout=90)
    seconds = time.monotonic() - start
    text = job.latest(0).text()
    errors = [line for line in text.splitlines() if "ERROR" in line]
    print(f"\n[ft test] no lighthouse: exit {code} after {seconds:.1f}s: {errors}")
    assert code == 1
    assert seconds < 60  # start-up (a few seconds, more on a busy machine) + connect_timeout_s
    assert len(errors) == 1, text
    assert f"127.0.0.1:{port}" in errors[0]
    assert "connect_timeout_s=3" in errors[0]
    assert "Traceback" not in text


def test_min_replica_size_survivor_waits_and_says_so(ft_job):
    args = [*FAST_ARGS, *PACED_ARGS, "--training.steps=20", "--fault_tolerance.min_replica_size=2"]
    job = ft_job(train_args=args).start()
    job.wait_for_event(1, TRAIN_STEP, timeout=240, where=lambda e: e.step == 5)
    job.kill_group(1)
    killed_at = time.monotonic()
    last_before = max(e.step for e in job.events(0, TRAIN_STEP))
    job.wait_for_event(0, QUORUM_WAITING, timeout=60, count=2)  # reported at 5 s and 10 s
    waited = time.monotonic() - killed_at
    steps = job.events(0, TRAIN_STEP)
    committed_alone = [e for e in steps if e["groups"] != 2]
    reports = job.events(0, QUORUM_WAITING)
    print(
        f"\n[ft test] min_replica_size=2: survivor at step {last_before} when group 1 died; "
        f"after {waited:.1f}s it had committed nothing alone and logged {len(reports)} waiting "
        f"line(s), e.g. {reports[0].fields}"
    )
    assert not committed_alone, committed_alone
    assert max(e.step for e in steps) <= last_before + 1
    assert len(reports) <= 3, "the watchdog must not log on every poll"
    assert reports[0]["reason"] == "min_replica_size" and reports[0]["groups_needed"] == 2

    job.start_group(1)
    assert job.wait_exit(0, 240) == 0
    assert job.wait_exit(1, 60) == 0
    formed = job.events(0, QUORUM_FORMED)
    assert any(e.step is not None and e["groups"] == 2 for e in formed), formed
    assert all(e["groups"] == 2 for e in job.events(0, TRAIN_STEP))
    d0, d1 = (per_step(job.events(r, PARAM_DIGEST), "digest") for r in (0, 1))
    assert d0[20] == d1[20]


def test_new_job_waits_for_all_groups_then_gives_up(ft_job):
    job = ft_job(groups=2)
    job.start_lighthouse()
    start = time.monotonic()
    job.start_group(0, [*FAST_ARGS, "--training.steps=5", "--fault_tolerance.quorum_timeout_s=8"])
    code = job.wait_exit(0, timeout=90)
    seconds = time.monotonic() - start
    text = job.latest(0).text()
    errors = [line for line in text.splitlines() if "ERROR" in line]
    reports = job.events(0, QUORUM_WAITING)
    print(
        f"\n[ft test] group 0 alone in a new job: exit {code} after {seconds:.1f}s, "
        f"{len(reports)} waiting line(s); {errors}"
    )
    assert code == 1
    assert not job.events(0, TRAIN_STEP), "the first group must not train alone"
    assert reports and reports[0]["reason"] == "group_size" and reports[0]["groups_needed"] == 2
    assert reports[0].step == 1  # waiting before step 1
    assert len(errors) == 1 and "quorum_timeout_s" in errors[0]
