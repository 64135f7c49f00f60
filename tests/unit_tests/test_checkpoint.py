"""CheckpointManager in one process: round trip, incomplete and garbage checkpoints, purge,
load_step, exclude_from_loading."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchtitan.components.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    complete_steps,
)
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import OptimizerState
from torchtitan.config.job_config import ConfigError, JobConfig
from torchtitan.tools.logging import logger
from torchtitan.trainer import ModelState, TrainState


class Position:
    """A dataloader-like Stateful: a position and a list of leftover tokens."""

    def __init__(self) -> None:
        self.position = 0
        self.leftover: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "leftover": list(self.leftover)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.leftover = list(state["leftover"])


class Run:
    """A tiny model, its AdamW, LR schedule, data position and train state, registered as the
    trainer registers them."""

    def __init__(self, config: JobConfig, seed: int = 0, outputs: int = 2) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, outputs))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = build_lr_scheduler(self.optimizer, config)
        self.data = Position()
        self.train_state = TrainState()
        self.states = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.scheduler,
            "dataloader": self.data,
            "train_state": self.train_state,
        }
        self.checkpointer = CheckpointManager(config, self.states)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad()
            self.model(torch.randn(3, 4)).square().mean().backward()
            self.optimizer.step()
            self.scheduler.step()
            self.data.position += 3
            self.data.leftover = list(range(self.data.position % 5))
            self.train_state.count_step(12)

    def snapshot(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "exp_avg": [
                self.optimizer.state[p]["exp_avg"].clone()
                for p in self.model.parameters()
                if p in self.optimizer.state
            ],
            "lr": self.optimizer.param_groups[0]["lr"],
            "scheduler_epoch": self.scheduler.last_epoch,
            "data": self.data.state_dict(),
            "train_state": self.train_state.state_dict(),
        }


def _config(tmp_path: Path, **checkpoint: Any) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.training.steps = 20
    config.lr_scheduler.warmup_steps = 2
    config.checkpoint.enable = True
    for name, value in checkpoint.items():
        setattr(config.checkpoint, name, value)
    return config


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a["exp_avg"], b["exp_avg"], strict=True):
        assert torch.equal(x, y)
    for key in ("lr", "scheduler_epoch", "data", "train_state"):
        assert a[key] == b[key], key


@pytest.fixture
def warnings_logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the project logger (which may not propagate to the root logger)."""
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def test_round_trip_restores_every_state(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run = Run(config)
    run.train(3)
    run.checkpointer.save(3)
    saved = run.snapshot()
    assert complete_steps(tmp_path / "checkpoint") == [3]

    fresh = Run(config, seed=1)  # other weights, no optimizer state yet
    assert fresh.checkpointer.load() == 3
    _assert_same(fresh.snapshot(), saved)

    # Both go on identically from there.
    torch.manual_seed(5)
    run.train(2)
    torch.manual_seed(5)
    fresh.train(2)
    _assert_same(fresh.snapshot(), run.snapshot())


def test_nothing_to_resume_from(tmp_path: Path) -> None:
    run = Run(_config(tmp_path))
    before = run.snapshot()
    assert run.checkpointer.load() is None
    _assert_same(run.snapshot(), before)


def test_disabled_checkpointing_loads_nothing(tmp_path: Path) -> None:
    run = Run(_config(tmp_path))
    run.train(1)
    run.checkpointer.save(1)
    assert Run(_config(tmp_path, enable=False)).checkpointer.load() is None


def test_incomplete_step_folder_is_skipped_with_a_warning(
    tmp_path: Path, warnings_logged: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    run = Run(config)
    run.train(2)
    run.checkpointer.save(2)
    saved = run.snapshot()
    partial = tmp_path / "checkpoint" / "step-4"  # a save that died before its .metadata
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half written")

    fresh = Run(config, seed=1)
    assert fresh.checkpointer.load() == 2
    _assert_same(fresh.snapshot(), saved)
    assert any(
        "step-4" in r.getMessage() and "incomplete" in r.getMessage()
        for r in warnings_logged.records
    )


def test_saving_a_step_again_replaces_its_partial_folder(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run = Run(config)
    run.train(2)
    partial = tmp_path / "checkpoint" / "step-2"
    partial.mkdir(parents=True)
    (partial / "junk").write_bytes(b"x")
    run.checkpointer.save(2)
    assert not (partial / "junk").exists()
    assert Run(config, seed=1).checkpointer.load() == 2


def test_keep_latest_k_purges_old_and_dead_partial_saves(tmp_path: Path) -> None:
    config = _config(tmp_path, keep_latest_k=2)
    run = Run(config)
    folder = tmp_path / "checkpoint"
    (folder / "step-1").mkdir(parents=True)  # a partial save, older than the newest complete
    for step in (2, 3, 4, 5):
        run.train(1)
        run.checkpointer.save(step)
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-5"]


def test_keep_latest_k_zero_keeps_all(tmp_path: Path) -> None:
    run = Run(_config(tmp_path, keep_latest_k=0))
    for step in (1, 2, 3):
        run.train(1)
        run.checkpointer.save(step)
    assert complete_steps(tmp_path / "checkpoint") == [1, 2, 3]


def test_load_step_picks_an_older_checkpoint(tmp_path: Path) -> None:
    run = Run(_config(tmp_path, keep_latest_k=0))
    run.train(2)
    run.checkpointer.save(2)
    at_two = run.snapshot()
    run.train(2)
    run.checkpointer.save(4)

    fresh = Run(_config(tmp_path, load_step=2), seed=1)
    assert fresh.checkpointer.load() == 2
    _assert_same(fresh.snapshot(), at_two)


def test_load_step_without_a_checkpoint_is_an_error(tmp_path: Path) -> None:
    run = Run(_config(tmp_path))
    run.train(2)
    run.checkpointer.save(2)
    with pytest.raises(CheckpointError, match=r"checkpoint.load_step: 3 .*complete steps: \[2\]"):
        Run(_config(tmp_path, load_step=3)).checkpointer.load()


def test_garbage_metadata_is_a_checkpoint_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "checkpoint" / "step-10"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"not a pickle at all")
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)))
    with pytest.raises(CheckpointError, match=r"step-10 cannot be loaded: its \.metadata file"):
        Run(_config(tmp_path)).checkpointer.load()
    assert "Traceback" not in capfd.readouterr().err  # DCP's own tracebacks are held back


def test_garbage_shards_are_a_checkpoint_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    run = Run(config)
    run.train(1)
    run.checkpointer.save(1)
    for shard in (tmp_path / "checkpoint" / "step-1").glob("*.distcp"):
        shard.write_bytes(b"\0garbage" * 32)
    # Caught by the checksums before DCP reads a byte of it.
    with pytest.raises(CheckpointError, match=r"step-1: __0_0.distcp \(written by rank 0\) has"):
        Run(config, seed=1).checkpointer.load()
    assert "Traceback" not in capfd.readouterr().err


def test_checkpoint_of_another_model_is_a_checkpoint_error(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run = Run(config)
    run.train(1)
    run.checkpointer.save(1)
    other = Run(config, outputs=3)
    with pytest.raises(CheckpointError, match="[Ss]ize mismatch"):
        other.checkpointer.load()


def test_exclude_from_loading_leaves_those_states_alone(tmp_path: Path) -> None:
    run = Run(_config(tmp_path))
    run.train(3)
    run.checkpointer.save(3)
    saved = run.snapshot()

    fresh = Run(_config(tmp_path, exclude_from_loading=["dataloader", "optimizer"]), seed=1)
    fresh_data = fresh.data.state_dict()
    assert fresh.checkpointer.load() == 3
    restored = fresh.snapshot()
    for x, y in zip(restored["params"], saved["params"], strict=True):
        assert torch.equal(x, y)
    assert restored["train_state"] == saved["train_state"]
    assert restored["data"] == fresh_data  # not restored
    assert not fresh.optimizer.state  # no optimizer state loaded


def test_exclude_from_loading_an_unknown_state_is_a_config_error(tmp_path: Path) -> None:
    run = Run(_config(tmp_path))
    run.train(1)
    run.checkpointer.save(1)
    with pytest.raises(ConfigError, match="checkpoint.exclude_from_loading.*'dataloadr'"):
        Run(_config(tmp_path, exclude_from_loading=["dataloadr"])).checkpointer.load()


def test_initial_load_path_loads_the_model_only(tmp_path: Path) -> None:
    source = Run(_config(tmp_path / "pretrained"))
    source.train(2)
    source.checkpointer.save(2)
    weights = source.snapshot()["params"]

    run = Run(
        _config(
            tmp_path / "finetune",
            initial_load_path=str(tmp_path / "pretrained" / "checkpoint" / "step-2"),
        ),
        seed=1,
    )
    assert run.checkpointer.load() is None  # training starts at step 1
    for x, y in zip(run.snapshot()["params"], weights, strict=True):
        assert torch.equal(x, y)
    assert run.train_state.step == 0 and not run.optimizer.state


# ---- checksums -------------------------------------------------------------------------------


def _two_checkpoints(tmp_path: Path) -> tuple[JobConfig, dict[str, Any], Path]:
    """Checkpoints of steps 5 and 10; the snapshot of step 5 and the folder of step 10."""
    config = _config(tmp_path)
    run = Run(config)
    run.train(5)
    run.checkpointer.save(5)
    older = run.snapshot()
    run.train(5)
    run.checkpointer.save(10)
    return config, older, tmp_path / "checkpoint" / "step-10"


def _zero_middle(path: Path, size: int = 4096) -> None:
    """Overwrite ``size`` bytes in the middle of a file with zeros, as a bad disk would."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + size] = bytes(min(size, len(data) - middle))
    path.write_bytes(bytes(data))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "zeros_in_tensor_data": (lambda f: _zero_middle(f / "__0_0.distcp"), "fails its checksum"),
    "a_flipped_metadata_byte": (lambda f: _flip(f / ".metadata", 100), "fails its checksum"),
    "a_deleted_file": (lambda f: (f / "__0_0.distcp").unlink(), "is missing"),
    "a_truncated_file": (
        lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:1000]),
        "has 1000 bytes",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_never_loaded_and_the_newest_intact_one_is(
    tmp_path: Path, damage: str, warnings_logged: pytest.LogCaptureFixture
) -> None:
    config, older, newest = _two_checkpoints(tmp_path)
    hurt, words = DAMAGE[damage]
    hurt(newest)
    fresh = Run(config, seed=1)
    assert fresh.checkpointer.load() == 5
    _assert_same(fresh.snapshot(), older)
    warned = [r.getMessage() for r in warnings_logged.records]
    assert any(f"checkpoint {newest}:" in m and words in m for m in warned), warned
    assert any("written by rank 0" in m for m in warned), warned
    # Asked for by checkpoint.load_step, it stops the run instead.
    config.checkpoint.load_step = 10
    with pytest.raises(CorruptCheckpointError, match="checkpoint.load_step asked for it"):
        Run(config, seed=1).checkpointer.load()


def test_when_no_checkpoint_passes_the_run_stops_naming_the_newest(tmp_path: Path) -> None:
    config, _, newest = _two_checkpoints(tmp_path)
    _zero_middle(newest / "__0_0.distcp")
    _flip(tmp_path / "checkpoint" / "step-5" / ".metadata", 50)
    with pytest.raises(CorruptCheckpointError, match=r"step-10: __0_0.distcp .* no other"):
        Run(config, seed=1).checkpointer.load()


def test_a_damaged_manifest_rejects_its_checkpoint(tmp_path: Path) -> None:
    config, _, newest = _two_checkpoints(tmp_path)
    (newest / "checksums.json").write_text("{not json")
    assert Run(config, seed=1).checkpointer.load() == 5


def test_a_checkpoint_without_checksums_loads_with_a_note(
    tmp_path: Path, warnings_logged: pytest.LogCaptureFixture
) -> None:
    """Written before checksums existed: no manifest, no marker. It loads, unverified, and
    says so in one line; a save that began with the marker and lost its manifest is a save
    that did not finish."""
    config, _, newest = _two_checkpoints(tmp_path)
    (newest / "checksums.json").unlink()
    assert complete_steps(tmp_path / "checkpoint") == [5]  # the marker says: unfinished
    (newest / ".checksums-expected").unlink()
    assert complete_steps(tmp_path / "checkpoint") == [5, 10]
    assert Run(config, seed=1).checkpointer.load() == 10
    notes = {r.getMessage() for r in warnings_logged.records if "unverified" in r.getMessage()}
    assert notes == {f"Checkpoint {newest} has no checksums (written before they existed): "
                     "loaded unverified"}  # fmt: skip


def test_every_file_of_a_save_is_in_its_manifest(tmp_path: Path) -> None:
    import json

    _, _, newest = _two_checkpoints(tmp_path)
    listed = json.loads((newest / "checksums.json").read_text())["files"]
    on_disk = {p.name for p in newest.iterdir()} - {"checksums.json", ".checksums-expected"}
    assert set(listed) == on_disk and ".metadata" in listed
    assert all(entry["rank"] == 0 and entry["bytes"] > 0 for entry in listed.values())


def _item(folder: Path, fqn: str) -> tuple[str, int, int]:
    """(file, offset, length) of the item holding ``fqn`` in a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    for index, where in metadata.storage_data.items():
        if index.fqn == fqn:
            return where.relative_path, where.offset, where.length
    raise KeyError(fqn)


@pytest.mark.parametrize("where", ["tensor_bytes", "zip_header"])
def test_a_damaged_item_never_reaches_its_state(tmp_path: Path, where: str) -> None:
    """Verified as it is read: a weight whose bytes were changed is not copied into the model
    (it keeps the values it had), and the error names the byte range. Damage to the tensor's
    own bytes parses fine (only the checksum sees it); zeros at the item's start break the
    zip structure DCP parses first, and the checksum still names the cause."""
    import io

    config, _, newest = _two_checkpoints(tmp_path)
    config.checkpoint.load_step = 10
    name, offset, length = _item(newest, "model.2.weight")
    data = bytearray((newest / name).read_bytes())
    if where == "tensor_bytes":
        saved = torch.load(io.BytesIO(bytes(data[offset : offset + length])), weights_only=True)
        at = bytes(data).index(saved.numpy().tobytes(), offset)
        data[at + 3] ^= 0x40  # the exponent of the first value
    else:
        data[offset : offset + 64] = bytes(64)
    (newest / name).write_bytes(bytes(data))
    fresh = Run(config, seed=1)
    before = fresh.model[2].weight.detach().clone()
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"{name} \(written by rank 0\), bytes \[{offset}, {offset + length}\) fails its "
        "checksum",
    ):
        fresh.checkpointer.load()
    assert torch.equal(fresh.model[2].weight, before)
    assert fresh.train_state.step == 0  # nothing but verified tensors was applied


@pytest.mark.parametrize(("fqn", "saved"), [("train_state.step", 10), ("dataloader.position", 30)])
def test_a_damaged_bytes_item_is_rejected_like_a_damaged_tensor(
    tmp_path: Path, fqn: str, saved: int, warnings_logged: pytest.LogCaptureFixture
) -> None:
    """A value that is not a tensor (the train state's step, the data position) is an item of
    pickled bytes, which DCP reads through a path of its own. A flipped bit in the pickled
    number still parses, as another number (10 -> 11): only its checksum sees it. The load
    takes the older checkpoint, warning with the item's byte range; asked for by
    ``checkpoint.load_step`` the run stops, and the damaged value never reaches its state."""
    import io
    import pickle

    config, older, newest = _two_checkpoints(tmp_path)
    name, offset, length = _item(newest, fqn)
    data = bytearray((newest / name).read_bytes())
    # torch.save's pickle (protocol 2) of a small int: b"\x80\x02K" + one byte + b".".
    at = bytes(data).index(pickle.dumps(saved, protocol=2), offset, offset + length)
    data[at + 3] ^= 0x01
    item = bytes(data[offset : offset + length])
    assert torch.load(io.BytesIO(item), weights_only=False) == saved ^ 0x01  # parses fine
    (newest / name).write_bytes(bytes(data))
    where = rf"{name} \(written by rank 0\), bytes \[{offset}, {offset + length}\) fails"

    fresh = Run(config, seed=1)
    assert fresh.checkpointer.load() == 5
    _assert_same(fresh.snapshot(), older)
    warned = [r.getMessage() for r in warnings_logged.records]
    assert any(f"checkpoint {newest}:" in m and "fails its checksum" in m for m in warned), warned

    config.checkpoint.load_step = 10
    stopped = Run(config, seed=1)
    with pytest.raises(CorruptCheckpointError, match=where):
        stopped.checkpointer.load()
    assert stopped.train_state.step == 0 and stopped.data.position == 0


def test_an_item_damaged_after_the_size_check_is_caught_as_read(tmp_path: Path) -> None:
    """The sizes pass verify(); the flipped byte inside the item is caught by the reader, and
    the run takes the older checkpoint."""
    from torchtitan.components import checksums

    config, older, newest = _two_checkpoints(tmp_path)
    name, offset, length = _item(newest, "model.0.weight")
    _flip(newest / name, offset + length - 10)
    assert checksums.verify(newest) is None
    fresh = Run(config, seed=1)
    assert fresh.checkpointer.load() == 5
    _assert_same(fresh.snapshot(), older)


def test_a_manifest_of_the_first_format_is_still_verified(tmp_path: Path) -> None:
    """One digest per file and no items (written before items had their own): hashed whole
    before the load."""
    import json

    from torchtitan.components import checksums

    config, _, newest = _two_checkpoints(tmp_path)
    manifest = json.loads((newest / "checksums.json").read_text())
    files = {}
    for name in manifest["files"]:
        digest, size = checksums.file_digest(newest / name)
        files[name] = {"xxh3_64": digest, "bytes": size, "rank": 0}
    (newest / "checksums.json").write_text(json.dumps({"algorithm": "xxh3_64", "files": files}))
    assert type(checksums.reader(newest)).__name__ == "FileSystemReader"
    assert Run(config, seed=1).checkpointer.load() == 10
    _zero_middle(newest / "__0_0.distcp")
    problem = checksums.verify(newest)
    assert problem is not None and "__0_0.distcp (written by rank 0) fails its checksum" in problem


def _save_and_load_with_threads(folder: Path, tensors: dict[str, torch.Tensor], threads: int):
    """Save ``tensors`` with DCP's writer spread over ``threads`` files, as the checkpoint
    manager would (manifest last), then load them into zeros through the verifying reader."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.components import checksums

    checksums.begin(folder)
    writer = checksums.ChecksummingWriter(folder, thread_count=threads)
    dcp.save(dict(tensors), storage_writer=writer)
    checksums.write_manifest(folder, writer.written)
    assert checksums.verify(folder) is None
    loaded = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(loaded, storage_reader=checksums.reader(folder))
    return loaded


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_rank_with_fewer_items_than_files_writes_empty_files_that_the_manifest_lists(
    tmp_path: Path,
) -> None:
    tensors = {"a": torch.arange(4.0), "b": torch.ones(3)}
    loaded = _save_and_load_with_threads(tmp_path / "ckpt", tensors, threads=4)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert any(p.stat().st_size == 0 for p in (tmp_path / "ckpt").glob("*.distcp"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_load_of_many_files_holds_one_open_at_a_time(tmp_path: Path) -> None:
    """A rank that reads many ranks' files (a 1024-rank checkpoint loaded on one process)
    must not hold a descriptor per file: with room for only a few more descriptors than are
    open now, a load of 16 files works."""
    import resource

    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(16)}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    import torch.distributed.checkpoint as dcp  # noqa: F401  (imported before the limit)

    try:
        _save_and_load_with_threads(tmp_path / "warm", tensors, threads=16)  # imports done
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 12, hard))
        loaded = _save_and_load_with_threads(tmp_path / "ckpt", tensors, threads=16)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) == 16
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_manifest_of_a_newer_format_is_refused_in_one_line(tmp_path: Path) -> None:
    import json

    from torchtitan.components import checksums

    _, _, newest = _two_checkpoints(tmp_path)
    manifest = json.loads((newest / "checksums.json").read_text())
    (newest / "checksums.json").write_text(json.dumps({**manifest, "format": 99}))
    problem = checksums.verify(newest)
    assert problem is not None and "has format 99, newer than this version reads" in problem


def test_a_checkpoint_folder_may_be_an_absolute_path_per_replica_group(tmp_path: Path) -> None:
    """``checkpoint.folder`` relative to the dump folder, or absolute (storage local to a
    group's region, where a restart reads its own checkpoint to replay from); each
    fault-tolerant replica group has its own folder in it."""
    from torchtitan.components.checkpoint import checkpoint_folder

    config = _config(tmp_path / "dump")
    assert checkpoint_folder(config) == tmp_path / "dump" / "checkpoint"
    config = _config(tmp_path / "dump", folder=str(tmp_path / "region_a"))
    config.fault_tolerance.enable = True
    config.fault_tolerance.replica_id = 3
    assert checkpoint_folder(config) == tmp_path / "region_a" / "replica_3"


def test_a_counted_step_moves_the_step_and_the_tokens_seen() -> None:
    state = TrainState()
    state.count_step(12)
    state.count_step()  # a step on no tokens of this rank's (a group joining at a sync point)
    assert state.state_dict() == {"step": 2, "tokens_seen": 12}
