"""Checksums of a checkpoint's files: written with every save, verified before every load.

``torch.distributed.checkpoint`` keeps no checksums: a tensor's bytes can rot on disk, or be cut
short by a copy between clusters, and load without a word as different numbers. So each rank
records an XXH3-64 digest (a fast non-cryptographic hash) of every file it wrote, right after
writing it (:class:`ChecksummingWriter`); after the save, rank 0 adds the digest of DCP's
``.metadata`` and writes them all to ``checksums.json`` (:func:`write_manifest`), the last file
of a save: a folder counts as a complete checkpoint only once it is there. A save starts by
creating ``.checksums-expected``, so a folder that has ``.metadata`` but not ``checksums.json``
is a save that died part-way, whereas one with neither marker was written before checksums
existed (loaded unverified, with a note). :func:`verify` reads every listed file again, split
over the ranks, and names the first mismatch: the folder, the file and the rank that wrote it.

What is detected: any change of a listed file's bytes (a flipped bit, a block of zeros), a file
cut short or grown, a file that is missing, a damaged or missing ``checksums.json``. What is not:
damage that happened in memory before the file was written, and a whole checkpoint folder
replaced by another complete one.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

#: The list of checksums, written last: a checksummed save is complete once it exists.
MANIFEST = "checksums.json"
#: Created first: this save writes a manifest (without one it is not complete).
EXPECTED = ".checksums-expected"
METADATA = ".metadata"


def file_digest(path: Path) -> tuple[int, int]:
    """(XXH3-64 digest, size in bytes) of a file, hashed in place (mapped, not copied): about
    5 ms per 56 MB when the file is in the page cache, as a file just written is."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return xxhash.xxh3_64_intdigest(b""), 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_64_intdigest(mapped), size


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ChecksummingWriter(FileSystemWriter):
    """DCP's file-system writer that also checksums, right after writing them, the files this
    rank wrote (``written``: file name -> (digest, bytes))."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.folder = Path(path)
        self.written: dict[str, tuple[int, int]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        results = future.wait()
        # Each result says where its item went (DCP's storage info for the file system).
        names = {result.storage_data.relative_path for result in results}
        self.written = {name: file_digest(self.folder / name) for name in sorted(names)}
        return future


def begin(folder: Path) -> None:
    """Mark ``folder`` as a save that will have a manifest (rank 0, before the data)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXPECTED).touch()


def write_manifest(folder: Path, written: dict[str, tuple[int, int]]) -> None:
    """Gather every rank's checksums and, on rank 0, write the manifest (with ``.metadata``'s)
    atomically: the save is complete from here on. Every rank calls it."""
    rank = _rank()
    mine = {name: (digest, size, rank) for name, (digest, size) in written.items()}
    gathered: list[Any] = [None] * _world()
    if _world() > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return
    files: dict[str, dict[str, int]] = {}
    for part in gathered:
        for name, (digest, size, writer) in part.items():
            files[name] = {"xxh3_64": digest, "bytes": size, "rank": writer}
    digest, size = file_digest(folder / METADATA)
    files[METADATA] = {"xxh3_64": digest, "bytes": size, "rank": 0}
    unlisted = sorted(
        p.name for p in folder.iterdir() if p.name not in files and p.name not in (EXPECTED,)
    )
    if unlisted:
        raise RuntimeError(f"files of no rank's save in {folder}: {', '.join(unlisted)}")
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"algorithm": "xxh3_64", "files": files}, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def state(folder: Path) -> str:
    """``"checksummed"`` (complete, with a manifest), ``"pending"`` (a checksummed save that
    did not finish), or ``"legacy"`` (written before checksums: nothing to verify)."""
    if (folder / MANIFEST).is_file():
        return "checksummed"
    return "pending" if (folder / EXPECTED).exists() else "legacy"


def _check(folder: Path, name: str, expected: dict[str, int]) -> str | None:
    path = folder / name
    writer = f"written by rank {expected['rank']}"
    if not path.is_file():
        return f"{name} ({writer}) is missing"
    digest, size = file_digest(path)
    if size != expected["bytes"]:
        return f"{name} ({writer}) has {size} bytes, {expected['bytes']} were written"
    if digest != expected["xxh3_64"]:
        return (
            f"{name} ({writer}) fails its checksum (xxh3_64 {digest:016x}, "
            f"{expected['xxh3_64']:016x} was written)"
        )
    return None


def verify(folder: Path) -> str | None:
    """None when every file of the checkpoint in ``folder`` matches its manifest, else one
    line naming the folder, the first bad file and its rank. The files are split over the
    ranks (every rank calls it, and all get the same answer). A checkpoint without a manifest
    (``state`` ``"legacy"``) passes: there is nothing to check."""
    if state(folder) == "legacy":
        return None
    problem: str | None = None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files: dict[str, dict[str, int]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
        files = {}
    mine: list[str] = []
    for index, name in enumerate(sorted(files)):
        if index % _world() == _rank() and problem is None:
            found = _check(folder, name, files[name])
            if found is not None:
                mine.append(found)
    if problem is not None:
        mine.append(problem)
    found_by_all = _all_gather(mine)
    return f"checkpoint {folder}: {found_by_all[0]}" if found_by_all else None


def _all_gather(items: list[str]) -> list[str]:
    if _world() == 1:
        return items
    gathered: list[Any] = [None] * _world()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]
