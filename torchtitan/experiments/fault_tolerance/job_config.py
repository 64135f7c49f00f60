"""Custom args module of the semi-synchronous fault-tolerance experiment.

Load it with ``--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config``: its
``JobConfig`` adds the fields below to ``[fault_tolerance]`` (TOML, CLI and ``--help``), and its
``trainer_for`` makes ``torchtitan.train`` run ``SemiSyncTrainer`` when
``fault_tolerance.semi_sync_method`` is set (the core trainer otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast, get_args

from torchtitan.config.job_config import ConfigError
from torchtitan.config.job_config import FaultTolerance as CoreFaultTolerance
from torchtitan.config.job_config import JobConfig as CoreJobConfig

if TYPE_CHECKING:
    from torch import nn

SEMI_SYNC_TRAINER = "torchtitan.experiments.fault_tolerance.trainer:SemiSyncTrainer"
#: The core's ``RUN_INSTEAD`` extension point: a semi-sync method typed without fault tolerance
#: runs as one replica group of a job the launcher starts.
RUN_INSTEAD = "torchtitan.experiments.fault_tolerance.launch.launcher:command_for_one_group"
CORE_TRAINER = "torchtitan.trainer:Trainer"
MODULE = "torchtitan.experiments.fault_tolerance.job_config"

# The values of the fields with a fixed set, each written once: the modules that act on them
# take these names (a bad value is refused when the config is parsed, naming the choices).
SemiSyncMethod = Literal["localsgd", "local_sgd", "diloco", "async_diloco"]
AsyncUpdate = Literal["eager", "eager_share", "delayed"]
PseudoGradDtype = Literal["float32", "bfloat16", "int8", "int4", "sparse"]
OuterStateDevice = Literal["cpu", "device"]

#: Each method name, alias included, to the method it runs.
SEMI_SYNC_METHODS = {
    name: "localsgd" if name == "local_sgd" else name for name in get_args(SemiSyncMethod)
}
ASYNC_UPDATES: tuple[str, ...] = get_args(AsyncUpdate)
PSEUDO_GRAD_DTYPES: tuple[str, ...] = get_args(PseudoGradDtype)


def trainer_for(config: CoreJobConfig) -> str:
    """The trainer class this config runs: semi-sync with a method, else the core trainer."""
    return SEMI_SYNC_TRAINER if semi_sync_config(config).semi_sync_method else CORE_TRAINER


def semi_sync_config(config: CoreJobConfig) -> FaultTolerance:
    """``config.fault_tolerance`` with this module's fields, for a config parsed with this
    custom args module."""
    # The config manager merges this module's section into the core one at run time, so the
    # object is this class; statically the core JobConfig only knows the core section.
    return cast(FaultTolerance, config.fault_tolerance)


@dataclass
class FaultTolerance(CoreFaultTolerance):
    """Fault tolerance across replica groups, with semi-synchronous training."""

    semi_sync_method: SemiSyncMethod | None = None
    """Semi-synchronous method across replica groups; unset: synchronous FT (gradients
    averaged every step). ``localsgd`` (``local_sgd``): average parameters every
    ``sync_steps``. ``diloco``: average pseudo-gradients and step an outer optimizer (Streaming
    DiLoCo with fragments). ``async_diloco``: DiLoCo whose average arrives behind the next
    period's compute (``async_update``). See docs/fault_tolerance.md."""

    sync_steps: int = 5
    """Inner steps between two syncs (DiLoCo's H). With fragments, each fragment syncs once
    every ``sync_steps`` steps, the fragments' syncs spread evenly across them."""

    sync_quorum_timeout_s: float = 3600.0
    """How long a group waits at a sync point for the sync's quorum (the slowest group) before
    it stops with an error naming this field. Keep it above a period (minutes on GPUs);
    ``quorum_timeout_s`` does not apply to syncs."""

    sync_collective_timeout_s: float = 300.0
    """How long one bucket's collective of a sync may take before the sync fails, naming this
    field; size it for a bucket on the slowest link, shared by the group's ranks (32 MiB as
    int8: about 17 MB, 1.4 s at 100 Mbit/s; the planner says). Two timed-out syncs in a row
    with every group alive stop the run. A group the lighthouse drops (dead, stopped) ends
    the sync sooner: this field is for transfers that are merely slow."""

    sync_bucket_mb: float = 32.0
    """A sync's tensors travel in buckets of up to this many MiB of fp32 values: small ones
    packed together, a large one cut into pieces. One bucket is one transfer; a packed bucket
    costs its size in memory once more while its own transfer runs (one at a time)."""

    agreement_check_every: int = 1
    """Every this many syncs, and whenever the quorum changes, the groups compare a digest of
    the global parameters: a strict majority wins and the others heal from it; without one
    the run stops naming the digests. 0: only when the quorum changes."""

    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (its best value depends on the groups and sync_steps)."""

    outer_momentum: float = 0.9
    """DiLoCo's outer optimizer momentum."""

    outer_nesterov: bool = True
    """Nesterov momentum in DiLoCo's outer optimizer."""

    num_fragments: int = 1
    """Streaming DiLoCo: this many fragments of consecutive transformer blocks, each syncing in
    turn (embeddings with the first, final norm and output with the last). 1: plain DiLoCo.
    Not with ``module_fqns_per_model_fragment``."""

    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """Streaming DiLoCo: each fragment's module names, e.g.
    ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``; unlisted modules join
    the last fragment."""

    fragment_sync_delay: int = 0
    """Streaming DiLoCo: inner steps a fragment's all-reduce overlaps with compute before its
    result is applied (tau); below sync_steps / fragments."""

    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo: after a sync, new = (1 - alpha) * global + alpha * local, alpha in
    [0, 1]. 0: take the global parameters."""

    async_update: AsyncUpdate = "eager"
    """async_diloco: where the next period starts while the average is in flight. ``eager``:
    the global parameters moved by this group's own pseudo-gradient (an estimate, corrected on
    arrival); ``eager_share``: by its share of the average (arXiv 2502.12996); ``delayed``: the
    global parameters, which take each average one period late."""

    outer_state_device: OuterStateDevice = "cpu"
    """async_diloco: where the global copy, the outer momentum and the period's start live (3x
    the parameters): ``cpu`` (pinned with a GPU) or ``device``, next to the model."""

    outer_step_threads: int = 0
    """async_diloco, ``outer_state_device=cpu``: threads for a sync point's host work (the outer
    step, the next period's start, the digest), which the accelerator waits for. 0: the cores
    this rank may run on, divided by the ranks of its host (torchrun's ``LOCAL_WORLD_SIZE``)."""

    outer_momentum_every: int = 1
    """async_diloco: > 1 is Delayed Nesterov (arXiv 2401.09135), the outer momentum updated
    once every this many outer steps, so stale averages do not compound through it. Needs
    ``outer_momentum`` > 0 and ``outer_nesterov``. 1: Nesterov at every outer step."""

    dynamic_local_steps: bool = False
    """async_diloco: DyLU (arXiv 2401.09135), each group's inner steps per period planned from
    the groups' speeds so that all reach the sync point together. Training ends after
    ``training.steps / sync_steps`` periods; the LR follows the job's progress. Not
    bit-for-bit repeatable. The plan: torchtitan/experiments/fault_tolerance/README.md."""

    dylu_probe_steps: int = 1
    """DyLU in a new job's first period, which has no measured speeds: the groups time this
    many inner steps after the first, exchange those speeds (a quorum of its own, no sync,
    formed while they train on) and plan the rest of the period, so that fast groups do not
    wait at the first sync point. 0: no probe (nor when the period has too few steps)."""

    pseudo_grad_dtype: PseudoGradDtype = "float32"
    """diloco and async_diloco: how pseudo-gradients travel: ``float32``, ``bfloat16`` (half
    the bytes), ``int8`` / ``int4`` (a quarter / an eighth, one fp32 scale per 128 values), or
    ``sparse`` (SparseLoCo, arXiv 2508.15706: per chunk of ``sparse_chunk`` values only the
    ``sparse_keep`` largest, ``sparse_value_bits`` each; 0.73 % of float32's bytes with 2
    groups at the defaults, all-gathered, so its bytes grow with the groups: fewer than int4's
    up to 36 groups; needs ``error_feedback`` and ``outer_momentum=0``). Every group decodes
    the same bytes, so global parameters stay identical. The CUDA path has not run on a GPU
    yet."""

    error_feedback: bool = False
    """With a compressed ``pseudo_grad_dtype``: what compression dropped is added to the
    fragment's next pseudo-gradient. Residuals are per rank and checkpointed; a healing group
    starts them at zero."""

    sparse_chunk: int = 4096
    """pseudo_grad_dtype=sparse: values per chunk, 2 to 65,536. Each rank chooses within its
    own shard, chunk by chunk; an index costs ceil(log2(sparse_chunk)) bits (12 at 4,096)."""

    sparse_keep: int = 64
    """pseudo_grad_dtype=sparse: values each chunk sends, those of largest magnitude in the
    pseudo-gradient plus its error-feedback residual (64 of 4,096: SparseLoCo's 1.6 %)."""

    sparse_value_bits: int = 2
    """pseudo_grad_dtype=sparse: bits per value sent, 1 to 4: its sign and one of
    2^(bits - 1) magnitude levels of its chunk (each the mean of the kept magnitudes in its
    bin, sent as fp32)."""

    sparse_residual_decay: float = 0.9
    """pseudo_grad_dtype=sparse: what of the error-feedback residual is still owed a sync
    later, in (0, 1]: it is multiplied by this before it is added to the next pseudo-gradient
    (SparseLoCo's beta, arXiv 2508.15706: it takes the place of outer momentum, which sparse
    refuses). 1: every value not sent is sent later. 0.9 gave a lower loss than 0.95 and 1 in
    benchmarks/convergence.py."""

    heal_history_syncs: int = 3
    """diloco, async_diloco: syncs whose averages each rank keeps in CPU memory, so that a group
    restarted from its own checkpoint at most this many syncs behind replays them instead of
    receiving the full state (~5x the parameters in fp32). Costs per sync the fragment's bytes
    as sent: 4 per parameter in float32, ~1 in int8, ~0.5 in int4, ~0.03 per group in sparse.
    0: always heal in full."""

    groups_per_site: int = 1
    """Replica groups per site (a datacenter: one DiLoCo worker). > 1: ``replica_id`` counts
    groups across the job (site = replica_id // groups_per_site), ``group_size`` is sites x
    groups_per_site, and ``min_replica_size`` counts sites. A site's groups average gradients
    every step through ``site_lighthouse`` (a dead one costs the site a share, not a restart);
    one of them carries the site's sync over the job's lighthouse. 1: every group is a site."""

    site_lighthouse: str = ""
    """With ``groups_per_site`` > 1: the lighthouse of this group's site, e.g.
    ``http://10.0.0.1:29611`` (one per site, on the site's fast network); the job's lighthouse
    (``lighthouse``) hears one group per site."""

    site_min_groups: int = 1
    """With ``groups_per_site`` > 1: live groups a site needs to take a step, in [1,
    groups_per_site] (a new job starts with all of them)."""

    @property
    def sites(self) -> int:
        """Sites in the job (replica groups when every group is a site)."""
        return max(1, self.group_size // self.groups_per_site)

    @property
    def site(self) -> int:
        """This group's site."""
        return self.replica_id // self.groups_per_site

    @property
    def method(self) -> str | None:
        """``semi_sync_method`` with its aliases resolved (``local_sgd`` -> ``localsgd``)."""
        return SEMI_SYNC_METHODS.get(self.semi_sync_method or "")

    def fragment_count(self) -> int:
        return len(self.module_fqns_per_model_fragment) or self.num_fragments

    def validate(self, config: CoreJobConfig) -> None:
        super().validate(config)
        method = self.semi_sync_method
        if method is None:
            for name in self._changed(SEMI_SYNC_FIELDS):
                raise ConfigError(
                    f"fault_tolerance.{name}",
                    getattr(self, name),
                    "only applies to semi-synchronous training: set fault_tolerance."
                    "semi_sync_method=localsgd, diloco or async_diloco, or drop this field",
                )
            return
        if not self.enable:
            raise ConfigError("fault_tolerance.semi_sync_method", method, _how_to_run(method))
        if self.sync_steps < 1:
            raise ConfigError("fault_tolerance.sync_steps", self.sync_steps, "must be >= 1")
        for name in ("sync_collective_timeout_s", "sync_bucket_mb"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fault_tolerance.{name}", getattr(self, name), "must be > 0")
        if self.sync_quorum_timeout_s <= 0:
            raise ConfigError(
                "fault_tolerance.sync_quorum_timeout_s", self.sync_quorum_timeout_s, "must be > 0"
            )
        if self.heal_history_syncs < 0:
            raise ConfigError(
                "fault_tolerance.heal_history_syncs",
                self.heal_history_syncs,
                "must be >= 0 (0: no history, every heal is a full one)",
            )
        if self.agreement_check_every < 0:
            raise ConfigError(
                "fault_tolerance.agreement_check_every",
                self.agreement_check_every,
                "must be >= 0 (0: only when the quorum changes)",
            )
        streaming = {
            "num_fragments": self.num_fragments != 1,
            "module_fqns_per_model_fragment": bool(self.module_fqns_per_model_fragment),
            "fragment_sync_delay": self.fragment_sync_delay != 0,
            "fragment_update_alpha": self.fragment_update_alpha != 0.0,
        }
        if self.method == "async_diloco":
            self._validate_async(config)
        else:
            for name in self._changed(ASYNC_FIELDS):
                raise ConfigError(
                    f"fault_tolerance.{name}",
                    getattr(self, name),
                    "only applies to semi_sync_method=async_diloco",
                )
        if self.method == "localsgd":
            for name, is_set in streaming.items():
                if is_set:
                    raise ConfigError(
                        f"fault_tolerance.{name}",
                        getattr(self, name),
                        "only applies to semi_sync_method=diloco or async_diloco (LocalSGD has no "
                        "fragments)",
                    )
            for name in self._changed(OUTER_FIELDS):
                raise ConfigError(
                    f"fault_tolerance.{name}",
                    getattr(self, name),
                    "only applies to semi_sync_method=diloco or async_diloco (LocalSGD averages "
                    "parameters; it has no outer optimizer and sends no pseudo-gradients)",
                )
        _validate_fragments(self, config)
        if self.outer_lr <= 0:
            raise ConfigError("fault_tolerance.outer_lr", self.outer_lr, "must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                "fault_tolerance.outer_momentum", self.outer_momentum, "must be in [0, 1)"
            )
        self._validate_compression()
        self._validate_sites()

    def _validate_sites(self) -> None:
        groups = self.groups_per_site
        if groups < 1:
            raise ConfigError("fault_tolerance.groups_per_site", groups, "must be >= 1")
        if groups == 1:
            for name in self._changed(SITE_FIELDS[1:]):
                raise ConfigError(
                    f"fault_tolerance.{name}",
                    getattr(self, name),
                    "only applies to sites of several groups: set fault_tolerance."
                    "groups_per_site > 1, or drop this field",
                )
            return
        if self.group_size % groups:
            raise ConfigError(
                "fault_tolerance.group_size",
                self.group_size,
                f"must be a multiple of fault_tolerance.groups_per_site ({groups}): sites x "
                "groups per site",
            )
        if self.min_replica_size > self.sites:
            raise ConfigError(
                "fault_tolerance.min_replica_size",
                self.min_replica_size,
                f"counts sites with groups_per_site > 1: must be in [1, {self.sites}]",
            )
        if not self.site_lighthouse:
            raise ConfigError(
                "fault_tolerance.site_lighthouse",
                "",
                "groups_per_site > 1 needs the site's lighthouse, e.g. "
                "--fault_tolerance.site_lighthouse=http://127.0.0.1:29611 (one per site)",
            )
        if self.site_lighthouse == self.lighthouse:
            raise ConfigError(
                "fault_tolerance.site_lighthouse",
                self.site_lighthouse,
                "must differ from fault_tolerance.lighthouse (the job's): each site has its own",
            )
        if not 1 <= self.site_min_groups <= groups:
            raise ConfigError(
                "fault_tolerance.site_min_groups",
                self.site_min_groups,
                f"must be in [1, groups_per_site] = [1, {groups}]",
            )
        if self.fragment_sync_delay:
            raise ConfigError(
                "fault_tolerance.fragment_sync_delay",
                self.fragment_sync_delay,
                "must be 0 with groups_per_site > 1: a group healing from its site mid-delay "
                "could not take the leader's result of the sync in flight",
            )
        if self.dynamic_local_steps:
            raise ConfigError(
                "fault_tolerance.dynamic_local_steps",
                True,
                "not with groups_per_site > 1: a site's groups take every step together, so "
                "DyLU's per-group plan does not apply; plan per site instead (not supported)",
            )

    def _validate_compression(self) -> None:
        compressed = self.pseudo_grad_dtype != "float32"
        if self.error_feedback and not compressed:
            raise ConfigError(
                "fault_tolerance.error_feedback",
                True,
                "needs a compressed fault_tolerance.pseudo_grad_dtype (bfloat16, int8, int4 "
                "or sparse)",
            )
        if self.pseudo_grad_dtype != "sparse":
            for name in self._changed(SPARSE_FIELDS):
                raise ConfigError(
                    f"fault_tolerance.{name}",
                    getattr(self, name),
                    "only applies to fault_tolerance.pseudo_grad_dtype=sparse",
                )
            return
        if not self.error_feedback:
            raise ConfigError(
                "fault_tolerance.pseudo_grad_dtype",
                "sparse",
                "sends a few values per chunk and needs fault_tolerance.error_feedback=true "
                "to deliver the rest later (without it they are lost for good); add "
                "--fault_tolerance.error_feedback",
            )
        if not 2 <= self.sparse_chunk <= MAX_SPARSE_CHUNK:
            raise ConfigError(
                "fault_tolerance.sparse_chunk",
                self.sparse_chunk,
                f"must be in [2, {MAX_SPARSE_CHUNK}] (a chunk's temporaries are as large as it)",
            )
        if not 1 <= self.sparse_keep <= self.sparse_chunk:
            raise ConfigError(
                "fault_tolerance.sparse_keep",
                self.sparse_keep,
                f"must be in [1, sparse_chunk={self.sparse_chunk}]",
            )
        if not 1 <= self.sparse_value_bits <= 4:
            raise ConfigError(
                "fault_tolerance.sparse_value_bits", self.sparse_value_bits, "must be 1, 2, 3 or 4"
            )
        if self.outer_momentum != 0:
            raise ConfigError(
                "fault_tolerance.outer_momentum",
                self.outer_momentum,
                "must be 0 with pseudo_grad_dtype=sparse: the residual's decay "
                "(sparse_residual_decay) takes the place of outer momentum, as in SparseLoCo "
                "(with momentum 0.9, benchmarks/convergence.py's loss was 2.97 against 2.31 "
                "without); add --fault_tolerance.outer_momentum=0",
            )
        if not 0 < self.sparse_residual_decay <= 1:
            raise ConfigError(
                "fault_tolerance.sparse_residual_decay",
                self.sparse_residual_decay,
                "must be in (0, 1] (1: no decay)",
            )

    def _validate_async(self, config: CoreJobConfig) -> None:
        not_async = {
            "fragment_sync_delay": "async_diloco overlaps each all-reduce with a whole period "
            "already; fragment_sync_delay is blocking Streaming DiLoCo's shorter overlap",
            "fragment_update_alpha": "async_diloco takes the global parameters (alpha 0)",
        }
        for name in self._changed(tuple(not_async)):
            raise ConfigError(f"fault_tolerance.{name}", getattr(self, name), not_async[name])
        if self.outer_step_threads < 0:
            raise ConfigError(
                "fault_tolerance.outer_step_threads",
                self.outer_step_threads,
                "must be >= 0 (0: this rank's share of the host's cores)",
            )
        if self.outer_momentum_every < 1:
            raise ConfigError(
                "fault_tolerance.outer_momentum_every",
                self.outer_momentum_every,
                "must be >= 1 (1: Nesterov every outer step; N > 1: Delayed Nesterov)",
            )
        if self.outer_momentum_every > 1 and not (self.outer_nesterov and self.outer_momentum):
            raise ConfigError(
                "fault_tolerance.outer_momentum_every",
                self.outer_momentum_every,
                "Delayed Nesterov needs fault_tolerance.outer_nesterov=true and "
                f"outer_momentum > 0 (is {self.outer_momentum}); or set it to 1",
            )
        period = self.sync_steps // self.fragment_count()
        if self._changed(("dylu_probe_steps",)) and not (
            self.dynamic_local_steps and 0 <= self.dylu_probe_steps < period - 1
        ):
            raise ConfigError(
                "fault_tolerance.dylu_probe_steps",
                self.dylu_probe_steps,
                "needs fault_tolerance.dynamic_local_steps and a value in [0, sync_steps / "
                f"fragments - 1) = [0, {period - 1}) (0: no probe)",
            )
        steps = config.training.steps
        if self.dynamic_local_steps and steps % self.sync_steps:
            raise ConfigError(
                "fault_tolerance.dynamic_local_steps",
                True,
                f"training then ends after training.steps / sync_steps periods: make "
                f"training.steps ({steps}) a multiple of fault_tolerance.sync_steps "
                f"({self.sync_steps})",
            )

    def _changed(self, names: tuple[str, ...]) -> list[str]:
        """The fields among ``names`` whose value is not their default."""
        defaults = {f.name: f for f in dataclasses.fields(self)}
        changed = []
        for name in names:
            spec = defaults[name]
            default = spec.default_factory() if callable(spec.default_factory) else spec.default
            if getattr(self, name) != default:
                changed.append(name)
        return changed


def _validate_fragments(ft: FaultTolerance, config: CoreJobConfig) -> None:
    """The Streaming DiLoCo fields, against each other and the configured model."""
    if ft.num_fragments < 1:
        raise ConfigError("fault_tolerance.num_fragments", ft.num_fragments, "must be >= 1")
    if ft.num_fragments > 1 and ft.module_fqns_per_model_fragment:
        raise ConfigError(
            "fault_tolerance.num_fragments",
            ft.num_fragments,
            "give either num_fragments > 1 or module_fqns_per_model_fragment, not both",
        )
    fragments = ft.fragment_count()
    if ft.sync_steps % fragments != 0:
        raise ConfigError(
            "fault_tolerance.sync_steps",
            ft.sync_steps,
            f"must be a multiple of the number of fragments ({fragments})",
        )
    period = ft.sync_steps // fragments
    if not 0 <= ft.fragment_sync_delay < period:
        raise ConfigError(
            "fault_tolerance.fragment_sync_delay",
            ft.fragment_sync_delay,
            f"must be in [0, sync_steps / fragments) = [0, {period})",
        )
    if not 0.0 <= ft.fragment_update_alpha <= 1.0:
        raise ConfigError(
            "fault_tolerance.fragment_update_alpha",
            ft.fragment_update_alpha,
            "must be in [0, 1]",
        )
    if ft.num_fragments == 1 and not ft.module_fqns_per_model_fragment:
        return  # one fragment, the whole model: nothing to check against it
    # Only here is the model built (on meta, which imports torch and the models): a config
    # without fragments parses without torch, e.g. ``run_train.sh``'s check before torchrun.
    model = _meta_model(config)
    # cast: nn.Module types attributes it looks up at run time as Tensor | Module.
    n_layers = len(cast("nn.ModuleDict", model.layers))
    if ft.num_fragments > n_layers:
        raise ConfigError(
            "fault_tolerance.num_fragments",
            ft.num_fragments,
            f"at most the model's {n_layers} transformer blocks",
        )
    if ft.module_fqns_per_model_fragment:
        check_fragment_fqns(model, ft.module_fqns_per_model_fragment)


def check_fragment_fqns(model: nn.Module, fragments: list[list[str]]) -> None:
    """Every name must be a module of ``model``; no module may be in two fragments (also not
    through a parent: ``layers`` and ``layers.0``)."""
    modules = dict(model.named_modules())
    field_name = "fault_tolerance.module_fqns_per_model_fragment"
    seen: dict[str, int] = {}
    for index, names in enumerate(fragments):
        if not names:
            raise ConfigError(field_name, fragments, f"fragment {index} is empty")
        for name in names:
            if name not in modules or name == "":
                close = sorted(n for n in modules if n and "." not in n.removeprefix("layers."))
                raise ConfigError(
                    field_name, name, f"no such module; top-level modules: {', '.join(close)}"
                )
            for other, other_index in seen.items():
                if name == other or name.startswith(other + ".") or other.startswith(name + "."):
                    raise ConfigError(
                        field_name,
                        name,
                        f"overlaps {other!r} of fragment {other_index}: fragments must be disjoint",
                    )
            seen[name] = index


def _meta_model(config: CoreJobConfig) -> nn.Module:
    """The configured model on the meta device: names and layer count, no memory."""
    import torch

    from torchtitan.models import get_train_spec

    spec = get_train_spec(config.model.name)
    with torch.device("meta"):
        return spec.model_cls(spec.model_args[config.model.flavor])


#: Fields that mean something only with a semi_sync_method, and only with DiLoCo.
OUTER_FIELDS = (
    "outer_lr",
    "outer_momentum",
    "outer_nesterov",
    "pseudo_grad_dtype",
    "error_feedback",
    "sparse_chunk",
    "sparse_keep",
    "sparse_value_bits",
    "sparse_residual_decay",
    "heal_history_syncs",
)
#: The largest ``sparse_chunk``: an index then takes 16 bits.
MAX_SPARSE_CHUNK = 2**16
#: Fields that mean something only with pseudo_grad_dtype=sparse.
SPARSE_FIELDS = ("sparse_chunk", "sparse_keep", "sparse_value_bits", "sparse_residual_decay")
#: Fields that mean something only with semi_sync_method=async_diloco.
ASYNC_FIELDS = (
    "async_update",
    "outer_state_device",
    "outer_step_threads",
    "outer_momentum_every",
    "dynamic_local_steps",
    "dylu_probe_steps",
)
#: Fields of sites of replica groups (the first one turns them on).
SITE_FIELDS = ("groups_per_site", "site_lighthouse", "site_min_groups")
SEMI_SYNC_FIELDS = (
    "sync_steps",
    "sync_quorum_timeout_s",
    "sync_collective_timeout_s",
    "sync_bucket_mb",
    "agreement_check_every",
    *OUTER_FIELDS,
    "num_fragments",
    "module_fqns_per_model_fragment",
    "fragment_sync_delay",
    "fragment_update_alpha",
    *ASYNC_FIELDS,
    *SITE_FIELDS,
)


def site_step_config(config: CoreJobConfig) -> CoreJobConfig:
    """``config`` as a site's own fault tolerance sees it (the groups of this group's site,
    syncing every step through ``site_lighthouse``): replica ``replica_id mod
    groups_per_site`` of ``groups_per_site``, needing ``site_min_groups``. A step's quorum may
    wait for the site's leader to finish a sync (a group joining the site meanwhile): up to
    ``sync_quorum_timeout_s`` + ``sync_collective_timeout_s`` when that is longer than
    ``quorum_timeout_s``."""
    ft = semi_sync_config(config)
    site = dataclasses.replace(
        ft,
        replica_id=ft.replica_id % ft.groups_per_site,
        group_size=ft.groups_per_site,
        min_replica_size=ft.site_min_groups,
        lighthouse=ft.site_lighthouse,
        quorum_timeout_s=max(
            ft.quorum_timeout_s, ft.sync_quorum_timeout_s + ft.sync_collective_timeout_s
        ),
    )
    return dataclasses.replace(config, fault_tolerance=site)


def job_level_config(config: CoreJobConfig) -> CoreJobConfig:
    """``config`` as the job's lighthouse sees it: each site one replica group (the one that
    carries its syncs). Unchanged when every group is a site."""
    ft = semi_sync_config(config)
    if ft.groups_per_site == 1:
        return config
    job = dataclasses.replace(ft, replica_id=ft.site, group_size=ft.sites)
    return dataclasses.replace(config, fault_tolerance=job)


def _how_to_run(method: str) -> str:
    """The error for a semi-sync method without fault tolerance: the commands that do run."""
    flags = f"--job.custom_args_module={MODULE} --fault_tolerance.semi_sync_method={method}"
    group = (
        "TORCHFT_LIGHTHOUSE=http://127.0.0.1:29610 ./run_train.sh "
        f"{flags} --fault_tolerance.enable --fault_tolerance.group_size=2 "
        "--fault_tolerance.replica_id=0"
    )
    launcher = f"./run_launcher.sh --groups 2 -- {flags}"
    return (
        "semi-synchronous training runs across replica groups and needs "
        "fault_tolerance.enable. Everything on this machine in one command: "
        f"{launcher}  |  or one group per terminal, after `torchft_lighthouse --min_replicas 1 "
        f"--bind 127.0.0.1:29610`: {group} (and replica_id=1 in a second terminal)"
    )


@dataclass
class JobConfig:
    """The experiment's additions to the core job config."""

    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
