"""What each sync did, said once: the ``semi_sync.sync`` event and its TensorBoard scalars, the
global digest after a committed sync, the job's lineage, and a warning when a period comes close
to the sync quorum timeout.

The trainer hooks :meth:`SyncReporter.start_clock` before torchft's optimizer hook and
:meth:`SyncReporter.after_inner_step` after it, and calls :meth:`SyncReporter.report` where a
sync is decided outside them (a group joining at a sync point, the end of training).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchtitan.components.ft import FTManager
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
from torchtitan.experiments.fault_tolerance.methods.outer_loop import Ending, OuterLoop
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.experiments.fault_tolerance.join.exchange import QuorumExchange
    from torchtitan.experiments.fault_tolerance.sync.quorum import RankInGroup, SyncQuorum


class SyncReporter:
    """Reports the syncs of ``loop`` (through the sync quorum ``sync``) for one rank, with the
    agreement check of ``exchange``'s last quorum."""

    def __init__(
        self,
        job_config: JobConfig,
        loop: OuterLoop,
        sync: SyncQuorum,
        ft: FTManager,
        metrics: MetricsProcessor,
        lineage: Lineage,
        rank: RankInGroup,
        exchange: QuorumExchange,
    ) -> None:
        self.job_config = job_config
        self.loop = loop
        self.sync = sync
        self.ft = ft
        self.metrics = metrics
        self.lineage = lineage
        self.device = rank.device
        self.group_ranks = rank.ranks
        #: Seconds the sync being reported took (a delayed sync: preparing + performing steps).
        self.seconds = 0.0
        #: The averaged pseudo-gradient's norm of the sync being reported (None: not measured).
        self.pseudo_grad_norm: float | None = None
        self.exchange = exchange
        self._clock = 0.0
        self._period_start: float | None = None
        self._warned_period = False

    def new_sync(self) -> None:
        """The next sync's time and norm start from nothing."""
        self.seconds = 0.0
        self.pseudo_grad_norm = None

    def start_clock(self) -> None:
        """After an inner step, before the method's own hook: a sync (if any) starts now."""
        self._clock = time.perf_counter()

    def _pseudo_grad_norm(self, squares: torch.Tensor | None) -> float | None:
        """The averaged pseudo-gradient's norm over the group's ranks, from each rank's
        ``squares`` (None: not measured). One all-reduce in a multi-rank group, which every
        rank issues."""
        found = torch.zeros(2, dtype=torch.float64, device=self.device)
        if squares is not None:
            found[0], found[1] = squares, 1.0
        if self.group_ranks > 1:  # shards of one group: sum over its ranks
            dist.all_reduce(found)
        total, measured = found.tolist()
        return math.sqrt(total) if measured else None

    def after_inner_step(self, step: int) -> None:
        """After the method's own hook in inner step ``step``: report the sync it performed."""
        loop = self.loop
        local_step = loop.local_step()
        # A delayed Streaming DiLoCo sync started (after a sync point, inner step 0 starts none).
        prepared = loop.starts_sync_here()
        performed = local_step == 0  # torchft resets the position after a sync
        if not (prepared or performed):
            return
        if prepared:  # the all-reduce overlaps the next fragment_sync_delay steps: send it all
            self.sync.transport.flush()
        self.seconds += time.perf_counter() - self._clock
        if performed:
            self.report(step)  # inside the step's optimizer.step()
            self.new_sync()

    def took(self, seconds: float) -> None:
        """The sync being reported took ``seconds`` outside the optimizer hooks (a join at a
        sync point, the end of training)."""
        self.seconds = seconds

    def report(self, step: int) -> None:
        """The sync the method decided last, as of train step ``step``."""
        outcome = self.loop.last_outcome()
        if outcome is None:  # async DiLoCo's first sync point: it only started a sync
            return
        committed, number = outcome.committed, outcome.number
        # A follower of its site is in no quorum of the job (its leader is).
        quorum_id = tft.quorum_id(self.ft.manager) if self.ft.started else None
        if committed:  # alike in every rank of the group: each takes part in the sum
            self.pseudo_grad_norm = self._pseudo_grad_norm(outcome.pseudo_grad_squares)
        norm = self.pseudo_grad_norm if committed else None
        wait = self.sync.last_wait
        events.SYNC.emit(
            step=step,
            sync=number,
            method=self.loop.method,
            fragment=outcome.fragment,
            fragments=len(self.loop.fragments),
            committed=committed,
            seconds=self.seconds,
            bytes_sent=outcome.bytes_sent,
            groups=outcome.groups,
            quorum_id=quorum_id,
            pseudo_grad_norm=norm,
            quorum_wait_s=wait,
            agreement=self.exchange.agreement,
            uncommitted_in_a_row=self.ft.uncommitted_in_a_row,
            inner_steps=outcome.inner_steps,
            tokens=outcome.tokens,
            weight=outcome.weight,
            pseudo_grad_dtype=self.sync.transport.dtype,
            compression_s=outcome.compression_s,
        )
        scalars = {
            "sync/seconds": self.seconds,
            "sync/quorum_wait_seconds": wait,
            "sync/bytes_sent": float(outcome.bytes_sent),
            "sync/groups": float(outcome.groups),
            "sync/committed": float(committed),
            "sync/fragment": float(outcome.fragment),
        }
        if quorum_id is not None:
            scalars["sync/quorum_id"] = float(quorum_id)
        if norm is not None:
            scalars["sync/pseudo_grad_norm"] = norm
        if outcome.compression_s is not None:
            scalars["sync/compression_seconds"] = outcome.compression_s
        for name in ("inner_steps", "tokens", "weight"):
            value = getattr(outcome, name)
            if value is not None:
                scalars[f"sync/{name}"] = float(value)
        self.metrics.write_scalars(step, scalars)
        if committed:
            self.lineage.committed(number, outcome.groups)
            self.loop.note_committed()
            if self.job_config.metrics.log_param_digest:
                events.GLOBAL_DIGEST.emit(step=step, sync=number, digest=self.global_digest())
        self._check_period_length()

    def report_outer_state(self, step: int) -> None:
        """What the method held beside the model, by kind (``events.OUTER_STATE``)."""
        loop = self.loop
        held = loop.state_bytes()
        params = sum(loop.fragment_bytes(i) for i in range(len(loop.fragments)))
        mib: dict[str, Any] = {
            f"{kind}_mib": held[kind] / 2**20 if kind in held else None
            for kind in events.OUTER_STATE_KINDS
        }
        events.OUTER_STATE.emit(
            step=step,
            method=loop.method,
            params_mib=params / 2**20,
            over_params=sum(held.values()) / max(params, 1),
            **mib,
        )

    def report_final(self, step: int, ending: Ending, digest: str) -> None:
        """The final model (``digest``: of this rank's parameters) and the lineage behind it."""
        lineage = self.lineage
        shared = lineage.last_shared_sync if lineage.last_shared_sync >= 0 else None
        events.FINAL_MODEL.emit(
            step=step,
            sync=self.sync.current_step(),
            method=self.loop.method,
            closing_sync_steps=ending.closing_sync_steps,
            dropped_inner_steps=ending.dropped_inner_steps,
            last_shared_sync=shared,
            solo_syncs=lineage.solo_syncs,
            solo_since=lineage.solo_since or None,
            digest=digest,
        )
        if lineage.solo_syncs and self.job_config.fault_tolerance.group_size > 1:
            events.FINISHED_ALONE.emit(
                step=step, sync=self.sync.current_step(), last_shared_sync=shared,
                solo_syncs=lineage.solo_syncs,
            )  # fmt: skip
        if self.job_config.metrics.log_param_digest:
            events.FINAL_DIGEST.emit(step=step, digest=digest)

    def _check_period_length(self) -> None:
        """Warn once when a period comes close to the sync quorum timeout: a restarted group
        waits up to one period for the running groups' next sync."""
        now = time.monotonic()
        last, self._period_start = self._period_start, now
        timeout = semi_sync_config(self.job_config).sync_quorum_timeout_s
        period = (now - last) * len(self.loop.fragments) if last is not None else 0.0
        if last is None or self._warned_period or period < timeout / 2:
            return
        self._warned_period = True
        logger.warning(
            f"[semi-sync] a sync period takes {period:.0f}s, more than half of "
            f"fault_tolerance.sync_quorum_timeout_s={timeout:g}s: a restarted group waits up "
            "to one period for the others' next sync; raise the timeout"
        )

    def global_digest(self) -> str:
        """Digest of this rank's shards of the global parameters every group holds after a
        sync (DiLoCo's global copies, or LocalSGD's averaged model)."""
        loop = self.loop
        return tensor_digest(
            t for i in range(len(loop.fragments)) for t in loop.global_parameters(i).values()
        )
