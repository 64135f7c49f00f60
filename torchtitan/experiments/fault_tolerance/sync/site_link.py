"""A site of replica groups (``fault_tolerance.groups_per_site`` > 1): :class:`SiteLink`, what
ties one group to the other groups of its site.

The groups of a site average gradients every step through the site's own lighthouse (the
site's FTManager, synchronous fault tolerance: a dead group is dropped, a restarted one heals
from a live one of its site), so they hold the same parameters and the same outer state. One
of them, the *leader*, carries the site's syncs over the slow link: it alone runs the job's
torchft Manager (``replica_<site>`` at the job's lighthouse) and sends the site's one payload.
After each sync it gives the others what the sync decided and delivered over the site's
network (:meth:`SiteLink.send`, :meth:`SiteLink.receive`), so every group of the site applies
the same result.

The leader is sticky: it stays while it is a member of the site's last step quorum; otherwise
the lowest-numbered member leads from the next sync point on (:meth:`SiteLink.elect`). Every
member of a quorum sees the same members and holds the same leader (a group that heals in it
takes the leader from its peer, and electing twice changes nothing), so all agree without a
collective. A leader is a process, not a group number: a group restarted leads only if elected.

A group that misses a share (the leader died, its header or result did not arrive) or whose
leader healed from another site in the sync's quorum (:meth:`SiteLink.share_quorum`) does not
hold the site's state: every group that does moves
its site Manager's step one up (:meth:`SiteLink.settle`), so at the next step the others heal
from one of them. Failure semantics: docs/fault_tolerance.md ("Sites").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from torchtitan.components.ft import FTManager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.delivery import all_reduce_across_groups
from torchtitan.experiments.fault_tolerance import events

#: What a leader's header says, in order (float64 each; ``squares`` NaN: none).
HEADER = ("committed", "number", "groups", "bytes_sent", "squares", "tensors", "fragment")


@dataclass(frozen=True)
class SiteHeader:
    """What the site's leader tells its other groups about a sync it decided."""

    committed: bool
    #: The sync's number (the job Manager's step a commit makes).
    number: int
    #: Sites in the sync's quorum.
    groups: int
    #: Bytes the leader's rank sent over the slow link.
    bytes_sent: int
    squares: float | None
    #: Tensors the results travel in (sizes first, then each).
    tensors: int = 0
    #: The fragment the sync was for.
    fragment: int = 0

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        squares = math.nan if self.squares is None else self.squares
        values = [float(self.committed), self.number, self.groups, self.bytes_sent, squares]
        values += [self.tensors, self.fragment]
        return torch.tensor(values, dtype=torch.float64, device=device)

    @classmethod
    def of(cls, found: torch.Tensor) -> SiteHeader:
        committed, number, groups, sent, squares, tensors, fragment = found.tolist()
        return cls(
            committed == 1.0,
            int(number),
            int(groups),
            int(sent),
            None if math.isnan(squares) else squares,
            int(tensors),
            int(fragment),
        )


class SiteLink:
    """One replica group's place in its site: who leads, and the sync results the leader
    shares. ``site_ft``: the site's FTManager (its torchft Manager started, with
    ``tft.record_quorum_members``); ``job_ft``: this group's job Manager, started only while it
    leads (its step is followed otherwise); ``index``: this group's number in its site;
    ``timeout_s``: the longest one share may wait for the leader (its sync's quorum, or its
    transfers)."""

    def __init__(
        self,
        site_ft: FTManager,
        job_ft: FTManager,
        index: int,
        groups: int,
        site: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.site_ft = site_ft
        self.job_ft = job_ft
        self.index = index
        self.groups = groups
        self.site = site
        self.device = device
        self.timeout_s = timeout_s
        #: The process that carries the site's syncs, by the id it heartbeats to the site's
        #: lighthouse under (``replica_<i>:<uuid>``: a restarted group is not its dead
        #: predecessor); "" before the first election.
        self.leader = ""
        #: Sites in the last sync's quorum, as the leader said (a follower's answer).
        self.job_groups = 0

    def leads(self) -> bool:
        return bool(self.leader) and self.leader == tft.heartbeat_id(self.site_ft.manager)

    def elect(self) -> bool:
        """At a sync point: the leader stays if it is a member of the site's last step quorum,
        else its lowest-numbered member leads. Returns whether the leader changed."""
        members = tft.quorum_members(self.site_ft.manager)
        if self.leader in members or not members:
            return False
        previous, self.leader = self.leader, min(members, key=tft.replica_number)
        if previous:  # not the site's first election
            events.SITE_LEADER.emit(
                site=self.site,
                leader=tft.replica_number(self.leader),
                previous=tft.replica_number(previous),
                groups=len(members),
            )
        return True

    def site_groups(self) -> int:
        """Groups in the site's last step quorum (1 before the first)."""
        manager = self.site_ft.manager
        return max(1, int(manager.num_participants())) if self.site_ft.started else 1

    # ---- what the leader shares -------------------------------------------------------------

    def share_quorum(self, healed: bool) -> None:
        """The leader, after its sync's quorum: whether it healed from another site in it."""
        self._share(torch.tensor([float(healed)], dtype=torch.float64, device=self.device))

    def hear_quorum(self) -> bool | None:
        """A follower: whether its leader healed from another site in its sync's quorum (then
        this group heals from its site at the next step); None when that did not arrive."""
        found = torch.full((1,), -0.0, dtype=torch.float64, device=self.device)
        return bool(found.item() == 1.0) if self._share(found) else None

    def send(self, header: SiteHeader, tensors: list[torch.Tensor]) -> None:
        """The leader: ``header``, then (committed) the sizes of ``tensors`` and the sync's
        results in them, to the site's other groups. A failure is theirs to handle (they heal
        from this group)."""
        self.job_groups = header.groups
        if not self._share(header.as_tensor(self.device)) or not header.committed:
            return
        sizes = torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float64)
        if tensors and not self._share(sizes.to(self.device)):
            return
        for tensor in tensors:
            if not self._share(tensor):
                return

    def receive(self, tensors: list[torch.Tensor]) -> tuple[SiteHeader | None, bool]:
        """A follower: the leader's header (None: it did not arrive: the leader died, or a
        group of the site did) and whether this group holds the sync's result now ((committed)
        its results went into ``tensors``). A group that does not hold it heals from its site
        (:meth:`settle`)."""
        found = torch.full((len(HEADER),), -0.0, dtype=torch.float64, device=self.device)
        if not self._share(found):
            return None, False
        header = SiteHeader.of(found.cpu())
        self.job_groups = header.groups
        if not header.committed:
            return header, True
        sizes = self._receive_sizes(header.tensors)
        if sizes is None:
            return header, False
        # This group's sync is not the leader's (it healed while one was in flight): take the
        # results into buffers of the leader's sizes, pairing the collectives, and heal.
        mine = [t.numel() for t in tensors]
        into = tensors if sizes == mine else [torch.empty(n, device=self.device) for n in sizes]
        for tensor in into:
            tensor.fill_(-0.0)  # x + -0.0 is x, bit for bit (also -0.0)
            if not self._share(tensor):
                return header, False
        return header, into is tensors

    def _receive_sizes(self, count: int) -> list[int] | None:
        """The sizes of the leader's ``count`` result tensors (None: they did not arrive)."""
        found = torch.full((count,), -0.0, dtype=torch.float64, device=self.device)
        if count and not self._share(found):
            return None
        return [int(v) for v in found.tolist()]

    def _share(self, tensor: torch.Tensor) -> bool:
        """SUM over the site's groups: the leader's values, the others' -0.0 (one all-reduce
        on the site's process group, bounded by ``timeout_s`` on its own: a follower waits in
        it while its leader syncs; False: it failed, recorded by the site's Manager)."""
        return all_reduce_across_groups(
            self.site_ft.manager,
            tensor,
            average=False,
            timeout=timedelta(seconds=self.timeout_s),
            per_operation=True,
        )

    def settle(self, holds: bool) -> None:
        """After a share, alike on every rank of the group: a group that holds the site's
        state moves its site Manager's step one up; one that does not stays behind and heals
        from a group of its site at the next step (steps only go up: no group that holds the
        state can end up behind one that does not)."""
        manager = self.site_ft.manager
        step = int(manager.current_step())
        if not holds:
            events.SITE_FELL_BEHIND.emit(site=self.site, group=self.index, site_step=step)
            return
        manager.load_state_dict(
            {"step": step + 1, "batches_committed": manager.batches_committed()}
        )

    # ---- what a group healing from its site takes -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        job = self.job_ft.state_dict()
        return {"leader": self.leader, "job_step": job["step"], "job_batches": job.get(
            "batches_committed", 0), "job_groups": self.job_groups}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.leader = str(state["leader"])
        self.job_groups = int(state.get("job_groups", 0))
        self.job_ft.load_state_dict(
            {"step": int(state["job_step"]), "batches_committed": int(state["job_batches"])}
        )
