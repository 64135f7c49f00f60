"""The checkpoint of a semi-sync method's state (``semi_sync`` in the state registry)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from torchtitan.distributed.tensors import local_tensor
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage
from torchtitan.experiments.fault_tolerance.transport.sync_transport import SyncTransport


class SemiSyncState:
    """Checkpoint view of the method: the inner-step position in the sync period, each
    fragment's global parameters and outer momentum, the method's extra state (async DiLoCo: its
    sync in flight) and with ``error_feedback`` what each rank's compression still owes.

    With the Manager's step (``ft_manager``) and the core state (model, inner optimizer, LR
    schedule, data position, step), a whole-job restart resumes exactly where the job was.
    ``loaded``: whether a checkpoint supplied it (if not, the trainer makes the loaded model the
    global parameters). Heals do not use it: torchft sends the methods' own registered state,
    and the inner-step position travels with ``semi_sync_position``.
    """

    def __init__(self, loop: OuterLoop, transport: SyncTransport, lineage: Lineage) -> None:
        self.loop = loop
        self.transport = transport
        self.lineage = lineage
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        loop = self.loop
        extra = loop.extra_state()  # first: it may take in a sync's result
        # A sync's transfers stage residuals on the background thread: let them finish first.
        self.transport.wait()
        in_flight = [i for i in range(len(loop.fragments)) if loop.in_flight(i)]
        state: dict[str, Any] = {
            "local_step": loop.local_step(),
            "in_flight_fragment": in_flight[0] if in_flight else -1,
            "lineage": self.lineage.state_dict(),
        }
        if extra:
            state["extra"] = extra
        residuals = self.transport.residuals
        if residuals is not None:
            # Each rank's residuals under its own key, plus those staged by an arrived, undecided
            # sync (async DiLoCo decides it at the next sync point, after a restart too).
            mine: dict[str, Any] = {}
            for i in range(len(loop.fragments)):
                numel = _local_numel(loop, i)
                staged = residuals.has_staged(i) and not loop.in_flight(i)
                mine[f"fragment_{i}"] = residuals.flat(i, numel)
                mine[f"staged_{i}"] = residuals.flat(i, numel, staged=True)
                mine[f"has_staged_{i}"] = staged
            state["error_feedback"] = {f"rank_{_group_rank()}": mine}
        for i in range(len(loop.fragments)):
            fragment = loop.fragment_state(i)
            if fragment:
                state[f"fragment_{i}"] = fragment
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loop = self.loop
        step = int(state["local_step"])
        if not loop.applies_next and step >= loop.period:  # a sync point would have reset it
            raise ValueError(
                f"the checkpoint is at inner step {step} of its sync period, past this job's "
                f"period of {loop.period} inner steps: resume with the "
                "fault_tolerance.sync_steps and num_fragments it was written with"
            )
        loop.set_local_step(step)
        self.lineage.load_state_dict(state["lineage"])
        for i in range(len(loop.fragments)):
            if f"fragment_{i}" in state:
                loop.load_fragment_state(i, state[f"fragment_{i}"])
        if "extra" in state:  # after the outer state above, which it may add to
            loop.load_extra_state(state["extra"])
        residuals = self.transport.residuals
        if residuals is not None and "error_feedback" in state:
            mine = state["error_feedback"][f"rank_{_group_rank()}"]
            for i in range(len(loop.fragments)):
                residuals.load(i, mine[f"fragment_{i}"])
                if mine[f"has_staged_{i}"]:
                    residuals.load(i, mine[f"staged_{i}"], staged=True)
        in_flight = int(state.get("in_flight_fragment", -1))
        if in_flight >= 0:
            # Saved mid all-reduce (fragment_sync_delay > 0): its result is lost. As torchft
            # after a failed sync: restore the fragment's global copy, restart the period.
            loop.restore_global_copies(in_flight)
            loop.set_local_step(0)
            events.IN_FLIGHT_SYNC_DROPPED.emit(fragment=in_flight)
        self.loaded = True


class SiteHealState:
    """What a group healing from a live group of its own site takes of the method (besides the
    core state, which the site's Manager sends too): the position in the period, the lineage,
    each fragment's global copy and outer momentum, the method's extra state, and which sync
    is in flight (the healed group takes the site leader's result of it at the sync point).

    With error feedback it carries what this rank's compression owes, per fragment (every
    group of a site owes what its leader owes: the leader shares it after each sync). Unlike
    :class:`SemiSyncState` it never waits for a sync in flight: the site's step would wait for
    the slow link."""

    def __init__(self, loop: OuterLoop, lineage: Lineage, transport: SyncTransport) -> None:
        self.loop = loop
        self.lineage = lineage
        self.transport = transport

    def state_dict(self) -> dict[str, Any]:
        loop = self.loop
        in_flight = [i for i in range(len(loop.fragments)) if loop.in_flight(i)]
        state: dict[str, Any] = {
            "local_step": loop.local_step(),
            "in_flight_fragment": in_flight[0] if in_flight else -1,
            "lineage": self.lineage.state_dict(),
            "extra": loop.extra_state(wait=False),
        }
        for i in range(len(loop.fragments)):
            state[f"fragment_{i}"] = loop.fragment_state(i)
        residuals = self.transport.residuals
        if residuals is not None:
            for i in range(len(loop.fragments)):
                state[f"owed_{i}"] = residuals.flat(i, _local_numel(loop, i))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loop = self.loop
        loop.set_local_step(int(state["local_step"]))
        self.lineage.load_state_dict(state["lineage"])
        for i in range(len(loop.fragments)):
            if state.get(f"fragment_{i}"):
                loop.load_fragment_state(i, state[f"fragment_{i}"])
        if state.get("extra"):
            loop.load_extra_state(state["extra"])
        residuals = self.transport.residuals
        if residuals is not None:
            residuals.reset()
            for i in range(len(loop.fragments)):
                if f"owed_{i}" in state:
                    residuals.load(i, state[f"owed_{i}"])
        in_flight = int(state["in_flight_fragment"])
        arrived = [i for i in range(len(loop.fragments)) if loop.has_arrived(i)]
        if in_flight >= 0 or arrived:
            loop.await_share(in_flight if in_flight >= 0 else arrived[0])


def _group_rank() -> int:
    """This process's rank in its replica group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local_numel(loop: OuterLoop, index: int) -> int:
    """Values of fragment ``index`` on this rank (its shards): what its all-reduce sends."""
    return sum(local_tensor(p).numel() for p in loop.fragment_parameters(index).values())
