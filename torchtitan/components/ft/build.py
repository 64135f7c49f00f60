"""Building this rank's fault tolerance from ``[fault_tolerance]``: the ``FTManager`` now, and
the torchft Manager with its replicate process group when the group is ready to train."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.ft import given_up, torchft_adapter
from torchtitan.components.ft.errors import FaultToleranceError
from torchtitan.components.ft.healing import NOT_HEALED
from torchtitan.components.ft.manager import FTManager
from torchtitan.components.ft.network import bind_ip, group_store, lighthouse_address
from torchtitan.components.ft.timeouts import ReplicaTimeouts
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools import torchft_logs
from torchtitan.tools.events import EventKind
from torchtitan.tools.logging import logger

#: How often a group re-sends a quorum request that the lighthouse failed to answer (it died,
#: or is restarting): torchft spreads its retries over the quorum timeout, so their number is
#: the timeout divided by this.
QUORUM_RETRY_INTERVAL_S = 1.0

#: This rank's torchft Manager is built: from now on the group heartbeats to the lighthouse.
MANAGER_STARTED = EventKind(
    "ft.manager_started",
    "[ft] replica group {replica_id} of {group_size}, {backend}, lighthouse {lighthouse}, "
    "min_replica_size {min_replica_size}, listening on {hostname}",
)


#: What c10d reads when it builds an nccl backend, set for the replicate group's (and any built
#: after it; the groups inside the replica group are built before, in ``init_distributed``):
#: on an asynchronous error (a peer's closed connection, its own timeout) the watchdog only
#: aborts the communicator (2, "CleanUpOnly": the process lives on, the work records the error
#: and torchft fails the step or sync), where c10d's default (3) ends the process, so a peer's
#: death would kill the survivors; and it signals no flight-recorder dump, whose process-wide
#: flag would make the first group's heartbeat monitor end the process minutes later.
REPLICA_NCCL_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


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


def fresh_rendezvous_process_group(backend: str, timeouts: ReplicaTimeouts) -> Any:
    """torchft's reconfigurable process group for ``backend`` (``nccl`` or ``gloo``), rebuilt
    at every quorum on fresh rendezvous keys (:func:`fresh_rendezvous_address`), with every
    timeout c10d and torchft apply to it from ``timeouts`` (``timeouts.py``).

    On nccl: c10d's watchdog (the communicator's options) is ``timeouts.watchdog``, and on an
    error it only aborts the communicator (:data:`REPLICA_NCCL_ENVIRONMENT`);
    torchft's abort timer around issuing an operation and ``TORCH_NCCL_NONBLOCKING_TIMEOUT``
    (unless set) are ``timeouts.operation``; a wait that names no timeout (the quorum's
    exchange, queued on the communicator's stream behind what is in flight) gets
    ``timeouts.collective``; a new group's rendezvous ``timeouts.rendezvous``, and the store
    that later pairs a heal's point-to-point communicators ``timeouts.operation``. Whatever
    reads a result waits with ``delivery.wait_delivered``.

    On gloo, the group of the last quorum is released on a thread of its own, not aborted in
    the quorum: gloo's ``abort`` and its destructor both wait for every collective in flight,
    and one that waits for a peer already gone (a sync abandoned by ``peer_watch``) returns only
    at its own timeout, minutes for a sync's transfer (seen: the next quorum held up 295 s)."""
    nccl = backend == "nccl"
    if nccl:
        timeouts.apply_nccl_environment()  # before torchft's group reads it
        # Here, on the main thread before torchft's threads start (not around each build on
        # its quorum thread: setenv beside another thread's getenv can crash the process). A
        # second Manager (sites of groups) finds them set already and writes nothing.
        for name, value in REPLICA_NCCL_ENVIRONMENT.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
    base = torchft_adapter.reconfigurable_group_class(backend)

    class FreshRendezvous(base):  # type: ignore[valid-type,misc]  # a class chosen at run time
        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      *args: Any, **kwargs: Any) -> None:  # fmt: skip
            address = fresh_rendezvous_address(store_addr, world_size, timeouts.rendezvous)
            super().configure(address, replica_id, rank, world_size, *args, **kwargs)

        def abort(self, errored: bool = True) -> None:
            if nccl:  # ncclCommAbort: returns, and ends the kernels in flight
                super().abort(errored)
                return
            old: Any = self.__dict__.get("_pg")  # torchft's base group (untyped)
            self._pg = None
            if old is not None:
                threading.Thread(
                    target=_release_when_unreferenced,
                    args=([old],),
                    name=given_up.thread_name("gloo-group-release"),
                    daemon=True,
                ).start()

        if nccl:

            def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
                store.set_timeout(timeouts.rendezvous)  # a member that never joins the group
                self._errored = None
                options = torchft_adapter.nccl_options(
                    timeouts.watchdog, self.__dict__.get("_global_ranks"), self._quorum_group_name()
                )
                group = torchft_adapter.build_nccl_group(store, rank, world_size, options)
                # From now on the store only pairs the point-to-point communicators a heal
                # creates on its first send: the peer publishes its id when its send starts,
                # which may be a heal's whole wait later, not a rendezvous's.
                store.set_timeout(timeouts.operation)
                return group

            def _wrap_work(self, work: Any, opts: object) -> Any:
                if not self._use_abort:  # NCCL < 2.25: c10d's own timeouts, as torchft does
                    return work
                # An operation that names its own bound (a site's share: a follower waits in it
                # while its leader syncs) is aborted after that, not the group's.
                own = getattr(opts, "timeout", None)
                bound = own if own is not None and own > timedelta(0) else timeouts.collective
                return torchft_adapter.accelerator_timeout_work(self, work, bound)

            def _quorum_group_name(self) -> str | None:
                quorum, rank, size = (
                    self.__dict__.get(k) for k in ("_quorum_id", "_group_rank", "_group_world_size")
                )
                return f"torchft_quorum_{quorum}_rank_{rank % size}" if rank and size else None

    # The wrapper's own timeout: on nccl torchft's timer around issuing each operation; on
    # gloo the rendezvous, and the default of an operation that names none (gloo runs the
    # quorum's small exchange beside a sync's transfers, never queued behind them).
    return FreshRendezvous(timeout=timeouts.operation if nccl else timeouts.rendezvous)


def _release_when_unreferenced(holder: list[Any], poll_s: float = 0.05) -> None:
    """Drop the last reference to ``holder[0]`` here, on this thread: once nobody else refers
    to it (torchft's ``configure`` keeps it in a local until it returns), so that its
    destructor, which waits for its collectives in flight, blocks only this thread."""
    while sys.getrefcount(holder[0]) > 2:  # the list's and getrefcount's own
        time.sleep(poll_s)
    holder.clear()


class SendsAfterWrites:
    """A checkpoint transport whose sender, before it reads any of the state, makes its stream
    wait for the compute that writes it (``FTManager.wait_for_state_writes``): torchft sends a
    heal from its recovery stream, which never waits for the training stream, so a peer could
    otherwise get parameters or optimizer moments half-way through an optimizer step. (The
    state's ``state_dict`` functions only hand out references: no kernel reads it before.)"""

    def __init__(self, transport: Any, ft: FTManager) -> None:
        self.transport = transport
        self.ft = ft

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: Any
    ) -> None:
        self.ft.wait_for_state_writes()
        self.transport.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def __getattr__(self, name: str) -> Any:  # receiving, metadata: torchft's transport's own
        return getattr(self.transport, name)


def end_collectives_in_flight(pg: Any) -> None:
    """A peer of the collectives in flight on ``pg`` (the replicate group) is gone: on nccl,
    abort the communicator now (torchft's ``abort``), or its kernels would stay queued on the
    device and every device-wide synchronize (torchft's ``should_commit`` makes one) would wait
    for them. On gloo nothing is queued on a device: the blocked collective only holds its own
    thread, and the group is let go at the next quorum."""
    from torchft.process_group import ProcessGroupNCCL

    if isinstance(pg, ProcessGroupNCCL):
        pg.abort()


def build_ft_manager(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    states: dict[str, Stateful],
    *,
    use_async_quorum: bool = False,
    init_sync: bool = True,
    quorum_timeout_s: float | None = None,
    collective_timeout_s: float | None = None,
    own_store: bool = False,
) -> FTManager | None:
    """This rank's FTManager, from ``[fault_tolerance]``; None when it is off. The torchft
    Manager itself is built by ``FTManager.start()``. Fails at once (``TorchftVersionError``)
    when the installed torchft is not the one ``torchft_adapter`` was written for.

    The quorum is synchronous by default: ``start_step`` waits for it anyway (to skip a quorum
    that is too small), and healing then happens before the forward pass, on the main thread,
    so a joiner trains in its first step instead of sending zeros, and no state is read by
    torchft's quorum thread while the model runs (FSDP swaps parameters during forward); how
    healing state travels is :meth:`FTManager.start`'s. ``quorum_timeout_s``: the longest
    quorum wait the trainer will ask for (default ``fault_tolerance.quorum_timeout_s``), the
    Manager's default timeout for the quorums that torchft's own algorithms start.
    ``collective_timeout_s``: the longest one collective across groups may take (semi-sync's
    ``sync_collective_timeout_s``; default ``process_group_timeout_ms``): with ``timeout_s`` it
    sizes every timeout of the replicate process group (``timeouts.ReplicaTimeouts``).
    ``own_store``: each Manager :meth:`FTManager.start` builds keeps its keys in a new TCP
    store of its own (``network.group_store``; collective over the group's ranks), for a second
    Manager in the same process or one started again (torchft's keys have no prefix), and
    listens on a port the kernel picks (never ``TORCHFT_MANAGER_PORT``, the first Manager's).
    """
    ft = job_config.fault_tolerance
    if not ft.enable:
        return None
    # The Manager built below relies on torchft internals (torchft_adapter): check the version
    # here, before the model's state is registered with anything.
    torchft_adapter.check_version()
    # torchft's Rust side was quieted at import (tools/torchft_logs); its Python loggers
    # follow RUST_LOG in the project's format.
    torchft_logs.show_python_loggers(list(logger.handlers))
    torchft_adapter.quiet_known_noise()
    address = lighthouse_address(job_config)
    longest_quorum_s = max(ft.quorum_timeout_s, quorum_timeout_s or 0.0)

    def build_manager(checkpoint_transport: Callable[..., Any] | None) -> Any:
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        store_addr, store_port = (
            group_store(ft.hostname, parallel_dims) if own_store else (None, None)
        )
        backend = ft.process_group
        if backend == "auto":
            backend = "nccl" if parallel_dims.device.type == "cuda" else "gloo"
        timeouts = ReplicaTimeouts.of(
            ft.process_group_timeout_ms, ft.timeout_s, collective_timeout_s
        )
        pg = fresh_rendezvous_process_group(backend, timeouts)
        # Healing goes over the replicate process group itself (no extra HTTP server listening
        # on every interface and serving the whole model unauthenticated).
        make_transport: Callable[..., Any] = checkpoint_transport or PGTransport
        transport = SendsAfterWrites(
            make_transport(
                pg, timeout=timedelta(seconds=ft.timeout_s), device=parallel_dims.device
            ),
            ft_manager,
        )
        try:
            with torchft_adapter.manager_server_bound_to(bind_ip(ft.hostname)):
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
                    store_addr=store_addr,
                    store_port=store_port,
                    port=0 if own_store else None,
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
        MANAGER_STARTED.emit(
            replica_id=ft.replica_id,
            group_size=ft.group_size,
            backend=backend,
            lighthouse=address,
            min_replica_size=ft.min_replica_size,
            hostname=ft.hostname,
        )
        return manager

    ft_manager = FTManager(job_config, build_manager, parallel_dims.dp_mesh)
    for name, state in states.items():
        if name not in NOT_HEALED:
            ft_manager.register_state(name, state)
    return ft_manager
