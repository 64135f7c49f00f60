"""Fault tolerance across replica groups with torchft.

Each rank of each replica group (one ``torchrun``, or one process) owns one ``torchft.Manager``.
The managers of rank r in every group form the fault-tolerant replicate dimension: a process
group that torchft rebuilds at every quorum from the groups alive at that moment.

The failure semantics (what a step, a dead group, a restarted group, a lighthouse restart and
too few groups do; which timeout governs what) are written once, in
``docs/fault_tolerance.md``. In one line each, for the reader of this file:

* ``should_commit`` is decided per group (every rank of the group finished without error); a
  group that did not commit a step its peers committed is behind and heals at the next quorum.
* A (re)starting group builds its Manager (and so becomes visible to the lighthouse) only in
  ``FTManager.start``, once its model, data and checkpoint are ready.
* Quorum waits are bounded (``join_quorum``) and end in one error line naming the field to
  raise; a lighthouse that restarts on the same address is found again within that time.

Network exposure: everything this module starts listens on ``fault_tolerance.hostname``
(default 127.0.0.1) only; torchft's manager server would bind every interface, so its
construction is wrapped (``_manager_server_bound_to``). What remains is listed in the docs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.components.ft.errors import FaultToleranceError
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

# Per-group state that a joiner must not take from its peer (see module docstring).
NOT_HEALED = frozenset({"dataloader"})

# Marker of a DTensor shard in healing state (see ``_to_local_tree``).
_SHARD = "__ft_local_shard__"




# ---- addresses -------------------------------------------------------------------------------


def lighthouse_address(job_config: JobConfig) -> str:
    address = job_config.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise FaultToleranceError(
            "fault_tolerance.enable is set but no lighthouse address is known: set "
            "fault_tolerance.lighthouse=http://HOST:PORT or env TORCHFT_LIGHTHOUSE "
            "(start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:PORT`)"
        )
    return address


def bind_ip(hostname: str) -> str:
    """The IP address that ``hostname`` (``fault_tolerance.hostname``) resolves to: what this
    group's listening sockets bind to."""
    try:
        return str(ipaddress.ip_address(hostname.strip("[]")))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise FaultToleranceError(
            f"fault_tolerance.hostname: {hostname!r} does not resolve ({e}); use this host's "
            "address on the network the replica groups share, or 127.0.0.1 for one machine"
        ) from e


def _host_port(ip: str, port: int | str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else None


def confine_to_host(job_config: JobConfig) -> None:
    """Before the trainer starts: make this process's own listeners use
    ``fault_tolerance.hostname`` (default 127.0.0.1).

    * A group of one process (no ``torchrun``) still needs a TCP store for torchft's Manager;
      host it here, bound to that address only (a torchrun store binds every interface).
    * gloo binds to the address of the machine's hostname (nccl's sockets to an interface it
      picks) unless ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``) names one: for a loopback
      address, name the loopback interface (unless the user set the variable).
    """
    ip = bind_ip(job_config.fault_tolerance.hostname)
    interface = _loopback_interface() if ipaddress.ip_address(ip).is_loopback else None
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    store = listen_store(ip)
    os.environ.update(MASTER_ADDR=ip, MASTER_PORT=str(store.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    confine_to_host.store = store  # type: ignore[attr-defined]  # keep it alive


def listen_store(ip: str) -> Any:
    """A TCPStore server listening on ``ip`` only, on a free port. (``TCPStore(host, ...)``
    alone binds every interface; a socket bound here and handed over does not.)"""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore(
        ip, port, world_size=1, is_master=True, wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )  # fmt: skip


@contextlib.contextmanager
def _manager_server_bound_to(ip: str) -> Iterator[None]:
    """While a torchft ``Manager`` is built, make its ``ManagerServer`` listen on ``ip`` only.

    torchft 0.2.0 hard-codes ``bind=f"[::]:{port}"`` (every interface) in ``Manager.__init__``
    and offers no parameter; the server is looked up in ``torchft.manager``'s namespace, so it is
    replaced there for the duration of the construction, keeping the port torchft chose.
    """
    import torchft.manager as torchft_manager

    original = torchft_manager.ManagerServer

    def bound_server(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        return original(*args, bind=_host_port(ip, port), **kwargs)

    torchft_manager.ManagerServer = bound_server  # type: ignore[misc]
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original  # type: ignore[misc]


# ---- healing state ---------------------------------------------------------------------------


def _to_local_tree(value: Any) -> Any:
    """Replace DTensors by their local shards plus layout, so state crosses groups as plain
    tensors (rank r of one group heals rank r of another: the shards line up). The layout is
    sent because the joiner may have no tensor to take it from (a fresh optimizer's state)."""
    if isinstance(value, DTensor):
        return {
            _SHARD: value.to_local(),
            "placements": tuple(value.placements),
            "shape": tuple(value.shape),
            "stride": tuple(value.stride()),
        }
    if isinstance(value, dict):
        return {k: _to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local_tree(v) for v in value]
    return value


def _from_local_tree(template: Any, value: Any, mesh: DeviceMesh | None) -> Any:
    """Inverse of ``_to_local_tree``: re-wrap shards as DTensors on ``template``'s mesh (or this
    group's ``mesh`` where the template has no such entry) and move tensors to its device."""
    if isinstance(value, dict) and _SHARD in value:
        local = value[_SHARD]
        if isinstance(template, DTensor):
            mesh, local = template.device_mesh, local.to(template.device)
        elif mesh is None:
            raise FaultToleranceError(
                "healing state holds a sharded tensor but this group has no device mesh: "
                "every replica group must run the same number of ranks (NGPU)"
            )
        return DTensor.from_local(
            local,
            mesh,
            value["placements"],
            run_check=False,
            shape=torch.Size(value["shape"]),
            stride=value["stride"],
        )
    if isinstance(value, dict):
        sub = template if isinstance(template, dict) else {}
        return {k: _from_local_tree(sub.get(k), v, mesh) for k, v in value.items()}
    if isinstance(value, list):
        subs = template if isinstance(template, list) and len(template) == len(value) else []
        return [_from_local_tree(subs[i] if subs else None, v, mesh) for i, v in enumerate(value)]
    if isinstance(template, torch.Tensor) and isinstance(value, torch.Tensor):
        return value.to(template.device)
    return value


def register_healing_state(
    manager: Any,
    name: str,
    state: Stateful,
    mesh: DeviceMesh | None = None,
    on_load: Callable[[str], None] | None = None,
) -> None:
    """Serve ``state`` (read when a peer asks) to joiners and load it when this group heals.
    ``mesh``: this group's FSDP mesh, to rebuild sharded entries the local state lacks."""

    def save() -> Any:
        return _to_local_tree(state.state_dict())

    def load(value: Any) -> None:
        state.load_state_dict(_from_local_tree(state.state_dict(), value, mesh))
        if on_load is not None:
            on_load(name)

    manager.register_state_dict_fn(name, load, save)


# ---- the per-step protocol -------------------------------------------------------------------


class _Watchdog:
    """Logs, from a thread, while the trainer is blocked waiting for a quorum: after 5 s, then
    at 10, 20, 40, 60 s and every 60 s after that (so a long wait is visible, never noisy)."""

    FIRST_REPORT_S = 5.0
    MAX_INTERVAL_S = 60.0

    def __init__(self, describe: Callable[[float], str], tick_s: float = 0.25) -> None:
        self._describe = describe
        self._tick_s = tick_s
        self._since: float | None = None
        self._next_report = self.FIRST_REPORT_S
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.reports = 0
        self._thread = threading.Thread(target=self._run, name="ft-watchdog", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """The trainer starts waiting (no-op if it already is)."""
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()
                self._next_report = self.FIRST_REPORT_S

    def end(self) -> float:
        """The wait is over; returns how long it lasted."""
        with self._lock:
            since, self._since = self._since, None
        return 0.0 if since is None else time.monotonic() - since

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            with self._lock:
                if self._since is None:
                    continue
                waited = time.monotonic() - self._since
                if waited < self._next_report:
                    continue
                interval = min(self._next_report, self.MAX_INTERVAL_S)
                self._next_report += interval
            self.reports += 1
            logger.warning(self._describe(waited))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


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
        build_manager: Callable[[], Any],
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
        self._pending: list[tuple[str, Callable[[Any], None], Callable[[], Any]]] = []
        self._pending_step: dict[str, int] | None = None
        self._quorum_ready = False
        self._last_quorum_size = 0
        self._needed = ft.group_size
        self._healed: list[str] = []
        self._last_commit: float | None = None
        self._last_participants = 0
        self._uncommitted = 0
        #: Commits and commit attempts (steps or syncs) of this process.
        self.commits = 0
        self.attempts = 0
        #: What the current wait is for, and what it needs, in the watchdog's lines ("step 12",
        #: "sync #3"; default: the groups join_quorum needs).
        self.waiting_for = ""
        self.waiting_needs = ""
        self.watchdog = _Watchdog(self._describe_wait)

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

    def start(self) -> None:
        """Build the torchft Manager (heartbeats to the lighthouse start now), give it the
        state registered so far and the step loaded from a checkpoint."""
        if self._manager is not None:
            return
        self._manager = self._build_manager()
        if self._pending_step is not None:
            self._manager.load_state_dict(self._pending_step)
        for key, load, save in self._pending:
            self._manager.register_state_dict_fn(key, load, save)
        self._pending.clear()

    # ---- state -----------------------------------------------------------------------------

    def register_state(self, name: str, state: Stateful) -> None:
        """Send ``state`` to joining groups and load it from a peer when this group heals."""
        register_healing_state(self, name, state, self.mesh, self._healed.append)

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        """torchft's ``Manager.register_state_dict_fn``, also before :meth:`start`."""
        if self._manager is None:
            self._pending.append((key, load, save))
        else:
            self._manager.register_state_dict_fn(key, load, save)

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

    def _describe_wait(self, waited: float) -> str:
        what = self.waiting_for or f"step {self.manager.current_step() + 1}"
        if self.waiting_needs:
            need = self.waiting_needs
        elif self._needed >= self.group_size and self.manager.current_step() <= 0:
            need = f"all {self.group_size} replica groups needed before step 1"
        else:
            need = f"min_replica_size={self._needed} groups needed"
        reach = "" if lighthouse_reachable(self.lighthouse) else " (UNREACHABLE)"
        return (
            f"[ft] {what}: waiting for a quorum for {waited:.0f}s; {need}, "
            f"{self._last_quorum_size} in the last quorum (lighthouse {self.lighthouse}"
            f"{reach}; gives up after {self._timeout_field}={self._timeout_s:g}s)"
        )

    _timeout_field = "fault_tolerance.quorum_timeout_s"
    _timeout_s = 0.0

    def join_quorum(
        self,
        needed: int | None = None,
        timeout_s: float | None = None,
        timeout_field: str = "fault_tolerance.quorum_timeout_s",
        accept: Callable[[], bool] | None = None,
    ) -> float:
        """Join a quorum with at least ``needed`` groups (default: all groups before the
        job's first commit, ``min_replica_size`` after) for which ``accept()`` (a check every
        member makes alike, e.g. after exchanging a few numbers) holds; return the wait.

        A quorum that is too small or not accepted is skipped by all its members alike: no
        collective is started in it, and it is closed with a failed ``should_commit`` (which
        also applies any state a joiner received in it). Waiting is bounded by ``timeout_s``
        (``timeout_field``, named in the error): a lighthouse that is down is retried within
        that time (torchft's quorum retries), so a restarted lighthouse is picked up again.
        """
        self._timeout_s = self.quorum_timeout_s if timeout_s is None else timeout_s
        self._timeout_field = timeout_field
        start = time.monotonic()
        deadline = start + self._timeout_s
        self._healed.clear()
        self.watchdog.begin()
        while True:
            try:
                remaining = max(deadline - time.monotonic(), 1.0)
                self.manager.start_quorum(timeout=timedelta(seconds=remaining))
                self.manager.wait_quorum()
            except FaultToleranceError:  # a check of the healed state failed: say that
                self.watchdog.end()
                raise
            except Exception as e:
                self.watchdog.end()
                raise FaultToleranceError(self._quorum_failure(e)) from e
            size = self.manager.num_participants()
            self._last_quorum_size = size
            self._needed = self._groups_needed() if needed is None else needed
            try:
                if size >= self._needed and (accept is None or accept()):
                    break
            except BaseException:
                self.watchdog.end()
                raise
            self.manager.report_error(RuntimeError(f"quorum of {size} not used"))
            self.manager.should_commit()
            if time.monotonic() >= deadline:
                self.watchdog.end()
                raise FaultToleranceError(self._too_few_groups(size))
            time.sleep(self.poll_s)
        waited = self.watchdog.end()
        what = self.waiting_for or f"step {self.manager.current_step() + 1}"
        if waited >= _Watchdog.FIRST_REPORT_S:
            logger.info(f"[ft] {what}: quorum of {size} group(s) after waiting {waited:.1f}s")
        if self._healed:
            logger.info(
                f"[ft] {what}: healed from a live peer "
                f"({', '.join(dict.fromkeys(self._healed))}) in "
                f"{time.monotonic() - start:.2f}s (quorum + transfer)"
            )
        return waited

    def _quorum_failure(self, error: Exception) -> str:
        what = self.waiting_for or f"step {self.manager.current_step() + 1}"
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
        logger.info(
            f"[ft] first quorum: {self.manager.num_participants()} group(s), manager step "
            f"{self.manager.current_step()}, after {time.perf_counter() - start:.1f}s"
        )

    def allreduce_gradients(self, model: nn.Module) -> None:
        """Average the gradients of this rank's shard across the replica groups in the quorum.

        Gradients are flattened into one buffer per dtype so a step costs one collective. A
        failure (a peer died) does not raise: torchft records it and ``should_commit`` says no.
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
            self.manager.allreduce(flat).wait()
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
            what = f"sync #{number}" if unit == "sync" else f"step {number}"
            logger.info(
                f"[ft] {what}: committed by {size} group(s) (was "
                f"{self._last_participants}) after {self._uncommitted} uncommitted {unit}(s); "
                f"stall: {now - self._last_commit:.2f}s since the previous commit"
            )
        self._last_commit = now
        self._last_participants = size
        self._uncommitted = 0
        return True

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


def lighthouse_reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at the lighthouse's address."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _quiet_known_torchft_noise() -> None:
    """Drop messages torchft 0.2.0 prints on every heal or quorum that say nothing to a user:
    a non-writable-buffer warning and a pytree deprecation inside its checkpoint transport,
    and a flight-recorder notice that only concerns NCCL."""
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)

    class _NoFlightRecorderNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "flight recorder" not in record.getMessage()

    logging.getLogger("torchft.manager").addFilter(_NoFlightRecorderNotice())


def fresh_rendezvous_address(store_addr: str, world_size: int, timeout: timedelta) -> str:
    """``store_addr`` (torchft's ``host:port/torchft/<quorum id>/<rank>``) with one more prefix
    level that no earlier rendezvous of the same quorum id used.

    torchft keys the process-group rendezvous of a quorum by the lighthouse's quorum id, and a
    restarted lighthouse numbers its quorums from 1 again: a survivor's store may then still
    hold the keys of the old quorum of that number, and a member that reads a stale peer
    address fails the rebuild. Each member adds 1 to a counter under the prefix; the members of
    one rebuild together add ``world_size``, so ``(count - 1) // world_size`` is the same for all
    of them and new for every rebuild. (A rebuild that a member died in leaves the counter out
    of step; the next one then fails, is not committed, and gets a new quorum id.)"""
    from torchft.process_group import create_store_client

    store = create_store_client(store_addr, timeout=timeout)
    rebuild = (store.add("rebuilds", 1) - 1) // world_size
    return f"{store_addr}/rebuild_{rebuild}"


def _process_group(backend: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group for ``backend``, rebuilt on fresh rendezvous keys
    (:func:`fresh_rendezvous_address`)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo

    class FreshRendezvous(base):  # type: ignore[valid-type,misc]  # a class chosen at run time
        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      *args: Any, **kwargs: Any) -> None:  # fmt: skip
            address = fresh_rendezvous_address(store_addr, world_size, timeout)
            super().configure(address, replica_id, rank, world_size, *args, **kwargs)

    return FreshRendezvous(timeout=timeout)


#: How often a group re-sends a quorum request that the lighthouse failed to answer (it died,
#: or is restarting): torchft spreads its retries over the quorum timeout, so their number is
#: the timeout divided by this.
QUORUM_RETRY_INTERVAL_S = 1.0


def build_ft_manager(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    states: dict[str, Stateful],
    *,
    use_async_quorum: bool = False,
    init_sync: bool = True,
    quorum_timeout_s: float | None = None,
) -> FTManager | None:
    """This rank's FTManager, from ``[fault_tolerance]``; None when it is off. The torchft
    Manager itself is built by ``FTManager.start()``.

    The quorum is synchronous by default: ``start_step`` waits for it anyway (to skip a quorum
    that is too small), and healing then happens before the forward pass, on the main thread,
    so a joiner trains in its first step instead of sending zeros, and no state is read by
    torchft's quorum thread while the model runs (FSDP swaps parameters during forward).
    ``quorum_timeout_s``: the longest quorum wait the trainer will ask for (default
    ``fault_tolerance.quorum_timeout_s``), the Manager's default timeout for the quorums that
    torchft's own algorithms start.
    """
    ft = job_config.fault_tolerance
    if not ft.enable:
        return None
    # torchft's Rust side logs every quorum and commit at INFO; keep its warnings only
    # unless the user asked otherwise (RUST_LOG=info shows them again).
    os.environ.setdefault("RUST_LOG", "warn")
    _quiet_known_torchft_noise()
    address = lighthouse_address(job_config)
    longest_quorum_s = max(ft.quorum_timeout_s, quorum_timeout_s or 0.0)

    def build_manager() -> Any:
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        backend = ft.process_group
        if backend == "auto":
            backend = "nccl" if parallel_dims.device.type == "cuda" else "gloo"
        pg = _process_group(backend, timedelta(milliseconds=ft.process_group_timeout_ms))
        # Healing goes over the replicate process group itself (no extra HTTP server listening
        # on every interface and serving the whole model unauthenticated).
        transport = PGTransport(
            pg, timeout=timedelta(seconds=ft.timeout_s), device=parallel_dims.device
        )
        try:
            with _manager_server_bound_to(bind_ip(ft.hostname)):
                manager = Manager(
                    pg=pg,
                    load_state_dict=None,
                    state_dict=None,
                    min_replica_size=ft.min_replica_size,
                    use_async_quorum=use_async_quorum,
                    timeout=timedelta(seconds=ft.timeout_s),
                    quorum_timeout=timedelta(seconds=quorum_timeout_s or ft.quorum_timeout_s),
                    connect_timeout=timedelta(seconds=ft.connect_timeout_s),
                    rank=parallel_dims.rank,
                    world_size=parallel_dims.world_size,
                    lighthouse_addr=address,
                    replica_id=f"replica_{ft.replica_id}",
                    hostname=ft.hostname,
                    checkpoint_transport=transport,
                    init_sync=init_sync,
                    # A quorum request that the lighthouse cannot answer (it died or restarts)
                    # is re-sent about every QUORUM_RETRY_INTERVAL_S until the timeout, so a
                    # lighthouse restarted on the same address is found again.
                    quorum_retries=math.ceil(longest_quorum_s / QUORUM_RETRY_INTERVAL_S),
                )
        except RuntimeError as e:
            if "failed to connect" not in str(e):
                raise
            raise FaultToleranceError(
                f"cannot reach the torchft lighthouse at {address} within "
                f"fault_tolerance.connect_timeout_s={ft.connect_timeout_s:g}s. Is "
                "torchft_lighthouse running there, and is fault_tolerance.lighthouse (or env "
                f"TORCHFT_LIGHTHOUSE) right? ({str(e).splitlines()[0]})"
            ) from e
        logger.info(
            f"[ft] replica group {ft.replica_id} of {ft.group_size}, {backend}, lighthouse "
            f"{address}, min_replica_size {ft.min_replica_size}, listening on {ft.hostname}"
        )
        return manager

    ft_manager = FTManager(job_config, build_manager, parallel_dims.dp_mesh)
    for name, state in states.items():
        if name not in NOT_HEALED:
            ft_manager.register_state(name, state)
    return ft_manager
