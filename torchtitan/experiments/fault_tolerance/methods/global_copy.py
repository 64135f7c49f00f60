"""What the methods with global copies share (DiLoCo, Streaming DiLoCo, async DiLoCo):
:class:`OuterState`, a fragment's global copy and outer optimizer, stepped by its passes
(``outer_passes``: the one outer step, in training and replay alike), and
:class:`GlobalCopyMethod`, an :class:`~.outer_loop.OuterLoop` over them (healing state, heal
history, digests, replay of missed syncs).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed.tensors import as_param_layout, local_tensor
from torchtitan.experiments.fault_tolerance.heal.history import HealHistory, HistoryEntry
from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop
from torchtitan.experiments.fault_tolerance.methods.outer_passes import OuterPasses, wait_for_copies
from torchtitan.experiments.fault_tolerance.transport.collective import Delivered
from torchtitan.tools.digest import fold_digest
from torchtitan.tools.pinned import host_tensor

if TYPE_CHECKING:
    from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum

#: Builds a fragment's outer optimizer over the tensors it steps (its global copy).
MakeOuter = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def state_tensor(like: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A tensor shaped like ``like`` for outer state: beside it (``device`` None), else fp32 on
    ``device``; on the CPU, pinned at its exact size when a GPU is present (``tools.pinned``)."""
    if device is None:
        return torch.empty_like(like)
    if device.type == "cpu":
        return host_tensor(like.shape, pinned=True)
    return torch.empty(like.shape, dtype=torch.float32, device=device)


class OuterState:
    """One fragment's outer state: the model's parameters, the global copy (this rank's shards,
    on the parameters' device or ``device``), its outer optimizer and the passes over them
    (:class:`~.outer_passes.OuterPasses`), and blocking DiLoCo's in-flight pseudo-gradient
    all-reduce."""

    #: Cross-device copies (model <-> global copy) don't block the host; they are waited for
    #: where needed (``wait_for_copies``). False: each blocks (the CUDA tests' reference).
    non_blocking = True

    def __init__(
        self,
        module: nn.Module,
        make_outer: MakeOuter,
        device: torch.device | None = None,
        threads: int = 0,
    ) -> None:
        """``threads``: for the passes over host memory (0: this rank's share of the host's
        cores)."""
        self.params: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.global_copy = {
            name: state_tensor(local_tensor(p.data), device) for name, p in self.params.items()
        }
        self.outer: torch.optim.Optimizer = make_outer(list(self.global_copy.values()))
        self.passes = OuterPasses(
            self.params, self.global_copy, self.outer, threads, self.non_blocking
        )
        #: Where the model's shards live (a sync's buffers and averages are there too).
        self.model_device = self.passes.model_device
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
        """If ``source`` and the outer state differ in device, wait for the non-blocking copies
        between them on each accelerator side's stream (on one device the stream orders them)."""
        state = next(iter(self.global_copy.values())).device
        if source != state:
            wait_for_copies(source)
            wait_for_copies(state)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` (the fragment's values, in parameter order) cut into each parameter's, in
        its shape."""
        return {
            name: view.view_as(self.global_copy[name])
            for name, view in self.passes.views(flat).items()
        }

    def heal_state(self) -> dict[str, Any]:
        """What a peer healing from this group takes, as torchft's DiLoCo lays it out."""
        return {"outer_optimizer": self.outer.state_dict(), "original_parameters": self.global_copy}

    @torch.no_grad()
    def load_heal_state(self, saved: dict[str, Any]) -> None:
        for name, value in saved["original_parameters"].items():
            self.global_copy[name].copy_(local_tensor(value))
        self.outer.load_state_dict(saved["outer_optimizer"])


F = TypeVar("F", bound=OuterState)


class GlobalCopyMethod(OuterLoop, Generic[F]):
    """A method with a global copy of each fragment, stepped by an outer optimizer with the
    averaged pseudo-gradient: a :class:`OuterState` each, healing state under :attr:`heal_key`,
    and the heal history, which a joiner replays (``heal.history``) with training's outer step
    instead of receiving the global copies."""

    #: The key of fragment ``i``'s healing state.
    heal_key: str

    def __init__(
        self,
        sync: SyncQuorum,
        inner_optimizer: torch.optim.Optimizer,
        period: int,
        fragments: list[nn.Module],
        states: list[F],
        history: HealHistory | None,
    ) -> None:
        """``history``: what each committed sync delivered, for a joiner to replay (None: none);
        capacity > 0 needs ``SyncTransport(keep_delivered=True)``."""
        super().__init__(sync, inner_optimizer, period)
        self.fragments = fragments
        self._states = states
        self.history = history if history is not None else HealHistory(0)
        #: See :meth:`take_stepped_squares`.
        self._stepped_squares: torch.Tensor | None = None
        for index, state in enumerate(states):
            state.take_model()
            sync.register_state_dict_fn(
                self.heal_key.format(index), state.load_heal_state, state.heal_state
            )

    def _keep(
        self, index: int, delivered: list[Delivered] | torch.Tensor, divisor: float = 1.0
    ) -> None:
        """Fragment ``index``'s sync committed (outer step not yet taken): record what its
        transfers ``delivered`` (``SyncDecision.delivered``), or the fp32 sums a checkpoint or
        peer gave (a tensor: no transfer here carried them); ``divisor``: what the outer step
        divides the sums by."""
        if self.history.capacity <= 0:
            return
        if isinstance(delivered, torch.Tensor):
            sums = delivered.detach().to("cpu", copy=True)
            delivered = [Delivered("float32", sums.numel(), 1, 1, sums)]
        number = self.sync.current_step()
        basis = self.global_digest(index)
        self.history.record(HistoryEntry.of(number, index, delivered, basis, divisor))

    def current_fragment(self) -> int:
        return self.sync.current_step() % len(self.fragments)

    def global_parameters(self, index: int) -> dict[str, torch.Tensor]:
        """A fragment's global copy (this rank's shards), by fragment parameter name."""
        return self._states[index].global_copy

    def fragment_parameters(self, index: int) -> dict[str, nn.Parameter]:
        return self._states[index].params

    def outer_optimizer(self, index: int) -> torch.optim.Optimizer:
        """The outer optimizer of a fragment."""
        return self._states[index].outer

    def take_global_copies(self) -> bool:
        for state in self._states:
            state.take_model()
            state.outer.state.clear()
        return True

    def replayer(self) -> GlobalCopyMethod:
        return self

    def fragment_state(self, index: int) -> dict[str, Any]:
        """The global copy and outer momentum, laid out like the parameters; zeros before the
        first outer step, so a fresh process offers DCP a tensor to load the momentum into (on
        the outer state's device)."""
        params = self.fragment_parameters(index)
        global_copy = self.global_parameters(index)  # also the tensors the outer optimizer steps
        outer = self.outer_optimizer(index)
        momentum = {
            name: outer.state.get(t, {}).get("momentum_buffer") for name, t in global_copy.items()
        }
        return {
            "global_parameters": {
                name: as_param_layout(p, global_copy[name]) for name, p in params.items()
            },
            "has_momentum": all(m is not None for m in momentum.values()),
            "outer_momentum": {
                name: (
                    m
                    if isinstance(m, DTensor)
                    else as_param_layout(
                        params[name], torch.zeros_like(global_copy[name]) if m is None else m
                    )
                )
                for name, m in momentum.items()
            },
        }

    def load_fragment_state(self, index: int, saved: dict[str, Any]) -> None:
        global_copy = self.global_parameters(index)
        for name, value in saved["global_parameters"].items():
            global_copy[name].copy_(local_tensor(value))
        outer = self.outer_optimizer(index)
        outer.state.clear()
        if saved["has_momentum"]:
            for name, value in saved["outer_momentum"].items():
                target = global_copy[name]
                outer.state[target]["momentum_buffer"] = (
                    value.detach().clone()
                    if isinstance(target, DTensor)
                    else local_tensor(value).detach().to(target.device, copy=True)
                )

    @torch.no_grad()
    def measure_outer_step(self, averages: Iterable[torch.Tensor]) -> None:
        """Before a sync's outer step with ``averages`` (this rank's shards): their sum of
        squares, for the sync's line. No collective here: the reporter, reached by every rank at
        the same syncs, sums the shares."""
        grads = [local_tensor(t) for t in averages]
        squares = torch.zeros((), dtype=torch.float64, device=self._states[0].model_device)
        if grads:  # one fused norm (its time counts in the sync's): not a loop of reductions
            squares += torch.nn.utils.get_total_norm(grads).double().square()
        self._stepped_squares = squares

    def note_stepped_squares(self, squares: float) -> None:
        """What :meth:`measure_outer_step` would have found, known already (async DiLoCo's
        transport took it where the sums arrived)."""
        self._stepped_squares = torch.tensor(
            squares, dtype=torch.float64, device=self._states[0].model_device
        )

    def take_stepped_squares(self) -> torch.Tensor | None:
        squares, self._stepped_squares = self._stepped_squares, None
        return squares

    def replayed_state(self, key: str) -> bool:
        """Whether a replay reproduces healing state ``key`` (a fragment's global copy and outer
        optimizer): the peer leaves it out."""
        return any(key == self.heal_key.format(i) for i in range(len(self.fragments)))

    def replay_device(self, index: int) -> torch.device:
        """Where the groups' outer step of fragment ``index`` takes its average; a replay
        decodes and divides it there too."""
        return self._states[index].model_device

    def replay_outer_step(self, index: int, average: torch.Tensor) -> None:
        """Apply a committed sync of fragment ``index`` exactly as its groups did; ``average``:
        its flat averaged pseudo-gradient as delivered (may be overwritten). Leaves the model's
        parameters undefined: the caller puts the global copies back."""
        state = self._states[index]
        state.passes.step(state.views(average))

    def state_bytes(self) -> dict[str, int]:
        """The global copies, outer optimizer state and the largest fragment's pseudo-gradient
        (held while its sync runs)."""
        return {
            "global_copy": sum(t.nbytes for s in self._states for t in s.global_copy.values()),
            "momentum": sum(
                value.nbytes
                for s in self._states
                for state in s.outer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            ),
            "buffers": self.sync_buffer_bytes(),
        }

    def sync_buffer_bytes(self) -> int:
        """The most a sync holds while it runs: the largest fragment's pseudo-gradient."""
        return max(self.fragment_bytes(i) for i in range(len(self.fragments)))

    @abstractmethod
    def restore_global_copies(self, index: int) -> None:
        """Put a fragment's global copy back into the model."""

    @abstractmethod
    def drop_in_flight(self, index: int) -> None:
        """Let a started all-reduce finish (every group started it) and drop its result."""

    def global_chunk_hashes(self, index: int) -> list[int]:
        """Chunk hashes of fragment ``index``'s global copy (this rank's shards)."""
        return self._states[index].passes.global_chunk_hashes()

    def global_digest(self, index: int) -> int:
        """A digest of fragment ``index``'s global copy (this rank's shards)."""
        return fold_digest(self.global_chunk_hashes(index))

    def agreement_digest(self) -> int | None:
        return fold_digest(
            h for i in range(len(self.fragments)) for h in self.global_chunk_hashes(i)
        )

    def replay_outer_steps(self, steps: Iterable[tuple[int, torch.Tensor]]) -> None:
        """:meth:`replay_outer_step` for each ``(index, average)`` in order, as one replay (a
        method may skip work between steps, never change their results)."""
        for index, average in steps:
            self.replay_outer_step(index, average)
