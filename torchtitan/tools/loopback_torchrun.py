"""``torchrun`` whose own TCP stores listen on loopback only, for jobs on one machine.

    python -m torchtitan.tools.loopback_torchrun --standalone --nproc_per_node=2 -m MODULE ...

takes exactly ``torchrun``'s arguments. The difference: a store that torchrun's agent hosts for
a rendezvous endpoint that resolves to a loopback address (``--standalone`` uses
``localhost:0``) is bound to that address. Plain torchrun binds its rendezvous store and the
store it shares with the workers to every interface, whatever the endpoint says (torch's
``TCPStore`` has no bind address; it only accepts an already bound socket, which is what this
wrapper hands it). Stores for other endpoints (multi-node rendezvous) are left as they are:
they must be reachable from the other nodes.

How a group ends when a rank stops: a rank that stopped on an error it printed itself (a
positive exit status and no torchrun error file, e.g. the trainer's one ``ERROR`` line, exit 1)
ends the group with one line naming that rank, and its exit status; torchrun's traceback and
failure report would only repeat it. A crash (a rank that wrote torchrun's error file, as
``torchtitan.train`` does for an exception it does not expect, or one killed by a signal other
than torchrun's own stop of the rest) keeps torchrun's failure report, its root cause's
traceback included.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from torch.distributed import TCPStore

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )


def _loopback_ip(host: str) -> str | None:
    try:
        # str(): typeshed's sockaddr also covers families whose address is an int.
        ip = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError):
        return None
    return ip if ipaddress.ip_address(ip).is_loopback else None


class LoopbackTCPStore(TCPStore):
    """``TCPStore`` that, as a server for a loopback host, listens on that address only."""

    def __init__(
        self,
        host_name: str,
        port: int = 0,
        world_size: int | None = None,
        is_master: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        ip = _loopback_ip(host_name) if is_master and "master_listen_fd" not in kwargs else None
        if ip is not None:
            sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port or 0))
            sock.listen(1024)
            port = sock.getsockname()[1]
            kwargs["master_listen_fd"] = sock.detach()
        super().__init__(host_name, port, world_size, is_master, *args, **kwargs)


def install() -> None:
    """Make torchrun's agent build its stores as ``LoopbackTCPStore`` (in this process)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    dist.TCPStore = LoopbackTCPStore  # type: ignore[misc]  # dynamic rendezvous' shared store
    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore  # type: ignore[misc]  # c10d rendezvous


def _reported(failure: ProcessFailure) -> bool:
    """The rank stopped on an error it printed: it exited with a status of its own (no
    signal) and left no error file, which a crash under ``@record`` writes."""
    return failure.exitcode > 0 and not os.path.isfile(failure.error_file)


def _reported_stop(error: ChildFailedError) -> tuple[int, ProcessFailure] | None:
    """The first rank that stopped on an error it printed, if that is why the group failed:
    every other failed rank did the same or was stopped by torchrun (SIGTERM, then SIGKILL).
    None for a crash, whose report torchrun should show."""
    failures = error.failures.items()
    reported = [(rank, f) for rank, f in failures if _reported(f)]
    if not reported:
        return None
    first = min(reported, key=lambda item: item[1].timestamp)
    stopped_by_torchrun = (-signal.SIGTERM, -signal.SIGKILL)

    def stopped_after_it(f: ProcessFailure) -> bool:  # not, say, an earlier OOM kill
        return f.exitcode in stopped_by_torchrun and f.timestamp >= first[1].timestamp

    if not all(_reported(f) or stopped_after_it(f) for _, f in failures):
        return None
    return first


class _DropFailureLines(logging.Filter):
    """Drops the agent's lines as a rank fails ("failed (exitcode ...)", "Sending process ...
    closing signal"): the failure report or the launcher's one line says the same."""

    MESSAGES = (
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        "Sending process %s closing signal %s",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.MESSAGES


def main() -> None:
    install()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _DropFailureLines()
    )
    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as e:
        stop = _reported_stop(e)
        if stop is None:
            raise
        rank, failure = stop
        print(
            f"rank {rank} stopped with exit status {failure.exitcode} on the error it printed",
            file=sys.stderr,
        )
        sys.exit(failure.exitcode)


if __name__ == "__main__":
    main()
