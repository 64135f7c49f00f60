"""Async DiLoCo with real replica groups: a real ``torchft_lighthouse`` and two ``run_train.sh``
groups on 127.0.0.1 with the tiny debug model. A sync point finishes the sync started one
period earlier (its ``semi_sync.sync`` event) and starts the next; after every committed sync
both groups hold the same global parameters (``semi_sync.global_digest``)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration_tests.harness import FAULTS_MODULE, SEMI_SYNC_MODULE, FTJob, tail
from tests.integration_tests.test_semi_sync import (
    SYNC_STEPS,
    args,
    assert_clean_syncs_agree,
    assert_loss_falls,
    global_digests,
    syncs,
)
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import (
    FINAL_DIGEST,
    FINAL_MODEL,
    FINISHED_ALONE,
    GLOBAL_DIGEST,
    HEALED,
    INNER_STEPS_PLANNED,
    OUTER_STATE,
    SPEED_PROBE,
    SYNC,
)
from torchtitan.experiments.fault_tolerance.sync.lineage import job_model
from torchtitan.tools.cluster import signal_pids
from torchtitan.trainer import TRAINING_FINISHED


@pytest.mark.parametrize("method, fragments", [("async_eager", 1), ("async_delayed_streaming", 2)])
def test_clean_run_syncs_identical_global_params(
    ft_job: Callable[..., FTJob], method: str, fragments: int
) -> None:
    """12 steps, sync_steps=4: sync points every 4 / fragments steps. Each finishes the sync
    started at the previous one, the end of training finishes the last: every sync is
    committed by both groups, fragments take turns, both groups log the same global digest
    and the same averaged pseudo-gradient norm for every sync, the loss falls, and both end
    with the same model."""
    steps = 12
    job = ft_job(groups=2, train_args=args(SEMI_SYNC_MODULE, method, f"--training.steps={steps}"))
    job.start()
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    period = SYNC_STEPS // fragments
    expected = steps // period
    per_group = [syncs(job.events(r, SYNC)) for r in range(2)]
    for found in per_group:
        assert [s.number for s in found] == list(range(1, expected + 1)), found
        assert all(s.committed and s.groups == 2 for s in found), found
        assert [s.fragment for s in found] == [i % fragments for i in range(expected)]
        # Sync K is started at step K * period and applied one sync point later; the last one
        # is started and finished in the last step.
        assert [s.step for s in found] == [*range(2 * period, steps + 1, period), steps]
        assert all(s.pseudo_grad_norm is not None and s.pseudo_grad_norm > 0 for s in found)
    for r in range(2):  # equal steps and batches: equal token weights
        raw = job.events(r, SYNC)
        # A fragment's inner steps since its last sync (the first: since the start).
        steps_in = [min(SYNC_STEPS, (i + 1) * period) for i in range(expected)]
        assert [e["inner_steps"] for e in raw] == steps_in
        assert [e["weight"] for e in raw] == [0.5] * expected
    assert_clean_syncs_agree(job, per_group, expected)
    first, last = assert_loss_falls(job.events(0, TRAIN_STEP))
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    assert job.events(0, FINAL_MODEL)[0]["dropped_inner_steps"] is None
    # Beside the model: a global copy, a period start and a momentum of the parameters' size,
    # and the all-reduce buffer of the largest fragment.
    held = job.events(0, OUTER_STATE)[0].fields
    params = held["params_mib"]
    assert held["global_copy_mib"] == held["period_start_mib"] == held["momentum_mib"] == params
    assert params / fragments <= held["buffers_mib"] <= params + 1e-3, held
    print(
        f"{method}: {expected} syncs, each applied one sync point later, identical digests; "
        f"loss {first:.3f} -> {last:.3f}; both groups end with {final[0][0]}"
    )


@pytest.mark.parametrize("ranks, periods", [(1, 6), (2, 3)])
def test_groups_of_different_speeds_take_different_inner_steps_and_agree(
    ft_job: Callable[..., FTJob], ranks: int, periods: int
) -> None:
    """DyLU (and Delayed Nesterov) with a straggler: group 1's steps take 4x as long as
    group 0's, with 4x the work of a step (``emulate_slowdown``, real compute) and 4x the
    pause after it (0.4 s against 0.1 s). The pauses set the ratio whatever the load on the
    machine's cores: with compute alone, a period of milliseconds measured beside other
    tests' processes gave group 1 a full period now and then. In every period, the first too
    (planned by the speed probe after inner step 2), group 1 takes fewer inner steps than
    sync_steps=8, and fewer than group 0 (which fills the time group 1's steps take: about
    8; in the first period it trains on while the probe's quorum waits for group 1's first
    two steps, and plans the rest of its period if that is not over); both pass the same
    sync points, every sync is committed by both with identical global digests, each
    sync's two weights are the groups' token shares and add up to 1, and both end with the
    same model after their own numbers of steps. With 2 ranks per group (FSDP2), every rank
    of a group takes the probe's plan at the same inner step, and the same plans after it."""
    sync_steps = 8
    steps = periods * sync_steps
    base = [
        *args(FAULTS_MODULE, "async_eager", f"--training.steps={steps}"),
        f"--fault_tolerance.sync_steps={sync_steps}",
        "--fault_tolerance.dynamic_local_steps",
        "--fault_tolerance.outer_momentum_every=2",  # Delayed Nesterov, in a real run too
    ]
    job = ft_job(groups=2, ngpu=ranks, train_args=base)
    job.start_lighthouse()
    job.start_group(0, ["--fault_injection.step_sleep_s=0.1"])
    job.start_group(1, ["--training.emulate_slowdown=4", "--fault_injection.step_sleep_s=0.4"])
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    per_group = [syncs(job.events(r, SYNC, rank=0)) for r in range(2)]
    for found in per_group:
        assert [s.number for s in found] == list(range(1, periods + 1)), found
        assert all(s.committed and s.groups == 2 for s in found), found
    if ranks == 1:
        assert_clean_syncs_agree(job, per_group, periods)
    for rank in range(ranks):  # FSDP2: each rank's digest is of its shard, the same in both
        digests = [global_digests(job.events(r, GLOBAL_DIGEST, rank=rank)) for r in range(2)]
        assert sorted(digests[0]) == list(range(1, periods + 1)), digests
        assert digests[0] == digests[1], (rank, digests)
    raw = [job.events(r, SYNC, rank=0) for r in range(2)]
    inner = [[e["inner_steps"] for e in raw[r]] for r in range(2)]
    assert all(n < sync_steps for n in inner[1]), inner
    assert all(n0 > n1 for n0, n1 in zip(inner[0], inner[1], strict=True)), inner
    # The probe planned the first period (the corrections within it may move the count).
    probes = [job.events(r, SPEED_PROBE, rank=0) for r in range(2)]
    assert [e["after"] for e in probes[1]] == [2], probes
    assert probes[1][0]["steps"] < sync_steps, probes
    # Group 0 trains on while the probe's quorum waits for group 1's first two steps (8 of
    # its own): it plans the rest of its period, or, if it got there first, nothing.
    assert [e["after"] for e in probes[0]] in ([2], []), probes
    assert all(probes[1][0]["steps"] < e["steps"] for e in probes[0]), probes
    # Each took the plan in a later step than the probe's.
    assert all(e["planned_at"] >= 3 for found in probes for e in found), probes
    for r in range(2):  # every rank of a group: the same plan, at the same step
        for rank in range(1, ranks):
            probe = [(e["planned_at"], e["steps"]) for e in job.events(r, SPEED_PROBE, rank=rank)]
            assert probe == [(e["planned_at"], e["steps"]) for e in probes[r]], (r, rank)
            rank_inner = [e["inner_steps"] for e in job.events(r, SYNC, rank=rank)]
            assert rank_inner == inner[r], (r, rank, rank_inner, inner[r])
    for e0, e1 in zip(raw[0], raw[1], strict=True):
        assert e0["weight"] + e1["weight"] == pytest.approx(1.0)
        assert e1["weight"] == pytest.approx(e1["tokens"] / (e0["tokens"] + e1["tokens"]))
    planned = job.events(1, INNER_STEPS_PLANNED, rank=0)
    assert planned and all(e["steps"] < sync_steps for e in planned), planned
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST, rank=0)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    last_steps = [job.events(r, TRAINING_FINISHED, rank=0)[-1].step for r in range(2)]
    assert last_steps == [sum(inner[0]), sum(inner[1])], last_steps
    assert last_steps[1] < last_steps[0], last_steps
    planned_at = [[e["planned_at"] for e in found] for found in probes]
    weights = [round(e["weight"], 3) for e in raw[1]]
    print(
        f"DyLU, {ranks} rank(s) per group, group 1 at 4x the work per step: probe after step "
        f"2 planned at steps {planned_at}; inner steps per period {inner[0]} and {inner[1]}; "
        f"group 1's weights {weights}; {periods} syncs with identical digests; both end "
        f"with {final[0][0]}"
    )


def test_a_whole_job_restart_from_checkpoints_one_sync_point_apart_resumes_identical_groups(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Async DiLoCo, int4 with error feedback, checkpoints every 2 steps (mid-period: each
    holds the sync in flight as arrived). The whole job restarts with group 0 on its
    checkpoint of step 6 (sync 1 in flight) and group 1 on step 10 (sync 2 in flight), one
    sync point apart, as DyLU's groups' latest checkpoints are (they take different steps per
    period). Group 0 heals from group 1's newer checkpoint, and with it takes group 1's sync in
    flight: both apply the same average at their next sync point, agree at every sync and end
    with the same model (applying its own older sum, group 0 would disagree at the next sync
    and the run would stop: two groups have no majority)."""
    common = [
        "--checkpoint.enable",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
    ]
    first_args = args(SEMI_SYNC_MODULE, "async_int4", "--training.steps=12", *common)
    first = ft_job(groups=2, train_args=first_args).run_to_end()
    job = ft_job(
        tmp_path / "restart",
        groups=2,
        dump_folder=first.dump_folder,
        train_args=args(SEMI_SYNC_MODULE, "async_int4", "--training.steps=20", *common),
    )
    job.start_lighthouse()
    job.start_group(0, ["--checkpoint.load_step=6"])
    job.start_group(1, ["--checkpoint.load_step=10"])
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    healed = job.events(0, HEALED)
    assert [(e["case"], e["peer"]) for e in healed] == [("newer_checkpoint", 1)], healed
    per_group = [syncs(job.events(r, SYNC)) for r in range(2)]
    shared = sorted({s.number for s in per_group[0]} & {s.number for s in per_group[1]})
    assert shared and all(s.committed for found in per_group for s in found), per_group
    digests = [global_digests(job.events(r, GLOBAL_DIGEST)) for r in range(2)]
    assert all(digests[0][n] == digests[1][n] for n in shared), digests
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    print(f"restart at steps 6 and 10: syncs {shared} agree; both end with {final[0][0]}")


def test_a_group_stopped_until_the_others_finished_ends_with_a_named_lineage(
    ft_job: Callable[..., FTJob],
) -> None:
    """Async DiLoCo with int8. Group 1 is stopped (SIGSTOP, alive but frozen) after step 6 and
    resumed only once group 0 has finished: group 0 goes on alone once the lighthouse stops
    counting the frozen group and finishes; group 1 then finds no peer and trains its
    remaining periods alone from its stale copy (a collective that met the frozen group would
    fail after the 3 s collective timeout). Both exit 0 with different models, and nothing is
    silent: each final model carries its lineage (the same last shared sync, syncs alone
    since), each group warns that it finished alone, and the job's model is group 0's (it
    carried the job on first)."""
    train_args = [
        *args(FAULTS_MODULE, "async_eager", "--training.steps=24"),
        "--fault_tolerance.pseudo_grad_dtype=int8",
        "--fault_tolerance.sync_collective_timeout_s=3",
        "--fault_injection.step_sleep_s=0.2",
    ]
    job = ft_job(groups=2, train_args=train_args)
    job.start()
    job.wait_for_event(1, TRAIN_STEP, timeout=240, where=lambda e: e.step == 6)
    frozen = job.group_pids(1)
    signal_pids(frozen, signal.SIGSTOP)
    try:
        assert job.wait_exit(0, timeout=240) == 0, tail(job.latest(0).text())
    finally:
        signal_pids(frozen, signal.SIGCONT)
    assert job.wait_exit(1, timeout=240) == 0, tail(job.latest(1).text())
    finals = {r: job.events(r, FINAL_MODEL)[0].fields for r in range(2)}
    assert finals[0]["digest"] != finals[1]["digest"]
    assert finals[0]["last_shared_sync"] == finals[1]["last_shared_sync"] is not None
    assert finals[0]["solo_syncs"] > 0 and finals[1]["solo_syncs"] > 0, finals
    for r in range(2):
        alone = job.events(r, FINISHED_ALONE)
        assert [e["solo_syncs"] for e in alone] == [finals[r]["solo_syncs"]]
    assert job_model(finals) == 0
    print(
        f"group 1 frozen after step 6: both finished alone after sync "
        f"#{finals[0]['last_shared_sync']} ({finals[0]['solo_syncs']} and "
        f"{finals[1]['solo_syncs']} syncs alone); the job's model is group 0's"
    )
