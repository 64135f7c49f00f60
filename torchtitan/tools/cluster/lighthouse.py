"""The torchft lighthouse of a local job: its command line and when it is ready."""

from __future__ import annotations

import re
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from torchtitan.tools.cluster.listeners import listening_sockets
from torchtitan.tools.cluster.ports import LOOPBACK
from torchtitan.tools.cluster.process import Process
from torchtitan.tools.cluster.process_tree import process_tree

_RUN_LIGHTHOUSE = Path(__file__).with_name("run_lighthouse.py")


def lighthouse_status(address: str, timeout_s: float) -> str:
    """The lighthouse's HTML status page (``http://host:port``); raises ``OSError`` when it
    cannot be reached within ``timeout_s``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = address if "://" in address else f"http://{address}"
    with opener.open(urllib.parse.urljoin(url, "/status"), timeout=timeout_s) as response:
        return str(response.read().decode())


@dataclass
class LighthouseSettings:
    """``torchft_lighthouse``'s flags. Its other defaults are left alone, except the address:
    it binds ``host`` (loopback unless a benchmark puts it in a network namespace) and a port
    chosen by the job, never torchft's default 29510, so that two jobs on one machine cannot
    join each other's quorum."""

    min_replicas: int = 1
    """Fewest groups for a quorum."""

    heartbeat_timeout_ms: int = 2000
    """A group silent this long is dropped from the quorum."""

    join_timeout_ms: int = 10000
    """How long a quorum waits for heartbeating groups that have not asked for it yet."""

    quorum_tick_ms: int = 100
    """How often the lighthouse checks whether a quorum can form."""

    host: str = LOOPBACK

    start_timeout_s: float = 20.0
    """How long a start may take until the lighthouse listens."""

    def command(self, port: int) -> list[str]:
        # torchft's `torchft_lighthouse` of this interpreter (lighthouse and groups must run the
        # same torchft version), minus the torch import of its package: listening within a
        # fraction of a second instead of seconds saves that much at every start of a job.
        return [
            sys.executable,
            str(_RUN_LIGHTHOUSE),
            "--min_replicas", str(self.min_replicas),
            "--quorum_tick_ms", str(self.quorum_tick_ms),
            "--join_timeout_ms", str(self.join_timeout_ms),
            "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms),
            "--bind", f"{self.host}:{port}",
        ]  # fmt: skip

    def address(self, port: int) -> str:
        """What groups are given as ``TORCHFT_LIGHTHOUSE``."""
        return f"http://{self.host}:{port}"


def wait_until_listening(lighthouse: Process, settings: LighthouseSettings, port: int) -> None:
    """Return once ``lighthouse`` (or a process it started) listens on ``port``; raise
    ``RuntimeError`` with its log if it exits first or does not listen within
    ``settings.start_timeout_s``.

    Its own sockets are looked at, not its log or a connect: its "listening on" line is not
    logged under some ``RUST_LOG`` settings, a connect may reach another process that holds
    the port, and neither works from here for a lighthouse in another network namespace."""
    deadline = time.monotonic() + settings.start_timeout_s
    while time.monotonic() < deadline and lighthouse.alive():
        if any(p == port for _, _, p in listening_sockets(process_tree(lighthouse.pid))):
            return
        time.sleep(0.1)
    raise RuntimeError(
        f"torchft_lighthouse ({' '.join(settings.command(port))}) did not listen within "
        f"{settings.start_timeout_s:g}s (exit code {lighthouse.poll()}):\n{lighthouse.tail()}"
    )


# The lighthouse's HTML status page names the groups waiting for a quorum like "[1/2
# participants healthy]"; torchft 0.2.0 has no other way to ask for it (its version is pinned
# in components/ft/torchft_adapter.py).
_WAITING = re.compile(r"\[(\d+)/\d+ participants healthy\]")


_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")


def groups_waiting_at(address: str, timeout_s: float = 5.0) -> int:
    """How many replica groups wait for a quorum at the lighthouse at ``address`` now
    (``http://host:port``); raises ``OSError`` when the lighthouse cannot be reached."""
    match = _WAITING.search(lighthouse_status(address, timeout_s))
    return int(match.group(1)) if match else 0


def groups_alive_at(address: str, timeout_s: float = 5.0) -> int:
    """How many replica groups the lighthouse at ``address`` counts alive now: those whose
    last heartbeat is within its heartbeat timeout (a killed group stays counted until then).
    Raises ``OSError`` when the lighthouse cannot be reached."""
    match = _HEARTBEATING.search(lighthouse_status(address, timeout_s))
    return int(match.group(1)) if match else 0
