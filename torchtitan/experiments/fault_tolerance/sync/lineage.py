"""Where a replica group's model comes from, so that the job's final model is unambiguous.

Groups that sync together hold the same global parameters. A group that goes on alone (peers
died, hung past the collective timeout, or finished) commits syncs no other group shares: its
model becomes a lineage of its own. :class:`Lineage` counts that for one group (reported in
``semi_sync.final_model``); the launcher names the job's model (:func:`job_model`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Lineage:
    """The last sync this group committed together with other groups, and the syncs it
    committed alone since (checkpointed with the semi-sync state)."""

    #: -1: none yet.
    last_shared_sync: int = -1
    solo_syncs: int = 0
    #: ``time.time()`` of the first of those solo syncs (0: none).
    solo_since: float = 0.0

    def committed(self, sync: int, groups: int) -> None:
        """Sync ``sync`` was committed in a quorum of ``groups`` groups."""
        if groups > 1:
            self.last_shared_sync, self.solo_syncs, self.solo_since = sync, 0, 0.0
            return
        if self.solo_syncs == 0:
            self.solo_since = time.time()
        self.solo_syncs += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_shared_sync": self.last_shared_sync,
            "solo_syncs": self.solo_syncs,
            "solo_since": self.solo_since,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_shared_sync = int(state["last_shared_sync"])
        self.solo_syncs = int(state["solo_syncs"])
        self.solo_since = float(state["solo_since"])


def job_model(finals: dict[int, dict[str, Any]]) -> int | None:
    """The replica group whose final model is the job's, from each finished group's
    ``semi_sync.final_model`` fields (None: none finished). Groups that agree are all the job's
    (the lowest id is named). Else: one that never trained alone since its last shared sync;
    else the latest last shared sync, and among those the first to go on alone (it carried the
    job while the others were away)."""
    if not finals:
        return None

    def order(item: tuple[int, dict[str, Any]]) -> tuple[int, int, float, int]:
        replica, fields = item
        shared = fields["last_shared_sync"]
        return (
            0 if fields["solo_syncs"] == 0 else 1,
            -(shared if shared is not None else -1),
            fields["solo_since"] or 0.0,
            replica,
        )

    return min(finals.items(), key=order)[0]
