"""``torchrun`` whose own TCP stores listen on loopback only, for jobs on one machine.

    python -m torchtitan.tools.loopback_torchrun --standalone --nproc_per_node=2 -m MODULE ...

takes exactly ``torchrun``'s arguments. The difference: a store that torchrun's agent hosts for
a rendezvous endpoint that resolves to a loopback address (``--standalone`` uses
``localhost:0``) is bound to that address. Plain torchrun binds its rendezvous store and the
store it shares with the workers to every interface, whatever the endpoint says (torch's
``TCPStore`` has no bind address; it only accepts an already bound socket, which is what this
wrapper hands it). Stores for other endpoints (multi-node rendezvous) are left as they are:
they must be reachable from the other nodes.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from typing import Any

from torch.distributed import TCPStore


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


def main() -> None:
    install()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(sys.argv[1:])


if __name__ == "__main__":
    main()
