"""Error feedback: per key, what this rank's own compression dropped, owed to the next round.

The quantization error is delivered later instead of lost. A residual covers the first
(per-rank) encoding only; the re-encoding of a reduced chunk is shared by all ranks and not fed
back.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ResidualEncoder(Protocol):
    """What :meth:`ErrorFeedback.encode` needs of a codec (``codecs.Codec``)."""

    def wire_bytes(self, numel: int) -> int:
        """Bytes ``numel`` values take on the wire."""

    def encode_into(
        self, x: torch.Tensor, out: torch.Tensor, numel: int, *, residual: torch.Tensor | None
    ) -> None:
        """Encode ``x`` into ``out``, storing in ``residual`` what the encoding drops."""


class ErrorFeedback:
    """Per-key residual of this rank's own compression, added back before the next encoding.

    ``correct(key, x)`` returns ``x + residual``; the encode writes what it dropped
    (``Codec.encode_into(..., residual=)``) into ``residual_buffer(key, x)``. Residuals are
    training state (``state_dict``): without them a restarted rank drops the error it owes.

    Failure semantics: a residual changes only when its sync commits. The collective stages
    (:meth:`stage`) what its encode dropped; :meth:`commit` keeps it, :meth:`discard` drops it
    and the residual owed before stays owed, so a sync that fails anywhere leaves no trace.

    On the CPU a replaced residual is reused as the next round's buffer (a fresh model-sized
    buffer costs more in page faults than the arithmetic); it is not touched before then.

    A residual from elsewhere (a checkpoint) is owed from :meth:`owe` on. ``decay``
    (SparseLoCo's beta, arXiv 2508.15706) multiplies the residual before it is added back (1:
    classic error feedback).
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._residuals: dict[str, torch.Tensor] = {}
        #: Replaced CPU residuals, to compute the next ones in.
        self._spares: dict[str, torch.Tensor] = {}
        #: Residuals of the sync being decided, by key (from its encodes).
        self._staged: dict[str, torch.Tensor] = {}

    def correct(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """A new tensor ``x + decay * residual[key]`` (a copy of ``x`` if no residual yet)."""
        return self.correct_(key, x.clone())

    def correct_(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x += decay * residual[key]`` in place; returns ``x``. The residual stays owed until
        :meth:`set_residual` replaces it."""
        residual = self._owed(key, x)
        if residual is None:
            return x
        if self.decay == 1:
            return x.add_(residual)
        # Two roundings (multiply, then add), the same on every device: no fused multiply-add.
        return x.add_(residual * self.decay)

    def _owed(self, key: str, x: torch.Tensor) -> torch.Tensor | None:
        """The residual of ``key`` on ``x``'s device, or None."""
        residual = self._residuals.get(key)
        if residual is None:
            return None
        if residual.shape != x.shape:
            raise ValueError(
                f"error feedback {key!r}: residual has shape {tuple(residual.shape)}, "
                f"tensor has {tuple(x.shape)}"
            )
        # The residual may come from a checkpoint loaded on another device.
        return residual.to(device=x.device, dtype=x.dtype)

    def holds(self, key: str) -> bool:
        """Whether a residual of ``key`` is owed."""
        return key in self._residuals

    def owe(self, key: str, residual: torch.Tensor) -> None:
        """``residual`` (e.g. a checkpoint's) is owed under ``key`` from now on: still owed if
        the collective meant to deliver it fails."""
        self._residuals[key] = residual

    def set_residual(self, key: str, residual: torch.Tensor) -> None:
        """Store the residual of ``key`` computed by its latest encode (owed from now on)."""
        old = self._residuals.get(key)
        self._residuals[key] = residual
        if old is not None and old is not residual and old.device.type == "cpu":
            self._spares[key] = old

    def stage(self, key: str, residual: torch.Tensor) -> None:
        """The residual of ``key`` left by an encode of the sync being decided: owed only once
        :meth:`commit` says the sync committed."""
        self._staged[key] = residual

    def commit(self) -> None:
        """The sync committed: its staged residuals are owed from now on."""
        for key, residual in self._staged.items():
            self.set_residual(key, residual)
        self._staged.clear()

    def discard(self) -> None:
        """The sync did not commit (or was never decided): what was owed before it stays owed."""
        for key, residual in self._staged.items():
            if residual.device.type == "cpu":
                self._spares[key] = residual
        self._staged.clear()

    def residual_buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``like`` (contents undefined) to compute ``key``'s next residual
        in: the CPU residual the last :meth:`set_residual` replaced, or a new one."""
        spare = self._spares.pop(key, None)
        if (
            spare is not None
            and spare.shape == like.shape
            and spare.dtype == like.dtype
            and spare.device == like.device
        ):
            return spare
        return torch.empty_like(like)

    def encode(self, key: str, x: torch.Tensor, codec: ResidualEncoder) -> torch.Tensor:
        """``codec.encode(x + residual)``, updating the residual."""
        corrected = self.correct(key, x)
        packed = torch.empty(codec.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        residual = self.residual_buffer(key, corrected)
        codec.encode_into(corrected, packed, x.numel(), residual=residual)
        self.set_residual(key, residual)
        return packed

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual of ``key`` (None before its first update)."""
        return self._residuals.get(key)

    def owed(self, staged: bool = False) -> dict[str, torch.Tensor]:
        """The residuals owed by key (``staged``: those the undecided sync left), not copied."""
        return dict(self._staged if staged else self._residuals)

    def forget(self, key: str) -> None:
        """Owe nothing more under ``key`` (its spare buffer and anything staged stay)."""
        self._residuals.pop(key, None)

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of ``key``, or all of them (and any staged)."""
        if key is None:
            self._residuals.clear()
            self._spares.clear()
            self._staged.clear()
        else:
            self._residuals.pop(key, None)
            self._spares.pop(key, None)
            self._staged.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the residuals by key (a residual's buffer is reused two rounds later)."""
        return {key: value.clone() for key, value in self._residuals.items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with copies of those in ``state_dict``."""
        self._residuals = {key: value.detach().clone() for key, value in state_dict.items()}
