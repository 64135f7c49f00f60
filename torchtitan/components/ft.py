"""Fault tolerance across replica groups with torchft.

Each rank of each replica group (one ``torchrun``) owns one ``torchft.Manager``. The managers
of rank r in every group form the fault-tolerant replicate dimension: a process group that
torchft rebuilds at every quorum from the groups alive at that moment.

Failure semantics (synchronous FT; see the README for the full story):

* A step is all-or-nothing. ``start_step`` joins a quorum; gradients are averaged across the
  groups in it; ``should_commit`` is True only if no group failed during the step. A step that
  is not committed changes nothing (no optimizer step, no LR step, no step count); the trainer
  moves on to the next batch.
* A group that dies (SIGKILL, crash) stops heartbeating; after the lighthouse's
  ``heartbeat_timeout_ms`` it is left out of the next quorum and the survivors go on. A group
  that hangs inside a collective is dropped after ``process_group_timeout_ms``.
* With fewer than ``min_replica_size`` groups alive, survivors wait for a quorum for up to
  ``quorum_timeout_s`` (and say so), then fail.
* A group that (re)joins heals: a live peer sends it every state in the trainer's registry
  except the dataloader (model, optimizer, LR schedule, step, and state registered by
  subclasses) at the step of the quorum, so from its first committed step on its parameters
  equal the peers' bit for bit. Its data position stays its own (each group reads its own
  shard; a restarted group resumes it from its own checkpoint, else from the shard's start).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

# Per-group state that a joiner must not take from its peer (see module docstring).
NOT_HEALED = frozenset({"dataloader"})


def _to_local_tree(value: Any) -> Any:
    """Replace DTensors by their local shards so state crosses groups as plain tensors
    (rank r of one group heals rank r of another: the shards line up)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local_tree(v) for v in value]
    return value


def _from_local_tree(template: Any, value: Any) -> Any:
    """Inverse of ``_to_local_tree``: re-wrap local shards like the DTensors in ``template``."""
    if isinstance(template, DTensor):
        return DTensor.from_local(
            value.to(template.device),
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _from_local_tree(template.get(k), v) for k, v in value.items()}
    if isinstance(template, list) and isinstance(value, list):
        return [_from_local_tree(t, v) for t, v in zip(template, value, strict=True)]
    if isinstance(template, torch.Tensor) and isinstance(value, torch.Tensor):
        return value.to(template.device)
    return value


def lighthouse_address(job_config: JobConfig) -> str:
    address = job_config.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise RuntimeError(
            "fault_tolerance.enable is set but no lighthouse address is known: set "
            "fault_tolerance.lighthouse=http://HOST:PORT or env TORCHFT_LIGHTHOUSE "
            "(start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:PORT`)"
        )
    return address


class FTManager:
    """This rank's torchft Manager, and what the trainer does with it each step."""

    def __init__(self, manager: Any, group_size: int, replica_id: int) -> None:
        self.manager = manager
        self.group_size = group_size
        self.replica_id = replica_id
        self._quorum_ready = False

    def start_step(self) -> None:
        """Join the quorum of this step (asynchronously when the Manager allows it), unless
        ``wait_for_full_quorum`` already holds one for it."""
        if self._quorum_ready:
            self._quorum_ready = False
            return
        self.manager.start_quorum()

    def allreduce_gradients(self, model: nn.Module) -> None:
        """Average the gradients of this rank's shard across the replica groups in the quorum.

        Gradients are flattened into one buffer per dtype so a step costs one collective.
        """
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters()
            if p.grad is not None
        ]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def should_commit(self) -> bool:
        """True when every group in the quorum finished this step without error."""
        return self.manager.should_commit()

    def wait_for_full_quorum(self, poll_seconds: float = 0.5) -> None:
        """Before step 1 of a new job, wait until all ``group_size`` groups are in one quorum,
        so that the first group up does not train alone. A group joining a job that already
        runs (the quorum is past step 0) goes on at once and heals in that quorum's step.

        Every group in a quorum sees the same members and step, so all of them decide alike
        to skip an incomplete quorum (no collective is started in it) or to train in it.
        """
        start = time.perf_counter()
        last_report = start
        while True:
            self.manager.start_quorum()
            self.manager.wait_quorum()
            participants = self.manager.num_participants()
            if participants >= self.group_size or self.manager.current_step() > 0:
                break
            now = time.perf_counter()
            if now - last_report > 5:
                logger.info(
                    f"[ft] waiting for all replica groups before step 1: {participants}/"
                    f"{self.group_size} in the quorum ({now - start:.0f}s)"
                )
                last_report = now
            time.sleep(poll_seconds)
        self._quorum_ready = True
        logger.info(
            f"[ft] first quorum: {participants} group(s), manager step "
            f"{self.manager.current_step()}, after {time.perf_counter() - start:.1f}s"
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def register_healing_state(manager: Any, name: str, state: Stateful) -> None:
    """Serve ``state`` (live, read when a peer asks) to joiners and load it when healing."""

    def save() -> Any:
        return _to_local_tree(state.state_dict())

    def load(value: Any) -> None:
        state.load_state_dict(_from_local_tree(state.state_dict(), value))
        logger.info(f"[ft] healed {name} from a live peer")

    manager.register_state_dict_fn(name, load, save)


def _quiet_known_torchft_noise() -> None:
    """Drop messages torchft 0.2.0 prints on every heal or quorum that say nothing to a user:
    a non-writable-buffer warning and a pytree deprecation inside its checkpoint transport,
    and a flight-recorder notice that only concerns NCCL."""
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)

    class _NoFlightRecorderNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "flight recorder" not in record.getMessage()

    logging.getLogger("torchft.manager").addFilter(_NoFlightRecorderNotice())


def build_ft_manager(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    states: dict[str, Stateful],
    *,
    use_async_quorum: bool = True,
    init_sync: bool = True,
) -> FTManager | None:
    """The Manager of this rank, from ``[fault_tolerance]``; None when it is off."""
    ft = job_config.fault_tolerance
    if not ft.enable:
        return None
    # torchft's Rust side logs every quorum and commit at INFO; keep its warnings only
    # unless the user asked otherwise (RUST_LOG=info shows them again).
    os.environ.setdefault("RUST_LOG", "warn")
    _quiet_known_torchft_noise()
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    backend = ft.process_group
    if backend == "auto":
        backend = "nccl" if parallel_dims.device.type == "cuda" else "gloo"
    pg_timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    pg = ProcessGroupNCCL(timeout=pg_timeout) if backend == "nccl" else ProcessGroupGloo(pg_timeout)
    # Healing goes over the replicate process group itself (no extra HTTP server listening on
    # every interface and serving the whole model unauthenticated).
    transport = PGTransport(
        pg, timeout=timedelta(seconds=ft.timeout_s), device=parallel_dims.device
    )
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ft.min_replica_size,
        use_async_quorum=use_async_quorum,
        timeout=timedelta(seconds=ft.timeout_s),
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
        connect_timeout=timedelta(seconds=ft.connect_timeout_s),
        rank=parallel_dims.rank,
        world_size=parallel_dims.world_size,
        lighthouse_addr=lighthouse_address(job_config),
        replica_id=f"replica_{ft.replica_id}",
        hostname=ft.hostname,
        checkpoint_transport=transport,
        init_sync=init_sync,
    )
    for name, state in states.items():
        if name not in NOT_HEALED:
            register_healing_state(manager, name, state)
    logger.info(
        f"[ft] replica group {ft.replica_id} of {ft.group_size}, {backend}, lighthouse "
        f"{lighthouse_address(job_config)}, min_replica_size {ft.min_replica_size}"
    )
    return FTManager(manager, ft.group_size, ft.replica_id)
