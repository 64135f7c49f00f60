"""Semi-sync at the sizes people train, shrunk to CPU: tensors larger than a bucket and a shard.

The debug model's every tensor fits in one bucket, which hid that torchft 0.2.0's bucketing
sends zeros for any larger tensor. Here the vocabulary is 32,000 tokens (a BPE trained on the
embedded corpus in the test) and the bucket is lowered to 1 MiB (262,144 fp32 values): the
embedding's and the output's FSDP shards (1,024,000 values each over 2 ranks) travel in four
bucket-sized pieces each, as an 8B model's 65.7 M-value embedding shard does in eight 32 MiB
ones. 2 groups x 2 FSDP2 ranks, Streaming DiLoCo (2 fragments) with int8 or sparse
pseudo-gradients (each rank chooses its top values within its own shard); one group is killed
and heals. Marked ``slow``: ``.ci/run`` runs it like every other test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration_tests.harness import FAULTS_MODULE, FTJob, per_rank
from tests.integration_tests.test_semi_sync import (
    args,
    global_digests,
    kill_and_heal_group_1,
    syncs,
)
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import FINAL_MODEL, SYNC
from torchtitan.trainer import VALIDATION

VOCAB = 32_000
DIM = 64  # debugmodel_small
BUCKET_MB = 1.0


def build_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of exactly ``VOCAB`` tokens, trained on the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from torchtitan.datasets.corpus import build_corpus

    texts = [d.text for d in build_corpus()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    short = VOCAB - tok.get_vocab_size()
    if short > 0:  # the corpus ran out of merges: fill up with plain tokens
        tok.add_tokens([f"<extra_{i}>" for i in range(short)])
    assert tok.get_vocab_size() == VOCAB
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def rank0_values() -> int:
    """Values of the model rank 0 holds with FSDP2 over 2 ranks (the first half of each
    parameter's rows, rounded up)."""
    import copy
    import math

    import torch

    from torchtitan.models import get_train_spec

    spec = get_train_spec("llama3")
    model_args = copy.deepcopy(spec.model_args["debugmodel_small"])
    model_args.vocab_size = VOCAB
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    return sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) for p in model.parameters())


@pytest.fixture(scope="module")
def tokenizer_32k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


#: Bytes a rank sends per value of its shards when both fragments have synced once, 2 groups:
#: int8, its own chunk and the reduced one, 1 byte plus a 4-byte scale per 128; sparse, its
#: encoding to the other group, 120 bytes per 4,096 values.
BYTES_PER_VALUE = {"diloco_int8": 1 + 4 / 128, "diloco_sparse": 120 / 4096}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco_int8", "diloco_sparse"])
def test_streaming_diloco_with_fsdp_averages_tensors_larger_than_a_bucket(
    ft_job: Callable[..., FTJob], tmp_path: Path, tokenizer_32k: Path, method: str
) -> None:
    """24 steps, sync_steps 4 over 2 fragments (a fragment sync every 2 steps), validation at
    the end. Group 1 is killed after step 6 and heals from group 0 at a sync. Afterwards every
    sync both took part in gives both groups the same global shard on each rank, both end with
    the same model, and their final validation losses, over the same held-out samples, are
    equal."""
    # The sizes this test is about (a precondition, not a finding): shards over a bucket.
    assert VOCAB * DIM // 2 > BUCKET_MB * 2**20 / 4
    train_args = args(
        FAULTS_MODULE,
        method,
        f"--model.tokenizer_path={tokenizer_32k}",
        "--fault_tolerance.num_fragments=2",
        f"--fault_tolerance.sync_bucket_mb={BUCKET_MB}",
        "--training.steps=24",
        "--validation.enable",
        "--validation.freq=1000",
        "--validation.steps=2",
        "--validation.local_batch_size=2",
    )
    job = ft_job(groups=2, ngpu=2, train_args=train_args)
    kill_and_heal_group_1(job, tmp_path / "pause_group0", ranks=2, timeout=400)

    shards = {r: per_rank(job.events(r)) for r in range(2)}
    for rank in (0, 1):
        digests = [global_digests(shards[r][rank]) for r in range(2)]
        common = sorted(set(digests[0]) & set(digests[1]))
        assert len(common) >= 3, (rank, digests)
        assert all(digests[0][n] == digests[1][n] for n in common), (rank, digests)
        last = syncs(shards[0][rank])[-1]
        assert last.committed and last.groups == 2
        finals = [[e["digest"] for e in shards[r][rank] if e.name == FINAL_MODEL.name]
                  for r in range(2)]  # fmt: skip
        assert len(finals[0]) == 1 and finals[0] == finals[1], (rank, finals)
    # Both fragments' syncs together cover every value of rank 0's shards once
    # (BYTES_PER_VALUE). A dropped tensor (the embedding shard is half of them) could not send
    # that much; each bucket's last chunk is padded, hence the 10 %.
    together = [e for e in job.events(0, SYNC, rank=0) if e["committed"] and e["groups"] == 2]
    rounds = [together[i : i + 2] for i in range(len(together) - 1)]
    both = [r for r in rounds if {e["fragment"] for e in r} == {0, 1}]
    assert both, together
    expected = rank0_values() * BYTES_PER_VALUE[method]
    for pair in both:
        sent = sum(e["bytes_sent"] for e in pair)
        assert expected / 1.04 <= sent <= 1.1 * expected, (sent, expected)
    validation = [[e["loss"] for e in job.events(r, VALIDATION, rank=0)] for r in range(2)]
    assert len(validation[0]) == 1 and validation[0] == validation[1], validation
    losses = [e["loss"] for e in job.events(0, TRAIN_STEP, rank=0)]
    assert losses[-1] < losses[0]
    print(
        f"32k vocabulary, 2x2 FSDP, {method} Streaming, 1 MiB buckets: shards agree at syncs "
        f"{common}; validation loss {validation[0][0]:.4f} in both groups"
    )
