"""Pieces of the semi-sync trainer that need no replica groups: model fragments, the state a
checkpoint carries, the heal check, the pseudo-gradient norm and the lighthouse status."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan.config import ConfigManager
from torchtitan.experiments.fault_tolerance.trainer import (
    SemiSyncState,
    SemiSyncTrainer,
    build_model_fragments,
    lighthouse_status,
)
from torchtitan.models import get_train_spec

SEMI_SYNC = "torchtitan.experiments.fault_tolerance.job_config"


def config(*argv: str) -> Any:
    return ConfigManager().parse_args(
        [
            "--job.custom_args_module",
            SEMI_SYNC,
            "--model.flavor=debugmodel_small",
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size=2",
            "--fault_tolerance.semi_sync_method=diloco",
            "--fault_tolerance.sync_steps=4",
            *argv,
        ]
    )


def small_model() -> nn.Module:
    spec = get_train_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(spec.model_args["debugmodel_small"])
    model.init_weights()
    return model


# ---- fragments -------------------------------------------------------------------------------


def _fragment_names(fragments: list[nn.Module]) -> list[list[str]]:
    return [fragment.fqns() for fragment in fragments]  # type: ignore[operator]


def test_one_fragment_is_the_model_itself() -> None:
    model = small_model()
    assert build_model_fragments(model, config()) == [model]


def test_fragments_by_count_cover_every_parameter_once_in_model_order() -> None:
    model = small_model()
    fragments = build_model_fragments(model, config("--fault_tolerance.num_fragments=2"))
    names = _fragment_names(fragments)
    assert names[0][0] == "tok_embeddings.weight"
    assert all(n.startswith(("tok_embeddings.", "layers.0.")) for n in names[0])
    assert all(n.startswith(("layers.1.", "norm.", "output.")) for n in names[1])
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in model.named_parameters())
    # The fragments hold the model's own parameters, not copies.
    params = dict(model.named_parameters())
    for fragment, fqns in zip(fragments, names, strict=True):
        for p, fqn in zip(fragment.parameters(), fqns, strict=True):
            assert p is params[fqn]


def test_fragments_by_fqn_put_unlisted_parameters_in_the_last() -> None:
    model = small_model()
    job = config(
        "--fault_tolerance.module_fqns_per_model_fragment", "layers.0.attention", "layers.1"
    )
    names = _fragment_names(build_model_fragments(model, job))
    assert all(n.startswith("layers.0.attention.") for n in names[0])
    # The rest of block 0 (its norms and feed-forward), embeddings, norm and output: last.
    assert "layers.0.feed_forward.w1.weight" in names[1]
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= set(names[1])
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in model.named_parameters())


# ---- checkpointed state ----------------------------------------------------------------------


class FakeManager:
    """What torchft's DiLoCo needs from a Manager when no sync runs."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def current_step(self) -> int:
        return 0


def diloco(model: nn.Module, fragments: int, delay: int = 0) -> tuple[Any, FakeManager]:
    from torchft.local_sgd import DiLoCo

    job = config(f"--fault_tolerance.num_fragments={fragments}")
    parts = build_model_fragments(model, job)
    manager = FakeManager()
    outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
    inner = torch.optim.AdamW(model.parameters())
    algo = DiLoCo(manager, parts, inner, outer, sync_every=4, fragment_sync_delay=delay)
    return algo, manager


def _outer_step(algo: Any) -> None:
    """One outer step of every fragment on a made-up pseudo-gradient."""
    for fragment in algo._fragments:
        for p in fragment._model_fragment.parameters():
            p.grad = torch.full_like(p, 0.01)
        fragment._outer_optimizer.step()
        fragment._outer_optimizer.zero_grad()
        fragment.save_parameters()


def test_semi_sync_state_round_trips_through_dcp_into_a_fresh_process(tmp_path: Path) -> None:
    model = small_model()
    algo, _ = diloco(model, fragments=2)
    _outer_step(algo)
    algo._local_step = 1
    saved_globals = [
        {k: v.clone() for k, v in f.original_parameters.items()} for f in algo._fragments
    ]
    momentum = [
        [
            f._outer_optimizer.state[p]["momentum_buffer"].clone()
            for p in f._model_fragment.parameters()
        ]
        for f in algo._fragments
    ]
    dcp.save({"semi_sync": SemiSyncState(SimpleNamespace(algorithm=algo))}, checkpoint_id=tmp_path)

    # A new process: same model init, an outer optimizer that never stepped (no momentum).
    fresh, _ = diloco(small_model(), fragments=2)
    assert not fresh._fragments[0]._outer_optimizer.state
    dcp.load({"semi_sync": SemiSyncState(SimpleNamespace(algorithm=fresh))}, checkpoint_id=tmp_path)
    assert fresh._local_step == 1
    for i, fragment in enumerate(fresh._fragments):
        for name, value in fragment.original_parameters.items():
            assert torch.equal(value, saved_globals[i][name])
        params = list(fragment._model_fragment.parameters())
        for p, expected in zip(params, momentum[i], strict=True):
            assert torch.equal(fragment._outer_optimizer.state[p]["momentum_buffer"], expected)


def test_checkpoint_without_outer_momentum_loads_none(tmp_path: Path) -> None:
    algo, _ = diloco(small_model(), fragments=1)
    dcp.save({"s": SemiSyncState(SimpleNamespace(algorithm=algo))}, checkpoint_id=tmp_path)
    fresh, _ = diloco(small_model(), fragments=1)
    dcp.load({"s": SemiSyncState(SimpleNamespace(algorithm=fresh))}, checkpoint_id=tmp_path)
    assert not fresh._fragments[0]._outer_optimizer.state


def test_checkpoint_taken_with_a_sync_in_flight_drops_that_sync() -> None:
    """Streaming with a delay: a checkpoint between a fragment's prepare and its perform
    cannot hold the in-flight all-reduce. Loading it puts that fragment back to its global
    parameters and restarts the period, as torchft does after a failed sync."""
    model = small_model()
    algo, _ = diloco(model, fragments=2, delay=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # inner steps moved the model away from the global copies
    algo._local_step = 1
    algo._fragments[1]._allreduce_work = ["in flight"]  # what prepare_sync leaves behind
    state = SemiSyncState(SimpleNamespace(algorithm=algo))
    saved = state.state_dict()
    assert saved["in_flight_fragment"] == 1

    algo._fragments[1]._allreduce_work = []
    state.load_state_dict(saved)
    assert algo._local_step == 0
    restored = algo._fragments[1]
    for name, p in restored._model_fragment.named_parameters():
        assert torch.equal(p, restored.original_parameters[name])
    untouched = algo._fragments[0]
    for name, p in untouched._model_fragment.named_parameters():
        assert torch.equal(p, untouched.original_parameters[name] + 1.0)


def test_healing_state_is_read_when_sent_not_at_start_up() -> None:
    """torchft's own DiLoCo healing state (global copies, outer optimizer) is produced when a
    peer asks, so a joiner gets the state of that moment."""
    algo, manager = diloco(small_model(), fragments=1)
    _, save = manager.fns["StreamingDiLoCoFragment_0"]
    before = save()["original_parameters"]
    _outer_step(algo)
    after = save()["original_parameters"]
    live = algo._fragments[0].original_parameters
    assert all(torch.equal(after[k], live[k]) for k in live)
    assert not all(torch.equal(before[k], after[k]) for k in live)


# ---- heal check and pseudo-gradient norm -----------------------------------------------------


def _stub(local_step: int) -> SimpleNamespace:
    return SimpleNamespace(
        algorithm=SimpleNamespace(_local_step=local_step),
        ft=SimpleNamespace(manager=SimpleNamespace(current_step=lambda: 7)),
        train_state=SimpleNamespace(step=30),
        period=4,
    )


def test_heal_at_the_peer_s_position_is_accepted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    logger = logging.getLogger("torchtitan")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="torchtitan")
    try:
        SemiSyncTrainer._check_heal(_stub(4), {"local_step": 4, "replica_id": 0})  # type: ignore[arg-type]
    finally:
        logger.removeHandler(caplog.handler)
    assert "healed from a live peer (replica group 0) at sync #8, train step 31" in caplog.text


def test_heal_at_another_position_of_the_period_stops() -> None:
    with pytest.raises(
        RuntimeError, match="inner step 3 of its sync period, but this group is at 4"
    ):
        SemiSyncTrainer._check_heal(_stub(4), {"local_step": 3, "replica_id": 1})  # type: ignore[arg-type]


def test_pseudo_gradient_norm_is_the_norm_of_the_outer_gradients() -> None:
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    stub = SimpleNamespace(device=torch.device("cpu"), parallel_dims=SimpleNamespace(world_size=1))
    SemiSyncTrainer._measure_pseudo_gradient(stub, torch.optim.SGD([a, b], lr=1.0))  # type: ignore[arg-type]
    assert stub._pseudo_grad_norm == pytest.approx(5.0)


# ---- lighthouse status -----------------------------------------------------------------------


def test_lighthouse_status_counts_live_groups_and_sees_a_running_job() -> None:
    from torchft.coordination import LighthouseClient, LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1500
    )
    try:
        address = server.address().replace(socket.gethostname(), "127.0.0.1")
        client = LighthouseClient(address, timedelta(seconds=5))
        assert lighthouse_status(address) == (0, False)
        client.heartbeat("replica_0:a")
        assert lighthouse_status(address) == (1, False)  # up, but no quorum yet: not running
        client.quorum(
            replica_id="replica_0:a",
            timeout=timedelta(seconds=5),
            address="x",
            store_address="y",
            step=3,
            world_size=1,
            shrink_only=False,
        )
        client.heartbeat("replica_1:b")
        assert lighthouse_status(address) == (2, True)  # replica_0 is in the last quorum
        time.sleep(2)  # replica_0 stops heartbeating: the job of that quorum is gone
        client.heartbeat("replica_1:b")
        assert lighthouse_status(address) == (1, False)
    finally:
        server.shutdown()


def test_lighthouse_status_of_nothing_is_none() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert lighthouse_status(f"http://127.0.0.1:{port}", timeout_s=1) is None
