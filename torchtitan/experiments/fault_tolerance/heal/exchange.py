"""Both ends of a heal that asks first (:class:`HealExchange`; the wire: ``checkpoint_transport``).

torchft sends a joiner every registered state. Here the joiner first sends its
:class:`~.history.ReplayBasis`, and the peer answers with that full state or, when its
history covers the joiner's gap, with the small state only (positions, LR schedule, step) and
the missed averages, which the joiner replays as they arrive. It fills the left-out entries with
its own state, so torchft loads every key as usual; the ``heal_history`` entry, loaded last,
checks the result against the peer's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from torchtitan.components.ft import FTManager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.healing import KEEP_OWN
from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance.heal.history import (
    HealHistory,
    HistoryEntry,
    ReplayBasis,
    ReplayPlan,
    plan_replay,
    replay,
)
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape, mismatch

#: The key of the heal history's entry in torchft's healing state.
HEAL_KEY = "heal_history"


class HealTransferError(RuntimeError):
    """A replay's payload did not arrive: the heal fails, as any failed transfer does."""


@dataclass(frozen=True)
class HealAnswer:
    """What a peer sends a joiner: torchft's ``state`` (``{"user", "torchft"}``), then, for a
    replay, the missed averages' ``payloads`` in order."""

    state: dict[str, Any]
    payloads: list[torch.Tensor]

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two answers the same: the kind, why (full) or which syncs (replay)."""
        value = self.state["user"][HEAL_KEY]
        if value["transfer"] != "replay":
            return ("full", value.get("why", ""))
        return ("replay", tuple(e["sync"] for e in value["entries"]))


@dataclass(frozen=True)
class HealReceipt:
    """What this group's last heal received."""

    #: ``replay`` (the missed averages) or ``full`` (every state); why not a replay, in one line.
    transfer: str
    why_full: str
    #: Bytes of the tensors received, and syncs replayed.
    nbytes: int
    syncs: int = 0
    #: Seconds from the request until everything arrived (a replay's outer steps run meanwhile).
    seconds: float = 0.0


def tree_nbytes(value: Any) -> int:
    """Bytes of the tensors in a nested state (each storage once, as torchft sends them)."""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        return sum(tree_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tree_nbytes(v) for v in value)
    return 0


class Replayer(Protocol):
    """What a heal replays missed syncs through: a method's global copies and training's own
    outer step (``GlobalCopyMethod``)."""

    @property
    def fragments(self) -> Sequence[object]:
        """The model's sync fragments."""

    def global_digest(self, index: int) -> int:
        """A digest of fragment ``index``'s global copy (this rank's shards)."""

    def replayed_state(self, key: str) -> bool:
        """Whether a replay reproduces healing state ``key``: the peer leaves it out."""

    def replay_outer_steps(self, steps: Iterable[tuple[int, torch.Tensor]]) -> None:
        """The outer step of each ``(fragment, average)`` in order."""

    def replay_device(self, index: int) -> torch.device:
        """Where fragment ``index``'s outer step takes its average."""

    def restore_global_copies(self, index: int) -> None:
        """Put fragment ``index``'s global copy back into the model."""


class HealExchange:
    """Both ends of a heal, for one rank of a group running ``method``. As a peer it answers a
    request from the ``history`` of committed syncs (:meth:`answer`). As a joiner it sends
    ``basis`` (:meth:`set_basis`, before its start-up quorum only) and, given a replay, redoes
    the missed outer steps as their averages arrive (:meth:`received`), then checks the result
    (:meth:`load`). A method that cannot replay (LocalSGD) heals in full."""

    def __init__(
        self,
        history: HealHistory,
        fingerprint: int,
        method: str,
        replayer: Replayer | None,
        ft: FTManager,
        shape: CollectiveShape | None = None,
    ) -> None:
        """``replayer``: what a replay goes through (None: ``method`` cannot replay). ``shape``:
        what fixes this rank's sync collectives: a joiner refuses a heal from a
        peer of another shape (``shape_refused``) before anything is sent."""
        self.history = history
        self.shape = shape
        #: Why this group refused to heal from its peer ("": it did not): their collectives
        #: cannot pair. The group stops at its quorum's exchange.
        self.shape_refused = ""
        self.fingerprint = fingerprint
        self.method = method
        self.replayer = replayer
        self.ft = ft
        self.replays = self.replayer is not None and history.capacity > 0
        self.basis = ReplayBasis.none()
        #: The last heal of this group (None: none yet).
        self.receipt: HealReceipt | None = None
        #: Why the last replay failed on arrival (""): the group heals in full at the next quorum.
        self.replay_failed = ""
        #: Why this group's own state can no longer be trained on ("": it can): a replay that
        #: failed after it began changed it. Only a full heal makes it whole (not going on alone).
        self.own_state_lost = ""
        self._heal_kind: str | None = None
        self._why_no_basis = ""

    def refusal(self, metadata: str) -> str:
        """Why this group cannot heal from a peer whose collectives ``metadata`` describes
        (``CollectiveShape.to_text``; "": it can)."""
        peers = CollectiveShape.from_text(metadata)
        if self.shape is None or peers is None:
            return ""
        return mismatch([("the peer it heals from", peers)], self.shape)

    def refused(self, why: str) -> None:
        """The peer was told that this group refuses to heal from it (``why``): the group stops
        at its quorum's exchange (``shape_refused``)."""
        self.shape_refused = why

    def digests(self) -> list[int]:
        """This rank's digest of each fragment's global copy."""
        loop = self._replay_method()
        return [loop.global_digest(i) for i in range(len(loop.fragments))]

    def _replay_method(self) -> Replayer:
        assert self.replayer is not None, f"{self.method} cannot replay"
        return self.replayer

    def _why_no_history(self) -> str:
        if self.replayer is None:
            return f"{self.method} cannot replay"
        if self.history.capacity <= 0:
            return "fault_tolerance.heal_history_syncs=0"
        return "it keeps one"

    def set_basis(self, sync: int | None) -> None:
        """Before a start-up quorum: this group's own checkpoint is at ``sync`` (None: none)."""
        self._why_no_basis = ""
        if sync is None or not self.replays:
            self.basis = ReplayBasis.none()
        else:
            self.basis = ReplayBasis(sync, self.fingerprint, tuple(self.digests()))

    def drop_basis(self, why: str) -> None:
        """A replay failed (``why``): the next heal is a full one, and says so."""
        self.expect_full(f"its replay failed before ({why})")

    def replay_reported(self, problem: str) -> None:
        """The group's ranks agreed that its replay failed (``problem``): the failure is told,
        and the next heal is a full one."""
        self.replay_failed = ""
        self.drop_basis(problem)

    def expect_full(self, why: str) -> None:
        """The next heal is a full one, for the reason ``why`` (said in ``full_because``)."""
        self.basis = ReplayBasis.none()
        self._why_no_basis = why

    def replayed(self) -> bool:
        """Whether this group's last heal replayed its missed syncs."""
        return self.receipt is not None and self.receipt.transfer == "replay"

    def event_fields(self) -> dict[str, Any]:
        """The last heal, for the ``semi_sync.healed`` event."""
        receipt = self.receipt
        return {
            "transfer": None if receipt is None else receipt.transfer,
            "bytes_received": None if receipt is None else receipt.nbytes,
            "replayed_syncs": None if receipt is None else receipt.syncs,
            "full_because": None if receipt is None or not receipt.why_full else receipt.why_full,
            "receive_s": None if receipt is None else round(receipt.seconds, 3),
        }

    #: The core's states a replay keeps as the joiner's own (its model takes the global copies).
    CORE_KEPT = ("model", "optimizer")

    # ---- the peer ----------------------------------------------------------------------------

    def answer(self, basis: ReplayBasis, step: int, state: dict[str, Any]) -> HealAnswer:
        """What to send a joiner with ``basis``: torchft's ``state`` in full, or its small
        entries plus the missed averages."""
        current_digests = functools.cache(self.digests)  # only if the plan gets that far
        if not self.replays:
            plan = ReplayPlan(None, f"the peer keeps no heal history ({self._why_no_history()})")
        else:
            plan = plan_replay(self.history, basis, step, self.fingerprint, current_digests)
        user = dict(state["user"])
        if plan.entries is None:
            user[HEAL_KEY] = {"transfer": "full", "why": plan.why_full}
            return HealAnswer({**state, "user": user}, [])
        # Left out: CORE_KEPT, and the fragments' global copies and outer optimizers (replayed).
        replayed = self._replay_method().replayed_state
        omitted = [key for key in user if key in self.CORE_KEPT or replayed(key)]
        for key in omitted:
            del user[key]
        user[HEAL_KEY] = {
            "transfer": "replay",
            "entries": [e.to_wire() for e in plan.entries],
            "digests": current_digests(),
            "omitted": omitted,
        }
        payloads = [p for e in plan.entries for p in e.payloads()]
        return HealAnswer({**state, "user": user}, payloads)

    def placeholder(self) -> dict[str, Any]:
        """This key's own healing state (replaced by :meth:`answer` on the way)."""
        return {"transfer": "none"}

    # ---- the joiner --------------------------------------------------------------------------

    def received(
        self, state: dict[str, Any], payloads: Iterator[torch.Tensor], started: float | None = None
    ) -> dict[str, Any]:
        """On the joiner, as the state arrives: a replay's averages are taken from ``payloads``
        and replayed one by one; then what the answer left out is filled with this group's own
        state. ``started``: when the request left (``time.perf_counter``), for the receipt.
        Runs on torchft's quorum thread while the main thread waits for the quorum
        (``QuorumRounds.form``), so nothing else touches the model or the method's state."""
        nbytes = tree_nbytes(state)
        value = state["user"].get(HEAL_KEY, {})
        syncs, why = 0, value.get("why", "")
        if value.get("transfer") == "replay":
            arrived, failed, nbytes_arrived = self._replay_as_received(value["entries"], payloads)
            value["arrived"], value["failed_because"] = arrived, failed
            omitted = list(value["omitted"])
            # The core's states stay as they are; the method's are its own, replayed above
            # (torchft's DiLoCo loads every fragment it registered: its own state again).
            core = [key for key in omitted if key in self.CORE_KEPT]
            own = tft.user_state(self.ft.manager, [k for k in omitted if k not in core])
            state["user"].update({key: KEEP_OWN for key in core})
            state["user"].update(own)
            self.ft.keep_own(core)
            nbytes += nbytes_arrived
            transfer, syncs, why = "replay", len(value["entries"]), ""
        else:
            transfer = "full"
            # When it asked for no replay itself, its own reason stands first.
            if self.basis.sync < 0 and self._why_no_basis:
                why = self._why_no_basis
            elif self.basis.sync < 0 and not self.replays:
                why = f"this group keeps no heal history ({self._why_no_history()})"
        if torch.cuda.is_available():
            # The replay and own state above ran on this stream; the main thread reads them.
            torch.cuda.current_stream().synchronize()
        seconds = 0.0 if started is None else time.perf_counter() - started
        self.receipt = HealReceipt(transfer, why, nbytes, syncs, seconds)
        self._heal_kind = transfer
        return state

    def _replay_as_received(
        self, wire: list[dict[str, Any]], payloads: Iterator[torch.Tensor]
    ) -> tuple[list[HistoryEntry], str, int]:
        """Replay ``wire``'s entries onto this group's global copies and outer optimizers, each
        once its payloads arrived intact. Returns the entries that arrived, why the replay
        failed ("": it did not) and the bytes received. A failed replay still takes every
        payload the peer sends (the peer waits for them); a failed transfer raises
        :class:`HealTransferError`. Either way the next heal is a full one, and once a replay
        began, the group's own state is lost (``own_state_lost``)."""
        arrived: list[HistoryEntry] = []

        def arriving() -> Iterator[HistoryEntry]:
            for value in wire:
                entry = HistoryEntry.from_wire(value, payloads)
                arrived.append(entry)
                if not entry.intact():
                    raise _Damaged(f"the history entry of sync #{entry.sync} arrived damaged")
                self.own_state_lost = "its replay of the syncs it missed stopped part-way"
                yield entry

        loop = self._replay_method()
        why = ""
        try:
            replay(arriving(), loop.replay_outer_steps, loop.replay_device)
        except HealTransferError as e:
            self.drop_basis(str(e))
            if self.own_state_lost:
                self.own_state_lost += f" ({e})"
            raise
        except _Damaged as e:
            why = str(e)
        except Exception as e:  # e.g. an entry of another size: fail safe, heal in full
            why = f"the replay raised {type(e).__name__}: {e}"
        nbytes = sum(e.nbytes for e in arrived)
        nbytes += sum(p.numel() * p.element_size() for p in payloads)  # a failed replay's rest
        if why and self.own_state_lost:
            self.own_state_lost += f" ({why})"
        return arrived, why, nbytes

    def load(self, value: dict[str, Any]) -> None:
        """torchft loads the ``heal_history`` entry last, on the main thread: put the replayed
        global copies into the model and check them against the peer's. (The group's ranks
        agree on the outcome in the quorum's exchange: ``QuorumExchange.on_quorum``.)"""
        try:
            self._load(value)
        except Exception as e:  # e.g. an entry of another size: fail safe, heal in full
            self.replay_failed = f"the replay raised {type(e).__name__}: {e}"
            self.drop_basis(self.replay_failed)

    def take_heal(self) -> str | None:
        """The heal this rank received since the last call (``replay``, ``full``; None: none)."""
        kind, self._heal_kind = self._heal_kind, None
        return kind

    def _load(self, value: dict[str, Any]) -> None:
        self.replay_failed = ""
        if value.get("transfer") != "replay":
            self.history.clear()  # this group's state now follows from the peer's, not its own
            self.own_state_lost = ""
            return
        entries: list[HistoryEntry] = value.get("arrived", [])
        why = value.get("failed_because", "the replay's averages never arrived")
        if not why:
            why = self._check([int(d) for d in value["digests"]])
            if why:
                self.own_state_lost = f"its replayed global parameters are not the job's ({why})"
        self.history.clear()
        if why:
            self.replay_failed = why
            self.drop_basis(why)  # the next heal is a full one
        else:
            self.own_state_lost = ""
            for entry in entries:  # the job's own averages: this group can serve them too
                self.history.record(entry)
            if self.basis.sync >= 0:
                # Healed again in this start-up (a retried quorum): from where it is now, or
                # the same syncs would be applied twice.
                self.set_basis(int(self.ft.manager.current_step()))

    def _check(self, digests: list[int]) -> str:
        """Put the replayed global copies into the model and check them against the peer's
        ``digests``. Returns why they differ ("": they do not)."""
        loop = self._replay_method()
        for index in range(len(loop.fragments)):
            loop.restore_global_copies(index)
        mine = self.digests()
        if mine != digests:
            i = next(i for i, (a, b) in enumerate(zip(mine, digests, strict=True)) if a != b)
            return f"after the replay, fragment {i}'s global parameters differ from the peer's"
        return ""


class _Damaged(Exception):
    """A history entry arrived with payloads that fail its checksum."""


def job_fingerprint_parts(job_config: JobConfig, model: nn.Module) -> list[str]:
    """What two groups' checkpoints must share to be replayed onto each other: the model and
    every setting that changes what an outer step does."""
    ft = semi_sync_config(job_config)
    settings: tuple[str, ...] = (
        "semi_sync_method", "sync_steps", "num_fragments", "module_fqns_per_model_fragment",
        "fragment_sync_delay", "fragment_update_alpha", "outer_lr", "outer_momentum",
        "outer_nesterov", "outer_momentum_every", "async_update", "pseudo_grad_dtype",
        "error_feedback",
    )  # fmt: skip
    if ft.pseudo_grad_dtype == "sparse":  # only then: other jobs keep their fingerprints
        settings += ("sparse_chunk", "sparse_keep", "sparse_value_bits", "sparse_residual_decay")
    parts = [f"model={job_config.model.name}/{job_config.model.flavor}"]
    parts += [f"{name}={getattr(ft, name)!r}" for name in settings]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters()]
    return parts
