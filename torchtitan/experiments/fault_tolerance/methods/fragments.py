"""The model's sync fragments for Streaming DiLoCo (``num_fragments`` or explicit module lists):
each parameter in exactly one, as the model's own object, so the methods sync the model itself.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config


class ModelFragment(nn.Module):
    """Some of the model's parameters, synced together: the model's own objects (not copies),
    registered under their model FQN with ``.`` -> ``__``."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        for name, param in named_params:
            self.register_parameter(name.replace(".", "__"), param)

    def fqns(self) -> list[str]:
        return [name.replace("__", ".") for name, _ in self.named_parameters()]


def fragment_module_names(model: nn.Module, job_config: JobConfig) -> list[list[str]]:
    """Module FQNs of each fragment, as ``[fault_tolerance]`` says: the explicit lists, or
    ``num_fragments`` runs of consecutive transformer blocks (embeddings with the first)."""
    ft = semi_sync_config(job_config)
    if ft.module_fqns_per_model_fragment:
        return [list(names) for names in ft.module_fqns_per_model_fragment]
    # cast: nn.Module types attributes it looks up at run time as Tensor | Module.
    blocks = [f"layers.{key}" for key in cast(nn.ModuleDict, model.layers).keys()]
    n = ft.num_fragments
    bounds = [round(i * len(blocks) / n) for i in range(n + 1)]
    names = [blocks[bounds[i] : bounds[i + 1]] for i in range(n)]
    if hasattr(model, "tok_embeddings"):
        names[0].insert(0, "tok_embeddings")
    return names


def build_model_fragments(model: nn.Module, job_config: JobConfig) -> list[nn.Module]:
    """The model split into its sync fragments (one: the model itself). Parameters of modules
    listed nowhere (e.g. the final norm and output, or the rest of a block when only
    ``layers.0.attention`` is listed) join the last fragment."""
    ft = semi_sync_config(job_config)
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


def describe_fragments(fragments: list[nn.Module]) -> list[str]:
    """One log line per fragment (none for one): its tensors, first and last."""
    if len(fragments) == 1:
        return []
    lines = []
    for i, fragment in enumerate(fragments):
        names = cast(ModelFragment, fragment).fqns()  # several: build_model_fragments made all
        lines.append(f"[semi-sync] fragment {i}: {len(names)} tensors, {names[0]} .. {names[-1]}")
    return lines
