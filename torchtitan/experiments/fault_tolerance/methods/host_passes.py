"""An async DiLoCo sync point's host work, in one or two passes over a fragment.

With the outer state in host memory (``outer_state_device=cpu``, the default) a sync point is
host work the accelerator waits for: the outer step, the local copy following the global copy,
the next pseudo-gradient, the start of the next period and the new global copy's digest. As
whole-fragment tensor operations on one thread that is 65 memcpy equivalents
(``benchmarks/outer_step.py``), 15-30 s on an 8B model's shard over 8 ranks.

:class:`SyncPointPasses` instead visits each parameter in pieces (``piece_workers``), all of a
sync point's operations on a piece while it is in cache, shared out over the rank's host cores.
The outer step is ``OuterSGD``'s own on each piece (``outer_optimizer.sgd_step_``), and every
other value goes through the operations of ``AsyncOuterState``'s whole-fragment methods, all
element-wise, so the results are the same bits; only the order of visits changes. With the
model on an accelerator, values cross through one pinned staging buffer of the fragment's
size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from torchtitan.distributed.tensors import local_tensor
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import OuterSGD, sgd_step_
from torchtitan.experiments.fault_tolerance.methods.piece_workers import (
    Piece,
    Worker,
    cut,
    run_pieces,
)
from torchtitan.tools.digest import chunk_hashes
from torchtitan.tools.pinned import host_tensor


def wait_for_copies(device: torch.device) -> None:
    """Wait for the copies queued ``non_blocking`` on ``device``'s current stream (nothing to
    wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class PlainSGD:
    """The settings of an outer :class:`~.outer_optimizer.OuterSGD`, whose step the passes take
    on each piece (``sgd_step_``, element-wise: the bits of its ``step`` on the whole
    parameter)."""

    lr: float
    momentum: float
    nesterov: bool

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> PlainSGD | None:
        """``optimizer``'s settings if it is ``OuterSGD`` with one group and a float learning
        rate; None otherwise."""
        if type(optimizer) is not OuterSGD or len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        if isinstance(group["lr"], torch.Tensor):
            return None
        return cls(float(group["lr"]), group["momentum"], group["nesterov"])

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        buf: torch.Tensor | None,
        first: bool,
        scratch: torch.Tensor,
        divide_by: torch.Tensor | None = None,
    ) -> None:
        """The outer step on a piece (``buf``: its momentum; ``first``: the optimizer's first
        step, which takes the gradient as momentum; ``scratch``: the piece's temporary).
        ``divide_by``: the gradient is ``grad / divide_by``, an exact division
        (``exact_division.divide_``'s bits), also written back into ``grad``."""
        if divide_by is not None:  # not div_: by a 0-dim tensor it takes 2.5x as long
            torch.div(grad, divide_by, out=grad)
        sgd_step_(
            param, grad, buf, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
            first=first, scratch=scratch,
        )  # fmt: skip

    def start_period(
        self,
        piece: Piece,
        pseudo: torch.Tensor | None,
        share: float | None,
        tokens: float,
        worker: Worker,
    ) -> None:
        """``AsyncOuterState.start_period`` on the piece: start = global, moved by this step for
        ``share x pseudo`` on a copy of the momentum (``share`` None: not moved); then
        ``pseudo`` scaled by ``tokens``."""
        if share is None:
            piece.start.copy_(piece.glob)
        else:
            assert pseudo is not None
            scratch = worker.scratch(piece.glob.numel())
            grad = pseudo if share == 1.0 else torch.mul(pseudo, share, out=scratch.grad)
            # The step written into start, its momentum into scratch: the optimizer's stay.
            sgd_step_(
                piece.glob, grad, piece.momentum, lr=self.lr, momentum=self.momentum,
                nesterov=self.nesterov, first=piece.momentum is None, scratch=scratch.step,
                out=piece.start, momentum_out=scratch.t1,
            )  # fmt: skip
        if tokens != 1.0:
            assert pseudo is not None
            pseudo.mul_(tokens)


class SyncPointPasses:
    """The passes over one fragment's outer state (``AsyncOuterState``'s tensors):
    :meth:`finish` (the outer step, then the local copy follows the global copy), :meth:`start`
    (the pseudo-gradient and the next period's start) or both (:meth:`finish_and_start`). The
    new global copy's digest is taken in the pass and kept while the copy is unchanged."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        global_copy: dict[str, torch.Tensor],
        period_start: dict[str, torch.Tensor],
        outer: torch.optim.Optimizer,
        model_device: torch.device,
        threads: int = 0,
    ) -> None:
        """``threads``: for the passes (0: ``piece_workers.cores_per_rank``)."""
        self.params = params
        self.threads = threads
        self.global_copy = global_copy
        self.period_start = period_start
        self.outer = outer
        self.model_device = model_device
        self.on_host = model_device.type == "cpu"
        self.numel = {name: t.numel() for name, t in global_copy.items()}
        #: Model on an accelerator: the pinned host buffer its values cross through.
        self._staging: torch.Tensor | None = None
        #: The global copy's chunk hashes, with the versions of its tensors they were taken at.
        self._hashes: tuple[tuple[int, ...], list[int]] | None = None

    def usable(self) -> bool:
        """Whether the passes apply: plain SGD (:class:`PlainSGD`), the outer state (momentum
        included) fp32 on the host, and every tensor contiguous (flat views are written)."""
        momentum = [self._momentum(glob) for glob in self.global_copy.values()]
        state = [*self.global_copy.values(), *self.period_start.values()]
        state += [buf for buf in momentum if buf is not None]
        local = [local_tensor(p.data) for p in self.params.values()]
        return (
            PlainSGD.of(self.outer) is not None
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state)
            and all(t.is_contiguous() for t in [*state, *local])
        )

    def _momentum(self, glob: torch.Tensor) -> torch.Tensor | None:
        return self.outer.state.get(glob, {}).get("momentum_buffer")

    # ---- the passes ----------------------------------------------------------------------------

    def finish(self, average: torch.Tensor | None, divisor: float) -> None:
        """The outer step with ``average / divisor`` (flat, on any device; None: no step), then
        the local copy follows the global copy (``AsyncOuterState.follow_global``)."""
        step = self._outer_step(average, divisor)
        on_host = self.on_host
        pieces = self._cut(
            local=self._local() if on_host else None,
            out=None if on_host else self._views(self._staging_buffer()),  # the shifts
            source=step.source if step is not None else None,
        )

        def body(piece: Piece, worker: Worker) -> None:
            scratch = worker.scratch(piece.glob.numel())
            self._step_piece(piece, step, worker)
            if piece.local is not None:
                piece.local.add_(torch.sub(piece.glob, piece.start, out=scratch.t1))
            else:
                torch.sub(piece.glob, piece.start, out=piece.out)
            piece.start.copy_(piece.glob)
            worker.hashes[piece.name].add(piece.a, piece.glob, scratch.products)

        self._keep_hashes(self._run(pieces, body, hashed=True))
        if not on_host:
            local, staged = self._local(), self._views(self._staging_buffer())
            for name in self.params:
                local[name].add_(staged[name].to(self.model_device, non_blocking=True))
            wait_for_copies(self.model_device)  # the host rewrites the staging next

    def start(self, out: torch.Tensor, share: float | None, tokens: float) -> None:
        """``out`` (flat, on the model's device) = start - model, the pseudo-gradient; the next
        period starts at the global copy moved by the outer step ``share x out`` would make
        (``share`` None: not moved); then ``out`` is scaled by ``tokens``."""
        sgd = PlainSGD.of(self.outer)
        assert sgd is not None  # usable() was checked
        if self.on_host:

            def body(piece: Piece, worker: Worker) -> None:
                local = piece.local
                assert local is not None
                torch.sub(piece.start, local, out=piece.out)  # pseudo_gradient
                sgd.start_period(piece, piece.out, share, tokens, worker)
                local.copy_(piece.start)

            self._run(self._cut(local=self._local(), out=self._views(out)), body)
            return
        local, views = self._local(), self._views(out)
        for name in self.params:  # the pseudo-gradient, on the device
            views[name].copy_(self.period_start[name].view(-1), non_blocking=True)
            views[name].sub_(local[name])
        if share is None:
            wait_for_copies(self.model_device)  # the host rewrites ``start`` next
            staged = None
        else:
            staged = self._to_host(out)

        def host_body(piece: Piece, worker: Worker) -> None:
            sgd.start_period(piece, piece.out, share, 1.0, worker)

        self._run(self._cut(out=staged), host_body)
        for name in self.params:
            local[name].copy_(self.period_start[name].view(-1), non_blocking=True)
        out.mul_(tokens)
        wait_for_copies(self.model_device)  # ``start`` is rewritten at the next sync point

    def finish_and_start(
        self,
        average: torch.Tensor | None,
        divisor: float,
        out: torch.Tensor,
        share: float | None,
        tokens: float,
    ) -> None:
        """:meth:`finish` then :meth:`start`: one pass, each piece finished and started while
        in cache, when the model is fp32 on the host; two otherwise. ``out`` may be
        ``average``'s buffer: a piece's average is read before its pseudo-gradient is written."""
        local_fp32 = all(t.dtype == torch.float32 for t in self._local().values())
        if not self.on_host or not local_fp32:  # the local copy is rounded to its dtype between
            self.finish(average, divisor)
            self.start(out, share, tokens)
            return
        step = self._outer_step(average, divisor)
        sgd = PlainSGD.of(self.outer)
        assert sgd is not None  # usable() was checked
        pieces = self._cut(
            local=self._local(),
            out=self._views(out),
            source=step.source if step is not None else None,
        )

        def body(piece: Piece, worker: Worker) -> None:
            scratch = worker.scratch(piece.glob.numel())
            glob, local = piece.glob, piece.local
            assert local is not None
            self._step_piece(piece, step, worker)
            # follow_global's local, kept in scratch: start and the model are written once,
            # below; its start (= global) is read as global.
            followed = torch.add(local, torch.sub(glob, piece.start, out=scratch.t1),
                                 out=scratch.t1)  # fmt: skip
            worker.hashes[piece.name].add(piece.a, glob, scratch.products)
            torch.sub(glob, followed, out=piece.out)  # pseudo_gradient
            sgd.start_period(piece, piece.out, share, tokens, worker)
            local.copy_(piece.start)

        self._keep_hashes(self._run(pieces, body, hashed=True))

    def _run(
        self, pieces: list[Piece], body: Callable[[Piece, Worker], None], hashed: bool = False
    ) -> dict[str, list[int]]:
        """``body`` on every piece; ``hashed``: the global copy's chunk hashes the bodies took
        (the digest kept is void meanwhile: a pass that fails half-way leaves none)."""
        if hashed:
            self._hashes = None
        return run_pieces(pieces, body, self.threads, self.numel if hashed else None)

    # ---- one piece -----------------------------------------------------------------------------

    def _outer_step(self, average: torch.Tensor | None, divisor: float) -> _OuterStep | None:
        """What the pieces of an outer step with ``average / divisor`` need (None: no step). At
        the first step every parameter gets a momentum buffer, as ``OuterSGD`` does."""
        if average is None:
            return None
        sgd = PlainSGD.of(self.outer)
        assert sgd is not None  # usable() was checked
        first = False
        if sgd.momentum != 0:
            states = [self.outer.state[glob] for glob in self.global_copy.values()]
            first = all(state.get("momentum_buffer") is None for state in states)
            if first:
                for state, glob in zip(states, self.global_copy.values(), strict=True):
                    state["momentum_buffer"] = torch.empty_like(glob)
        source = self._to_host(average)
        divide_by = None if divisor == 1 else torch.full((), divisor, dtype=torch.float32)
        return _OuterStep(sgd, source, divide_by, first)

    @staticmethod
    def _step_piece(piece: Piece, step: _OuterStep | None, worker: Worker) -> None:
        if step is not None:
            assert piece.source is not None
            scratch = worker.scratch(piece.glob.numel()).step
            step.sgd.step(
                piece.glob, piece.source, piece.momentum, step.first, scratch, step.divide_by
            )

    # ---- what the passes work on ---------------------------------------------------------------

    def _cut(
        self,
        local: dict[str, torch.Tensor] | None = None,
        out: dict[str, torch.Tensor] | None = None,
        source: dict[str, torch.Tensor] | None = None,
    ) -> list[Piece]:
        momentum = {name: self._momentum(glob) for name, glob in self.global_copy.items()}
        return cut(self.numel, [self.global_copy, self.period_start, local, out, source, momentum])

    def _local(self) -> dict[str, torch.Tensor]:
        """Each parameter's local values (its shard), flat, where the model lives."""
        return {name: local_tensor(p.data).view(-1) for name, p in self.params.items()}

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat``, the fragment's size, cut into each parameter's values."""
        views, offset = {}, 0
        for name, numel in self.numel.items():
            views[name] = flat[offset : offset + numel]
            offset += numel
        return views

    def _to_host(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat``'s values in host memory by parameter (an accelerator's via the staging)."""
        if flat.device.type == "cpu":
            return self._views(flat)
        staging = self._views(self._staging_buffer())
        for name, view in self._views(flat).items():
            staging[name].copy_(view, non_blocking=True)
        wait_for_copies(flat.device)
        return staging

    def staging_bytes(self) -> int:
        return 0 if self._staging is None else self._staging.nbytes

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = host_tensor((sum(self.numel.values()),), pinned=True)
        return self._staging

    # ---- the global copy's digest --------------------------------------------------------------

    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in self.global_copy.values())

    def _keep_hashes(self, hashes: dict[str, list[int]]) -> None:
        """Keep a pass's hashes, keyed by the copy's versions, moved first (a pass writes
        through views of pieces; its versions are moved once, here)."""
        for t in self.global_copy.values():
            torch.autograd.graph.increment_version(t)
        self._hashes = (self._versions(), [h for name in self.numel for h in hashes[name]])

    def global_chunk_hashes(self) -> list[int]:
        """The global copy's chunk hashes (``tools.digest``) in parameter order: the last
        pass's unless a write since moved a tensor's version (a heal's, a checkpoint's load)."""
        if self._hashes is None or self._hashes[0] != self._versions():
            found = [h for t in self.global_copy.values() for h in chunk_hashes(t)]
            self._hashes = (self._versions(), found)
        return list(self._hashes[1])


class _OuterStep(NamedTuple):
    """An outer step's gradient (``source / divide_by``, in host memory), the optimizer's
    settings, and whether it is its first step."""

    sgd: PlainSGD
    source: dict[str, torch.Tensor]
    divide_by: torch.Tensor | None
    first: bool
