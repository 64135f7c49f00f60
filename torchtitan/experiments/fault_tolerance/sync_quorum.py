"""The sync quorum of semi-synchronous training: the Manager the methods sync through, and the
few numbers the groups of a quorum exchange before they sync.

A method asks for a sync's quorum at each sync point and then all-reduces. :class:`SyncManager`
is its Manager (with typed forwarders to torchft's Manager for the rest the methods ask) and
makes the quorum the core's bounded quorum wait (``FTManager.join_quorum``): at least
``min_replica_size`` groups (a survivor left with fewer waits, and says so, instead of training
alone and discarding every period), a timeout of its own (``fault_tolerance.sync_quorum_timeout_s``,
sized for periods of minutes) that ends in one error line naming the field, and an ``accept``
check that every member of the quorum makes alike after :func:`exchange`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchtitan.components.ft import FaultToleranceError, FTManager, QuorumPurpose
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.compression import Delivered
from torchtitan.experiments.fault_tolerance.peer_watch import heartbeat_key
from torchtitan.experiments.fault_tolerance.shapes import CollectiveShape
from torchtitan.experiments.fault_tolerance.transport import (
    FragmentResiduals,
    SyncTransport,
    TransferWork,
)

if TYPE_CHECKING:
    from torch.distributed import Work
    from torchft.manager import Manager

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
    #: 1 in DyLU's speed probe (a quorum of the job's first period that is no sync): a group
    #: that meets a probing one in its own quorum does not use that quorum.
    probe: int = 0
    #: 1 when this group's replay of its missed syncs failed on arrival: nobody commits this
    #: quorum's sync, and the group heals in full at the next one.
    replay_failed: int = 0
    #: The key of the id this group heartbeats to the lighthouse under (``peer_watch``): the
    #: sync's transfers end as soon as the lighthouse drops a member.
    heartbeat: int = 0
    #: This group's ``fault_tolerance.replica_id``.
    replica: int = 0
    #: What fixes the shapes of its collectives (``shapes.CollectiveShape``), field by field.
    ranks: int = 0
    fragments: int = 0
    shard_values: int = 0
    bucket_values: int = 0
    dtype: int = 0
    layout: int = 0

    def shape(self) -> CollectiveShape:
        return CollectiveShape(
            self.ranks,
            self.fragments,
            self.shard_values,
            self.bucket_values,
            self.dtype,
            self.layout,
        )

    def give_shape(self, shape: CollectiveShape) -> None:
        for name, value in dataclasses.asdict(shape).items():
            setattr(self, name, value)


def exchange(manager: Manager, mine: Member, device: torch.device) -> list[Member] | None:
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


def most_in_group(values: list[int], device: torch.device) -> list[int]:
    """Element by element, the largest of this replica group's ranks' ``values`` (one MAX
    all-reduce in the group's default process group): how its ranks decide alike."""
    found = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return [int(v) for v in found.tolist()]


class ProbeInFlight:
    """DyLU's speed probe under way: ``run`` (its quorum and exchange) in a daemon thread,
    on the training thread's accelerator device, while the training thread goes on with its
    inner steps. Nothing else uses the replica process group or the Manager's quorum
    meanwhile: a new job's first period has no sync in flight, and the next quorum (the
    first sync point, or the end of training) waits for this one (:meth:`finish`). A peer
    that heals in the probe's quorum reads this group's state only while the training
    thread waits in :meth:`finish` (async DiLoCo keeps state reads disallowed until then)."""

    def __init__(self, run: Callable[[], None], after: Callable[[], None]) -> None:
        self._after = after
        self._error: BaseException | None = None
        # A new thread starts on device 0: torchft's quorum takes the caller's device.
        accelerator = torch.accelerator.is_available()
        device = torch.accelerator.current_device_index() if accelerator else None
        self._thread = threading.Thread(
            target=self._run, args=(run, device), name="dylu-speed-probe", daemon=True
        )
        self._thread.start()

    def _run(self, run: Callable[[], None], device: int | None) -> None:
        try:
            if device is not None:
                torch.accelerator.set_device_index(device)
            run()
        except BaseException as e:  # raised in the training thread, by finish()
            self._error = e

    def done(self) -> bool:
        """Whether the probe's quorum and exchange are over (this rank's)."""
        return not self._thread.is_alive()

    def finish(self) -> None:
        """Wait for the probe, raise what it raised (e.g. its quorum timed out), then run
        ``after`` here, in the training thread."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._after()


def most_of_one_in_group(value: int, device: torch.device) -> int:
    """The largest of this replica group's ranks' ``value``."""
    return most_in_group([value], device)[0]


class SyncManager:
    """torchft's Manager as LocalSGD/DiLoCo (and async DiLoCo) see it: ``start_quorum`` is the
    gated sync quorum (always synchronous), ``allreduce`` goes through the sync's
    :class:`~.transport.SyncTransport` (buckets of its own, ``pseudo_grad_dtype`` on the wire,
    finite checks, a timeout sized for periods), ``should_commit`` counts in the core's failure
    accounting and fails a sync that carried a non-finite value; the rest the methods ask
    (``current_step``, ``num_participants``, ``errored``, ``report_error``, the state-read
    gates) is forwarded to torchft's Manager, typed.

    Each quorum is given its exchange (``accept``): it runs in every member of a quorum that
    has enough groups (it may exchange a few numbers) and returns whether the quorum is used;
    all members decide alike (``QuorumProtocol.on_quorum``).
    ``fragments``: the method's fragment count; a sync is for fragment ``step mod fragments``
    (the Manager's step after its quorum: a heal in it moves this group to its peer's sync).
    ``agree_in_group``: the most of this group's ranks' numbers (a MAX all-reduce in a group
    of several ranks), so that they decide alike whether a sync timed out.
    """

    def __init__(
        self,
        ft: FTManager,
        min_groups: int,
        timeout_s: float,
        *,
        transport: SyncTransport,
        fragments: int = 1,
        agree_in_group: Callable[[int], int] = lambda n: n,
    ) -> None:
        self.ft = ft
        self.min_groups = min_groups
        self.timeout_s = timeout_s
        self.transport = transport
        self.fragments = fragments
        #: True while this group is inside a sync quorum (a peer healing from it then gets
        #: the state of a sync point).
        self.in_quorum = False
        #: Seconds the last sync quorum took (waiting for the others, healing a joiner).
        self.last_wait = 0.0
        #: Syncs in a row that failed on a collective timeout, and the quorum size then.
        self._timeouts_in_a_row = 0
        self._timeout_groups = 0
        self.agree_in_group = agree_in_group
        #: The heartbeat keys of the last quorum's members (:meth:`set_members`).
        self._members: tuple[int, ...] = ()
        self._heartbeat: int | None = None

    @property
    def heartbeat(self) -> int:
        """The key of the id this group heartbeats to the lighthouse under (``peer_watch``)."""
        if self._heartbeat is None:
            self._heartbeat = heartbeat_key(tft.heartbeat_id(self.ft.manager))
        return self._heartbeat

    def set_members(self, heartbeats: list[int]) -> None:
        """The quorum just formed has these members (their heartbeat keys, from its exchange):
        the sync it starts watches them."""
        self._members = tuple(heartbeats)

    @property
    def dtype(self) -> str:
        return self.transport.dtype

    @property
    def residuals(self) -> FragmentResiduals | None:
        """The error-feedback residuals by fragment (None: no error feedback)."""
        return self.transport.residuals

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
        *,
        exact: bool = False,
    ) -> TransferWork | Work:
        """torchft's ``Manager.allreduce``, through the sync's transport; ``exact`` sends the
        tensor as fp32 without error feedback (e.g. token counts), in order with the rest.
        ``should_quantize`` is torchft's own fp8 all-reduce (CUDA and Triton only), which
        goes through torchft's Manager as it is."""
        manager = self.ft.manager
        if should_quantize:
            return manager.allreduce(tensor, should_quantize=True, reduce_op=reduce_op)
        return self.transport.allreduce(
            manager, tensor, average=reduce_op == ReduceOp.AVG, exact=exact
        )

    def flush(self) -> None:
        """Send what the transport still holds of this sync's tensors."""
        self.transport.flush()

    def sync_stats(self) -> tuple[int, float | None]:
        """Bytes this group sent in the last sync and, compressed, seconds spent compressing
        and decompressing (waiting for its transfers)."""
        return self.transport.stats()

    def delivered(self) -> list[Delivered]:
        """After a committed sync: what its transfers delivered, as every group received it
        (the heal history keeps it; ``SyncTransport.delivered``)."""
        return self.transport.delivered()

    def sync_squares(self) -> float | None:
        """The sum of squares of this sync's result, this rank's (``SyncTransport.squares``)."""
        return self.transport.squares()

    def sync_failed(self) -> bool:
        """Whether the sync in progress is already known to fail (after its works are done):
        an error recorded, or a value that was not finite."""
        return self.ft.manager.errored() is not None or self.transport.non_finite() is not None

    def reset_error_feedback(self) -> None:
        """Forget the residuals (after a heal: they belong to state this group no longer has)."""
        if self.transport.residuals is not None:
            self.transport.residuals.reset()

    def wait_for_transfers(self) -> None:
        """Every transfer of the sync in progress done (a checkpoint reads what they stage)."""
        self.transport.wait()

    def discard_undecided(self) -> None:
        """A sync that will never be decided (dropped at the end of training): what it staged
        is void."""
        self.transport.end_sync(False)

    def shutdown(self) -> None:
        self.transport.shutdown()

    def start_quorum(self, accept: Callable[[], bool]) -> None:
        """The sync's quorum: the lighthouse's, through ``FTManager.join_quorum``, with
        ``sync_quorum_timeout_s`` and ``accept``, the exchange its members run."""
        sync = self.ft.manager.current_step() + 1
        self.in_quorum = True
        start = time.perf_counter()
        try:
            self.ft.join_quorum(
                needed=self.min_groups,
                timeout_s=self.timeout_s,
                timeout_field="fault_tolerance.sync_quorum_timeout_s",
                accept=accept,
                purpose=QuorumPurpose(f"sync #{sync}", sync=sync),
            )
        finally:
            self.last_wait = time.perf_counter() - start
            self.in_quorum = False
        self.begin_sync()

    def start_probe(self, accept: Callable[[], bool], after: Callable[[], None]) -> ProbeInFlight:
        """DyLU's speed probe (:meth:`probe_quorum`) in a thread of its own: the group takes
        its next inner steps while the probe's quorum forms. ``ProbeInFlight.finish``, in the
        training thread, then runs ``after`` (which plans the rest of the period)."""
        return ProbeInFlight(lambda: self.probe_quorum(accept), after)

    def probe_quorum(self, accept: Callable[[], bool]) -> None:
        """DyLU's speed probe in the job's first period: a quorum that is no sync, in which
        ``accept`` exchanges the groups' speeds (nothing else is sent; nothing is committed:
        the Manager's step stays). Bounded by ``sync_quorum_timeout_s``, like a sync's."""
        self.ft.join_quorum(
            needed=self.min_groups,
            timeout_s=self.timeout_s,
            timeout_field="fault_tolerance.sync_quorum_timeout_s",
            accept=accept,
            purpose=QuorumPurpose("DyLU's speed probe"),
        )

    def begin_sync(self) -> None:
        """The quorum of a sync is in (this one's, or a starting group's first): its transfers
        are numbered from 0, for the fragment it syncs, and watched for a member gone."""
        members = self._members
        self.transport.begin_sync(
            self.ft.manager,
            self.current_step() % self.fragments,
            members,
            self.heartbeat if members else 0,
        )

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """The sync's verdict (every rank of the group alike, torchft's ``should_commit``),
        after its transfers are done. A sync that carried a value that is not finite fails
        here on every group (each group's result shows it); a collective that failed or ended
        past ``sync_collective_timeout_s`` is said in an error line, and stops the run the
        second time in a row with every group still in the quorum (the timeout is too small
        for the transfer, not a peer gone). The group's ranks agree on the latter first."""
        manager = self.ft.manager
        found = self.transport.non_finite()
        if found is not None:
            sync = manager.current_step() + 1
            events.NON_FINITE.emit(
                sync=sync,
                fragment=self.transport.fragment,
                origin="this group" if found == "sent" else "another group",
                group=self.ft.replica_id if found == "sent" else None,
            )
            if manager.errored() is None:
                manager.report_error(
                    FloatingPointError(f"sync #{sync}: a pseudo-gradient was not finite")
                )
        groups = manager.num_participants()
        gone = self.transport.peer_gone
        if gone is not None:
            events.PEER_GONE.emit(sync=manager.current_step() + 1, message=str(gone))
        committed = False
        try:
            committed = self.ft.should_commit(unit="sync")
        finally:
            self.transport.end_sync(committed)
        timed_out = self.transport.timed_out
        if not self.agree_in_group(int(timed_out is not None)):
            self._timeouts_in_a_row = 0
            return committed
        message = str(timed_out or "a transfer timed out on another rank of this group")
        same_groups = self._timeouts_in_a_row > 0 and groups >= self._timeout_groups
        self._timeouts_in_a_row += 1
        self._timeout_groups = groups
        events.COLLECTIVE_TIMEOUT.emit(
            sync=manager.current_step() + 1, message=message, in_a_row=self._timeouts_in_a_row
        )
        if same_groups:
            raise FaultToleranceError(
                f"[semi-sync] {self._timeouts_in_a_row} syncs in a row timed out with all "
                f"{groups} groups still in the quorum: {message}"
            )
        return committed

    # ---- the rest of what the methods ask of a Manager: torchft's answers ------------------

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        self.ft.register_state_dict_fn(key, load, save)

    def current_step(self) -> int:
        return int(self.ft.manager.current_step())

    def num_participants(self) -> int:
        return int(self.ft.manager.num_participants())

    def errored(self) -> Exception | None:
        return self.ft.manager.errored()

    def report_error(self, error: Exception) -> None:
        self.ft.manager.report_error(error)

    def allow_state_dict_read(self) -> None:
        """Peers may read this group's state for a heal again: what the kernels queued so far
        write (this step's optimizer step) is what a heal sends (``FTManager``'s write point:
        the sender waits for it)."""
        self.ft.note_state_written()
        self.ft.manager.allow_state_dict_read()

    def disallow_state_dict_read(self) -> None:
        self.ft.manager.disallow_state_dict_read()
