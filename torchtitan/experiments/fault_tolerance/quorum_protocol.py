"""How a replica group enters the job, and what every quorum of it decides.

* **Start-up and join** (:meth:`QuorumProtocol.start`): a group asks for its first quorum as
  soon as its Manager runs. Until it is in, it announces a Manager step one below its own, so
  that torchft heals it from a running group (or from a starting one with a newer
  checkpoint); healed at a running group's sync point, it takes part in that sync.
* **The exchange at every quorum** (:meth:`QuorumProtocol.on_quorum`, run by every member of
  a quorum with enough groups): roles, start-up attempts, every ``agreement_check_every``
  syncs a digest of the global parameters, and DyLU's step times (``sync_quorum.exchange``).
  Every member decides alike whether to use the quorum (a new job waits for all its groups)
  and whether the groups agree (:class:`QuorumFindings`); a minority steps back one sync and
  heals from the majority, no majority stops the run.
* **Healing** (:meth:`QuorumProtocol.position` / :meth:`QuorumProtocol.load_peer`): the
  sending group's position in its period and lineage travel with torchft's state.

Failure semantics are written once, in docs/fault_tolerance.md ("Semi-synchronous training").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.components.ft import FaultToleranceError, FTManager, QuorumPurpose
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.heal_transport import HealExchange
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.lineage import Lineage
from torchtitan.experiments.fault_tolerance.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.reporting import SyncReporter
from torchtitan.experiments.fault_tolerance.shapes import CollectiveShape, mismatch
from torchtitan.experiments.fault_tolerance.speed_exchange import SpeedExchange
from torchtitan.experiments.fault_tolerance.sync_quorum import (
    FRESH,
    RESUMED,
    RUNNING,
    Member,
    ProbeInFlight,
    SyncManager,
    compare_digests,
    exchange,
)

if TYPE_CHECKING:
    from torchtitan.trainer import TrainState


@dataclass(frozen=True)
class JoinAtSync:
    """A starting group healed from a running group inside that group's sync quorum: it takes
    part in the sync now, at the peer's inner step."""

    local_step: int
    peer: int
    waited_s: float


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

    def as_ints(self) -> list[int]:
        return [int(v) for v in dataclasses.astuple(self)]

    @classmethod
    def from_ints(cls, values: list[int]) -> QuorumFindings:
        failed, disagree, no_majority, minority, steps, *flags = values
        replay_failed, replayed, full, shapes_differ = (bool(v) for v in flags)
        return cls(
            bool(failed), bool(disagree), bool(no_majority), bool(minority), steps,
            replay_failed, replayed, full, shapes_differ,
        )  # fmt: skip


class QuorumProtocol:
    """The start-up, join and quorum exchange of one rank of a replica group."""

    def __init__(
        self,
        job_config: JobConfig,
        ft: FTManager,
        sync: SyncManager,
        algorithm: OuterLoop,
        lineage: Lineage,
        reporter: SyncReporter,
        train_state: TrainState,
        device: torch.device,
        group_ranks: int,
        most_in_group: Callable[[list[int]], list[int]],
        heal: HealExchange,
        shape: CollectiveShape,
        speeds: SpeedExchange | None,
    ) -> None:
        """``shape``: what fixes the shapes of this rank's sync collectives, compared with
        every member's before the quorum is used; ``speeds``: DyLU's plans (None: no DyLU)."""
        self.job_config = job_config
        self.ft = ft
        self.sync = sync
        self.algorithm = algorithm
        self.lineage = lineage
        self.reporter = reporter
        #: The trainer's step counter (read here, for the events).
        self.train_state = train_state
        self.device = device
        self.group_ranks = group_ranks
        self.most_in_group = most_in_group
        #: Both ends of a heal (a replay of missed syncs, or the full state).
        self.heal = heal
        self.shape = shape
        self.period = algorithm.period
        self.speeds = speeds
        #: Whether this group is asking for its first quorum.
        self.starting = False
        #: Why this group starts without a checkpoint of its own although it had some (all
        #: failed their checksums): it must heal in full from a peer. Empty: not so.
        self.heal_in_full = ""
        self._start_role = FRESH
        self._start_attempts = 0
        self._peer: dict[str, int] | None = None
        self._checked_quorum = -2

    # ---- joining the job ---------------------------------------------------------------------

    def start(self) -> JoinAtSync | None:
        """Ask for the first quorum right away, and act on what it is.

        Until it is in, a starting group announces a Manager step one below its own (-1 when
        it starts with no checkpoint): torchft heals a group whose step is below the
        quorum's highest, so a starting group always heals from a running group, even one of
        the same step (its checkpoint was taken in the current period) or of step 0 (a
        group killed before the job's first sync). Starting groups alone keep their order,
        so a whole-job restart heals only those behind the newest checkpoint. Afterwards:

        * healed from a running group at its sync point: take part in that sync (returned:
          the trainer performs this group's part of it);
        * healed from a starting group: continue from that group's position;
        * not healed (all starting, this one the newest): continue from its own position.
        """
        assert self.ft is not None
        ft = semi_sync_config(self.job_config)
        manager = self.ft.manager
        true_step = manager.current_step()
        self._start_role = RESUMED if (true_step > 0 or self.train_state.step > 0) else FRESH
        self.algorithm.note_joined()
        self.announce(true_step - 1)
        self.starting = True
        self._start_attempts = 0
        self._peer = None
        purpose = QuorumPurpose(
            "start-up",
            needs=f"all {ft.group_size} replica groups of a new job, or the running groups' "
            "next sync",
            reason="start-up",
        )
        events.ASKING_FOR_QUORUM.emit(
            step=self.train_state.step, role="resumed" if self._start_role == RESUMED else "fresh"
        )
        # Up to a period for a running job's next sync, or the others' start-up for a new one.
        timeout_s, timeout_field = max(
            (ft.sync_quorum_timeout_s, "fault_tolerance.sync_quorum_timeout_s"),
            (ft.quorum_timeout_s, "fault_tolerance.quorum_timeout_s"),
        )
        start = time.perf_counter()
        try:
            while True:
                self.ft.join_quorum(
                    needed=ft.min_replica_size,
                    timeout_s=timeout_s,
                    timeout_field=timeout_field,
                    accept=self.on_quorum,
                    purpose=purpose,
                )
                if manager.errored() is None:
                    break
                # The quorum failed on purpose (a disagreement) or a member died: go again.
                manager.should_commit()
                if self._peer is not None and not self._peer["starting"]:
                    # The running groups go on from where this group copied them: be healed
                    # again, at their next sync.
                    self._peer = None
                    self.announce(manager.current_step() - 1)
        finally:
            self.starting = False
        self.sync.begin_sync()  # a group joining at a sync point takes part in it now
        peer = self._peer
        if self.heal_in_full and peer is None:
            raise FaultToleranceError(
                f"[semi-sync] no checkpoint of this group passed its checksums "
                f"({self.heal_in_full}), and no other group had a state to heal from: every "
                "group of the job started without one. Restore a checkpoint folder from a copy."
            )
        lost = self.heal.own_state_lost
        if self.group_ranks > 1:  # every rank stops if one of them must
            if self.most_in_group([int(bool(lost))])[0] and not lost:
                lost = "another rank's replay of the syncs it missed stopped part-way"
        if lost and peer is None:
            raise FaultToleranceError(
                f"[semi-sync] this group cannot go on from its own checkpoint: "
                f"{lost}, and no other group is left to heal from in "
                "full. Restart it (it loads its checkpoint again) once a group of the job runs, "
                "or restart the whole job from checkpoints."
            )
        if peer is not None and peer["at_sync"]:
            return JoinAtSync(peer["local_step"], peer["replica_id"], time.perf_counter() - start)
        self.announce(manager.current_step() + 1)
        if peer is not None:  # healed from a starting group, whose step was announced low
            self.algorithm.set_local_step(peer["local_step"])
            events.HEALED.emit(
                step=self.train_state.step + 1,
                sync=manager.current_step() + 1,
                peer=peer["replica_id"],
                inner_step=peer["local_step"],
                period=self.period,
                case="newer_checkpoint",
                waited_s=None,
                **self.heal.event_fields(),
            )
        events.IN_JOB.emit(
            step=self.train_state.step + 1,
            sync=manager.current_step() + 1,
            groups=manager.num_participants(),
            inner_step=self.algorithm.local_step(),
            period=self.period,
        )
        return None

    def announce(self, step: int) -> None:
        manager = self.ft.manager
        manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})

    # ---- the quorums a method asks for -------------------------------------------------------

    def sync_quorum(self) -> None:
        """A sync's quorum, with :meth:`on_quorum` in it (``outer_loop.Quorums``)."""
        self.sync.start_quorum(self.on_quorum)

    def start_probe(self) -> ProbeInFlight:
        """DyLU's speed probe, with the speed exchange in it (``outer_loop.Quorums``)."""
        assert self.speeds is not None, "a speed probe without DyLU"
        return self.sync.start_probe(self.speeds.on_probe, self.speeds.after_probe)

    # ---- the exchange at every quorum --------------------------------------------------------

    def on_quorum(self) -> bool:
        """Run by every member of a quorum with enough groups: exchange roles and digests, and
        decide alike whether to use the quorum (a starting group waits for all groups of a new
        job) and whether the groups agree."""
        manager = self.ft.manager
        ft = self.job_config.fault_tolerance
        if self.heal.shape_refused:  # before any collective of a quorum it cannot take part in
            raise FaultToleranceError(f"[semi-sync] {self.heal.shape_refused}")
        if self.starting:
            self._start_attempts += 1
            joined = int(self._peer is not None and not self._peer["starting"])
            mine = Member(self._start_role, joined, self._start_attempts)
        else:
            mine = Member(RUNNING)
        failed_replay = self.heal.replay_failed
        healed = self.heal.take_heal()
        digest = None if failed_replay else self._digest_if_due()
        mine.replay_failed = int(bool(failed_replay))
        mine.heartbeat = self.sync.heartbeat
        mine.replica = ft.replica_id
        mine.give_shape(self.shape)
        if digest is not None:
            mine.has_digest, mine.digest = 1, digest
        if self.speeds is not None:
            self.speeds.fill(mine)
        members = exchange(manager, mine, self.device)
        self.sync.set_members([m.heartbeat for m in members or []])
        # A member in DyLU's speed probe sent its record from the probe's own exchange, which
        # carries no shapes (nor is its quorum used for a sync: see below).
        shapes = [(f"replica group {m.replica}", m.shape()) for m in members or [] if not m.probe]
        shapes_differ = mismatch(shapes, self.shape)
        verdict = compare_digests(members or [])
        own = mine.digest if mine.has_digest else None
        found = QuorumFindings(
            failed=members is None,
            disagree=not verdict.agree,
            no_majority=not verdict.agree and verdict.majority is None,
            minority=not verdict.agree and own is not None and own != verdict.majority,
            planned_steps=(
                0 if self.speeds is None else self.speeds.planned_steps(members or [], mine)
            ),
            replay_failed=bool(failed_replay) or any(m.replay_failed for m in members or []),
            replayed=healed == "replay",
            healed_in_full=healed == "full",
            shapes_differ=bool(shapes_differ),
        )
        if self.group_ranks > 1:
            # Each rank exchanged with the same rank of the other groups (and compared its own
            # shard): the group acts on what any of its ranks found, and all its ranks take
            # the same number of inner steps.
            found = QuorumFindings.from_ints(self.most_in_group(found.as_ints()))
        if found.shapes_differ:
            # Before any collective that depends on them: nobody uses this quorum, and a
            # starting group, the one that does not fit the job, stops.
            manager.report_error(RuntimeError("the groups' collectives cannot pair"))
            if self.starting:
                raise FaultToleranceError(
                    "[semi-sync] "
                    + (shapes_differ or "another rank of this group found that the replica "
                       "groups' collectives cannot pair (see its error line)")
                )  # fmt: skip
            return True
        self.reporter.agreement = (
            None if not verdict.digests else "disagree" if found.disagree else "agree"
        )
        if found.failed:
            return True
        assert members is not None
        if found.replay_failed or (found.replayed and found.healed_in_full):
            # A joiner's replay failed (on one of its ranks, or its ranks did not all replay):
            # nobody commits this sync, and it heals in full at the next one (its request then
            # asks for the full state).
            manager.report_error(RuntimeError("a joining group's replay failed"))
            if healed is not None or failed_replay:  # a rank of the joining group
                problem = failed_replay or (
                    "the ranks of this group did not all replay (a full heal on some)"
                    if found.replayed and found.healed_in_full
                    else "another rank of this group failed its replay"
                )
                events.REPLAY_FAILED.emit(step=self.train_state.step, problem=problem)
                self.heal.replay_failed = ""
                self.heal.drop_basis(problem)
            return True
        if any(m.probe for m in members):
            # Running groups in DyLU's speed probe: meet them at their sync point, healed again
            # there if torchft healed this group from one of them here (mid-period).
            if self.starting and self._peer is not None and not self._peer["starting"]:
                self._peer = None
                self.announce(manager.current_step() - 1)
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
            if self.starting and not mine.joined:
                events.CHECKPOINT_AHEAD.emit(step=self.train_state.step)
                self.announce(manager.current_step() - 1)
            # Its global parameters are not the running job's, and nothing is committed: no
            # disagreement to act on (with two groups that would stop the job).
            return True
        if found.disagree:
            self._act_on_disagreement(verdict.digests, found.no_majority, found.minority)
        elif self.starting and self.speeds is not None:
            self.speeds.probe_if_new_job(members)
        return True

    def _digest_if_due(self) -> int | None:
        """A digest of the global parameters of the last sync, every ``agreement_check_every``
        syncs, whenever the quorum changed (a group (re)joined or left), and at start-up."""
        manager = self.ft.manager
        every = semi_sync_config(self.job_config).agreement_check_every
        quorum = tft.quorum_id(manager)
        due = (
            self.starting
            or quorum != self._checked_quorum
            or (every > 0 and manager.current_step() % every == 0)
        )
        if not due:
            return None
        self._checked_quorum = quorum
        return self.algorithm.agreement_digest()

    def _act_on_disagreement(self, digests: list[int], no_majority: bool, minority: bool) -> None:
        manager = self.ft.manager
        distinct = [f"{d & (2**64 - 1):016x}" for d in sorted(set(digests))]
        sync = manager.current_step() + 1
        if no_majority:
            raise FaultToleranceError(
                f"[semi-sync] replica groups disagree on the global parameters before sync "
                f"#{sync} (digests {', '.join(distinct)}; no majority): stopping rather than "
                "training on diverged copies. Restart the job from one group's checkpoint: "
                "docs/fault_tolerance.md, 'After replica groups disagree'."
            )
        # Nobody commits this sync; the groups that differ from the majority step back one
        # sync, so that torchft heals them from a majority group at the next one.
        manager.report_error(RuntimeError("global parameters disagree"))
        if minority:
            events.DIFFERS_FROM_MAJORITY.emit(sync=sync, digests=distinct)
            self.announce(manager.current_step() - 1)
        else:
            events.MINORITY_ELSEWHERE.emit(sync=sync, digests=distinct)

    # ---- healing -----------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """Sent to a group that heals from this one: where this group is, and its lineage
        (the healed group's model is this one's from then on)."""
        return {
            "local_step": self.algorithm.local_step(),
            "at_sync": int(self.sync.in_quorum and not self.starting),
            "starting": int(self.starting),
            "replica_id": self.job_config.fault_tolerance.replica_id,
            **{f"lineage_{k}": v for k, v in self.lineage.state_dict().items()},
        }

    def load_peer(self, peer: dict[str, int]) -> None:
        """On the group that heals, after torchft loaded the peer's state (in the quorum). A
        starting group takes the peer's position (:meth:`start`). A running group must be at
        the same inner step as its peer, or the sync that follows would pair different
        operations (a hang, or a wrong average): stop loudly instead."""
        self.algorithm.forget_global()  # a digest of parameters this group no longer holds
        self.sync.reset_error_feedback()  # owed for state this group no longer has
        self.lineage.load_state_dict(
            {k.removeprefix("lineage_"): v for k, v in peer.items() if k.startswith("lineage_")}
        )
        if self.starting:
            self._peer = dict(peer)
            return
        mine = self.algorithm.local_step()
        if peer["starting"] or peer["local_step"] != mine:
            raise FaultToleranceError(
                f"[semi-sync] healed from replica group {peer['replica_id']} at inner step "
                f"{peer['local_step']} of its sync period"
                + (" (a group that is starting up)" if peer["starting"] else "")
                + f", but this group is at {mine}: their syncs would not pair up"
            )
        events.HEALED.emit(
            step=self.train_state.step + 1,
            sync=self.ft.manager.current_step() + 1,
            peer=peer["replica_id"],
            inner_step=mine,
            period=self.period,
            case="running",
            waited_s=None,
            **self.heal.event_fields(),
        )
