"""The job configuration: one dataclass per TOML section, one docstring per field.

Values resolve as defaults < ``--job.config_file`` TOML < command-line flags
(``--section.field=value``). The docstrings below are what ``--help`` prints.
An experiment adds fields through ``--job.custom_args_module`` (see ``manager.py``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan.config.model_names import MODEL_FLAVORS, PUBLISHED_VOCABULARY


class ConfigError(ValueError):
    """A config value that is not allowed. ``field`` is its dotted name (``training.steps``);
    the message is one line: ``<field>: <value> is not allowed; <what is allowed>``."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = repr(value)
        if len(shown) > 80:  # keep the message to one readable line
            shown = shown[:77] + "..."
        super().__init__(f"{field}: {shown} is not allowed; {allowed}")


def _require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(field, value, allowed)


def _require_path(path: str | None, field: str) -> None:
    if path is not None and not os.path.exists(path):
        raise ConfigError(field, path, "no such file or folder; give an existing path")


def require_dataset_path(dataset: str, dataset_path: str | None, section: str) -> None:
    """``dataset=local`` reads files: it needs ``dataset_path`` (the datasets check it too)."""
    _require(
        dataset != "local" or bool(dataset_path),
        f"{section}.dataset",
        dataset,
        f"'local' reads files: give {section}.dataset_path (a file or folder)",
    )


def require_shard_degree(degree: int, world_size: int) -> None:
    """FSDP2 shards over all ranks of the job: ``data_parallel_shard_degree`` is -1 or the
    world size (``WORLD_SIZE``; ``run_train.sh`` sets it to ``NGPU`` for its config check)."""
    _require(
        degree in (-1, world_size),
        "parallelism.data_parallel_shard_degree",
        degree,
        f"this job has {world_size} rank(s) and shards over all of them: use -1 or {world_size}",
    )


def _cuda_available() -> bool:
    # torch is imported only when a value asks for cuda, so that parsing a config stays cheap.
    import torch

    return torch.cuda.is_available()


@dataclass
class Job:
    """Where the run writes its outputs, and which config file and extensions it reads."""

    config_file: str | None = None
    """TOML file to read before the command-line flags. Flags override its values."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, checkpoints, TensorBoard logs."""

    description: str = "default job"
    """Free-text description of the job, printed at start-up."""

    custom_args_module: str = ""
    """Python module whose ``JobConfig`` dataclass is merged into this one (new sections, or
    new fields of existing sections), e.g. ``torchtitan.experiments.fault_tolerance.job_config``.
    The module may also name the trainer class to run (module attribute ``TRAINER``)."""

    print_config: bool = False
    """Print the fully resolved configuration at start-up."""


@dataclass
class Model:
    """Which model family and size to train, and its tokenizer."""

    name: str = "llama3"
    """Model family, a key of the train-spec registry (``torchtitan.models``); the known ones
    are listed in ``torchtitan/config/model_names.py``."""

    flavor: str = "debugmodel"
    """Size preset of the model family, e.g. ``debugmodel``, ``8B``, ``70B``."""

    tokenizer_path: str = ""
    """Path to a Hugging Face ``tokenizer.json`` (or a folder holding one). Empty: the built-in
    byte-level tokenizer (vocabulary 256 + BOS/EOS), which needs no files."""

    def validate(self, config: JobConfig) -> None:
        _require(
            self.name in MODEL_FLAVORS,
            "model.name",
            self.name,
            f"known model families: {', '.join(sorted(MODEL_FLAVORS))}",
        )
        flavors = MODEL_FLAVORS[self.name]
        _require(
            self.flavor in flavors,
            "model.flavor",
            self.flavor,
            f"flavors of {self.name!r}: {', '.join(flavors)}",
        )
        vocab = PUBLISHED_VOCABULARY.get((self.name, self.flavor))
        if vocab is not None and not self.tokenizer_path:
            raise ConfigError(
                "model.tokenizer_path",
                self.tokenizer_path,
                f"{self.name} {self.flavor} is the published shape with a {vocab:,}-token "
                "vocabulary: give its tokenizer.json (the built-in byte tokenizer would shrink "
                "the vocabulary to 258 tokens)",
            )
        if self.tokenizer_path and not os.path.exists(self.tokenizer_path):
            raise ConfigError(
                "model.tokenizer_path",
                self.tokenizer_path,
                "no such file or folder; give a tokenizer.json file or a folder holding one, "
                "or leave it empty for the built-in byte tokenizer",
            )


@dataclass
class Optimizer:
    """The torch optimizer and its hyper-parameters."""

    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    """Inner optimizer."""

    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""

    beta1: float = 0.9
    """Adam/AdamW first-moment decay."""

    beta2: float = 0.95
    """Adam/AdamW second-moment decay."""

    eps: float = 1e-8
    """Adam/AdamW epsilon."""

    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW)."""

    momentum: float = 0.0
    """Momentum, used by SGD only."""

    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """Kernel strategy of the torch optimizer: ``foreach`` (multi-tensor), ``fused`` (one kernel,
    GPU and recent CPU builds) or ``for-loop`` (one tensor at a time, least memory)."""

    def validate(self, config: JobConfig) -> None:
        _require(self.lr > 0, "optimizer.lr", self.lr, "must be > 0")
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            _require(0 <= beta < 1, f"optimizer.{name}", beta, "must be in [0, 1)")
        _require(self.eps >= 0, "optimizer.eps", self.eps, "must be >= 0")
        _require(
            self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "must be >= 0"
        )
        _require(self.momentum >= 0, "optimizer.momentum", self.momentum, "must be >= 0")


@dataclass
class LRScheduler:
    """Learning-rate schedule: linear warmup, constant, then decay."""

    warmup_steps: int = 200
    """Steps of linear warmup from ``lr / (warmup_steps + 1)`` to ``lr``."""

    decay_ratio: float | None = None
    """Fraction of the steps, at the end of training, spent decaying the learning rate.
    None: decay over all steps after warmup. 0: no decay (constant after warmup)."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""

    min_lr_factor: float = 0.0
    """Learning rate at the end of decay, as a fraction of ``optimizer.lr``, in [0, 1]."""

    def validate(self, config: JobConfig) -> None:
        _require(
            self.warmup_steps >= 0, "lr_scheduler.warmup_steps", self.warmup_steps, "must be >= 0"
        )
        _require(
            self.decay_ratio is None or 0 <= self.decay_ratio <= 1,
            "lr_scheduler.decay_ratio",
            self.decay_ratio,
            "must be in [0, 1], or unset for decay over all steps after warmup",
        )
        _require(
            0 <= self.min_lr_factor <= 1,
            "lr_scheduler.min_lr_factor",
            self.min_lr_factor,
            "must be in [0, 1]",
        )


@dataclass
class Training:
    """Data, batch shape, number of steps, device and precision."""

    dataset: str = "embedded"
    """Dataset: ``embedded`` (English text that ships with Python: the stdlib's help topics and
    docstrings, no download), a local ``.txt``/``.jsonl``/``.parquet`` file or folder given by
    ``dataset_path``, or a Hugging Face Hub dataset name such as ``allenai/c4`` (streamed)."""

    dataset_path: str | None = None
    """Local path of the dataset files (for local datasets), or a local copy of a hub dataset."""

    local_batch_size: int = 8
    """Sequences per batch on each data-parallel rank."""

    seq_len: int = 2048
    """Tokens per sequence."""

    max_norm: float = 1.0
    """Gradient clipping: maximum total gradient norm (0 disables clipping)."""

    steps: int = 10000
    """Number of training steps (optimizer steps)."""

    seed: int | None = None
    """Random seed for model initialisation and data order. None: seed 0 for the model, and a
    warning that runs are not reproducible across restarts unless a seed is set."""

    deterministic: bool = False
    """Use deterministic algorithms only (slower); with a seed, repeated runs give bitwise
    equal losses on the same hardware."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on. ``auto``: cuda when available, else cpu."""

    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the forward and backward compute (master weights and gradients stay float32):
    FSDP2's mixed-precision policy with several ranks, ``torch.autocast`` with one (matmuls in
    bfloat16, reductions such as the loss in float32)."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction under FSDP2."""

    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (0: leave it automatic)."""

    emulate_slowdown: float = 1.0
    """Benchmarks and tests: this process computes this many times a step's work (extra
    forward and backward passes whose gradients are discarded), a slower machine in real
    compute time, with or without fault tolerance. 1: off."""

    def validate(self, config: JobConfig) -> None:
        _require(self.steps >= 1, "training.steps", self.steps, "must be >= 1")
        _require(
            self.emulate_slowdown >= 1.0,
            "training.emulate_slowdown",
            self.emulate_slowdown,
            "must be >= 1 (1: off; 2: twice the compute per step)",
        )
        _require(
            self.local_batch_size >= 1,
            "training.local_batch_size",
            self.local_batch_size,
            "must be >= 1",
        )
        _require(self.seq_len >= 1, "training.seq_len", self.seq_len, "must be >= 1")
        _require(
            self.max_norm >= 0, "training.max_norm", self.max_norm, "must be >= 0 (0: no clipping)"
        )
        _require(self.gc_freq >= 0, "training.gc_freq", self.gc_freq, "must be >= 0")
        _require_path(self.dataset_path, "training.dataset_path")
        require_dataset_path(self.dataset, self.dataset_path, "training")
        _require(
            self.device != "cuda" or _cuda_available(),
            "training.device",
            self.device,
            "torch sees no CUDA device here; use 'cpu' or 'auto'",
        )


@dataclass
class Parallelism:
    """How the model is sharded inside one replica group (FSDP2)."""

    data_parallel_shard_degree: int = -1
    """Ranks the model is sharded over with FSDP2 inside one job (one replica group): -1 or
    the job's number of ranks (``NGPU``), which are the same; a job of one rank does not
    shard. Sharding over fewer ranks than the job has is not supported."""

    def validate(self, config: JobConfig) -> None:
        require_shard_degree(self.data_parallel_shard_degree, int(os.environ.get("WORLD_SIZE", 1)))

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free the gathered parameters after forward (``always``), keep them for backward
    (``never``), or torch's default (reshard every block but the last)."""


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: Literal["none", "full"] = "none"
    """``full`` recomputes each transformer block's activations in backward to save memory."""


@dataclass
class Compile:
    """torch.compile of the model."""

    enable: bool = False
    """Compile each transformer block with ``torch.compile``."""


@dataclass
class Checkpoint:
    """Saving and resuming (torch.distributed.checkpoint)."""

    enable: bool = False
    """Save checkpoints (torch.distributed.checkpoint) and resume from the newest one found."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to ``job.dump_folder`` (or an absolute path, e.g. storage
    local to a group's region); each save is ``step-<N>/`` in it."""

    interval: int = 500
    """Save every this many steps (and always after the last step)."""

    keep_latest_k: int = 10
    """Keep only the newest k checkpoints (0: keep all)."""

    load_step: int = -1
    """Step to resume from; -1: the newest complete checkpoint."""

    initial_load_path: str | None = None
    """Checkpoint folder to start from when the run folder has none (e.g. pretrained weights)."""

    initial_load_model_only: bool = True
    """Load only the model from ``initial_load_path`` (not optimizer, step or data position).
    With false, every state but those in ``exclude_from_loading``."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not restored on resume (or from ``initial_load_path``), e.g.
    ``optimizer,dataloader``. A checkpoint of another kind of run lacks some: a plain run's
    has no ``ft_manager`` or ``semi_sync``."""

    def validate(self, config: JobConfig) -> None:
        _require(self.interval >= 1, "checkpoint.interval", self.interval, "must be >= 1")
        _require(
            self.keep_latest_k >= 0,
            "checkpoint.keep_latest_k",
            self.keep_latest_k,
            "must be >= 0 (0: keep all)",
        )
        _require(
            self.load_step >= -1,
            "checkpoint.load_step",
            self.load_step,
            "must be -1 (newest) or a saved step >= 0",
        )


@dataclass
class Metrics:
    """The per-step log line and TensorBoard."""

    log_freq: int = 10
    """Print the step line (and write TensorBoard scalars) every this many steps."""

    enable_tensorboard: bool = False
    """Write TensorBoard scalars under ``<dump_folder>/<save_tb_folder>/``."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to ``job.dump_folder``."""

    disable_color_printing: bool = False
    """Plain log lines without ANSI colours. They are plain anyway when ``NO_COLOR`` is set or
    the log is not a terminal (a pipe, a file)."""

    log_param_digest: bool = False
    """Log a SHA-256 digest of the parameters (local shards) after every committed step, and
    of the global parameters after every semi-sync sync: equal digests across replica groups
    mean bit-identical weights. Costs one pass over the parameters per log."""

    cpu_peak_flops: float = 0.0
    """Peak FLOP/s of this CPU, for ``mfu`` on CPU. 0: measure a matmul peak once at start-up
    (0.1 s of CPU per rank). Negative: report mfu as n/a."""

    def validate(self, config: JobConfig) -> None:
        _require(self.log_freq >= 1, "metrics.log_freq", self.log_freq, "must be >= 1")


@dataclass
class Validation:
    """Periodic loss on a held-out split."""

    enable: bool = False
    """Report validation loss on the held-out split every ``freq`` steps. With fault
    tolerance every replica group validates the same held-out samples (the ranks of a group
    split them), so groups that hold the same model report the same loss."""

    dataset: str = ""
    """Validation dataset; empty: the held-out split of ``training.dataset``."""

    dataset_path: str | None = None
    """Local path of the validation dataset (see ``training.dataset_path``)."""

    local_batch_size: int = 8
    """Sequences per validation batch on each rank."""

    freq: int = 100
    """Validate every this many training steps (and after the last step)."""

    steps: int = 10
    """Batches per validation; -1: the whole validation split."""

    def validate(self, config: JobConfig) -> None:
        _require(self.freq >= 1, "validation.freq", self.freq, "must be >= 1")
        _require(
            self.steps == -1 or self.steps >= 1,
            "validation.steps",
            self.steps,
            "must be -1 (whole split) or >= 1",
        )
        _require(
            self.local_batch_size >= 1,
            "validation.local_batch_size",
            self.local_batch_size,
            "must be >= 1",
        )
        _require_path(self.dataset_path, "validation.dataset_path")
        require_dataset_path(self.dataset, self.dataset_path, "validation")


@dataclass
class Comm:
    """Collective timeouts inside one replica group."""

    init_timeout_seconds: int = 300
    """Timeout of the collectives inside one job (FSDP2, and its process group start-up),
    for as long as it runs."""

    def validate(self, config: JobConfig) -> None:
        _require(
            self.init_timeout_seconds > 0,
            "comm.init_timeout_seconds",
            self.init_timeout_seconds,
            "must be > 0",
        )


#: torchft's environment variables that would override a field in some places only: refused.
TORCHFT_VARIABLES = {
    "TORCHFT_TIMEOUT_SEC": "timeout_s",
    "TORCHFT_QUORUM_TIMEOUT_SEC": "quorum_timeout_s",
    "TORCHFT_CONNECT_TIMEOUT_SEC": "connect_timeout_s",
    "TORCHFT_QUORUM_RETRIES": "quorum_timeout_s",
}


@dataclass
class FaultTolerance:
    """Fault tolerance across replica groups with torchft."""

    enable: bool = False
    """Make the replica dimension fault tolerant with torchft: each replica group (one
    ``torchrun``) joins a quorum at the lighthouse, dead groups are dropped, restarted groups heal
    from a live peer."""

    replica_id: int = 0
    """This replica group's index, in ``[0, group_size)``. It also picks the group's slice of
    the data and its checkpoint folder (``checkpoint/replica_<id>``)."""

    group_size: int = 0
    """Number of replica groups in the job (not ranks per group). A new job trains its first
    step only once all of them are in the quorum, so the first group up does not train alone."""

    min_replica_size: int = 1
    """Fewest replica groups that may train a step once the job has started. With fewer alive,
    the survivors commit nothing: they wait (logging that they do every so often) for up to
    ``quorum_timeout_s``, then fail."""

    process_group: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the fault-tolerant process group across replica groups. ``auto``: nccl on
    cuda, gloo on cpu."""

    process_group_timeout_ms: int = 10000
    """Timeout of one collective across replica groups: the longest a survivor waits inside a
    step for a group that hangs (a group that dies fails the collective at once), or for a
    group that died between joining a quorum and joining the rebuilt process group; that step
    is then not committed."""

    lighthouse: str = ""
    """Lighthouse address, ``http://HOST:PORT``. Empty: env ``TORCHFT_LIGHTHOUSE``."""

    quorum_timeout_s: float = 60.0
    """How long a group waits for a quorum it can train in (all ``group_size`` groups before
    the job's first step, ``min_replica_size`` after) before failing with an error."""

    connect_timeout_s: float = 10.0
    """How long to wait when connecting to the lighthouse and to peers before failing (no
    lighthouse at the address: the group exits with an error naming it after this long)."""

    timeout_s: float = 60.0
    """Timeout of the Manager's own operations: ``should_commit``, and each operation of a
    heal (semi-sync sends the healing state in pieces of 64 MiB)."""

    max_consecutive_failures: int = 10
    """Stop the run with an error (naming the last cause torchft recorded, e.g. a healing
    transfer that exceeded ``timeout_s``) after this many uncommitted steps in a row (or syncs,
    with semi-synchronous training). Waiting for a quorum with too few groups does not count
    (``quorum_timeout_s`` bounds it). 0: no limit."""

    hostname: str = "127.0.0.1"
    """Address this group advertises to the lighthouse and to the other groups, and the address
    its own listeners bind to (torchft's manager server; the TCP store of a one-process group;
    gloo, through ``GLOO_SOCKET_IFNAME``, when it is a loopback address). Default 127.0.0.1:
    every group on this machine. Multi-host: this host's address on the network the groups
    share (see docs/fault_tolerance.md)."""

    def validate(self, config: JobConfig) -> None:
        if not self.enable:
            return
        size = self.group_size
        _require(
            size >= 1,
            "fault_tolerance.group_size",
            size,
            "must be >= 1 (the number of replica groups) when fault_tolerance.enable is set",
        )
        _require(
            0 <= self.replica_id < size,
            "fault_tolerance.replica_id",
            self.replica_id,
            f"must be in [0, group_size) = [0, {size})",
        )
        _require(
            1 <= self.min_replica_size <= size,
            "fault_tolerance.min_replica_size",
            self.min_replica_size,
            f"must be in [1, group_size] = [1, {size}]",
        )
        _require(
            self.process_group != "nccl" or _cuda_available(),
            "fault_tolerance.process_group",
            self.process_group,
            "nccl needs CUDA, which torch does not see here; use 'gloo' or 'auto'",
        )
        _require(
            self.max_consecutive_failures >= 0,
            "fault_tolerance.max_consecutive_failures",
            self.max_consecutive_failures,
            "must be >= 0 (0: no limit)",
        )
        for name in (
            "process_group_timeout_ms",
            "quorum_timeout_s",
            "connect_timeout_s",
            "timeout_s",
        ):
            value = getattr(self, name)
            _require(value > 0, f"fault_tolerance.{name}", value, "must be > 0")
        for variable, name in TORCHFT_VARIABLES.items():
            if variable in os.environ:
                raise ConfigError(
                    f"fault_tolerance.{name}",
                    f"{variable}={os.environ[variable]}",
                    f"set the field instead and unset {variable}: the trainer passes its own "
                    "timeouts to torchft, so the variable would change some of them only",
                )


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain nested dicts (TOML-ready: None values are dropped)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return clean(dataclasses.asdict(config))


@dataclass
class JobConfig:
    """Training job configuration."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain nested dicts (None values dropped)."""
        return to_dict(self)
