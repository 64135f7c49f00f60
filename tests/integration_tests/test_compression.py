"""Compressed pseudo-gradients (``fault_tolerance.pseudo_grad_dtype``) with real replica groups:
a real ``torchft_lighthouse`` and two groups on 127.0.0.1. Every group decodes the same bytes,
so after every committed sync both hold the same global parameters; what a sync sends shrinks
with the dtype. (A group killed inside a compressed sync, then healed:
test_semi_sync.py::test_kill_mid_inner_steps_and_during_sync_then_heal[async_int4].)"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration_tests.harness import FAULTS_MODULE, SEMI_SYNC_MODULE, FTJob, tail
from tests.integration_tests.test_semi_sync import (
    args,
    assert_clean_syncs_agree,
    assert_loss_falls,
    global_digests,
    syncs,
)
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import (
    FINAL_DIGEST,
    GLOBAL_DIGEST,
    NON_FINITE,
    SYNC,
)

#: The most bytes a sync of each dtype may send, as a share of float32's (payload + scales).
#: Sparse: 120 bytes per 4,096 values to the one other group (Streaming: half the model).
MAX_SHARE = {
    "diloco_int8": 0.27,
    "async_int4": 0.14,
    "streaming_sparse": 0.01,
    "async_sparse": 0.01,
}


@pytest.mark.parametrize(
    "method", ["diloco_int8", "async_int4", "streaming_sparse", "async_sparse"]
)
def test_compressed_syncs_keep_the_groups_identical(
    ft_job: Callable[..., FTJob], tmp_path: Path, method: str
) -> None:
    """12 steps, sync_steps 4, int8 (blocking DiLoCo, through torchft's DiLoCo) or int4 with
    error feedback (async DiLoCo): every sync is committed by both groups with the same global
    digest, both end with the same model, the loss falls, and each sync sent at most 0.27x
    (int8) / 0.14x (int4) of what a float32 sync of the same model sends, with its compression
    time reported; sparse, in Streaming DiLoCo and async DiLoCo, under 1 %."""
    steps = 12
    job = ft_job(groups=2, train_args=args(SEMI_SYNC_MODULE, method, f"--training.steps={steps}"))
    reference = ft_job(
        tmp_path / "float32",
        groups=2,
        train_args=args(SEMI_SYNC_MODULE, "diloco", "--training.steps=4"),
    )
    job.start()
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    reference.start()  # one float32 sync of the same model: the bytes to compare with
    for r in range(2):
        assert reference.wait_exit(r, timeout=240) == 0, tail(reference.latest(r).text())
    fp32_bytes = reference.events(0, SYNC)[0]["bytes_sent"]
    expected = steps // 4 * (2 if method.startswith("streaming") else 1)  # a fragment each
    per_group = [syncs(job.events(r, SYNC)) for r in range(2)]
    for found in per_group:
        assert [s.number for s in found] == list(range(1, expected + 1)), found
        assert all(s.committed and s.groups == 2 for s in found), found
    assert_clean_syncs_agree(job, per_group, expected)
    shares = []
    for r in range(2):
        for e in job.events(r, SYNC):
            assert e["pseudo_grad_dtype"] == method.split("_")[1]
            assert e["compression_s"] is not None and e["compression_s"] > 0
            share = e["bytes_sent"] / fp32_bytes
            assert 0 < share <= MAX_SHARE[method], (share, e["bytes_sent"], fp32_bytes)
            shares.append(share)
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    first, last = assert_loss_falls(job.events(0, TRAIN_STEP))
    print(
        f"{method}: {expected} syncs committed with identical digests; bytes per sync "
        f"{min(shares):.3f}-{max(shares):.3f} x float32 ({fp32_bytes} B); loss {first:.3f} -> "
        f"{last:.3f}; both end with {final[0][0]}"
    )


@pytest.mark.parametrize("method", ["diloco_int8", "async_int4", "async_sparse"])
def test_a_nan_in_one_group_fails_that_sync_everywhere_and_poisons_nothing(
    ft_job: Callable[..., FTJob], method: str
) -> None:
    """Error feedback on; group 1 puts a NaN into its pseudo-gradient of sync #2. Both groups
    drop that sync (group 1 names itself, group 0 names another group), retry it under the
    same number, and commit every later sync with the same digest; both end with the same
    finite model. Without the check the NaN would poison its block's scale in every group's
    average alike (the digests would still agree) and, through the residual, every later
    sync."""
    extra = ["--training.steps=16", "--fault_tolerance.error_feedback"]
    if method in ("async_int4", "async_sparse"):
        extra = extra[:1]  # these have error feedback already
    job = ft_job(groups=2, train_args=args(FAULTS_MODULE, method, *extra))
    job.start_lighthouse()
    job.start_group(0)
    job.start_group(1, ["--fault_injection.nan_in_sync=2"])
    for r in range(2):
        assert job.wait_exit(r, timeout=240) == 0, tail(job.latest(r).text())
    found = [
        [(e["origin"], e["group"], e.sync) for e in job.events(r, NON_FINITE)] for r in range(2)
    ]
    assert found == [[("another group", None, 2)], [("this group", 1, 2)]], found
    per_group = [syncs(job.events(r, SYNC)) for r in range(2)]
    for outcomes in per_group:
        assert [(s.number, s.committed) for s in outcomes][:3] == [(1, True), (2, False), (2, True)]
        assert all(s.committed for s in outcomes[2:]), outcomes
    digests = [global_digests(job.events(r, GLOBAL_DIGEST)) for r in range(2)]
    assert digests[0] == digests[1] and len(digests[0]) >= 3, digests
    final = [[e["digest"] for e in job.events(r, FINAL_DIGEST)] for r in range(2)]
    assert len(final[0]) == 1 and final[0] == final[1], final
    losses_ = [e["loss"] for e in job.events(0, TRAIN_STEP)]
    assert all(math.isfinite(v) for v in losses_), losses_
