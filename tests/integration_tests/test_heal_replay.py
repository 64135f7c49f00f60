"""Healing without the WAN (``heal.history``), with a real lighthouse and real replica groups.

Group 1 checkpoints at step 8 (sync #2), is killed after step 9, and group 0 goes on alone for
two more syncs (#3 and #4). Group 1 is then restarted from its own checkpoint while group 0 is
held between two steps, so that it joins at group 0's sync #5. With a history of at least two
syncs, group 0 sends only the two averages it committed alone; group 1 replays them onto its
checkpoint. The digest exchange in that quorum and every later sync prove the replay bit for
bit (``assert_same_global_params``). With a history of one sync the same restart heals in full
and says why.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration_tests.faults import (
    EXITING_SERVING_REPLAY,
    HELD_BEFORE_SYNC,
    REPLAY_PAYLOAD_DAMAGED,
    STALLED_AFTER_STEP,
)
from tests.integration_tests.harness import FAULTS_MODULE, FTJob, tail
from tests.integration_tests.test_semi_sync import (
    _restart_while_paused,
    args,
    assert_same_global_params,
    global_digests,
    syncs,
)
from torchtitan.components.checkpoint import CHECKPOINT_RESUMED
from torchtitan.experiments.fault_tolerance.events import (
    CHECKPOINT_AHEAD,
    FINAL_DIGEST,
    GLOBAL_DIGEST,
    HEALED,
    REPLAY_FAILED,
    SYNC,
)
from torchtitan.tools.events import Event

#: Parameters of the tests' model (``debugmodel_small``; its log says so at start-up).
PARAMS = 131_648

CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval=8", "--checkpoint.keep_latest_k=0"]


def _restart_behind(
    job: FTJob,
    pause: Path,
    alone_until: int,
    group0: list[str] | None = None,
    before_restart: Callable[[], None] | None = None,
    restart_env: dict[str, str] | None = None,
) -> None:
    """Kill group 1 after step 9 (its checkpoint: step 8, sync #2), let group 0 commit syncs
    alone up to ``alone_until``, then restart group 1 (``restart_env``: variables for that
    start) so that it heals at group 0's next sync."""
    job.start_lighthouse()
    job.start_group(0, [f"--fault_injection.pause_file={pause}", *(group0 or [])])
    job.start_group(1, ["--fault_injection.stall_after_step=9"])
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=240)
    job.kill_group(1)
    job.wait_for_event(
        0, SYNC, timeout=240, where=lambda e: e["committed"] and e.sync == alone_until
    )
    if before_restart is not None:
        before_restart()
    _restart_while_paused(job, pause, [], restart_env)
    job.wait_for_event(1, HEALED, timeout=240)
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())


def _paced(method: str = "diloco", *extra: str, steps: int = 40) -> list[str]:
    return args(
        FAULTS_MODULE,
        method,
        f"--training.steps={steps}",
        "--fault_injection.step_sleep_s=0.05",
        *CHECKPOINT,
        *extra,
    )


def _full_heal(job: FTJob) -> Event:
    """Group 1's one heal, a full one; both groups then agree to the end."""
    (healed,) = job.events(1, HEALED)
    assert healed["transfer"] == "full", healed.fields
    assert healed["bytes_received"] > 0 and healed["replayed_syncs"] == 0
    assert_same_global_params(job)
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    return healed


@pytest.mark.parametrize(
    "method, extra",
    [
        ("diloco", []),
        (
            "streaming",
            ["--fault_tolerance.pseudo_grad_dtype=int4", "--fault_tolerance.error_feedback"],
        ),
        ("async_int4", []),  # int4 with error feedback; its checkpoint holds a sync in flight
        ("async_sparse", []),  # a history entry holds every group's sparse encoding
    ],
)
def test_a_group_restarted_from_its_checkpoint_replays_the_syncs_it_missed(
    ft_job: Callable[..., FTJob], tmp_path: Path, method: str, extra: list[str]
) -> None:
    pause = tmp_path / "pause_group0"
    # A history longer than the 2 syncs aimed at: under load group 0 may pass another sync
    # point before its pause takes hold.
    history = "--fault_tolerance.heal_history_syncs=8"
    job = ft_job(groups=2, train_args=_paced(method, history, *extra))
    # The syncs committed by step 8: DiLoCo's at steps 4 and 8; Streaming syncs one of its 2
    # fragments every 2 steps; async DiLoCo commits a sync one sync point after its start.
    checkpoint_sync = {"diloco": 2, "streaming": 4, "async_int4": 1, "async_sparse": 1}[method]
    _restart_behind(job, pause, alone_until=checkpoint_sync + 2)

    assert [e.step for e in job.events(1, CHECKPOINT_RESUMED)] == [8]
    (healed,) = job.events(1, HEALED)
    behind = healed.sync - 1 - checkpoint_sync  # the syncs committed since its checkpoint
    assert behind >= 2
    assert (healed["case"], healed["transfer"]) == ("replay", "replay"), healed.fields
    assert healed["replayed_syncs"] == behind, healed.fields
    assert healed["full_because"] is None
    # What a replay carries: the missed averages as they travelled (fp32: 4 bytes per
    # parameter of the synced fragment; int4: about 0.53, scales included, here also for a
    # sync the peer's own checkpoint waited for), and no tensor of the small state. A full heal
    # carries ~20 bytes per parameter.
    # sparse: 2 groups' encodings of 120 bytes per 4,096 values, 0.06.
    per_param = {"diloco": 4.0, "async_sparse": 0.07}.get(method, 0.6)
    synced = PARAMS / (2 if method == "streaming" else 1)
    assert 0 < healed["bytes_received"] <= behind * synced * per_param, healed.fields
    survivor = syncs(job.events(0, SYNC))
    digests = assert_same_global_params(job)
    restarted = global_digests(job.events(1, GLOBAL_DIGEST))
    assert min(restarted) == healed.sync and restarted[healed.sync] == digests[healed.sync]
    assert survivor[-1].committed and survivor[-1].groups == 2
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    print(
        f"{method}: group 1 resumed at sync #{checkpoint_sync}, replayed {behind} syncs "
        f"({healed['bytes_received']} bytes) at sync #{healed.sync}; {len(digests)} digests "
        "agree"
    )


def test_a_group_restarted_within_the_period_of_its_checkpoint_replays_nothing(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Killed after step 9, restarted before the job's next sync (group 0 is held at that
    sync point): its checkpoint (sync #2) is the job's last sync, so it receives only the
    small state."""
    hold = tmp_path / "hold_group0"
    job = ft_job(groups=2, train_args=_paced())
    job.start_lighthouse()
    job.start_group(
        0, [f"--fault_injection.hold_before_sync_file={hold}", "--fault_injection.step_sleep_s=0.3"]
    )
    job.start_group(1, ["--fault_injection.stall_after_step=9"])
    job.wait_for_event(0, SYNC, timeout=240, where=lambda e: e["committed"] and e.sync == 2)
    hold.touch()  # group 0 is 4 steps of 0.3 s away from sync #3
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=240)
    job.kill_group(1)
    job.wait_for_event(0, HELD_BEFORE_SYNC, timeout=60, where=lambda e: e.sync == 3)
    job.wait_until_dead_to_lighthouse(alive=1)
    job.start_group(1, [])
    job.wait_quorum_request(1)
    hold.unlink()
    job.wait_for_event(1, HEALED, timeout=240)
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    (healed,) = job.events(1, HEALED)
    assert healed.sync == 3 and healed["transfer"] == "replay", healed.fields
    assert healed["replayed_syncs"] == 0
    assert healed["bytes_received"] < 10_000  # positions, LR schedule, step: no tensor of size
    assert_same_global_params(job)
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final


def test_a_group_further_behind_than_the_history_heals_in_full_and_says_why(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    pause = tmp_path / "pause_group0"
    job = ft_job(groups=2, train_args=_paced("diloco", "--fault_tolerance.heal_history_syncs=1"))
    _restart_behind(job, pause, alone_until=4)
    healed = _full_heal(job)
    behind = healed.sync - 1 - 2
    assert healed["full_because"] == (
        f"it is {behind} syncs behind and the peer keeps 1 (fault_tolerance.heal_history_syncs)"
    )


def test_a_damaged_history_entry_is_never_replayed(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Group 0 damages its kept average of sync #3 (in memory): group 1, which missed it,
    heals in full instead."""
    pause = tmp_path / "pause_group0"
    job = ft_job(groups=2, train_args=_paced())
    _restart_behind(
        job, pause, alone_until=4, group0=["--fault_injection.corrupt_heal_history_sync=3"]
    )
    assert _full_heal(job)["full_because"] == (
        "the peer's history entry of sync #3 fails its checksum"
    )


def test_an_average_damaged_on_the_wire_fails_the_replay_and_the_group_heals_in_full(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Group 0 damages the second average it sends (its history keeps it intact): group 1
    replays the first, sees the damage on arrival and still takes the rest (group 0 is not
    held up), says so, nobody commits that sync, and group 1 heals in full at the next one,
    saying why."""
    pause = tmp_path / "pause_group0"
    job = ft_job(groups=2, train_args=_paced())
    damage = ["--fault_injection.damage_replay_payload=2"]
    _restart_behind(job, pause, alone_until=4, group0=damage)
    assert [e["index"] for e in job.events(0, REPLAY_PAYLOAD_DAMAGED)] == [2]
    (failed,) = job.events(1, REPLAY_FAILED)
    # Group 1's checkpoint is at sync #2: the second average it missed is sync #4's.
    assert failed["problem"] == "the history entry of sync #4 arrived damaged", failed.fields
    healed = _full_heal(job)
    assert healed["full_because"] == (
        "its replay failed before (the history entry of sync #4 arrived damaged)"
    )
    # The sync of the failed replay was committed by nobody (group 0's only failed one): sync
    # #5 is made again a period later, with group 1 healed in full.
    (uncommitted,) = [e for e in job.events(0, SYNC) if not e["committed"]]
    assert uncommitted.step < healed.step and uncommitted.sync == healed.sync


def test_a_peer_that_dies_during_a_replay_stops_the_group_instead_of_training_on_half_of_it(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Group 0 exits once it has sent the first average group 1 missed. Group 1 replayed it,
    so its state is neither its checkpoint's nor the job's: alone now, it stops with one line
    saying why instead of training on."""
    pause = tmp_path / "pause_group0"
    job = ft_job(groups=2, train_args=_paced())
    job.start_lighthouse()
    job.start_group(
        0,
        [f"--fault_injection.pause_file={pause}", "--fault_injection.exit_serving_replay_after=1"],
    )
    job.start_group(1, ["--fault_injection.stall_after_step=9"])
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=240)
    job.kill_group(1)
    job.wait_for_event(0, SYNC, timeout=240, where=lambda e: e["committed"] and e.sync == 4)
    # Alone after group 0 is gone, group 1 waits for the others up to quorum_timeout_s.
    _restart_while_paused(job, pause, ["--fault_tolerance.quorum_timeout_s=5"])
    assert job.wait_exit(0, timeout=240) == 3, tail(job.latest(0).text())
    assert [e["sent"] for e in job.events(0, EXITING_SERVING_REPLAY)] == [1]
    assert job.wait_exit(1, timeout=240) != 0
    text = job.latest(1).text()
    assert (
        "this group cannot go on from its own checkpoint: its replay of the syncs it missed "
        "stopped part-way (payload 2 of "
    ) in text, tail(text)
    assert not job.events(1, HEALED) and not job.events(1, SYNC)


def test_a_checkpoint_of_another_run_is_never_replayed_onto(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Group 1 restarts from another run's checkpoint of the same config and step (another
    seed): its global parameters at sync #2 are not the job's, so it heals in full."""
    other = ft_job(
        tmp_path / "other", groups=2, train_args=_paced("diloco", "--training.seed=1", steps=8)
    ).run_to_end()
    pause = tmp_path / "pause_group0"
    job = ft_job(groups=2, train_args=_paced())

    def swap_checkpoint() -> None:
        mine = job.dump_folder / "checkpoint" / "replica_1" / "step-8"
        shutil.rmtree(mine)
        shutil.copytree(other.dump_folder / "checkpoint" / "replica_1" / "step-8", mine)

    _restart_behind(job, pause, alone_until=3, before_restart=swap_checkpoint)
    assert [e.step for e in job.events(1, CHECKPOINT_RESUMED)] == [8]
    assert _full_heal(job)["full_because"] == (
        "its global parameters of fragment 0 at sync #2 differ from the job's (a checkpoint "
        "of another run, or damaged)"
    )


def test_after_a_whole_job_restart_the_history_is_gone_and_the_older_group_heals_in_full(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Both groups restart: group 0 from step 16 (sync #4), group 1 from step 8 (sync #2).
    Group 0 restarted too, so its history is empty: group 1 heals in full from it."""
    first = ft_job(tmp_path / "first", groups=2, train_args=_paced(steps=16)).run_to_end()
    shutil.rmtree(first.dump_folder / "checkpoint" / "replica_1" / "step-16")
    job = ft_job(
        tmp_path / "restart", groups=2, dump_folder=first.dump_folder,
        train_args=_paced(steps=24),
    )  # fmt: skip
    job.start()
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    assert [e.step for e in job.events(1, CHECKPOINT_RESUMED)] == [8]
    healed = _full_heal(job)
    assert healed["case"] == "newer_checkpoint"
    assert healed["full_because"] == (
        "the peer's history does not reach back to sync #3 (it is empty: the peer restarted "
        "or healed since)"
    )


def test_a_checkpoint_ahead_of_the_running_job_heals_in_full(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Group 0 restarts alone from step 8 (its newer checkpoint lost) and trains on alone to
    sync #3; group 1 then comes back with its checkpoint of step 16 (sync #4), ahead of the
    job: that sync is not committed, and group 1 heals in full at the next one."""
    first = ft_job(tmp_path / "first", groups=2, train_args=_paced(steps=16)).run_to_end()
    shutil.rmtree(first.dump_folder / "checkpoint" / "replica_0" / "step-16")
    pause = tmp_path / "pause_group0"
    job = ft_job(
        tmp_path / "restart", groups=2, dump_folder=first.dump_folder,
        train_args=_paced("diloco", "--fault_tolerance.quorum_timeout_s=3", steps=32),
    )  # fmt: skip
    job.start_lighthouse()
    job.start_group(0, [f"--fault_injection.pause_file={pause}"])
    job.wait_for_event(0, SYNC, timeout=240, where=lambda e: e["committed"] and e.sync == 3)
    _restart_while_paused(job, pause, [])
    job.wait_for_event(1, HEALED, timeout=240)
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    assert [e.step for e in job.events(1, CHECKPOINT_RESUMED)] == [16]
    assert len(job.events(1, CHECKPOINT_AHEAD)) == 1
    healed = _full_heal(job)
    assert healed["full_because"] == (
        f"its checkpoint (sync #4) is ahead of the job (#{healed.sync - 1})"
    )


def test_with_fsdp2_every_rank_replays_its_own_shard(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """2 groups x 2 ranks (FSDP2): each rank of the restarted group asks the same rank of its
    peer for the syncs its shard missed, replays them, and rank r of both groups then holds
    the same global shard at every sync they share."""
    pause = tmp_path / "pause_group0"
    history = "--fault_tolerance.heal_history_syncs=8"
    job = ft_job(groups=2, ngpu=2, train_args=_paced("diloco", history))
    _restart_behind(job, pause, alone_until=4)
    for rank in (0, 1):
        (healed,) = job.events(1, HEALED, rank=rank)
        assert healed["transfer"] == "replay", (rank, healed.fields)
        assert healed["replayed_syncs"] == healed.sync - 1 - 2
        digests = [global_digests(job.events(r, GLOBAL_DIGEST, rank=rank, all_starts=True))
                   for r in range(2)]  # fmt: skip
        shared = sorted(set(digests[0]) & set(digests[1]))
        assert healed.sync in shared
        assert all(digests[0][n] == digests[1][n] for n in shared), rank


def test_a_replay_that_fails_on_one_rank_only_heals_the_group_in_full_without_a_hang(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """2 groups x 2 ranks (FSDP2): group 0's rank 1 damages the second average it serves, so
    group 1's rank 1 stops its replay there while rank 0 replays both. A replay issues no
    collective (the norm of a replayed outer step is not reduced in the group), so the ranks
    still issue the same collectives: they agree in the quorum's exchange that the replay
    failed, nobody commits that sync, and group 1 heals in full at the next one; both groups
    finish within the bound, with the same global parameters."""
    pause = tmp_path / "pause_group0"
    history = "--fault_tolerance.heal_history_syncs=8"
    job = ft_job(groups=2, ngpu=2, train_args=_paced("diloco", history))
    damage = [
        "--fault_injection.damage_replay_payload=2",
        "--fault_injection.damage_replay_payload_rank=1",
    ]
    _restart_behind(job, pause, alone_until=4, group0=damage)
    assert [e["index"] for e in job.events(0, REPLAY_PAYLOAD_DAMAGED)] == [2]
    problems = sorted(e["problem"] for e in job.events(1, REPLAY_FAILED))
    assert problems == [
        "another rank of this group failed its replay",
        "the history entry of sync #4 arrived damaged",
    ], problems
    for rank in (0, 1):
        heals = job.events(1, HEALED, rank=rank)
        assert [h["transfer"] for h in heals] == ["full"], (rank, [h.fields for h in heals])
        digests = [global_digests(job.events(r, GLOBAL_DIGEST, rank=rank, all_starts=True))
                   for r in range(2)]  # fmt: skip
        shared = sorted(set(digests[0]) & set(digests[1]))
        assert heals[0].sync in shared
        assert all(digests[0][n] == digests[1][n] for n in shared), rank
