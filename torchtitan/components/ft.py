"""Fault tolerance across replica groups with torchft.

Each rank of each replica group (one ``torchrun``, or one process) owns one ``torchft.Manager``.
The managers of rank r in every group form the fault-tolerant replicate dimension: a process
group that torchft rebuilds at every quorum from the groups alive at that moment. The full story,
with the multi-host recipe, is in ``docs/fault_tolerance.md``.

Failure semantics (synchronous FT):

* A step is all-or-nothing. ``start_step`` joins the quorum of the step; gradients are averaged
  across the groups in it; ``should_commit`` is True only if no group failed during the step. A
  step that is not committed changes nothing (no optimizer step, no LR step, no step count);
  the trainer moves on to the next batch (the batch of the failed step is not retried).
* A group that dies (SIGKILL, crash) stops heartbeating. A survivor's collective with it fails
  at once (connection reset) or after ``process_group_timeout_ms`` (a hung peer); the survivor's
  next quorum forms without the dead group once the lighthouse's ``heartbeat_timeout_ms`` has
  passed. That is the stall survivors see; the first commit after it says how long it was.
* Groups train only in a quorum of at least ``min_replica_size`` groups (before the job's first
  committed step: all ``group_size`` groups, so the first group up does not train alone). With
  fewer, they wait, say so every so often, and fail after ``quorum_timeout_s``.
* A group that (re)joins heals in the quorum it joins, before its forward pass: a live peer
  sends it every state in the trainer's registry except the dataloader (model, optimizer, LR
  schedule, train step, and state registered by subclasses), so it computes its first step on
  the same parameters as its peers and its first committed step leaves it bit-identical to them.
  Its data position stays its own (each group reads its own shard; a restarted group resumes it
  from its own checkpoint, else from the shard's start). With ``use_async_quorum=True`` torchft
  applies the received state in ``should_commit`` instead, and the joiner's gradient of that
  step is zeros; the parameters are bit-identical after it all the same.

Network exposure: everything this module starts listens on ``fault_tolerance.hostname``
(default 127.0.0.1) only; torchft's manager server would bind every interface, so its
construction is wrapped (``_manager_server_bound_to``). What remains is listed in the docs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
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
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

# Per-group state that a joiner must not take from its peer (see module docstring).
NOT_HEALED = frozenset({"dataloader"})

# Marker of a DTensor shard in healing state (see ``_to_local_tree``).
_SHARD = "__ft_local_shard__"


class FaultToleranceError(RuntimeError):
    """The fault-tolerant job cannot go on: no lighthouse, no quorum in time, bad healing state.
    The message names the address or the config field involved."""


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
    """This rank's torchft Manager, and what the trainer does with it each step."""

    def __init__(
        self,
        manager: Any,
        job_config: JobConfig,
        mesh: DeviceMesh | None = None,
        poll_s: float = 1.0,
    ) -> None:
        ft = job_config.fault_tolerance
        self.manager = manager
        self.group_size = ft.group_size
        self.replica_id = ft.replica_id
        self.min_replica_size = ft.min_replica_size
        self.quorum_timeout_s = ft.quorum_timeout_s
        self.lighthouse = lighthouse_address(job_config)
        self.mesh = mesh
        self.poll_s = poll_s
        self._quorum_ready = False
        self._last_quorum_size = 0
        self._needed = ft.group_size
        self._healed: list[str] = []
        self._last_commit: float | None = None
        self._last_participants = 0
        self._uncommitted = 0
        self.watchdog = _Watchdog(self._describe_wait)

    # ---- state -----------------------------------------------------------------------------

    def register_state(self, name: str, state: Stateful) -> None:
        """Send ``state`` to joining groups and load it from a peer when this group heals."""
        register_healing_state(self.manager, name, state, self.mesh, self._healed.append)

    # ---- quorum ----------------------------------------------------------------------------

    def _groups_needed(self) -> int:
        # Before the job's first committed step every group must be there (the first group up
        # must not train alone); later min_replica_size. Every member of a quorum sees the same
        # step (a group behind heals to it) and size, so all decide alike.
        return self.group_size if self.manager.current_step() == 0 else self.min_replica_size

    def _describe_wait(self, waited: float) -> str:
        step = self.manager.current_step() + 1
        if self._needed >= self.group_size and self.manager.current_step() == 0:
            need = f"all {self.group_size} replica groups needed before step 1"
        else:
            need = f"min_replica_size={self._needed} groups needed"
        return (
            f"[ft] step {step}: waiting for a quorum for {waited:.0f}s; {need}, "
            f"{self._last_quorum_size} in the last quorum (lighthouse {self.lighthouse}; "
            f"gives up after fault_tolerance.quorum_timeout_s={self.quorum_timeout_s:g}s)"
        )

    def _join_quorum(self) -> None:
        """Join a quorum with enough groups to train this step (see the module docstring).

        A quorum that is too small is skipped by all its members alike: no collective is
        started in it, and it is closed with a failed ``should_commit`` (which also applies any
        state a joiner received in it). Waiting is bounded by ``quorum_timeout_s``.
        """
        start = time.monotonic()
        deadline = start + self.quorum_timeout_s
        self._healed.clear()
        self.watchdog.begin()
        while True:
            try:
                remaining = max(deadline - time.monotonic(), 1.0)
                self.manager.start_quorum(timeout=timedelta(seconds=remaining))
                self.manager.wait_quorum()
            except Exception as e:
                self.watchdog.end()
                raise FaultToleranceError(
                    f"no quorum from the lighthouse at {self.lighthouse} (replica group "
                    f"{self.replica_id}, step {self.manager.current_step() + 1}): "
                    f"{type(e).__name__}: {e}. Governed by fault_tolerance.quorum_timeout_s="
                    f"{self.quorum_timeout_s:g} and connect_timeout_s."
                ) from e
            size = self.manager.num_participants()
            self._last_quorum_size = size
            self._needed = self._groups_needed()
            if size >= self._needed:
                break
            self.manager.report_error(RuntimeError(f"quorum of {size} < {self._needed} groups"))
            self.manager.should_commit()
            if time.monotonic() >= deadline:
                self.watchdog.end()
                fix = (
                    "a new job starts only with all fault_tolerance.group_size groups: start the "
                    "missing ones, or lower group_size"
                    if self.manager.current_step() == 0
                    else "start the missing groups, or lower fault_tolerance.min_replica_size"
                )
                raise FaultToleranceError(
                    f"replica group {self.replica_id}: waited {self.quorum_timeout_s:g}s "
                    f"(fault_tolerance.quorum_timeout_s) for a quorum of {self._needed} groups; "
                    f"the last one had {size}: {fix}."
                )
            time.sleep(self.poll_s)
        waited = self.watchdog.end()
        step = self.manager.current_step() + 1
        if waited >= _Watchdog.FIRST_REPORT_S:
            logger.info(f"[ft] step {step}: quorum of {size} group(s) after waiting {waited:.1f}s")
        if self._healed:
            logger.info(
                f"[ft] step {step}: healed from a live peer "
                f"({', '.join(dict.fromkeys(self._healed))}) in "
                f"{time.monotonic() - start:.2f}s (quorum + transfer)"
            )

    def start_step(self) -> None:
        """Join the quorum of this step (heal if behind), unless ``wait_for_full_quorum``
        already holds one for it. Blocks until the quorum has enough groups."""
        if self._quorum_ready:
            self._quorum_ready = False
            return
        self._join_quorum()

    def wait_for_full_quorum(self) -> None:
        """Before the loop: join the first quorum now (all ``group_size`` groups for a new
        job, ``min_replica_size`` for one that already committed steps) and keep it for the
        first ``start_step``."""
        start = time.perf_counter()
        self._join_quorum()
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

    def should_commit(self) -> bool:
        """True when every group in the quorum finished this step without error. The first
        commit after a failure or a change of the quorum's size logs how long commits stalled."""
        committed = self.manager.should_commit()
        now = time.monotonic()
        if not committed:
            self._uncommitted += 1
            return False
        size = self.manager.num_participants()
        changed = self._last_participants and size != self._last_participants
        if self._last_commit is not None and (self._uncommitted or changed):
            logger.info(
                f"[ft] step {self.manager.current_step()}: committed by {size} group(s) (was "
                f"{self._last_participants}) after {self._uncommitted} uncommitted step(s); "
                f"stall: {now - self._last_commit:.2f}s since the previous commit"
            )
        self._last_commit = now
        self._last_participants = size
        self._uncommitted = 0
        return True

    def shutdown(self) -> None:
        self.watchdog.stop()
        self.manager.shutdown(wait=False)


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


def build_ft_manager(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    states: dict[str, Stateful],
    *,
    use_async_quorum: bool = False,
    init_sync: bool = True,
) -> FTManager | None:
    """The Manager of this rank, from ``[fault_tolerance]``; None when it is off.

    The quorum is synchronous by default: ``start_step`` waits for it anyway (to skip a quorum
    that is too small), and healing then happens before the forward pass, on the main thread,
    so a joiner trains in its first step instead of sending zeros, and no state is read by
    torchft's quorum thread while the model runs (FSDP swaps parameters during forward).
    """
    ft = job_config.fault_tolerance
    if not ft.enable:
        return None
    # torchft's Rust side logs every quorum and commit at INFO; keep its warnings only
    # unless the user asked otherwise (RUST_LOG=info shows them again).
    os.environ.setdefault("RUST_LOG", "warn")
    _quiet_known_torchft_noise()
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    backend = ft.process_group
    if backend == "auto":
        backend = "nccl" if parallel_dims.device.type == "cuda" else "gloo"
    pg_timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    pg = ProcessGroupNCCL(timeout=pg_timeout) if backend == "nccl" else ProcessGroupGloo(pg_timeout)
    # Healing goes over the replicate process group itself (no extra HTTP server listening on
    # every interface and serving the whole model unauthenticated).
    transport = PGTransport(
        pg, timeout=timedelta(seconds=ft.timeout_s), device=parallel_dims.device
    )
    address = lighthouse_address(job_config)
    try:
        with _manager_server_bound_to(bind_ip(ft.hostname)):
            manager = Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=ft.min_replica_size,
                use_async_quorum=use_async_quorum,
                timeout=timedelta(seconds=ft.timeout_s),
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=timedelta(seconds=ft.connect_timeout_s),
                rank=parallel_dims.rank,
                world_size=parallel_dims.world_size,
                lighthouse_addr=address,
                replica_id=f"replica_{ft.replica_id}",
                hostname=ft.hostname,
                checkpoint_transport=transport,
                init_sync=init_sync,
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
    ft_manager = FTManager(manager, job_config, parallel_dims.dp_mesh)
    for name, state in states.items():
        if name not in NOT_HEALED:
            ft_manager.register_state(name, state)
    logger.info(
        f"[ft] replica group {ft.replica_id} of {ft.group_size}, {backend}, lighthouse "
        f"{address}, min_replica_size {ft.min_replica_size}, listening on {ft.hostname}"
    )
    return ft_manager
