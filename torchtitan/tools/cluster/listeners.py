"""Which of a job's processes listen on which TCP address, read from ``/proc``.

Each process's sockets are its ``/proc/<pid>/fd`` links (``socket:[inode]``); the listening ones
and their addresses are in ``/proc/<pid>/net/tcp{,6}``, the tables of the process's own network
namespace (a process inside another namespace is seen there too).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

_TCP_LISTEN = "0A"


def _address(hex_addr: str, family: int) -> str:
    """The address of a ``/proc/net/tcp{,6}`` entry: 32-bit words in host (little-endian)
    byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def _listening_by_inode(pid: int) -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of the listening sockets in ``pid``'s namespace."""
    listening = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != _TCP_LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            listening[int(fields[9])] = (_address(hex_addr, family), int(hex_port, 16))
    return listening


def listening_sockets(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket that one of ``pids`` holds;
    processes that have exited or are not readable are skipped."""
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        listening = _listening_by_inode(pid)
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:[") : -1])
                if inode in listening:
                    found.append((pid, *listening[inode]))
    return found
