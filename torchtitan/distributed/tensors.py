"""A parameter's local shard, and a shard laid out again as its parameter (DTensor or plain)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the tensor itself when it is not sharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


def as_param_layout(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a DTensor laid out like ``param``, so DCP stores one
    logical tensor, not one per rank. It shares ``local``'s storage on any device: CPU outer
    state (``outer_state_device=cpu``) is saved and loaded there, never copied to the
    accelerator (several copies of the shard at once: what the field avoids)."""
    if not isinstance(param, DTensor):
        return local
    mesh = param.device_mesh
    if local.device.type != mesh.device_type:
        # Same ranks and layout on local's device (DCP needs only the layout), from the
        # parameter's process groups: no new ones.
        groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        mesh = DeviceMesh.from_group(
            groups[0] if mesh.ndim == 1 else groups,
            local.device.type,
            mesh=mesh.mesh,
            mesh_dim_names=mesh.mesh_dim_names,
        )
    return DTensor.from_local(
        local, mesh, param.placements, shape=param.shape, stride=param.stride()
    )
