"""Error feedback: what this rank's compression dropped, owed to the fragment's next sync.

The quantization error is delivered later instead of lost. A residual covers the first
(per-rank) encoding only; the re-encoding of a reduced chunk is shared by all ranks and not fed
back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ResidualKey(NamedTuple):
    """Where a transfer's values sit: its fragment, and the offset of its first value among
    the fragment's local values (a sync's transfers cover its fragment once, in order)."""

    fragment: int
    offset: int


#: The key of a lone transfer (a fragment's only one, e.g. in a test).
FIRST = ResidualKey(0, 0)


class Residuals:
    """This rank's error-feedback residuals: per fragment, segments of its flat local values.

    A transfer at ``key`` adds what is owed over its values first (:meth:`correct_`); its
    encode writes what it drops into :meth:`buffer`, which the collective then stages
    (:meth:`stage`). Residuals are training state: without them a restarted rank drops the
    error it owes.

    Failure semantics: a residual changes only when its sync commits. :meth:`commit` makes what
    the sync staged owed, a fragment at a time (a committed sync carried every transfer of its
    fragment); :meth:`discard` drops it, and what was owed before stays owed, so a sync that
    fails anywhere leaves no trace.

    A checkpoint holds a fragment's residuals as one flat fp32 tensor of its size
    (:meth:`flat`), whatever the buckets; :meth:`load` owes it again as one segment, which the
    transfers read in slices. What an undecided sync staged is checkpointed apart (``staged``)
    and owed only if that sync then commits.

    On the CPU a replaced residual is the next buffer of its key (a fresh model-sized buffer
    costs more in page faults than the arithmetic). ``decay`` (SparseLoCo's beta, arXiv
    2508.15706) multiplies the residual before it is added back (1: classic error feedback).
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        #: What each fragment owes: offset of a segment -> its residual (flat).
        self._owed: dict[int, dict[int, torch.Tensor]] = {}
        #: What the sync being decided staged, as ``_owed``.
        self._staged: dict[int, dict[int, torch.Tensor]] = {}
        #: Fragments whose staged residuals a checkpoint loaded (their sync is still undecided).
        self._staged_by_checkpoint: set[int] = set()
        #: Replaced CPU residuals, to compute the next ones of their key in.
        self._spares: dict[ResidualKey, torch.Tensor] = {}

    def owed(self, key: ResidualKey, numel: int) -> torch.Tensor | None:
        """The residual owed over the ``numel`` values at ``key`` (not copied), or None when
        its fragment owes nothing. Raises ValueError when the fragment owes residuals that do
        not cover them (a checkpoint's, written with other shards)."""
        segments = self._owed.get(key.fragment)
        if not segments:
            return None
        own = segments.get(key.offset)  # this transfer's, from a sync since the last load
        if own is not None and own.numel() == numel:
            return own
        loaded = segments.get(0)  # a checkpoint's, read a transfer at a time
        if loaded is not None and key.offset + numel <= loaded.numel():
            return loaded[key.offset : key.offset + numel]
        held = sum(residual.numel() for residual in segments.values())
        raise ValueError(
            f"error feedback: fragment {key.fragment} owes residuals of {held} values, none "
            f"covering the {numel} values at offset {key.offset}: were they checkpointed with "
            "other shards?"
        )

    def correct_(self, key: ResidualKey, x: torch.Tensor) -> torch.Tensor:
        """``x += decay * residual`` in place over the flat ``x`` at ``key``; returns ``x``.
        The residual stays owed until the sync that sent ``x`` commits."""
        residual = self.owed(key, x.numel())
        if residual is None:
            return x
        # The residual may come from a checkpoint loaded on another device.
        residual = residual.to(device=x.device, dtype=x.dtype)
        if self.decay == 1:
            return x.add_(residual)
        # Two roundings (multiply, then add), the same on every device: no fused multiply-add.
        return x.add_(residual * self.decay)

    def buffer(self, key: ResidualKey, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``like`` (contents undefined) to compute the residual of
        ``key`` in: the CPU residual of ``key`` last replaced, or a new one."""
        spare = self._spares.pop(key, None)
        if (
            spare is not None
            and spare.shape == like.shape
            and spare.dtype == like.dtype
            and spare.device == like.device
        ):
            return spare
        return torch.empty_like(like)

    def stage(self, key: ResidualKey, residual: torch.Tensor) -> None:
        """The residual at ``key`` left by an encode of the sync being decided: owed once
        :meth:`commit` says the sync committed."""
        if key.fragment in self._staged_by_checkpoint:  # that sync is void: a newer one runs
            self._staged_by_checkpoint.discard(key.fragment)
            self._retire(key.fragment, self._staged.pop(key.fragment, {}))
        self._staged.setdefault(key.fragment, {})[key.offset] = residual

    def commit(self) -> None:
        """The sync committed: what it staged (or a checkpoint loaded as staged) is owed, in
        place of what its fragment owed."""
        for fragment, staged in self._staged.items():
            self._retire(fragment, self._owed.get(fragment, {}))
            self._owed[fragment] = staged
        self._staged = {}
        self._staged_by_checkpoint.clear()

    def discard(self, loaded: bool = True) -> None:
        """The sync did not commit (or was never decided): what was owed before stays owed.
        ``loaded``: also drop what a checkpoint loaded as staged (False: keep it for the
        verdict of the sync it belongs to)."""
        for fragment in list(self._staged):
            if loaded or fragment not in self._staged_by_checkpoint:
                self._retire(fragment, self._staged.pop(fragment))
        if loaded:
            self._staged_by_checkpoint.clear()

    def _retire(self, fragment: int, segments: dict[int, torch.Tensor]) -> None:
        for offset, residual in segments.items():
            if residual.device.type == "cpu":
                self._spares[ResidualKey(fragment, offset)] = residual

    def reset(self) -> None:
        """Owe nothing, loaded residuals included (after a heal: they belong to state this
        group no longer has)."""
        self._owed.clear()
        self._staged.clear()
        self._staged_by_checkpoint.clear()
        self._spares.clear()

    def has_staged(self, fragment: int) -> bool:
        """Whether the undecided sync of ``fragment`` left residuals."""
        return bool(self._staged.get(fragment))

    def segments(self, fragment: int, staged: bool = False) -> dict[int, torch.Tensor]:
        """What ``fragment`` owes by offset, not copied: a residual per transfer that left one,
        or the one a checkpoint loaded. ``staged``: what its undecided sync staged."""
        return dict((self._staged if staged else self._owed).get(fragment, {}))

    def flat(self, fragment: int, numel: int, staged: bool = False) -> torch.Tensor:
        """The residuals of ``fragment`` as one flat fp32 CPU tensor of ``numel`` values (its
        local parameters); zeros where it owes nothing (before its first compressed sync, or
        right after a heal). ``staged``: those the undecided sync of ``fragment`` leaves if it
        commits (:meth:`has_staged`)."""
        out = torch.zeros(numel, dtype=torch.float32)
        for start, residual in self.segments(fragment, staged).items():
            if start + residual.numel() > numel:
                raise ValueError(
                    f"error feedback: fragment {fragment}'s residuals hold more than its "
                    f"{numel} parameter values (a segment at offset {start})"
                )
            out[start : start + residual.numel()] = residual.reshape(-1).cpu()
        return out

    def load(self, fragment: int, flat: torch.Tensor, staged: bool = False) -> None:
        """Owe ``flat`` (from :meth:`flat`) again, in place of what ``fragment`` owed.
        ``staged``: what the undecided sync of ``fragment`` leaves if it commits (owed from
        :meth:`commit` on)."""
        segments = {0: flat.detach().reshape(-1).clone()}
        if staged:
            self._staged[fragment] = segments
            self._staged_by_checkpoint.add(fragment)
            return
        self._retire(fragment, self._owed.get(fragment, {}))
        self._owed[fragment] = segments
