"""Failure detection for a sync in flight: the lighthouse's heartbeats, not a transfer timeout.

``sync_collective_timeout_s`` is sized for transfers that may take minutes on a slow link, so it
cannot tell a dead group from a slow one. The lighthouse can: it drops a group whose Manager's
heartbeat (every 100 ms, from its own thread) is older than ``--heartbeat_timeout_ms``. While a
rank waits for a transfer, :class:`PeerWatch` asks whether it dropped a group of the sync's
quorum; the transport then ends the sync at once (not committed, retried at the next quorum
without that group).

A process stuck in a collective (a hung GPU) still heartbeats, so only the collective timeout
ends it; while the lighthouse is unreachable, nothing is concluded.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchtitan.components.ft import torchft_adapter as tft


def heartbeat_key(heartbeat_id: str) -> int:
    """A signed 64-bit key of a group's heartbeat id, for the quorum's int64 records."""
    digest = hashlib.blake2b(heartbeat_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass(frozen=True)
class Gone:
    """A group of the sync's quorum that the lighthouse dropped."""

    #: Its id at the lighthouse (``replica_<R>:<uuid>``).
    heartbeat_id: str

    @property
    def name(self) -> str:
        """``replica group R`` (the id without its start's uuid)."""
        replica = self.heartbeat_id.split(":", 1)[0]
        return f"replica group {replica.removeprefix('replica_')}"


class PeerWatch:
    """Asks the lighthouse at ``lighthouse`` whether it dropped a group of a quorum.

    ``every_s``: how often a waiting rank asks (one HTTP request of a few kB). ``heartbeats``:
    reads the lighthouse's view (a test gives its own).
    """

    def __init__(
        self,
        lighthouse: str,
        every_s: float = 0.5,
        heartbeats: Callable[[str], dict[str, bool]] = tft.lighthouse_heartbeats,
    ) -> None:
        self.lighthouse = lighthouse
        self.every_s = every_s
        self._heartbeats = heartbeats
        self._last_asked = -float("inf")

    def gone(self, participants: Sequence[int], own: int) -> Gone | None:
        """A group among ``participants`` (heartbeat keys; ``own`` left out) the lighthouse no
        longer counts alive, or None: all alive, or nothing known (unreachable, or restarted).
        Asks at most once per ``every_s``."""
        now = time.monotonic()
        if now - self._last_asked < self.every_s:
            return None
        self._last_asked = now
        try:
            seen = self._heartbeats(self.lighthouse)
        except OSError:
            return None
        wanted = set(participants) - {own}
        for heartbeat_id, alive in seen.items():
            if not alive and heartbeat_key(heartbeat_id) in wanted:
                return Gone(heartbeat_id)
        return None
