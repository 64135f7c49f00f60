"""Where fault tolerance connects and listens: the lighthouse's address, and this group's own
listeners kept on ``fault_tolerance.hostname`` (default 127.0.0.1) instead of every interface.

The listeners that remain and how each is confined are tabled in ``docs/fault_tolerance.md``
("Exposure: what listens where").
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from typing import Any

from torchtitan.components.ft.errors import FaultToleranceError
from torchtitan.config.job_config import JobConfig


def lighthouse_address(job_config: JobConfig) -> str:
    """``fault_tolerance.lighthouse``, else env ``TORCHFT_LIGHTHOUSE``; an error naming both
    when neither is set."""
    address = job_config.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise FaultToleranceError(
            "fault_tolerance.enable is set but no lighthouse address is known: set "
            "fault_tolerance.lighthouse=http://HOST:PORT or env TORCHFT_LIGHTHOUSE "
            "(start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:PORT`)"
        )
    return address


def lighthouse_reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at the lighthouse's address."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def bind_ip(hostname: str) -> str:
    """The IP address that ``hostname`` (``fault_tolerance.hostname``) resolves to: what this
    group's listening sockets bind to."""
    try:
        return str(ipaddress.ip_address(hostname.strip("[]")))
    except ValueError:
        pass
    try:
        # str(): typeshed's sockaddr also covers families whose address is an int.
        return str(socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as e:
        raise FaultToleranceError(
            f"fault_tolerance.hostname: {hostname!r} does not resolve ({e}); use this host's "
            "address on the network the replica groups share, or 127.0.0.1 for one machine"
        ) from e


def host_port(ip: str, port: int | str) -> str:
    """``ip:port``, with an IPv6 address in brackets."""
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


def group_store(hostname: str, parallel_dims: Any) -> tuple[str, int]:
    """A TCP store of the replica group's own besides torchrun's (``MASTER_ADDR``): where a
    second torchft Manager of each rank keeps its keys. Rank 0 listens on ``hostname``'s
    address; the others learn the port through the default process group's store (collective
    over the group's ranks: all call it, in the same order)."""
    ip = bind_ip(hostname)
    if parallel_dims.world_size == 1:
        store = listen_store(ip)
        _KEPT_STORES.append(store)
        return ip, store.port
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_store()
    key = f"torchtitan/group_store/{len(_KEPT_STORES)}"
    if parallel_dims.rank == 0:
        store = listen_store(ip)
        _KEPT_STORES.append(store)
        default.set(key, f"{ip} {store.port}")
    else:
        _KEPT_STORES.append(None)
    host, port = default.get(key).decode().split()
    return host, int(port)


#: The stores :func:`group_store` started (they live as long as the process).
_KEPT_STORES: list[Any] = []


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
