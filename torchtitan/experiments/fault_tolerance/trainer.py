"""Semi-synchronous training across replica groups: torchft's LocalSGD and (Streaming) DiLoCo.

``SemiSyncTrainer`` is the core ``Trainer`` for runs with ``fault_tolerance.semi_sync_method``
(``job_config.trainer_for`` picks it). What differs, through the core's extension points:

* ``train_step`` is a plain local step: the sync runs inside ``optimizer.step()``, from the
  optimizer hooks of torchft's ``LocalSGD``/``DiLoCo``, entered in ``train_context``. Their
  Manager is a :class:`~.sync_quorum.SyncManager`: a sync's quorum needs ``min_replica_size``
  groups and has its own timeout (``sync_quorum_timeout_s``).
* ``join_replica_groups``: a group starts its torchft Manager (and so becomes visible to the
  lighthouse) only when it is ready to train, and asks for its first quorum at once.
* Every quorum starts with a small exchange among its members (roles, and every
  ``agreement_check_every`` syncs a digest of the global parameters): the run proves that the
  groups agree, instead of trusting it.
* The last step leaves every group with the global parameters (the final model is the job's).

Failure semantics (what a sync commits, what a dead, hung or restarted group and a lighthouse
restart do, what a heal carries) are written once, in docs/fault_tolerance.md ("Semi-synchronous
training"), and tested in tests/integration_tests/test_semi_sync*.py.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from torchtitan.components.checkpoint import CorruptCheckpointError
from torchtitan.components.ft import FaultToleranceError, FTManager, build_ft_manager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.lr_scheduler import move_schedule_to
from torchtitan.config.job_config import ConfigError, JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.async_diloco import (
    AsyncDiLoCo,
    dylu_inner_steps,
    dylu_period_seconds,
)
from torchtitan.experiments.fault_tolerance.fragments import ModelFragment
from torchtitan.experiments.fault_tolerance.job_config import SEMI_SYNC_METHODS, semi_sync_config
from torchtitan.experiments.fault_tolerance.lineage import Lineage
from torchtitan.experiments.fault_tolerance.method_state import SemiSyncState
from torchtitan.experiments.fault_tolerance.methods import build_method, describe
from torchtitan.experiments.fault_tolerance.outer_loop import (
    OuterLoop,
)
from torchtitan.experiments.fault_tolerance.reporting import SyncReporter
from torchtitan.experiments.fault_tolerance.sync_quorum import (
    FRESH,
    RESUMED,
    RUNNING,
    Member,
    SyncManager,
    compare_digests,
    exchange,
)
from torchtitan.experiments.fault_tolerance.transport import SyncTransport
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.logging import logger
from torchtitan.trainer import StepResult, Trainer

# ---- the trainer ---------------------------------------------------------------------------


class SemiSyncTrainer(Trainer):
    """Trains with ``fault_tolerance.semi_sync_method`` (LocalSGD or DiLoCo) across groups."""

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
        transport = SyncTransport(
            ft.pseudo_grad_dtype,
            error_feedback=ft.error_feedback,
            bucket_mb=ft.sync_bucket_mb,
            timeout_s=ft.sync_collective_timeout_s,
        )
        self.sync = SyncManager(
            self.ft,
            ft.min_replica_size,
            ft.sync_quorum_timeout_s,
            self._on_quorum,
            transport,
            fragment_of_sync=lambda: self.algorithm.current_fragment(),
        )
        self.algorithm: OuterLoop = build_method(
            job_config,
            self.sync,
            self.model,
            self.optimizer,
            self.device,
            group_ranks=self.parallel_dims.world_size,
        )
        if self.parallel_dims.world_size > 1:
            # The ranks of this group decide alike (one MAX all-reduce in the group).
            agree = self._agree_in_group
            self.sync.agree_in_group = agree
            if isinstance(self.algorithm, AsyncDiLoCo):
                self.algorithm.agree_in_group = agree
        self.fragments = self.algorithm.fragments
        self.period, self.delay = self.algorithm.period, self.algorithm.delay
        # DyLU: groups take different numbers of inner steps, so training ends after a number
        # of sync points (the fastest group's steps), and the learning rate follows the job's
        # progress through them.
        self.dynamic = ft.dynamic_local_steps
        self.total_sync_points = job_config.training.steps // self.period
        self.lineage = Lineage()
        self.reporter = SyncReporter(
            job_config,
            self.algorithm,
            self.sync,
            self.ft,
            self.metrics,
            self.lineage,
            self.device,
            self.parallel_dims.world_size,
        )
        self.state = SemiSyncState(self)
        self.register_state("semi_sync", self.state, heal=False)
        # Not a checkpointed state: where in the sync period the sending group is, so that a
        # group healing from it continues from the same point (and joins its sync if it is
        # at one).
        self.ft.register_state_dict_fn("semi_sync_position", self._load_peer, self._position)
        self.starting = False
        #: Why this group starts without a checkpoint of its own although it had some (all
        #: failed their checksums): it must heal in full from a peer. Empty: not so.
        self._heal_in_full = ""
        self._start_role = FRESH
        self._start_attempts = 0
        self._peer: dict[str, int] | None = None
        self._checked_quorum = -2
        logger.info(describe(job_config, self.algorithm))
        if len(self.fragments) > 1:
            for i, fragment in enumerate(self.fragments):
                # cast: with more than one fragment, build_model_fragments made them all.
                names = cast(ModelFragment, fragment).fqns()
                logger.info(
                    f"[semi-sync] fragment {i}: {len(names)} tensors, {names[0]} .. {names[-1]}"
                )
        if job_config.training.steps % ft.sync_steps:
            logger.warning(
                f"[semi-sync] training.steps={job_config.training.steps} is not a multiple of "
                f"fault_tolerance.sync_steps={ft.sync_steps}: the local progress after the last "
                "sync is not part of the final model (every group ends with the global one)"
            )

    def _agree_in_group(self, value: int) -> int:
        return self._most_in_group([value])[0]

    def _most_in_group(self, values: list[int]) -> list[int]:
        """Element by element, the largest of this group's ranks' ``values`` (one MAX
        all-reduce in the group)."""
        found = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return [int(v) for v in found.tolist()]

    # ---- extension points of the core trainer ------------------------------------------------

    def build_ft_manager(self) -> FTManager | None:
        # Every group initialises the model from the same seed, so the step-0 weight sync
        # (init_sync) is not needed; the first quorum's digest exchange checks it.
        return build_ft_manager(
            self.job_config,
            self.parallel_dims,
            self.states,
            use_async_quorum=False,
            init_sync=False,
            quorum_timeout_s=semi_sync_config(self.job_config).sync_quorum_timeout_s,
        )

    def load_checkpoint(self) -> None:
        """A group none of whose checkpoints passes its checksums starts without one and heals
        in full from a peer (:meth:`_start` stops with an error if no peer has a state to give):
        the other groups hold the job's state. A checkpoint named by ``checkpoint.load_step``,
        or a job of one group, still stops the run."""
        try:
            super().load_checkpoint()
        except CorruptCheckpointError as e:
            if self.job_config.checkpoint.load_step >= 0 or self.ft.group_size < 2:
                raise
            self._heal_in_full = str(e)
            events.OWN_CHECKPOINT_REJECTED.emit(problem=str(e))

    def join_replica_groups(self) -> None:
        """After the checkpoint is loaded: make sure DiLoCo's global parameters are the
        loaded ones, start the Manager and join the job (see :meth:`_start`)."""
        if not self.state.loaded and self.algorithm.has_global_copies:
            # DiLoCo copied the global parameters when it was built, before any checkpoint was
            # loaded: take them again from the model as loaded, with fresh outer momentum.
            self.algorithm.take_global_copies()
            cfg = self.job_config.checkpoint
            if self.train_state.step > 0 or (cfg.enable and cfg.initial_load_path):
                events.GLOBAL_FROM_LOADED_MODEL.emit(step=self.train_state.step)
        assert self.ft is not None
        self.ft.start()
        self._start()

    def train_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        # Post-hooks run in registration order: ours before torchft's starts the clock of a
        # sync, ours after it reports the result.
        stack.callback(self.optimizer.register_step_post_hook(self._before_torchft).remove)
        stack.enter_context(self.algorithm.hooks())
        after = self.optimizer.register_step_post_hook(
            lambda *_: self.reporter.after_inner_step(self.train_state.step + 1)
        )
        stack.callback(after.remove)
        return stack

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        self.optimizer.zero_grad()
        loss = self.forward_backward(inputs, labels)
        grad_norm = self.clip_gradients()
        self.optimizer.step()  # torchft's hook syncs here at the end of each sync period
        self._advance_schedule()
        if self._last_step_taken(self.train_state.step + 1):
            self._finish()
        return StepResult(self._mean_over_job(loss), grad_norm.item())

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        slowdown = semi_sync_config(self.job_config).emulate_slowdown
        if slowdown > 1:
            self._emulate_slower_group(inputs, labels, slowdown - 1)
        return super().forward_backward(inputs, labels)

    def _emulate_slower_group(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: float
    ) -> None:
        """``extra`` times a step's forward and backward work, whose gradients are dropped
        (``fault_tolerance.emulate_slowdown``): whole passes over the batch, then one over
        the matching fraction of its sequences."""
        whole, part = int(extra), extra - int(extra)
        rows = round(part * inputs.shape[0])
        for batch in [slice(None)] * whole + ([slice(0, rows)] if rows else []):
            super().forward_backward(inputs[batch], labels[batch])
        self.optimizer.zero_grad(set_to_none=True)

    def training_done(self) -> bool:
        if self.dynamic:
            return self.algorithm.sync_points >= self.total_sync_points
        return super().training_done()

    def _last_step_taken(self, step: int) -> bool:
        """Whether the step just taken (``step``, not yet counted) ends training."""
        if self.dynamic:
            return self.training_done() and self.algorithm.local_step() == 0
        return step == self.job_config.training.steps

    def _advance_schedule(self) -> None:
        """After an inner step: one step along the learning-rate schedule, or with DyLU to the
        job's progress, counted in the steps of a group that takes whole periods."""
        if not self.dynamic:
            self.lr_scheduler.step()
            return
        loop = self.algorithm
        within = loop.local_step() * self.period // loop.steps_this_period()
        move_schedule_to(self.lr_scheduler, loop.sync_points * self.period + within)

    # ---- joining the job ---------------------------------------------------------------------

    def _start(self) -> None:
        """Ask for the first quorum right away, and act on what it is.

        Until it is in, a starting group announces a Manager step one below its own (-1 when
        it starts with no checkpoint): torchft heals a group whose step is below the
        quorum's highest, so a starting group always heals from a running group, even one of
        the same step (its checkpoint was taken in the current period) or of step 0 (a
        group killed before the job's first sync). Starting groups alone keep their order,
        so a whole-job restart heals only those behind the newest checkpoint. Afterwards:

        * healed from a running group at its sync point: take part in that sync;
        * healed from a starting group: continue from that group's position;
        * not healed (all starting, this one the newest): continue from its own position.
        """
        assert self.ft is not None
        ft = semi_sync_config(self.job_config)
        manager = self.ft.manager
        true_step = manager.current_step()
        self._start_role = RESUMED if (true_step > 0 or self.train_state.step > 0) else FRESH
        self.algorithm.note_joined()
        self._announce(true_step - 1)
        self.starting = True
        self._start_attempts = 0
        self._peer = None
        self.ft.waiting_for = "start-up"
        self.ft.waiting_needs = (
            f"all {ft.group_size} replica groups of a new job, or the running groups' next sync"
        )
        self.ft.waiting_reason = "start-up"
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
                    accept=self._on_quorum,
                )
                if manager.errored() is None:
                    break
                # The quorum failed on purpose (a disagreement) or a member died: go again.
                manager.should_commit()
                if self._peer is not None and not self._peer["starting"]:
                    # The running groups go on from where this group copied them: be healed
                    # again, at their next sync.
                    self._peer = None
                    self._announce(manager.current_step() - 1)
        finally:
            self.starting = False
            self.ft.waiting_for = self.ft.waiting_needs = self.ft.waiting_reason = ""
        self.sync.begin_sync()  # a group joining at a sync point takes part in it now
        peer = self._peer
        if self._heal_in_full and peer is None:
            raise FaultToleranceError(
                f"[semi-sync] no checkpoint of this group passed its checksums "
                f"({self._heal_in_full}), and no other group had a state to heal from: every "
                "group of the job started without one. Restore a checkpoint folder from a copy."
            )
        if peer is not None and peer["at_sync"]:
            self._join_sync(time.perf_counter() - start)
            return
        self._announce(manager.current_step() + 1)
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
            )
        events.IN_JOB.emit(
            step=self.train_state.step + 1,
            sync=manager.current_step() + 1,
            groups=manager.num_participants(),
            inner_step=self.algorithm.local_step(),
            period=self.period,
        )

    def _announce(self, step: int) -> None:
        manager = self.ft.manager
        manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})

    def _join_sync(self, waited: float) -> None:
        """Healed from a running group inside its sync quorum: do that sync's part of this
        group now (the running groups are all-reducing with it), then go on from there."""
        assert self._peer is not None
        self.algorithm.set_local_step(self._peer["local_step"])
        events.HEALED.emit(
            step=self.train_state.step + 1,
            sync=self.ft.manager.current_step() + 1,
            peer=self._peer["replica_id"],
            inner_step=self._peer["local_step"],
            period=self.period,
            case="join_sync",
            waited_s=waited,
        )
        self.reporter.new_sync()
        self.sync.last_wait = waited  # this group's wait for the others' sync point
        start = time.perf_counter()
        performed = self.algorithm.join_sync()
        self.sync.flush()  # the running groups flushed theirs after the same hook
        self.reporter.seconds = time.perf_counter() - start
        # The running groups are inside this step's optimizer.step(); finish it as they will.
        self._advance_schedule()
        last = self._last_step_taken(self.train_state.step + 1)
        self.train_state.step += 1
        if performed:
            self.reporter.report(self.train_state.step)
        if last:
            # The running groups end the job at this sync point: end it with them.
            self._finish()
        if self.checkpointer.should_save(self.train_state.step, False):
            self.checkpointer.save(self.train_state.step)

    # ---- the exchange at every quorum --------------------------------------------------------

    def _on_quorum(self) -> bool:
        """Run by every member of a quorum with enough groups: exchange roles and digests, and
        decide alike whether to use the quorum (a starting group waits for all groups of a new
        job) and whether the groups agree."""
        manager = self.ft.manager
        ft = self.job_config.fault_tolerance
        if self.starting:
            self._start_attempts += 1
            joined = int(self._peer is not None and not self._peer["starting"])
            mine = Member(self._start_role, joined, self._start_attempts)
        else:
            mine = Member(RUNNING)
        digest = self._digest_if_due()
        if digest is not None:
            mine.has_digest, mine.digest = 1, digest
        if self.dynamic:
            mine.step_us = round(self.algorithm.step_seconds() * 1e6)
        members = exchange(manager, mine, self.device)
        verdict = compare_digests(members or [])
        own = mine.digest if mine.has_digest else None
        flags = [
            members is None,  # a member failed: this quorum's sync fails anyway
            not verdict.agree,
            not verdict.agree and verdict.majority is None,
            not verdict.agree and own is not None and own != verdict.majority,
        ]
        speeds = [m.step_us / 1e6 for m in members or []]
        plan = dylu_inner_steps(self.period, speeds, mine.step_us / 1e6) if self.dynamic else 0
        if self.parallel_dims.world_size > 1:
            # Each rank exchanged with the same rank of the other groups (and compared its own
            # shard): the group acts on what any of its ranks found, and all its ranks take
            # the same number of inner steps.
            *found_flags, plan = self._most_in_group([*flags, plan])
            flags = [bool(v) for v in found_flags]
        failed, disagree, no_majority, minority = flags
        self.reporter.agreement = (
            None if not verdict.digests else "disagree" if disagree else "agree"
        )
        if failed:
            return True
        assert members is not None
        if self.dynamic:
            self._plan_period(plan, speeds, mine.step_us / 1e6)
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
                self._announce(manager.current_step() - 1)
        if disagree:
            self._act_on_disagreement(verdict.digests, no_majority, minority)
        return True

    def _plan_period(self, steps: int, speeds: list[float], mine: float) -> None:
        """DyLU: the next period's inner steps (said in the log when they change)."""
        if steps != self.algorithm.steps_this_period():
            fastest = min((s for s in speeds if s > 0), default=0.0)
            events.INNER_STEPS_PLANNED.emit(
                step=self.train_state.step,
                steps=steps,
                period=self.period,
                ms_per_step=mine * 1e3,
                fastest_ms_per_step=fastest * 1e3,
            )
        self.algorithm.plan_period(steps, dylu_period_seconds(self.period, speeds))

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
            self._announce(manager.current_step() - 1)
        else:
            events.MINORITY_ELSEWHERE.emit(sync=sync, digests=distinct)

    # ---- healing -----------------------------------------------------------------------------

    def _position(self) -> dict[str, Any]:
        """Sent to a group that heals from this one: where this group is, and its lineage
        (the healed group's model is this one's from then on)."""
        return {
            "local_step": self.algorithm.local_step(),
            "at_sync": int(self.sync.in_quorum and not self.starting),
            "starting": int(self.starting),
            "replica_id": self.job_config.fault_tolerance.replica_id,
            **{f"lineage_{k}": v for k, v in self.lineage.state_dict().items()},
        }

    def _load_peer(self, peer: dict[str, int]) -> None:
        """On the group that heals, after torchft loaded the peer's state (in the quorum). A
        starting group takes the peer's position (:meth:`_start`). A running group must be at
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
        )

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        sync = getattr(self, "sync", None)  # None: __init__ stopped before building it
        if sync is not None:
            sync.shutdown()
        super().close()

    def _finish(self) -> None:
        """After the last step: every group ends with the global parameters (before the last
        checkpoint and validation). DiLoCo puts every fragment's global copy back into the
        model (a started all-reduce is let finish and dropped, alike in every group); LocalSGD
        runs a closing sync if the last step was not one."""
        manager = self.ft.manager
        self.reporter.new_sync()
        start = time.perf_counter()
        ending = self.algorithm.finish()
        self.sync.discard_undecided()  # a sync dropped on the way leaves no residual
        self.reporter.seconds = time.perf_counter() - start
        if ending.synced:
            self.reporter.report(self.train_state.step + 1)
        step = self.train_state.step + 1
        digest = tensor_digest(self.model.parameters())
        lineage = self.lineage
        shared = lineage.last_shared_sync if lineage.last_shared_sync >= 0 else None
        events.FINAL_MODEL.emit(
            step=step,
            sync=manager.current_step(),
            method=self.method,
            closing_sync_steps=ending.closing_sync_steps,
            dropped_inner_steps=ending.dropped_inner_steps,
            last_shared_sync=shared,
            solo_syncs=lineage.solo_syncs,
            solo_since=lineage.solo_since or None,
            digest=digest,
        )
        if lineage.solo_syncs and self.job_config.fault_tolerance.group_size > 1:
            events.FINISHED_ALONE.emit(
                step=step, sync=manager.current_step(), last_shared_sync=shared,
                solo_syncs=lineage.solo_syncs,
            )  # fmt: skip
        if self.job_config.metrics.log_param_digest:
            events.FINAL_DIGEST.emit(step=step, digest=digest)

    # ---- the optimizer hook before the method's -----------------------------------------------

    def _before_torchft(self, *_: Any) -> None:
        # After every inner step, whether the method syncs in it or not (DyLU decides that
        # inside the method's own hook, from the time the period took): the inner step is done
        # and the next one starts from zero_grad, so free the inner gradients now, and the
        # pseudo-gradients and the local copy a sync makes take their place instead of adding
        # to them. The sync's clock starts here too.
        self.optimizer.zero_grad(set_to_none=True)
        self.reporter.start_clock()
