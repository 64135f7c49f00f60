"""One fragment's outer state in async DiLoCo: its global copy, where this group's local period
started, the outer optimizer over the global copy, and the outer step and copies between the
model and that state (``async_diloco`` runs the algorithm around it).

The global copies, the outer momentum and the start of the local period live on the state
device (the CPU by default: 3x the parameters off the accelerator; pinned when a GPU is
present). Copies between the model and the state are queued without blocking the host and
waited for where the host reads or rewrites their tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.experiments.fault_tolerance.outer_loop import as_param_layout, local_tensor
from torchtitan.experiments.fault_tolerance.outer_optimizer import DelayedNesterov


def _state_tensor(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.empty(like.shape, dtype=torch.float32, device=device)
    if t.device.type == "cpu" and torch.cuda.is_available():
        t = t.pin_memory()
    return t


def _wait_for_copies(device: torch.device) -> None:
    """Wait until the copies queued on ``device``'s current stream are done. Copies between the
    model (on CUDA) and the outer state (pinned host memory) are issued ``non_blocking``, a
    whole fragment at a time; the host waits once, before it reads what came from the device
    or overwrites what goes to it. Nothing to wait for on the CPU, where copies are done when
    they return."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class FragmentState:
    """One fragment's outer state: its global copy, where this group's local period started,
    and the outer optimizer over the global copy."""

    #: Copies between the model and the outer state are queued without blocking the host
    #: (waited for where the host needs them: :func:`_wait_for_copies`). False: each copy
    #: blocks, the reference the CUDA tests compare with.
    non_blocking = True

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        lr: float,
        momentum: float,
        nesterov: bool,
        momentum_every: int,
    ) -> None:
        self.params = dict(module.named_parameters())
        self.global_copy = {
            n: _state_tensor(local_tensor(p), device) for n, p in self.params.items()
        }
        self.period_start = {
            n: _state_tensor(local_tensor(p), device) for n, p in self.params.items()
        }
        self.outer: torch.optim.Optimizer
        if momentum_every > 1:
            self.outer = DelayedNesterov(
                list(self.global_copy.values()), lr=lr, momentum=momentum, delay=momentum_every
            )
        else:
            self.outer = torch.optim.SGD(
                list(self.global_copy.values()),
                lr=lr,
                momentum=momentum,
                nesterov=nesterov and momentum > 0,
            )
        #: Inner steps this group took since the fragment's last sync point.
        self.steps = 0
        #: Where the model's shards live (copies to and from it are queued on its stream).
        self.model_device = local_tensor(next(iter(self.params.values()))).device

    def numel(self) -> int:
        return sum(t.numel() for t in self.global_copy.values())

    @torch.no_grad()
    def model_to_global(self) -> None:
        """The model's current values become the global copy and the local start."""
        for name, p in self.params.items():
            self.global_copy[name].copy_(local_tensor(p.data), non_blocking=self.non_blocking)
        _wait_for_copies(self.model_device)
        for name in self.params:
            self.period_start[name].copy_(self.global_copy[name])

    @torch.no_grad()
    def pseudo_gradient(self, out: torch.Tensor) -> None:
        """Write start - model (this group's progress since its local period started, with
        the sign of a gradient) into the flat ``out``."""
        offset = 0
        for name, p in self.params.items():
            local = local_tensor(p.data)
            n = local.numel()
            view = out[offset : offset + n].view_as(local)
            view.copy_(self.period_start[name], non_blocking=self.non_blocking)
            view.sub_(local)
            offset += n
        _wait_for_copies(self.model_device)  # the host rewrites ``start`` next

    @torch.no_grad()
    def apply_average(self, flat: torch.Tensor) -> None:
        """One outer step on the global copy with the averaged pseudo-gradient ``flat``."""
        offset = 0
        for t in self.global_copy.values():
            n = t.numel()
            t.grad = (
                flat[offset : offset + n].view_as(t).to(t.device, non_blocking=self.non_blocking)
            )
            offset += n
        _wait_for_copies(flat.device)  # the outer step reads them on the host
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def follow_global(self) -> None:
        """Shift the local copy by how far the global copy is from the local start, and start
        the local period there: inner progress since is kept, what the period assumed about
        the global copy is replaced by what it is."""
        for name, p in self.params.items():
            local = local_tensor(p.data)
            shift = self.global_copy[name] - self.period_start[name]
            # ``shift`` is a fresh tensor nobody writes to: it may still be in flight below.
            local.add_(shift.to(local.device, non_blocking=self.non_blocking))
            self.period_start[name].copy_(self.global_copy[name])
        _wait_for_copies(self.model_device)  # the shifts are freed on return

    @torch.no_grad()
    def start_period(self, estimate: torch.Tensor | None, scale: float = 1.0) -> None:
        """Start the fragment's next local period at the global copy, moved by the outer step
        ``scale x estimate`` (a flat pseudo-gradient) would make when given (``eager``)."""
        offset = 0
        lr = self.outer.param_groups[0]["lr"]
        if estimate is not None:  # from the device to the host, all queued, waited for once
            grads = {}
            for name in self.params:
                n = self.period_start[name].numel()
                part = estimate[offset : offset + n].view_as(self.period_start[name])
                grads[name] = part.to(
                    self.period_start[name].device, non_blocking=self.non_blocking
                )
                offset += n
            _wait_for_copies(estimate.device)
        for name, p in self.params.items():
            target = self.period_start[name]
            target.copy_(self.global_copy[name])
            if estimate is not None:
                grad = grads[name] if scale == 1.0 else grads[name] * scale
                target.sub_(self._outer_direction(name, grad), alpha=lr)
            local_tensor(p.data).copy_(target, non_blocking=self.non_blocking)
        _wait_for_copies(self.model_device)  # ``start`` is rewritten at the next sync point

    def _outer_direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The direction the outer optimizer's next step takes the global copy ``name`` along
        for gradient ``grad``, its state left as it is."""
        copy = self.global_copy[name]
        if isinstance(self.outer, DelayedNesterov):
            return self.outer.direction(copy, grad)
        group = self.outer.param_groups[0]
        momentum = self.outer.state.get(copy, {}).get("momentum_buffer")
        return outer_sgd_direction(grad, momentum, group["momentum"], group["nesterov"])

    def delayed_state(self) -> dict[str, Any]:
        """Delayed Nesterov's state besides the momentum (a checkpoint needs it): where in
        its window the optimizer is, and the pseudo-gradients summed in the window so far
        (zeros where nothing is summed, so that every checkpoint has the same keys)."""
        if not isinstance(self.outer, DelayedNesterov):
            return {}
        sums = {}
        for name, p in self.params.items():
            summed = self.outer.state.get(self.global_copy[name], {}).get("grad_sum")
            if summed is None:
                summed = torch.zeros_like(self.global_copy[name])
            sums[name] = as_param_layout(p, summed)
        return {"outer_step": self.outer.param_groups[0]["step"], "grad_sum": sums}

    @torch.no_grad()
    def load_delayed_state(self, saved: dict[str, Any]) -> None:
        if not isinstance(self.outer, DelayedNesterov):
            return
        self.outer.param_groups[0]["step"] = int(saved["outer_step"])
        for name, value in saved["grad_sum"].items():
            target = self.global_copy[name]
            self.outer.state[target]["grad_sum"] = local_tensor(value).to(target.device, copy=True)

    def state_for_heal(self) -> dict[str, Any]:
        return {
            "global": dict(self.global_copy),
            "start": dict(self.period_start),
            "outer": self.outer.state_dict(),
            "steps": self.steps,
        }

    @torch.no_grad()
    def load_from_heal(self, state: dict[str, Any]) -> None:
        """The peer's global copy, outer state and local start (which goes with the model the
        peer sends alongside): this group goes on exactly as the peer."""
        for name, value in state["global"].items():
            self.global_copy[name].copy_(value)
            self.period_start[name].copy_(state["start"][name])
        self.outer.load_state_dict(state["outer"])
        # The peer's inner steps since the fragment's last sync point go with its model (a
        # group that was behind in a sync quorum then drops them: ``AsyncDiLoCo._after_heal``).
        self.steps = int(state.get("steps", 0))


def outer_sgd_direction(
    grad: torch.Tensor, momentum_buffer: torch.Tensor | None, momentum: float, nesterov: bool
) -> torch.Tensor:
    """The direction ``torch.optim.SGD`` (no weight decay, no dampening) steps along for
    ``grad`` with this momentum buffer, without changing the buffer: the estimate ``eager``
    applies is exactly the step the outer optimizer would take if every group had sent the
    same pseudo-gradient as this one."""
    if momentum == 0:
        return grad
    buf = grad.clone() if momentum_buffer is None else momentum_buffer * momentum + grad
    return grad + momentum * buf if nesterov else buf
