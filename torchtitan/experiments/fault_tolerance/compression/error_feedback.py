"""Error feedback: per key, what this rank's own compression dropped, owed to the next round.

Over many rounds the sum of what was sent tracks the sum of the inputs: the quantization error
is delivered later instead of lost. A residual covers the first (per-rank) encoding only; the
re-encoding of a reduced chunk is shared by all ranks and not fed back. A residual changes only
when its sync commits (staged, then committed or discarded), and a failed collective leaves it
as it was: none of the corrected tensor was delivered.
"""

from __future__ import annotations

import torch

from torchtitan.experiments.fault_tolerance.compression.codecs import Codec


class ErrorFeedback:
    """Per-key residual of this rank's own compression, added back before the next encoding.

    ``correct(key, x)`` returns ``x + residual`` (``correct_`` adds in place); the encode of
    that tensor computes what it dropped (``Codec.encode_into(..., residual=)``) into
    ``residual_buffer(key, x)``, and ``set_residual`` stores it. The residuals are part of the
    training state (``state_dict``/``load_state_dict``): without them a restarted rank would
    drop the error it still owes.

    On the CPU the residual a new one replaces is kept as the buffer for the round after
    (:meth:`residual_buffer`): a fresh model-sized buffer there costs more in page faults than
    the arithmetic done in it. The replaced residual is not touched before that next round.

    Keys of a fragment's pseudo-gradient are ``fragment_key(fragment, n)``: the ``n``-th
    transfer of the fragment's sync (the transport's buckets, in order). Together they cover
    the fragment's parameters once, so a checkpoint holds a fragment's residuals as one flat
    tensor of fixed size (:meth:`fragment_residual`), whatever the bucket sizes, and a
    restarted rank hands it back in slices as the sync's tensors come
    (:meth:`load_fragment_residual`).

    A residual changes only when its sync commits: the collective stages (:meth:`stage`) what its
    encode dropped, and the sync's verdict either keeps it (:meth:`commit`) or drops it
    (:meth:`discard`, the residual owed before stays owed). A sync that fails anywhere (a
    later bucket, another rank of the group, another group, a non-finite value) so leaves no
    trace in what this rank owes.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        #: Loaded flat residuals not handed out yet: fragment -> (flat, offset taken so far).
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}
        #: Replaced CPU residuals, to compute the next ones in.
        self._spares: dict[str, torch.Tensor] = {}
        #: Residuals of the sync being decided, by key (from its encodes) ...
        self._staged: dict[str, torch.Tensor] = {}
        #: ... or by fragment, as a checkpoint saved them while that sync was undecided.
        self._staged_flat: dict[int, torch.Tensor] = {}

    @staticmethod
    def fragment_key(fragment: int, index: int) -> str:
        return f"fragment_{fragment}/{index}"

    def correct(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """A new tensor ``x + residual[key]`` (a copy of ``x`` if there is no residual yet)."""
        residual = self._owed(key, x)
        return x.clone() if residual is None else x + residual

    def correct_(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x += residual[key]`` in place; returns ``x``. The residual stays owed until
        :meth:`set_residual` replaces it."""
        residual = self._owed(key, x)
        return x if residual is None else x.add_(residual)

    def _owed(self, key: str, x: torch.Tensor) -> torch.Tensor | None:
        """The residual of ``key`` on ``x``'s device, or None. A loaded one is taken from the
        pending flat tensor here and kept under ``key``, so that it is still owed if the
        collective that was to deliver it fails."""
        residual = self._residuals.get(key)
        if residual is None:
            residual = self._take_pending(key, x.numel())
            if residual is not None:
                residual = residual.reshape(x.shape)
                self._residuals[key] = residual
        if residual is None:
            return None
        if residual.shape != x.shape:
            raise ValueError(
                f"error feedback {key!r}: residual has shape {tuple(residual.shape)}, "
                f"tensor has {tuple(x.shape)}"
            )
        # The residual may come from a checkpoint loaded on another device.
        return residual.to(device=x.device, dtype=x.dtype)

    def _take_pending(self, key: str, numel: int) -> torch.Tensor | None:
        """The next ``numel`` values of a loaded flat residual of ``key``'s fragment."""
        fragment = _fragment_of_key(key)
        if fragment is None or fragment not in self._pending:
            return None
        flat, offset = self._pending[fragment]
        if offset + numel > flat.numel():
            raise ValueError(
                f"error feedback {key!r}: the checkpointed residual of fragment {fragment} has "
                f"{flat.numel()} values, {offset} taken; this tensor needs {numel} more"
            )
        if offset + numel == flat.numel():
            del self._pending[fragment]
        else:
            self._pending[fragment] = (flat, offset + numel)
        return flat[offset : offset + numel]

    def fragment_residual(self, fragment: int, numel: int, staged: bool = False) -> torch.Tensor:
        """This rank's residuals of ``fragment`` as one flat fp32 CPU tensor of ``numel``
        values (the fragment's local parameters), in key order; zeros where it owes nothing
        (before its first compressed sync, or right after a heal). ``staged``: the residuals
        the undecided sync of ``fragment`` leaves if it commits (:meth:`has_staged`)."""
        flat = torch.zeros(numel, dtype=torch.float32)
        residuals = self._staged if staged else self._residuals
        if staged and fragment in self._staged_flat:
            flat.copy_(self._staged_flat[fragment])
            return flat
        if not staged and fragment in self._pending:
            pending, offset = self._pending[fragment]
            flat[offset:] = pending[offset:].cpu()
        keys = sorted(
            (int(k.rsplit("/", 1)[1]), k) for k in residuals if _fragment_of_key(k) == fragment
        )
        offset = 0
        for _, key in keys:
            residual = residuals[key].reshape(-1)
            if offset + residual.numel() > numel:
                raise ValueError(
                    f"error feedback: fragment {fragment}'s residuals hold more than its "
                    f"{numel} parameter values (key {key!r})"
                )
            flat[offset : offset + residual.numel()] = residual.cpu()
            offset += residual.numel()
        return flat

    def load_fragment_residual(
        self, fragment: int, flat: torch.Tensor, staged: bool = False
    ) -> None:
        """Owe ``flat`` (from :meth:`fragment_residual`) again: the fragment's next sync takes
        it in slices, one per tensor, in key order. ``staged``: what the undecided sync of
        ``fragment`` leaves if it commits (owed from :meth:`commit` on)."""
        flat = flat.detach().reshape(-1).clone()
        if staged:
            self._staged_flat[fragment] = flat
            return
        for key in [k for k in self._residuals if _fragment_of_key(k) == fragment]:
            del self._residuals[key]
        self._pending[fragment] = (flat, 0)

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

    def has_staged(self, fragment: int) -> bool:
        """Whether the undecided sync of ``fragment`` left residuals (:meth:`stage`)."""
        return fragment in self._staged_flat or any(
            _fragment_of_key(k) == fragment for k in self._staged
        )

    def commit(self) -> None:
        """The sync committed: its staged residuals are owed from now on."""
        for key, residual in self._staged.items():
            self.set_residual(key, residual)
        for fragment, flat in self._staged_flat.items():
            self.load_fragment_residual(fragment, flat)
        self._staged.clear()
        self._staged_flat.clear()

    def discard(self, loaded: bool = True) -> None:
        """The sync did not commit (or was never decided): what was owed before it stays owed.
        ``loaded``: also drop what a checkpoint loaded as staged (False: keep it for the
        verdict of the sync it belongs to)."""
        for key, residual in self._staged.items():
            if residual.device.type == "cpu":
                self._spares[key] = residual
        self._staged.clear()
        if loaded:
            self._staged_flat.clear()

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

    def encode(self, key: str, x: torch.Tensor, codec: Codec) -> torch.Tensor:
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

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of ``key``, or all of them (and any loaded, not yet taken, and
        any staged)."""
        if key is None:
            self._residuals.clear()
            self._pending.clear()
            self._spares.clear()
            self._staged.clear()
            self._staged_flat.clear()
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


def _fragment_of_key(key: str) -> int | None:
    """The fragment of a key made by :meth:`ErrorFeedback.fragment_key` (None for others)."""
    head, _, tail = key.partition("/")
    if not head.startswith("fragment_") or not tail.isdigit():
        return None
    return int(head.removeprefix("fragment_"))
