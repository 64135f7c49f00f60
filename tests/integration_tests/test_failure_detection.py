"""A dead or stopped group costs its peers seconds, a slow one nothing: real lighthouse (2 s
heartbeat timeout), real groups, ``sync_collective_timeout_s`` at its default (300 s).

Each victim stalls right after a sync quorum, before its part of the sync's all-reduce
(``--fault_injection.stall_after_quorum``): its peers' transfers of that sync then wait for it.
There it is SIGKILLed, SIGSTOPped, or let go after 8 s (alive and heartbeating all along)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration_tests.faults import STALLED_AFTER_STEP, STALLED_IN_SYNC
from tests.integration_tests.harness import FAST_ARGS, FAULTS_MODULE, FTJob, tail
from tests.integration_tests.test_semi_sync import (
    args,
    assert_same_global_params,
    kill_and_heal_group_1,
)
from torchtitan.components.ft.manager import COMMITTED_AFTER_STALL
from torchtitan.experiments.fault_tolerance.events import HEALED, PEER_GONE, SYNC

ASYNC = [
    *FAST_ARGS,
    FAULTS_MODULE,
    "--fault_tolerance.semi_sync_method=async_diloco",
    "--fault_tolerance.sync_steps=4",
    "--fault_injection.step_sleep_s=0.2",
]
#: Far below the collective timeout (300 s), a few heartbeat timeouts (2 s) and periods.
BOUND_S = 30.0


def _survivor_stall(job: FTJob, replica_id: int, after: float) -> float:
    """The survivor's first stall (previous commit -> the first commit with fewer groups)
    after the kill at ``after``."""
    stall = job.wait_for_event(
        replica_id,
        COMMITTED_AFTER_STALL,
        timeout=120,
        where=lambda e: e.time > after and e["groups"] < e["previous_groups"],
    )[0]
    return float(stall["stall_s"])


def test_a_group_killed_inside_an_async_int4_sync_costs_the_survivors_seconds(
    ft_job: Callable[..., FTJob],
) -> None:
    """3 groups, async DiLoCo, int4 with error feedback: group 2 dies inside its 2nd sync. Both
    survivors commit again with 2 groups within BOUND_S of their previous commit (before the
    fix, 302 s: a transfer waited out the collective timeout) and finish."""
    job = ft_job(
        groups=3,
        train_args=[
            *ASYNC,
            "--fault_tolerance.pseudo_grad_dtype=int4",
            "--fault_tolerance.error_feedback",
            "--training.steps=40",
        ],
    )
    job.start_lighthouse()
    for r in range(2):
        job.start_group(r)
    job.start_group(2, ["--fault_injection.stall_after_quorum=2"])
    job.wait_for_event(2, STALLED_IN_SYNC, timeout=180)
    killed_at = time.time()
    job.kill_group(2)
    stalls = [_survivor_stall(job, r, killed_at) for r in range(2)]
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    assert max(stalls) < BOUND_S, stalls
    print(f"survivors' stalls after the kill: {stalls[0]:.2f} s, {stalls[1]:.2f} s")


def test_a_stopped_group_costs_its_peer_seconds(ft_job: Callable[..., FTJob]) -> None:
    """2 groups, async DiLoCo, int8: group 1 is SIGSTOPped inside its 2nd sync (alive to the
    kernel, silent to the lighthouse, its sockets open). Group 0's sync ends when the
    lighthouse drops group 1, says so, and group 0 goes on alone within BOUND_S (before the
    fix, 301.92 s); it finishes and exits 0 though the abandoned collective still waits."""
    job = ft_job(
        groups=2,
        train_args=[*ASYNC, "--fault_tolerance.pseudo_grad_dtype=int8", "--training.steps=40"],
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(1, ["--fault_injection.stall_after_quorum=2"])
    job.wait_for_event(1, STALLED_IN_SYNC, timeout=180)
    stopped_at = time.time()
    pids = job.group_pids(1)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        stall = _survivor_stall(job, 0, stopped_at)
        gone = job.wait_for_event(0, PEER_GONE, timeout=60)[0]
        assert job.wait_exit(0, timeout=300) == 0, tail(job.latest(0).text())
    finally:
        job.kill_group(1)
    assert stall < BOUND_S, stall
    assert "replica group 1 stopped heartbeating" in gone["message"]
    assert "sync_collective_timeout_s=300s" in gone["message"]
    assert gone.time - stopped_at < BOUND_S
    print(f"survivor's stall: {stall:.2f} s; {gone['message']}")


def test_a_slow_but_live_peer_still_completes_its_sync(ft_job: Callable[..., FTJob]) -> None:
    """2 groups, async DiLoCo: group 1 holds back its part of its 2nd sync for 8 s (four
    heartbeat timeouts) while alive. Group 0 waits for it: that sync commits with both groups,
    and no sync ends on a peer gone."""
    job = ft_job(
        groups=2,
        train_args=[*ASYNC, "--fault_tolerance.pseudo_grad_dtype=int8", "--training.steps=24"],
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(
        1, ["--fault_injection.stall_after_quorum=2", "--fault_injection.stall_seconds=8"]
    )
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    for r in range(2):
        syncs = job.events(r, SYNC)
        assert syncs and all(s["committed"] and s["groups"] == 2 for s in syncs), [
            (s.sync, s["committed"], s["groups"]) for s in syncs
        ]
        assert not job.events(r, PEER_GONE)
    held = [s for s in job.events(0, SYNC) if s.sync == 2]
    assert held and held[0]["seconds"] >= 4.0, held  # it waited for the late part


def test_groups_whose_collectives_cannot_pair_stop_before_any_sync(
    ft_job: Callable[..., FTJob],
) -> None:
    """DiLoCo, group 0 with 1 rank and group 1 with 2 (NGPU): their collectives cannot pair
    (rank 0 of each would all-reduce a whole model with half of one). Both stop in their
    first quorum, before any sync, each with one error line that names both groups' shapes and
    NGPU, not a divergence of the global parameters and not a traceback (the 2-rank group's
    torchrun still adds its own failure report)."""
    job = ft_job(
        groups=2,
        train_args=[
            *FAST_ARGS,
            "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config",
            "--fault_tolerance.semi_sync_method=diloco",
            "--training.steps=20",
        ],
    )
    job.start_lighthouse()
    job.start_group(0)
    job.ngpu = 2
    job.start_group(1)
    for r in range(2):
        assert job.wait_exit(r, timeout=180) != 0
    for r in range(2):
        text = job.latest(r).text()
        other = 1 - r
        assert f"the collectives of replica group {other} cannot pair with this group's" in text, (
            tail(text)
        )
        assert f"it has {1 + other} rank(s)" in text and f"this group has {1 + r} rank(s)" in text
        assert "Start every group with the same NGPU" in text
        assert "disagree on the global parameters" not in text
        assert text.count("ERROR FaultToleranceError") == 1 + r, tail(text)
        assert "Traceback" not in text or "ChildFailedError" in text, tail(text)
        assert not job.events(r, SYNC)


def test_a_heal_slower_than_the_process_group_timeout_completes(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """DiLoCo, group 1 killed and restarted without a checkpoint: it heals in full from group
    0, whose every send of the heal waits 0.1 s (a slow link), so the heal takes longer than
    process_group_timeout_ms (5 s here). The heal completes, in pieces, and both groups go on
    to the end with the same global parameters."""
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            "--training.steps=60",
            "--fault_injection.step_sleep_s=0.03",
            "--fault_injection.heal_send_sleep_s=0.1",
        ),
    )
    kill_and_heal_group_1(job, tmp_path / "pause_group0")
    heal = job.events(1, HEALED)[-1]
    assert heal["transfer"] == "full" and heal["receive_s"] > 5.0, heal.fields
    assert_same_global_params(job)
    print(f"heal: {heal['bytes_received'] / 2**20:.1f} MiB in {heal['receive_s']:.1f} s")


def test_a_group_restarted_with_another_shape_is_refused_before_its_heal(
    ft_job: Callable[..., FTJob],
) -> None:
    """DiLoCo with 1 rank per group; group 1 is killed and restarted with 2 ranks. It could not
    even receive a heal of the other shape: it reads its peer's shape in the heal's metadata,
    refuses the heal (telling the peer, which sends nothing) and stops in one line naming both
    shapes and NGPU. Group 0 goes on alone to the end."""
    job = ft_job(
        groups=2,
        train_args=[
            *FAST_ARGS,
            FAULTS_MODULE,
            "--fault_tolerance.semi_sync_method=diloco",
            "--fault_tolerance.sync_steps=4",
            "--fault_injection.step_sleep_s=0.2",
            "--training.steps=60",
        ],
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(1, ["--fault_injection.stall_after_step=6"])
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=180)
    job.kill_group(1)
    job.ngpu = 2
    job.start_group(1)
    assert job.wait_exit(1, timeout=180) != 0
    text = job.latest(1).text()
    assert "the collectives of the peer it heals from cannot pair with this group's" in text, tail(
        text
    )
    assert "it has 1 rank(s)" in text and "this group has 2 rank(s)" in text
    assert "Start every group with the same NGPU" in text
    assert job.wait_exit(0, timeout=300) == 0, tail(job.latest(0).text())
    assert job.events(0, SYNC)[-1]["committed"]
