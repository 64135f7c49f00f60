"""Failure detection for a sync in flight: the lighthouse's heartbeats, not a transfer timeout.

A sync's transfers may take minutes on a slow link, so ``sync_collective_timeout_s`` is sized
for that and cannot also tell a dead or hung group from a slow one. The lighthouse can: every
group's Manager heartbeats to it every 100 ms from a thread of its own, and the lighthouse drops
a group whose last heartbeat is older than its ``--heartbeat_timeout_ms`` (a killed process, a
stopped one, a node gone). :class:`PeerWatch` asks it, while a rank waits for a transfer, whether
it dropped a group of the sync's quorum; the transport then ends the sync at once
(``SyncTransport``: not committed, retried at the next quorum without that group).

A group stays alive to the lighthouse as long as its process runs, so a group stuck inside a
collective (a hung GPU) is still ended by the collective timeout; and while the lighthouse
cannot be reached (it restarts), nothing is concluded from it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchtitan.components.ft import torchft_adapter as tft


def heartbeat_key(heartbeat_id: str) -> int:
    """A signed 64-bit key of a group's :func:`~.torchft_adapter.heartbeat_id`, to exchange in
    the quorum (whose records are int64)."""
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

    ``every_s``: while a rank waits for a transfer, how often it asks (one HTTP request of a
    few kB each time, only while a wait lasts). ``heartbeats``: how the lighthouse's view is
    read (``torchft_adapter.lighthouse_heartbeats``; a test gives its own).
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
        """A group among ``participants`` (their :func:`heartbeat_key`, this group's ``own``
        left out) that the lighthouse no longer counts alive, or None: all alive, or nothing
        known (the lighthouse is unreachable, or has not heard of them since it restarted).
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
