"""Semi-synchronous training across replica groups: torchft's LocalSGD and (Streaming) DiLoCo.

``SemiSyncTrainer`` is the core ``Trainer`` with three differences:

* its torchft Manager uses a synchronous quorum (DiLoCo requires it; a quorum happens only at
  syncs, every ``sync_steps`` inner steps, not every step);
* ``train_step`` is a plain local step; the sync runs inside ``optimizer.step()``, from the
  optimizer hooks that torchft's ``LocalSGD``/``DiLoCo`` install while ``train_context`` is
  entered;
* the algorithm's state (DiLoCo: global parameters and outer optimizer of every fragment; both:
  the inner-step position in the sync period) is registered with the checkpointer.

Failure semantics (torchft's, stated here because users rely on them):

* A sync commits only if every group in its quorum finished the all-reduce (``should_commit``).
  A failed DiLoCo sync restores the fragment's last global parameters (the local progress of
  that period is dropped) and the same fragment is retried at the next sync; a failed LocalSGD
  sync keeps each group's local parameters.
* A group that dies is dropped at the next quorum (after the lighthouse's heartbeat timeout);
  survivors keep doing inner steps meanwhile, and sync among themselves.
* A restarted group joins the quorum of the next sync and heals there: a live peer sends it
  the model, inner optimizer, LR schedule, step and (DiLoCo) global parameters plus outer
  optimizer state, all as they are at that sync, so the sync it joins averages identical
  pseudo-gradients and afterwards every group holds the same global parameters.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.ft import FTManager, build_ft_manager
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.logging import logger
from torchtitan.trainer import StepResult, Trainer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ModelFragment(nn.Module):
    """A set of the model's modules that DiLoCo syncs together (their parameters are shared
    with the model, not copied)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)


def build_model_fragments(model: nn.Module, job_config: JobConfig) -> list[nn.Module]:
    """The model split as ``[fault_tolerance]`` says: by FQN lists, or into ``num_fragments``
    runs of consecutive blocks (embeddings with the first, norm and output with the last).
    Parameters of modules listed nowhere join the last fragment."""
    ft = job_config.fault_tolerance
    if ft.module_fqns_per_model_fragment:
        names = [list(fragment) for fragment in ft.module_fqns_per_model_fragment]
    elif ft.num_fragments == 1:
        return [model]
    else:
        blocks = [f"layers.{key}" for key in model.layers.keys()]  # type: ignore[union-attr]
        n = ft.num_fragments
        bounds = [round(i * len(blocks) / n) for i in range(n + 1)]
        names = [blocks[bounds[i] : bounds[i + 1]] for i in range(n)]
    modules = dict(model.named_modules())
    fragments = [[modules[name] for name in fragment] for fragment in names]
    covered = {id(p) for fragment in fragments for m in fragment for p in m.parameters()}
    leftovers = [
        m
        for name, m in model.named_children()
        if name != "layers" and not any(id(p) in covered for p in m.parameters())
    ]
    leftovers += [
        m
        for m in getattr(model, "layers", {}).values()  # type: ignore[union-attr]
        if not any(id(p) in covered for p in m.parameters())
    ]
    # Embeddings first, the rest last: keeps the natural order when splitting by count.
    if not ft.module_fqns_per_model_fragment and hasattr(model, "tok_embeddings"):
        fragments[0].insert(0, model.tok_embeddings)
        leftovers = [m for m in leftovers if m is not model.tok_embeddings]
    fragments[-1].extend(leftovers)
    return [ModelFragment(fragment) for fragment in fragments]


class SemiSyncState:
    """Checkpoint view of the algorithm: per-fragment global parameters and outer optimizer
    (DiLoCo), and the inner-step position in the sync period."""

    def __init__(self, trainer: SemiSyncTrainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        algo = self.trainer.algorithm
        state: dict[str, Any] = {"local_step": algo._local_step}
        for i, fragment in enumerate(getattr(algo, "_fragments", [])):
            state[f"fragment_{i}"] = {
                "global_parameters": {
                    name: _as_like(param, fragment.original_parameters[name])
                    for name, param in fragment._model_fragment.named_parameters()
                },
                "outer_optimizer": fragment._outer_optimizer.state_dict(),
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        algo = self.trainer.algorithm
        algo._local_step = int(state["local_step"])
        for i, fragment in enumerate(getattr(algo, "_fragments", [])):
            saved = state[f"fragment_{i}"]
            for name, value in saved["global_parameters"].items():
                fragment.original_parameters[name].copy_(_local(value))
            fragment._outer_optimizer.load_state_dict(saved["outer_optimizer"])


def _as_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a shard of the global copy) as a DTensor laid out like ``param``, so DCP
    stores one logical tensor instead of one per rank."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local


class SemiSyncTrainer(Trainer):
    """Runs ``fault_tolerance.semi_sync_method``; without one, exactly the core trainer."""

    def __init__(self, job_config: JobConfig) -> None:
        self.method = job_config.fault_tolerance.method
        super().__init__(job_config)
        if self.method is None:
            return
        ft = job_config.fault_tolerance
        assert self.ft is not None
        manager = self.ft.manager
        if self.method == "localsgd":
            from torchft.local_sgd import LocalSGD

            self.algorithm: Any = LocalSGD(manager, self.model, self.optimizer, ft.sync_steps)
            self.fragments: list[nn.Module] = [self.model]
        else:
            from torchft.local_sgd import DiLoCo

            self.fragments = build_model_fragments(self.model, job_config)
            outer = [
                torch.optim.SGD(
                    fragment.parameters(),
                    lr=ft.outer_lr,
                    momentum=ft.outer_momentum,
                    nesterov=ft.outer_nesterov,
                )
                for fragment in self.fragments
            ]
            self.algorithm = DiLoCo(
                manager,
                self.fragments,
                self.optimizer,
                outer,
                sync_every=ft.sync_steps,
                backup_device=self.device,
                should_quantize=ft.should_quantize,
                fragment_sync_delay=ft.fragment_sync_delay,
                fragment_update_alpha=ft.fragment_update_alpha,
            )
        # DiLoCo registers its global parameters and outer optimizers for healing itself;
        # checkpoints need them too.
        self.register_state("semi_sync", SemiSyncState(self), heal=False)
        self._sync_start = 0.0
        self._pseudo_grad_norm = float("nan")
        self._manager_step = 0
        logger.info(
            f"[semi-sync] {self.method}: sync every {ft.sync_steps} inner steps, "
            f"{len(self.fragments)} fragment(s)"
            + (
                f", outer SGD lr {ft.outer_lr} momentum {ft.outer_momentum} "
                f"nesterov {ft.outer_nesterov}, delay {ft.fragment_sync_delay}, "
                f"alpha {ft.fragment_update_alpha}"
                if self.method == "diloco"
                else ""
            )
        )

    # Semi-sync groups meet only at syncs; torchft heals a late group at its first sync.
    @property
    def wait_for_all_groups(self) -> bool:  # type: ignore[override]
        return self.method is None

    def build_ft_manager(self) -> FTManager | None:
        if self.method is None:
            return super().build_ft_manager()
        # Every group initialises the model from the same seed, so the step-0 weight sync
        # (init_sync) is not needed; with it, all but one group would throw away their first
        # sync period.
        return build_ft_manager(
            self.job_config,
            self.parallel_dims,
            self.states,
            use_async_quorum=False,
            init_sync=False,
        )

    def train_context(self) -> contextlib.AbstractContextManager:
        if self.method is None:
            return super().train_context()
        stack = contextlib.ExitStack()
        # Hooks run in registration order: ours before torchft's marks the start of a sync,
        # ours after it reports the result.
        stack.callback(self.optimizer.register_step_post_hook(self._before_sync).remove)
        stack.enter_context(self.algorithm)
        stack.callback(self.optimizer.register_step_post_hook(self._after_sync).remove)
        return stack

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        if self.method is None:
            return super().train_step(inputs, labels)
        self.optimizer.zero_grad()
        loss = self.forward_backward(inputs, labels)
        grad_norm = self.clip_gradients()
        self.optimizer.step()  # torchft's hook syncs here every sync period
        self.lr_scheduler.step()
        return StepResult(self._mean_over_job(loss), grad_norm.item())

    # ---- sync visibility ---------------------------------------------------------------------

    def _sync_period(self) -> int:
        return self.job_config.fault_tolerance.sync_steps // len(self.fragments)

    def _syncs_now(self) -> bool:
        """Whether torchft's hook, which runs next, completes a sync at this step."""
        return self.algorithm._local_step + 1 >= self._sync_period()

    def _fragment_now(self) -> int:
        return self.ft.manager.current_step() % len(self.fragments)  # type: ignore[union-attr]

    @torch.no_grad()
    def _before_sync(self, *_: Any) -> None:
        if not self._syncs_now():
            return
        self._manager_step = self.ft.manager.current_step()  # type: ignore[union-attr]
        self._pseudo_grad_norm = float("nan")
        if self.method == "diloco" and self.job_config.fault_tolerance.fragment_sync_delay == 0:
            fragment = self.algorithm._fragments[self._fragment_now()]
            squares = torch.zeros((), dtype=torch.float64)
            for name, p in fragment._model_fragment.named_parameters():
                diff = fragment.original_parameters[name] - _local(p.data)
                squares += diff.double().pow(2).sum().cpu()
            self._pseudo_grad_norm = squares.sqrt().item()
        self._sync_start = time.perf_counter()

    def _after_sync(self, *_: Any) -> None:
        if self.algorithm._local_step != 0:
            return
        manager = self.ft.manager  # type: ignore[union-attr]
        seconds = time.perf_counter() - self._sync_start
        committed = manager.current_step() > self._manager_step
        fragment_index = self._manager_step % len(self.fragments)
        fragment = self.fragments[fragment_index]
        payload = sum(_local(p).numel() * p.element_size() for p in fragment.parameters())
        groups = manager.num_participants()
        step = self.train_state.step + 1
        norm = (
            "n/a"
            if self._pseudo_grad_norm != self._pseudo_grad_norm
            else (f"{self._pseudo_grad_norm:.4f}")
        )
        logger.info(
            f"[semi-sync] step {step} sync: {self.method} fragment {fragment_index}/"
            f"{len(self.fragments)}  {'committed' if committed else 'NOT committed'}  "
            f"time {seconds * 1000:.0f} ms  sent {payload / 2**20:.2f} MiB  groups {groups}  "
            f"quorum {manager._quorum_id}  pseudo_grad_norm {norm}  sync #{manager.current_step()}"
        )
        scalars = {
            "sync/seconds": seconds,
            "sync/bytes_sent": float(payload),
            "sync/groups": float(groups),
            "sync/committed": float(committed),
            "sync/fragment": float(fragment_index),
            "sync/quorum_id": float(manager._quorum_id),
        }
        if norm != "n/a":
            scalars["sync/pseudo_grad_norm"] = self._pseudo_grad_norm
        self.metrics.write_scalars(step, scalars)
        if self.job_config.metrics.log_param_digest:
            logger.info(f"global_digest sync {manager.current_step()}: {self.global_digest()}")

    def global_digest(self) -> str:
        """Digest of the global parameters every group should hold after a sync: DiLoCo's
        global copies of all fragments, or LocalSGD's averaged model parameters."""
        if self.method == "diloco":
            return tensor_digest(
                t
                for fragment in self.algorithm._fragments
                for t in fragment.original_parameters.values()
            )
        return tensor_digest(self.model.parameters())
