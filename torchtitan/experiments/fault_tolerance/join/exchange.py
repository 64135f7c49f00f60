"""What every quorum decides: :meth:`QuorumExchange.on_quorum`, run by every member of a quorum
with enough groups, exchanges roles, start-up attempts, every ``agreement_check_every`` syncs a
digest of the global parameters, and DyLU's step times. Every member decides alike whether to use
the quorum (a new job waits for all its groups) and whether the groups agree; a minority steps
back one sync and heals from the majority, no majority stops the run. Failure semantics are
written once, in docs/fault_tolerance.md ("Semi-synchronous training").
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.components.ft import FaultToleranceError, FTManager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.manager import QuorumRounds
from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.heal.exchange import HealExchange
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.join.speeds import SpeedExchange
from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.sync.quorum import (
    FRESH,
    RESUMED,
    RUNNING,
    Host,
    Member,
    RankInGroup,
    SyncQuorum,
    compare_digests,
    exchange,
)
from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape, mismatch

if TYPE_CHECKING:
    from torchtitan.trainer import TrainState


#: Start-up quorums a new job's groups may take to hold one initial model: the first finds
#: the models differ, the next heals the groups that differ; more are a margin for a quorum
#: that failed on the way.
MAX_INITIAL_MODEL_ROUNDS = 3


@dataclass
class StartUp:
    """A group asking for its first quorum (``QuorumProtocol.start``)."""

    #: ``FRESH`` or ``RESUMED``.
    role: int
    #: Quorums asked for so far (alike on all ranks of the group).
    attempts: int = 0
    #: The position of the peer it healed from in this start-up (None: none).
    peer: dict[str, int] | None = None
    #: A new job's group whose initial model differs from the first group's takes that
    #: group's (its replica id; None: it keeps its own).
    initial_model_from: int | None = None
    #: Start-up quorums of the same members (their heartbeat keys) in which the groups'
    #: initial models differed (alike in every group).
    initial_models_differed: int = 0
    initial_models_members: tuple[int, ...] = ()

    @property
    def healed_from_running(self) -> bool:
        """Whether it holds the running groups' state (then it takes part in their sync)."""
        return self.peer is not None and not self.peer["starting"]


@dataclass
class QuorumFindings:
    """What one quorum's exchange found, alike in every rank of the group (each rank compared
    its own shard's digest: the group acts on what any of its ranks found)."""

    #: A member failed in the exchange: this quorum's sync fails anyway.
    failed: bool
    #: The digests of the global parameters differ.
    disagree: bool
    #: ... and no digest is held by a strict majority.
    no_majority: bool
    #: ... and this group's digest is not the majority's.
    minority: bool
    #: DyLU: the inner steps of this group's next period (0: not planned).
    planned_steps: int = 0
    #: A replay of missed syncs failed (a member said so, or this rank's own did).
    replay_failed: bool = False
    #: This rank was healed in this quorum by a replay / in full (with several ranks a group
    #: must not mix them: each rank's peer decided for its own shards).
    replayed: bool = False
    healed_in_full: bool = False
    #: The members' collectives cannot pair (``shapes.mismatch``).
    shapes_differ: bool = False
    #: This group's digest differs from the initial model's source's
    #: (:func:`initial_model_source`): in a new job, it takes that group's initial model.
    differs_from_first: bool = False

    def as_ints(self) -> list[int]:
        return [int(v) for v in dataclasses.astuple(self)]

    @classmethod
    def from_ints(cls, values: list[int]) -> QuorumFindings:
        failed, disagree, no_majority, minority, steps, *flags = values
        replay_failed, replayed, full, shapes_differ, differs_from_first = (bool(v) for v in flags)
        return cls(
            bool(failed), bool(disagree), bool(no_majority), bool(minority), steps,
            replay_failed, replayed, full, shapes_differ, differs_from_first,
        )  # fmt: skip


@dataclass(eq=False)
class QuorumExchange:
    """The exchange of one rank of a replica group at every quorum."""

    job_config: JobConfig
    ft: FTManager
    sync: SyncQuorum
    algorithm: OuterLoop
    train_state: TrainState
    rank: RankInGroup
    heal: HealExchange
    #: What fixes the shapes of this rank's sync collectives, compared with every member's.
    shape: CollectiveShape
    #: DyLU's plans (None: no DyLU).
    speeds: SpeedExchange | None
    #: The agreement check of the last quorum: "agree", "disagree", or None (not checked).
    agreement: str | None = dataclasses.field(default=None, init=False)
    _checked_quorum: int = dataclasses.field(default=-2, init=False)
    #: The groups' torch versions last said to differ (each mix is said once).
    _versions_told: tuple[str, ...] = dataclasses.field(default=(), init=False)

    def set_manager_step(self, step: int) -> None:
        """Give torchft ``step`` as this group's: below the others', it heals from them."""
        manager = self.ft.manager
        manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})

    def settle(self, rounds: QuorumRounds, start_up: StartUp | None = None) -> None:
        """Form quorums in ``rounds`` until its members use one (:meth:`on_quorum`, alike in
        every member); ``start_up``: this group is asking for its first quorum."""
        rounds.form()
        while not self.on_quorum(start_up):
            rounds.form()

    def on_quorum(self, start_up: StartUp | None = None) -> bool:
        """Exchange roles and digests, and decide alike whether to use the quorum (a starting
        group, ``start_up``, waits for all groups of a new job) and whether the groups agree."""
        manager = self.ft.manager
        ft = self.job_config.fault_tolerance
        if self.heal.shape_refused:  # before any collective of a quorum it cannot take part in
            raise FaultToleranceError(f"[semi-sync] {self.heal.shape_refused}")
        if start_up is not None:
            start_up.attempts += 1
            mine = Member(start_up.role, int(start_up.healed_from_running), start_up.attempts)
        else:
            mine = Member(RUNNING)
        failed_replay = self.heal.replay_failed
        healed = self.heal.take_heal()
        digest = None if failed_replay else self._digest_if_due(start_up is not None)
        mine.replay_failed = int(bool(failed_replay))
        mine.heartbeat = self.sync.heartbeat
        mine.replica = ft.replica_id
        mine.give_shape(self.shape)
        mine.give_host(Host.this())
        if digest is not None:
            mine.has_digest, mine.digest = 1, digest
        if self.speeds is not None:
            mine.step_us = self.speeds.step_us(mine.role)
        members = exchange(manager, mine, self.rank.device, self.sync.transport.timeout)
        self.sync.set_members([m.heartbeat for m in members or []])
        # A prober's record comes from the probe's own exchange: no shapes (nor a sync, below).
        shapes = [(f"replica group {m.replica}", m.shape()) for m in members or [] if not m.probe]
        shapes_differ = mismatch(shapes, self.shape)
        verdict = compare_digests(members or [])
        own = mine.digest if mine.has_digest else None
        first = initial_model_source(members or [mine])
        steps = 0 if self.speeds is None else self.speeds.planned_steps(members or [], mine)
        found = QuorumFindings(
            failed=members is None,
            disagree=not verdict.agree,
            no_majority=not verdict.agree and verdict.majority is None,
            minority=not verdict.agree and own is not None and own != verdict.majority,
            planned_steps=steps,
            replay_failed=bool(failed_replay) or any(m.replay_failed for m in members or []),
            replayed=healed == "replay",
            healed_in_full=healed == "full",
            shapes_differ=bool(shapes_differ),
            differs_from_first=bool(own is not None and first.has_digest and own != first.digest),
        )
        # Each rank exchanged with the same rank of the other groups: the group acts on what any
        # of its ranks found, and all its ranks take the same inner steps.
        found = QuorumFindings.from_ints(self.rank.most(found.as_ints()))
        if found.shapes_differ:
            # Before any collective that depends on them: nobody uses this quorum, and a
            # starting group, the one that does not fit the job, stops.
            manager.report_error(RuntimeError("the groups' collectives cannot pair"))
            if start_up is not None:
                raise FaultToleranceError(
                    "[semi-sync] "
                    + (shapes_differ or "another rank of this group found that the replica "
                       "groups' collectives cannot pair (see its error line)")
                )  # fmt: skip
            return True
        self.agreement = None if not verdict.digests else "disagree" if found.disagree else "agree"
        if found.failed:
            return True
        assert members is not None
        self._tell_torch_versions(members)
        if found.replay_failed or (found.replayed and found.healed_in_full):
            # A joiner's replay failed (on one of its ranks, or its ranks did not all replay):
            # nobody commits this sync, and it heals in full at the next one.
            manager.report_error(RuntimeError("a joining group's replay failed"))
            if healed is not None or failed_replay:  # a rank of the joining group
                problem = failed_replay or (
                    "the ranks of this group did not all replay (a full heal on some)"
                    if found.replayed and found.healed_in_full
                    else "another rank of this group failed its replay"
                )
                events.REPLAY_FAILED.emit(step=self.train_state.step, problem=problem)
                self.heal.replay_reported(problem)
            return True
        if any(m.probe for m in members):
            # Running groups in DyLU's speed probe: meet them at their sync point, healed again
            # there if torchft healed this group from one of them here (mid-period).
            if start_up is not None and start_up.healed_from_running:
                start_up.peer = None
                self.set_manager_step(manager.current_step() - 1)
            return False
        if self.speeds is not None:
            self.speeds.plan(found.planned_steps, members, mine)
        running = any(m.role == RUNNING for m in members)
        if not running and len(members) < ft.group_size:
            # Only starting groups, not all of them: a new job waits for all; a restarted one
            # goes on without a missing group after quorum_timeout_s.
            resumed = any(m.role == RESUMED for m in members)
            grace = math.ceil(ft.quorum_timeout_s / self.ft.poll_s)
            if not resumed or max(m.attempts for m in members) < grace:
                return False
        if running and any(m.role != RUNNING and not m.joined for m in members):
            # A starting group that did not heal from the running ones holds a checkpoint at
            # or beyond their step: it cannot take part in their sync. Nobody commits this
            # one; it heals at the next (its step goes below theirs).
            manager.report_error(RuntimeError("a starting group is ahead of the running job"))
            if start_up is not None and not mine.joined:
                events.CHECKPOINT_AHEAD.emit(step=self.train_state.step)
                self.set_manager_step(manager.current_step() - 1)
            # Its global parameters are not the running job's, and nothing is committed: no
            # disagreement to act on (with two groups that would stop the job).
            return True
        if found.disagree and start_up is not None and all(m.role == FRESH for m in members):
            self._take_one_initial_model(members, start_up, found.differs_from_first)
        elif found.disagree:
            self._act_on_disagreement(members, found.no_majority, found.minority)
        elif start_up is not None and self.speeds is not None:
            self.speeds.probe_if_new_job(members)
        return True

    def _digest_if_due(self, starting: bool) -> int | None:
        """A digest of the global parameters of the last sync, every ``agreement_check_every``
        syncs, whenever the quorum changed (a group (re)joined or left), and at start-up."""
        manager = self.ft.manager
        every = semi_sync_config(self.job_config).agreement_check_every
        quorum = tft.quorum_id(manager)
        due = (
            starting
            or quorum != self._checked_quorum
            or (every > 0 and manager.current_step() % every == 0)
        )
        if not due:
            return None
        self._checked_quorum = quorum
        return self.algorithm.agreement_digest()

    def _take_one_initial_model(
        self, members: list[Member], start_up: StartUp, differs: bool
    ) -> None:
        """A new job whose groups built other initial models from the same seed (their hosts'
        kernels draw other bits): nobody uses this quorum; a group whose model differs from
        the source's (:func:`initial_model_source`) steps its Manager back, so that torchft
        heals it from a group holding that model at the next quorum."""
        manager = self.ft.manager
        manager.report_error(RuntimeError("the groups' initial models differ"))
        source = initial_model_source(members)
        # Rounds with the same members: a group that restarted (a new heartbeat key) draws
        # anew and may take the model again.
        membership = tuple(sorted(m.heartbeat for m in members))
        if membership != start_up.initial_models_members:
            start_up.initial_models_members, start_up.initial_models_differed = membership, 0
        start_up.initial_models_differed += 1
        if start_up.initial_models_differed > MAX_INITIAL_MODEL_ROUNDS:
            # The groups that differed took the source's model, bits and all: no host's draw.
            raise FaultToleranceError(
                f"[semi-sync] the new job's initial models still differ after "
                f"{MAX_INITIAL_MODEL_ROUNDS} start-up quorums of the same groups, in which those "
                f"that differed took replica group {source.replica}'s "
                f"({'; '.join(_holders(members))}): stopping. Check that every group runs the "
                "same config and training.seed."
            )
        differing = [m for m in members if m.has_digest and m.digest != source.digest]
        events.INITIAL_MODELS_DIFFER.emit(
            step=self.train_state.step,
            source=source.replica,
            takes_it=differs,
            groups=_holders(members),
            same_host=[m.replica for m in differing if m.host() == source.host()],
        )
        if differs:
            start_up.initial_model_from = source.replica
            self.heal.expect_full(
                f"a new job's groups start from one initial model, replica group "
                f"{source.replica}'s, and this group's differed"
            )
            self.set_manager_step(manager.current_step() - 1)

    def _tell_torch_versions(self, members: list[Member]) -> None:
        """Say once per mix when the quorum's groups run different torch minor versions."""
        hosts = [(m.replica, m.host()) for m in members]
        known = [(replica, host) for replica, host in hosts if host is not None]
        if len({host.torch_minor() for _, host in known}) <= 1:
            return
        mix = tuple(f"replica group {r}: torch {host.torch}" for r, host in sorted(known))
        if mix != self._versions_told:
            self._versions_told = mix
            events.TORCH_VERSIONS_DIFFER.emit(groups=list(mix))

    def _act_on_disagreement(
        self, members: list[Member], no_majority: bool, minority: bool
    ) -> None:
        manager = self.ft.manager
        distinct = [
            f"{d & (2**64 - 1):016x}" for d in sorted({m.digest for m in members if m.has_digest})
        ]
        holders = _holders(members)
        sync = manager.current_step() + 1
        if no_majority:
            raise FaultToleranceError(
                f"[semi-sync] replica groups disagree on the global parameters before sync "
                f"#{sync} (digests: {'; '.join(holders)}; no majority): stopping rather than "
                "training on diverged copies. Restart the job from one group's checkpoint: "
                "docs/fault_tolerance.md, 'After replica groups disagree'."
            )
        # Nobody commits this sync; the groups that differ from the majority step back one
        # sync, so that torchft heals them from a majority group at the next one.
        manager.report_error(RuntimeError("global parameters disagree"))
        if minority:
            events.DIFFERS_FROM_MAJORITY.emit(sync=sync, digests=distinct, groups=holders)
            self.set_manager_step(manager.current_step() - 1)
        else:
            events.MINORITY_ELSEWHERE.emit(sync=sync, digests=distinct, groups=holders)


def initial_model_source(members: list[Member]) -> Member:
    """The group whose initial model a new job's groups start from: of the kind of host most
    of them run (the fewest full heals), the lowest replica id. Decided from each group's
    host, alike on all its ranks."""
    hosts = Counter(m.host() for m in members)
    most = max(hosts.values())
    return min((m for m in members if hosts[m.host()] == most), key=lambda m: m.replica)


def _holders(members: list[Member]) -> list[str]:
    """Each member that gave a digest: its replica id, the digest (hex) and its host."""
    return [
        f"replica group {m.replica}: {m.digest & (2**64 - 1):016x} ({m.host() or 'host unknown'})"
        for m in members
        if m.has_digest
    ]
