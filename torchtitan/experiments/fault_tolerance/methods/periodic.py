"""LocalSGD and (Streaming) DiLoCo: the methods whose sync point blocks until its average is in.

Both run from the inner optimizer's hooks on the sync quorum. Every ``period`` inner steps:

* **LocalSGD** (arXiv 1805.09767): the sync quorum, then the mean of the groups' parameters;
  committed, it replaces the model's, else the group keeps its own.
* **DiLoCo** (arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512, with several fragments, one
  per sync point in turn: ``sync.current_step() mod F``, alike in every group). ``delay``
  steps before the sync point (0: at it): the sync quorum, then the fragment's pseudo-gradient
  ``global copy - model`` is all-reduced to its mean during those steps. At the sync point the
  model goes back to the global copy; committed, the outer optimizer steps the global copy with
  the mean as gradient and the model takes it, moved ``alpha`` (``fragment_update_alpha``) of
  the way back to where its own inner steps had taken it.

A failed sync (any group's error, a peer gone, a value not finite) is dropped alike in every
group: LocalSGD keeps each group's parameters, DiLoCo restores the fragment's global copy and
drops the period's inner steps. Every operation on a value is torchft 0.2.0's ``LocalSGD`` /
``DiLoCo``'s, in order, so the bits equal torchft's (``tests/unit_tests/test_torchft_oracle.py``).
Unlike torchft (never in values), the outer optimizer steps the global copy itself, so a heal's
replay takes the same step, and the local parameters are copied only when ``alpha`` > 0: extra
memory is the global copy and outer momentum, plus the pseudo-gradient while a sync runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.distributed.tensors import local_tensor
from torchtitan.experiments.fault_tolerance.heal.history import HealHistory
from torchtitan.experiments.fault_tolerance.methods.global_copy import (
    GlobalCopyMethod,
    MakeOuter,
    OuterState,
)
from torchtitan.experiments.fault_tolerance.methods.outer_loop import Ending, OuterLoop, Quorums
from torchtitan.tools.digest import device_digest

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum

#: The healing state of fragment ``i`` (its global copy and outer optimizer), under the key and
#: in the layout torchft's DiLoCo registers it.
FRAGMENT_STATE_KEY = "StreamingDiLoCoFragment_{}"


class LocalSGD(OuterLoop):
    """Every ``period`` steps the groups average their parameters."""

    method = "localsgd"

    def __init__(
        self,
        sync: SyncQuorum,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        period: int,
    ) -> None:
        super().__init__(sync, inner_optimizer, period)
        self.fragments = [model]
        #: The model's digest right after the last committed sync (None: not known).
        self._global_digest: int | None = None
        #: The sync's means and their all-reduces, from its start to the sync point.
        self._works: list[tuple[torch.Tensor, Any]] = []

    @torch.no_grad()
    def start_transfer(self) -> None:
        """All-reduce copies of the parameters to their mean."""
        means = [local_tensor(p.data).clone() for p in self.fragments[0].parameters()]
        self._works = [(mean, self.sync.allreduce(mean)) for mean in means]

    @torch.no_grad()
    def decide_sync(self) -> None:
        """The model takes the mean if the sync commits; the next period starts either way."""
        works, self._works = self._works, []
        for _, work in works:
            work.wait()
        if self.take_verdict(0).committed:
            for p, (mean, _) in zip(self.fragments[0].parameters(), works, strict=True):
                local_tensor(p.data).copy_(mean)

    def agreement_digest(self) -> int | None:
        return self._global_digest

    def note_committed(self) -> None:
        self._global_digest = device_digest(self.fragments[0].parameters())

    def note_joined(self) -> None:
        if self._local_step == 0:  # at a period's start the model is the last average
            self.note_committed()

    def forget_global(self) -> None:
        self._global_digest = None

    def finish(self, quorums: Quorums) -> Ending:
        steps_since = self._local_step
        if steps_since:
            self.start_sync(quorums)
            self.sync_point(quorums)
        return Ending(bool(steps_since), steps_since, None)


class DiLoCo(GlobalCopyMethod[OuterState]):
    """DiLoCo over ``fragments`` (Streaming DiLoCo with more than one), one fragment synced
    every ``period`` inner steps (see the module docstring)."""

    method = "diloco"
    heal_key = FRAGMENT_STATE_KEY

    def __init__(
        self,
        sync: SyncQuorum,
        fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        make_outer: MakeOuter,
        *,
        period: int,
        delay: int = 0,
        alpha: float = 0.0,
        history: HealHistory | None = None,
    ) -> None:
        """``make_outer``: builds a fragment's outer optimizer over its global copy; ``period``:
        inner steps between sync points; ``delay``: steps from a fragment's all-reduce to its
        outer step (< ``period``); ``alpha``: ``fragment_update_alpha``; ``history``: the heal
        history (``GlobalCopyMethod``)."""
        if not 0 <= delay < period:
            raise ValueError(f"delay must be in [0, period={period}), not {delay}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], not {alpha}")
        states = [OuterState(f, make_outer) for f in fragments]
        super().__init__(sync, inner_optimizer, period, fragments, states, history)
        self.delay = delay
        self.alpha = alpha

    # ---- the sync ----------------------------------------------------------------------------

    @torch.no_grad()
    def start_transfer(self) -> None:
        """Start the all-reduce to the mean of the current fragment's pseudo-gradient, ``global
        copy - model``, in new tensors: a failed sync's abandoned transfer may still write into
        what it carried (``transport``)."""
        index = self.current_fragment()
        state = self._states[index]
        assert not state.works, f"fragment {index}'s last all-reduce was never waited for"
        for name, local in state.locals().items():
            state.grads[name] = torch.sub(state.global_copy[name], local)
        state.works = [self.sync.allreduce(grad) for grad in state.grads.values()]

    @torch.no_grad()
    def decide_sync(self) -> None:
        """Wait for the current fragment's all-reduce; committed, the outer step, and the model
        takes the new global copy (and ``alpha`` of its own); else the old global copy."""
        index = self.current_fragment()
        state = self._states[index]
        grads = state.settle()
        own = {n: t.clone() for n, t in state.locals().items()} if self.alpha > 0 else None
        decision = self.take_verdict(index)
        if decision.committed:
            self._keep(index, decision.delivered)
            self.measure_outer_step(grads.values())
            state.passes.step(grads)
        state.restore()
        if decision.committed and own is not None:
            for name, local in state.locals().items():
                local.lerp_(own[name], self.alpha)

    def finish(self, quorums: Quorums) -> Ending:
        steps_since = self._local_step
        for index in range(len(self.fragments)):
            if self.in_flight(index):
                self.drop_in_flight(index)
            self.restore_global_copies(index)
        return Ending(False, 0, steps_since if steps_since or self.delay else None)

    # ---- what the trainer reads and sets -----------------------------------------------------

    def in_flight(self, index: int) -> bool:
        return bool(self._states[index].works)

    def drop_in_flight(self, index: int) -> None:
        self._states[index].settle()

    def sync_buffer_bytes(self) -> int:
        # The pseudo-gradient, and with alpha > 0 the copy of the local parameters.
        return super().sync_buffer_bytes() * (2 if self.alpha > 0 else 1)

    def restore_global_copies(self, index: int) -> None:
        self._states[index].restore()
