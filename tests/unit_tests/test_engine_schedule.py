"""The engine's one schedule (``OuterLoop.at_step``) for a group that joins a running sync.

A restarted group heals inside the running groups' sync quorum and takes part in that sync
through ``join_sync``: it must apply the sync at the inner step the running groups do. With
LocalSGD and DiLoCo that is at once; with ``fragment_sync_delay`` it is ``delay`` steps later
(the running groups started the all-reduce ``delay`` steps before their sync point); with async
DiLoCo at the next sync point (the joiner sends weight 0). Two real gloo groups: group 0 runs
from the start, group 1 joins at group 0's first sync quorum.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit_tests.gloo_groups import LoopbackManager, OpenQuorums, run_groups, sync_manager
from tests.unit_tests.toy_task import BUCKET, PERIOD, build_method, inner_step, make_model

SYNCS = 3
#: By method: where group 0's first sync quorum is (the inner step group 1 joins at), whether
#: ``join_sync`` applies the sync at once, and the inner step of group 0's first committed sync.
CASES = {
    "localsgd": (PERIOD, True, PERIOD),
    "diloco": (PERIOD, True, PERIOD),
    "streaming_diloco_delayed": (PERIOD - 1, False, PERIOD),
    "async_eager": (PERIOD, False, 2 * PERIOD),
}


def run(rank: int, pg: Any, method: str) -> tuple[bool | None, list[Any]]:
    """Group ``rank``'s ``join_sync`` answer (None: group 0 did not join) and, per committed
    sync, the inner step it was applied at (the joiner counts from group 0's start) and the
    global parameters then."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = LoopbackManager(pg, rank, 2)
    sync = sync_manager(manager, bucket_numel=BUCKET)
    loop = build_method(method, sync, model, optimizer, outer_lr=0.7, outer_momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    step, joined, records = 0, None, []

    def global_parameters() -> list[torch.Tensor]:
        tensors = (
            t for i in range(len(loop.fragments)) for t in loop.global_parameters(i).values()
        )
        return [t.detach().clone() for t in tensors]

    try:
        if rank == 1:  # healed in group 0's first sync quorum, at its inner step
            step = CASES[method][0]
            loop.set_local_step(0 if loop.applies_next else step)
            joined = loop.join_sync()
            if joined:
                records.append((step, global_parameters()))
        with loop.hooks(OpenQuorums(sync)):
            while len(records) < SYNCS:
                inner_step(model, optimizer, data, lambda x: torch.sin(x[:, :1]))
                step += 1
                if len(manager.commits) > len(records):
                    records.append((step, global_parameters()))
    finally:
        sync.transport.shutdown()
    assert all(manager.commits)
    return joined, records


@pytest.mark.parametrize("method", CASES)
def test_a_joining_group_applies_the_running_sync_where_the_running_group_does(
    method: str,
) -> None:
    (_, running), (joined, joiner) = run_groups(2, lambda r, pg: run(r, pg, method))
    _, at_once, first = CASES[method]
    assert joined is at_once  # applied at once, or started and applied later
    applied_at = [first + PERIOD * i for i in range(SYNCS)]
    assert [s for s, _ in joiner] == [s for s, _ in running] == applied_at
    # The joiner took part in every average: after each sync both hold the same global ones.
    for (_, mine), (_, theirs) in zip(joiner, running, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
