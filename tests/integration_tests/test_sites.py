"""Sites of replica groups (``fault_tolerance.groups_per_site``): 2 sites x 2 groups, a job
lighthouse and one lighthouse per site, real processes.

Each test kills groups mid-period and restarts them without a checkpoint, then checks what the
issue asks of sites: the dead group's site keeps committing steps while it is down, the
restarted group heals from its site (a whole site: from the other site), every group ends with
the same final model, and each site sends one payload per sync over the slow link (one group
of the site reports the sync's bytes, the others none, and both sites' payloads are equal).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration_tests.faults import STALLED_AFTER_STEP
from tests.integration_tests.harness import FAST_ARGS, FAULTS_MODULE, FTJob, tail
from torchtitan.components.ft.build import MANAGER_STARTED
from torchtitan.components.ft.manager import HEALED as FT_HEALED
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import FINAL_MODEL, SITE_LEADER, SYNC

GROUPS_PER_SITE = 2
SITES = 2
#: A period of 5 steps; the victims stop after step 7, mid-period.
METHODS = {
    "diloco": ["--fault_tolerance.semi_sync_method=diloco"],
    "async_int4": [
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.pseudo_grad_dtype=int4",
        "--fault_tolerance.error_feedback",
    ],
}
STOP_AFTER = 7


def site_args(method: str, steps: int) -> list[str]:
    return [
        *FAST_ARGS,
        FAULTS_MODULE,
        *METHODS[method],
        "--fault_tolerance.sync_steps=5",
        # Sites wait for each other at every sync: a site whose group is down does not fall a
        # sync behind (that is the whole-site case's heal).
        "--fault_tolerance.min_replica_size=2",
        f"--training.steps={steps}",
        "--fault_injection.step_sleep_s=0.1",
    ]


def _steps_between(job: FTJob, replica_id: int, since: float, until: float) -> list[int]:
    found = job.events(replica_id, TRAIN_STEP, rank=0, all_starts=True)
    return [e.step for e in found if since <= e.time < until and e.step is not None]


def _check_one_payload_per_site(job: FTJob) -> dict[int, int]:
    """Per committed sync: in each site exactly one group sent bytes over the slow link, and
    the sites sent equal payloads. Returns the payload per sync number."""
    sent: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for replica in range(SITES * GROUPS_PER_SITE):
        for event in job.events(replica, SYNC, rank=0, all_starts=True):
            if event["committed"] and event.sync is not None:
                sent[event.sync][replica // GROUPS_PER_SITE].append(event["bytes_sent"])
    payloads = {}
    for number, by_site in sorted(sent.items()):
        carried = {site: [b for b in found if b > 0] for site, found in by_site.items()}
        for site, nonzero in carried.items():
            assert len(nonzero) == 1, f"sync #{number}, site {site}: bytes sent {by_site[site]}"
        assert len({b[0] for b in carried.values()}) == 1, f"sync #{number}: {dict(by_site)}"
        payloads[number] = next(iter(carried.values()))[0]
    return payloads


def _final_digests(job: FTJob) -> set[str]:
    digests = set()
    for replica in range(SITES * GROUPS_PER_SITE):
        found = job.events(replica, FINAL_MODEL, rank=0)
        assert len(found) == 1, tail(job.latest(replica).text())
        digests.add(found[0]["digest"])
    return digests


@pytest.mark.parametrize(
    ("method", "victim"),
    [("diloco", 0), ("async_int4", 1), ("async_int4", 0)],
    ids=["diloco-leader_killed", "async_int4_ef-follower_killed", "async_int4_ef-leader_killed"],
)
def test_a_dead_group_costs_its_site_a_share_and_heals_from_it(
    ft_job: Callable[..., FTJob], tmp_path: Path, method: str, victim: int
) -> None:
    """Group ``victim`` of site 0 (0: the site's leader, which carries its syncs) stops after
    step 7 and is SIGKILLed there; its site's other group drops it and keeps committing steps;
    it is held between steps (a pause file) until the restarted victim is back, so that the job
    cannot end first; the victim heals from it, and all four groups end equal."""
    survivor = 1 - victim
    pause = tmp_path / "pause_survivor"
    job = ft_job(groups=4, groups_per_site=GROUPS_PER_SITE, train_args=site_args(method, 40))
    job.start_lighthouse()
    for site in range(SITES):
        job.start_site_lighthouse(site)
    for replica in range(SITES * GROUPS_PER_SITE):
        extra = []
        if replica == victim:
            extra = [f"--fault_injection.stall_after_step={STOP_AFTER}"]
        elif replica == survivor:
            extra = [f"--fault_injection.pause_file={pause}"]
        job.start_group(replica, extra)
    job.wait_for_event(victim, STALLED_AFTER_STEP, timeout=240)
    job.kill_group(victim)
    killed = time.time()  # the events' clock
    # The survivor drops the victim (heartbeat timeout) and commits steps without it.
    job.wait_for_event(
        survivor, TRAIN_STEP, timeout=120, rank=0, where=lambda e: e.step >= STOP_AFTER + 4
    )
    pause.touch()
    restart = time.time()
    job.start_group(victim)
    job.wait_for_event(victim, MANAGER_STARTED, timeout=120)
    pause.unlink()
    healed = job.wait_for_event(victim, FT_HEALED, timeout=120)
    for replica in range(SITES * GROUPS_PER_SITE):
        assert job.wait_exit(replica, timeout=300) == 0, tail(job.latest(replica).text())

    down = _steps_between(job, survivor, killed, restart)
    assert len(down) >= 3, f"site 0 committed steps {down} while group {victim} was down"
    assert "semi_sync" in healed[0]["states"], healed[0].fields
    if victim == 0:
        leaders = job.events(survivor, SITE_LEADER, rank=0, all_starts=True)
        assert [e["leader"] for e in leaders] == [1], "group 1 of site 0 leads once group 0 is gone"
    payloads = _check_one_payload_per_site(job)
    assert len(payloads) >= 6, payloads
    assert len(_final_digests(job)) == 1


def test_a_whole_site_killed_and_restarted_heals_from_the_other_site(
    ft_job: Callable[..., FTJob],
) -> None:
    """Both groups of site 1 stop after step 7 and are SIGKILLed; site 0 waits for site 1 at
    its next sync (min_replica_size=2 sites). Site 1 restarts without checkpoints: its leader
    heals from site 0 in that sync's quorum, its other group from its leader at the next step,
    and all four groups end equal."""
    job = ft_job(groups=4, groups_per_site=GROUPS_PER_SITE, train_args=site_args("diloco", 25))
    job.start_lighthouse()
    for site in range(SITES):
        job.start_site_lighthouse(site)
    for replica in range(SITES * GROUPS_PER_SITE):
        extra = [f"--fault_injection.stall_after_step={STOP_AFTER}"] if replica >= 2 else []
        job.start_group(replica, extra)
    for replica in (2, 3):
        job.wait_for_event(replica, STALLED_AFTER_STEP, timeout=240)
    for replica in (2, 3):
        job.kill_group(replica)
    for replica in (2, 3):
        job.start_group(replica)
    for replica in range(SITES * GROUPS_PER_SITE):
        assert job.wait_exit(replica, timeout=300) == 0, tail(job.latest(replica).text())
    leader_heals = job.events(2, "semi_sync.healed", rank=0)
    assert leader_heals and leader_heals[0]["peer"] == 0, "site 1's leader heals from site 0"
    behind = job.events(3, "semi_sync.site_fell_behind", rank=0)
    assert behind, "site 1's other group heals from its leader after the leader's heal"
    assert job.events(3, FT_HEALED, rank=0), tail(job.latest(3).text())
    _check_one_payload_per_site(job)
    assert len(_final_digests(job)) == 1
