"""The outer step and async DiLoCo's sync point, as passes over a fragment's outer state in
pieces (``piece_workers``): the one implementation of both, in training and in replay.

Every method's outer step is a pass (:meth:`OuterPasses.step`). With the outer state in host
memory (async DiLoCo's ``outer_state_device=cpu``, the default) a sync point is host work the
accelerator waits for: the outer step, the local copy following the global copy, the next
pseudo-gradient, the start of the next period and the new global copy's digest. As
whole-fragment tensor operations on one thread that is 65 memcpy equivalents
(``benchmarks/outer_step.py``), 15-30 s on an 8B model's shard over 8 ranks. The passes instead
do all of a sync point's operations on a piece while it is in cache, shared out over the rank's
host cores; with the model on an accelerator, values cross through one pinned staging buffer of
the fragment's size. With the state on the accelerator, the pieces are queued there.

The outer step on a piece is the outer optimizer's own arithmetic (``outer_optimizer``:
``sgd_step_``, ``delayed_nesterov_step_``), and every operation is element-wise, so a pass has
the bits of the optimizer's ``step`` on the whole tensors (``tests/unit_tests/outer_reference.py``
holds the whole-fragment forms the tests compare with); only the order of visits changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from torchtitan.distributed.tensors import local_tensor
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import (
    DelayedNesterov,
    DelayedNesterovBuffers,
    OuterSGD,
    delayed_nesterov_buffers,
    delayed_nesterov_estimate,
    delayed_nesterov_step_,
    sgd_step_,
)
from torchtitan.experiments.fault_tolerance.methods.piece_workers import (
    Piece,
    PieceBuffers,
    Worker,
    cut,
    piece_values,
    run_pieces,
)
from torchtitan.tools.digest import chunk_hashes
from torchtitan.tools.exact_division import divisor_like
from torchtitan.tools.pinned import host_tensor

Tensors = dict[str, torch.Tensor]


def wait_for_copies(device: torch.device) -> None:
    """Wait for the copies queued ``non_blocking`` on ``device``'s current stream (nothing to
    wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PieceRule(Protocol):
    """One outer step of a fragment's outer optimizer, its state made ready for every parameter,
    taken piece by piece; and where the step after it would take a piece (async DiLoCo's eager
    start), the state unchanged."""

    def columns(self) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
        """The momentum and the window's sums by parameter (None: the rule reads none)."""
        ...

    def step(self, piece: Piece, grad: torch.Tensor, scratch: PieceBuffers) -> None:
        """The outer step on ``piece.glob`` for ``grad``, the piece's state updated."""
        ...

    def estimate(self, piece: Piece, grad: torch.Tensor, scratch: PieceBuffers) -> None:
        """Into ``piece.start``: ``piece.glob`` moved by the next step for ``grad`` (after this
        rule's, if it steps); nothing of the optimizer's changes."""
        ...

    def close(self) -> None:
        """The pass is over: the buffers its step wrote first go into the optimizer's state,
        and Delayed Nesterov counts its step (a pass that fails before changes none)."""
        ...


def _one_group(outer: torch.optim.Optimizer) -> dict:
    if len(outer.param_groups) != 1 or isinstance(outer.param_groups[0]["lr"], torch.Tensor):
        raise ValueError(
            f"an outer optimizer needs one parameter group with a float lr, got "
            f"{len(outer.param_groups)} group(s)"
        )
    return outer.param_groups[0]


class _SGDRule:
    """:class:`~.outer_optimizer.OuterSGD`'s step (``sgd_step_``); stepping, a parameter's first
    step with momentum allocates its buffer, which the step fills with the gradient."""

    def __init__(self, outer: OuterSGD, global_copy: Tensors, stepping: bool) -> None:
        group = _one_group(outer)
        outer._check_group(group)
        self.outer, self.global_copy = outer, global_copy
        self.lr, self.momentum = float(group["lr"]), group["momentum"]
        self.nesterov, self.stepping = group["nesterov"], stepping
        self.first: set[str] = set()
        self.buffers: dict[str, torch.Tensor | None] = {}
        for name, glob in global_copy.items():
            buffer = outer.state.get(glob, {}).get("momentum_buffer")
            if self.momentum != 0 and buffer is None:
                self.first.add(name)
                if stepping:
                    buffer = torch.empty_like(glob)
            self.buffers[name] = buffer

    def columns(self) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
        return self.buffers, dict.fromkeys(self.buffers)

    def step(self, piece: Piece, grad: torch.Tensor, scratch: PieceBuffers) -> None:
        sgd_step_(
            piece.glob, grad, piece.momentum, lr=self.lr, momentum=self.momentum,
            nesterov=self.nesterov, first=piece.name in self.first, scratch=scratch.step,
        )  # fmt: skip

    def estimate(self, piece: Piece, grad: torch.Tensor, scratch: PieceBuffers) -> None:
        # The step written into start, its momentum into scratch: the optimizer's stay.
        sgd_step_(
            piece.glob, grad, piece.momentum, lr=self.lr, momentum=self.momentum,
            nesterov=self.nesterov, first=piece.name in self.first and not self.stepping,
            scratch=scratch.step, out=piece.start, momentum_out=scratch.t1,
        )  # fmt: skip

    def close(self) -> None:
        if self.stepping:
            for name in self.first:
                self.outer.state[self.global_copy[name]]["momentum_buffer"] = self.buffers[name]


class _DelayedNesterovRule:
    """:class:`~.outer_optimizer.DelayedNesterov`'s step (``delayed_nesterov_step_``), its
    buffers allocated where the step writes them first (``delayed_nesterov_buffers``)."""

    def __init__(self, outer: DelayedNesterov, global_copy: Tensors, stepping: bool) -> None:
        self.group = _one_group(outer)
        outer._check_group(self.group)
        self.outer, self.global_copy = outer, global_copy
        self.number, self.stepping = self.group["step"], stepping
        self.last = self.number % self.group["delay"] == self.group["delay"] - 1
        self.buffers: dict[str, DelayedNesterovBuffers] = {}
        for name, glob in global_copy.items():
            state = outer.state.get(glob, {})
            if stepping:
                self.buffers[name] = delayed_nesterov_buffers(state, glob, self.last)
            else:
                momentum, grad_sum = state.get("momentum_buffer"), state.get("grad_sum")
                self.buffers[name] = DelayedNesterovBuffers(
                    momentum, grad_sum, momentum is None, grad_sum is None
                )

    def _settings(self) -> dict:
        group = self.group
        return {k: group[k] for k in ("lr", "momentum", "delay", "c")}

    def columns(self) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
        return (
            {name: b.momentum for name, b in self.buffers.items()},
            {name: b.grad_sum for name, b in self.buffers.items()},
        )

    def step(self, piece: Piece, grad: torch.Tensor, scratch: PieceBuffers) -> None:
        buffers = self.buffers[piece.name]
        delayed_nesterov_step_(
            piece.glob, grad, piece.momentum, piece.grad_sum, buffers.fresh_momentum,
            buffers.fresh_sum, step=self.number, **self._settings(),
        )  # fmt: skip

    def estimate(self, piece: Piece, grad: torch.Tensor, scratch: PieceBuffers) -> None:
        assert piece.start is not None
        no_momentum = self.buffers[piece.name].fresh_momentum
        if self.stepping:  # the step just taken on the piece is in its buffers
            no_momentum = no_momentum and not self.last
        delayed_nesterov_estimate(
            piece.glob, grad, None if no_momentum else piece.momentum, piece.grad_sum,
            piece.start, step=self.number + self.stepping, **self._settings(),
        )  # fmt: skip

    def close(self) -> None:
        if self.stepping:
            for name, buffers in self.buffers.items():
                buffers.keep(self.outer.state[self.global_copy[name]])
            self.group["step"] = self.number + 1


def piece_rule(outer: torch.optim.Optimizer, global_copy: Tensors, stepping: bool) -> PieceRule:
    """The rule of ``outer`` over ``global_copy`` for a pass that takes an outer step
    (``stepping``) or only estimates one."""
    if type(outer) is OuterSGD:
        return _SGDRule(outer, global_copy, stepping)
    if type(outer) is DelayedNesterov:
        return _DelayedNesterovRule(outer, global_copy, stepping)
    raise TypeError(f"the outer optimizer must be OuterSGD or DelayedNesterov, not {type(outer)}")


def check_outer(outer: torch.optim.Optimizer) -> None:
    """Raise now what a pass would raise at the first outer step over ``outer``: a type the
    passes cannot step, more than one group, a tensor learning rate, a setting out of range."""
    if not isinstance(outer, (OuterSGD, DelayedNesterov)):
        piece_rule(outer, {}, stepping=False)  # raises, naming the type
        return
    outer._check_group(_one_group(outer))


class OuterPasses:
    """The passes over one fragment's outer state (its global copy and outer optimizer):
    :meth:`step`, every method's outer step; and async DiLoCo's sync point over its local start:
    :meth:`finish` (the outer step, then the local copy follows the global copy), :meth:`start`
    (the pseudo-gradient and the next period's start) or both (:meth:`finish_and_start`). The
    new global copy's digest is taken in a host pass and kept while the copy is unchanged."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        global_copy: Tensors,
        outer: torch.optim.Optimizer,
        threads: int = 0,
        non_blocking: bool = True,
    ) -> None:
        """``threads``: for the host's passes (0: ``piece_workers.cores_per_rank``);
        ``non_blocking``: copies between the model's device and the state's are queued, and
        waited for where the host reads or rewrites them (False: each blocks, the reference
        of the CUDA tests)."""
        check_outer(outer)
        self.params = params
        self.non_blocking = non_blocking
        self.global_copy = global_copy
        self.outer = outer
        self.threads = threads
        self.numel = {name: t.numel() for name, t in global_copy.items()}
        self.model_device = local_tensor(next(iter(params.values()))).device
        self.state_device = next(iter(global_copy.values())).device
        #: The pass reads and writes the model's values itself (else through the staging).
        self.in_place = self.state_device == self.model_device
        if not self.in_place and self.state_device.type != "cpu":
            raise ValueError(f"outer state on {self.state_device} for a model on the CPU")
        state = list(global_copy.values())
        local = [local_tensor(p.data) for p in params.values()]
        if not all(t.is_contiguous() for t in [*state, *local]):
            raise ValueError("the outer state and the model's shards must be contiguous")
        #: The digest is taken in the pass: fp32 on the host (``PieceHashes``' pieces).
        self._hashed = self.state_device.type == "cpu" and all(
            t.dtype == torch.float32 for t in state
        )
        #: Model on an accelerator: the pinned host buffer its values cross through.
        self._staging: torch.Tensor | None = None
        #: The global copy's chunk hashes, with the versions of its tensors they were taken at.
        self._hashes: tuple[tuple[int, ...], list[int]] | None = None

    # ---- the passes ----------------------------------------------------------------------------

    def step(self, averages: Tensors, divisor: float = 1.0) -> None:
        """The outer step with ``averages / divisor`` (by parameter, any device; they may be
        overwritten) as gradient."""
        source = self._to_state(averages)
        divide_by = self._divide_by(divisor)
        rule = piece_rule(self.outer, self.global_copy, stepping=True)

        def body(piece: Piece, worker: Worker) -> None:
            scratch = worker.scratch(piece.glob.numel(), piece.glob.dtype)
            self._step_piece(rule, piece, divide_by, scratch)
            self._hash(piece, worker)

        self._run(self._cut(rule, source=source), body)
        rule.close()

    def finish(self, start: Tensors, average: torch.Tensor | None, divisor: float) -> None:
        """The outer step with ``average / divisor`` (flat, on any device; None: no step), then
        the local copy follows the global copy: it moves by global copy - local ``start``, and
        the period starts at the global copy."""
        source = None if average is None else self._to_state(self.views(average))
        divide_by = self._divide_by(divisor)
        rule = piece_rule(self.outer, self.global_copy, stepping=average is not None)
        in_place = self.in_place
        pieces = self._cut(
            rule,
            start=start,
            local=self._local() if in_place else None,
            out=None if in_place else self.views(self._staging_buffer()),  # the shifts
            source=source,
        )

        def body(piece: Piece, worker: Worker) -> None:
            assert piece.start is not None
            scratch = worker.scratch(piece.glob.numel(), piece.glob.dtype)
            if piece.source is not None:
                self._step_piece(rule, piece, divide_by, scratch)
            if piece.local is not None:
                piece.local.add_(torch.sub(piece.glob, piece.start, out=scratch.t1))
            else:
                torch.sub(piece.glob, piece.start, out=piece.out)
            piece.start.copy_(piece.glob)
            self._hash(piece, worker)

        self._run(pieces, body)
        rule.close()
        if not in_place:
            local, staged = self._local(), self.views(self._staging_buffer())
            for name in self.params:
                local[name].add_(staged[name].to(self.model_device, non_blocking=self.non_blocking))
            wait_for_copies(self.model_device)  # the host rewrites the staging next

    def start(self, start: Tensors, out: torch.Tensor, share: float | None, tokens: float) -> None:
        """``out`` (flat, on the model's device) = ``start`` - model, the pseudo-gradient; the
        next period starts at the global copy moved by the outer step ``share x out`` would make
        (``share`` None: not moved); then ``out`` is scaled by ``tokens``."""
        rule = piece_rule(self.outer, self.global_copy, stepping=False)
        if self.in_place:

            def body(piece: Piece, worker: Worker) -> None:
                local, pseudo = piece.local, piece.out
                assert local is not None and pseudo is not None and piece.start is not None
                torch.sub(piece.start, local, out=pseudo)  # the pseudo-gradient
                self._start_period(rule, piece, pseudo, share, tokens, worker)
                local.copy_(piece.start)

            pieces = self._cut(rule, start=start, local=self._local(), out=self.views(out))
            self._run(pieces, body, steps=False)
            return
        local, views = self._local(), self.views(out)
        for name in self.params:  # the pseudo-gradient, on the device
            views[name].copy_(start[name].view(-1), non_blocking=self.non_blocking)
            views[name].sub_(local[name])
        if share is None:
            wait_for_copies(self.model_device)  # the host rewrites ``start`` next
            staged = None
        else:
            staged = self._to_state(self.views(out))

        def host_body(piece: Piece, worker: Worker) -> None:
            self._start_period(rule, piece, piece.out, share, 1.0, worker)

        self._run(self._cut(rule, start=start, out=staged), host_body, steps=False)
        for name in self.params:
            local[name].copy_(start[name].view(-1), non_blocking=self.non_blocking)
        out.mul_(tokens)
        wait_for_copies(self.model_device)  # ``start`` is rewritten at the next sync point

    def finish_and_start(
        self,
        start: Tensors,
        average: torch.Tensor | None,
        divisor: float,
        out: torch.Tensor,
        share: float | None,
        tokens: float,
    ) -> None:
        """:meth:`finish` then :meth:`start`: one pass, each piece finished and started while
        in cache, when the model is fp32 beside the state; two otherwise. ``out`` may be
        ``average``'s buffer: a piece's average is read before its pseudo-gradient is written."""
        local_fp32 = all(t.dtype == torch.float32 for t in self._local().values())
        if not self.in_place or not local_fp32:  # the local copy is rounded to its dtype between
            self.finish(start, average, divisor)
            self.start(start, out, share, tokens)
            return
        source = None if average is None else self._to_state(self.views(average))
        divide_by = self._divide_by(divisor)
        rule = piece_rule(self.outer, self.global_copy, stepping=average is not None)
        pieces = self._cut(
            rule, start=start, local=self._local(), out=self.views(out), source=source
        )

        def body(piece: Piece, worker: Worker) -> None:
            scratch = worker.scratch(piece.glob.numel(), piece.glob.dtype)
            glob, local, pseudo = piece.glob, piece.local, piece.out
            assert local is not None and pseudo is not None and piece.start is not None
            if piece.source is not None:
                self._step_piece(rule, piece, divide_by, scratch)
            # The followed local copy, kept in scratch: start and the model are written once,
            # below; its start (= global) is read as global.
            followed = torch.add(local, torch.sub(glob, piece.start, out=scratch.t1),
                                 out=scratch.t1)  # fmt: skip
            self._hash(piece, worker)
            torch.sub(glob, followed, out=pseudo)  # the pseudo-gradient
            self._start_period(rule, piece, pseudo, share, tokens, worker)
            local.copy_(piece.start)

        self._run(pieces, body)
        rule.close()

    def _run(
        self, pieces: list[Piece], body: Callable[[Piece, Worker], None], steps: bool = True
    ) -> None:
        """``body`` on every piece. A pass that ``steps`` the global copy keeps the chunk hashes
        its bodies took (the digest kept is void meanwhile: a pass that fails half-way leaves
        none); one that does not leaves the digest alone."""
        hashed = steps and self._hashed
        if steps:
            self._hashes = None
        hashes = run_pieces(
            pieces, body, self.threads, self.numel if hashed else None, self.state_device
        )
        if steps:
            for t in self.global_copy.values():  # a pass writes through views of pieces
                torch.autograd.graph.increment_version(t)
        if hashed:
            self._hashes = (self._versions(), [h for name in self.numel for h in hashes[name]])

    # ---- one piece -----------------------------------------------------------------------------

    @staticmethod
    def _step_piece(
        rule: PieceRule, piece: Piece, divide_by: torch.Tensor | None, scratch: PieceBuffers
    ) -> None:
        """The outer step on the piece with ``source / divide_by`` (an exact division,
        ``exact_division``'s bits, written back into the source)."""
        assert piece.source is not None
        if divide_by is not None:  # not div_: by a 0-dim tensor it takes 2.5x as long
            torch.div(piece.source, divide_by, out=piece.source)
        rule.step(piece, piece.source, scratch)

    @staticmethod
    def _start_period(
        rule: PieceRule,
        piece: Piece,
        pseudo: torch.Tensor | None,
        share: float | None,
        tokens: float,
        worker: Worker,
    ) -> None:
        """The next period's start on the piece: the global copy, moved by the next outer step
        for ``share x pseudo`` (``share`` None: not moved); then ``pseudo`` scaled by
        ``tokens``."""
        assert piece.start is not None
        if share is None:
            piece.start.copy_(piece.glob)
        else:
            assert pseudo is not None
            scratch = worker.scratch(piece.glob.numel(), piece.glob.dtype)
            grad = pseudo if share == 1.0 else torch.mul(pseudo, share, out=scratch.grad)
            rule.estimate(piece, grad, scratch)
        if tokens != 1.0:
            assert pseudo is not None
            pseudo.mul_(tokens)

    def _hash(self, piece: Piece, worker: Worker) -> None:
        if self._hashed:  # on the host: an integer dot product, no temporary
            worker.hashes[piece.name].add(piece.a, piece.glob)

    def _divide_by(self, divisor: float) -> torch.Tensor | None:
        if divisor == 1:
            return None
        return divisor_like(next(iter(self.global_copy.values())), divisor)

    # ---- what the passes work on ---------------------------------------------------------------

    def _cut(
        self,
        rule: PieceRule,
        start: Tensors | None = None,
        local: Tensors | None = None,
        out: Tensors | None = None,
        source: Tensors | None = None,
    ) -> list[Piece]:
        momentum, grad_sum = rule.columns()
        columns = [self.global_copy, start, local, out, source, momentum, grad_sum]
        return cut(self.numel, columns, piece_values(self.state_device))

    def _local(self) -> Tensors:
        """Each parameter's local values (its shard), flat, where the model lives."""
        return {name: local_tensor(p.data).view(-1) for name, p in self.params.items()}

    def views(self, flat: torch.Tensor) -> Tensors:
        """``flat``, the fragment's size, cut into each parameter's values."""
        views, offset = {}, 0
        for name, numel in self.numel.items():
            views[name] = flat[offset : offset + numel]
            offset += numel
        if offset != flat.numel():
            raise ValueError(f"{flat.numel()} values for a fragment of {offset} parameters")
        return views

    def _to_state(self, values: Tensors) -> Tensors:
        """``values`` (by parameter) flat where the state lives: as they are if there, else
        through the staging buffer (an accelerator's, for host state) or copied."""
        for name, numel in self.numel.items():
            if values[name].numel() != numel:
                raise ValueError(
                    f"{values[name].numel()} values for {name}, a parameter of {numel} values"
                )
        device = next(iter(values.values())).device
        if device == self.state_device:
            return {name: values[name].view(-1) for name in self.numel}
        if self.state_device.type != "cpu":
            return {name: values[name].reshape(-1).to(self.state_device) for name in self.numel}
        staging = self.views(self._staging_buffer())
        for name in self.numel:
            staging[name].copy_(values[name].view(-1), non_blocking=self.non_blocking)
        wait_for_copies(device)
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

    def global_chunk_hashes(self) -> list[int]:
        """The global copy's chunk hashes (``tools.digest``) in parameter order: the last
        pass's unless a write since moved a tensor's version (a heal's, a checkpoint's load)."""
        if self._hashes is None or self._hashes[0] != self._versions():
            found = [h for t in self.global_copy.values() for h in chunk_hashes(t)]
            self._hashes = (self._versions(), found)
        return list(self._hashes[1])
