"""Healing without the WAN: a joiner replays the committed averages it missed onto its own
checkpoint.

From a checkpoint at sync ``s`` to the job's sync ``S`` the global parameters changed only by
the outer steps of syncs ``s+1 .. S``, each taking one average (the bytes every group decoded,
or the fp32 average). A peer keeps the last ``fault_tolerance.heal_history_syncs`` of them
(:class:`HealHistory`, CPU memory, this rank's shards). The joiner sends what it holds
(:class:`ReplayBasis`), the peer the missing entries if it can (:func:`plan_replay`), over
torchft's checkpoint transport; the joiner redoes the outer steps in order
(:func:`replay`), the same operations on the same values, so its global copies and outer
momentum end bit for bit equal to the peer's. Otherwise it heals in full, and says why.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.transport.collective import Delivered
from torchtitan.tools.digest import chunk_hashes, fold_digest
from torchtitan.tools.exact_division import divide_

#: Slots of a :class:`ReplayBasis` on the wire (int64): a version, the sync, the fingerprint,
#: the number of fragments, then one digest per fragment.
BASIS_SLOTS = 64
_BASIS_VERSION = 0x5EA1_0001


def job_fingerprint(parts: Iterable[str]) -> int:
    """Signed 64-bit fingerprint of the method's settings and the parameters' names and shapes:
    what makes two groups' checkpoints the same job's."""
    digest = hashlib.blake2b("\n".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _payload_digest(transfers: Iterable[Delivered], taken: bool = True) -> int:
    """Digest of the payloads; ``taken``: from the hashes taken when kept (``Delivered.kept``)
    where present, else from the bytes now."""
    return fold_digest(
        h
        for t in transfers
        for h in (t.hashes if taken and t.hashes is not None else chunk_hashes(t.payload))
    )


@dataclass(frozen=True)
class HistoryEntry:
    """One committed sync of one fragment, as every group applied it."""

    #: The Manager's step after this sync committed (syncs are numbered from 1).
    sync: int
    fragment: int
    #: The sync's transfers' results, in order: the fragment's averaged pseudo-gradient, flat.
    transfers: tuple[Delivered, ...]
    #: A digest of the fragment's global copy before this sync's outer step (this rank's shards).
    basis_digest: int
    #: A digest of the payloads, taken when the entry was recorded.
    checksum: int
    #: What the outer step divides the delivered values by (async DiLoCo: the groups' tokens).
    scale: float = 1.0

    @classmethod
    def of(
        cls,
        sync: int,
        fragment: int,
        transfers: Iterable[Delivered],
        basis_digest: int,
        scale: float = 1.0,
    ) -> HistoryEntry:
        kept = tuple(transfers)
        return cls(sync, fragment, kept, basis_digest, _payload_digest(kept), scale)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def intact(self) -> bool:
        """Whether the payloads still match their checksum."""
        return _payload_digest(self.transfers, taken=False) == self.checksum

    def average(self, device: torch.device | None = None) -> torch.Tensor:
        """The fragment's averaged pseudo-gradient, flat fp32: the delivered values divided by
        ``scale``, the outer step's own operations, so the same bits."""
        values = [t.values(device) for t in self.transfers]
        if not values:
            return torch.zeros(0, dtype=torch.float32, device=device)
        flat = torch.cat(values) if len(values) > 1 else values[0]
        if self.scale != 1.0:
            divide_(flat, self.scale)
        return flat

    # Wire form: a description in plain containers (torchft sends it with the state), then the
    # payloads one by one, so that a joiner replays one while the next is on the wire.
    def to_wire(self) -> dict[str, Any]:
        return {
            "sync": self.sync,
            "fragment": self.fragment,
            "basis_digest": self.basis_digest,
            "checksum": self.checksum,
            "scale": self.scale,
            "transfers": [
                {
                    "dtype": t.dtype,
                    "numel": t.numel,
                    "world_size": t.world_size,
                    "divide_by": t.divide_by,
                    "payload_numel": t.payload.numel(),
                    "payload_dtype": str(t.payload.dtype).removeprefix("torch."),
                }
                for t in self.transfers
            ],
        }

    def payloads(self) -> list[torch.Tensor]:
        """The transfers' payloads, in the order :meth:`from_wire` takes them."""
        return [t.payload.reshape(-1) for t in self.transfers]

    @staticmethod
    def payload_specs(value: dict[str, Any]) -> list[tuple[int, torch.dtype]]:
        """The size and dtype of each payload of an entry's wire form, in order."""
        return [
            (int(t["payload_numel"]), getattr(torch, t["payload_dtype"]))
            for t in value["transfers"]
        ]

    @classmethod
    def from_wire(cls, value: dict[str, Any], payloads: Iterator[torch.Tensor]) -> HistoryEntry:
        """The entry back from its wire form, taking its payloads from ``payloads``."""
        transfers = []
        for t, (numel, dtype) in zip(value["transfers"], cls.payload_specs(value), strict=True):
            payload = next(payloads).to("cpu")
            if payload.numel() != numel or payload.dtype != dtype:
                raise ValueError(
                    f"a payload of sync #{value['sync']} has {payload.numel()} {payload.dtype} "
                    f"values, its description {numel} {dtype}"
                )
            transfers.append(
                Delivered(
                    t["dtype"], int(t["numel"]), int(t["world_size"]), t["divide_by"], payload
                )
            )
        return cls(
            int(value["sync"]),
            int(value["fragment"]),
            tuple(transfers),
            int(value["basis_digest"]),
            int(value["checksum"]),
            float(value["scale"]),
        )


class HealHistory:
    """The last ``capacity`` committed syncs, in order and without gaps: a sync that is not the
    next one restarts the history (the earlier ones cannot be replayed up to it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: deque[HistoryEntry] = deque(maxlen=max(capacity, 1))
        self._full_said = False

    def __len__(self) -> int:
        return len(self._entries) if self.capacity > 0 else 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    @property
    def first_sync(self) -> int | None:
        return self._entries[0].sync if len(self) else None

    def record(self, entry: HistoryEntry) -> None:
        if self.capacity <= 0:
            return
        if self._entries and entry.sync != self._entries[-1].sync + 1:
            self._entries.clear()
        self._entries.append(entry)
        if not self._full_said and len(self) == self.capacity:
            self._full_said = True
            events.HEAL_HISTORY_KEPT.emit(syncs=len(self), mib=self.nbytes / 2**20)

    def clear(self) -> None:
        """This group's state no longer follows from its history (it healed in full)."""
        self._entries.clear()

    def after(self, sync: int) -> list[HistoryEntry]:
        """The entries of syncs after ``sync``, in order."""
        return [e for e in self._entries if e.sync > sync] if self.capacity > 0 else []


@dataclass(frozen=True)
class ReplayBasis:
    """What a joiner's checkpoint holds: its sync, the job's fingerprint and each fragment's
    global-copy digest (this rank's shards). ``sync`` -1: nothing to replay onto."""

    sync: int
    fingerprint: int = 0
    digests: tuple[int, ...] = ()

    @classmethod
    def none(cls) -> ReplayBasis:
        return cls(-1)

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        slots = [_BASIS_VERSION, self.sync, self.fingerprint, len(self.digests), *self.digests]
        if len(slots) > BASIS_SLOTS:  # more fragments than the wire holds: no replay
            slots = [_BASIS_VERSION, -1, 0, 0]
        out = torch.zeros(BASIS_SLOTS, dtype=torch.int64, device=device)
        out[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
        return out

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ReplayBasis:
        values = [int(v) for v in t.cpu().tolist()]
        if values[0] != _BASIS_VERSION:
            return cls.none()
        count = values[3]
        return cls(values[1], values[2], tuple(values[4 : 4 + count]))


@dataclass(frozen=True)
class ReplayPlan:
    """A peer's answer: the entries to replay, or why the joiner heals in full."""

    entries: list[HistoryEntry] | None
    why_full: str = ""


def plan_replay(
    history: HealHistory,
    basis: ReplayBasis,
    job_sync: int,
    fingerprint: int,
    current_digests: Callable[[], list[int]],
) -> ReplayPlan:
    """What this peer (at ``job_sync``) can send a joiner with ``basis``; ``current_digests``:
    this rank's digest of each fragment's global copy now. Anything that cannot be replayed
    exactly answers a full heal, with a one-line reason."""

    def full(why: str) -> ReplayPlan:
        return ReplayPlan(None, why)

    if basis.sync < 0:
        return full("it has no checkpoint of its own to replay onto")
    if history.capacity <= 0:
        return full("the peer keeps no heal history (fault_tolerance.heal_history_syncs=0)")
    if basis.fingerprint != fingerprint:
        return full(
            "it does not run the job's settings or model (the method's settings or the "
            "model's parameters differ from the peer's)"
        )
    if basis.sync > job_sync:
        return full(f"its checkpoint (sync #{basis.sync}) is ahead of the job (#{job_sync})")
    missed = job_sync - basis.sync
    if missed > history.capacity:
        return full(
            f"it is {missed} syncs behind and the peer keeps {history.capacity} "
            "(fault_tolerance.heal_history_syncs)"
        )
    entries = history.after(basis.sync)
    if [e.sync for e in entries] != list(range(basis.sync + 1, job_sync + 1)):
        first = history.first_sync
        return full(
            f"the peer's history does not reach back to sync #{basis.sync + 1} "
            + (f"(it starts at #{first}" if first is not None else "(it is empty")
            + ": the peer restarted or healed since)"
        )
    for entry in entries:
        if not entry.intact():
            return full(f"the peer's history entry of sync #{entry.sync} fails its checksum")
    digests = current_digests()
    if len(basis.digests) != len(digests):
        return full("its checkpoint has another number of fragments")
    expected = list(digests)
    for entry in reversed(entries):  # the earliest entry of a fragment holds its basis
        expected[entry.fragment] = entry.basis_digest
    for fragment, (mine, theirs) in enumerate(zip(expected, basis.digests, strict=True)):
        if mine != theirs:
            return full(
                f"its global parameters of fragment {fragment} at sync #{basis.sync} differ "
                "from the job's (a checkpoint of another run, or damaged)"
            )
    return ReplayPlan(entries)


def replay(
    entries: Iterable[HistoryEntry],
    outer_steps: Callable[[Iterable[tuple[int, torch.Tensor]]], None],
    device_of: Callable[[int], torch.device],
) -> int:
    """Redo the outer steps of ``entries`` in order through the method's ``outer_steps``, given
    ``(fragment, average)`` pairs decoded one at a time as reached (``entries`` may still be
    arriving) on ``device_of(fragment)``, where the groups divided it (CUDA and the CPU round a
    division apart). Entries of ``scale`` 0 (no tokens) are skipped. Returns the entries' bytes."""
    held = 0

    def steps() -> Iterator[tuple[int, torch.Tensor]]:
        nonlocal held
        for entry in entries:
            held += entry.nbytes
            if entry.scale != 0:
                yield entry.fragment, entry.average(device_of(entry.fragment))

    outer_steps(steps())
    return held
