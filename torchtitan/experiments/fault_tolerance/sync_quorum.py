"""The sync quorum of semi-synchronous training: what torchft's LocalSGD and DiLoCo are given as
their Manager, and the few numbers the groups of a quorum exchange before they sync.

torchft's algorithms call ``manager.start_quorum()`` at each sync point and then all-reduce.
:class:`SyncManager` stands in for the Manager there (everything else goes to torchft's Manager
unchanged) and turns that call into the core's bounded quorum wait
(``FTManager.join_quorum``): at least ``min_replica_size`` groups (a survivor left with fewer
waits, and says so, instead of training alone and discarding every period), a timeout of its own
(``fault_tolerance.sync_quorum_timeout_s``, sized for periods of minutes) that ends in one error
line naming the field, and an ``accept`` check that every member of the quorum makes alike
after :func:`exchange`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

from torchtitan.components.ft import FTManager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.torchft_adapter import ManagerStandIn
from torchtitan.experiments.fault_tolerance.compression import (
    AsyncCompressedAllReduce,
    CompressedWork,
    ErrorFeedback,
    sent_and_seconds,
)

#: Roles in a quorum: a group at its sync point, and a group that has just (re)started (with
#: no checkpoint, or resumed from one).
RUNNING, FRESH, RESUMED = 0, 1, 2


@dataclass
class Member:
    """What one group tells the others of its quorum."""

    role: int
    #: A starting group that healed from a running group in this start-up (it holds their state).
    joined: int = 0
    #: Quorums this group has asked for since it started (alike on all its ranks).
    attempts: int = 0
    #: 1 when ``digest`` is given: a 64-bit digest of the global parameters of the last sync.
    has_digest: int = 0
    digest: int = 0
    #: DyLU: this group's microseconds per inner step in its last period (0: not measured).
    step_us: int = 0


def exchange(manager: Any, mine: Member, device: torch.device) -> list[Member] | None:
    """Every member's :class:`Member`, in quorum order: an all-gather written as one SUM
    all-reduce over the replica process group (each member fills its own slot). None when the
    collective failed (a member died): torchft then fails this quorum's commit anyway."""
    fields = len(astuple(mine))
    size, rank = manager.num_participants(), manager.participating_rank()
    buffer = torch.zeros(size * fields, dtype=torch.int64, device=device)
    buffer[rank * fields : (rank + 1) * fields] = torch.tensor(astuple(mine), dtype=torch.int64)
    manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    rows = buffer.view(size, fields).tolist()
    return [Member(*row) for row in rows]


@dataclass
class Verdict:
    """What the digests of a quorum say: all equal, or who disagrees."""

    digests: list[int]
    #: The digest held by more than half of the members that gave one, if any.
    majority: int | None

    @property
    def agree(self) -> bool:
        return len(set(self.digests)) <= 1


def compare_digests(members: list[Member]) -> Verdict:
    digests = [m.digest for m in members if m.has_digest]
    counts = {d: digests.count(d) for d in digests}
    top = max(counts, key=counts.__getitem__) if counts else None
    majority = top if top is not None and 2 * counts[top] > len(digests) else None
    return Verdict(digests, majority)


class SyncManager(ManagerStandIn):
    """torchft's Manager as LocalSGD/DiLoCo see it: ``start_quorum`` is the gated sync quorum
    (always synchronous), ``should_commit`` counts in the core's failure accounting; all else
    is torchft's own.

    ``on_quorum`` runs in every member of a quorum that has enough groups (it may exchange a
    few numbers) and returns whether the quorum is used; all members must decide alike.

    With :meth:`compress` (``fault_tolerance.pseudo_grad_dtype``), ``allreduce`` sends
    pseudo-gradients compressed (``compression.py``), in order on one background thread, with
    torchft's failure semantics: an error is reported to the Manager (the sync is not
    committed, nothing is applied) and ``wait`` does not raise.
    """

    def __init__(
        self,
        ft: FTManager,
        min_groups: int,
        timeout_s: float,
        on_quorum: Callable[[], bool],
    ) -> None:
        self.ft = ft
        self.min_groups = min_groups
        self.timeout_s = timeout_s
        self.on_quorum = on_quorum
        #: True while this group is inside a sync quorum (a peer healing from it then gets
        #: the state of a sync point).
        self.in_quorum = False
        #: Seconds the last sync quorum took (waiting for the others, healing a joiner).
        self.last_wait = 0.0
        self.dtype = "float32"
        self._runner: AsyncCompressedAllReduce | None = None
        self.error_feedback: ErrorFeedback | None = None
        #: Names the tensors of a sync for error feedback: (fragment, index of the call).
        self._fragment_of_sync: Callable[[], int] = lambda: 0
        self._calls = 0
        #: The compressed collectives started since the last quorum (their stats: the bytes
        #: this group really sent, the compression time).
        self.works: list[CompressedWork] = []

    def compress(
        self, dtype: str, error_feedback: bool, fragment_of_sync: Callable[[], int]
    ) -> None:
        """Send pseudo-gradients as ``dtype`` (``float32``: uncompressed, torchft's own
        all-reduce); with ``error_feedback`` each group adds what its compression dropped
        to its next pseudo-gradient of the same tensor."""
        self.dtype = dtype
        if dtype != "float32":
            self._runner = AsyncCompressedAllReduce()
            self.error_feedback = ErrorFeedback() if error_feedback else None
            self._fragment_of_sync = fragment_of_sync

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
        *,
        key: str | None = None,
        exact: bool = False,
    ) -> Any:
        """torchft's ``Manager.allreduce``, compressed when :meth:`compress` says so. ``key``
        names the tensor for error feedback (default: the fragment being synced and the
        order of the call since the quorum, the same in every sync of that fragment);
        ``exact`` sends it uncompressed (e.g. token counts), still in order with the rest."""
        manager = self.ft.manager
        if self._runner is None:
            return manager.allreduce(tensor, should_quantize=should_quantize, reduce_op=reduce_op)
        if key is None:
            key = ErrorFeedback.fragment_key(self._fragment_of_sync(), self._calls)
        self._calls += 1
        if manager.errored() is not None:  # torchft: after an error, the rest are no-ops
            work = CompressedWork(tensor)
            work.complete()
            return work
        if not manager.is_participating():
            tensor.zero_()  # a healing group sends nothing
        work = self._runner.submit(
            tft.replica_process_group(manager),
            tensor.view(-1),  # the codec takes flat tensors; a view, so results land in place
            "float32" if exact else self.dtype,
            divide_by=manager.num_participants() if reduce_op == ReduceOp.AVG else 1,
            error_feedback=None if exact else self.error_feedback,
            key=key,
            on_error=manager.report_error,
        )
        if not exact:
            self.works.append(work)
        return work

    def compressed_stats(self) -> tuple[int, float] | None:
        """Bytes this group sent and seconds it spent compressing and decompressing in the
        compressed all-reduces since the last quorum (waiting for them). None: uncompressed."""
        if self._runner is None:
            return None
        for work in self.works:
            work.wait()
        return sent_and_seconds(self.works) or (0, 0.0)

    def reset_error_feedback(self) -> None:
        """Forget the residuals (after a heal: they belong to state this group no longer has)."""
        if self.error_feedback is not None:
            self.error_feedback.reset()

    def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.shutdown()

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        self.ft.waiting_sync = self.ft.manager.current_step() + 1
        self.in_quorum = True
        self._calls = 0
        self.works = []
        start = time.perf_counter()
        try:
            self.ft.join_quorum(
                needed=self.min_groups,
                timeout_s=self.timeout_s,
                timeout_field="fault_tolerance.sync_quorum_timeout_s",
                accept=self.on_quorum,
            )
        finally:
            self.last_wait = time.perf_counter() - start
            self.in_quorum = False
            self.ft.waiting_sync = None

    def should_commit(self, timeout: Any = None) -> bool:
        return self.ft.should_commit(unit="sync")

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.ft.register_state_dict_fn(key, load, save)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ft.manager, name)
