"""Every semi-sync method really averages every parameter, whatever its size and dtype.

Two replica groups, and three for a few cases (real gloo process groups, one thread each;
``gloo_groups``), train the same model on different data and sync. With outer lr 1 and momentum
0 a sync must move every global parameter by exactly the mean of what the groups sent: for
LocalSGD the mean of their parameters, for DiLoCo and async DiLoCo the mean of their pseudo-
gradients, which for DiLoCo and async ``delayed`` (periods that start from the global copy)
makes the global parameters the mean of the groups' local ones. Exact up to fp32 rounding for
float32, within the codec's stated bound otherwise (``transport/codecs.py``: half a quantization
step, ``absmax / qmax / 2``, per encoding; bfloat16: 2^-8 relative). Sparse keeps most of a
pseudo-gradient back: with its error feedback, what a group sent is its input plus what it owed
less what it owes after the sync, and the sync moves the globals by the mean of exactly that.
The bucket is lowered to 300 values, so the model has tensors larger than a bucket, tensors
packed together, and a bucket that a tensor does not fit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.unit_tests.gloo_groups import LoopbackManager, OpenQuorums, run_groups, sync_manager
from tests.unit_tests.toy_task import BUCKET, PERIOD, fragment_count, inner_step, make_model
from tests.unit_tests.toy_task import build_method as build
from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncOuterState
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    get_codec,
)

GROUPS = 2


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def train_and_record(
    rank: int, pg: Any, method: str, dtype: str, groups: int = GROUPS
) -> dict[str, Any]:
    """One group: 3 syncs; per sync the tensors it sent (flat, in call order, divided by its
    token count for async DiLoCo), the global parameters of the synced fragment before and
    after, and its local parameters of that fragment at the sync point."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = LoopbackManager(pg, rank, groups)
    loop: Any = None
    # Sparse keeps what it does not send as a residual: what a group sent is then known
    # exactly from its residuals before and after the sync.
    feedback = dtype == "sparse"
    sync = sync_manager(
        manager,
        dtype,
        error_feedback=feedback,
        bucket_numel=BUCKET,
        fragments=fragment_count(method),
    )
    loop = build(method, sync, model, optimizer)
    record: dict[str, Any] = {
        "sent": [], "before": [], "after": [], "local": [], "owed_before": [], "owed_after": []
    }  # fmt: skip
    sending: list[torch.Tensor] = []
    allreduce = sync.allreduce

    def owed(index: int) -> torch.Tensor:
        """This group's residuals of fragment ``index``, flat, in parameter order."""
        assert sync.transport.residuals is not None
        return sync.transport.residuals.flat(index, flat(fragment_params(index)).numel())

    def spy_allreduce(tensor: torch.Tensor, *args: Any, exact: bool = False, **kw: Any) -> Any:
        if not exact:
            if feedback and not sending:
                record["owed_before"].append(owed(loop.current_fragment()))
            sending.append(tensor.detach().clone().reshape(-1))
        return allreduce(tensor, *args, exact=exact, **kw)

    sync.allreduce = spy_allreduce  # type: ignore[method-assign]  # a spy on the method

    def globals_of(index: int) -> torch.Tensor:
        if method == "localsgd":
            return flat(model.parameters())
        return flat(loop.global_parameters(index).values())

    fragment_params = (
        (lambda i: list(model.parameters()))
        if method in ("localsgd", "diloco") or method.startswith("async_")
        else (lambda i: list(loop.fragments[i].parameters()))
    )

    if method.startswith("async_"):
        # The average of the sync started at one sync point is applied at the next one.
        original_finish = AsyncOuterState.finish
        original_start = AsyncOuterState.start

        def spy_start(state: AsyncOuterState, out: torch.Tensor, *args: Any) -> None:
            record["local"].append(flat(model.parameters()))
            record["start"] = record.get("start", []) + [flat(state.period_start.values())]
            original_start(state, out, *args)

        def spy_finish(state: AsyncOuterState, sums: torch.Tensor | None, total: float) -> None:
            if sums is not None:
                record["before"].append(flat(state.global_copy.values()))
            original_finish(state, sums, total)
            if sums is not None:
                record["after"].append(flat(state.global_copy.values()))
                if feedback:
                    record["owed_after"].append(owed(0))

        def spy_both(
            state: AsyncOuterState, sums: Any, total: float, out: torch.Tensor, *args: Any
        ) -> None:  # the one pass, as its two halves (test_outer_passes: the same bits)
            spy_finish(state, sums, total)
            spy_start(state, out, *args)

        state = loop._states[0]
        state.start = lambda out, *args: spy_start(state, out, *args)  # type: ignore[method-assign]
        state.finish = lambda sums, total: spy_finish(state, sums, total)  # type: ignore[method-assign]
        state.finish_and_start = lambda *args: spy_both(state, *args)  # type: ignore[method-assign]
    else:
        begin_sync = sync.begin_sync

        def spy_quorum() -> None:  # the end of a sync quorum
            begin_sync()
            index = loop.current_fragment()
            record["fragment"] = record.get("fragment", []) + [index]
            record["local"].append(flat(fragment_params(index)))
            record["before"].append(globals_of(index))

        sync.begin_sync = spy_quorum  # type: ignore[method-assign]

    data = torch.Generator().manual_seed(100 + rank)
    syncs = 4 if method.startswith("async_") else 3
    steps = syncs * PERIOD * (2 if method.startswith("streaming_diloco") else 1)
    try:
        with loop.hooks(OpenQuorums(sync)):
            for _ in range(steps):
                inner_step(model, optimizer, data, lambda x: torch.sin(x[:, :1] * (rank + 1)))
                if sending:
                    record["sent"].append(torch.cat(sending))
                    sending.clear()
                if not method.startswith("async_") and loop.local_step() == 0:
                    # The sync prepared at its quorum is performed (with a delay: a step later).
                    record["after"].append(globals_of(record["fragment"][-1]))
                    if feedback:
                        record["owed_after"].append(owed(record["fragment"][-1]))
    finally:
        sync.transport.shutdown()
    record["commits"] = manager.commits
    if feedback:
        # What the group really sent (decoded): its input plus what it owed, less what it owes
        # now; the slack bounds the fp32 rounding of that arithmetic.
        record["slack"], record["owed_more"] = [], []
        # The last sync handed in may not have ended (async): it has no "after".
        owed_pairs = zip(record["owed_before"], record["owed_after"], strict=False)
        for i, (before, after) in enumerate(owed_pairs):
            given = record["sent"][i]
            record["sent"][i] = given.double() + before.double() - after.double()
            record["owed_more"].append(after.double() - before.double())
            eps = torch.finfo(torch.float32).eps
            record["slack"].append(2 * eps * (given.abs() + before.abs() + after.abs()))
    if method.startswith("async_"):
        tokens = PERIOD * 10
        record["sent"] = [s / tokens for s in record["sent"]]
        record["slack"] = [s / tokens for s in record.get("slack", [])]
        record["owed_more"] = [s / tokens for s in record.get("owed_more", [])]
    return record


def window_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per element, the largest magnitude within 127 elements on either side: at least the
    absmax of any 128-value block that holds it (blocks lie in buckets, buckets are runs of
    consecutive tensors)."""
    return F.max_pool1d(x.abs()[None, None], 2 * 127 + 1, stride=1, padding=127)[0, 0]


def bound(sent: list[torch.Tensor], dtype: str, slack: list[torch.Tensor] | None = None):
    """The most the decoded mean of ``sent`` can differ from their exact mean, per element:
    each group's own encoding, then the re-encoding of the reduced sum, divided by the number
    of groups. Sparse: ``sent`` is already what was decoded, known up to its ``slack``."""
    if dtype == "float32":
        return torch.zeros_like(sent[0])
    if dtype == "sparse":
        assert slack is not None
        return sum(s.double() for s in slack) / len(sent)
    if dtype == "bfloat16":
        u = 2.0**-8
        own = sum(u * s.abs() for s in sent)
        return (own + u * (sum(s.abs() for s in sent) + own)) / len(sent)
    qmax = get_codec(dtype).qmax  # type: ignore[attr-defined]
    windows = [window_absmax(s) for s in sent]
    own = sum(w / qmax / 2 for w in windows)
    reduced = sum(windows) + own  # the reduced block's absmax is at most this
    return (own + reduced / qmax / 2) / len(sent)


CASES = [("localsgd", "float32", GROUPS)] + [
    (method, dtype, GROUPS)
    for method in ("diloco", "streaming_diloco", "streaming_diloco_delayed")
    + ("async_eager", "async_eager_share", "async_delayed")
    for dtype in PSEUDO_GRAD_DTYPES
]
# Three groups: an average divided by 2 whatever the quorum's size fails here.
CASES += [
    ("localsgd", "float32", 3),
    ("diloco", "int4", 3),
    ("streaming_diloco", "bfloat16", 3),
    ("async_eager", "int8", 3),
    ("async_delayed", "float32", 3),
    ("diloco", "sparse", 3),
    ("async_eager", "sparse", 3),
]


@pytest.mark.parametrize(("method", "dtype", "groups"), CASES)
def test_a_sync_moves_every_global_parameter_by_the_mean_of_what_the_groups_sent(
    method: str, dtype: str, groups: int
) -> None:
    records = run_groups(groups, lambda r, pg: train_and_record(r, pg, method, dtype, groups))
    first = records[0]
    assert all(all(r["commits"]) for r in records), [r["commits"] for r in records]
    assert len(first["after"]) >= 3
    assert all(len(r["after"]) == len(first["after"]) for r in records)
    largest = max(t.numel() for t in make_model().parameters())
    assert largest > BUCKET  # the case torchft 0.2.0's bucketing dropped
    for sync in range(len(first["after"])):
        sent = [r["sent"][sync] for r in records]
        slack = [r["slack"][sync] for r in records] if dtype == "sparse" else None
        mean = sum(s.double() for s in sent) / groups
        # Every group applied the same bits.
        for other in records[1:]:
            same = torch.equal(first["after"][sync], other["after"][sync])
            assert same, f"sync {sync}: the groups' global parameters differ ({method}, {dtype})"
        before, after = first["before"][sync].double(), first["after"][sync].double()
        if method == "localsgd":
            moved_to, expected = after, mean  # the parameters become the mean
        else:
            moved_to, expected = before - after, mean  # lr 1: moved by the mean pseudo-gradient
        scale = before.abs().max() + mean.abs().max()
        rounding = 8 * torch.finfo(torch.float32).eps * scale
        error = (moved_to - expected).abs()
        allowed = bound(sent, dtype, slack).double() + rounding
        worst = (error - allowed).max().item()
        assert worst <= 0, f"sync {sync}: {worst:.3g} past the bound ({method}, {dtype})"
        assert mean.abs().max() > 10 * rounding  # the groups did send something
        if method in ("diloco", "streaming_diloco", "streaming_diloco_delayed", "async_delayed"):
            # Periods start from the global copy: the globals become the mean of the locals
            # (sparse: of each local moved by what its group now owes more).
            locals_ = sum(r["local"][sync].double() for r in records) / groups
            if dtype == "sparse":
                locals_ += sum(r["owed_more"][sync] for r in records) / groups
            gap = (after - locals_).abs() - bound(sent, dtype, slack).double() - 2 * rounding
            assert gap.max().item() <= 0, f"sync {sync}: globals are not the locals' mean"


def test_error_feedback_keeps_a_residual_per_transfer_renewed_by_every_committed_sync() -> None:
    """int4 DiLoCo with error feedback over three syncs: a residual per transfer (the pieces of
    the tensor larger than a bucket and the two buckets), each renewed by every committed sync,
    past the first one (the offsets restart at every quorum and meet their residuals again)."""

    def group(rank: int, pg: Any) -> list[dict[int, torch.Tensor]]:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        manager = LoopbackManager(pg, rank, GROUPS)
        sync = sync_manager(manager, "int4", error_feedback=True, bucket_numel=BUCKET)
        loop = build("diloco", sync, model, optimizer)
        owed: list[dict[int, torch.Tensor]] = []
        data = torch.Generator().manual_seed(100 + rank)
        try:
            with loop.hooks(OpenQuorums(sync)):
                for _ in range(3 * PERIOD):
                    inner_step(model, optimizer, data, lambda x: x[:, :1])
                    if loop.local_step() == 0:
                        assert sync.transport.residuals is not None
                        segments = sync.transport.residuals.segments(0).items()
                        owed.append({k: v.clone() for k, v in segments})  # buffers are reused
        finally:
            sync.transport.shutdown()
        assert manager.commits == [True] * 3
        return owed

    # 1024 in bucket-sized pieces, then the two buckets of small tensors.
    sizes = [300, 300, 300, 124, 64 + 128 + 2, 120 + 60 + 60 + 1]
    offsets = [sum(sizes[:i]) for i in range(6)]
    for owed in run_groups(GROUPS, group):
        assert [sorted(o) for o in owed] == [offsets] * 3
        assert [owed[0][k].numel() for k in offsets] == sizes
        for key in owed[0]:
            values = [o[key] for o in owed]
            assert all(v.abs().sum() > 0 and torch.isfinite(v).all() for v in values)
            assert not torch.equal(values[0], values[1]) and not torch.equal(values[1], values[2])
