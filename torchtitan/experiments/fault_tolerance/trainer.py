"""Semi-synchronous training across replica groups: torchft's LocalSGD and (Streaming) DiLoCo.

``SemiSyncTrainer`` is the core ``Trainer`` with these differences:

* its torchft Manager uses a synchronous quorum (DiLoCo requires it): groups meet only at
  syncs, not at every step;
* ``train_step`` is a plain local step; the sync runs inside ``optimizer.step()``, from the
  optimizer hooks that torchft's ``LocalSGD``/``DiLoCo`` install while ``train_context`` is
  entered;
* before step 1 it waits until every replica group is up (heartbeating at the lighthouse), so
  that the first sync of a new or resumed job is not made by the fastest group alone;
* the algorithm's state (DiLoCo: global parameters and outer optimizer of every fragment; both:
  the inner-step position in the sync period) is registered with the checkpointer;
* every sync is reported (log line, TensorBoard/JSONL scalars, optional digest of the global
  parameters), and a group that heals checks that it is at its peer's point of the period.

Failure semantics (torchft's, stated here because users rely on them):

* A sync commits only if every group in its quorum finished the all-reduce (``should_commit``).
  A failed DiLoCo sync restores the fragment's last global parameters (the local progress of
  that fragment in that period is dropped) and the same fragment is retried at the next sync;
  a failed LocalSGD sync keeps each group's local parameters.
* A group that dies is dropped at the next quorum (after the lighthouse's heartbeat timeout);
  survivors keep doing inner steps meanwhile, and sync among themselves.
* A restarted group trains its first period alone, then asks for a quorum at its own sync
  point; the lighthouse answers when the survivors reach theirs. The restarted group is behind
  (its Manager step is lower), so it heals in that quorum: a live peer sends the model, inner
  optimizer, LR schedule, step and (DiLoCo) global parameters plus outer optimizer state, all as
  they are at that moment (read when sent, never a copy from start-up). Both groups are then at
  the same point of the sync period (checked), average identical pseudo-gradients (or
  parameters), and afterwards hold the same global parameters. Its own first period is thrown
  away. The lighthouse never lets it sync alone while a peer is alive: a quorum needs more than
  half of the heartbeating groups.
"""

from __future__ import annotations

import contextlib
import re
import time
import urllib.request
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.ft import FTManager, build_ft_manager, lighthouse_address
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.logging import logger
from torchtitan.trainer import StepResult, Trainer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---- model fragments -----------------------------------------------------------------------


class ModelFragment(nn.Module):
    """Some of the model's parameters, synced together by Streaming DiLoCo. The parameters are
    the model's own objects (not copies), registered under their model FQN with ``.`` -> ``__``.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        for name, param in named_params:
            self.register_parameter(name.replace(".", "__"), param)

    def fqns(self) -> list[str]:
        return [name.replace("__", ".") for name, _ in self.named_parameters()]


def fragment_module_names(model: nn.Module, job_config: JobConfig) -> list[list[str]]:
    """Module FQNs of each fragment, as ``[fault_tolerance]`` says: the explicit lists, or
    ``num_fragments`` runs of consecutive transformer blocks (embeddings with the first)."""
    ft = job_config.fault_tolerance
    if ft.module_fqns_per_model_fragment:
        return [list(names) for names in ft.module_fqns_per_model_fragment]
    blocks = [f"layers.{key}" for key in model.layers.keys()]  # type: ignore[union-attr]
    n = ft.num_fragments
    bounds = [round(i * len(blocks) / n) for i in range(n + 1)]
    names = [blocks[bounds[i] : bounds[i + 1]] for i in range(n)]
    if hasattr(model, "tok_embeddings"):
        names[0].insert(0, "tok_embeddings")
    return names


def build_model_fragments(model: nn.Module, job_config: JobConfig) -> list[nn.Module]:
    """The model split into its sync fragments. One fragment: the model itself. Every parameter
    is in exactly one fragment: parameters of modules listed nowhere (e.g. the final norm and
    output, or the rest of a block when only ``layers.0.attention`` is listed) join the last."""
    ft = job_config.fault_tolerance
    if ft.num_fragments == 1 and not ft.module_fqns_per_model_fragment:
        return [model]
    modules = dict(model.named_modules())
    owner: dict[int, int] = {}
    for index, names in enumerate(fragment_module_names(model, job_config)):
        for name in names:
            for p in modules[name].parameters():
                owner.setdefault(id(p), index)
    count = ft.fragment_count()
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(count)]
    for name, p in model.named_parameters():
        groups[owner.get(id(p), count - 1)].append((name, p))
    return [ModelFragment(group) for group in groups]


# ---- checkpointed state --------------------------------------------------------------------


def _as_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a DTensor laid out like ``param`` (sharing storage), so
    DCP stores one logical tensor instead of one per rank and loads in place."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local


class SemiSyncState:
    """Checkpoint view of the algorithm: the inner-step position in the sync period and, for
    DiLoCo, each fragment's global parameters and outer-optimizer momentum.

    Together with the Manager's step (``ft_manager``) and the core state (model, inner
    optimizer, LR schedule, data position, step), a whole-job restart resumes exactly where the
    job was. Healing does not use this: torchft sends DiLoCo's own copy of it, and a joiner
    always heals at the same point of the period as its peers.
    """

    def __init__(self, trainer: SemiSyncTrainer) -> None:
        self.trainer = trainer

    def _fragments(self) -> list[Any]:
        return list(getattr(self.trainer.algorithm, "_fragments", []))

    def state_dict(self) -> dict[str, Any]:
        algo = self.trainer.algorithm
        in_flight = [i for i, f in enumerate(self._fragments()) if f._allreduce_work]
        state: dict[str, Any] = {
            "local_step": algo._local_step,
            "in_flight_fragment": in_flight[0] if in_flight else -1,
        }
        for i, fragment in enumerate(self._fragments()):
            outer = fragment._outer_optimizer
            params = dict(fragment._model_fragment.named_parameters())
            momentum = {
                name: outer.state.get(p, {}).get("momentum_buffer") for name, p in params.items()
            }
            state[f"fragment_{i}"] = {
                "global_parameters": {
                    name: _as_like(p, fragment.original_parameters[name])
                    for name, p in params.items()
                },
                "has_momentum": all(m is not None for m in momentum.values()),
                # Placeholders where the outer optimizer has not stepped yet, so that a fresh
                # process offers DCP a tensor to load the saved momentum into.
                "outer_momentum": {
                    name: m if m is not None else torch.zeros_like(params[name].detach())
                    for name, m in momentum.items()
                },
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        algo = self.trainer.algorithm
        algo._local_step = int(state["local_step"])
        fragments = self._fragments()
        for i, fragment in enumerate(fragments):
            saved = state[f"fragment_{i}"]
            for name, value in saved["global_parameters"].items():
                fragment.original_parameters[name].copy_(_local(value))
            outer = fragment._outer_optimizer
            outer.state.clear()
            if saved["has_momentum"]:
                params = dict(fragment._model_fragment.named_parameters())
                for name, value in saved["outer_momentum"].items():
                    outer.state[params[name]]["momentum_buffer"] = value.detach().clone()
        in_flight = int(state.get("in_flight_fragment", -1))
        if in_flight >= 0:
            # Saved while a fragment's all-reduce was in flight (fragment_sync_delay > 0): its
            # result is lost. Do what torchft does for a failed sync: put the fragment back to
            # its global parameters and start the period again; the fragment is retried.
            fragments[in_flight].restore_parameters()
            algo._local_step = 0
            logger.warning(
                f"[semi-sync] the checkpoint was taken while fragment {in_flight}'s sync was in "
                "flight; that sync is dropped and the fragment restarts from its global "
                "parameters"
            )


# ---- the trainer ---------------------------------------------------------------------------


_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")
_QUORUM_MEMBER = re.compile(r"<b>([^<\s]+)</b>")
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*([^\s<]+): seen')


def lighthouse_status(address: str, timeout_s: float = 5.0) -> tuple[int, bool] | None:
    """(replica groups alive, whether a group of the last quorum is alive, i.e. a job is
    running), read from the lighthouse's status page: torchft 0.2.0 has no RPC for either.
    None when the page cannot be read or parsed."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(f"{address.rstrip('/')}/status", timeout=timeout_s) as response:
            page = response.read().decode("utf-8", "replace")
    except OSError:
        return None
    alive = _HEARTBEATING.search(page)
    if alive is None:
        return None
    _, _, last_quorum = page.partition("Previous Quorum")
    last_quorum, _, heartbeats = last_quorum.partition("Heartbeats")
    members = set(_QUORUM_MEMBER.findall(last_quorum))
    fresh = {replica for old, replica in _HEARTBEAT.findall(heartbeats) if not old}
    return int(alive.group(1)), bool(members & fresh)


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
        self.fragments: list[nn.Module]
        if self.method == "localsgd":
            from torchft.local_sgd import LocalSGD

            self.algorithm: Any = LocalSGD(manager, self.model, self.optimizer, ft.sync_steps)
            self.fragments = [self.model]
            self.period, self.delay = ft.sync_steps, 0
        else:
            from torchft.local_sgd import DiLoCo

            self.fragments = build_model_fragments(self.model, job_config)
            outer = [
                torch.optim.SGD(
                    fragment.parameters(),
                    lr=ft.outer_lr,
                    momentum=ft.outer_momentum,
                    # torch refuses Nesterov without momentum; with 0 it is plain SGD anyway.
                    nesterov=ft.outer_nesterov and ft.outer_momentum > 0,
                )
                for fragment in self.fragments
            ]
            # torchft registers each fragment's global parameters and outer optimizer for
            # healing itself (under fixed keys: build it once per Manager).
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
            self.period = ft.sync_steps // len(self.fragments)
            self.delay = ft.fragment_sync_delay
            for optimizer in outer:
                optimizer.register_step_pre_hook(self._measure_pseudo_gradient)
        self.register_state("semi_sync", SemiSyncState(self), heal=False)
        # Not a checkpointed state: only what a joiner needs to check that it heals at the
        # same point of the sync period as the peer that sends it the state.
        manager.register_state_dict_fn("semi_sync_position", self._check_heal, self._position_now)
        self._sync_seconds = 0.0
        self._hook_start = 0.0
        self._pseudo_grad_norm: float | None = None
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
        if len(self.fragments) > 1:
            for i, fragment in enumerate(self.fragments):
                names = fragment.fqns()  # type: ignore[operator]
                logger.info(
                    f"[semi-sync] fragment {i}: {len(names)} tensors, {names[0]} .. {names[-1]}"
                )

    # ---- extension points of the core trainer ------------------------------------------------

    # The core's pre-step-1 barrier is a quorum. Semi-sync groups must meet only at sync points
    # (a restarted group that took a quorum at start-up would heal mid-sync and fall out of
    # step with its peers), so ``train_context`` waits on heartbeats instead.
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
        start = time.perf_counter()
        self.wait_for_groups_up()
        self.metrics.exclude_time(time.perf_counter() - start)  # not training time
        stack = contextlib.ExitStack()
        # Post-hooks run in registration order: ours before torchft's starts the clock of a
        # sync, ours after it reports the result.
        stack.callback(self.optimizer.register_step_post_hook(self._before_torchft).remove)
        stack.enter_context(self.algorithm)
        stack.callback(self.optimizer.register_step_post_hook(self._after_torchft).remove)
        return stack

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        if self.method is None:
            return super().train_step(inputs, labels)
        self.optimizer.zero_grad()
        loss = self.forward_backward(inputs, labels)
        grad_norm = self.clip_gradients()
        self.optimizer.step()  # torchft's hook syncs here at the end of each sync period
        self.lr_scheduler.step()
        return StepResult(self._mean_over_job(loss), grad_norm.item())

    # ---- start-up ----------------------------------------------------------------------------

    def wait_for_groups_up(self, poll_s: float = 0.5) -> None:
        """Before step 1 of a new or resumed job, wait (at most ``quorum_timeout_s``) until all
        ``group_size`` replica groups heartbeat at the lighthouse. From then on the lighthouse
        holds a first quorum open for every group that is up (``join_timeout_ms``), so the
        first sync is made by all groups, not by the fastest alone. A group that (re)joins a
        running job (a group of the last quorum is alive) does not wait."""
        ft = self.job_config.fault_tolerance
        address = lighthouse_address(self.job_config)
        start = last_report = time.perf_counter()
        while True:
            status = lighthouse_status(address)
            if status is None:
                logger.warning(
                    f"[semi-sync] cannot read the lighthouse's status page at {address}; "
                    "not waiting for the other replica groups"
                )
                return
            alive, running = status
            now = time.perf_counter()
            if running or alive >= ft.group_size:
                if now - start > 1:
                    logger.info(f"[semi-sync] {alive}/{ft.group_size} replica groups up")
                return
            if now - start > ft.quorum_timeout_s:
                logger.warning(
                    f"[semi-sync] only {alive}/{ft.group_size} replica groups up after "
                    f"{ft.quorum_timeout_s:.0f}s; starting anyway"
                )
                return
            if now - last_report > 5:
                logger.info(f"[semi-sync] waiting for replica groups: {alive}/{ft.group_size} up")
                last_report = now
            time.sleep(poll_s)

    # ---- healing ---------------------------------------------------------------------------

    def _position_now(self) -> dict[str, int]:
        replica_id = self.job_config.fault_tolerance.replica_id
        return {"local_step": self.algorithm._local_step, "replica_id": replica_id}

    def _check_heal(self, peer: dict[str, int]) -> None:
        """Runs on a joiner after torchft loaded the peer's state (inside the quorum of a
        sync). Both must be at the same inner step of the period, or the sync that follows
        would pair different operations (a hang, or a wrong average): stop loudly instead."""
        mine = self.algorithm._local_step
        if peer["local_step"] != mine:
            raise RuntimeError(
                f"[semi-sync] healed from replica group {peer['replica_id']} at inner step "
                f"{peer['local_step']} of its sync period, but this group is at {mine}"
            )
        logger.info(
            f"[semi-sync] healed from a live peer (replica group {peer['replica_id']}) at sync "
            f"#{self.ft.manager.current_step() + 1}, train step "  # type: ignore[union-attr]
            f"{self.train_state.step + 1}, inner step {mine}/{self.period}"
        )

    # ---- sync visibility ---------------------------------------------------------------------

    def _position(self) -> tuple[bool, bool]:
        """(prepares, performs): what torchft's hook, which runs next, does at this step."""
        local_step = self.algorithm._local_step + 1
        return local_step == self.period - self.delay, local_step == self.period

    def _before_torchft(self, *_: Any) -> None:
        prepares, performs = self._position()
        if prepares:
            self._sync_seconds = 0.0
            self._pseudo_grad_norm = None
        if prepares or performs:
            # The inner step is done and the next step starts from zero_grad: free the inner
            # gradients now, so that torchft's pseudo-gradients and the local parameter copy
            # it makes for the sync take their place instead of adding to them.
            self.optimizer.zero_grad(set_to_none=True)
            self._hook_start = time.perf_counter()

    @torch.no_grad()
    def _measure_pseudo_gradient(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Outer-optimizer pre-hook: the fragment's gradients are now the pseudo-gradients
        averaged over the groups (the same in every group), whatever the delay."""
        grads = [
            _local(p.grad)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        if grads:  # one fused norm (its time counts in the sync's): not a loop of reductions
            squares += torch.nn.utils.get_total_norm(grads).double().square()
        if self.parallel_dims.world_size > 1:  # shards of one group: sum over its ranks
            dist.all_reduce(squares)
        self._pseudo_grad_norm = squares.sqrt().item()

    def _after_torchft(self, *_: Any) -> None:
        local_step = self.algorithm._local_step
        prepared = local_step == self.period - self.delay  # only reachable when delay > 0
        performed = local_step == 0  # torchft resets the position after a sync
        if not (prepared or performed):
            return
        self._sync_seconds += time.perf_counter() - self._hook_start
        if performed:
            self._report_sync()

    def _report_sync(self) -> None:
        manager = self.ft.manager  # type: ignore[union-attr]
        # torchft 0.2.0 has no public accessor for these two: the failure count is reset to 0
        # by a commit and raised by a failed one, so right after should_commit it is the
        # verdict of this sync.
        committed = getattr(manager, "_commit_failures", 0) == 0
        quorum_id = getattr(manager, "_quorum_id", -1)
        # The number of this sync: the Manager's step it makes (a failed one is retried
        # under the same number).
        sync_number = manager.current_step() + (0 if committed else 1)
        fragment_index = (sync_number - 1) % len(self.fragments)
        fragment = self.fragments[fragment_index]
        payload = sum(_local(p).numel() * p.element_size() for p in fragment.parameters())
        groups = manager.num_participants()
        step = self.train_state.step + 1
        norm = self._pseudo_grad_norm if committed else None
        logger.info(
            f"[semi-sync] step {step} sync: {self.method} fragment {fragment_index}/"
            f"{len(self.fragments)}  {'committed' if committed else 'NOT committed'}  "
            f"time {self._sync_seconds * 1000:.0f} ms  sent {payload / 2**20:.2f} MiB  "
            f"groups {groups}  quorum {quorum_id}  "
            f"pseudo_grad_norm {'n/a' if norm is None else f'{norm:.4f}'}  sync #{sync_number}"
        )
        scalars = {
            "sync/seconds": self._sync_seconds,
            "sync/bytes_sent": float(payload),
            "sync/groups": float(groups),
            "sync/committed": float(committed),
            "sync/fragment": float(fragment_index),
            "sync/quorum_id": float(quorum_id),
        }
        if norm is not None:
            scalars["sync/pseudo_grad_norm"] = norm
        self.metrics.write_scalars(step, scalars)
        if committed and self.job_config.metrics.log_param_digest:
            logger.info(f"global_digest sync {sync_number}: {self.global_digest()}")

    def global_digest(self) -> str:
        """Digest of the global parameters every group holds after a sync: DiLoCo's global
        copies of all fragments, or LocalSGD's averaged model parameters (this rank's shards)."""
        if self.method == "diloco":
            return tensor_digest(
                t
                for fragment in self.algorithm._fragments
                for t in fragment.original_parameters.values()
            )
        return tensor_digest(self.model.parameters())
