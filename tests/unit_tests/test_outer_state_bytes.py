"""What each method says it holds beside the model (``OuterLoop.state_bytes``, the
``semi_sync.outer_state`` event and ``benchmarks/memory.py``'s figures by kind), after real
syncs over gloo groups, against the sizes the method's design gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit_tests.gloo_groups import LoopbackManager, OpenQuorums, run_groups, sync_manager
from tests.unit_tests.toy_task import (
    PERIOD,
    build_method,
    fragment_count,
    fragments_of,
    inner_step,
    make_model,
)

#: Bytes of the toy model's parameters (fp32), and of its largest fragment of two.
PARAMS = sum(p.numel() for p in make_model().parameters()) * 4
LARGEST = max(sum(p.numel() for p in f.parameters()) for f in fragments_of(make_model(), 2)) * 4


def _trained(method: str) -> Any:
    """Group 0's method after three periods (every fragment synced at least once) with outer
    momentum, beside a second group."""

    def run(rank: int, pg: Any) -> Any:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = sync_manager(LoopbackManager(pg, rank, 2), fragments=fragment_count(method))
        loop = build_method(method, sync, model, optimizer, outer_momentum=0.9)
        data = torch.Generator().manual_seed(rank)
        try:
            with loop.hooks(OpenQuorums(sync)):
                for _ in range(3 * PERIOD):
                    inner_step(model, optimizer, data, lambda x: x[:, :1])
        finally:
            sync.transport.shutdown()
        return loop

    return run_groups(2, run)[0]


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("localsgd", {"buffers": PARAMS}),
        ("diloco", {"global_copy": PARAMS, "momentum": PARAMS, "buffers": PARAMS}),
        ("streaming_diloco", {"global_copy": PARAMS, "momentum": PARAMS, "buffers": LARGEST}),
        (
            "async_eager",
            {
                "global_copy": PARAMS,
                "period_start": PARAMS,
                "momentum": PARAMS,
                "buffers": PARAMS + 4,  # [pseudo-gradient, tokens], fp32; no staging on a CPU
            },
        ),
    ],
)
def test_state_bytes_are_the_tensors_each_method_holds(
    method: str, expected: dict[str, int]
) -> None:
    loop = _trained(method)
    assert loop.state_bytes() == expected
    assert sum(loop.fragment_bytes(i) for i in range(len(loop.fragments))) == PARAMS
