"""The one place where torchtitan touches torchft's internals.

Everything torchtitan needs from torchft that is not public API is read, driven or patched
here, for torchft 0.2.0 (the version ``pyproject.toml`` pins; lighthouse and groups must run the
same one). torchft's ``Manager`` is otherwise used through its public constructor and verbs
(its ``LocalSGD`` and ``DiLoCo`` are what the tests hold ours to). What torchft 0.2.0 does not
offer:

* a bind address for the Manager's server (it listens on every interface):
  :func:`manager_server_bound_to`;
* a switch for messages it emits on every heal or quorum that tell a user nothing, and for
  the tracebacks it logs with errors it handles itself: :func:`quiet_known_noise`;
* the Manager's quorum id, the healing state it would send, its replica process group, and the
  id the lighthouse knows its group by;
* the lighthouse's view of the groups: who heartbeats, who it dropped, who waits for a quorum
  (read from its status page: 0.2.0 has no other way to ask).

:func:`check_version` fails with a clear message on another torchft version; the core calls it
before it builds anything of torchft (``build.build_ft_manager``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import re
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from torchtitan.components.ft.errors import FaultToleranceError
from torchtitan.components.ft.network import host_port
from torchtitan.tools.cluster.lighthouse import lighthouse_status

if TYPE_CHECKING:  # torchft ships no type information: these name what each accessor takes
    from torchft.manager import Manager

#: The torchft release these accessors were written against.
TORCHFT_VERSION = "0.2.0"


class TorchftVersionError(FaultToleranceError):
    """The installed torchft is not the one this adapter was written for."""


def check_version() -> None:
    """Raise :class:`TorchftVersionError` unless torchft ``TORCHFT_VERSION`` is installed."""
    try:
        found = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        raise TorchftVersionError("torchft is not installed: pip install torchft==0.2.0") from None
    if found != TORCHFT_VERSION:
        raise TorchftVersionError(
            f"torchft {found} is installed, but torchtitan uses internals of "
            f"torchft {TORCHFT_VERSION} (torchtitan/components/ft/torchft_adapter.py): "
            f"install torchft=={TORCHFT_VERSION}, or update the adapter"
        )


# ---- the Manager's construction ----------------------------------------------------------


@contextlib.contextmanager
def manager_server_bound_to(ip: str) -> Iterator[None]:
    """While a torchft ``Manager`` is built, make its ``ManagerServer`` listen on ``ip`` only.

    torchft 0.2.0 hard-codes ``bind=f"[::]:{port}"`` (every interface) in ``Manager.__init__``
    and offers no parameter; the server is looked up in ``torchft.manager``'s namespace, so it is
    replaced there for the duration of the construction, keeping the port torchft chose.
    """
    import torchft.manager as torchft_manager

    original = torchft_manager.ManagerServer

    def bound_server(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        return original(*args, bind=host_port(ip, port), **kwargs)

    torchft_manager.ManagerServer = bound_server
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original


class _HandledErrorsInOneLine(logging.Filter):
    """torchft's Manager logs the errors it handles itself (a process group that could not be
    configured, a failed all-reduce or recovery: ``got exception in ...``; a collective that
    timed out while it was waited on: ``got exception waiting for work ...``) with a full
    traceback, although the run goes on: the error is recorded, this step or sync is not
    committed and the next quorum starts over. Such a record becomes one WARNING line; a
    traceback on the console then always means a crash."""

    HANDLED = ("got exception in ", "got exception waiting for work")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and any(h in str(record.msg) for h in self.HANDLED):
            record.msg = f"{record.getMessage()} (handled: not committed, retried at next quorum)"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class _NoFlightRecorderNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def quiet_known_noise() -> None:
    """Drop messages torchft 0.2.0 prints on every heal or quorum that say nothing to a user
    (a non-writable-buffer warning and a pytree deprecation inside its checkpoint transport, a
    flight-recorder notice that only concerns NCCL), and shorten the errors its Manager handles
    itself to one line each. Calling it again adds nothing twice."""
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)
    manager_logger = logging.getLogger("torchft.manager")
    for kind in (_NoFlightRecorderNotice, _HandledErrorsInOneLine):
        if not any(isinstance(f, kind) for f in manager_logger.filters):
            manager_logger.addFilter(kind())


# ---- the Manager ---------------------------------------------------------------------------


def quorum_id(manager: Manager) -> int:
    """The id of the quorum the Manager is configured for (the lighthouse's; -1: none yet)."""
    return int(manager._quorum_id)


def user_state(manager: Manager, keys: list[str]) -> dict[str, Any]:
    """This group's own healing state of ``keys``, as the Manager would send it to a peer."""
    return {key: manager._user_state_dicts[key]() for key in keys}


def replica_process_group(manager: Manager) -> ProcessGroup:
    """The process group across replica groups the Manager's own all-reduces run on (torchft
    reconfigures it at every quorum that changes membership): for collectives the Manager does
    not offer, such as compressed all-reduces."""
    return manager._pg


# ---- the replicate process group -----------------------------------------------------------


def reconfigurable_group_class(backend: str) -> type:
    """torchft's reconfigurable process group class for ``nccl`` or ``gloo``."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo


def nccl_options(
    watchdog: timedelta, global_ranks: list[int] | None, group_name: str | None
) -> Any:
    """c10d's options for the nccl backend of a quorum's group, as torchft 0.2.0 builds them
    (non-blocking communicators, the quorum's ranks and name), plus the watchdog's timeout,
    which torchft leaves at c10d's default (10 min per operation, counted from its queueing)."""
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.config.blocking = False
    options._timeout = watchdog
    if global_ranks:
        options.global_ranks_in_group = global_ranks
    if group_name:
        options.group_name = group_name  # type: ignore[assignment]  # a str, as torchft sets it
    return options


def build_nccl_group(store: Any, rank: int, world_size: int, options: Any) -> Any:
    """A c10d process group with an nccl backend built with ``options`` and connected on the
    current device: what torchft 0.2.0's ``ProcessGroupNCCL._create_pg`` builds."""
    from torch.distributed import ProcessGroup
    from torch.distributed import ProcessGroupNCCL as NCCLBackend

    group = ProcessGroup(store, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.NCCL)
    backend = NCCLBackend(store, rank, world_size, options)
    backend._set_sequence_number_for_group()
    backend.eager_connect_single_device(torch.device(torch.accelerator.current_device_index()))
    group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, backend)
    return group


def accelerator_timeout_work(pg: Any, work: Any, timeout: timedelta) -> Any:
    """torchft's wrapper of an nccl work: its ``wait`` aborts ``pg`` after ``timeout`` (or the
    one it is given) instead of letting c10d's watchdog end the process."""
    from torchft.process_group import _WorkAcceleratorTimeout

    return _WorkAcceleratorTimeout(pg, work, timeout)


def backend_work(work: Any) -> Any:
    """The c10d work under torchft's nccl wrapper (``_WorkAcceleratorTimeout``, whose ``wait``
    arms torchft's abort timer and, given a timeout, synchronizes the whole device), or
    ``work`` itself."""
    from torchft.process_group import _WorkAcceleratorTimeout

    return work._work if isinstance(work, _WorkAcceleratorTimeout) else work


def work_timeout(work: Any) -> timedelta | None:
    """The timeout torchft's nccl wrapper gave ``work`` (the operation's, or its group's); None
    for any other work (gloo's carries its own)."""
    from torchft.process_group import _WorkAcceleratorTimeout

    return work._timeout if isinstance(work, _WorkAcceleratorTimeout) else None


def group_generation(pg: Any) -> object:
    """What ``pg`` (torchft's reconfigurable group) runs on now: its c10d group, replaced at
    every reconfiguration and dropped by an abort. A collective whose group's generation
    changed while it was waited for did not deliver, even where its work says nothing. Any
    other group is its own generation."""
    found: dict[str, Any] = getattr(pg, "__dict__", {})
    return found.get("_pg", pg)


def heartbeat_id(manager: Manager) -> str:
    """The id this group heartbeats to the lighthouse under: ``replica_<R>:<uuid>``, a new
    uuid at every start (so a restarted group is not its dead predecessor). Alike on every
    rank of the group (torchft shares it through the group's store)."""
    import torchft.manager as torchft_manager

    return bytes(manager._store.get(torchft_manager.REPLICA_ID_KEY)).decode()


class _QuorumRecorder:
    """Stands in for a Manager's client (torchft's Rust ``ManagerClient``): the same in every
    call, and keeps the replica ids of the last quorum it returned."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_ids: list[str] = []

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.replica_ids = list(quorum.replica_ids)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def record_quorum_members(manager: Manager) -> None:
    """From now on, :func:`quorum_members` knows the members of ``manager``'s last quorum."""
    manager._client = _QuorumRecorder(manager._client)


def quorum_members(manager: Manager) -> list[str]:
    """The heartbeat id (``replica_<R>:<uuid>``, :func:`heartbeat_id`) of each member of the
    Manager's last quorum, in the lighthouse's order, alike for every member
    (:func:`record_quorum_members` first)."""
    recorder = manager._client
    assert isinstance(recorder, _QuorumRecorder), "record_quorum_members was not called"
    return list(recorder.replica_ids)


def replica_number(heartbeat: str) -> int:
    """R of a heartbeat id ``replica_<R>:<uuid>``."""
    return int(re.findall(r"\d+", heartbeat.split(":")[0])[-1])


# ---- the lighthouse's status page ----------------------------------------------------------


# One heartbeat of the page's "Heartbeats" list: its CSS class says "old" once the heartbeat is
# older than the lighthouse's --heartbeat_timeout_ms (the group no longer counts as alive).
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+): seen ([0-9.]+)s ago')


def lighthouse_heartbeats(address: str, timeout_s: float = 1.0) -> dict[str, bool]:
    """Every group the lighthouse has heard from since it started, by :func:`heartbeat_id`:
    True while it counts the group alive, False once it dropped it (its last heartbeat is
    older than the lighthouse's heartbeat timeout). Raises ``OSError`` when the lighthouse
    cannot be reached."""
    page = lighthouse_status(address, timeout_s)
    return {m.group(2): m.group(1) is None for m in _HEARTBEAT.finditer(page)}
