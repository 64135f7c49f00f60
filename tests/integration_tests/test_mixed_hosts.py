"""Replica groups on hosts whose CPUs compute differently train one model.

A group's host is emulated by the ATen CPU kernels its processes use (``ATEN_CPU_CAPABILITY``,
``tests/kernel_sets.py``): ``default`` (the portable kernels, as on a CPU family whose vector
code differs) against the host's best (AVX-512 or AVX2). The two draw other initial models from
the same seed and take other inner steps; the global parameters, which every group computes
from the same averages, must still be bit for bit the same in every group after every sync.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration_tests.harness import SEMI_SYNC_MODULE, FTJob, per_rank
from tests.integration_tests.test_heal_replay import _paced, _restart_behind
from tests.integration_tests.test_semi_sync import (
    SYNC_STEPS,
    args,
    assert_same_global_params,
    global_digests,
    syncs,
)
from tests.kernel_sets import best, with_kernels
from torchtitan.components.checkpoint import CHECKPOINT_RESUMED
from torchtitan.experiments.fault_tolerance.events import (
    FINAL_DIGEST,
    GLOBAL_DIGEST,
    HEALED,
    INITIAL_MODELS_DIFFER,
    SYNC,
)

#: Group 0 on the portable kernels, group 1 on the host's best.
KERNELS = {0: "default", 1: best()}

needs_two_kernel_sets = pytest.mark.skipif(
    best() == "default", reason="this host runs ATen's portable kernels only"
)


def _on_their_kernels() -> dict[int, dict[str, str]]:
    return {r: with_kernels(k, {}) for r, k in KERNELS.items()}


def _final_digests(job: FTJob) -> list[list[str]]:
    return [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]


@needs_two_kernel_sets
@pytest.mark.parametrize(
    ("method", "ngpu"),
    [
        ("diloco", 1),
        ("streaming", 1),
        ("async_int4", 1),
        ("diloco_sparse", 1),
        ("localsgd", 1),
        ("diloco", 2),
    ],
)
def test_groups_on_different_cpu_kernels_start_from_one_model_and_agree_at_every_sync(
    ft_job: Callable[..., FTJob], method: str, ngpu: int
) -> None:
    """DiLoCo; Streaming DiLoCo (2 fragments, delay 1, alpha 0.5); async DiLoCo in int4 with
    error feedback; sparse pseudo-gradients; LocalSGD; DiLoCo with 2 FSDP2 ranks per group.
    The groups' initial models differ (their kernels draw other normal values from the seed):
    group 1 takes group 0's in the start-up quorum (every rank its own shard), instead of both
    stopping at sync #0. Then every sync is committed by both with one global digest per rank,
    and both end with the same model."""
    steps = 6 * SYNC_STEPS
    job = ft_job(
        groups=2,
        ngpu=ngpu,
        train_args=args(SEMI_SYNC_MODULE, method, f"--training.steps={steps}"),
        group_env=_on_their_kernels(),
    )
    job.run_to_end(timeout=300)

    for rank in range(ngpu):
        said = [job.events(r, INITIAL_MODELS_DIFFER, rank=rank) for r in range(2)]
        assert said[0] and said[1], "the two kernel sets drew the same initial model"
        assert [e["takes_it"] for e in said[0]] == [False]
        assert [e["takes_it"] for e in said[1]] == [True]
        assert KERNELS[1].upper() in said[0][0]["groups"][1]
        assert "DEFAULT" in said[0][0]["groups"][0] and said[0][0]["same_host"] == []
        (healed,) = job.events(1, HEALED, rank=rank)
        assert (healed["case"], healed["peer"], healed["transfer"]) == ("initial_model", 0, "full")
        assert "replica group 0's" in healed["full_because"]
    assert not job.events(0, HEALED)

    fragments = 2 if method == "streaming" else 1
    expected = steps // SYNC_STEPS * fragments
    for r in range(2):
        for rank, found in per_rank(job.events(r, SYNC)).items():
            assert all(s.committed and s.groups == 2 for s in syncs(found)), (rank, found)
        for rank in range(ngpu):
            assert len(global_digests(job.events(r, GLOBAL_DIGEST, rank=rank))) == expected
    for rank in range(ngpu):  # each rank's shard, compared with the same rank of the other
        merged: dict[int, str] = {}
        for r in range(2):
            for number, digest in global_digests(job.events(r, GLOBAL_DIGEST, rank=rank)).items():
                assert merged.setdefault(number, digest) == digest, (rank, number)
        assert sorted(merged) == list(range(1, expected + 1))
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST, rank=0)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    print(
        f"{method}, {ngpu} rank(s) per group: groups on {KERNELS[0]} and {KERNELS[1]} kernels: "
        f"{len(merged)} syncs with one digest each, final model {final[0][0]}"
    )


@needs_two_kernel_sets
def test_the_initial_model_comes_from_the_kernels_most_groups_run(
    ft_job: Callable[..., FTJob],
) -> None:
    """Three groups: group 0 on the host's best kernels, groups 1 and 2 on the portable ones.
    Groups 1 and 2 draw the same initial model; the source is group 1 (the commonest kind of
    host), so group 0 alone takes it, in one full heal, and every sync agrees."""
    steps = 4 * SYNC_STEPS
    job = ft_job(
        groups=3,
        train_args=args(SEMI_SYNC_MODULE, "diloco", f"--training.steps={steps}"),
        group_env={r: with_kernels(KERNELS[1] if r == 0 else KERNELS[0], {}) for r in range(3)},
    )
    job.run_to_end(timeout=300)
    said = [job.events(r, INITIAL_MODELS_DIFFER) for r in range(3)]
    assert all(e["source"] == 1 for found in said for e in found) and all(said)
    assert [[e["takes_it"] for e in found] for found in said] == [[True], [False], [False]]
    (healed,) = job.events(0, HEALED)
    assert healed["case"] == "initial_model" and healed["peer"] in (1, 2)
    assert not job.events(1, HEALED) and not job.events(2, HEALED)
    digests = assert_same_global_params(job, groups=3)
    assert sorted(digests) == list(range(1, steps // SYNC_STEPS + 1))
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(3)]
    assert final[0] == final[1] == final[2] and len(final[0]) == 1, final


@needs_two_kernel_sets
@pytest.mark.parametrize("method", ["diloco", "async_int4"])
def test_a_group_restarted_on_other_cpu_kernels_replays_what_it_missed_and_agrees(
    ft_job: Callable[..., FTJob], tmp_path: Path, method: str
) -> None:
    """Both groups on the host's best kernels; group 1 checkpoints at step 8, is killed, and
    comes back on the portable kernels while group 0 went on alone for two syncs: it replays
    them onto its checkpoint (its outer steps, now on other kernels, give the bits group 0's
    gave), takes part in the next sync, and the groups agree at that sync and every later one."""
    pause = tmp_path / "pause_group0"
    job = ft_job(
        groups=2,
        train_args=_paced(method, "--fault_tolerance.heal_history_syncs=8"),
        group_env={r: with_kernels(KERNELS[1], {}) for r in range(2)},
    )
    checkpoint_sync = {"diloco": 2, "async_int4": 1}[method]
    _restart_behind(
        job, pause, alone_until=checkpoint_sync + 2, restart_env=with_kernels(KERNELS[0], {})
    )
    assert [e.step for e in job.events(1, CHECKPOINT_RESUMED)] == [8]
    (healed,) = job.events(1, HEALED)
    assert (healed["case"], healed["transfer"]) == ("replay", "replay"), healed.fields
    assert healed["replayed_syncs"] >= 2
    after = [s for s in syncs(job.events(1, SYNC)) if s.number >= healed.sync]
    assert len(after) >= 2 and all(s.committed and s.groups == 2 for s in after), after
    digests = assert_same_global_params(job)
    restarted = global_digests(job.events(1, GLOBAL_DIGEST))
    assert min(restarted) == healed.sync and set(restarted) <= set(digests)
    final = _final_digests(job)
    assert len(final[0]) == 1 and final[0] == final[1], final
    print(
        f"{method}: group 1 restarted on {KERNELS[0]} kernels replayed "
        f"{healed['replayed_syncs']} syncs at sync #{healed.sync}; {len(restarted)} later "
        "syncs agree"
    )
