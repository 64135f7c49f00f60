"""Semi-synchronous training (LocalSGD, DiLoCo, Streaming DiLoCo) with real replica groups.

Each test runs a real ``torchft_lighthouse`` and two replica groups (``run_train.sh``) on
127.0.0.1 with the tiny debug model, and reads the events the groups emit: the per-step loss, one
``semi_sync.sync`` event per sync and, after every committed sync, a digest of the global
parameters (``semi_sync.global_digest``; DiLoCo: the global copies of all fragments, LocalSGD:
the averaged model). Groups that took part in sync K must give the same digest for K.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration_tests.faults import PAUSED, STALLED_AFTER_STEP, STALLED_IN_SYNC
from tests.integration_tests.harness import (
    FAST_ARGS,
    FAULTS_MODULE,
    SEMI_SYNC_MODULE,
    FTJob,
    per_rank,
    per_step,
    tail,
)
from torchtitan.components.checkpoint import CHECKPOINT_RESUMED
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import (
    FINAL_DIGEST,
    FINAL_MODEL,
    GLOBAL_DIGEST,
    HEALED,
    SYNC,
)
from torchtitan.tools.events import Event

SYNC_STEPS = 4

SPARSE = [
    "--fault_tolerance.pseudo_grad_dtype=sparse",
    "--fault_tolerance.error_feedback",
    "--fault_tolerance.outer_momentum=0",
]
METHODS = {
    "localsgd": ["--fault_tolerance.semi_sync_method=localsgd"],
    "diloco": ["--fault_tolerance.semi_sync_method=diloco"],
    "streaming": [
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.num_fragments=2",
        "--fault_tolerance.fragment_sync_delay=1",
        "--fault_tolerance.fragment_update_alpha=0.5",
    ],
    "async_eager": ["--fault_tolerance.semi_sync_method=async_diloco"],
    "async_delayed_streaming": [
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.async_update=delayed",
        "--fault_tolerance.num_fragments=2",
    ],
    # Compressed pseudo-gradients (transport/): blocking DiLoCo through torchft, and async.
    "diloco_int8": [
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.pseudo_grad_dtype=int8",
    ],
    "async_int4": [
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.pseudo_grad_dtype=int4",
        "--fault_tolerance.error_feedback",
    ],
    # Sparse pseudo-gradients: error feedback and no outer momentum, as the dtype requires.
    "diloco_sparse": [
        "--fault_tolerance.semi_sync_method=diloco",
        *SPARSE,
    ],
    "streaming_sparse": [
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.num_fragments=2",
        "--fault_tolerance.fragment_sync_delay=1",
        *SPARSE,
    ],
    "async_sparse": [
        "--fault_tolerance.semi_sync_method=async_diloco",
        *SPARSE,
    ],
}


@dataclass
class Sync:
    step: int
    fragment: int
    committed: bool
    groups: int
    pseudo_grad_norm: float | None
    number: int  # the Manager's step after the sync
    quorum_wait: float  # seconds in the sync's quorum (waiting for the others, healing)


def syncs(events: Iterable[Event]) -> list[Sync]:
    """The ``semi_sync.sync`` events among ``events``, in order."""
    return [
        Sync(
            step=e.step,  # type: ignore[arg-type]
            fragment=e["fragment"],
            committed=e["committed"],
            groups=e["groups"],
            pseudo_grad_norm=e["pseudo_grad_norm"],
            number=e.sync,  # type: ignore[arg-type]
            quorum_wait=e["quorum_wait_s"],
        )
        for e in events
        if e.name == SYNC.name
    ]


def global_digests(events: Iterable[Event]) -> dict[int, str]:
    """{sync number: digest} of the ``semi_sync.global_digest`` events among ``events``; a
    sync number given twice with different digests fails."""
    found: dict[int, str] = {}
    for e in events:
        if e.name != GLOBAL_DIGEST.name:
            continue
        number, digest = e.sync, e["digest"]
        assert number is not None
        assert found.setdefault(number, digest) == digest, f"sync {number} logged twice"
    return found


def losses(events: Iterable[Event]) -> dict[int, float]:
    """{step: loss} of the ``train.step`` events among ``events``."""
    return per_step((e for e in events if e.name == TRAIN_STEP.name), "loss")


def assert_same_global_params(job: FTJob, groups: int = 2) -> dict[int, str]:
    """Every sync number given by more than one group has one digest; returns them all."""
    merged: dict[int, str] = {}
    for r in range(groups):
        for number, digest in global_digests(job.events(r, GLOBAL_DIGEST, all_starts=True)).items():
            assert merged.setdefault(number, digest) == digest, (
                f"sync {number}: group {r} holds different global parameters than a peer "
                f"({digest} vs {merged[number]})"
            )
    return merged


def assert_clean_syncs_agree(job: FTJob, per_group: list[list[Sync]], expected: int) -> None:
    """Both groups of a clean run: the same averaged pseudo-gradient norm at every sync, and
    the same global digest for each of syncs 1..``expected``, each logged by both."""
    norms = [[s.pseudo_grad_norm for s in found] for found in per_group]
    assert norms[0] == norms[1]
    digests = assert_same_global_params(job)
    assert sorted(digests) == list(range(1, expected + 1))
    for r in range(2):
        assert sorted(global_digests(job.events(r, GLOBAL_DIGEST))) == sorted(digests)


def assert_loss_falls(events: Iterable[Event]) -> tuple[float, float]:
    values = [loss for _, loss in sorted(losses(events).items())]
    first, last = sum(values[:3]) / 3, sum(values[-3:]) / 3
    assert last < first - 0.2, f"loss did not fall: {first:.3f} -> {last:.3f}"
    return first, last


def args(module: str, method: str, *extra: str) -> list[str]:
    return [
        *FAST_ARGS,
        module,
        f"--fault_tolerance.sync_steps={SYNC_STEPS}",
        *METHODS[method],
        *extra,
    ]


# ---- clean runs ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["localsgd", "streaming"])
def test_clean_run_syncs_identical_global_params(
    ft_job: Callable[..., FTJob], tmp_path: Path, method: str
) -> None:
    """Two groups, 10 steps: every sync is made by both groups and committed, fragments take
    turns, both groups log the same global digest at every sync, the loss falls, and the
    TensorBoard scalars match the log lines. (Plain DiLoCo's clean run is the reference run of
    the whole-job restart test below.) 10 is not a multiple of sync_steps=4 (warned at
    start-up): LocalSGD runs a closing sync at step 10; Streaming DiLoCo ends with every
    fragment's global copy. Either way both groups end with the same model."""
    steps = 10
    job = ft_job(
        groups=2,
        train_args=args(
            SEMI_SYNC_MODULE, method, f"--training.steps={steps}", "--metrics.enable_tensorboard"
        ),
    ).start()
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    per_group = [syncs(job.events(r, SYNC)) for r in range(2)]
    fragments = 2 if method == "streaming" else 1
    expected = steps // (SYNC_STEPS // fragments) + (1 if method == "localsgd" else 0)
    for found in per_group:
        assert [s.number for s in found] == list(range(1, expected + 1)), found
        assert all(s.committed and s.groups == 2 for s in found), found
        assert [s.fragment for s in found] == [i % fragments for i in range(expected)]
        if method == "streaming":  # averaged pseudo-gradients: measured also with a delay
            assert all(s.pseudo_grad_norm is not None and s.pseudo_grad_norm > 0 for s in found)
        else:
            assert all(s.pseudo_grad_norm is None for s in found)
    assert_clean_syncs_agree(job, per_group, expected)
    first, last = assert_loss_falls(job.events(0, TRAIN_STEP))
    for r in range(2):
        # A start-up warning, before the event file: its wording is what the user reads.
        assert "is not a multiple of fault_tolerance.sync_steps=4" in job.latest(r).text()
        assert len(job.events(r, FINAL_MODEL)) == 1
    final_model = job.events(0, FINAL_MODEL)[0]
    if method == "localsgd":
        assert [s.step for s in per_group[0]] == [4, 8, 10]  # the closing sync
        assert final_model["closing_sync_steps"] == 2
    else:
        assert final_model["dropped_inner_steps"] is not None
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    print(
        f"{method}: {expected} syncs, identical digests; loss {first:.3f} -> {last:.3f}; "
        f"both groups end with the same model {final[0][0]}"
    )
    _check_tensorboard(tmp_path / "dump" / "tb" / "replica_0", per_group[0], method)


def _check_tensorboard(folder: Path, logged: list[Sync], method: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("sync/seconds", "sync/bytes_sent", "sync/groups", "sync/committed"):
        assert tag in tags, tags
        assert [e.step for e in events.Scalars(tag)] == [s.step for s in logged]
    assert [e.value for e in events.Scalars("sync/groups")] == [2.0] * len(logged)
    if method == "streaming":
        norms = [e.value for e in events.Scalars("sync/pseudo_grad_norm")]
        assert norms == pytest.approx([s.pseudo_grad_norm for s in logged], rel=1e-3)
    else:
        assert "sync/pseudo_grad_norm" not in tags


# ---- faults ----------------------------------------------------------------------------------


# Async DiLoCo heals here compressed (int4 + error feedback); uncompressed async DiLoCo heals
# under FSDP2 below.
@pytest.mark.parametrize("method", ["localsgd", "diloco", "streaming", "async_int4"])
def test_kill_mid_inner_steps_and_during_sync_then_heal(
    ft_job: Callable[..., FTJob], tmp_path: Path, method: str
) -> None:
    """Group 1 is killed twice, each time restarted without a checkpoint (healing only):
    first between two inner steps, then inside a sync whose all-reduce group 0 waits on. Group 0
    goes on alone each time; the restarted group heals from it; at the next common sync both
    hold the same global parameters; both finish.

    Steps take milliseconds and a restart takes seconds, so while group 1 restarts, group 0 is
    held between two steps (alive and heartbeating) by a pause file, and let go once the new
    group 1 trains: it must not run out of steps before its peer is back. Between seeing group
    0 sync alone and holding it, the test polls; a pause of 0.03 s after each step keeps group
    0 from running its last steps meanwhile (unpaced, on a loaded machine it once finished all
    100 steps in that time). Group 1 heals for the second time at about step 24: 96 steps
    leave group 0 more than 70 steps of slack."""
    pause = tmp_path / "pause_group0"
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE, method, "--training.steps=96", "--fault_injection.step_sleep_s=0.03"
        ),
    )
    job.start_lighthouse()
    job.start_group(0, [f"--fault_injection.pause_file={pause}"])
    job.start_group(1, ["--fault_injection.stall_after_step=6"])

    # 1) Between inner steps (step 6: mid-period for sync_steps 4; nothing in flight).
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=180)
    job.kill_group(1)
    alone_1 = _wait_alone(job, after=0)
    _restart_while_paused(job, pause, ["--fault_injection.stall_after_quorum=2"])
    healed_1 = _wait_heal(job)

    # 2) Inside a sync: the new group 1 healed in its 1st quorum; its 2nd is a joint sync in
    #    which it stalls before its all-reduce, and dies there.
    job.wait_for_event(
        1, STALLED_IN_SYNC, timeout=180, where=lambda e: e["quorum"] == 2 and e["groups"] == 2
    )
    before = len(syncs(job.events(0, SYNC)))
    job.kill_group(1)
    alone_2 = _wait_alone(job, after=before)
    failed = [s for s in syncs(job.events(0, SYNC))[before:] if not s.committed]
    assert failed and failed[0].groups == 2, "group 0's sync with the dying group must fail"
    _restart_while_paused(job, pause, [])
    healed_2 = _wait_heal(job)

    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    # Restarted without a checkpoint, it has nothing to replay onto: full heals, saying why.
    why = "cannot replay" if method == "localsgd" else "no checkpoint of its own to replay onto"
    for heal in job.events(1, HEALED):
        assert heal["transfer"] == "full" and why in heal["full_because"], heal.fields
    digests = assert_same_global_params(job)
    for start, healed in ((1, healed_1), (2, healed_2)):
        restarted = global_digests(job.events(1, GLOBAL_DIGEST, start=job.starts[1][start]))
        first = min(restarted)
        assert first == healed.number and restarted[first] == digests[first]
    survivor = syncs(job.events(0, SYNC))
    assert survivor[-1].committed and survivor[-1].groups == 2
    assert (
        global_digests(job.events(1, GLOBAL_DIGEST))[survivor[-1].number]
        == digests[survivor[-1].number]
    )
    first_loss, last_loss = assert_loss_falls(job.events(0, TRAIN_STEP))
    print(
        f"{method}: kill 1 (step 6) -> group 0 alone from sync #{alone_1.number}, group 1 "
        f"healed at sync #{healed_1.number}; kill 2 (in sync #{failed[0].number}, groups "
        f"{failed[0].groups}, NOT committed) -> group 0 alone from sync #{alone_2.number}, "
        f"group 1 healed at sync #{healed_2.number}; last sync #{survivor[-1].number} "
        f"groups {survivor[-1].groups}; {len(digests)} digests, identical where shared; "
        f"loss {first_loss:.3f} -> {last_loss:.3f}"
    )


def _wait_alone(job: FTJob, after: int) -> Sync:
    """Group 0's first sync committed alone among its syncs from index ``after`` on."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        alone = [s for s in syncs(job.events(0, SYNC))[after:] if s.committed and s.groups == 1]
        if alone:
            return alone[0]
        assert job.latest(0).alive(), tail(job.latest(0).text())
        time.sleep(0.2)
    raise AssertionError(f"group 0 did not go on alone:\n{tail(job.latest(0).text())}")


def _restart_while_paused(
    job: FTJob, pause: Path, extra: list[str], env: dict[str, str] | None = None
) -> None:
    """Hold group 0 between two steps, restart group 1 (``env``: variables for this start),
    and let group 0 go once group 1 waits for its first quorum at the lighthouse: group 0's
    next sync is then the joint one in which group 1 heals, whatever the speed of either."""
    paused = len(job.events(0, PAUSED))
    pause.touch()
    job.wait_for_event(0, PAUSED, timeout=60, count=paused + 1)
    job.start_group(1, extra, env)
    job.wait_quorum_request(1)
    pause.unlink()


def kill_and_heal_group_1(job: FTJob, pause: Path, ranks: int = 1, timeout: float = 300) -> None:
    """Start both groups, kill group 1 (every one of its ``ranks``) after step 6, let group 0
    go on alone, restart group 1 while group 0 is paused so that it heals at group 0's next
    sync, and wait until both have exited cleanly."""
    job.start_lighthouse()
    job.start_group(0, [f"--fault_injection.pause_file={pause}"])
    job.start_group(1, ["--fault_injection.stall_after_step=6"])
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=timeout, count=ranks)
    job.kill_group(1)
    _wait_alone(job, after=0)
    _restart_while_paused(job, pause, [])
    job.wait_for_event(1, HEALED, timeout=timeout, count=ranks)
    for r in range(2):
        assert job.wait_exit(r, timeout=timeout) == 0, tail(job.latest(r).text())


def _wait_heal(job: FTJob) -> Sync:
    """Wait until the latest start of group 1 healed and then committed a sync; return it."""
    job.wait_for_event(1, HEALED, timeout=180)
    job.wait_for_event(1, GLOBAL_DIGEST, timeout=120)
    committed = [s for s in syncs(job.events(1, SYNC)) if s.committed]
    assert committed[0].groups == 2, committed[0]
    return committed[0]


# ---- whole-job restart -----------------------------------------------------------------------


def test_diloco_whole_job_restart_reproduces_global_params(tmp_path: Path) -> None:
    """Both groups crash after step 7 (checkpoint at step 6, two inner steps into a sync
    period) and restart from their checkpoints: the global parameters at the next syncs equal
    those of the same job run without interruption, bit for bit. The checkpoint carries the
    model, inner optimizer, LR schedule, data position and step (core), the Manager's step
    (``ft_manager``) and ``semi_sync``: DiLoCo's global parameters, outer momentum and the
    inner-step position. Async DiLoCo's checkpoint also holds the start of the local period,
    the summed result of the sync in flight and, with compression and error feedback, what
    each rank's compression still owes: the FSDP2 test below restarts such a job."""
    train_args = args(
        FAULTS_MODULE,
        "diloco",
        "--training.steps=12",
        "--checkpoint.enable",
        "--checkpoint.interval=6",
    )
    with FTJob(_folder(tmp_path / "uninterrupted"), groups=2, train_args=train_args) as reference:
        reference.start()
        for r in range(2):
            assert reference.wait_exit(r, timeout=240) == 0, tail(reference.latest(r).text())
        expected = assert_same_global_params(reference)
        assert sorted(expected) == [1, 2, 3]
        for r in range(2):
            assert all(s.groups == 2 for s in syncs(reference.events(r, SYNC)))

    with FTJob(_folder(tmp_path / "crashed"), groups=2, train_args=train_args) as job:
        _crash_after_step_7_and_restart(job)
        resumed = {r: job.events(r) for r in range(2)}
        for r in range(2):
            assert [e.step for e in resumed[r] if e.name == CHECKPOINT_RESUMED.name] == [6]
            found = syncs(resumed[r])
            got = global_digests(resumed[r])
            # Two inner steps were left in the period: the first sync is at step 8.
            assert [(s.step, s.number, s.groups) for s in found] == [(8, 2, 2), (12, 3, 2)]
            assert got == {2: expected[2], 3: expected[3]}, (r, got, expected)
        first_start = job.events(0, GLOBAL_DIGEST, start=job.starts[0][0])
        assert global_digests(first_start)[1] == expected[1]
        # Compared as the step line prints them (4 decimals), as this test always has.
        resumed_losses = losses(resumed[0])
        reference_losses = losses(reference.events(0, TRAIN_STEP))
        assert {s: round(resumed_losses[s], 4) for s in range(7, 13)} == {
            s: round(reference_losses[s], 4) for s in range(7, 13)
        }
    print(f"diloco resume from step 6: syncs identical to the uninterrupted run {expected}")


def test_fsdp2_whole_job_restart_gives_every_rank_its_own_residuals(tmp_path: Path) -> None:
    """2 groups x 2 FSDP2 ranks, async DiLoCo with int4 and error feedback: both groups crash
    after step 7 (checkpoint at step 6, sync 1 in flight: started at step 4, applied at step
    8) and restart. Each rank owes the compression error of its
    own shard and saves it under a key of its own (``rank_0``, ``rank_1``); every rank's global
    shard at every sync after the restart equals the uninterrupted run's, bit for bit (a rank
    handed its peer's residuals, or none, would send different bytes)."""
    train_args = args(
        FAULTS_MODULE,
        "async_int4",
        "--training.steps=12",
        "--checkpoint.enable",
        "--checkpoint.interval=6",
    )

    def shard_digests(job: FTJob) -> dict[int, dict[int, str]]:
        """{rank: {sync number: digest}} of the groups' latest starts, which agree rank by
        rank."""
        found: dict[int, dict[int, str]] = {}
        for r in range(2):
            for rank, events in per_rank(job.events(r, GLOBAL_DIGEST)).items():
                digests = global_digests(events)
                assert found.setdefault(rank, digests) == digests, (r, rank)
        assert sorted(found) == [0, 1]
        return found

    with FTJob(
        _folder(tmp_path / "uninterrupted"), groups=2, ngpu=2, train_args=train_args
    ) as reference:
        reference.start()
        for r in range(2):
            assert reference.wait_exit(r, timeout=300) == 0, tail(reference.latest(r).text())
        expected = shard_digests(reference)
        assert all(sorted(expected[rank]) == [1, 2, 3] for rank in (0, 1)), expected
        assert expected[0] != expected[1]  # really sharded

    with FTJob(_folder(tmp_path / "crashed"), groups=2, ngpu=2, train_args=train_args) as job:
        _crash_after_step_7_and_restart(job, ranks=2)
        for r in range(2):
            resumed = job.events(r, CHECKPOINT_RESUMED)
            assert sorted((e.rank, e.step) for e in resumed) == [(0, 6), (1, 6)]
            # Sync 1 (in flight in the checkpoint) is applied at step 8, sync 3 at the end.
            found = syncs(job.events(r, SYNC, rank=0))
            assert [(s.step, s.number, s.groups) for s in found] == [
                (8, 1, 2),
                (12, 2, 2),
                (12, 3, 2),
            ], found
        assert shard_digests(job) == expected
    print(f"fsdp2 2x2 async int4+EF resumed from step 6: every rank's shard as before {expected}")


def _crash_after_step_7_and_restart(job: FTJob, ranks: int = 1) -> None:
    """Start both groups, hold every rank after step 7, kill both groups, and start them again
    once the lighthouse has seen them dead; returns when both have exited cleanly."""
    job.start_lighthouse()
    for r in range(2):
        job.start_group(r, ["--fault_injection.stall_after_step=7"])
    for r in range(2):
        job.wait_for_event(
            r, STALLED_AFTER_STEP, timeout=300, count=ranks, where=lambda e: e.step == 7
        )
    for r in range(2):
        job.kill_group(r)
    # Let the lighthouse see both dead (heartbeat timeout), as after a real crash: the
    # restarted groups then wait for each other before their first sync.
    time.sleep(job.lighthouse_settings.heartbeat_timeout_ms / 1000 + 0.5)
    for r in range(2):
        job.start_group(r)
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# ---- FSDP2 inside the groups -----------------------------------------------------------------


def test_async_diloco_with_fsdp2_inside_each_group(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """2 groups x 2 ranks (FSDP2, DTensor parameters; 4 processes): async DiLoCo syncs each
    rank's shard with the same rank of the other group; its global copies are plain tensors of
    the rank's shard, on the CPU. Group 1 is killed between inner steps and restarted: every
    rank heals its shard from its peer rank, and afterwards rank r of both groups holds the same
    global shard. (Blocking DiLoCo, torchft's, does the same in
    test_real_sizes.py, there Streaming with int8 on tensors larger than a bucket.)"""
    method = "async_eager"
    job = ft_job(groups=2, ngpu=2, train_args=args(FAULTS_MODULE, method, "--training.steps=40"))
    kill_and_heal_group_1(job, tmp_path / "pause_group0", ranks=2)

    shards = {r: per_rank(job.events(r, all_starts=True)) for r in range(2)}
    common = {}
    for rank in (0, 1):
        digests = [global_digests(shards[r][rank]) for r in range(2)]
        common[rank] = sorted(set(digests[0]) & set(digests[1]))
        assert common[rank], f"rank {rank}: no sync logged by both groups"
        for number in common[rank]:
            assert digests[0][number] == digests[1][number], (rank, number)
        last = syncs(shards[0][rank])[-1]
        assert last.committed and last.groups == 2
    # The shards differ between ranks (the parameters really are sharded).
    rank0, rank1 = (global_digests(shards[0][rank]) for rank in (0, 1))
    assert all(rank0[n] != rank1[n] for n in common[0])
    healed = syncs(job.events(1, SYNC, rank=0))[0]
    print(
        f"fsdp2 2x2 {method}: group 1 healed at sync #{healed.number}; per-rank shards identical "
        f"at syncs {common[0][0]}..{common[0][-1]} (common: {len(common[0])})"
    )
