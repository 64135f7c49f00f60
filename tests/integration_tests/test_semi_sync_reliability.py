"""Semi-sync at the period lengths people run, with real lighthouses and replica groups.

Periods here are stretched on purpose (``--fault_injection.step_sleep_s``) or held at a sync
point (``--fault_injection.hold_before_sync_file``), so that what depends on a period's length
is tested at a length where waiting for a period would show (longer than the sync quorum
timeout). Nothing asserts that this machine is fast: bounds are the timeouts the run itself was
given, and the figures are printed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration_tests.faults import CORRUPTED, HELD_BEFORE_SYNC, STALLED_AFTER_STEP
from tests.integration_tests.harness import (
    FAST_ARGS,
    FAULTS_MODULE,
    PACED_ARGS,
    FTJob,
    per_step,
    tail,
)
from tests.integration_tests.test_semi_sync import (
    args,
    assert_same_global_params,
    global_digests,
    losses,
    syncs,
)
from tests.integration_tests.train_runs import error_lines
from torchtitan.components.checkpoint import CHECKPOINT_REJECTED, CHECKPOINT_RESUMED
from torchtitan.components.ft.manager import QUORUM_FORMED, QUORUM_WAITING
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import (
    ASKING_FOR_QUORUM,
    DIFFERS_FROM_MAJORITY,
    FINAL_DIGEST,
    GLOBAL_DIGEST,
    GLOBAL_FROM_LOADED_MODEL,
    HEALED,
    MINORITY_ELSEWHERE,
    OWN_CHECKPOINT_REJECTED,
    SYNC,
)
from torchtitan.tools.events import read_events
from torchtitan.trainer import PARAM_DIGEST


def _wait_both_committed(job: FTJob, number: int, timeout: float = 240) -> None:
    for r in range(2):
        job.wait_for_event(r, GLOBAL_DIGEST, timeout=timeout, where=lambda e: e.sync == number)


def test_rejoin_with_a_period_longer_than_the_sync_timeout(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """Periods of ~4 s, sync quorum timeout 3 s. Group 0 is held at a sync point (alive,
    not asking) while group 1 is killed and restarted without a checkpoint. The restarted
    group asks for its first quorum as soon as it is built; group 0, let go, finds it waiting:
    it heals at group 0's sync and takes part in it. Group 0's wait in that quorum is bounded
    by the transfer, not by the period (waiting for a period of the joiner's would exceed the
    timeout and kill group 0). Both finish; every common sync has one digest."""
    hold = tmp_path / "hold_group0"
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            "--training.steps=18",
            "--fault_tolerance.sync_steps=6",
            "--fault_injection.step_sleep_s=0.6",
            "--fault_tolerance.sync_quorum_timeout_s=3",
        ),
    )
    job.start_lighthouse()
    job.start_group(0, [f"--fault_injection.hold_before_sync_file={hold}"])
    job.start_group(1)
    _wait_both_committed(job, 1)
    hold.touch()
    held = job.wait_for_event(0, HELD_BEFORE_SYNC, timeout=120)
    rejoin_sync = held[0].sync
    job.kill_group(1)
    killed_at = time.monotonic()
    job.wait_until_dead_to_lighthouse(alive=1)
    job.start_group(1)
    job.wait_for_event(1, ASKING_FOR_QUORUM, timeout=180)
    asked_after = time.monotonic() - killed_at
    job.wait_quorum_request(1)  # its request has reached the lighthouse (group 0 is held)
    hold.unlink()
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())

    healed = job.events(1, HEALED)
    assert healed and healed[0].sync == rejoin_sync, tail(job.latest(1).text())
    at_rejoin = [s for s in syncs(job.events(0, SYNC)) if s.number == rejoin_sync]
    assert at_rejoin and at_rejoin[0].committed and at_rejoin[0].groups == 2, at_rejoin
    wait = at_rejoin[0].quorum_wait
    assert wait < 3, f"group 0 waited {wait}s in the rejoin quorum (timeout 3 s)"
    digests = assert_same_global_params(job)
    joiner = global_digests(job.events(1, GLOBAL_DIGEST))
    assert min(joiner) == rejoin_sync and joiner[rejoin_sync] == digests[rejoin_sync]
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert final[0] and final[0] == final[1]
    periods = syncs(job.events(0, SYNC))
    print(
        f"rejoin at sync #{rejoin_sync}: joiner asked {asked_after:.1f}s after the kill; "
        f"group 0's quorum wait at the rejoin sync {wait:.2f}s (sync quorum timeout 3 s, "
        f"period ~{6 * 0.6:.1f}s+); {len(periods)} syncs, {len(digests)} digests identical"
    )


def _lighthouse_restart_args(method: str) -> list[str]:
    if method == "sync":
        return [*FAST_ARGS, *PACED_ARGS, "--training.steps=30"]
    return args(
        FAULTS_MODULE, "diloco", "--training.steps=40", "--fault_injection.step_sleep_s=0.15"
    )


def test_lighthouse_restart_is_survived(ft_job: Callable[..., FTJob]) -> None:
    """DiLoCo: the lighthouse is killed mid-run and started again on the same address 3 s
    later. Both groups carry on (the quorum request in flight is sent again to the new
    lighthouse), sync together again with identical global parameters, and finish."""
    job = ft_job(groups=2, train_args=_lighthouse_restart_args("diloco")).start()
    _wait_both_committed(job, 3)
    port = job.kill_lighthouse()
    down = time.monotonic()
    before = max(s.number for s in syncs(job.events(0, SYNC)))
    time.sleep(3)
    job.start_lighthouse(port)
    up = time.monotonic() - down
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    digests = assert_same_global_params(job)
    after = [s for s in syncs(job.events(0, SYNC)) if s.number > before]
    together = [s for s in after if s.committed and s.groups == 2]
    assert together, after
    for r in range(2):
        assert "Traceback" not in job.latest(r).text()
    gap = min((s.quorum_wait for s in after), default=0.0)
    print(
        f"lighthouse down {up:.1f}s after sync #{before}: {len(together)} later syncs committed "
        f"by both groups; {len(digests)} digests identical; first wait after: "
        f"{after[0].quorum_wait:.1f}s (min {gap:.2f}s)"
    )


def test_lighthouse_restart_is_survived_by_synchronous_ft(ft_job: Callable[..., FTJob]) -> None:
    """The same for synchronous FT: every step's quorum waits for the lighthouse to return."""
    job = ft_job(groups=2, train_args=_lighthouse_restart_args("sync")).start()
    for r in range(2):
        job.wait_for_event(r, PARAM_DIGEST, timeout=240, where=lambda e: e.step == 6)
    port = job.kill_lighthouse()
    time.sleep(4)
    job.start_lighthouse(port)
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    steps = [losses(job.events(r, TRAIN_STEP)) for r in range(2)]
    assert max(steps[0]) == max(steps[1]) == 30
    digests = [per_step(job.events(r, PARAM_DIGEST), "digest") for r in range(2)]
    assert digests[0][30] == digests[1][30]


def test_a_lighthouse_that_never_returns_gives_one_error_line(
    ft_job: Callable[..., FTJob],
) -> None:
    """The lighthouse dies for good: each group stops within its sync quorum timeout (plus a
    period) with exit status 1 and one error line that names the lighthouse's address."""
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            "--training.steps=400",
            "--fault_injection.step_sleep_s=0.1",
            "--fault_tolerance.sync_quorum_timeout_s=5",
        ),
    ).start()
    _wait_both_committed(job, 2)
    job.kill_lighthouse()
    start = time.monotonic()
    for r in range(2):
        assert job.wait_exit(r, timeout=120) == 1
    took = time.monotonic() - start
    for r in range(2):
        text = job.latest(r).text()
        errors = error_lines(text)
        assert len(errors) == 1, errors
        assert job.lighthouse_address in errors[0] and "unreachable" in errors[0], errors[0]
        assert "fault_tolerance.sync_quorum_timeout_s=5" in errors[0]
        assert "Traceback" not in text
    print(f"lighthouse gone: both groups stopped {took:.1f}s later: {errors[0]}")


def test_agreement_check_catches_a_corrupted_group(ft_job: Callable[..., FTJob]) -> None:
    """Group 1's DiLoCo global copy is changed by one number after sync #2. The digests the
    groups exchange at the next quorum differ; with two groups there is no majority, so both
    stop before sync #3 is made, naming both digests."""
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            "--training.steps=40",
            "--fault_tolerance.agreement_check_every=1",
        ),
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(1, ["--fault_injection.corrupt_global_after_sync=2"])
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 1, tail(job.latest(r).text())
    assert job.events(1, CORRUPTED)
    for r in range(2):
        errors = error_lines(job.latest(r).text())
        assert len(errors) == 1 and "disagree on the global parameters before sync #3" in errors[0]
        assert len(re.findall(r"\b[0-9a-f]{16}\b", errors[0].split("digests", 1)[1])) == 2
        digests = global_digests(job.events(r, GLOBAL_DIGEST))
        assert sorted(digests) == [1, 2]  # sync #3 was never made
    print(f"caught at the next quorum: {errors[0]}")


def test_with_three_groups_the_minority_heals_from_the_majority(
    ft_job: Callable[..., FTJob],
) -> None:
    """Three groups, agreement_check_every=2: group 2's DiLoCo global copy is changed by one
    number after sync #3. No check is due before sync #4 (3 syncs made), so sync #4 is made
    with the copies apart (group 2's pseudo-gradient, taken from its changed copy, enters that
    average); the check before sync #5 finds group 2 alone with its digest. Group 2 says it
    differs from the majority, groups 0 and 1 say a group elsewhere does; nobody commits that
    attempt, group 2 heals from a majority group at the next one, and from then on all three
    hold the majority's global parameters: the majority's digests never differ from each
    other, group 2's equal theirs again, and the job finishes with one model. Paced steps and a
    5 s heartbeat timeout keep the quorum unchanged on a loaded machine (a quorum change would
    run the check off its cadence)."""
    steps = 40  # 10 syncs of 4 steps
    job = ft_job(
        groups=3,
        heartbeat_timeout_ms=5000,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            f"--training.steps={steps}",
            "--fault_tolerance.agreement_check_every=2",
            "--fault_injection.step_sleep_s=0.05",
        ),
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(1)
    job.start_group(2, ["--fault_injection.corrupt_global_after_sync=3"])
    for r in range(3):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    assert [e.sync for e in job.events(2, CORRUPTED)] == [3]
    differs = job.events(2, DIFFERS_FROM_MAJORITY)
    assert [e.sync for e in differs] == [5], differs  # not before #4: the check was not due
    assert len(differs[0]["digests"]) == 2, differs
    for r in (0, 1):
        elsewhere = job.events(r, MINORITY_ELSEWHERE)
        assert [e.sync for e in elsewhere] == [5], elsewhere
        assert elsewhere[0]["digests"] == differs[0]["digests"]
        assert not job.events(r, DIFFERS_FROM_MAJORITY) and not job.events(r, HEALED)
        dropped = [s.number for s in syncs(job.events(r, SYNC)) if not s.committed]
        assert dropped == [5], dropped
    assert any(not s.committed for s in syncs(job.events(2, SYNC)))  # nor did group 2
    healed = job.events(2, HEALED)
    assert len(healed) == 1 and healed[0]["peer"] in (0, 1), healed
    digests = [global_digests(job.events(r, GLOBAL_DIGEST)) for r in range(3)]
    majority = assert_same_global_params(job, groups=2)  # groups 0 and 1 never differ
    # 10 sync points, one of them the dropped attempt at #5: 9 syncs made.
    assert sorted(majority) == list(range(1, steps // 4)), sorted(majority)
    # Group 2 held the majority's copy up to #3 and from its heal on, and another at #4.
    assert all(digests[2][n] == majority[n] for n in (1, 2, 3)), digests
    assert digests[2][4] != majority[4], digests
    after = [n for n in digests[2] if n > 4]
    assert after and all(digests[2][n] == majority[n] for n in after), (after, digests)
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(3)]
    assert final[0] == final[1] == final[2] and len(final[0]) == 1, final
    print(
        f"3 groups: group 2 corrupted after sync #3, found alone before sync #5 "
        f"(digests {differs[0]['digests']}), healed from group {healed[0]['peer']} at sync "
        f"#{healed[0].sync}; all end with {final[0][0]}"
    )


def test_min_replica_size_holds_in_semi_sync(ft_job: Callable[..., FTJob], tmp_path: Path) -> None:
    """min_replica_size=2: with group 1 dead, group 0 waits at its next sync (and says so)
    instead of syncing alone; it goes on once group 1 is back."""
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            "--training.steps=40",
            "--fault_tolerance.min_replica_size=2",
            "--fault_injection.step_sleep_s=0.05",
        ),
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(1, ["--fault_injection.stall_after_step=10"])
    job.wait_for_event(1, STALLED_AFTER_STEP, timeout=180, where=lambda e: e.step == 10)
    job.kill_group(1)
    job.wait_for_event(
        0,
        QUORUM_WAITING,
        timeout=120,
        where=lambda e: e["reason"] == "min_replica_size" and e["groups_needed"] == 2,
    )
    job.start_group(1)
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    survivor = syncs(job.events(0, SYNC))
    assert all(s.groups == 2 for s in survivor if s.committed), survivor
    assert_same_global_params(job)
    waited = [f"{e['waited_s']:.1f}" for e in job.events(0, QUORUM_FORMED) if e["groups"] == 2]
    print(f"min_replica_size=2: group 0 never synced alone; waited {waited}s for group 1")


def test_consecutive_failed_syncs_stop_the_run(ft_job: Callable[..., FTJob]) -> None:
    """A group whose every sync fails stops after max_consecutive_failures of them, naming the
    cause; its peer goes on and finishes."""
    job = ft_job(
        groups=2,
        train_args=args(FAULTS_MODULE, "diloco", "--training.steps=40"),
    )
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(
        1, ["--fault_injection.fail_syncs_from=2", "--fault_tolerance.max_consecutive_failures=3"]
    )
    assert job.wait_exit(1, timeout=240) == 1, tail(job.latest(1).text())
    errors = error_lines(job.latest(1).text())
    assert len(errors) == 1, errors
    assert "3 syncs in a row were not committed" in errors[0]
    assert "max_consecutive_failures=3" in errors[0] and "injected sync failure" in errors[0]
    assert job.wait_exit(0, timeout=240) == 0, tail(job.latest(0).text())
    print(errors[0])


def test_diloco_starts_from_a_plain_checkpoint(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """A plain run (no fault tolerance) trains 30 steps and saves a checkpoint; DiLoCo starts
    from its model and optimizer (checkpoint.initial_load_path). The global copies are the
    loaded weights,
    so the first sync's pseudo-gradient is of the size of the later ones (not random init minus
    pretrained) and the loss does not jump after it."""
    import subprocess
    import sys

    from tests.integration_tests.harness import REPO

    plain = tmp_path / "plain"
    plain_args = [a for a in FAST_ARGS if "fault_tolerance" not in a]
    run = subprocess.run(
        [str(REPO / "run_train.sh"), f"--job.dump_folder={plain}", *plain_args,
         "--training.steps=30", "--checkpoint.enable", "--checkpoint.interval=30"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**__import__("os").environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    plain_losses = losses(read_events(plain / "events", TRAIN_STEP))
    job = ft_job(
        groups=2,
        train_args=args(
            FAULTS_MODULE,
            "diloco",
            "--training.steps=24",
            "--checkpoint.enable",
            f"--checkpoint.initial_load_path={plain / 'checkpoint' / 'step-30'}",
            # Model and inner optimizer (warm Adam moments): the period after the load is then
            # like any other, and the first pseudo-gradient shows only what the global copies
            # started from. The plain run's schedule, data position and step are its own.
            "--checkpoint.initial_load_model_only=false",
            "--checkpoint.exclude_from_loading",
            "lr_scheduler,dataloader,train_state,ft_manager,semi_sync",
        ),
    ).start()
    for r in range(2):
        assert job.wait_exit(r, timeout=300) == 0, tail(job.latest(r).text())
    assert job.events(0, GLOBAL_FROM_LOADED_MODEL)
    norms = [s.pseudo_grad_norm for s in syncs(job.events(0, SYNC))]
    assert len(norms) == 6 and all(n is not None for n in norms), norms
    later = sorted(norms[1:6])  # type: ignore[type-var]
    median = later[2]
    assert norms[0] <= 3 * median, (norms[0], median)  # type: ignore[operator]
    diloco = losses(job.events(0, TRAIN_STEP))
    last_plain = [plain_losses[s] for s in range(21, 31)]
    noise = max(abs(a - b) for a, b in zip(last_plain, last_plain[1:], strict=False))
    before, after = diloco[4], diloco[5]  # the first sync is at the end of step 4
    assert after <= before + noise, (before, after, noise)
    assert diloco[1] <= max(last_plain) + noise  # started from the trained model
    assert_same_global_params(job)
    print(
        f"first pseudo-gradient norm {norms[0]:.4f}, median of the next five {median:.4f}; "
        f"loss {diloco[1]:.3f} at step 1 (plain run ended at {plain_losses[30]:.3f}), "
        f"{before:.3f} -> {after:.3f} across the first sync (noise {noise:.3f})"
    )


def test_a_group_whose_checkpoints_all_fail_their_checksums_heals_in_full(
    ft_job: Callable[..., FTJob], tmp_path: Path
) -> None:
    """DiLoCo, checkpoints at steps 4 and 8; then 4 KB of zeros in the middle of every one of
    group 0's data files. On a whole-job restart group 0 loads neither (each rejected, naming
    the folder, the file and the rank), says that it starts without a checkpoint and heals in
    full from group 1, which resumed from its own step 8; both then train on in step and end
    with the same model."""
    common = ["--checkpoint.enable", "--checkpoint.interval=4", "--checkpoint.keep_latest_k=0"]
    first_args = args(FAULTS_MODULE, "diloco", "--training.steps=8", *common)
    first = ft_job(groups=2, train_args=first_args).run_to_end()
    mine = first.dump_folder / "checkpoint" / "replica_0"
    damaged = sorted(mine.glob("step-*/__0_0.distcp"))
    assert len(damaged) == 2
    for shard in damaged:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
        shard.write_bytes(bytes(data))

    job = ft_job(
        tmp_path / "restart",
        groups=2,
        dump_folder=first.dump_folder,
        train_args=args(FAULTS_MODULE, "diloco", "--training.steps=16", *common),
    )
    job.start()
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    rejected = [e["problem"] for e in job.events(0, CHECKPOINT_REJECTED)]
    assert len(rejected) == 2 and all("__0_0.distcp (written by rank 0)" in p for p in rejected)
    assert len(job.events(0, OWN_CHECKPOINT_REJECTED)) == 1
    assert [e.step for e in job.events(1, CHECKPOINT_RESUMED)] == [8]
    healed = job.events(0, HEALED)
    assert [(e["case"], e["peer"]) for e in healed] == [("newer_checkpoint", 1)], healed
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
