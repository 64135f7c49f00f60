"""Custom args module of the semi-synchronous fault-tolerance experiment.

Load it with ``--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config``: its
``JobConfig`` adds the fields below to ``[fault_tolerance]`` (TOML, CLI and ``--help``), and its
``TRAINER`` makes ``torchtitan.train`` run ``SemiSyncTrainer`` instead of the core trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.job_config import ConfigError
from torchtitan.config.job_config import FaultTolerance as CoreFaultTolerance
from torchtitan.config.job_config import JobConfig as CoreJobConfig

TRAINER = "torchtitan.experiments.fault_tolerance.trainer:SemiSyncTrainer"

SEMI_SYNC_METHODS = {"localsgd": "localsgd", "local_sgd": "localsgd", "diloco": "diloco"}


@dataclass
class FaultTolerance(CoreFaultTolerance):
    """Fault tolerance across replica groups, with semi-synchronous training."""

    semi_sync_method: str | None = None
    """Semi-synchronous method across replica groups. Unset: synchronous FT (gradients averaged
    every step). ``localsgd`` (or ``local_sgd``): groups train alone for ``sync_steps`` steps,
    then average parameters. ``diloco``: groups train alone for ``sync_steps`` steps, then
    average pseudo-gradients (global - local parameters) and apply the outer optimizer;
    Streaming DiLoCo when there is more than one fragment."""

    sync_steps: int = 5
    """Inner steps between two syncs (DiLoCo's H). With fragments, each fragment syncs once
    every ``sync_steps`` steps, fragment syncs spread evenly across them."""

    outer_optimizer: Literal["sgd"] = "sgd"
    """DiLoCo's outer optimizer, applied to the averaged pseudo-gradient at each sync."""

    outer_lr: float = 0.7
    """Outer learning rate. Its best value depends on the number of groups and sync_steps."""

    outer_momentum: float = 0.9
    """Outer optimizer momentum."""

    outer_nesterov: bool = True
    """Nesterov momentum in the outer optimizer (with outer_momentum 0 both are plain SGD)."""

    num_fragments: int = 1
    """Streaming DiLoCo: split the model into this many fragments of consecutive transformer
    blocks (embeddings with the first, final norm and output with the last); each syncs in
    turn. 1: plain DiLoCo. Not together with ``module_fqns_per_model_fragment``."""

    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """Streaming DiLoCo: module names of each fragment, one inner list per fragment, e.g.
    ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``. Parameters of modules
    listed nowhere join the last fragment, so every parameter is synced."""

    fragment_sync_delay: int = 0
    """Streaming DiLoCo: inner steps a fragment's all-reduce overlaps with compute before its
    result is applied (tau). Must be < sync_steps / fragments."""

    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo: mix of local and global parameters after a sync, in [0, 1]:
    new = (1 - alpha) * global + alpha * local. 0: take the global parameters."""

    should_quantize: bool = False
    """Quantize pseudo-gradients to fp8 for the all-reduce (torchft; needs CUDA and Triton)."""

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
            return
        choices = ", ".join(SEMI_SYNC_METHODS)
        if method not in SEMI_SYNC_METHODS:
            raise ConfigError("fault_tolerance.semi_sync_method", method, f"choose {choices}")
        if not self.enable:
            raise ConfigError(
                "fault_tolerance.semi_sync_method",
                method,
                "semi-sync training needs fault_tolerance.enable (a lighthouse and replica groups)",
            )
        if self.sync_steps < 1:
            raise ConfigError("fault_tolerance.sync_steps", self.sync_steps, "must be >= 1")
        streaming = {
            "num_fragments": self.num_fragments != 1,
            "module_fqns_per_model_fragment": bool(self.module_fqns_per_model_fragment),
            "fragment_sync_delay": self.fragment_sync_delay != 0,
            "fragment_update_alpha": self.fragment_update_alpha != 0.0,
        }
        if self.method == "localsgd":
            for name, is_set in streaming.items():
                if is_set:
                    raise ConfigError(
                        f"fault_tolerance.{name}",
                        getattr(self, name),
                        "only applies to semi_sync_method=diloco (LocalSGD has no fragments)",
                    )
        self._validate_fragments(config)
        if self.outer_lr <= 0:
            raise ConfigError("fault_tolerance.outer_lr", self.outer_lr, "must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                "fault_tolerance.outer_momentum", self.outer_momentum, "must be in [0, 1)"
            )
        if self.should_quantize and not _can_quantize():
            raise ConfigError(
                "fault_tolerance.should_quantize",
                True,
                "torchft quantizes on CUDA with Triton only; this machine has no CUDA device or "
                "no triton, and a silent full-precision fallback would misreport the traffic",
            )

    def _validate_fragments(self, config: CoreJobConfig) -> None:
        if self.num_fragments < 1:
            raise ConfigError("fault_tolerance.num_fragments", self.num_fragments, "must be >= 1")
        if self.num_fragments > 1 and self.module_fqns_per_model_fragment:
            raise ConfigError(
                "fault_tolerance.num_fragments",
                self.num_fragments,
                "give either num_fragments > 1 or module_fqns_per_model_fragment, not both",
            )
        fragments = self.fragment_count()
        if self.sync_steps % fragments != 0:
            raise ConfigError(
                "fault_tolerance.sync_steps",
                self.sync_steps,
                f"must be a multiple of the number of fragments ({fragments})",
            )
        period = self.sync_steps // fragments
        if not 0 <= self.fragment_sync_delay < period:
            raise ConfigError(
                "fault_tolerance.fragment_sync_delay",
                self.fragment_sync_delay,
                f"must be in [0, sync_steps / fragments) = [0, {period})",
            )
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ConfigError(
                "fault_tolerance.fragment_update_alpha",
                self.fragment_update_alpha,
                "must be in [0, 1]",
            )
        model = _meta_model(config)
        n_layers = len(model.layers)
        if self.num_fragments > n_layers:
            raise ConfigError(
                "fault_tolerance.num_fragments",
                self.num_fragments,
                f"at most the model's {n_layers} transformer blocks",
            )
        if self.module_fqns_per_model_fragment:
            check_fragment_fqns(model, self.module_fqns_per_model_fragment)


def check_fragment_fqns(model: object, fragments: list[list[str]]) -> None:
    """Every name must be a module of ``model``; no module may be in two fragments (also not
    through a parent: ``layers`` and ``layers.0``)."""
    modules = dict(model.named_modules())  # type: ignore[attr-defined]
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


def _meta_model(config: CoreJobConfig):  # noqa: ANN202  (a model of any family)
    """The configured model on the meta device: names and layer count, no memory."""
    import torch

    from torchtitan.models import get_train_spec

    spec = get_train_spec(config.model.name)
    with torch.device("meta"):
        return spec.model_cls(spec.model_args[config.model.flavor])


def _can_quantize() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@dataclass
class JobConfig:
    """The experiment's additions to the core job config."""

    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
