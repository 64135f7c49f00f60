"""Apply activation checkpointing, torch.compile and FSDP2 to a Llama 3 ``Transformer``.

Everything is applied in place, so module and parameter names stay ``layers.0.attention.wq.
weight`` etc. (no ``_checkpoint_wrapped_module`` or ``_orig_mod`` in them): checkpoints and the
fault-tolerance experiment's fragments address the model by those names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.job_config import JobConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_llama(
    model: nn.Module, dp_mesh: DeviceMesh | None, job_config: JobConfig
) -> nn.Module:
    """Activation checkpointing, then compile, then FSDP2 over ``dp_mesh``; returns ``model``.

    The order matters: compile must see the checkpointed block so it traces the recompute
    region, and FSDP2's hooks go outside both.
    """
    blocks = _blocks(model)
    mode = job_config.activation_checkpoint.mode
    if mode == "full":
        for block in blocks:
            apply_activation_checkpointing(block)
        logger.info("Applied full activation checkpointing to %d blocks", len(blocks))
    elif mode != "none":
        raise ValueError(
            f"activation_checkpoint.mode={mode!r} is not supported; use 'none' or 'full'"
        )

    if job_config.compile.enable:
        for block in blocks:
            block.compile()  # in place, unlike torch.compile(block): names stay the same
        logger.info("Compiled %d transformer blocks with torch.compile", len(blocks))

    if dp_mesh is not None and dp_mesh.size() > 1:
        apply_fsdp(model, dp_mesh, job_config)
        logger.info("Applied FSDP2 over %d ranks", dp_mesh.size())
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``model.layers``), in order."""
    # cast: nn.Module types attributes it looks up at run time as Tensor | Module.
    return list(cast(nn.ModuleDict, model.layers).values())


def apply_activation_checkpointing(block: nn.Module) -> None:
    """Recompute ``block``'s activations in backward instead of keeping them.

    Patches the instance's ``forward`` rather than wrapping the module, so names do not change.
    Non-reentrant checkpointing works with FSDP2 (its pre-backward hook gathers the parameters
    before the recompute) and with torch.compile.
    """
    forward = block.forward

    # A plain closure, not functools.partial: torch.compile skips a partial forward silently.
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed_forward


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, job_config: JobConfig) -> None:
    """Shard each transformer block, then the root (embedding, final norm, output)."""
    training = job_config.training
    mp_policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[training.mixed_precision_param],
        reduce_dtype=_DTYPES[training.mixed_precision_reduce],
    )
    policy = job_config.parallelism.fsdp_reshard_after_forward
    if policy not in ("default", "always", "never"):
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward={policy!r} is not supported; "
            "use 'default', 'always' or 'never'"
        )
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        if policy == "default":
            # Backward starts with the last block, so resharding it after forward would only
            # free its parameters to all-gather them again straight away.
            reshard = i < len(blocks) - 1
        else:
            reshard = policy == "always"
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    # The root's parameters (output layer first) are needed as soon as backward starts, so
    # only "always" reshards them; this matches torch's own default for a root module.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=policy == "always")
