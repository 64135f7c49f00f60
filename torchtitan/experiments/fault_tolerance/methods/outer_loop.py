"""The outer loops ``SemiSyncTrainer`` drives: what a semi-sync method is to the trainer.

:class:`OuterLoop` names the verbs the trainer needs (syncing from optimizer hooks, start-up,
healing, checkpoints, the end), so that it never depends on how a method keeps its state:
``periodic.LocalSGD``, ``periodic.DiLoCo`` (Streaming too) and ``async_diloco.AsyncDiLoCo``,
the last two through ``global_copy.GlobalCopyMethod``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from torchtitan.distributed.tensors import local_tensor

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.heal.exchange import Replayer
    from torchtitan.experiments.fault_tolerance.sync.quorum import SyncDecision, SyncQuorum


class Probe(Protocol):
    """DyLU's speed probe under way, its quorum forming while the group trains on."""

    def done(self) -> bool:
        """Whether its quorum and exchange are over (this rank's)."""

    def finish(self) -> None:
        """Wait for it and take its plan, in the training thread; raise what it raised."""


class Quorums(Protocol):
    """The quorums a method asks for, each with the exchange its members run: given to the
    method by whoever drives it (``QuorumProtocol`` in a job), for the time it trains."""

    def sync_quorum(self) -> bool:
        """A sync's quorum, used once its members accept it (``SyncQuorum.sync_rounds``).
        Returns whether this group healed in it (its state is now a peer's)."""

    def start_probe(self) -> Probe:
        """DyLU's speed probe (``join.speeds.ProbeInFlight``)."""


@contextlib.contextmanager
def optimizer_hooks(
    optimizer: torch.optim.Optimizer, before: Callable[..., None], after: Callable[..., None]
) -> Iterator[None]:
    """``before`` and ``after`` as ``optimizer``'s step pre- and post-hooks meanwhile."""
    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class SyncOutcome:
    """What the last sync point did, as the trainer reports it."""

    #: The decided sync: the Manager step it makes (a failed one retries the same number).
    number: int
    fragment: int
    committed: bool
    #: Bytes of this group's payload for that sync.
    bytes_sent: int
    #: Replica groups in that sync's quorum.
    groups: int
    #: Token weighting (async DiLoCo): this group's inner steps and tokens in the sync, and
    #: its share of all groups' tokens (its weight in the average). None: equal weights.
    inner_steps: int | None = None
    tokens: int | None = None
    weight: float | None = None
    #: With a compressed ``pseudo_grad_dtype``: seconds spent compressing and decompressing
    #: (``bytes_sent`` is then what was really sent). None: uncompressed.
    compression_s: float | None = None
    #: This rank's share of the sum of squares of the average its outer step took (its shards;
    #: the reporter sums the group's ranks'). None: no outer step since the last outcome.
    pseudo_grad_squares: torch.Tensor | None = None

    @classmethod
    def of(cls, decision: SyncDecision, fragment: int, **weights: Any) -> SyncOutcome:
        """The outcome of ``decision``, a sync of ``fragment``; ``weights``: its token fields."""
        return cls(
            decision.number,
            fragment,
            decision.committed,
            decision.bytes_sent,
            decision.groups,
            compression_s=decision.compression_s,
            **weights,
        )


@dataclass
class Ending:
    """What ``OuterLoop.finish`` did."""

    #: A sync was decided on the way (report it like one at a sync point).
    synced: bool
    #: Inner steps a closing sync took in (LocalSGD's sync of the last partial period).
    closing_sync_steps: int
    #: Inner steps since the last sync that are not in the final model (None: nothing).
    dropped_inner_steps: int | None


class OuterLoop(ABC):
    """The engine: the model's ``fragments`` (one: the model itself) sync in turn, one every
    ``period`` inner steps, from the inner optimizer's hooks on the sync quorum. Every method
    runs the one schedule of :meth:`at_step`; they differ in what a sync sends and applies
    (:meth:`start_sync`, :meth:`decide_sync`) and in when it is applied: ``delay`` steps after
    it starts, at the sync point (0: at once), or at the next sync point (``applies_next``).
    ``global_copy.GlobalCopyMethod`` adds global copies and an outer optimizer."""

    method: str
    fragments: list[nn.Module]
    #: Inner steps from a sync's start to the sync point that applies it (< ``period``).
    delay: int = 0
    #: A sync point starts a sync that the next sync point applies (async DiLoCo).
    applies_next: bool = False
    #: Sync points passed in this job (by methods supporting DyLU; alike in every group).
    sync_points: int = 0

    def __init__(
        self, sync: SyncQuorum, inner_optimizer: torch.optim.Optimizer, period: int
    ) -> None:
        self.sync = sync
        self.inner_optimizer = inner_optimizer
        self.period = period
        self._local_step = 0
        #: The sync the last sync point decided (None: none), its squares not yet taken.
        self._outcome: SyncOutcome | None = None

    def hooks(self, quorums: Quorums) -> contextlib.AbstractContextManager:
        """The optimizer hooks that sync in ``quorums``, entered around the training loop."""
        return optimizer_hooks(
            self.inner_optimizer, self._before_step, lambda *_: self._after_step(quorums)
        )

    def _before_step(self, *_: Any) -> None:
        # Parameters change in the step: a peer must not read them for a heal meanwhile.
        self.sync.disallow_state_dict_read()

    def _after_step(self, quorums: Quorums) -> None:
        self._local_step += 1
        self.at_step(quorums)

    def at_step(self, quorums: Quorums) -> None:
        """After each inner step (``local_step()`` counts it), every method's schedule: a sync
        starts ``delay`` steps before its sync point, or at the sync point before (with
        ``applies_next``); a sync point applies the sync due and starts the next period."""
        self.count_step(quorums)
        if self.starts_sync_here():
            self.start_sync(quorums)
        if self._local_step >= self.steps_this_period():
            self.sync_point(quorums)

    def starts_sync_here(self) -> bool:
        """Whether a sync starts at this inner step that its sync point applies (at once, or
        ``delay`` steps later); with ``applies_next`` the sync point starts the next one."""
        return not self.applies_next and self._local_step == self.steps_this_period() - self.delay

    def sync_point(self, quorums: Quorums) -> None:
        """The end of a period: apply the sync due, and start the next sync here if it is
        applied at the next sync point."""
        self.decide_sync()
        self._local_step = 0
        if self.applies_next:
            self.start_sync(quorums)

    def count_step(self, quorums: Quorums) -> None:
        """After each inner step, before the schedule: let peers read the state for a heal
        again (the step is over)."""
        self.sync.allow_state_dict_read()

    def start_sync(self, quorums: Quorums) -> None:
        """The sync quorum, then the current fragment's transfer."""
        quorums.sync_quorum()
        self.start_transfer()

    @abstractmethod
    def start_transfer(self) -> None:
        """Start the current fragment's transfer (all of a sync a group healed inside the
        running groups' sync quorum starts: the quorum is behind it)."""

    @abstractmethod
    def decide_sync(self) -> None:
        """At a sync point: wait for the sync due and decide it (``SyncQuorum.decide``);
        committed, its average is applied, here or by the pass that starts the next period
        (async DiLoCo); dropped alike in every group otherwise."""

    def local_step(self) -> int:
        """Inner steps since the last sync point."""
        return self._local_step

    def set_local_step(self, step: int) -> None:
        """Move to inner step ``step`` of the period (a restart or a heal)."""
        self._local_step = step

    def join_sync(self) -> bool:
        """A group healed inside the running groups' sync quorum takes part in that sync now.
        Returns whether it was applied (False: started, applied later)."""
        self.start_transfer()
        if self.delay or self.applies_next:
            return False
        self.decide_sync()
        self._local_step = 0
        return True

    @abstractmethod
    def finish(self, quorums: Quorums) -> Ending:
        """After the last inner step: leave the model with the global parameters."""

    @abstractmethod
    def agreement_digest(self) -> int | None:
        """Digest of the last sync's global parameters (this rank's shards), alike in every
        group that holds them: what the agreement check compares. None: not known now."""

    def steps_this_period(self) -> int:
        """Inner steps between the last sync point and the next: ``period``, unless the
        method adapts it to this group's speed (DyLU)."""
        return self.period

    def current_fragment(self) -> int:
        """The fragment the next sync point syncs (alike in every group)."""
        return 0

    def fragment_parameters(self, index: int) -> dict[str, nn.Parameter]:
        """The model parameters of a fragment (the model's own objects), by parameter name."""
        return dict(self.fragments[index].named_parameters())

    def global_parameters(self, index: int) -> dict[str, torch.Tensor]:
        """A fragment's global parameters after the last sync, this rank's shards by name. A
        method without global copies: the model's (after a sync, they are the average)."""
        return {name: local_tensor(p.data) for name, p in self.fragment_parameters(index).items()}

    def take_global_copies(self) -> bool:
        """Make the model's parameters the global ones, with fresh outer state (e.g. after
        loading weights). Returns False when the model itself is the global state (no copies)."""
        return False

    def restore_global_copies(self, index: int) -> None:  # noqa: B027 (no copies: nothing)
        """Put fragment ``index``'s global copy into the model (a sync dropped)."""

    def replayer(self) -> Replayer | None:
        """What a heal replays missed syncs through (None: this method cannot replay)."""
        return None

    def fragment_state(self, index: int) -> dict[str, Any]:
        """What a checkpoint holds of fragment ``index`` besides the model (its global copy and
        outer momentum; nothing for a method without them)."""
        return {}

    def load_fragment_state(self, index: int, saved: dict[str, Any]) -> None:  # noqa: B027
        """Take back what :meth:`fragment_state` gave, as loaded."""

    def take_stepped_squares(self) -> torch.Tensor | None:
        """The sum of squares of the average the last outer step took, this rank's shards
        (None: no outer step since the last call)."""
        return None

    def in_flight(self, index: int) -> bool:
        """Whether a fragment's sync started and its result is not here yet (a checkpoint now
        cannot hold it). A method that syncs at once: never."""
        return False

    def has_arrived(self, index: int) -> bool:
        """Whether fragment ``index``'s sync is here, not yet applied (async DiLoCo's, loaded
        from a checkpoint or a peer). A method that applies a sync at once: never."""
        return False

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the method besides model and inner optimizer, by kind
        (``events.OUTER_STATE_KINDS``; kinds it has not left out). Here: the most a running
        sync holds, a copy of the largest fragment (LocalSGD's mean)."""
        return {"buffers": max(self.fragment_bytes(i) for i in range(len(self.fragments)))}

    def fragment_bytes(self, index: int) -> int:
        """Bytes of fragment ``index``'s parameters on this rank (its shards)."""
        return sum(local_tensor(p.data).nbytes for p in self.fragments[index].parameters())

    def extra_state(self, wait: bool = True) -> dict[str, Any]:
        """What else a checkpoint needs to resume exactly (tensors laid out like the
        parameters), with the same keys in every process so a fresh one offers DCP something
        to load into. Most methods: nothing. ``wait=False``: without waiting for a sync in
        flight (a heal within a site)."""
        return {}

    def await_share(self, index: int) -> None:
        """Healed from a group of its site while fragment ``index``'s sync was in flight: take
        the site leader's result of it at its sync point. Only async DiLoCo has a sync in
        flight between steps with sites (``fragment_sync_delay`` is refused with them)."""
        raise NotImplementedError(f"{self.method}: no sync is in flight between steps")

    def load_extra_state(self, state: dict[str, Any]) -> None:  # noqa: B027 (a no-op by default)
        """Take back what :meth:`extra_state` gave, as loaded."""

    def note_committed(self) -> None:  # noqa: B027 (a no-op by default)
        """After a committed sync (LocalSGD: the model is the global parameters now)."""

    def note_joined(self) -> None:  # noqa: B027 (a no-op by default)
        """This group is in the job, at its own inner step (after a checkpoint, or fresh)."""

    def forget_global(self) -> None:  # noqa: B027 (a no-op by default)
        """This group healed from a peer: what it knew of the global parameters is void."""

    def take_verdict(self, fragment: int) -> SyncDecision:
        """The verdict on the sync of ``fragment`` in progress (``SyncQuorum.decide``); its
        outcome is kept for :meth:`last_outcome`."""
        decision = self.sync.decide()
        self._outcome = SyncOutcome.of(decision, fragment)
        return decision

    def last_outcome(self) -> SyncOutcome | None:
        """The sync the last sync point decided, right after it (None: it decided none), with
        the sum of squares of the average its outer step took."""
        squares = self.take_stepped_squares()
        if self._outcome is None:
            return None
        return dataclasses.replace(self._outcome, pseudo_grad_squares=squares)
