"""The semi-sync method a config names, built on the sync quorum, and one line that says what it
is. The only place that branches on ``fault_tolerance.semi_sync_method``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance.heal.history import HealHistory
from torchtitan.experiments.fault_tolerance.job_config import FaultTolerance, semi_sync_config
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncDiLoCo
from torchtitan.experiments.fault_tolerance.methods.fragments import build_model_fragments
from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import outer_optimizer
from torchtitan.experiments.fault_tolerance.methods.periodic import DiLoCo, LocalSGD
from torchtitan.experiments.fault_tolerance.sync.quorum import RankInGroup, SyncQuorum
from torchtitan.experiments.fault_tolerance.sync.site_link import SiteLink
from torchtitan.experiments.fault_tolerance.transport.codecs import sparse_name
from torchtitan.experiments.fault_tolerance.transport.peer_watch import PeerWatch
from torchtitan.experiments.fault_tolerance.transport.sync_transport import SyncTransport

if TYPE_CHECKING:
    from torchtitan.components.ft import FTManager


def build_method(
    job_config: JobConfig,
    sync: SyncQuorum,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    group_ranks: int,
    history: HealHistory | None = None,
) -> OuterLoop:
    """The method around the inner ``optimizer``, syncing through ``sync``; ``group_ranks``:
    ranks of this replica group (for async DiLoCo's token count); ``history``: where a method
    that can replay keeps what its committed syncs delivered."""
    ft = semi_sync_config(job_config)
    if ft.method == "localsgd":
        return LocalSGD(sync, model, optimizer, ft.sync_steps)
    fragments = build_model_fragments(model, job_config)
    if ft.method == "async_diloco":
        training = job_config.training
        return AsyncDiLoCo(
            sync,
            fragments,
            optimizer,
            sync_steps=ft.sync_steps,
            update=ft.async_update,
            outer_lr=ft.outer_lr,
            outer_momentum=ft.outer_momentum,
            outer_nesterov=ft.outer_nesterov,
            outer_momentum_every=ft.outer_momentum_every,
            state_device=torch.device("cpu") if ft.outer_state_device == "cpu" else device,
            tokens_per_step=training.local_batch_size * training.seq_len * group_ranks,
            host_threads=ft.outer_step_threads,
            history=history,
        )
    return DiLoCo(
        sync,
        fragments,
        optimizer,
        outer_optimizer(ft.outer_lr, ft.outer_momentum, ft.outer_nesterov),
        period=ft.sync_steps // len(fragments),
        delay=ft.fragment_sync_delay,
        alpha=ft.fragment_update_alpha,
        history=history,
    )


def build_sync_quorum(
    ft: FaultTolerance,
    ft_manager: FTManager,
    history: HealHistory,
    rank: RankInGroup,
    site: SiteLink | None = None,
) -> SyncQuorum:
    """The sync quorum and its transport; ``history`` keeps what committed syncs delivered
    (if its capacity is not 0)."""
    transport = SyncTransport(
        wire_dtype(ft),
        error_feedback=ft.error_feedback,
        residual_decay=residual_decay(ft),
        bucket_mb=ft.sync_bucket_mb,
        timeout_s=ft.sync_collective_timeout_s,
        peers=PeerWatch(ft_manager.lighthouse),
        keep_delivered=history.capacity > 0,
    )
    return SyncQuorum(
        ft_manager,
        ft.min_replica_size,
        ft.sync_quorum_timeout_s,
        transport=transport,
        fragments=ft.fragment_count(),
        rank=rank,
        site=site,
    )


def heal_history(ft: FaultTolerance) -> HealHistory:
    """The last committed syncs, which a group restarted from its own checkpoint replays
    instead of receiving the full state: none for LocalSGD (cannot replay)."""
    return HealHistory(ft.heal_history_syncs if ft.method != "localsgd" else 0)


def wire_dtype(ft: FaultTolerance) -> str:
    """``pseudo_grad_dtype`` as the codecs name it (sparse's name includes non-default
    settings)."""
    if ft.pseudo_grad_dtype != "sparse":
        return ft.pseudo_grad_dtype
    return sparse_name(ft.sparse_chunk, ft.sparse_keep, ft.sparse_value_bits)


def residual_decay(ft: FaultTolerance) -> float:
    """The error-feedback residual's decay per sync: ``sparse_residual_decay`` for sparse, else
    1 (nothing fades)."""
    return ft.sparse_residual_decay if ft.pseudo_grad_dtype == "sparse" else 1.0


def describe(job_config: JobConfig, loop: OuterLoop) -> str:
    """One log line: the method and every setting it runs with."""
    ft = semi_sync_config(job_config)
    parts = [f"sync every {ft.sync_steps} inner steps", f"{len(loop.fragments)} fragment(s)"]
    if ft.method != "localsgd":
        if ft.outer_momentum_every > 1:
            parts.append(
                f"outer Delayed Nesterov lr {ft.outer_lr} momentum {ft.outer_momentum} "
                f"every {ft.outer_momentum_every} outer steps"
            )
        else:
            parts.append(
                f"outer SGD lr {ft.outer_lr} momentum {ft.outer_momentum} "
                f"nesterov {ft.outer_nesterov}"
            )
    if ft.method == "async_diloco":
        parts.append(
            f"{ft.async_update} update overlapped with the next period, outer state on "
            f"{ft.outer_state_device}"
        )
        if ft.dynamic_local_steps:
            points = job_config.training.steps // loop.period
            parts.append(
                "DyLU (inner steps per period from each group's speed; training ends after "
                f"{points} sync points)"
            )
    elif ft.method == "diloco":
        parts.append(f"delay {ft.fragment_sync_delay}, alpha {ft.fragment_update_alpha}")
    line = f"[semi-sync] {ft.method}: " + ", ".join(parts)
    if ft.pseudo_grad_dtype != "float32":
        feedback = " with error feedback" if ft.error_feedback else ""
        line += f"; pseudo-gradients sent as {ft.pseudo_grad_dtype}{feedback}"
        if ft.pseudo_grad_dtype == "sparse":
            line += (
                f" (top {ft.sparse_keep} of every {ft.sparse_chunk} values, "
                f"{ft.sparse_value_bits} bits each)"
            )
    return line + f"; sync quorum timeout {ft.sync_quorum_timeout_s:g}s"
