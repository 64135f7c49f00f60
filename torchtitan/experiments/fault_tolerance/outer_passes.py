"""An async DiLoCo sync point's host work, in one or two passes over a fragment.

With the outer state in host memory (``outer_state_device=cpu``, the default) a sync point is
host work the accelerator waits for: the outer step on the global copy, the local copy
following it, the next pseudo-gradient, the start of the next period, and a digest of the new
global copy. Written as whole-fragment tensor operations on one thread (torchrun's
``OMP_NUM_THREADS=1``), each one reads and writes the fragment's arrays from memory again,
with temporaries of the fragment's size: 65 memcpy equivalents per sync point
(``benchmarks/outer_step.py``), 15-30 s on the shard of an 8B model over 8 ranks.

:class:`SyncPointPasses` visits each parameter in pieces of :data:`PIECE` values instead: all of
a sync point's operations on a piece run while it is in the CPU's cache, into scratch buffers
of a piece's size, and the pieces are shared out over the host cores this rank may use
(:func:`cores_per_rank`). The outer step is ``torch.optim.SGD(fused=True)``'s own kernel,
called on each piece (the outer optimizer is built fused on the host, so a replayed or
fallback step gives the same bits), dividing by the tokens as it reads the sums; the eager
start is that same step on copies, so it lands exactly where the outer step would. Every other
value goes through the tensor operations of ``FragmentState``'s whole-fragment methods (kept
for other outer optimizers and outer state on the accelerator), so the results are the same
bits; only the order in which values are visited changes. The global copy's digest is taken
in the pass. With the model on an accelerator, what crosses between it and the host goes
through one pinned staging buffer of the fragment's exact size, copied once each way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from torchtitan.experiments.fault_tolerance.outer_loop import local_tensor
from torchtitan.tools.digest import PieceHashes, chunk_hashes
from torchtitan.tools.pinned import host_tensor

#: Values per piece: 1 MiB of fp32 per array, so that the half-dozen arrays and scratch buffers
#: a piece touches stay in a core's cache; a divisor of the digest's chunk (2^20).
PIECE = 1 << 18


def wait_for_copies(device: torch.device) -> None:
    """Wait until the copies queued on ``device``'s current stream are done. Copies between the
    model (on CUDA) and the outer state (pinned host memory) are issued ``non_blocking``, a
    whole fragment at a time; the host waits once, before it reads what came from the device
    or overwrites what goes to it. Nothing to wait for on the CPU, where copies are done when
    they return."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def cores_per_rank() -> int:
    """The host cores this rank may use for a sync point's host work: those it may run on (its
    affinity: a container's or a launcher's cpuset), shared with the other ranks of its host
    (torchrun's ``LOCAL_WORLD_SIZE``), at least one."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    available = available or os.cpu_count() or 1
    return max(1, available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@contextlib.contextmanager
def one_thread_per_op() -> Iterator[None]:
    """torch's intra-op threads set to one meanwhile: a pass runs its pieces on threads of its
    own (:class:`_Workers`), each op on one core. (Splitting each op of a piece over the cores
    instead pays a fork and join per op, on a piece too small to hide it.)"""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


class _Scratch(NamedTuple):
    """Buffers of a piece's size, reused by every piece."""

    grad: torch.Tensor
    t1: torch.Tensor
    t2: torch.Tensor
    products: torch.Tensor  # int64: the digest's


class _Worker:
    """One thread's share of a pass: its scratch buffers and the hashes of the pieces it took
    (chunk sums, added up over the workers at the end: a sum modulo 2^64 in any order)."""

    def __init__(self) -> None:
        self._scratch = _Scratch(
            grad=torch.empty(PIECE, dtype=torch.float32),
            t1=torch.empty(PIECE, dtype=torch.float32),
            t2=torch.empty(PIECE, dtype=torch.float32),
            products=torch.empty(PIECE, dtype=torch.int64),
        )
        self.hashes: dict[str, PieceHashes] = {}

    def scratch(self, numel: int) -> _Scratch:
        """The scratch buffers, cut to ``numel`` values."""
        if numel == PIECE:
            return self._scratch
        return _Scratch(*(t[:numel] for t in self._scratch))


@functools.cache
def _workers(count: int) -> _Workers:
    """The process's workers, shared by its passes (one at a time: :meth:`_Workers.run`)."""
    return _Workers(count)


class _Workers:
    """The threads a pass runs its pieces on: the caller's and ``count - 1`` more, each taking
    every ``count``-th piece (torch's ops release the GIL while they run)."""

    def __init__(self, count: int) -> None:
        self.workers = [_Worker() for _ in range(count)]
        #: One pass at a time (a job's run on its training thread; tests run several groups
        #: in one process).
        self._lock = threading.Lock()
        self._pool = (
            ThreadPoolExecutor(count - 1, thread_name_prefix="sync-point-pass")
            if count > 1
            else None
        )

    def run(
        self,
        pieces: list[_Piece],
        body: Callable[[_Piece, _Worker], None],
        hashed: dict[str, int] | None = None,
    ) -> _Found:
        """``body(piece, worker)`` for every piece; with ``hashed`` (each parameter's numel),
        the chunk hashes the bodies took, by parameter."""
        with self._lock:
            return self._run(pieces, body, hashed)

    def _run(
        self,
        pieces: list[_Piece],
        body: Callable[[_Piece, _Worker], None],
        hashed: dict[str, int] | None,
    ) -> _Found:
        for worker in self.workers:
            worker.hashes = {
                name: PieceHashes(n, 4, torch.device("cpu")) for name, n in (hashed or {}).items()
            }
        count = len(self.workers)

        def share(k: int) -> None:
            for piece in pieces[k::count]:
                body(piece, self.workers[k])

        futures = [] if self._pool is None else [
            self._pool.submit(share, k) for k in range(1, count)
        ]  # fmt: skip
        try:
            share(0)
        finally:
            for future in futures:
                future.result()  # raises what the worker raised
        return _Found({name: self._added(name) for name in hashed or {}})

    def _added(self, name: str) -> list[int]:
        """``name``'s chunk hashes: each chunk's sums from every worker, modulo 2^64."""
        found = [w.hashes[name].hashes for w in self.workers]
        return [sum(chunk) % (1 << 64) for chunk in zip(*found, strict=True)]


@dataclass(frozen=True)
class PlainSGD:
    """The settings of an outer ``torch.optim.SGD(fused=True)``, whose kernel the passes call
    on each piece (:meth:`step`)."""

    lr: float
    momentum: float
    dampening: float
    nesterov: bool

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> PlainSGD | None:
        """``optimizer``'s settings if it is torch's SGD as the outer loop builds it (one group,
        no weight decay, not maximizing, a float learning rate); None otherwise."""
        if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        if (
            not group.get("fused")  # its step is the kernel the passes call on each piece
            or group["weight_decay"] != 0
            or group["maximize"]
            or isinstance(group["lr"], torch.Tensor)
        ):
            return None
        return cls(float(group["lr"]), group["momentum"], group["dampening"], group["nesterov"])

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        buf: torch.Tensor | None,
        first: bool,
        divide_by: torch.Tensor | None = None,
    ) -> None:
        """The optimizer's fused step on a piece of one parameter (``buf``: its momentum's
        piece; ``first``: the optimizer's first step, which takes the gradient as momentum):
        the kernel ``torch.optim.SGD(fused=True).step`` runs on the whole parameter, so the
        same bits. ``divide_by``: the gradient is ``grad / divide_by``, an exact division
        (``exact_division.divide_``'s bits) that the kernel also writes back into ``grad``."""
        torch._fused_sgd_(
            [param], [grad], [] if buf is None else [buf],
            weight_decay=0.0, momentum=self.momentum, lr=self.lr, dampening=self.dampening,
            nesterov=self.nesterov, maximize=False, is_first_step=first,
            grad_scale=divide_by, found_inf=None,
        )  # fmt: skip


class SyncPointPasses:
    """The passes over one fragment's outer state (``async_state.FragmentState``'s tensors):
    :meth:`finish` (the outer step and the local copy following the global copy),
    :meth:`start` (the pseudo-gradient and the start of the next period) or both at once
    (:meth:`finish_and_start`, one pass when the model is on the host too). The new global
    copy's digest is taken in :meth:`finish`'s pass and kept while the copy is unchanged
    (:meth:`global_chunk_hashes`)."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        global_copy: dict[str, torch.Tensor],
        period_start: dict[str, torch.Tensor],
        outer: torch.optim.Optimizer,
        model_device: torch.device,
        threads: int = 0,
    ) -> None:
        """``threads``: for the passes (0: :func:`cores_per_rank`)."""
        self.params = params
        self.threads = threads
        self.global_copy = global_copy
        self.period_start = period_start
        self.outer = outer
        self.model_device = model_device
        self.numel = {name: t.numel() for name, t in global_copy.items()}
        #: Model on an accelerator: the pinned host buffer its values cross through.
        self._staging: torch.Tensor | None = None
        #: The global copy's chunk hashes, with the versions of its tensors they were taken at.
        self._hashes: tuple[tuple[int, ...], list[int]] | None = None

    def usable(self) -> bool:
        """Whether the passes apply: the outer state on the host, stepped by plain SGD, its
        tensors (momentum included) fp32 and every tensor contiguous (flat views of them are
        written)."""
        state = [*self.global_copy.values(), *self.period_start.values()]
        state += [buf for buf in self._momentum_buffers() if buf is not None]
        local = [local_tensor(p.data) for p in self.params.values()]
        return (
            PlainSGD.of(self.outer) is not None
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state)
            and all(t.is_contiguous() for t in [*state, *local])
        )

    def _momentum_buffers(self) -> list[torch.Tensor | None]:
        return [
            self.outer.state.get(glob, {}).get("momentum_buffer")
            for glob in self.global_copy.values()
        ]

    @property
    def on_host(self) -> bool:
        return self.model_device.type == "cpu"

    # ---- the passes ----------------------------------------------------------------------------

    def finish(self, average: torch.Tensor | None, divisor: float) -> None:
        """The outer step with ``average / divisor`` (flat, the fragment's size, on any device;
        None: no step), then the local copy follows the global copy."""
        step = self._outer_step(average, divisor)
        on_host = self.on_host
        # FragmentState.follow_global: local += global - start (on the host; else that shift
        # goes to the device through the staging buffer), start = global.
        pieces = self._cut(
            local=self._local() if on_host else None,
            out=None if on_host else self._views(self._staging_buffer()),
            source=step.source if step is not None else None,
        )

        def body(piece: _Piece, worker: _Worker) -> None:
            scratch = worker.scratch(piece.glob.numel())
            self._step_piece(piece, step)
            if piece.local is not None:
                piece.local.add_(torch.sub(piece.glob, piece.start, out=scratch.t1))
            else:
                torch.sub(piece.glob, piece.start, out=piece.out)
            piece.start.copy_(piece.glob)
            worker.hashes[piece.name].add(piece.a, piece.glob, scratch.products)

        self._keep_hashes(self._run(pieces, body, hashed=True).hashes)
        if not on_host:
            local, staged = self._local(), self._views(self._staging_buffer())
            for name in self.params:
                local[name].add_(staged[name].to(self.model_device, non_blocking=True))
            wait_for_copies(self.model_device)  # the host rewrites the staging next

    def start(self, out: torch.Tensor, share: float | None, tokens: float) -> None:
        """``out`` (flat, on the model's device) = start - model, this group's pseudo-gradient;
        the next period starts at the global copy, moved by the outer step ``share x out``
        would make (``share`` None: not moved); then ``out`` is scaled by ``tokens`` (the
        weight it is sent with)."""
        sgd = PlainSGD.of(self.outer)
        if self.on_host:

            def body(piece: _Piece, worker: _Worker) -> None:
                local = piece.local
                assert local is not None
                torch.sub(piece.start, local, out=piece.out)  # pseudo_gradient
                self._start_piece(piece, piece.out, sgd, share, tokens, worker)
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

        def host_body(piece: _Piece, worker: _Worker) -> None:
            self._start_piece(piece, piece.out, sgd, share, 1.0, worker)

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
        """:meth:`finish` then :meth:`start` of this fragment: one pass when the model is on
        the host (each piece is finished and started while in cache; what the second writes
        anyway is not written by the first), two otherwise. ``out`` may be ``average``'s
        buffer: a piece's average is read before its pseudo-gradient is written."""
        local_fp32 = all(t.dtype == torch.float32 for t in self._local().values())
        if not self.on_host or not local_fp32:  # the local copy is rounded to its dtype between
            self.finish(average, divisor)
            self.start(out, share, tokens)
            return
        step = self._outer_step(average, divisor)
        sgd = PlainSGD.of(self.outer)
        pieces = self._cut(
            local=self._local(),
            out=self._views(out),
            source=step.source if step is not None else None,
        )

        def body(piece: _Piece, worker: _Worker) -> None:
            scratch = worker.scratch(piece.glob.numel())
            glob, local = piece.glob, piece.local
            assert local is not None
            self._step_piece(piece, step)
            # follow_global's local (+= global - start), kept in scratch: start and the model's
            # piece are written once, below; its start (= global) is read as global.
            followed = torch.add(local, torch.sub(glob, piece.start, out=scratch.t1),
                                 out=scratch.t1)  # fmt: skip
            worker.hashes[piece.name].add(piece.a, glob, scratch.products)
            torch.sub(glob, followed, out=piece.out)  # pseudo_gradient
            self._start_piece(piece, piece.out, sgd, share, tokens, worker)
            local.copy_(piece.start)

        self._keep_hashes(self._run(pieces, body, hashed=True).hashes)

    def _run(
        self,
        pieces: list[_Piece],
        body: Callable[[_Piece, _Worker], None],
        hashed: bool = False,
    ) -> _Found:
        """``body`` on every piece, on :attr:`threads` threads; ``hashed``: the chunk hashes of
        the global copy the bodies took (meanwhile the digest kept is void: a pass that fails
        half-way leaves none)."""
        if hashed:
            self._hashes = None
        with one_thread_per_op():
            workers = _workers(self.threads or cores_per_rank())
            found = workers.run(pieces, body, self.numel if hashed else None)
        return found

    # ---- one piece -----------------------------------------------------------------------------

    def _outer_step(self, average: torch.Tensor | None, divisor: float) -> _OuterStep | None:
        """What the pieces of an outer step with ``average / divisor`` need (None: no step).
        At the optimizer's first step every parameter gets its momentum buffer, which the
        kernel fills with the gradient, as ``torch.optim.SGD(fused=True)`` does."""
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
    def _step_piece(piece: _Piece, step: _OuterStep | None) -> None:
        """The outer step on the piece's global copy: the gradient is ``piece.source /
        step.divide_by`` (an exact division, as ``divide_``; written back into the source)."""
        if step is not None:
            assert piece.source is not None
            step.sgd.step(piece.glob, piece.source, piece.momentum, step.first, step.divide_by)

    @staticmethod
    def _start_piece(
        piece: _Piece,
        pseudo: torch.Tensor | None,
        sgd: PlainSGD | None,
        share: float | None,
        tokens: float,
        worker: _Worker,
    ) -> None:
        """``FragmentState.start_period`` on the piece: start = global, moved by the outer
        optimizer's step for ``share x pseudo`` on a copy of its momentum (``share`` None: not
        moved); then ``pseudo`` scaled by ``tokens``."""
        piece.start.copy_(piece.glob)
        if share is not None:
            assert pseudo is not None and sgd is not None
            scratch = worker.scratch(piece.glob.numel())
            grad = pseudo if share == 1.0 else torch.mul(pseudo, share, out=scratch.grad)
            momentum = None
            if sgd.momentum != 0:  # none yet: the step takes the gradient as its momentum
                momentum = scratch.t1
                if piece.momentum is not None:
                    momentum.copy_(piece.momentum)
            sgd.step(piece.start, grad, momentum, first=piece.momentum is None)
        if tokens != 1.0:
            assert pseudo is not None
            pseudo.mul_(tokens)

    # ---- what the passes work on ---------------------------------------------------------------

    def _cut(
        self,
        local: dict[str, torch.Tensor] | None = None,
        out: dict[str, torch.Tensor] | None = None,
        source: dict[str, torch.Tensor] | None = None,
    ) -> list[_Piece]:
        """The pieces of every parameter: views of its global copy, local start, momentum (if
        any) and of the flat tensors given by parameter, ``PIECE`` values each (one ``split``
        per tensor: slicing each piece in Python costs more than a small piece's ops)."""
        pieces = []
        for name, numel in self.numel.items():
            if numel == 0:  # e.g. a rank's empty FSDP shard of a small parameter
                continue
            glob = self.global_copy[name]
            buf = self.outer.state.get(glob, {}).get("momentum_buffer")
            columns = [
                glob.view(-1).split(PIECE),
                self.period_start[name].view(-1).split(PIECE),
                *(
                    (None,) * -(-numel // PIECE) if c is None else c.view(-1).split(PIECE)
                    for c in (
                        None if local is None else local[name],
                        None if out is None else out[name],
                        None if source is None else source[name],
                        buf,
                    )
                ),
            ]
            pieces += [
                _Piece(name, k * PIECE, *parts)
                for k, parts in enumerate(zip(*columns, strict=True))
            ]
        return pieces

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
        """``flat``'s values in host memory, by parameter: a host tensor as it is, an
        accelerator's copied into the staging buffer (waited for once)."""
        if flat.device.type == "cpu":
            return self._views(flat)
        staging = self._views(self._staging_buffer())
        for name, view in self._views(flat).items():
            staging[name].copy_(view, non_blocking=True)
        wait_for_copies(flat.device)
        return staging

    def staging_bytes(self) -> int:
        """Bytes of the pinned staging buffer (0: none allocated)."""
        return 0 if self._staging is None else self._staging.nbytes

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = host_tensor((sum(self.numel.values()),), pinned=True)
        return self._staging

    # ---- the global copy's digest --------------------------------------------------------------

    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in self.global_copy.values())

    def _keep_hashes(self, hashes: dict[str, list[int]]) -> None:
        """Keep the hashes a pass took, keyed by the copy's versions, moved first: the fused
        kernel writes without moving them (``Fragment.outer_step`` moves them after its step)."""
        for t in self.global_copy.values():
            torch.autograd.graph.increment_version(t)
        self._hashes = (self._versions(), [h for name in self.numel for h in hashes[name]])

    def global_chunk_hashes(self) -> list[int]:
        """The chunk hashes of the global copy (``tools.digest``), in parameter order: those
        the last pass took while nothing wrote the copy since (every in-place write, a heal's
        or a checkpoint's load included, moves a tensor's version), else taken now."""
        if self._hashes is None or self._hashes[0] != self._versions():
            found = [h for t in self.global_copy.values() for h in chunk_hashes(t)]
            self._hashes = (self._versions(), found)
        return list(self._hashes[1])


class _Found(NamedTuple):
    """What a pass's workers took: the global copy's chunk hashes by parameter (none unless
    asked)."""

    hashes: dict[str, list[int]]


class _Piece(NamedTuple):
    """``PIECE`` values (fewer at a parameter's end) of one parameter, from element ``a``: its
    global copy, local start, and what the pass also needs there (None: not in this pass)."""

    name: str
    a: int
    glob: torch.Tensor
    start: torch.Tensor
    local: torch.Tensor | None
    out: torch.Tensor | None
    source: torch.Tensor | None
    momentum: torch.Tensor | None


class _OuterStep(NamedTuple):
    """An outer step's gradient (``source / divide_by``, in host memory), the optimizer's
    settings, and whether it is its first step."""

    sgd: PlainSGD
    source: dict[str, torch.Tensor]
    divide_by: torch.Tensor | None
    first: bool
