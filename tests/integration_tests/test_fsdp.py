"""``NGPU=2 ./run_train.sh`` on CPU (gloo, FSDP2 over 2 ranks) against one process.

What can be compared: with 2 ranks, rank r reads its own shard of the data (document i of an
epoch goes to rank i % 2), so a plain 1-process run, even with twice the local batch, packs
different sequences into each batch and its losses differ by sampling noise (about 0.1 here).
An exact comparison needs the same sequences, so the reference is one process that trains on
the union of both ranks' batches (``union_batch_trainer``, a custom args module): its mean loss
and gradient are exactly what FSDP2's gradient averaging computes over the two ranks. The
losses then differ only by float summation order: measured at most 2 float32 ulps (1e-6) over
12 steps; the test allows 1e-5 relative.

The plain 1-process run with the same global batch is still checked loosely: both runs' losses
fall by a similar amount.
"""

from __future__ import annotations

import math
from pathlib import Path

from tests.integration_tests.train_runs import SMALL, run_train, train_env
from torchtitan.components.metrics import read_metrics

STEPS = 12
PER_RANK_BATCH = 2
RELATIVE_TOLERANCE = 1e-5


def _args(dump: Path, batch: int) -> list[str]:
    return [
        *SMALL,
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        f"--training.local_batch_size={batch}",
        "--training.seed=0",
        "--validation.enable=false",
    ]


def _train(dump: Path, batch: int, ngpu: int = 1, extra: list[str] | None = None) -> dict:
    result = run_train([*_args(dump, batch), *(extra or [])], env=train_env(NGPU=str(ngpu)))
    assert result.returncode == 0, result.stdout
    metrics = read_metrics(dump / "metrics.jsonl")
    assert sorted(metrics) == list(range(1, STEPS + 1)), metrics
    return metrics


def test_two_fsdp_ranks_match_one_process_on_the_union_of_their_batches(tmp_path: Path) -> None:
    sharded = _train(tmp_path / "fsdp2", PER_RANK_BATCH, ngpu=2)
    union = _train(
        tmp_path / "union",
        PER_RANK_BATCH,
        extra=[
            "--job.custom_args_module=tests.integration_tests.union_batch_trainer",
            "--union_batch.ranks=2",
        ],
    )
    for step in range(1, STEPS + 1):
        for key in ("train/loss", "train/grad_norm"):
            a, b = sharded[step][key], union[step][key]
            assert math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE), (step, key, a, b)

    plain = _train(tmp_path / "plain", 2 * PER_RANK_BATCH)

    def fall(metrics: dict) -> float:
        losses = [metrics[s]["train/loss"] for s in range(1, STEPS + 1)]
        return sum(losses[:3]) / 3 - sum(losses[-3:]) / 3

    # Measured: both fall by about 0.5 (6.0 -> 5.45) over these 12 steps.
    assert fall(sharded) > 0.25 and fall(plain) > 0.25, (fall(sharded), fall(plain))
    assert abs(fall(sharded) - fall(plain)) < 0.25, (fall(sharded), fall(plain))


def test_bfloat16_on_one_rank_computes_in_autocast(tmp_path: Path) -> None:
    """``mixed_precision_param=bfloat16`` without FSDP (one rank): the forward runs in bf16
    autocast, so the first loss differs from float32's (the same weights and batch), by
    about bf16's precision and no more."""
    fp32 = _train(tmp_path / "fp32", PER_RANK_BATCH)
    bf16 = _train(
        tmp_path / "bf16", PER_RANK_BATCH, extra=["--training.mixed_precision_param=bfloat16"]
    )
    a, b = fp32[1]["train/loss"], bf16[1]["train/loss"]
    assert a != b and abs(a - b) < 0.02 * a, (a, b)
