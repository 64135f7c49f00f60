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

import contextlib
import functools
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from torchtitan.experiments.fault_tolerance.compression import Delivered
from torchtitan.experiments.fault_tolerance.heal_history import HealHistory, HistoryEntry
from torchtitan.experiments.fault_tolerance.outer_loop import (
    Ending,
    GlobalCopyLoop,
    OuterLoop,
    ReplaysOuterSteps,
    SyncOutcome,
    local_tensor,
    optimizer_hooks,
)
from torchtitan.experiments.fault_tolerance.outer_passes import wait_for_copies
from torchtitan.tools.digest import device_digest
from torchtitan.tools.pinned import host_tensor

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync_quorum import SyncManager

#: Builds a fragment's outer optimizer over the tensors it steps (its global copy).
MakeOuter = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

#: The healing state of fragment ``i`` (its global copy and outer optimizer), under the key and
#: in the layout torchft's DiLoCo registers it.
FRAGMENT_STATE_KEY = "StreamingDiLoCoFragment_{}"


class _PeriodicLoop(OuterLoop):
    """The hooks and inner-step count both methods share: a sync every ``period`` steps."""

    def __init__(
        self, manager: SyncManager, inner_optimizer: torch.optim.Optimizer, period: int
    ) -> None:
        self.manager = manager
        self.inner_optimizer = inner_optimizer
        self.period = period
        self._local_step = 0
        #: The verdict of the last sync point's sync (None: it decided none).
        self._committed: bool | None = None

    def hooks(self) -> contextlib.AbstractContextManager:
        return optimizer_hooks(self.inner_optimizer, self._before_step, self._after_step)

    def _before_step(self, *_: Any) -> None:
        # Parameters change in the step: a peer must not read them for a heal meanwhile.
        self.manager.disallow_state_dict_read()

    def _after_step(self, *_: Any) -> None:
        self._local_step += 1
        self.at_step()

    @abstractmethod
    def at_step(self) -> None:
        """After each inner step (``local_step()`` counts it): let peers read the state for a
        heal again (``allow_state_dict_read``) and sync when it is time."""

    def local_step(self) -> int:
        return self._local_step

    def set_local_step(self, step: int) -> None:
        self._local_step = step

    def last_outcome(self, manager: SyncManager) -> SyncOutcome | None:
        if self._committed is None:
            return None
        number = manager.current_step() + (0 if self._committed else 1)
        sent, compression_s = manager.sync_stats()
        return SyncOutcome(
            number,
            (number - 1) % len(self.fragments),
            self._committed,
            sent,
            manager.num_participants(),
            compression_s=compression_s,
        )


class LocalSGD(_PeriodicLoop):
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

    def at_step(self) -> None:
        self.manager.allow_state_dict_read()
        if self._local_step >= self.period:
            self.manager.start_quorum()
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

    def finish(self) -> Ending:
        steps_since = self._local_step
        if steps_since:
            self.manager.start_quorum()
            self._average()
        return Ending(bool(steps_since), steps_since, None)


def state_tensor(like: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A tensor for a fragment's outer state, ``like``'s shape: beside ``like`` (``device``
    None), else fp32 on ``device``, in host memory pinned at its exact size when a GPU is
    present (``tools.pinned``)."""
    if device is None:
        return torch.empty_like(like)
    if device.type == "cpu":
        return host_tensor(like.shape, pinned=True)
    return torch.empty(like.shape, dtype=torch.float32, device=device)


class Fragment:
    """One fragment's outer state: its parameters (the model's), its global copy (this rank's
    shards; on the parameters' device, or on ``device``), the outer optimizer that steps the
    copy, and the pseudo-gradient whose all-reduce is in flight (blocking DiLoCo's)."""

    #: Copies between the model and a global copy on another device are queued without
    #: blocking the host and waited for where the host needs them (``wait_for_copies``).
    #: False: each copy blocks, the reference the CUDA tests compare with.
    non_blocking = True

    def __init__(
        self, module: nn.Module, make_outer: MakeOuter, device: torch.device | None = None
    ) -> None:
        self.params: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.global_copy = {
            name: state_tensor(local_tensor(p.data), device) for name, p in self.params.items()
        }
        self.outer: torch.optim.Optimizer = make_outer(list(self.global_copy.values()))
        #: Where the model's shards live (a sync's buffers and averages are there too).
        self.model_device = local_tensor(next(iter(self.params.values()))).device
        #: The all-reduced pseudo-gradients (once the works are done) and their works.
        self.grads: dict[str, torch.Tensor] = {}
        self.works: list[Any] = []

    def settle(self) -> dict[str, torch.Tensor]:
        """Wait for the all-reduce in flight; its averaged pseudo-gradients, no longer kept."""
        for work in self.works:
            work.wait()
        grads, self.grads, self.works = self.grads, {}, []
        return grads

    def locals(self) -> dict[str, torch.Tensor]:
        return {name: local_tensor(p.data) for name, p in self.params.items()}

    def numel(self) -> int:
        return sum(t.numel() for t in self.global_copy.values())

    @torch.no_grad()
    def take_model(self) -> None:
        """The model's current values become the global copy."""
        for name, local in self.locals().items():
            self.global_copy[name].copy_(local, non_blocking=self.non_blocking)
        self._wait_if_crossed(self.model_device)

    @torch.no_grad()
    def restore(self) -> None:
        for name, local in self.locals().items():
            local.copy_(self.global_copy[name])

    def _wait_if_crossed(self, source: torch.device) -> None:
        """Wait for the copies from ``source`` queued without blocking, if the outer state is
        elsewhere (on one device, the stream orders them: no wait)."""
        if source != next(iter(self.global_copy.values())).device:
            wait_for_copies(source)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` (the fragment's values, in parameter order) cut into each parameter's."""
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, t in self.global_copy.items():
            views[name] = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        if offset != flat.numel():
            raise ValueError(f"{flat.numel()} values for a fragment of {offset} parameters")
        return views

    @torch.no_grad()
    def outer_step(self, averages: dict[str, torch.Tensor]) -> None:
        """The outer optimizer's step on the global copy with ``averages`` (by name, on any
        device; views the step may change) as its gradient: every method's outer step,
        training's and a heal's replay alike."""
        for name, t in self.global_copy.items():
            t.grad = averages[name].to(t.device, non_blocking=self.non_blocking)
        self._wait_if_crossed(next(iter(averages.values())).device)  # the step reads them
        self.outer.step()
        self.outer.zero_grad()
        # A fused step leaves the tensors' versions as they were: moved here, so that what
        # keys a digest to them (``outer_passes``' cache) sees the write.
        for t in self.global_copy.values():
            torch.autograd.graph.increment_version(t)

    def heal_state(self) -> dict[str, Any]:
        """What a peer healing from this group takes, as torchft's DiLoCo lays it out."""
        return {"outer_optimizer": self.outer.state_dict(), "original_parameters": self.global_copy}

    @torch.no_grad()
    def load_heal_state(self, saved: dict[str, Any]) -> None:
        for name, value in saved["original_parameters"].items():
            self.global_copy[name].copy_(local_tensor(value))
        self.outer.load_state_dict(saved["outer_optimizer"])


F = TypeVar("F", bound=Fragment)


class GlobalCopyMethod(_PeriodicLoop, GlobalCopyLoop, ReplaysOuterSteps, Generic[F]):
    """What DiLoCo and async DiLoCo share: a :class:`Fragment` per fragment, its healing state
    registered under :attr:`heal_key`, and the outer step a heal replays."""

    #: The key of fragment ``i``'s healing state.
    heal_key: str

    def __init__(
        self,
        manager: SyncManager,
        inner_optimizer: torch.optim.Optimizer,
        period: int,
        fragments: list[nn.Module],
        states: list[F],
        history: HealHistory | None,
    ) -> None:
        """``history``: keeps what each committed sync delivered, for a joiner to replay
        (None: none kept)."""
        super().__init__(manager, inner_optimizer, period)
        self.fragments = fragments
        self._states = states
        self.history = history if history is not None else HealHistory(0)
        #: Set when torchft loaded a peer's state into this group (cleared by the method).
        self._healed = False
        for index, state in enumerate(states):
            state.take_model()
            manager.register_state_dict_fn(
                self.heal_key.format(index),
                functools.partial(self._load_heal_state, index),
                state.heal_state,
            )

    def _load_heal_state(self, index: int, saved: dict[str, Any]) -> None:
        self._states[index].load_heal_state(saved)
        self._healed = True

    def _keep(self, index: int, loaded: torch.Tensor | None = None, divisor: float = 1.0) -> None:
        """Fragment ``index``'s sync committed (its outer step not yet taken): keep what its
        transfers delivered in the history, or ``loaded``, its sums when no transfer of this
        process carried them (fp32, from a checkpoint or a peer); ``divisor``: what the outer
        step divides the sums by."""
        if self.history.capacity <= 0:
            return
        if loaded is None:
            kept = self.manager.delivered()
        else:
            sums = loaded.detach().to("cpu", copy=True)
            kept = [Delivered("float32", sums.numel(), 1, 1, sums)]
        number = self.manager.current_step()
        basis = self.global_digest(index)
        self.history.record(HistoryEntry.of(number, index, kept, basis, divisor))

    def current_fragment(self) -> int:
        return self.manager.current_step() % len(self.fragments)

    def global_parameters(self, index: int) -> dict[str, torch.Tensor]:
        return self._states[index].global_copy

    def fragment_parameters(self, index: int) -> dict[str, nn.Parameter]:
        return self._states[index].params

    def outer_optimizer(self, index: int) -> torch.optim.Optimizer:
        return self._states[index].outer

    def take_global_copies(self) -> None:
        for state in self._states:
            state.take_model()
            state.outer.state.clear()

    def replayed_state(self, key: str) -> bool:
        return any(key == self.heal_key.format(i) for i in range(len(self.fragments)))

    def replay_device(self, index: int) -> torch.device:
        return self._states[index].model_device

    def replay_outer_step(self, index: int, average: torch.Tensor) -> None:
        state = self._states[index]
        state.outer_step(state.views(average))


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

    def at_step(self) -> None:
        self.manager.allow_state_dict_read()
        if self._local_step == self.period - self.delay:
            self.manager.start_quorum()
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

    def finish(self) -> Ending:
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

    def restore_global_copies(self, index: int) -> None:
        self._states[index].restore()
