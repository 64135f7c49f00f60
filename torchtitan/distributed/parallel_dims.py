"""The process layout of one job (one replica group): device, ranks, the FSDP2 mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.job_config import JobConfig, require_shard_degree
from torchtitan.tools.logging import logger


@dataclass
class ParallelDims:
    """Where this process sits.

    Inside a job every rank is a data-parallel shard (FSDP2 over ``dp_mesh``). Replica groups
    (fault tolerance) are separate jobs; ``data_rank``/``data_world_size`` fold them in so that
    each rank of each group reads its own slice of the data.
    """

    device: torch.device
    rank: int
    world_size: int
    dp_mesh: DeviceMesh | None
    replica_id: int = 0
    num_replica_groups: int = 1

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def data_rank(self) -> int:
        return self.replica_id * self.world_size + self.rank

    @property
    def data_world_size(self) -> int:
        return self.num_replica_groups * self.world_size

    @property
    def is_main_rank(self) -> bool:
        return self.rank == 0


def pick_device(job_config: JobConfig) -> torch.device:
    """``training.device``, with ``auto`` meaning cuda when available."""
    kind = job_config.training.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


#: With fault tolerance on nccl, for every nccl group of the process: no heartbeat monitor. The
#: monitor of the process's first group ends the process a few minutes after any group of it
#: saw an error: a survivor's replicate group seeing a peer's death would then kill the survivor
#: (``components/ft/build.py`` has the replicate group's own modes). A rank's death inside its
#: replica group still ends the group: that group's watchdog tears the process down.
FAULT_TOLERANT_NCCL_ENVIRONMENT = {"TORCH_NCCL_ENABLE_MONITORING": "0"}


def init_distributed(job_config: JobConfig) -> ParallelDims:
    """Start the job's process group (when launched with more than one rank) and its mesh.

    nccl on cuda, gloo on cpu. FSDP2 shards over all ranks of the job; only
    ``parallelism.data_parallel_shard_degree`` in {-1, world size} is supported.
    """
    device = pick_device(job_config)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    require_shard_degree(job_config.parallelism.data_parallel_shard_degree, world_size)
    ft = job_config.fault_tolerance
    replica_id, groups = (ft.replica_id, ft.group_size) if ft.enable else (0, 1)
    if ft.enable and device.type == "cuda":
        os.environ.update(FAULT_TOLERANT_NCCL_ENVIRONMENT)  # before any nccl group is built
    if world_size == 1:
        return ParallelDims(device, 0, 1, None, replica_id, groups)

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=job_config.comm.init_timeout_seconds),
        )
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    logger.info(f"Process group up: {backend}, {world_size} ranks, FSDP2 over dp_shard")
    return ParallelDims(device, rank, world_size, mesh, replica_id, groups)
