"""LocalSGD and (Streaming) DiLoCo: the methods whose sync point blocks until its average is in.

Both run from the inner optimizer's hooks on the sync Manager (torchft's quorum, commit vote
and state transfer; the sync transport's all-reduce). Every ``period`` inner steps:

* **LocalSGD** (arXiv 1805.09767): the sync quorum, then the mean of the groups' parameters;
  committed, it replaces the model's, else the group keeps its own.
* **DiLoCo** (arXiv 2311.08105), and Streaming DiLoCo (arXiv 2501.18512) with more than one
  fragment, one fragment per sync point in turn (``manager.current_step() mod F``, alike in
  every group). ``delay`` steps before the sync point (0: at it): the sync quorum, then the
  pseudo-gradient ``global copy - model`` of the fragment, all-reduced to its mean while the
  group takes those ``delay`` steps. At the sync point: the model goes back to the global
  copy; committed, the outer optimizer steps the global copy with the mean as its gradient,
  the model takes the new global copy, and ``alpha`` (``fragment_update_alpha``) of the way
  back to where this group's own inner steps had taken it.

A failed sync (any group's error, a peer gone, a value not finite) is dropped alike in every
group: LocalSGD keeps each group's parameters, DiLoCo puts the fragment back to its global copy
and drops the period's inner steps, as torchft's algorithms do. Every operation on a value is
the one torchft 0.2.0's ``LocalSGD`` / ``DiLoCo`` make, in the same order, so the groups end
each sync with the same bits as torchft's (``tests/unit_tests/test_torchft_oracle.py``).

Where this differs from torchft, never in values: the outer optimizer steps the global copy
itself (torchft restores the copy into the model and steps that), so a heal's replay takes the
same outer step; the local parameters are copied only when ``alpha`` > 0 (torchft copies them
at every sync). DiLoCo's extra memory is then the global copy and the outer momentum, plus the
pseudo-gradient while a sync runs (``benchmarks/memory.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.experiments.fault_tolerance.global_copy import Fragment, GlobalCopyMethod, MakeOuter
from torchtitan.experiments.fault_tolerance.heal_history import HealHistory
from torchtitan.experiments.fault_tolerance.outer_loop import (
    Ending,
    OuterLoop,
    Quorums,
    local_tensor,
)
from torchtitan.tools.digest import device_digest

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync_quorum import SyncManager

#: The healing state of fragment ``i`` (its global copy and outer optimizer), under the key and
#: in the layout torchft's DiLoCo registers it.
FRAGMENT_STATE_KEY = "StreamingDiLoCoFragment_{}"


class LocalSGD(OuterLoop):
    """Every ``period`` steps the groups average their parameters."""

    method = "localsgd"

    def __init__(
        self,
        manager: SyncManager,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        period: int,
    ) -> None:
        super().__init__(manager, inner_optimizer, period)
        self.fragments = [model]
        #: The model's digest right after the last committed sync (None: not known).
        self._global_digest: int | None = None

    def at_step(self, quorums: Quorums) -> None:
        self.manager.allow_state_dict_read()
        if self._local_step >= self.period:
            quorums.sync_quorum()
            self._average()

    def _average(self) -> None:
        """All-reduce copies of the parameters to their mean; the model takes it if the sync
        commits. The next period starts either way."""
        params = list(self.fragments[0].parameters())
        means = [local_tensor(p.data).clone() for p in params]
        works = [self.manager.allreduce(mean) for mean in means]
        for work in works:
            work.wait()
        self._committed = bool(self.manager.should_commit())
        if self._committed:
            with torch.no_grad():
                for p, mean in zip(params, means, strict=True):
                    local_tensor(p.data).copy_(mean)
        self._local_step = 0

    def agreement_digest(self) -> int | None:
        return self._global_digest

    def note_committed(self) -> None:
        self._global_digest = device_digest(self.fragments[0].parameters())

    def note_joined(self) -> None:
        if self._local_step == 0:  # at a period's start the model is the last average
            self.note_committed()

    def forget_global(self) -> None:
        self._global_digest = None

    def join_sync(self) -> bool:
        self._average()
        return True

    def finish(self, quorums: Quorums) -> Ending:
        steps_since = self._local_step
        if steps_since:
            quorums.sync_quorum()
            self._average()
        return Ending(bool(steps_since), steps_since, None)


class DiLoCo(GlobalCopyMethod[Fragment]):
    """DiLoCo over ``fragments`` (Streaming DiLoCo with more than one), one fragment synced
    every ``period`` inner steps (see the module docstring)."""

    method = "diloco"
    heal_key = FRAGMENT_STATE_KEY

    def __init__(
        self,
        manager: SyncManager,
        fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        make_outer: MakeOuter,
        *,
        period: int,
        delay: int = 0,
        alpha: float = 0.0,
        should_quantize: bool = False,
        history: HealHistory | None = None,
    ) -> None:
        """``make_outer``: builds a fragment's outer optimizer over the tensors it is given (its
        global copy); ``period``: inner steps between two sync points (one fragment each);
        ``delay``: steps between a fragment's all-reduce and its outer step (below ``period``);
        ``alpha``: ``fragment_update_alpha``; ``should_quantize``: torchft's own fp8 all-reduce
        (CUDA and Triton only) carries the pseudo-gradients; ``history``: the heal history
        (``GlobalCopyMethod``)."""
        if not 0 <= delay < period:
            raise ValueError(f"delay must be in [0, period={period}), not {delay}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], not {alpha}")
        states = [Fragment(f, make_outer) for f in fragments]
        super().__init__(manager, inner_optimizer, period, fragments, states, history)
        self.delay = delay
        self.alpha = alpha
        self.should_quantize = should_quantize

    # ---- the sync ----------------------------------------------------------------------------

    def at_step(self, quorums: Quorums) -> None:
        self.manager.allow_state_dict_read()
        if self._local_step == self.period - self.delay:
            quorums.sync_quorum()
            self._prepare(self.current_fragment())
        if self._local_step == self.period:
            self._perform(self.current_fragment())
            self._local_step = 0

    @torch.no_grad()
    def _prepare(self, index: int) -> None:
        """This group's pseudo-gradient of fragment ``index`` (global copy - model), its
        all-reduce to the mean started. Into tensors of this sync's own: a transfer abandoned
        with a failed sync may still write into what it carried (``transport``)."""
        state = self._states[index]
        assert not state.works, f"fragment {index}'s last all-reduce was never waited for"
        for name, local in state.locals().items():
            state.grads[name] = torch.sub(state.global_copy[name], local)
        state.works = [
            self.manager.allreduce(grad, should_quantize=self.should_quantize)
            for grad in state.grads.values()
        ]

    @torch.no_grad()
    def _perform(self, index: int) -> None:
        """Wait for fragment ``index``'s all-reduce; committed, the outer step, and the model
        takes the new global copy (and ``alpha`` of its own); else the old global copy."""
        state = self._states[index]
        grads = state.settle()
        own = {n: t.clone() for n, t in state.locals().items()} if self.alpha > 0 else None
        self._committed = bool(self.manager.should_commit())
        if self._committed:
            self._keep(index)
            state.outer_step(grads)
        state.restore()
        if self._committed and own is not None:
            for name, local in state.locals().items():
                local.lerp_(own[name], self.alpha)

    def join_sync(self) -> bool:
        index = self.current_fragment()
        self._prepare(index)
        if self.delay:
            return False
        self._perform(index)
        self._local_step = 0
        return True

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
