"""Checksums of a checkpoint: written with every save, verified on every load.

``torch.distributed.checkpoint`` keeps no checksums: a tensor's bytes can rot on disk, or be cut
short by a copy between clusters, and load without a word as different numbers. So each rank
records an XXH3-64 digest (a fast non-cryptographic hash) of every item it wrote (one tensor or
one blob of bytes: a byte range of one of its files), right after writing it
(:class:`ChecksummingWriter`). After the save, rank 0 adds the digest of DCP's ``.metadata``
and writes them all, with each file's size, to ``checksums.json`` (:func:`write_manifest`), the
last file of a save: a folder counts as a complete checkpoint only once it is there. A save
starts by creating ``.checksums-expected``, so a folder that has ``.metadata`` but not
``checksums.json`` is a save that died part-way, whereas one with neither marker was written
before checksums existed (loaded unverified, with a note).

A load is checked in two steps. :func:`verify`, before DCP opens anything, reads the manifest,
hashes ``.metadata`` and checks that every file is there with its size (split over the ranks;
all get the same answer). Then :class:`VerifyingReader` hashes every item right after DCP read
it, from the pages that read brought into the page cache, and before DCP copies it into a
state: no value reaches a state before it is verified, and the files are read from disk once.
A mismatch stops the load with :class:`ItemChecksumError`; a state may then hold some verified
values of the bad checkpoint, which the caller overwrites (an older checkpoint, a heal) or
stops on.

What is detected: any change of the bytes that a load reads (a flipped bit, a block of zeros),
a file cut short, grown or missing, a damaged or missing ``checksums.json``. What is not: damage
that happened in memory before the file was written, a checkpoint folder replaced by another
complete one, and damage to items that a load skips (``checkpoint.exclude_from_loading``).
Manifests of the first format (one digest per file, no items) are still read: their files are
hashed whole by :func:`verify`.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

#: The list of checksums, written last: a checksummed save is complete once it exists.
MANIFEST = "checksums.json"
#: Created first: this save writes a manifest (without one it is not complete).
EXPECTED = ".checksums-expected"
METADATA = ".metadata"
#: 2: a digest per item (byte range) of each data file; 1 (no ``format`` key): one per file.
FORMAT = 2


class ItemChecksumError(ValueError):
    """An item that a load read does not match its checksum (the message names the folder,
    the file, the byte range and the rank that wrote it)."""


class ManifestFormatError(ValueError):
    """A manifest written by a newer version, in a format this one does not read."""


def _digest(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(data)


@contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """The bytes of a file, mapped, not copied (empty for an empty file)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()


def file_digest(path: Path) -> tuple[int, int]:
    """(XXH3-64 digest, size in bytes) of a whole file, hashed in place."""
    with _mapped(path) as data:
        return _digest(data), len(data)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


#: What a rank records of one data file it wrote: {"bytes": size, "items": {offset: [length,
#: digest]}} (offsets are strings, as JSON keys are).
FileEntry = dict[str, Any]


class ChecksummingWriter(FileSystemWriter):
    """DCP's file-system writer that also checksums, right after writing them, the items this
    rank wrote (``written``: file name -> its :data:`FileEntry`). The files are still in the
    page cache then, so this reads no disk."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        super().__init__(path, **options)  # FileSystemWriter's (thread_count, ...)
        self.folder = Path(path)
        self.written: dict[str, FileEntry] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        # Each result says where its item went: DCP's storage info for the file system, with
        # the file's name and the item's byte range in it.
        ranges: dict[str, list[tuple[int, int]]] = {}
        for result in future.wait():
            where = result.storage_data
            ranges.setdefault(where.relative_path, []).append((where.offset, where.length))
        self.written = {}
        for name in sorted(ranges):
            with _mapped(self.folder / name) as data:
                items = {
                    str(offset): [length, _digest(data[offset : offset + length])]
                    for offset, length in sorted(ranges[name])
                }
                self.written[name] = {"bytes": len(data), "items": items}
        return future


def begin(folder: Path) -> None:
    """Mark ``folder`` as a save that will have a manifest (rank 0, before the data)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXPECTED).touch()


def write_manifest(folder: Path, written: dict[str, FileEntry]) -> None:
    """Gather every rank's checksums and, on rank 0, write the manifest (with ``.metadata``'s)
    atomically: the save is complete from here on. Every rank calls it."""
    rank = _rank()
    mine = {name: {**entry, "rank": rank} for name, entry in written.items()}
    gathered: list[Any] = [None] * _world()
    if _world() > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return
    files: dict[str, dict[str, Any]] = {}
    for part in gathered:
        files.update(part)
    digest, size = file_digest(folder / METADATA)
    files[METADATA] = {"xxh3_64": digest, "bytes": size, "rank": 0}
    for path in folder.glob("__*_*.distcp"):
        # A rank (or a writer thread) with nothing to write still creates its file, empty.
        writer = path.name[2:].split("_", 1)[0]
        if path.name not in files and path.stat().st_size == 0 and writer.isdigit():
            files[path.name] = {"bytes": 0, "items": {}, "rank": int(writer)}
    unlisted = sorted(
        p.name for p in folder.iterdir() if p.name not in files and p.name not in (EXPECTED,)
    )
    if unlisted:
        raise RuntimeError(f"files of no rank's save in {folder}: {', '.join(unlisted)}")
    tmp = folder / f"{MANIFEST}.tmp"
    manifest = {"format": FORMAT, "algorithm": "xxh3_64", "files": files}
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def state(folder: Path) -> str:
    """``"checksummed"`` (complete, with a manifest), ``"pending"`` (a checksummed save that
    did not finish), or ``"legacy"`` (written before checksums: nothing to verify)."""
    if (folder / MANIFEST).is_file():
        return "checksummed"
    return "pending" if (folder / EXPECTED).exists() else "legacy"


def _writer(entry: dict[str, Any]) -> str:
    return f"written by rank {entry.get('rank', '?')}"


def _check(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    """What is wrong with one listed file, before a load: missing, another size, or (for
    ``.metadata`` and files of a format-1 manifest) another digest."""
    path = folder / name
    if not path.is_file():
        return f"{name} ({_writer(entry)}) is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{name} ({_writer(entry)}) has {size} bytes, {entry['bytes']} were written"
    if "items" in entry:
        return None  # verified item by item as it is read (VerifyingReader)
    digest, _ = file_digest(path)
    if digest != entry["xxh3_64"]:
        return (
            f"{name} ({_writer(entry)}) fails its checksum (xxh3_64 {digest:016x}, "
            f"{entry['xxh3_64']:016x} was written)"
        )
    return None


def read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's files (name -> entry); raises OSError or ValueError when unreadable."""
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format", 1) > FORMAT:
        raise ManifestFormatError(
            f"{MANIFEST} has format {manifest['format']}, newer than this version reads "
            f"({FORMAT}): load it with the version that wrote it"
        )
    files = manifest["files"]
    if not isinstance(files, dict):
        raise ValueError(f"'files' is a {type(files).__name__}, not a mapping")
    return files


def verify(folder: Path) -> str | None:
    """None when the checkpoint in ``folder`` may be loaded, else one line naming the folder,
    the first bad file and its rank: the manifest is readable, ``.metadata`` matches its digest
    and every file is there with the size it was written with. The items themselves are
    verified as they are read (:class:`VerifyingReader`). Every rank calls it and all get the
    same answer. A checkpoint without a manifest (``state`` ``"legacy"``) passes: there is
    nothing to check."""
    if state(folder) == "legacy":
        return None
    problem: str | None = None
    try:
        files = read_manifest(folder)
    except ManifestFormatError as e:
        problem = str(e)
        files = {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
        files = {}
    mine: list[str] = []
    for index, name in enumerate(sorted(files)):
        if index % _world() == _rank() and problem is None:
            try:
                found = _check(folder, name, files[name])
            except (KeyError, TypeError) as e:
                found = f"{MANIFEST} has a malformed entry for {name} ({type(e).__name__}: {e})"
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


def reader(folder: Path) -> FileSystemReader:
    """The reader a load of ``folder`` uses: one that verifies each item as it is read when
    the manifest lists items (:func:`verify` hashed a format-1 manifest's files whole)."""
    if state(folder) == "checksummed":
        files = read_manifest(folder)
        if all("items" in entry for name, entry in files.items() if name != METADATA):
            return VerifyingReader(folder, files)
    return FileSystemReader(folder)


class _HeldBackPlanner:
    """The planner DCP's read loop is given: it hands an item's bytes or tensor on to the real
    planner only once the item's checksum matched."""

    def __init__(self, planner: LoadPlanner, reader: VerifyingReader) -> None:
        self.planner = planner
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.reader.check(read_item)
        self.planner.load_bytes(read_item, value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self.reader.check(read_item)
        return self.planner.resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.planner.commit_tensor(read_item, tensor)


class VerifyingReader(FileSystemReader):
    """DCP's file-system reader that verifies every item it reads against ``files`` (the
    manifest's entries) before DCP hands it to a state; raises :class:`ItemChecksumError`.

    DCP calls :meth:`check` for each item right after reading its bytes and before copying
    them into the state. The digest is computed there, over the file's pages that DCP's read
    has just brought into the page cache: the disk is read once, and the check costs the hash
    alone, on a cold cache as on a warm one."""

    def __init__(self, path: str | os.PathLike[str], files: dict[str, dict[str, Any]]) -> None:
        super().__init__(path)
        self.folder = Path(path)
        self.files = files
        self._views: dict[str, memoryview] = {}

    def _where(self, read_item: ReadItem) -> tuple[str, int, int]:
        # DCP's storage info for the file system: the file and the item's byte range in it.
        where = self.storage_data[read_item.storage_index]
        return where.relative_path, where.offset, where.length

    def check(self, read_item: ReadItem) -> None:
        """Raise :class:`ItemChecksumError` unless the bytes of ``read_item`` match."""
        name, offset, length = self._where(read_item)
        entry = self.files.get(name) or {}
        items = entry.get("items")
        written = items.get(str(offset)) if isinstance(items, dict) else None
        where = f"{name} ({_writer(entry)}), bytes [{offset}, {offset + length})"
        if written is None or written[0] != length:
            raise ItemChecksumError(
                f"checkpoint {self.folder}: {where}: no such item in {MANIFEST}"
            )
        data = self._view(name)
        if offset + length > len(data):
            raise ItemChecksumError(
                f"checkpoint {self.folder}: {where}: the file has {len(data)} bytes"
            )
        digest = _digest(data[offset : offset + length])
        if digest != written[1]:
            raise ItemChecksumError(
                f"checkpoint {self.folder}: {where} fails its checksum (xxh3_64 {digest:016x}, "
                f"{written[1]:016x} was written)"
            )

    def _view(self, name: str) -> memoryview:
        """The file mapped; one file at a time (DCP reads file by file), so that a rank that
        reads many ranks' files holds one descriptor, not one per file."""
        view = self._views.get(name)
        if view is None:
            self._release_views()
            with open(self.folder / name, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    view = memoryview(b"")
                else:
                    view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            self._views[name] = view
        return view

    def _release_views(self) -> None:
        views, self._views = self._views, {}
        for view in views.values():
            view.release()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            # Duck-typed: DCP's read loop calls only the three methods _HeldBackPlanner has.
            held_back = cast(LoadPlanner, _HeldBackPlanner(planner, self))
            return super().read_data(plan, held_back)
        except ItemChecksumError:
            raise
        except Exception as e:
            # Damaged bytes can fail DCP's own parse of an item before check() sees it: the
            # checksums say plainly what is wrong, when they do.
            for read_item in plan.items:
                self.check(read_item)
            raise e
        finally:
            self._release_views()
