"""Healing state crosses replica groups as plain tensors; a joiner rebuilds sharded (DTensor)
entries even where its own state has none to copy the layout from (a fresh optimizer)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan.components.ft import FaultToleranceError, register_healing_state
from torchtitan.components.ft.healing import _from_local_tree, _to_local_tree
from torchtitan.components.optimizer import OptimizerState


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank gloo process group and mesh (FSDP2 and DTensor need one)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    if owned:
        dist.destroy_process_group()


class Recorder:
    """Stands in for torchft's Manager: keeps the registered save/load functions."""

    def __init__(self) -> None:
        self.fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, name: str, load: Any, save: Any) -> None:
        self.fns[name] = (load, save)


def test_plain_state_round_trips():
    state = {"a": torch.arange(3.0), "b": [torch.ones(2), 4, "x"], "c": {"d": 1.5}}
    sent = pickle.loads(pickle.dumps(_to_local_tree(state)))
    back = _from_local_tree(state, sent, None)
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"][0], state["b"][0])
    assert back["b"][1:] == [4, "x"] and back["c"] == {"d": 1.5}


def test_dtensor_rebuilt_without_a_template(mesh):
    shard = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    sent = pickle.loads(pickle.dumps(_to_local_tree({"w": shard})))
    assert not isinstance(sent["w"], DTensor)  # crosses groups as a plain tensor + layout
    for template in ({"w": shard}, {}):
        back = _from_local_tree(template, sent, mesh)["w"]
        assert isinstance(back, DTensor)
        assert back.placements == shard.placements and back.shape == shard.shape
        assert torch.equal(back.to_local(), shard.to_local())


def test_dtensor_without_any_mesh_is_a_clear_error(mesh):
    shard = distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)])
    with pytest.raises(FaultToleranceError, match="same number of ranks"):
        _from_local_tree({}, _to_local_tree({"w": shard}), None)


def _sharded_model(seed: int, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    return model


def test_fresh_optimizer_heals_sharded_state_from_a_peer(mesh):
    """The joiner heals while it holds gradients and an optimizer that never stepped (so its
    state dict has no entries to copy DTensor layouts from); it must still step afterwards
    and match the peer."""
    peer = _sharded_model(0, mesh)
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=0.1)
    peer(torch.randn(3, 4)).sum().backward()
    peer_opt.step()

    joiner = _sharded_model(1, mesh)
    joiner_opt = torch.optim.AdamW(joiner.parameters(), lr=0.1)
    joiner(torch.randn(3, 4)).sum().backward()  # grads present, optimizer state empty

    sender, receiver = Recorder(), Recorder()
    register_healing_state(sender, "optimizer", OptimizerState(peer, peer_opt), mesh)
    healed: list[str] = []
    register_healing_state(
        receiver, "optimizer", OptimizerState(joiner, joiner_opt), mesh, healed.append
    )
    payload = pickle.loads(pickle.dumps(sender.fns["optimizer"][1]()))
    receiver.fns["optimizer"][0](payload)
    assert healed == ["optimizer"]
    for p_peer, p_joiner in zip(peer.parameters(), joiner.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = peer_opt.state[p_peer][key], joiner_opt.state[p_joiner][key]
            assert isinstance(b, DTensor)
            assert torch.equal(a.to_local(), b.to_local())
    joiner_opt.step()  # mixing plain tensors and DTensors would raise here
