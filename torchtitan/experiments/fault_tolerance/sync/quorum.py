"""The sync quorum of semi-synchronous training: :class:`SyncQuorum`, what the methods sync
through (torchft's Manager, bounded), and the few numbers the groups of a quorum exchange
(:func:`exchange`).

A sync's quorum is the core's bounded quorum wait (``FTManager.quorum_rounds``): at least
``min_replica_size`` groups (a survivor left with fewer waits and says so, rather than train
alone), and ``sync_quorum_timeout_s``, which ends in one error line naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import platform
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchtitan.components.ft import FaultToleranceError, FTManager, QuorumPurpose
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.delivery import AllWorks, all_reduce_across_groups
from torchtitan.components.ft.manager import QuorumRounds
from torchtitan.components.ft.timeouts import WATCHDOG_MARGIN
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.sync.site_link import SiteHeader, SiteLink
from torchtitan.experiments.fault_tolerance.transport.collective import Delivered
from torchtitan.experiments.fault_tolerance.transport.peer_watch import heartbeat_key
from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape
from torchtitan.experiments.fault_tolerance.transport.sync_transport import SyncTransport

if TYPE_CHECKING:
    from torchft.manager import Manager

#: Roles in a quorum: at its sync point; (re)started with no checkpoint; resumed from one.
RUNNING, FRESH, RESUMED = 0, 1, 2


def _pack(text: str) -> int:
    """Up to 8 ASCII characters as one int64 (the exchange carries integers)."""
    return int.from_bytes(text.encode("ascii", "replace")[:8].ljust(8, b"\0"), "little")


def _unpack(value: int) -> str:
    return value.to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii", "replace")


@dataclass(frozen=True)
class Host:
    """What a group computes with, beyond its code: the machine, torch's version, the ATen CPU
    kernels torch picked (``ATEN_CPU_CAPABILITY``) and the GPU (``<arch>x<SMs>``: its number
    of multiprocessors sizes the launch grid that places random draws; ``none``). Groups
    agree bit for bit on any mix (``docs/design.md``, "Bits the groups agree on"); when they
    do not, this tells a user hardware from a bug."""

    machine: str
    torch: str
    kernels: str
    gpu: str = "none"

    @classmethod
    @functools.cache
    def this(cls) -> Host:
        # "2.13.0+cpu", "2.14.0a0+git1234": the release's numbers only
        numbers = re.findall(r"\d+", torch.__version__.split("+")[0])
        release = ".".join((numbers + ["0", "0", "0"])[:3])
        gpu = "none"
        if torch.cuda.is_available():
            found = torch.cuda.get_device_properties(torch.cuda.current_device())
            gpu = f"{found.major}{found.minor}x{found.multi_processor_count}"  # 8 characters
        return cls(platform.machine(), release, torch.backends.cpu.get_cpu_capability(), gpu)

    def torch_minor(self) -> str:
        return ".".join(self.torch.split(".")[:2])

    def __str__(self) -> str:
        gpu = "" if self.gpu == "none" else f", GPU sm{self.gpu}"
        return f"{self.machine}, torch {self.torch}, {self.kernels} kernels{gpu}"

    def as_ints(self) -> tuple[int, int, int, int]:
        major, minor, patch = (int(n) for n in self.torch.split("."))
        version = major * 1_000_000 + minor * 1_000 + patch
        return _pack(self.machine), version, _pack(self.kernels), _pack(self.gpu)

    @classmethod
    def from_ints(cls, machine: int, version: int, kernels: int, gpu: int) -> Host:
        torch_version = f"{version // 1_000_000}.{version // 1_000 % 1_000}.{version % 1_000}"
        return cls(_unpack(machine), torch_version, _unpack(kernels), _unpack(gpu))


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
    #: 1 in DyLU's speed probe (a quorum that is no sync): a group meeting it does not use it.
    probe: int = 0
    #: 1 when this group's replay of its missed syncs failed on arrival: nobody commits this
    #: quorum's sync, and the group heals in full at the next one.
    replay_failed: int = 0
    #: The key this group heartbeats under (``peer_watch``): a sync ends once one is dropped.
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
    #: The group's :class:`Host`, packed (0: not given, e.g. a speed probe's record).
    machine: int = 0
    torch_version: int = 0
    kernels: int = 0
    gpu: int = 0

    def host(self) -> Host | None:
        if not self.torch_version:
            return None
        return Host.from_ints(self.machine, self.torch_version, self.kernels, self.gpu)

    def give_host(self, host: Host) -> None:
        self.machine, self.torch_version, self.kernels, self.gpu = host.as_ints()

    def shape(self) -> CollectiveShape:
        names = [f.name for f in dataclasses.fields(CollectiveShape)]
        return CollectiveShape(**{name: getattr(self, name) for name in names})

    def give_shape(self, shape: CollectiveShape) -> None:
        for name, value in dataclasses.asdict(shape).items():
            setattr(self, name, value)


def exchange(
    manager: Manager, mine: Member, device: torch.device, timeout: timedelta | None = None
) -> list[Member] | None:
    """Every member's :class:`Member`, in quorum order (an all-gather as one SUM all-reduce).
    None when the collective failed (a member died): the Manager is told, so this quorum is
    not committed. The records are read only once they have arrived
    (``delivery.all_reduce_across_groups``: on nccl ``wait`` returns before they are there);
    ``timeout``: the longest the exchange may take (a sync's collective timeout)."""
    fields = len(astuple(mine))
    size, rank = manager.num_participants(), manager.participating_rank()
    buffer = torch.zeros(size * fields, dtype=torch.int64, device=device)
    buffer[rank * fields : (rank + 1) * fields] = torch.tensor(astuple(mine), dtype=torch.int64)
    if not all_reduce_across_groups(manager, buffer, average=False, timeout=timeout):
        return None
    return [Member(*row) for row in buffer.view(size, fields).tolist()]


@dataclass
class Verdict:
    """What the digests of a quorum say."""

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


def in_group_wait(quorum_s: float, heal_s: float, collective_s: float) -> timedelta:
    """How long :meth:`RankInGroup.most` waits for the group's other ranks: how far one rank's
    work across groups may run past another's between two decisions. That is at most a sync
    quorum (``sync_quorum_timeout_s``) and, after it, two operations only that rank still
    waits for, each a heal's piece (``timeout_s``) or a sync's transfer
    (``sync_collective_timeout_s``), plus c10d's margin (``timeouts.WATCHDOG_MARGIN``)."""
    longest = max(heal_s, collective_s)
    return timedelta(seconds=quorum_s + 2 * longest) + WATCHDOG_MARGIN


@dataclass(frozen=True)
class RankInGroup:
    """This rank within its replica group: the device its exchanges run on, and how many ranks
    the group has; they decide alike by taking the largest of each number (:meth:`most`)."""

    device: torch.device
    ranks: int = 1
    #: The group's ranks' own host process group for :meth:`most` (None: one rank).
    host_group: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, device: torch.device, ranks: int, wait: timedelta) -> RankInGroup:
        """Collective over the replica group's ranks (all call it, at start-up). Each rank
        decides right after its own work across groups (a heal, the quorum's exchange, a
        sync's transfers), and ranks sharing one link finish it minutes apart: the decision
        runs on a gloo group of its own whose timeout, ``wait``, outlasts that work, never on
        the device's group, whose watchdog counts from the queueing (and whose collectives
        training's stream would wait for)."""
        if ranks == 1:
            return cls(device)
        return cls(device, ranks, dist.new_group(backend="gloo", timeout=wait))

    def most(self, values: list[int]) -> list[int]:
        """Element by element, the largest of the group's ranks' ``values`` (one MAX
        all-reduce on :attr:`host_group`; a group of one rank decides alone)."""
        if self.ranks == 1:
            return list(values)
        found = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.host_group)
        return [int(v) for v in found.tolist()]


@dataclass(frozen=True)
class SyncDecision:
    """A decided sync (:meth:`SyncQuorum.decide`): the verdict, alike in every group, and what
    this rank's transfers carried."""

    committed: bool
    #: The sync's number: the Manager step a commit makes (a failed one's is retried under it).
    number: int
    #: Replica groups in the sync's quorum.
    groups: int
    #: Bytes this rank sent and, compressed, its seconds (de)compressing (None: uncompressed).
    bytes_sent: int
    compression_s: float | None
    #: The sum of squares of the sync's result, this rank's (None: a transfer has none; 0.0:
    #: no transfer carried it here, e.g. a sync loaded from a checkpoint).
    squares: float | None
    #: Committed, with ``keep_delivered``: the results as every group received them, in order.
    delivered: list[Delivered]


class SyncQuorum:
    """torchft's Manager as the methods see it: ``sync_rounds`` is the bounded sync quorum,
    ``allreduce`` goes through the sync's :class:`~.sync_transport.SyncTransport`, ``decide``
    counts in the core's failure accounting and returns the sync's record; the rest is
    torchft's Manager's answers, typed.

    The members of a quorum use it once each has accepted it alike (``join.exchange``, which
    forms another otherwise). A sync is for fragment
    ``step mod fragments`` (the Manager's step after its quorum: a heal in it moves this group
    to its peer's sync). ``rank``: this rank in its group, whose ranks decide alike (None: a
    group of one).

    With sites of groups (``site``): only the site's leader runs the job's Manager and the
    sync's transfers; it then shares the decision and the results with the site's other groups
    (:class:`~.site_link.SiteLink`), whose ``allreduce`` only marks what the leader's results
    go into and whose ``decide`` takes them."""

    def __init__(
        self,
        ft: FTManager,
        min_groups: int,
        timeout_s: float,
        *,
        transport: SyncTransport,
        fragments: int = 1,
        rank: RankInGroup | None = None,
        site: SiteLink | None = None,
    ) -> None:
        self.ft = ft
        self.site = site
        #: The tensors of the sync in progress, in the order they were given to ``allreduce``,
        #: and whether each went exact (uncompressed, no error feedback: e.g. token counts).
        self._sent: list[tuple[torch.Tensor, bool]] = []

        self.min_groups = min_groups
        self.timeout_s = timeout_s
        self.transport = transport
        self.fragments = fragments
        #: Inside a sync quorum (a peer healing from it then gets the state of a sync point).
        self.in_quorum = False
        #: Seconds the last sync quorum took (waiting for the others, healing a joiner).
        self.last_wait = 0.0
        #: Syncs in a row that failed on a collective timeout, and the quorum size then.
        self._timeouts_in_a_row = 0
        self._timeout_groups = 0
        self.rank = rank
        self._members: tuple[int, ...] = ()
        self._heartbeat: tuple[Any, int] | None = None

    def leads(self) -> bool:
        """Whether this group carries the syncs (with sites: its site's leader; else always)."""
        return self.site is None or self.site.leads()

    def expect(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """The tensors the sync in progress delivers into, and whether each goes exact (a
        group healed while it was in flight, which did not start it): what a follower takes
        its leader's results into."""
        self._sent = list(tensors)

    def site_tokens(self, tokens: int) -> int:
        """The tokens of this group's site for ``tokens`` per group: every group of the site
        trained the same steps (``tokens`` without sites)."""
        return tokens if self.site is None else tokens * self.site.site_groups()

    def agree_in_group(self, value: int) -> int:
        """The most of this group's ranks' ``value`` (one MAX all-reduce in the group)."""
        return value if self.rank is None else self.rank.most([value])[0]

    @property
    def heartbeat(self) -> int:
        """The key this group heartbeats to the lighthouse under (``peer_watch``)."""
        manager = self.ft.manager
        if self._heartbeat is None or self._heartbeat[0] is not manager:
            # A site's leader starts a new Manager when it leads again: a new id.
            self._heartbeat = (manager, heartbeat_key(tft.heartbeat_id(manager)))
        return self._heartbeat[1]

    def set_members(self, heartbeats: list[int]) -> None:
        """The heartbeat keys of the quorum just formed: the sync it starts watches them."""
        self._members = tuple(heartbeats)

    def allreduce(
        self,
        tensor: torch.Tensor,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
        *,
        exact: bool = False,
    ) -> AllWorks:
        """Through the sync's transport; ``exact``: as fp32 without error feedback (e.g. token
        counts), in order with the rest. A follower of its site sends nothing: its leader's
        results go into ``tensor`` in :meth:`decide`."""
        self._sent.append((tensor, exact))
        if not self.leads():
            return AllWorks([])
        return self.transport.allreduce(
            self.ft.manager, tensor, average=reduce_op == ReduceOp.AVG, exact=exact
        )

    def sync_failed(self) -> bool:
        """Whether the sync in progress is known to fail: an error, or a non-finite value. A
        follower of its site: always, as nothing of it is here before :meth:`decide`."""
        if not self.leads():
            return True
        return self.ft.manager.errored() is not None or self.transport.non_finite() is not None

    def reset_error_feedback(self) -> None:
        """Forget the residuals (after a heal: they belong to state this group no longer has)."""
        if self.transport.residuals is not None:
            self.transport.residuals.reset()

    def discard_undecided(self) -> None:
        """A sync never to be decided (dropped at the end of training): what it staged is void."""
        self._sent = []
        self.transport.end_sync(False)

    @contextlib.contextmanager
    def sync_rounds(self) -> Iterator[QuorumRounds]:
        """The sync's quorum: in the block, ``QuorumRounds.form`` joins one of at least
        ``min_groups`` groups, bounded by ``sync_quorum_timeout_s``, until its members accept
        one alike (``join.exchange``); the one formed last is the sync's, whose transfers
        start when the block ends."""
        sync = self.ft.manager.current_step() + 1
        self.in_quorum = True
        start = time.perf_counter()
        try:
            with self._rounds(QuorumPurpose(f"sync #{sync}", sync=sync)) as rounds:
                yield rounds
        finally:
            self.last_wait = time.perf_counter() - start
            self.in_quorum = False
        self.begin_sync()

    def probe_rounds(self) -> contextlib.AbstractContextManager[QuorumRounds]:
        """DyLU's speed probe: quorums as :meth:`sync_rounds`' that are no sync (nothing is
        committed, the Manager's step stays), in which the groups exchange their speeds."""
        return self._rounds(QuorumPurpose("DyLU's speed probe"))

    def _rounds(self, purpose: QuorumPurpose) -> contextlib.AbstractContextManager[QuorumRounds]:
        # Sites join the job at their first sync point: a new job's first sync waits for every
        # site, as a new job's start-up waits for every group without sites. The Manager's own
        # rule (None) decides it once the quorum is formed, after a heal to a running job.
        needed = None if self.site is not None else self.min_groups
        return self.ft.quorum_rounds(
            needed=needed,
            timeout_s=self.timeout_s,
            timeout_field="fault_tolerance.sync_quorum_timeout_s",
            purpose=purpose,
        )

    def joined_sync(self, waited_s: float) -> None:
        """This group joins the running groups' sync at their sync point, after waiting
        ``waited_s`` for them: the wait its report gives (``last_wait``)."""
        self.last_wait = waited_s

    def begin_sync(self) -> None:
        """A sync's quorum is in (or a starting group's first): its transfers are numbered from
        0, for the fragment it syncs, and watched for a member gone."""
        members = self._members
        self.transport.begin_sync(
            self.ft.manager,
            self.current_step() % self.fragments,
            members,
            self.heartbeat if members else 0,
        )

    def decide(self) -> SyncDecision:
        """torchft's verdict, after the sync's transfers are done, and what they carried. A sync
        that carried a value that is not finite fails on every group; a collective that failed
        or ended past ``sync_collective_timeout_s`` is said in an error line, and stops the run
        the second time in a row with every group still in the quorum (the timeout is too
        small, not a peer gone). The group's ranks agree on the latter first.

        With sites, the leader sends its site what it decided and received; a follower takes
        it (not committed when it did not arrive)."""
        sent, self._sent = self._sent, []
        if not self.leads():
            return self._follow(sent)
        fragment = self.transport.fragment
        decision = self._decide()
        if self.site is not None:
            tensors = [t for t, _ in sent]
            residuals = self.transport.residuals
            if decision.committed and residuals is not None:
                # What the site's compression owes now, so that any group of it can carry the
                # next sync (this rank's shards: its peer ranks' residuals are their own).
                owed = residuals.flat(fragment, _compressed_numel(sent))
                tensors.append(owed.to(sent[0][0].device))
            header = SiteHeader(
                decision.committed, decision.number, decision.groups, decision.bytes_sent,
                decision.squares, len(tensors), fragment,
            )  # fmt: skip
            self.site.send(header, tensors)
            self.site.settle(True)
        return decision

    def _follow(self, sent: list[tuple[torch.Tensor, bool]]) -> SyncDecision:
        """A follower's decision: its leader's, the results into ``sent`` (and what the
        leader's compression owes into this group's residuals); kept for a heal history as
        fp32, as they arrived."""
        assert self.site is not None
        tensors = [t for t, _ in sent]
        residuals = self.transport.residuals
        owed = None
        if residuals is not None and sent:
            owed = torch.zeros(_compressed_numel(sent), device=tensors[0].device)
            tensors.append(owed)
        header, holds = self.site.receive(tensors)
        # Alike on every rank of the group: a rank whose share failed leaves its shards out of
        # step with the others', so the whole group drops the sync and heals from its site.
        holds = not self.agree_in_group(int(not holds))
        self.site.settle(holds)
        if header is None or not header.committed or not holds:
            groups = 0 if header is None else header.groups
            return SyncDecision(False, self.current_step() + 1, groups, 0, None, None, [])
        if residuals is not None and owed is not None:
            residuals.load(header.fragment, owed.cpu())
        batches = int(self.ft.state_dict().get("batches_committed", 0)) + header.groups
        self.ft.load_state_dict({"step": header.number, "batches_committed": batches})
        delivered = []
        if self.transport.keep_delivered:
            delivered = [
                Delivered.kept("float32", t.numel(), 1, 1.0, t.detach().to("cpu", copy=True))
                for t, exact in sent
                if not exact
            ]
        return SyncDecision(True, header.number, header.groups, 0, None, header.squares, delivered)

    def _decide(self) -> SyncDecision:
        groups = self.num_participants()
        committed = self._verdict()
        transport = self.transport
        sent, compression_s = transport.stats()
        return SyncDecision(
            committed,
            self.current_step() + (0 if committed else 1),
            groups,
            sent,
            compression_s,
            transport.squares(),
            transport.delivered() if committed and transport.keep_delivered else [],
        )

    def _verdict(self) -> bool:
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
        """The job Manager's step (a follower of its site: the one its leader's syncs made)."""
        if not self.ft.started:
            return int(self.ft.state_dict()["step"])
        return int(self.ft.manager.current_step())

    def num_participants(self) -> int:
        """Groups (with sites: sites) in the last sync's quorum."""
        if not self.ft.started:
            return self.site.job_groups if self.site is not None else 0
        return int(self.ft.manager.num_participants())

    def allow_state_dict_read(self) -> None:
        """Peers may read this group's state for a heal again: a heal sends what the kernels
        queued so far write (``FTManager``'s write point)."""
        self.ft.note_state_written()
        if self.ft.started:
            self.ft.manager.allow_state_dict_read()

    def disallow_state_dict_read(self) -> None:
        if self.ft.started:
            self.ft.manager.disallow_state_dict_read()


def _compressed_numel(sent: list[tuple[torch.Tensor, bool]]) -> int:
    """Values of a sync's tensors that travel compressed (what error feedback owes over)."""
    return sum(t.numel() for t, exact in sent if not exact)
