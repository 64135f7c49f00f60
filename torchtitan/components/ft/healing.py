"""The state a live group sends to a joining one, and how sharded tensors cross groups.

Rank r of one replica group heals rank r of another, so their FSDP shards line up: DTensors
travel as their local shard plus layout (plain tensors for torchft's transport) and are
rebuilt on the receiving group's mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.components.ft.errors import FaultToleranceError

#: Trainer state a joiner keeps as its own instead of taking its peer's: a group's data
#: position is that of its own data shard.
NOT_HEALED = frozenset({"dataloader"})

# Marks a DTensor's local shard in healing state (see ``_to_local_tree``).
_SHARD = "__ft_local_shard__"

#: In place of a state a heal does not send (a transport that sends only what the joiner
#: lacks): the joiner keeps its own, untouched.
KEEP_OWN: dict[str, bool] = {"__ft_keep_own__": True}


def keeps_own(value: Any) -> bool:
    return isinstance(value, dict) and bool(value.get("__ft_keep_own__"))


def _to_local_tree(value: Any) -> Any:
    """Replace DTensors by their local shards plus layout. The layout is sent because the
    joiner may have no tensor to take it from (a fresh optimizer's state)."""
    if isinstance(value, DTensor):
        return {
            _SHARD: value.to_local(),
            "placements": tuple(value.placements),
            "shape": tuple(value.shape),
            "stride": tuple(value.stride()),
        }
    if isinstance(value, dict):
        return {k: _to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local_tree(v) for v in value]
    return value


def _from_local_tree(template: Any, value: Any, mesh: DeviceMesh | None) -> Any:
    """Inverse of ``_to_local_tree``: re-wrap shards as DTensors on ``template``'s mesh (or this
    group's ``mesh`` where the template has no such entry) and move tensors to its device."""
    if isinstance(value, dict) and _SHARD in value:
        local = value[_SHARD]
        if isinstance(template, DTensor):
            mesh, local = template.device_mesh, local.to(template.device)
        elif mesh is None:
            raise FaultToleranceError(
                "healing state holds a sharded tensor but this group has no device mesh: "
                "every replica group must run the same number of ranks (NGPU)"
            )
        return DTensor.from_local(
            local,
            mesh,
            value["placements"],
            run_check=False,
            shape=torch.Size(value["shape"]),
            stride=value["stride"],
        )
    if isinstance(value, dict):
        sub = template if isinstance(template, dict) else {}
        return {k: _from_local_tree(sub.get(k), v, mesh) for k, v in value.items()}
    if isinstance(value, list):
        subs = template if isinstance(template, list) and len(template) == len(value) else []
        return [_from_local_tree(subs[i] if subs else None, v, mesh) for i, v in enumerate(value)]
    if isinstance(template, torch.Tensor) and isinstance(value, torch.Tensor):
        return value.to(template.device)
    return value


def register_healing_state(
    manager: Any,
    name: str,
    state: Stateful,
    mesh: DeviceMesh | None = None,
    on_load: Callable[[str], None] | None = None,
) -> None:
    """Serve ``state`` (read when a peer asks) to joiners and load it when this group heals.
    ``manager``: anything with torchft's ``register_state_dict_fn``. ``mesh``: this group's
    FSDP mesh, to rebuild sharded entries the local state lacks. ``on_load(name)`` runs after
    the state was loaded from a peer."""

    def save() -> Any:
        return _to_local_tree(state.state_dict())

    def load(value: Any) -> None:
        if keeps_own(value):
            return
        state.load_state_dict(_from_local_tree(state.state_dict(), value, mesh))
        if on_load is not None:
            on_load(name)

    manager.register_state_dict_fn(name, load, save)
