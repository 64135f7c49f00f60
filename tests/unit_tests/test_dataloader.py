import hashlib
import inspect
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.components.tokenizer import ByteTokenizer
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.corpus import Document, build_corpus, split_of
from torchtitan.datasets.sources import IndexedSource, StreamSource, build_source
from torchtitan.datasets.text import TextDataLoader, TextDataset, build_dataloader

TOK = ByteTokenizer()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus() -> list[Document]:
    return build_corpus()


def digest(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(f"{d.title}\0{d.text}\0".encode())
    return h.hexdigest()


def indexed(texts: list[str]) -> IndexedSource:
    return IndexedSource("tiny", len(texts), lambda i: texts[i])


def take(loader_or_dataset, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader_or_dataset)
    return [next(it) for _ in range(n)]


def same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True)
    )


def config(**training) -> JobConfig:
    job = JobConfig()
    job.training.seq_len = 32
    job.training.local_batch_size = 2
    job.validation.local_batch_size = 2
    for key, value in training.items():
        setattr(job.training, key, value)
    return job


# ------------------------------------------------------------------------------- corpus


def test_corpus_is_deterministic_and_a_few_mb(corpus: list[Document]) -> None:
    assert digest(build_corpus()) == digest(corpus)
    assert len({d.title for d in corpus}) == len(corpus) > 1000
    assert sum(len(d.text.encode()) for d in corpus) > 1_500_000
    assert all(d.text and " at 0x" not in d.text for d in corpus)


def test_corpus_ignores_what_this_process_patched(
    corpus: list[Document], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Libraries patch the stdlib (torch, datasets...); the corpus is built apart from them.
    monkeypatch.setattr(inspect, "getfile", lambda obj: "patched")
    assert digest(build_corpus()) == digest(corpus)


def test_corpus_validation_split_is_disjoint_and_about_5_percent(corpus: list[Document]) -> None:
    train = {d.title for d in corpus if split_of(d.title) == "train"}
    validation = {d.title for d in corpus if split_of(d.title) == "validation"}
    assert not train & validation and len(train) + len(validation) == len(corpus)
    assert 0.02 < len(validation) / len(corpus) < 0.1
    # The split is a pure function of the title: no per-process hash salt.
    assert split_of("topic:assert") == split_of("topic:assert")


# ------------------------------------------------------------------------------- packing


def test_samples_are_packed_shifted_windows_of_the_token_stream() -> None:
    texts = ["abc", "de", "fghij"]
    stream = [t for text in texts for t in TOK.encode(text)]
    ds = TextDataset(indexed(texts), TOK, seq_len=4, infinite=False)
    samples = list(ds)
    assert len(samples) == len(stream) // 5
    for k, (x, y) in enumerate(samples):
        assert x.dtype == torch.long and x.shape == (4,)
        assert x.tolist() == stream[5 * k : 5 * k + 4]
        assert y.tolist() == stream[5 * k + 1 : 5 * k + 5]


def test_training_ranks_get_disjoint_documents_each_epoch() -> None:
    texts = [f"{i:04d}" for i in range(12)]  # 4 bytes + BOS + EOS = exactly one sample
    seen = []
    for rank in range(3):
        ds = TextDataset(indexed(texts), TOK, seq_len=5, dp_rank=rank, dp_world_size=3, seed=7)
        seen.append({TOK.decode(x.tolist()) for x, _ in take(ds, 4)})
    assert all(len(s) == 4 for s in seen)
    assert set.union(*seen) == set(texts)


def test_epochs_are_reshuffled_deterministically_from_the_seed() -> None:
    texts = [f"{i:04d}" for i in range(50)]

    def order(seed: int) -> list[str]:
        ds = TextDataset(indexed(texts), TOK, seq_len=5, seed=seed)
        return [TOK.decode(x.tolist()) for x, _ in take(ds, 100)]

    a = order(1)
    assert a == order(1) and a != order(2)
    assert sorted(a[:50]) == sorted(a[50:]) == texts and a[:50] != a[50:]


def test_validation_ranks_split_samples_evenly_and_disjointly() -> None:
    texts = [f"document {i} " * (i % 7 + 1) for i in range(40)]
    single = list(TextDataset(indexed(texts), TOK, seq_len=9, infinite=False))
    per_rank = [
        list(TextDataset(indexed(texts), TOK, 9, dp_rank=r, dp_world_size=3, infinite=False))
        for r in range(3)
    ]
    assert len({len(p) for p in per_rank}) == 1  # equal lengths: no rank waits forever
    interleaved = [per_rank[j % 3][j // 3] for j in range(3 * len(per_rank[0]))]
    assert same(interleaved, single[: len(interleaved)])
    assert len(single) - len(interleaved) < 3


# ------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("world", [1, 2])
def test_resume_gives_the_exact_next_batches_across_epochs(world: int) -> None:
    # 5 short documents, sequences longer than most: every few batches cross an epoch.
    texts = ["alpha", "be", "gamma delta", "e", "zeta eta theta"]
    for rank in range(world):

        def loader(rank: int = rank) -> TextDataLoader:
            return TextDataLoader(TextDataset(indexed(texts), TOK, 7, rank, world, seed=3), 3)

        reference = take(loader(), 30)
        for n in (0, 1, 4, 9, 17):
            first = loader()
            assert same(take(first, n), reference[:n])
            state = pickle.loads(pickle.dumps(first.state_dict()))
            resumed = loader()
            resumed.load_state_dict(state)
            assert same(take(resumed, 30 - n), reference[n:])
            assert same(take(first, 30 - n), reference[n:])  # saving changed nothing
            if n == 17:  # the resume point lies epochs into the data
                assert state[f"dp_rank_{rank}"]["epoch"] >= 2


def test_resume_of_a_stream_source(tmp_path: Path) -> None:
    file = tmp_path / "data.jsonl"
    file.write_text(
        "".join(json.dumps({"text": f"row {i} " * (i % 5 + 1)}) + "\n" for i in range(30))
    )
    source = build_source("local", str(file), "train")
    assert isinstance(source, StreamSource)

    def loader() -> TextDataLoader:
        return TextDataLoader(TextDataset(source, TOK, 16, 1, 2), 2)

    reference = take(loader(), 25)
    first = loader()
    take(first, 11)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert same(take(resumed, 14), reference[11:])


def test_state_is_small() -> None:
    ds = TextDataset(indexed(["x" * 100] * 10), TOK, seq_len=16)
    take(ds, 20)
    state = ds.state_dict()
    assert set(state) == {"dataset", "rank", "world_size", "epoch", "next_document", "buffer"}
    assert len(state["buffer"]) < 100 + 2 + 17


def test_state_from_another_rank_or_world_is_rejected() -> None:
    texts = ["some text here"] * 8

    def loader(rank: int, world: int) -> TextDataLoader:
        return TextDataLoader(TextDataset(indexed(texts), TOK, 4, rank, world), 2)

    state = loader(0, 2).state_dict()
    with pytest.raises(ValueError, match="dp_rank_1.*dp_rank_0"):
        loader(1, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 0 of 2.*rank 0 of 4"):
        loader(0, 4).load_state_dict(state)


# ------------------------------------------------------------------------------- loaders


def test_embedded_dataloader_batches_and_validation_repeats(corpus: list[Document]) -> None:
    job = config()
    train = build_dataloader(job, TOK, 0, 1, "train")
    x, y = next(iter(train))
    assert x.shape == y.shape == (2, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])

    validation = build_dataloader(job, TOK, 0, 1, "validation")
    first = take(validation, 3)  # an early stop, as with validation.steps
    assert same(take(validation, 3), first)
    batches = list(validation)
    assert same(list(validation), batches)
    val_bytes = sum(len(d.text.encode()) + 2 for d in corpus if split_of(d.title) == "validation")
    assert len(batches) == -(-(val_bytes // 33) // 2)
    # Training text never comes from the held-out documents.
    held_out = {d.text for d in corpus if split_of(d.title) == "validation"}
    assert all(TOK.decode(s.tolist()) not in held_out for s in x)


def test_local_txt_jsonl_parquet(tmp_path: Path) -> None:
    texts = [f"document number {i}: " + "words " * (i % 9) for i in range(200)]
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(t)
    (tmp_path / "txt" / "README.md").write_text("not data")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "data.parquet", row_group_size=7)

    def documents(path: Path, split: str) -> list[str]:
        source = build_source("local", str(path), split)  # type: ignore[arg-type]
        if isinstance(source, IndexedSource):
            return [source.read(i) for i in range(source.size)]
        return list(source.open())

    for path in (tmp_path / "txt", tmp_path / "data.jsonl", tmp_path / "data.parquet"):
        train, validation = documents(path, "train"), documents(path, "validation")
        assert not set(train) & set(validation) and 0 < len(validation) < 30
        assert sorted(train + validation) == sorted(texts)
        loader = build_dataloader(config(dataset="local", dataset_path=str(path)), TOK, 0, 1)
        assert next(iter(loader))[0].shape == (2, 32)


def test_local_folder_with_validation_files(tmp_path: Path) -> None:
    (tmp_path / "c4-train.00000.jsonl").write_text(json.dumps({"text": "train " * 20}) + "\n")
    (tmp_path / "c4-validation.00000.jsonl").write_text(json.dumps({"text": "val " * 20}) + "\n")
    assert list(build_source("local", str(tmp_path), "train").open()) == ["train " * 20]  # type: ignore[union-attr]
    validation = build_dataloader(
        config(dataset="local", dataset_path=str(tmp_path)), TOK, 0, 1, "validation"
    )
    text = TOK.decode([t for b in validation for x in b[0] for t in x.tolist()])
    assert "val" in text and "train" not in text


def test_explicit_validation_dataset_is_used_whole(tmp_path: Path) -> None:
    texts = [f"held out {i} " * 5 for i in range(20)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    job = config()
    job.validation.dataset = "local"
    job.validation.dataset_path = str(tmp_path / "eval.jsonl")
    batches = list(build_dataloader(job, TOK, 0, 1, "validation"))
    stream = [t for text in texts for t in TOK.encode(text)]
    assert sum(len(b[0]) for b in batches) == len(stream) // 33


def test_bad_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="training.dataset_path"):
        build_dataloader(config(dataset="local", dataset_path=str(tmp_path / "nope")), TOK, 0, 1)
    job = config()
    job.validation.dataset_path = str(tmp_path / "nope")
    job.validation.dataset = "local"
    with pytest.raises(FileNotFoundError, match="validation.dataset_path"):
        build_dataloader(job, TOK, 0, 1, "validation")
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.txt, \.jsonl, \.parquet"):
        build_source("local", str(tmp_path / "data.csv"), "train")
    with pytest.raises(ValueError, match="no dataset files.*\\.txt, \\.jsonl, \\.parquet"):
        build_source("local", str(tmp_path), "train")
    with pytest.raises(ValueError, match="training.dataset=local"):
        build_source("embedded", str(tmp_path), "train")
    with pytest.raises(ValueError, match="fewer than the 5 data-parallel ranks"):
        TextDataset(indexed(["a", "b"]), TOK, 4, 0, 5)


def test_hub_datasets_offline_error_and_local_copy(tmp_path: Path) -> None:
    # A fresh interpreter: the hub libraries read these variables when first imported.
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(REPO),
    }
    copy = tmp_path / "copy"
    copy.mkdir()
    for split in ("train", "validation"):
        rows = [{"text": f"{split} {i}", "url": "u"} for i in range(3)]
        (copy / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = (
        "from torchtitan.datasets.sources import build_source\n"
        "for name in ('allenai/c4', 'nobody/not-a-cached-dataset'):\n"
        "    try:\n"
        "        build_source(name, None, 'train')\n"
        "    except ConnectionError as e:\n"
        "        print(e)\n"
        "for split in ('train', 'validation'):\n"
        f"    print(list(build_source('someone/data', {str(copy)!r}, split).open()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4, out.stderr
    for line, name in zip(lines, ("allenai/c4", "nobody/not-a-cached-dataset"), strict=False):
        assert f"training.dataset='{name}'" in line
        assert "Hub is unreachable" in line and "training.dataset_path" in line
    # A local copy of a hub dataset is read offline, with its own validation split.
    assert lines[2:] == [
        str([f"train {i}" for i in range(3)]),
        str([f"validation {i}" for i in range(3)]),
    ]
