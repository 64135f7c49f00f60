"""A heal that asks first: torchft's process-group checkpoint transport, with one request from
the joiner before the peer sends.

torchft heals a group by sending it every registered state (model, inner optimizer, each
fragment's global copy and outer optimizer, ...). :class:`HistoryTransport` keeps torchft's
transport and adds a request: the joiner sends its :class:`~.heal_history.ReplayBasis`, the
peer answers (:meth:`HealExchange.answer`) either with that full state or, when its history
covers the joiner's gap, with the missed averages plus the small state only (positions, LR
schedule, step). The joiner fills the left-out entries with its own state, so torchft loads
every key as usual; the ``heal_history`` entry, loaded last, replays (:meth:`HealExchange.load`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from torchtitan.components.ft import FTManager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.healing import KEEP_OWN
from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.compression import Delivered
from torchtitan.experiments.fault_tolerance.heal_history import (
    BASIS_SLOTS,
    HealHistory,
    HistoryEntry,
    ReplayBasis,
    ReplayPlan,
    plan_replay,
    replay,
)
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.outer_loop import (
    GlobalCopyLoop,
    OuterLoop,
    ReplaysOuterSteps,
)
from torchtitan.tools.digest import device_digest

#: The key of the heal history's entry in torchft's healing state.
HEAL_KEY = "heal_history"
#: The process-group tag of the joiner's request (torchft's transport uses 1 and up).
_REQUEST_TAG = 0


@dataclass(frozen=True)
class HealReceipt:
    """What this group's last heal received."""

    #: ``replay`` (the missed averages) or ``full`` (every state).
    transfer: str
    #: Why not a replay (``full``), in one line.
    why_full: str
    #: Bytes of the tensors received.
    nbytes: int
    #: Syncs replayed.
    syncs: int = 0


def tree_nbytes(value: Any) -> int:
    """Bytes of the tensors in a nested state (each storage once, as torchft sends them)."""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        return sum(tree_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tree_nbytes(v) for v in value)
    return 0


class HealExchange:
    """Both ends of a heal, for one rank of a group running ``loop``.

    As a peer it keeps the ``history`` of committed syncs (:meth:`record`) and answers a
    request from it (:meth:`answer`). As a joiner it sends ``basis`` (:meth:`set_basis` before
    its start-up quorum; none otherwise) and, given a replay, redoes the missed outer steps in
    :meth:`load`. A method that cannot replay (LocalSGD, async DiLoCo for now) keeps no
    history, and each of its heals is a full one."""

    def __init__(
        self, history: HealHistory, fingerprint: int, loop: OuterLoop, ft: FTManager
    ) -> None:
        self.history = history
        self.fingerprint = fingerprint
        self.loop = loop
        self.ft = ft
        self.replays = isinstance(loop, ReplaysOuterSteps) and history.capacity > 0
        self.basis = ReplayBasis.none()
        #: The last heal of this group (None: none yet).
        self.receipt: HealReceipt | None = None
        #: Why the last replay failed on arrival ("" when it did not): the group then heals
        #: in full at the next quorum.
        self.replay_failed = ""
        self._full_said = False
        self._heal_kind: str | None = None

    def digests(self) -> list[int]:
        """This rank's digest of each fragment's global copy."""
        loop = self.loop
        assert isinstance(loop, GlobalCopyLoop)
        return [
            device_digest(loop.global_parameters(i).values()) for i in range(len(loop.fragments))
        ]

    def record(self, sync: int, fragment: int, delivered: list[Delivered]) -> None:
        """A sync committed (before its outer step): keep what it delivered."""
        loop = self.loop
        assert isinstance(loop, GlobalCopyLoop) and isinstance(loop, ReplaysOuterSteps)
        basis = device_digest(loop.global_parameters(fragment).values())
        kept, scale = loop.kept_average(fragment, delivered)
        self.history.record(HistoryEntry.of(sync, fragment, kept, basis, scale))
        if not self._full_said and len(self.history) == self.history.capacity:
            self._full_said = True
            events.HEAL_HISTORY_KEPT.emit(syncs=len(self.history), mib=self.history.nbytes / 2**20)

    def _why_no_history(self) -> str:
        if not isinstance(self.loop, ReplaysOuterSteps):
            return f"{self.loop.method} cannot replay"
        if self.history.capacity <= 0:
            return "fault_tolerance.heal_history_syncs=0, or should_quantize"
        return "it keeps one"

    def set_basis(self, sync: int | None) -> None:
        """Before a start-up quorum: this group's own checkpoint is at ``sync`` (None: it has
        none to replay onto)."""
        if sync is None or not self.replays:
            self.basis = ReplayBasis.none()
        else:
            self.basis = ReplayBasis(sync, self.fingerprint, tuple(self.digests()))

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
        }

    #: The core's states a replay keeps as the joiner's own: its model (the global copies go
    #: into it after the replay) and its inner optimizer.
    CORE_KEPT = ("model", "optimizer")

    def replayable(self, key: str) -> bool:
        """The healing state a replay leaves out: the model (the global copies replace it),
        the inner optimizer (the joiner keeps its own) and the fragments' global copies and
        outer optimizers (replayed)."""
        loop = self.loop
        return key in self.CORE_KEPT or (
            isinstance(loop, ReplaysOuterSteps) and loop.replayed_state(key)
        )

    # ---- the peer ----------------------------------------------------------------------------

    def answer(self, basis: ReplayBasis, step: int, state: dict[str, Any]) -> dict[str, Any]:
        """What to send a joiner with ``basis``: torchft's ``state`` (``{"user", "torchft"}``)
        in full, or its small entries plus the missed averages."""
        if not self.replays:
            plan = ReplayPlan(None, f"the peer keeps no heal history ({self._why_no_history()})")
        else:
            plan = plan_replay(self.history, basis, step, self.fingerprint, self.digests)
        user = dict(state["user"])
        if plan.entries is None:
            user[HEAL_KEY] = {"transfer": "full", "why": plan.why_full}
            return {**state, "user": user}
        omitted = [key for key in user if self.replayable(key)]
        for key in omitted:
            del user[key]
        user[HEAL_KEY] = {
            "transfer": "replay",
            "entries": [e.to_wire() for e in plan.entries],
            "digests": self.digests(),
            "omitted": omitted,
        }
        return {**state, "user": user}

    def placeholder(self) -> dict[str, Any]:
        """This key's own healing state (replaced by :meth:`answer` on the way)."""
        return {"transfer": "none"}

    # ---- the joiner --------------------------------------------------------------------------

    def received(self, state: dict[str, Any]) -> dict[str, Any]:
        """On the joiner, as the state arrives (torchft's quorum thread, the main thread waits
        for the quorum): fill what a replay left out with this group's own state."""
        nbytes = tree_nbytes(state)
        value = state["user"].get(HEAL_KEY, {})
        if value.get("transfer") == "replay":
            omitted = list(value["omitted"])
            # The core's states stay as they are; the method's are reloaded from its own
            # (torchft's DiLoCo loads every fragment it registered), then replayed.
            core = [key for key in omitted if key in self.CORE_KEPT]
            own = tft.user_state(self.ft.manager, [k for k in omitted if k not in core])
            state["user"].update({key: KEEP_OWN for key in core})
            state["user"].update(own)
            self.ft.keep_own(core)
            self.receipt = HealReceipt("replay", "", nbytes, len(value["entries"]))
        else:
            why = value.get("why", "")
            if self.basis.sync < 0 and not self.replays:  # it asked for no replay itself
                why = f"this group keeps no heal history ({self._why_no_history()})"
            self.receipt = HealReceipt("full", why, nbytes)
        self._heal_kind = self.receipt.transfer
        return state

    def load(self, value: dict[str, Any]) -> None:
        """torchft loads the ``heal_history`` entry last, on the main thread: replay. (The
        ranks of a group agree on the outcome in the quorum's exchange, where every rank takes
        part whatever its heal did: ``QuorumProtocol.on_quorum``.)"""
        try:
            self._load(value)
        except Exception as e:  # e.g. an entry of another size: fail safe, heal in full
            self.replay_failed = f"the replay raised {type(e).__name__}: {e}"
            self.basis = ReplayBasis.none()

    def take_heal(self) -> str | None:
        """The kind of heal this rank received since the last call (``replay``, ``full``;
        None: none): asked once per quorum."""
        kind, self._heal_kind = self._heal_kind, None
        return kind

    def _load(self, value: dict[str, Any]) -> None:
        self.replay_failed = ""
        if value.get("transfer") != "replay":
            self.history.clear()  # this group's state now follows from the peer's, not its own
            return
        entries = [HistoryEntry.from_wire(e) for e in value["entries"]]
        broken = [e.sync for e in entries if not e.intact()]
        why = (
            f"the history entry of sync #{broken[0]} arrived damaged"
            if broken
            else self._apply(entries, [int(d) for d in value["digests"]])
        )
        self.history.clear()
        if why:
            self.replay_failed = why
            self.basis = ReplayBasis.none()  # the next heal is a full one
        else:
            for entry in entries:  # the job's own averages: this group can serve them too
                self.history.record(entry)
            if self.basis.sync >= 0:
                # Healed again in this start-up (a retried quorum): from where it is now, or
                # the same syncs would be applied twice.
                self.set_basis(int(self.ft.manager.current_step()))

    def _apply(self, entries: list[HistoryEntry], digests: list[int]) -> str:
        """Replay ``entries`` onto the global copies, put them into the model and check them
        against the peer's ``digests``. Returns why it failed ("": it did not)."""
        loop = self.loop
        assert isinstance(loop, ReplaysOuterSteps) and isinstance(loop, GlobalCopyLoop)
        replay(entries, loop.replay_outer_step, loop.replay_device)
        for index in range(len(loop.fragments)):
            loop.restore_global_copies(index)
        mine = self.digests()
        if mine != digests:
            wrong = [i for i, (a, b) in enumerate(zip(mine, digests, strict=True)) if a != b]
            return (
                f"after the replay, fragment {wrong[0]}'s global parameters differ from the peer's"
            )
        return ""


def _answer_key(answer: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two answers the same: the kind, why (full) or which syncs (replay)."""
    value = answer["user"][HEAL_KEY]
    if value["transfer"] != "replay":
        return ("full", value.get("why", ""))
    return ("replay", tuple(e["sync"] for e in value["entries"]))


def build_history_transport(exchange_of: Callable[[], HealExchange]) -> Callable[..., Any]:
    """The factory the core's ``build_ft_manager`` takes: torchft's process-group transport
    with the request before every heal; ``exchange_of()`` gives this rank's
    :class:`HealExchange` (asked at each heal: the Manager is built before the method)."""
    from torchft.checkpointing.pg_transport import PGTransport

    class HistoryTransport(PGTransport):
        def send_checkpoint(
            self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
        ) -> None:
            # Every joiner's request first (a few numbers each), then one send per distinct
            # answer to all the joiners it is for, as torchft sends one state to all of them.
            answers: dict[str, tuple[Any, list[int]]] = {}
            for dst in dst_ranks:
                request = torch.zeros(BASIS_SLOTS, dtype=torch.int64, device=self._device)
                self._pg.recv([request], dst, tag=_REQUEST_TAG).wait(timeout)
                answer = exchange_of().answer(ReplayBasis.from_tensor(request), step, state_dict)
                key = repr(_answer_key(answer))
                answers.setdefault(key, (answer, []))[1].append(dst)
            for answer, dsts in answers.values():
                super().send_checkpoint(dsts, step, answer, timeout)

        def recv_checkpoint(
            self, src_rank: int, metadata: str, step: int, timeout: timedelta
        ) -> Any:
            exchange = exchange_of()
            request = exchange.basis.to_tensor(self._device)
            self._pg.send([request], src_rank, tag=_REQUEST_TAG).wait(timeout)
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            return exchange.received(state)

    def build(pg: ProcessGroup, timeout: timedelta, device: torch.device) -> Any:
        return HistoryTransport(pg, timeout=timeout, device=device)

    return build


def job_fingerprint_parts(job_config: JobConfig, model: nn.Module) -> list[str]:
    """What two groups' checkpoints must share to be replayed onto each other: the model and
    every setting that changes what an outer step does."""
    ft = semi_sync_config(job_config)
    settings = (
        "semi_sync_method", "sync_steps", "num_fragments", "module_fqns_per_model_fragment",
        "fragment_sync_delay", "fragment_update_alpha", "outer_lr", "outer_momentum",
        "outer_nesterov", "outer_momentum_every", "async_update", "pseudo_grad_dtype",
        "error_feedback",
    )  # fmt: skip
    parts = [f"model={job_config.model.name}/{job_config.model.flavor}"]
    parts += [f"{name}={getattr(ft, name)!r}" for name in settings]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters()]
    return parts
