"""Semi-synchronous training across replica groups: LocalSGD, (Streaming) DiLoCo, async DiLoCo.

``SemiSyncTrainer`` is the core ``Trainer`` for runs with ``fault_tolerance.semi_sync_method``
(``job_config.trainer_for`` picks it). What differs, through the core's extension points:

* ``train_step`` is a plain local step: the sync runs inside ``optimizer.step()``, from the
  method's optimizer hooks (``outer_loop.OuterLoop``), entered in ``train_context`` with the
  quorum protocol's quorums. The method syncs through a :class:`~.sync.quorum.SyncQuorum`: a
  sync's quorum needs ``min_replica_size`` groups and has its own timeout
  (``sync_quorum_timeout_s``).
* ``join_replica_groups``: a group starts its torchft Manager (and so becomes visible to the
  lighthouse) only when it is ready to train, and asks for its first quorum at once.
* Every quorum starts with a small exchange among its members (roles, and every
  ``agreement_check_every`` syncs a digest of the global parameters): the run proves that the
  groups agree, instead of trusting it.
* The last step leaves every group with the global parameters (the final model is the job's).
* Sites of groups (``groups_per_site`` > 1): ``step_ft`` is the site's Manager, which averages
  gradients every step among the site's groups; the job's Manager runs in the site's leader
  only (``sync.site_link``).

Failure semantics (what a sync commits, what a dead, hung or restarted group and a lighthouse
restart do, what a heal carries) are written once, in docs/fault_tolerance.md ("Semi-synchronous
training"), and tested in tests/integration_tests/test_semi_sync*.py.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from torchtitan.components.checkpoint import CorruptCheckpointError
from torchtitan.components.ft import FTManager, build_ft_manager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.lr_scheduler import move_schedule_to
from torchtitan.config.job_config import ConfigError, JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.heal.checkpoint_transport import build_history_transport
from torchtitan.experiments.fault_tolerance.heal.exchange import (
    HEAL_KEY,
    HealExchange,
    job_fingerprint_parts,
)
from torchtitan.experiments.fault_tolerance.heal.history import job_fingerprint
from torchtitan.experiments.fault_tolerance.job_config import (
    SEMI_SYNC_METHODS,
    job_level_config,
    semi_sync_config,
    site_step_config,
)
from torchtitan.experiments.fault_tolerance.join.exchange import QuorumExchange
from torchtitan.experiments.fault_tolerance.join.protocol import JoinAtSync, QuorumProtocol
from torchtitan.experiments.fault_tolerance.join.speeds import build_speed_exchange
from torchtitan.experiments.fault_tolerance.method_state import SemiSyncState, SiteHealState
from torchtitan.experiments.fault_tolerance.methods.build import (
    build_method,
    build_sync_quorum,
    describe,
    heal_history,
    wire_dtype,
)
from torchtitan.experiments.fault_tolerance.methods.fragments import describe_fragments
from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.report.sync_reporter import SyncReporter
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage
from torchtitan.experiments.fault_tolerance.sync.quorum import RankInGroup, in_group_wait
from torchtitan.experiments.fault_tolerance.sync.site_link import SiteLink
from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape
from torchtitan.tools import host_memory
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.logging import logger
from torchtitan.trainer import StepResult, Trainer

# ---- the trainer ---------------------------------------------------------------------------


class SemiSyncTrainer(Trainer):
    """Trains with ``fault_tolerance.semi_sync_method`` across replica groups."""

    params_agree_every_step = False  # they agree after each sync: SyncReporter.global_digest
    # Never None here, unlike in the core Trainer: __init__ checks that fault tolerance is on.
    ft: FTManager

    def __init__(self, job_config: JobConfig) -> None:
        ft = semi_sync_config(job_config)
        method = ft.method
        if method is None:
            # This class runs a semi-sync method and nothing else; synchronous FT is the core
            # Trainer's (trainer_for picks it), never a mode of this one.
            raise ConfigError(
                "fault_tolerance.semi_sync_method",
                ft.semi_sync_method,
                f"SemiSyncTrainer needs one of {', '.join(SEMI_SYNC_METHODS)}; without a "
                "method run the core Trainer (the custom args module's trainer_for picks it)",
            )
        tft.check_version()
        self.method: str = method
        super().__init__(job_config)
        assert self.ft is not None
        ranks = self.parallel_dims.world_size
        wait = in_group_wait(ft.sync_quorum_timeout_s, ft.timeout_s, ft.sync_collective_timeout_s)
        rank = RankInGroup.build(self.device, ranks, wait)
        history = heal_history(ft)
        self.site = self._site_link(ft)
        self.sync = build_sync_quorum(ft, self.ft, history, rank, self.site)
        self.algorithm: OuterLoop = build_method(
            job_config, self.sync, self.model, self.optimizer, self.device,
            group_ranks=ranks, history=history,
        )  # fmt: skip
        self.period = self.algorithm.period
        # DyLU: groups take different numbers of inner steps, so training ends after a number
        # of sync points (the fastest group's steps), and the learning rate follows the job's
        # progress through them.
        self.dynamic = ft.dynamic_local_steps
        self.total_sync_points = job_config.training.steps // self.period
        fingerprint = job_fingerprint(job_fingerprint_parts(job_config, self.model))
        fragments = self.algorithm.fragments
        bucket = self.sync.transport.bucket_numel
        shape = CollectiveShape.of(fragments, ranks, bucket, wire_dtype(ft))
        self.heal = HealExchange(
            history, fingerprint, self.algorithm.method, self.algorithm.replayer(), self.ft, shape
        )
        self.lineage = Lineage()
        self.state = SemiSyncState(self.algorithm, self.sync.transport, self.lineage)
        #: Why every checkpoint of this group failed its checksums ("": none did).
        self._checkpoint_rejected = ""
        self.register_state("semi_sync", self.state, heal=False)
        if self.site is not None:
            # A group healing from its site takes the site's outer state and who leads (the
            # core state is registered with the site's Manager already).
            assert self.step_ft is not None
            # Who leads first: a heal of the method's state may ask.
            site = self.site
            self.step_ft.register_state_dict_fn("site", site.load_state_dict, site.state_dict)
            site_heal = SiteHealState(self.algorithm, self.lineage, self.sync.transport)
            self.step_ft.register_state("semi_sync", site_heal)
            self.register_state("site_ft_manager", self.step_ft, heal=False)
        # What the job's lighthouse and the other groups (with sites: sites) see of this one.
        job = job_level_config(job_config)
        speeds = build_speed_exchange(job, self.algorithm, self.ft, self.train_state, rank)
        exchange = QuorumExchange(
            job, self.ft, self.sync, self.algorithm, self.train_state, rank, self.heal,
            shape, speeds,
        )  # fmt: skip
        self.reporter = SyncReporter(
            job, self.algorithm, self.sync, self.ft, self.metrics, self.lineage, rank, exchange,
        )  # fmt: skip
        self.protocol = QuorumProtocol(exchange, self.lineage)
        # Healing state besides the checkpointed one: where in its period the sending group
        # is, so that the healed group continues from there (and joins its sync if at one).
        self.ft.register_state_dict_fn(
            "semi_sync_position", self.protocol.load_peer, self.protocol.position
        )
        # Last: torchft loads the healing state in this order, and a replay's check (its global
        # copies into the model, against the peer's digests) comes after all.
        self.ft.register_state_dict_fn(HEAL_KEY, self.heal.load, self.heal.placeholder)
        for line in [describe(job_config, self.algorithm), *describe_fragments(fragments)]:
            logger.info(line)
        if job_config.training.steps % ft.sync_steps:
            logger.warning(
                f"[semi-sync] training.steps={job_config.training.steps} is not a multiple of "
                f"fault_tolerance.sync_steps={ft.sync_steps}: the local progress after the last "
                "sync is not part of the final model (every group ends with the global one)"
            )

    # ---- extension points of the core trainer ------------------------------------------------

    def build_ft_manager(self) -> FTManager | None:
        # Every group initialises the model from the same seed, so the step-0 weight sync
        # (init_sync) is not needed; the first quorum's digest exchange checks it.
        ft = semi_sync_config(self.job_config)
        return build_ft_manager(
            job_level_config(self.job_config),
            self.parallel_dims,
            self.states,
            use_async_quorum=False,
            init_sync=False,
            quorum_timeout_s=ft.sync_quorum_timeout_s,
            collective_timeout_s=ft.sync_collective_timeout_s,
            # With sites it may start again (a group that comes to lead anew): a fresh store
            # each time, so that its ranks never read the keys of the Manager before.
            own_store=ft.groups_per_site > 1,
        )

    def build_step_ft(self) -> FTManager | None:
        """With sites of groups: the site's Manager, through ``site_lighthouse``, which
        averages gradients among the site's groups every step, with the timeouts of
        synchronous fault tolerance (a follower's long waits for its leader's sync are bounded
        one by one: ``SiteLink``); the site's groups start from the same seed (no step-0 weight
        sync). None without sites."""
        ft = semi_sync_config(self.job_config)
        if ft.groups_per_site == 1:
            return None
        if self.ft is not None and self.ft.lighthouse == ft.site_lighthouse:
            # The job's lighthouse may come from TORCHFT_LIGHTHOUSE, which the config's own
            # check does not see.
            raise ConfigError(
                "fault_tolerance.site_lighthouse",
                ft.site_lighthouse,
                "is the job's lighthouse (fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE): "
                "each site needs one of its own",
            )
        return build_ft_manager(
            site_step_config(self.job_config),
            self.parallel_dims,
            self.states,
            init_sync=False,
            own_store=True,
        )

    def _site_link(self, ft: Any) -> SiteLink | None:
        if self.step_ft is None:
            return None
        return SiteLink(
            self.step_ft,
            self.ft,
            index=ft.replica_id % ft.groups_per_site,
            groups=ft.groups_per_site,
            site=ft.site,
            device=self.device,
            timeout_s=_site_wait_s(ft),
        )

    def load_checkpoint(self) -> None:
        """A group none of whose checkpoints passes its checksums starts without one and heals
        in full from a peer (``QuorumProtocol.start`` stops with an error if no peer has a
        state to give): the other groups hold the job's state. A checkpoint named by
        ``checkpoint.load_step``, or a job of one group, still stops the run."""
        try:
            super().load_checkpoint()
        except CorruptCheckpointError as e:
            if self.job_config.checkpoint.load_step >= 0 or self.ft.group_size < 2:
                raise
            self._checkpoint_rejected = str(e)
            events.OWN_CHECKPOINT_REJECTED.emit(problem=str(e))

    def join_replica_groups(self) -> None:
        """After the checkpoint is loaded: make sure DiLoCo's global parameters are the
        loaded ones, start the Manager and join the job (``QuorumProtocol.start``)."""
        # DiLoCo copied the global parameters when it was built, before any checkpoint was
        # loaded: take them again from the model as loaded, with fresh outer momentum.
        if not self.state.loaded and self.algorithm.take_global_copies():
            cfg = self.job_config.checkpoint
            if self.train_state.step > 0 or (cfg.enable and cfg.initial_load_path):
                events.GLOBAL_FROM_LOADED_MODEL.emit(step=self.train_state.step)
        if self.site is not None:
            self._join_site()
            return
        assert self.ft is not None
        self.ft.start(build_history_transport(self.heal))
        # A group resumed from its own checkpoint offers it as the basis of a replay.
        own = self.state.loaded and not self._checkpoint_rejected
        self.heal.set_basis(self.ft.manager.current_step() if own else None)
        try:
            joined = self.protocol.start(heal_in_full=self._checkpoint_rejected)
        finally:
            self.heal.set_basis(None)  # a running group that falls behind heals in full
        if joined is not None:
            self._join_sync(joined)

    def _join_site(self) -> None:
        """With sites: join the site's step quorum (a new job's needs every group of the site;
        a group behind its site heals from a live one of it, leader and outer state included).
        The job's Manager starts in the site's leader at its first sync point."""
        assert self.step_ft is not None
        self.step_ft.start()
        tft.record_quorum_members(self.step_ft.manager)
        self.algorithm.note_joined()
        self.step_ft.wait_for_full_quorum()

    def train_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        # Post-hooks run in registration order: ours before the method's starts the clock of a
        # sync, ours after it reports the result.
        stack.callback(self.optimizer.register_step_post_hook(self._before_torchft).remove)
        stack.enter_context(self.algorithm.hooks(self.protocol))
        after = self.optimizer.register_step_post_hook(self._after_method)
        stack.callback(after.remove)
        return stack

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        # The core's step (with sites: gradients averaged in the site); the method's hook syncs
        # inside optimizer.step() at the end of each sync period.
        result = super().train_step(inputs, labels)
        if result.committed and self._last_step_taken(self.train_state.step + 1):
            self._finish()
        return result

    def training_done(self) -> bool:
        if self.dynamic:
            return self.algorithm.sync_points >= self.total_sync_points
        return super().training_done()

    def _last_step_taken(self, step: int) -> bool:
        """Whether the step just taken (``step``, not yet counted) ends training."""
        if self.dynamic:
            return self.training_done() and self.algorithm.local_step() == 0
        return step == self.job_config.training.steps

    def advance_schedule(self) -> None:
        """After an inner step: one step along the learning-rate schedule, or with DyLU to the
        job's progress, counted in the steps of a group that takes whole periods."""
        if not self.dynamic:
            self.lr_scheduler.step()
            return
        loop = self.algorithm
        within = loop.local_step() * self.period // loop.steps_this_period()
        move_schedule_to(self.lr_scheduler, loop.sync_points * self.period + within)

    # ---- joining the job ---------------------------------------------------------------------

    def _join_sync(self, joined: JoinAtSync) -> None:
        """Healed from a running group inside its sync quorum: do that sync's part of this
        group now (the running groups are all-reducing with it), then go on from there."""
        self.algorithm.set_local_step(joined.local_step)
        events.HEALED.emit(
            step=self.train_state.step + 1,
            sync=self.ft.manager.current_step() + 1,
            peer=joined.peer,
            inner_step=joined.local_step,
            period=self.period,
            # A replay always joins at the sync point it was healed in.
            case="replay" if self.heal.replayed() else "join_sync",
            waited_s=joined.waited_s,
            **self.heal.event_fields(),
        )
        self.reporter.new_sync()
        start = time.perf_counter()
        performed = self.algorithm.join_sync()
        self.sync.transport.flush()  # the running groups flushed theirs after the same hook
        self.reporter.took(time.perf_counter() - start)
        # The running groups are inside this step's optimizer.step(); finish it as they will.
        self.advance_schedule()
        last = self._last_step_taken(self.train_state.step + 1)
        self.train_state.count_step()
        if performed:
            self.reporter.report(self.train_state.step)
        if last:
            # The running groups end the job at this sync point: end it with them.
            self._finish()
        if self.checkpointer.should_save(self.train_state.step, False):
            self.checkpointer.save(self.train_state.step)

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        sync = getattr(self, "sync", None)  # None: __init__ stopped before building it
        if sync is not None:
            sync.transport.shutdown()
        super().close()

    def _finish(self) -> None:
        """After the last step: every group ends with the global parameters (before the last
        checkpoint and validation). DiLoCo puts every fragment's global copy back into the
        model (a started all-reduce is let finish and dropped, alike in every group); LocalSGD
        runs a closing sync if the last step was not one."""
        self.reporter.new_sync()
        start = time.perf_counter()
        ending = self.algorithm.finish(self.protocol)
        self.sync.discard_undecided()  # a sync dropped on the way leaves no residual
        self.reporter.took(time.perf_counter() - start)
        if ending.synced:
            self.reporter.report(self.train_state.step + 1)
        step = self.train_state.step + 1
        self.reporter.report_outer_state(step)
        self.reporter.report_final(step, ending, tensor_digest(self.model.parameters()))

    # ---- the optimizer hooks around the method's -----------------------------------------------

    def _before_torchft(self, *_: Any) -> None:
        # After every inner step, whether the method syncs in it or not (DyLU decides that
        # inside the method's own hook, from the time the period took): the inner step is done
        # and the next one starts from zero_grad, so free the inner gradients now, and the
        # pseudo-gradients and the local copy a sync makes take their place instead of adding
        # to them. The sync's temporaries are mapped on their own, not left in the host heap
        # (``tools.host_memory``). The sync's clock starts here too.
        self.optimizer.zero_grad(set_to_none=True)
        host_memory.map_large()
        self.reporter.start_clock()

    def _after_method(self, *_: Any) -> None:
        host_memory.heap_large()  # the next inner step's gradients reuse the heap
        self.reporter.after_inner_step(self.train_state.step + 1)


def _site_wait_s(ft: Any) -> float:
    """The longest a collective of a site's groups may take: a follower waits in it while its
    leader's sync waits for its quorum and transfers."""
    return float(ft.sync_quorum_timeout_s + ft.sync_collective_timeout_s)
