"""This rank's error-feedback residuals by fragment, and how a checkpoint holds them."""

from __future__ import annotations

import torch

from torchtitan.experiments.fault_tolerance.transport.error_feedback import (
    ErrorFeedback,
)


class FragmentResiduals:
    """The residual of transfer ``n`` of fragment ``f``'s sync lives under ``key(f, n)`` in an
    :class:`ErrorFeedback` store (:attr:`feedback`).

    A fragment's transfers cover its parameters once, in order, so a checkpoint holds its
    residuals as one flat fp32 tensor of the fragment's size (:meth:`flat`), whatever the
    buckets; a restarted rank hands the loaded tensor (:meth:`load`) back in slices as the
    transfers ask for their keys. What an undecided sync staged is checkpointed apart
    (``staged``) and owed only if that sync then commits (:meth:`commit`).
    """

    def __init__(self, decay: float = 1.0) -> None:
        #: Loaded flat residuals not handed out yet: fragment -> (flat, offset taken so far).
        self._loaded: dict[int, tuple[torch.Tensor, int]] = {}
        #: Residuals of an undecided sync, by fragment, as a checkpoint saved them.
        self._staged_loaded: dict[int, torch.Tensor] = {}
        self.feedback = ErrorFeedback(decay=decay)

    @staticmethod
    def key(fragment: int, index: int) -> str:
        return f"fragment_{fragment}/{index}"

    @staticmethod
    def fragment_of(key: str) -> int | None:
        """The fragment of a :meth:`key` (None for another key)."""
        head, _, tail = key.partition("/")
        if not head.startswith("fragment_") or not tail.isdigit():
            return None
        return int(head.removeprefix("fragment_"))

    def claim(self, key: str, numel: int) -> None:
        """Before transfer ``key`` of ``numel`` values is sent: if its fragment's loaded
        residual has values not handed out yet and ``key`` owes none, the next ``numel`` of
        them are owed under ``key`` (the transfers ask in order)."""
        if self.feedback.holds(key):
            return
        loaded = self._take_loaded(key, numel)
        if loaded is not None:
            self.feedback.owe(key, loaded)

    def _take_loaded(self, key: str, numel: int) -> torch.Tensor | None:
        """The next ``numel`` values of the loaded flat residual of ``key``'s fragment."""
        fragment = self.fragment_of(key)
        if fragment is None or fragment not in self._loaded:
            return None
        flat, offset = self._loaded[fragment]
        if offset + numel > flat.numel():
            raise ValueError(
                f"error feedback {key!r}: the checkpointed residual of fragment {fragment} has "
                f"{flat.numel()} values, {offset} taken; this tensor needs {numel} more"
            )
        if offset + numel == flat.numel():
            del self._loaded[fragment]
        else:
            self._loaded[fragment] = (flat, offset + numel)
        return flat[offset : offset + numel]

    def _keys(self, fragment: int, residuals: dict[str, torch.Tensor]) -> list[str]:
        found = [
            (int(k.rsplit("/", 1)[1]), k) for k in residuals if self.fragment_of(k) == fragment
        ]
        return [key for _, key in sorted(found)]

    def flat(self, fragment: int, numel: int, staged: bool = False) -> torch.Tensor:
        """This rank's residuals of ``fragment`` as one flat fp32 CPU tensor of ``numel``
        values (the fragment's local parameters), in key order; zeros where it owes nothing
        (before its first compressed sync, or right after a heal). ``staged``: the residuals
        the undecided sync of ``fragment`` leaves if it commits (:meth:`has_staged`)."""
        out = torch.zeros(numel, dtype=torch.float32)
        if staged and fragment in self._staged_loaded:
            out.copy_(self._staged_loaded[fragment])
            return out
        if not staged and fragment in self._loaded:
            loaded, offset = self._loaded[fragment]
            out[offset:] = loaded[offset:].cpu()
        residuals = self.feedback.owed(staged)
        offset = 0
        for key in self._keys(fragment, residuals):
            residual = residuals[key].reshape(-1)
            if offset + residual.numel() > numel:
                raise ValueError(
                    f"error feedback: fragment {fragment}'s residuals hold more than its "
                    f"{numel} parameter values (key {key!r})"
                )
            out[offset : offset + residual.numel()] = residual.cpu()
            offset += residual.numel()
        return out

    def load(self, fragment: int, flat: torch.Tensor, staged: bool = False) -> None:
        """Owe ``flat`` (from :meth:`flat`) again: the fragment's next sync takes it in slices,
        one per transfer, in key order. ``staged``: what the undecided sync of ``fragment``
        leaves if it commits (owed from :meth:`commit` on)."""
        flat = flat.detach().reshape(-1).clone()
        if staged:
            self._staged_loaded[fragment] = flat
            return
        for key in self._keys(fragment, self.feedback.owed()):
            self.feedback.forget(key)
        self._loaded[fragment] = (flat, 0)

    def has_staged(self, fragment: int) -> bool:
        """Whether the undecided sync of ``fragment`` left residuals."""
        staged = self.feedback.owed(staged=True)
        return fragment in self._staged_loaded or bool(self._keys(fragment, staged))

    def commit(self) -> None:
        """The sync committed: what it staged (or a checkpoint loaded as staged) is owed."""
        self.feedback.commit()
        for fragment, flat in self._staged_loaded.items():
            self.load(fragment, flat)
        self._staged_loaded.clear()

    def discard(self, loaded: bool = True) -> None:
        """The sync did not commit (or was never decided): what was owed before stays owed.
        ``loaded``: also drop what a checkpoint loaded as staged (False: keep it for the
        verdict of the sync it belongs to)."""
        self.feedback.discard()
        if loaded:
            self._staged_loaded.clear()

    def reset(self) -> None:
        """Owe nothing, loaded residuals included (after a heal: they belong to state this
        group no longer has)."""
        self.feedback.reset()
        self._loaded.clear()
        self._staged_loaded.clear()
