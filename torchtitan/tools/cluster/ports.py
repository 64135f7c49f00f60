"""Ports on this machine for a local job: picked by the kernel, never torchft's defaults."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the kernel's pick). Another process may
    take it before it is used; for a job on one machine that race is rare enough."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
