"""The trainer: builds every component from the config and runs the training loop.

Read top to bottom: ``__init__`` builds (device and ranks, fault tolerance, tokenizer, data,
model, optimizer, schedule, checkpointer, metrics); ``train`` is the loop; ``train_step`` is one
optimizer step. Subclasses (experiments) change behaviour through the small named extension
points marked "Extension point" rather than by copying this file.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.ft import FTManager, build_ft_manager
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics import MetricsProcessor, metrics_file
from torchtitan.components.optimizer import OptimizerState, build_optimizer
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import write_toml
from torchtitan.datasets.text import build_dataloader
from torchtitan.distributed import ParallelDims, init_distributed
from torchtitan.models import get_train_spec
from torchtitan.protocols.train_spec import InitWeights
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.events import EventFile, EventKind, attach_event_file, detach_event_file
from torchtitan.tools.logging import logger

#: Training (re)starts: ``first_step..last_step``, and what the throughput figures of this run
#: rest on (``parameters``, ``flops_per_token``, ``peak_flops``: None when unknown;
#: ``emulate_slowdown``: the compute factor of an emulated straggler, 1 for none).
TRAINING_STARTED = EventKind(
    "train.started",
    "Training steps {first_step}..{last_step}, {tokens_per_batch} tokens per batch per rank, "
    "dump folder {dump_folder}",
)
TRAINING_FINISHED = EventKind("train.finished", "Training finished after step {step}")
#: Synchronous FT: the step's commit failed; ``uncommitted_in_a_row`` counts toward
#: ``max_consecutive_failures`` (0: no limit).
STEP_NOT_COMMITTED = EventKind(
    "train.step_not_committed",
    "step {step} not committed (a replica group failed during it); retrying with the next batch",
    logging.WARNING,
)
#: Synchronous FT with ``metrics.log_param_digest``: this rank's parameters after the step.
PARAM_DIGEST = EventKind("train.param_digest", "param_digest step {step}: {digest}")
VALIDATION = EventKind(
    "train.validation", "validation: step {step}  loss: {loss:.4f}  ({seconds:.1f}s)"
)


class ModelState:
    """Checkpoint/heal view of the model: FQN-keyed, FSDP2 shards kept as DTensors."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class TrainState:
    """Counters that must survive a restart: the step and the tokens seen so far."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0

    def count_step(self, tokens: int = 0) -> None:
        """A step was taken (committed), on ``tokens`` tokens of this rank's."""
        self.step += 1
        self.tokens_seen += tokens

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


@dataclass
class StepResult:
    """What one ``train_step`` reports: loss and gradient norm (averaged over the job's ranks),
    and whether the step was committed (always True without fault tolerance)."""

    loss: float
    grad_norm: float
    committed: bool = True


class Trainer:
    """Trains ``job_config.model`` on ``job_config.training.dataset``."""

    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = job_config
        self.dump_folder = Path(job_config.job.dump_folder)
        training = job_config.training

        if training.deterministic:
            # cuBLAS needs a fixed workspace for deterministic matmuls.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if training.seed is None:
            logger.warning("training.seed is unset: using seed 0 for the model initialisation")
        self.seed = training.seed if training.seed is not None else 0

        if training.gc_freq > 0:
            gc.disable()  # collect on a schedule, not in the middle of a step
        self.parallel_dims: ParallelDims = init_distributed(job_config)
        self.device = self.parallel_dims.device
        self.train_state = TrainState()

        self.tokenizer = build_tokenizer(job_config)
        self.dataloader = build_dataloader(
            job_config,
            self.tokenizer,
            self.parallel_dims.data_rank,
            self.parallel_dims.data_world_size,
            split="train",
        )
        self.val_dataloader = None
        if job_config.validation.enable:
            # Sharded over this group's ranks only: every replica group validates the same
            # samples, so the losses of groups that hold the same model compare.
            self.val_dataloader = build_dataloader(
                job_config,
                self.tokenizer,
                self.parallel_dims.rank,
                self.parallel_dims.world_size,
                split="validation",
            )

        self.train_spec = get_train_spec(job_config.model.name)
        self.model_args = copy.deepcopy(self.train_spec.model_args[job_config.model.flavor])
        self.model_args.update_from_config(job_config, self.tokenizer.vocab_size)
        self.model = self.build_model()
        # FSDP2 casts the parameters itself (its mixed-precision policy); without it, autocast.
        self.autocast_dtype = (
            torch.bfloat16
            if training.mixed_precision_param == "bfloat16" and self.parallel_dims.dp_mesh is None
            else None
        )
        self.loss_fn = self.train_spec.build_loss_fn(job_config)
        n_params, self.flops_per_token = self.model_args.num_flops_per_token(training.seq_len)
        self.n_params = n_params
        logger.info(
            f"Model {job_config.model.name}/{job_config.model.flavor}: {n_params:,} parameters, "
            f"{self.flops_per_token / 1e6:.1f} MFLOPs per token, on {self.device}"
        )

        self.optimizer = self.build_optimizer(self.model)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, job_config)

        # The one registry of state: checkpoints save it, fault-tolerant healing sends it.
        self.states: dict[str, Stateful] = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.dataloader,
            "train_state": self.train_state,
        }
        self.ft: FTManager | None = None
        self.ft = self.build_ft_manager()
        if self.ft is not None:
            # The Manager's own step must survive a whole-job restart (checkpoints only: a
            # joiner gets it from torchft itself when healing).
            self.register_state("ft_manager", self.ft, heal=False)
        #: What averages gradients across replica groups every step (None: nothing does).
        self.step_ft: FTManager | None = self.build_step_ft()
        self.checkpointer = CheckpointManager(job_config, self.states)

        tb_folder = None
        if job_config.metrics.enable_tensorboard and self.parallel_dims.is_main_rank:
            tb_folder = self.dump_folder / job_config.metrics.save_tb_folder
            if job_config.fault_tolerance.enable:
                tb_folder = tb_folder / f"replica_{job_config.fault_tolerance.replica_id}"
        jsonl = metrics_file(job_config) if self.parallel_dims.is_main_rank else None
        self.metrics = MetricsProcessor(
            job_config, self.device, self.flops_per_token, tb_folder, jsonl
        )
        self.event_file: EventFile | None = None

    # ---- building blocks (extension points) --------------------------------------------------

    def build_model(self) -> nn.Module:
        """Build the model on ``meta``, parallelize it, then materialise and initialise it
        shard by shard: a 70B model never exists whole on one device, and the weights are the
        same for every rank count (``init_weights`` draws full tensors and keeps its shard)."""
        with torch.device("meta"):
            model = self.train_spec.model_cls(self.model_args)
        model = self.train_spec.parallelize_fn(model, self.parallel_dims.dp_mesh, self.job_config)
        model.to_empty(device=self.device)
        torch.manual_seed(self.seed)
        with torch.no_grad():
            cast(InitWeights, model).init_weights(buffer_device=self.device)
        model.train()
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Extension point: the inner optimizer."""
        return build_optimizer(model, self.job_config)

    def build_ft_manager(self) -> FTManager | None:
        """Extension point: the torchft Manager (None without ``fault_tolerance.enable``).

        The default runs synchronous fault-tolerant data parallel: gradients are averaged
        across replica groups every step.
        """
        return build_ft_manager(self.job_config, self.parallel_dims, self.states)

    def build_step_ft(self) -> FTManager | None:
        """Extension point: the fault tolerance that averages gradients every step (default
        :attr:`ft`; semi-sync: none, or its site's groups)."""
        return self.ft

    def register_state(self, name: str, state: Stateful, *, heal: bool = True) -> None:
        """Extension point: add state that checkpoints save and (with ``heal``) that a live
        peer sends to a joining replica group."""
        if name in self.states:
            raise ValueError(f"state {name!r} is already registered")
        self.states[name] = state
        if heal and self.ft is not None:
            self.ft.register_state(name, state)

    def load_checkpoint(self) -> None:
        """Extension point: resume from the newest checkpoint that passes its checksums (none:
        start at step 1). Raises ``CorruptCheckpointError`` when every one fails."""
        self.checkpointer.load()

    #: Whether every replica group holds the same parameters after each committed step
    #: (synchronous FT), so that ``metrics.log_param_digest`` logs a digest per step.
    params_agree_every_step: bool = True

    def join_replica_groups(self) -> None:
        """Extension point: with fault tolerance, after the checkpoint is loaded and before the
        loop. Starts the torchft Manager only now (a group becomes visible to the lighthouse
        when it is ready to train) and, for a new job, waits until every replica group is in
        the quorum so that the first group up does not train alone."""
        assert self.ft is not None
        self.ft.start()
        if self.train_state.step == 0:
            self.ft.wait_for_full_quorum()

    def train_context(self) -> contextlib.AbstractContextManager:
        """Extension point: a context entered around the whole training loop."""
        return contextlib.nullcontext()

    # ---- one step ----------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        """``training.mixed_precision_param=bfloat16`` where FSDP2 does not apply it (one rank
        per group): the forward in bf16 autocast, the weights and gradients float32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward on one batch; returns the (detached) loss. With
        ``training.emulate_slowdown`` > 1, the extra work first, its gradients dropped."""
        slowdown = self.job_config.training.emulate_slowdown
        if slowdown > 1:
            self._emulate_slowdown(inputs, labels, slowdown - 1)
        return self._forward_backward_once(inputs, labels)

    def _emulate_slowdown(self, inputs: torch.Tensor, labels: torch.Tensor, extra: float) -> None:
        """``extra`` times a step's forward and backward work: whole passes over the batch,
        then one over the matching fraction of its sequences; their gradients are dropped."""
        whole, part = int(extra), extra - int(extra)
        rows = round(part * inputs.shape[0])
        for batch in [slice(None)] * whole + ([slice(0, rows)] if rows else []):
            self._forward_backward_once(inputs[batch], labels[batch])
        for p in self.model.parameters():
            p.grad = None

    def _forward_backward_once(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs)
            loss = self.loss_fn(logits, labels)
        del logits  # free the largest activation before backward allocates gradients
        loss.backward()
        return loss.detach()

    def clip_gradients(self) -> torch.Tensor:
        """Clip to ``training.max_norm`` (0: no clipping); returns the total gradient norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.job_config.training.max_norm
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm if max_norm > 0 else float("inf"), foreach=True
        )
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return norm

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        """Extension point: one optimizer step on one batch.

        With fault tolerance, the step starts a quorum, averages gradients across the live
        replica groups and is applied only if every group agrees (``should_commit``); an
        uncommitted step leaves parameters and optimizer untouched.
        """
        ft = self.step_ft
        self.optimizer.zero_grad()
        if ft is not None:
            ft.start_step()
        loss = self.forward_backward(inputs, labels)
        if ft is not None:
            ft.allreduce_gradients(self.model)
        grad_norm = self.clip_gradients()
        if ft is not None and not ft.should_commit():
            return StepResult(self._mean_over_job(loss), grad_norm.item(), committed=False)
        self.optimizer.step()
        self.advance_schedule()
        return StepResult(self._mean_over_job(loss), grad_norm.item())

    def advance_schedule(self) -> None:
        """Extension point: after a committed step, the learning-rate schedule's step."""
        self.lr_scheduler.step()

    def _mean_over_job(self, value: torch.Tensor) -> float:
        if self.parallel_dims.world_size > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return value.item()

    # ---- validation --------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over ``validation.steps`` batches of the held-out split (all ranks)."""
        assert self.val_dataloader is not None
        self.model.eval()
        max_batches = self.job_config.validation.steps
        total = torch.zeros(2, device=self.device)  # sum of batch losses, batch count
        batches = iter(self.val_dataloader)
        while max_batches < 0 or total[1] < max_batches:
            batch = next(batches, None)
            # Every rank must run the same number of forwards (FSDP all-gathers in each):
            # stop as soon as any rank runs out of validation data.
            have = torch.tensor([0.0 if batch is None else 1.0], device=self.device)
            if self.parallel_dims.world_size > 1:
                dist.all_reduce(have, op=dist.ReduceOp.MIN)
            if have.item() == 0:
                break
            assert batch is not None  # every rank has one: the MIN above is 1
            inputs, labels = (t.to(self.device) for t in batch)
            with self.autocast():
                total[0] += self.loss_fn(self.model(inputs), labels).float()
            total[1] += 1
        self.model.train()
        if self.parallel_dims.world_size > 1:
            dist.all_reduce(total)
        return (total[0] / total[1].clamp(min=1)).item()

    # ---- the loop ----------------------------------------------------------------------------

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Training batches on the training device, forever (the dataloader loops epochs)."""
        for inputs, labels in self.dataloader:
            yield inputs.to(self.device), labels.to(self.device)

    def train(self) -> None:
        """Resume if a checkpoint exists, then train until ``training.steps``."""
        cfg = self.job_config
        if self.event_file is None:
            # Attached here rather than in __init__: a constructor that raises leaves no handler
            # on the shared logger, and every fact worth an event happens from here on.
            ft = cfg.fault_tolerance
            self.event_file = attach_event_file(
                self.dump_folder, ft.replica_id if ft.enable else None, self.parallel_dims.rank
            )
        self.load_checkpoint()
        self.metrics.start(self.train_state.step)
        if self.parallel_dims.is_main_rank:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            write_toml(cfg, self.dump_folder / self.config_file_name())
        total_steps = cfg.training.steps
        tokens_per_batch = cfg.training.local_batch_size * cfg.training.seq_len
        TRAINING_STARTED.emit(
            first_step=self.train_state.step + 1,
            last_step=total_steps,
            tokens_per_batch=tokens_per_batch,
            dump_folder=str(self.dump_folder),
            parameters=self.n_params,
            flops_per_token=self.flops_per_token,
            peak_flops=self.metrics.peak,
            world_size=self.parallel_dims.world_size,
            emulate_slowdown=cfg.training.emulate_slowdown,
        )
        batches = self.batches()
        if self.ft is not None:
            self.join_replica_groups()
        with self.train_context():
            while not self.training_done():
                inputs, labels = next(batches)
                self.metrics.count(inputs.numel())
                result = self.train_step(inputs, labels)
                if not result.committed:
                    assert self.step_ft is not None
                    STEP_NOT_COMMITTED.emit(
                        step=self.train_state.step + 1,
                        uncommitted_in_a_row=self.step_ft.uncommitted_in_a_row,
                        max_consecutive_failures=self.step_ft.max_consecutive_failures,
                    )
                    continue
                self.train_state.count_step(inputs.numel())
                self.after_step(result)
        self.metrics.close()
        if self.ft is not None:
            self.ft.check_progress()
        TRAINING_FINISHED.emit(step=self.train_state.step)

    def training_done(self) -> bool:
        """Extension point: whether training is over (``training.steps`` steps taken). Asked
        before every step and after it (the last step logs, validates and checkpoints)."""
        return self.train_state.step >= self.job_config.training.steps

    def after_step(self, result: StepResult) -> None:
        """Logging, validation, checkpointing and housekeeping after a committed step."""
        cfg = self.job_config
        step = self.train_state.step
        last = self.training_done()
        if step == 1 or step % cfg.metrics.log_freq == 0 or last:
            # Groups in the last quorum (semi-sync: the last sync; none before the first).
            groups = self.ft.manager.num_participants() if self.ft and self.ft.started else None
            self.metrics.log_step(step, result.loss, result.grad_norm, groups)
        start = time.perf_counter()
        if cfg.metrics.log_param_digest and self.ft is not None and self.params_agree_every_step:
            PARAM_DIGEST.emit(step=step, digest=tensor_digest(self.model.parameters()))
        if self.val_dataloader is not None and (step % cfg.validation.freq == 0 or last):
            val_loss = self.validate()
            VALIDATION.emit(step=step, loss=val_loss, seconds=time.perf_counter() - start)
            self.metrics.write_scalars(step, {"validation/loss": val_loss})
        if self.checkpointer.should_save(step, last):
            self.checkpointer.save(step)
        if cfg.training.gc_freq > 0 and step % cfg.training.gc_freq == 0:
            gc.collect(1)
        self.metrics.exclude_time(time.perf_counter() - start)

    def config_file_name(self) -> str:
        ft = self.job_config.fault_tolerance
        return f"config_replica_{ft.replica_id}.toml" if ft.enable else "config.toml"

    def close(self) -> None:
        """Release the process groups, the torchft Manager and the event file."""
        for ft in {id(f): f for f in (getattr(self, "step_ft", None), self.ft) if f}.values():
            ft.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.event_file is not None:
            detach_event_file(self.event_file)
            self.event_file = None
