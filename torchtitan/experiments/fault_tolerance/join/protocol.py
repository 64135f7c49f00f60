"""How a replica group joins the job (:meth:`QuorumProtocol.start`), and what travels with a heal
besides torchft's state: the sender's position in its period and its lineage
(:meth:`~QuorumProtocol.position`, :meth:`~QuorumProtocol.load_peer`). What every quorum decides
is ``exchange``'s.

Failure semantics are written once, in docs/fault_tolerance.md ("Semi-synchronous training").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from torchtitan.components.ft import FaultToleranceError, QuorumPurpose
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.heal.checkpoint_transport import build_history_transport
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.join.exchange import QuorumExchange, StartUp
from torchtitan.experiments.fault_tolerance.join.speeds import ProbeInFlight
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage
from torchtitan.experiments.fault_tolerance.sync.quorum import FRESH, RESUMED


@dataclass(frozen=True)
class JoinAtSync:
    """A starting group healed from a running group inside that group's sync quorum: it takes
    part in the sync now, at the peer's inner step."""

    local_step: int
    peer: int
    waited_s: float


class QuorumProtocol:
    """The start-up and join of one rank of a replica group, and the quorums it asks for."""

    def __init__(self, exchange: QuorumExchange, lineage: Lineage) -> None:
        """``exchange``: what every quorum of this rank exchanges (and what it is built with);
        ``lineage``: what travels with a heal besides torchft's state."""
        self.exchange = exchange
        self.lineage = lineage
        self.job_config, self.ft, self.sync = exchange.job_config, exchange.ft, exchange.sync
        self.algorithm, self.train_state = exchange.algorithm, exchange.train_state
        self.rank, self.heal, self.speeds = exchange.rank, exchange.heal, exchange.speeds
        self.period = self.algorithm.period
        #: While this group asks for its first quorum (None: it is in the job).
        self.start_up: StartUp | None = None
        #: Whether torchft loaded a peer's state into this group since the quorum began.
        self._peer_loaded = False

    # ---- joining the job ---------------------------------------------------------------------

    def start(self, heal_in_full: str = "") -> JoinAtSync | None:
        """Ask for the first quorum right away, and act on what it is. ``heal_in_full``: why
        this group must heal in full from a peer although it had checkpoints (all failed their
        checksums); empty: it need not.

        Until it is in, a starting group announces a Manager step one below its own (-1 with no
        checkpoint): torchft heals a group whose step is below the quorum's highest, so a
        starting group always heals from a running group, even one of the same step (its
        checkpoint is from the current period) or of step 0 (killed before the first sync).
        Starting groups alone keep their order, so a whole-job restart heals only those behind
        the newest checkpoint. Afterwards:

        * healed from a running group at its sync point: take part in that sync (returned:
          the trainer performs this group's part of it);
        * healed from a starting group: continue from that group's position;
        * not healed (all starting, this one the newest): continue from its own position.
        """
        ft = semi_sync_config(self.job_config)
        manager = self.ft.manager
        true_step = manager.current_step()
        # A group whose checkpoints all failed their checksums is a restarted job's: it must
        # heal from a group with state, never start a new job's model.
        restarted = true_step > 0 or self.train_state.step > 0 or bool(heal_in_full)
        role = RESUMED if restarted else FRESH
        self.algorithm.note_joined()
        self.exchange.set_manager_step(true_step - 1)
        start_up = self.start_up = StartUp(role)
        purpose = QuorumPurpose(
            "start-up",
            needs=f"all {ft.group_size} replica groups of a new job, or the running groups' "
            "next sync",
            reason="start-up",
        )
        events.ASKING_FOR_QUORUM.emit(
            step=self.train_state.step, role="resumed" if role == RESUMED else "fresh"
        )
        # Up to a period for a running job's next sync, or the others' start-up for a new one.
        timeout_s, timeout_field = max(
            (ft.sync_quorum_timeout_s, "fault_tolerance.sync_quorum_timeout_s"),
            (ft.quorum_timeout_s, "fault_tolerance.quorum_timeout_s"),
        )
        start = time.perf_counter()
        try:
            while True:
                with self.ft.quorum_rounds(
                    needed=ft.min_replica_size,
                    timeout_s=timeout_s,
                    timeout_field=timeout_field,
                    purpose=purpose,
                ) as rounds:
                    self.exchange.settle(rounds, start_up)
                if manager.errored() is None:
                    break
                # The quorum failed on purpose (a disagreement) or a member died: go again.
                manager.should_commit()
                if start_up.healed_from_running:
                    # The running groups go on from where it copied them: heal at their next sync.
                    start_up.peer = None
                    self.exchange.set_manager_step(manager.current_step() - 1)
        finally:
            self.start_up = None
        self.sync.begin_sync()  # a group joining at a sync point takes part in it now
        peer = start_up.peer
        if heal_in_full and peer is None:
            raise FaultToleranceError(
                f"[semi-sync] no checkpoint of this group passed its checksums "
                f"({heal_in_full}), and no other group had a state to heal from: every "
                "group of the job started without one. Restore a checkpoint folder from a copy."
            )
        lost = self.heal.own_state_lost
        if self.rank.most([int(bool(lost))])[0] and not lost:  # every rank stops if one must
            lost = "another rank's replay of the syncs it missed stopped part-way"
        if lost and peer is None:
            raise FaultToleranceError(
                f"[semi-sync] this group cannot go on from its own checkpoint: "
                f"{lost}, and no other group is left to heal from in "
                "full. Restart it (it loads its checkpoint again) once a group of the job runs, "
                "or restart the whole job from checkpoints."
            )
        if peer is not None and peer["at_sync"]:
            joined = JoinAtSync(peer["local_step"], peer["replica_id"], time.perf_counter() - start)
            self.sync.joined_sync(joined.waited_s)
            return joined
        self.exchange.set_manager_step(manager.current_step() + 1)
        if peer is not None:  # healed from a starting group, whose step was announced low
            self.algorithm.set_local_step(peer["local_step"])
            events.HEALED.emit(
                step=self.train_state.step + 1,
                sync=manager.current_step() + 1,
                peer=peer["replica_id"],
                inner_step=peer["local_step"],
                period=self.period,
                case="newer_checkpoint" if start_up.initial_model_from is None else "initial_model",
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

    # ---- the quorums a method asks for -------------------------------------------------------

    def sync_quorum(self) -> bool:
        """A sync's quorum, settled by the exchange (``outer_loop.Quorums``): whether this group
        healed in it (torchft loaded a peer's state, :meth:`load_peer` among it).

        With sites, only the site's leader (elected here, :meth:`~.site_link.SiteLink.elect`)
        joins it: a group that leads from now on starts its job Manager, at the step its
        site's syncs made (a site behind the others heals from one in this quorum); one that
        does not lead (any more) leaves the job's lighthouse."""
        self._peer_loaded = False
        site = self.sync.site
        if site is not None:
            site.elect()
            if not site.leads():
                self.ft.step_down()
                # A leader that healed from another site holds a state its site does not: the
                # others heal from it at the next step, not a period later.
                healed = site.hear_quorum()
                site.settle(not self.sync.agree_in_group(int(healed is None or healed)))
                return False
            if not self.ft.started:
                self.ft.start(build_history_transport(self.heal))
        with self.sync.sync_rounds() as rounds:
            self.exchange.settle(rounds)
        if site is not None:
            site.share_quorum(self._peer_loaded)
            site.settle(True)
        return self._peer_loaded

    def start_probe(self) -> ProbeInFlight:
        """DyLU's speed probe (``outer_loop.Quorums``)."""
        assert self.speeds is not None, "a speed probe without DyLU"
        return self.speeds.start_probe()

    # ---- healing -----------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """Sent to a group that heals from this one: where this group is, and its lineage
        (the healed group's model is this one's from then on)."""
        return {
            "local_step": self.algorithm.local_step(),
            "at_sync": int(self.sync.in_quorum and self.start_up is None),
            "starting": int(self.start_up is not None),
            "replica_id": self.job_config.fault_tolerance.replica_id,
            **{f"lineage_{k}": v for k, v in self.lineage.state_dict().items()},
        }

    def load_peer(self, peer: dict[str, int]) -> None:
        """On the group that heals, after torchft loaded the peer's state (in the quorum). A
        starting group takes the peer's position (:meth:`start`). A running group must be at
        the same inner step as its peer, or the sync that follows would pair different
        operations (a hang, or a wrong average): stop loudly instead."""
        self._peer_loaded = True
        self.algorithm.forget_global()  # a digest of parameters this group no longer holds
        self.sync.reset_error_feedback()  # owed for state this group no longer has
        self.lineage.load_state_dict(
            {k.removeprefix("lineage_"): v for k, v in peer.items() if k.startswith("lineage_")}
        )
        start_up = self.start_up  # read once: start() may end this start-up meanwhile
        if start_up is not None:
            start_up.peer = dict(peer)
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
