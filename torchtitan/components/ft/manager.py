"""``FTManager``: this rank's torchft Manager, and what the trainer does with it each step
(join a bounded quorum, average gradients, decide the commit). What a step, a dead group and
a restarted group do is written in ``docs/fault_tolerance.md``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.components.ft.delivery import all_reduce_across_groups
from torchtitan.components.ft.errors import FaultToleranceError
from torchtitan.components.ft.healing import register_healing_state
from torchtitan.components.ft.network import lighthouse_address, lighthouse_reachable
from torchtitan.components.ft.watchdog import QuorumWaitWatchdog
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.events import EventKind


def _waiting_line(v: dict[str, Any], _: bool) -> str:
    reach = "" if v["lighthouse_reachable"] else " (UNREACHABLE)"
    return (
        f"[ft] {v['what']}: waiting for a quorum for {v['waited_s']:.0f}s; {v['needs']}, "
        f"{v['last_quorum_groups']} in the last quorum (lighthouse {v['lighthouse']}{reach}; "
        f"gives up after {v['timeout_field']}={v['timeout_s']:g}s)"
    )


# Events of this group's quorums and commits. ``what`` names what the quorum is for ("step 12",
# "sync #3", "start-up"); the event's step or sync number is that step or sync.

#: Still waiting for a quorum (when: ``QuorumWaitWatchdog.SCHEDULE_S``).
#: ``reason``: ``group_size`` (a new job needs all groups), ``min_replica_size``, or the
#: caller's (``QuorumPurpose.reason``); ``needs`` says it in words.
QUORUM_WAITING = EventKind("ft.quorum_waiting", _waiting_line, logging.WARNING)
#: A quorum formed after a wait long enough to have been reported.
QUORUM_FORMED = EventKind(
    "ft.quorum_formed", "[ft] {what}: quorum of {groups} group(s) after waiting {waited_s:.1f}s"
)
#: This group was healed in the quorum: ``states`` came from a live peer.
HEALED = EventKind(
    "ft.healed",
    lambda v, _: (
        f"[ft] {v['what']}: healed from a live peer ({', '.join(v['states'])}) in "
        f"{v['seconds']:.2f}s (quorum + transfer)"
        + (f"; kept its own {', '.join(v['kept_own'])}" if v.get("kept_own") else "")
    ),
)
FIRST_QUORUM = EventKind(
    "ft.first_quorum",
    "[ft] first quorum: {groups} group(s), manager step {manager_step}, after {seconds:.1f}s",
)
#: The first commit after uncommitted steps (syncs) or a change of the quorum's size:
#: ``stall_s`` since the previous commit.
COMMITTED_AFTER_STALL = EventKind(
    "ft.committed_after_stall",
    lambda v, _: (
        f"[ft] {v['what']}: committed by {v['groups']} group(s) (was {v['previous_groups']}) "
        f"after {v['uncommitted']} uncommitted {v['unit']}(s); stall: {v['stall_s']:.2f}s "
        "since the previous commit"
    ),
)


@dataclass(frozen=True)
class QuorumPurpose:
    """What a quorum other than the next step's is for, as its wait is reported."""

    #: Named in the log and events ("sync #3", "start-up").
    what: str
    #: The sync the quorum is for (the events' sync number); None: not a sync.
    sync: int | None = None
    #: What the wait needs, in words, and its ``reason`` in ``ft.quorum_waiting`` events
    #: (empty: the groups ``join_quorum`` needs).
    needs: str = ""
    reason: str = ""


class FTManager:
    """This rank's torchft Manager, and what the trainer does with it each step.

    The torchft Manager is built by :meth:`start`, not here: its server starts heartbeating to
    the lighthouse the moment it exists, and the lighthouse counts a heartbeating group that
    has not asked for a quorum against the others (a quorum needs more than half of the
    heartbeating groups). So a (re)starting group becomes visible only once its model, data
    and checkpoint are ready and it can ask for its first quorum at once. Until then, state
    registered for healing is kept here and the Manager's step (``state_dict``; checkpointed
    as ``ft_manager``) is held for it.
    """

    def __init__(
        self,
        job_config: JobConfig,
        build_manager: Callable[[Callable[..., Any] | None], Any],
        mesh: DeviceMesh | None = None,
        poll_s: float = 1.0,
    ) -> None:
        ft = job_config.fault_tolerance
        self._build_manager = build_manager
        self._manager: Any = None
        self.group_size = ft.group_size
        self.replica_id = ft.replica_id
        self.min_replica_size = ft.min_replica_size
        self.quorum_timeout_s = ft.quorum_timeout_s
        self.timeout_s = ft.timeout_s
        self.max_consecutive_failures = ft.max_consecutive_failures
        self.lighthouse = lighthouse_address(job_config)
        self.mesh = mesh
        self.poll_s = poll_s
        #: Every state registered for healing, given to each Manager :meth:`start` builds.
        self._registered: list[tuple[str, Callable[[Any], None], Callable[[], Any]]] = []
        self._pending_step: dict[str, int] | None = None
        self._quorum_ready = False
        self._last_quorum_size = 0
        self._needed = ft.group_size
        self._healed: list[str] = []
        #: States of the current heal that this group kept as its own (set by the transport).
        self._kept_own: set[str] = set()
        self._last_commit: float | None = None
        #: Recorded on the training stream where the state a heal sends was last written
        #: (:meth:`note_state_written`); None on a CPU.
        self._written: Any = None
        self._last_participants = 0
        self._uncommitted = 0
        #: Commits and commit attempts (steps or syncs) of this process.
        self.commits = 0
        self.attempts = 0
        #: What the current quorum is for (None: the next step).
        self._purpose: QuorumPurpose | None = None
        self.watchdog = QuorumWaitWatchdog(self._report_wait)

    # ---- life cycle --------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._manager is not None

    @property
    def manager(self) -> Any:
        """The torchft Manager (after :meth:`start`)."""
        if self._manager is None:
            raise RuntimeError("FTManager.start() has not been called: no torchft Manager yet")
        return self._manager

    def start(self, checkpoint_transport: Callable[..., Any] | None = None) -> None:
        """Build the torchft Manager (heartbeats to the lighthouse start now), give it the
        state registered so far and the step loaded from a checkpoint.
        ``checkpoint_transport(pg, timeout, device)``: how healing state travels (default
        torchft's ``PGTransport`` over the replicate process group); it may work on the state
        as it receives it, on the quorum's thread, while the main thread waits for the quorum
        (the semi-sync replay of missed syncs does)."""
        if self._manager is not None:
            return
        self._manager = self._build_manager(checkpoint_transport)
        if self._pending_step is not None:
            self._manager.load_state_dict(self._pending_step)
        for key, load, save in self._registered:
            self._manager.register_state_dict_fn(key, load, save)

    def step_down(self) -> None:
        """Shut the torchft Manager down (the group leaves the lighthouse's quorums) and keep
        its step, for a later :meth:`start` (which registers the same state again)."""
        if self._manager is None:
            return
        self._pending_step = {k: int(v) for k, v in self._manager.state_dict().items()}
        self._manager.shutdown(wait=False)
        self._manager = None

    # ---- state -----------------------------------------------------------------------------

    def register_state(self, name: str, state: Stateful) -> None:
        """Send ``state`` to joining groups and load it from a peer when this group heals."""
        register_healing_state(self, name, state, self.mesh, self._healed.append)

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        """torchft's ``Manager.register_state_dict_fn``, also before :meth:`start`."""
        self._registered.append((key, load, save))
        if self._manager is not None:
            self._manager.register_state_dict_fn(key, load, save)

    def note_state_written(self) -> None:
        """The state a heal sends is now what the kernels queued on this thread's stream so
        far write (an optimizer step may still run on the device): remember that point, for
        :meth:`wait_for_state_writes`. Called where a quorum starts, and where a method lets
        peers read its state again after it computed."""
        if torch.accelerator.is_available():
            self._written = torch.accelerator.current_stream().record_event()

    def wait_for_state_writes(self) -> None:
        """On the heal sender's stream (torchft sends from a stream of its own, which never
        waits for the training stream): wait for the point :meth:`note_state_written` marked,
        before the first read of the state. One event wait, not a device-wide synchronize."""
        if self._written is not None:
            torch.accelerator.current_stream().wait_event(self._written)

    def keep_own(self, names: list[str]) -> None:
        """In the heal under way, these states stay this group's own (a transport that sends
        only what the joiner lacks puts ``healing.KEEP_OWN`` in their place): ``ft.healed``
        names them apart."""
        self._kept_own.update(names)

    def state_dict(self) -> dict[str, int]:
        """The Manager's step and committed-batch count (for checkpoints)."""
        if self._manager is not None:
            return self._manager.state_dict()
        return dict(self._pending_step or {"step": 0, "batches_committed": 0})

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self._manager is not None:
            self._manager.load_state_dict(state)
        else:
            self._pending_step = {k: int(v) for k, v in state.items()}

    # ---- quorum ----------------------------------------------------------------------------

    def _groups_needed(self) -> int:
        # Before the job's first committed step every group must be there (the first group up
        # must not train alone); later min_replica_size. Every member of a quorum sees the same
        # step (a group behind heals to it) and size, so all decide alike.
        return self.group_size if self.manager.current_step() == 0 else self.min_replica_size

    def _subject(self) -> dict[str, Any]:
        """What the current quorum is for: the event's step or sync number, and ``what``."""
        purpose = self._purpose
        if purpose is not None and purpose.sync is not None:
            return {"sync": purpose.sync, "what": purpose.what}
        if purpose is not None:
            return {"what": purpose.what}
        step = self.manager.current_step() + 1
        return {"step": step, "what": f"step {step}"}

    def _report_wait(self, waited: float) -> None:
        purpose = self._purpose
        if purpose is not None and purpose.needs:
            reason, needs = purpose.reason, purpose.needs
        elif self._needed >= self.group_size and self.manager.current_step() <= 0:
            reason = "group_size"
            needs = f"all {self.group_size} replica groups needed before step 1"
        else:
            reason, needs = "min_replica_size", f"min_replica_size={self._needed} groups needed"
        QUORUM_WAITING.emit(
            **self._subject(),
            waited_s=waited,
            reason=reason,
            groups_needed=self._needed,
            needs=needs,
            last_quorum_groups=self._last_quorum_size,
            lighthouse=self.lighthouse,
            lighthouse_reachable=lighthouse_reachable(self.lighthouse),
            timeout_field=self._timeout_field,
            timeout_s=self._timeout_s,
        )

    _timeout_field = "fault_tolerance.quorum_timeout_s"
    _timeout_s = 0.0

    def join_quorum(
        self,
        needed: int | None = None,
        timeout_s: float | None = None,
        timeout_field: str = "fault_tolerance.quorum_timeout_s",
        purpose: QuorumPurpose | None = None,
    ) -> float:
        """Join a quorum with at least ``needed`` groups (default: all groups before the job's
        first commit, ``min_replica_size`` after) and use it; return the wait. The bounds and
        ``purpose`` are :meth:`quorum_rounds`'."""
        with self.quorum_rounds(needed, timeout_s, timeout_field, purpose) as rounds:
            rounds.form()
        return rounds.waited

    @contextlib.contextmanager
    def quorum_rounds(
        self,
        needed: int | None = None,
        timeout_s: float | None = None,
        timeout_field: str = "fault_tolerance.quorum_timeout_s",
        purpose: QuorumPurpose | None = None,
    ) -> Iterator[QuorumRounds]:
        """One bounded wait for a quorum the caller uses: inside the block,
        ``QuorumRounds.form`` joins the next quorum with at least ``needed`` groups (see
        :meth:`join_quorum`), each member checks it alike (e.g. after exchanging a few numbers)
        and forms another if it does not use it; the quorum formed last is used when the block
        ends without an error. A quorum that is too small or not used is skipped by all its
        members alike: no collective is started in it, and it is closed with a failed
        ``should_commit`` (which also applies any state a joiner received in it). Waiting is
        bounded by ``timeout_s`` (``timeout_field``, named in the error): a lighthouse that is
        down is retried within that time (torchft's quorum retries), so a restarted
        lighthouse is picked up again. ``purpose``: what the quorum is for, as the wait's
        reports and events say it (default: the next step)."""
        self._purpose = purpose
        self._timeout_s = self.quorum_timeout_s if timeout_s is None else timeout_s
        self._timeout_field = timeout_field
        start = time.monotonic()
        rounds = QuorumRounds(self, needed, start + self._timeout_s)
        try:
            # A peer healing in this quorum reads the state written by the kernels queued so
            # far.
            self.note_state_written()
            self._healed.clear()
            self._kept_own.clear()
            self.watchdog.begin()
            try:
                yield rounds
            except BaseException:
                self.watchdog.end()
                raise
            rounds.waited = waited = self.watchdog.end()
            subject = self._subject()
            if waited >= QuorumWaitWatchdog.SCHEDULE_S[0]:
                QUORUM_FORMED.emit(**subject, groups=rounds.size, waited_s=waited)
            if self._healed or self._kept_own:
                HEALED.emit(
                    **subject,
                    states=[s for s in dict.fromkeys(self._healed) if s not in self._kept_own],
                    kept_own=sorted(self._kept_own),
                    seconds=time.monotonic() - start,
                )
        finally:
            self._purpose = None

    def _quorum_failure(self, error: Exception) -> str:
        what = self._subject()["what"]
        if not lighthouse_reachable(self.lighthouse):
            return (
                f"the torchft lighthouse at {self.lighthouse} is unreachable: replica group "
                f"{self.replica_id} got no quorum for {what} within {self._timeout_field}="
                f"{self._timeout_s:g}s. Restart torchft_lighthouse there (groups pick up a "
                "restarted lighthouse by themselves while they wait)."
            )
        return (
            f"no quorum from the lighthouse at {self.lighthouse} (replica group "
            f"{self.replica_id}, {what}) within {self._timeout_field}={self._timeout_s:g}s: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. "
            f"A slower replica group or a longer period needs a larger {self._timeout_field}."
        )

    def _too_few_groups(self, size: int) -> str:
        if size >= self._needed:  # its members did not use it (the caller's check failed)
            purpose = self._purpose
            needs = f" ({purpose.needs})" if purpose is not None and purpose.needs else ""
            return (
                f"replica group {self.replica_id}: waited {self._timeout_s:g}s "
                f"({self._timeout_field}) for a quorum its members use{needs}; the last one "
                f"had {size} groups but was not used (the lines above say why: a group it "
                f"waits for, or groups that do not agree); raise {self._timeout_field} if "
                "they need longer."
            )
        if self.manager.current_step() <= 0 and self._needed >= self.group_size:
            fix = (
                "a new job starts only with all fault_tolerance.group_size groups: start the "
                "missing ones, or lower group_size"
            )
        else:
            fix = "start the missing groups, or lower fault_tolerance.min_replica_size"
        return (
            f"replica group {self.replica_id}: waited {self._timeout_s:g}s "
            f"({self._timeout_field}) for a quorum of {self._needed} groups; the last one had "
            f"{size}: {fix}."
        )

    def start_step(self) -> None:
        """Join the quorum of this step (heal if behind), unless ``wait_for_full_quorum``
        already holds one for it. Blocks until the quorum has enough groups."""
        if self._quorum_ready:
            self._quorum_ready = False
            return
        self.join_quorum()

    def wait_for_full_quorum(self) -> None:
        """Before the loop: join the first quorum now (all ``group_size`` groups for a new
        job, ``min_replica_size`` for one that already committed steps) and keep it for the
        first ``start_step``."""
        start = time.perf_counter()
        self.join_quorum()
        self._quorum_ready = True
        FIRST_QUORUM.emit(
            groups=self.manager.num_participants(),
            manager_step=self.manager.current_step(),
            seconds=time.perf_counter() - start,
        )

    def allreduce_gradients(self, model: nn.Module) -> None:
        """Average the gradients of this rank's shard across the replica groups in the quorum.

        Gradients are flattened into one buffer per dtype so a step costs one collective. A
        failure (a peer died) does not raise: torchft records it and ``should_commit`` says no
        (``delivery.all_reduce_across_groups``: also on nccl, where only the work may know).
        """
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters()
            if p.grad is not None
        ]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            if not all_reduce_across_groups(self.manager, flat, average=True):
                return  # not committed: the gradients stay as they are
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def should_commit(self, unit: str = "step") -> bool:
        """True when every rank of this group finished this step (or sync) without error.
        (torchft decides per group: another group may decide otherwise; it then heals at the
        next quorum.) The first commit after a failure or a change of the quorum's size logs
        how long commits stalled. ``fault_tolerance.max_consecutive_failures`` failures in a
        row stop the run with the cause torchft recorded."""
        self.attempts += 1
        try:
            committed = self.manager.should_commit()
        except TimeoutError as e:  # the ranks of this group did not all answer in time
            raise FaultToleranceError(
                f"replica group {self.replica_id}: should_commit of this {unit} timed out "
                f"(fault_tolerance.timeout_s={self.timeout_s:g}s): a rank of this group is "
                f"stuck or slower than that ({str(e).splitlines()[0] if str(e) else 'timeout'})"
            ) from e
        now = time.monotonic()
        if not committed:
            self._uncommitted += 1
            limit = self.max_consecutive_failures
            if limit and self._uncommitted >= limit:
                raise FaultToleranceError(
                    f"replica group {self.replica_id}: {self._uncommitted} {unit}s in a row "
                    f"were not committed (fault_tolerance.max_consecutive_failures={limit}); "
                    f"the last cause: {self.last_error()}"
                )
            return False
        self.commits += 1
        size = self.manager.num_participants()
        changed = self._last_participants and size != self._last_participants
        if self._last_commit is not None and (self._uncommitted or changed):
            number = self.manager.current_step()
            subject = (
                {"sync": number, "what": f"sync #{number}"}
                if unit == "sync"
                else {"step": number, "what": f"step {number}"}
            )
            COMMITTED_AFTER_STALL.emit(
                **subject,
                unit=unit,
                groups=size,
                previous_groups=self._last_participants,
                uncommitted=self._uncommitted,
                stall_s=now - self._last_commit,
            )
        self._last_commit = now
        self._last_participants = size
        self._uncommitted = 0
        return True

    @property
    def uncommitted_in_a_row(self) -> int:
        """Commits that failed since the last one (counted toward max_consecutive_failures)."""
        return self._uncommitted

    def last_error(self) -> str:
        """One line: the error torchft recorded in the current quorum (or why none is known)."""
        error = self.manager.errored()
        if error is None:
            return "none recorded (a peer group failed, or this group healed)"
        error = getattr(error, "original_exception", error)
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0] if text else ''}"

    def check_progress(self) -> None:
        """At the end of training: a run that tried to commit and committed nothing failed."""
        if self.attempts and not self.commits:
            raise FaultToleranceError(
                f"replica group {self.replica_id} committed none of its {self.attempts} "
                f"attempts (the last cause: {self.last_error()}); nothing it trained counts"
            )

    def shutdown(self) -> None:
        self.watchdog.stop()
        if self._manager is not None:
            self._manager.shutdown(wait=False)


class QuorumRounds:
    """The quorums of one bounded wait (:meth:`FTManager.quorum_rounds`), formed one by one."""

    def __init__(self, ft: FTManager, needed: int | None, deadline: float) -> None:
        self._ft = ft
        self._needed = needed
        self._deadline = deadline
        #: The size of the quorum formed last (0: none formed yet).
        self.size = 0
        #: Once the wait is over: how long it took (``QuorumWaitWatchdog``'s measure).
        self.waited = 0.0

    def form(self) -> int:
        """Close the quorum formed before, if any, unused; join the next one with enough
        groups and return its size."""
        if self.size:
            self._skip(self.size)
        ft = self._ft
        while True:
            try:
                remaining = max(self._deadline - time.monotonic(), 1.0)
                ft.manager.start_quorum(timeout=timedelta(seconds=remaining))
                ft.manager.wait_quorum()
            except FaultToleranceError:  # a check of the healed state failed: say that
                raise
            except Exception as e:
                raise FaultToleranceError(ft._quorum_failure(e)) from e
            size = ft._last_quorum_size = ft.manager.num_participants()
            ft._needed = ft._groups_needed() if self._needed is None else self._needed
            if size >= ft._needed:
                self.size = size
                return size
            self._skip(size)

    def _skip(self, size: int) -> None:
        """Close a quorum of ``size`` groups unused, alike in all its members; past the
        deadline, stop with the error that names the bound."""
        self.size = 0
        manager = self._ft.manager
        manager.report_error(RuntimeError(f"quorum of {size} not used"))
        manager.should_commit()
        if time.monotonic() >= self._deadline:
            raise FaultToleranceError(self._ft._too_few_groups(size))
        time.sleep(self._ft.poll_s)
