"""Run upstream torchtitan 0.3.0 (the peer) on CPU, for ``benchmarks/peer_throughput.py``.

Runs inside the peer's own virtual environment (``benchmarks/.peer_venv``), never ours:

    benchmarks/.peer_venv/bin/python benchmarks/peer_shim/run_peer.py --data DIR --steps N ...

Upstream 0.3.0 does not train on CPU as shipped. This file changes, at run time and without
touching the installed package, only what stops it:

1. ``torch._utils._get_available_device_type`` answers ``"cpu"`` instead of ``None`` (upstream
   then falls back to ``"cuda"`` for its device, its device module and its NCCL backend): so the
   device is ``cpu``, the device module ``torch.cpu`` and the process group gloo.
2. ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels of MoE expert
   parallelism, imported unconditionally, and Triton has no CPU wheel here) is replaced by a
   module whose kernels raise if ever called. The Llama model never calls them.
3. ``torch.cpu`` gets the device functions upstream calls on its device module and that torch
   has only for accelerators: ``get_device_name``, ``get_device_properties`` (total memory =
   physical memory), ``memory_stats`` (peak = the process's peak resident set, as our trainer
   reports on CPU), ``reset_peak_memory_stats`` and ``empty_cache`` (no-ops); and its
   ``current_device()`` answers the index 0 instead of the string ``"cpu"`` (upstream passes it
   to ``barrier(device_ids=...)``).
4. Flex attention runs eagerly. Upstream's only causal attention for Llama on one device is
   ``flex_attention`` (block-causal per document) under ``torch.compile``; on CPU torch refuses
   it any gradient (``_validate_device`` raises "FlexAttention does not support backward on
   CPU"). The shim removes that refusal and calls ``flex_attention`` uncompiled, which runs
   torch's dense reference implementation (the full score matrix, masked), forward and backward.
   ``--attention sdpa`` is a variant for comparison, not upstream as shipped: attention becomes
   ``scaled_dot_product_attention(is_causal=True)`` over the whole sequence, as in our model.
5. ``torch.distributed.set_timeout`` (newer than torch 2.13, called after the first step) is
   provided through torch 2.13's ``ProcessGroup.set_timeout``.

Anything else the runner sets is configuration (``Trainer.Config`` fields), listed in the
benchmark's README. The last line printed is a JSON object with the step times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types


def apply_shim(attention: str = "flex-eager") -> None:
    """Patches 1-5 of the module docstring (``attention="sdpa"``: the variant of patch 4).
    Must run before torchtitan is imported."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # patch 1

    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")  # patch 2
    for name in (
        "copy_full_counts_to_peers_kernel",
        "copy_rows_to_peers_kernel",
        "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel",
        "fill_dispatch_metadata_kernel",
        "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel",
        "topk_scores_grad_kernel",
    ):
        setattr(kernels, name, _unavailable(name))
    sys.modules[kernels.__name__] = kernels

    cpu = torch.cpu  # patch 3
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, value in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=total),
        "memory_stats": lambda *a, **k: {
            "active_bytes.all.peak": _peak_rss_bytes(),
            "reserved_bytes.all.peak": _peak_rss_bytes(),
        },
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, value)
    # torch.cpu.current_device() is the string "cpu"; upstream passes it as a device index
    # (barrier(device_ids=[...])): answer index 0, the only CPU device.
    cpu.current_device = lambda: 0

    import torch.distributed as dist  # patch 5

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout

    import torch.nn.attention.flex_attention as flex  # patch 4
    from torchtitan.models.common.attention import FlexAttention

    flex._validate_device = _validate_device_allowing_cpu_backward
    FlexAttention._compiled_flex_attn = staticmethod(flex.flex_attention)
    if attention == "sdpa":
        FlexAttention.compiled_flex_attn = staticmethod(_causal_sdpa)


def _validate_device_allowing_cpu_backward(*tensors: object) -> None:
    """torch's check minus its refusal of gradients on CPU: eager flex attention falls back
    to its dense reference implementation (the full score matrix), forward and backward."""


def _causal_sdpa(q, k, v, *, scale, enable_gqa, **_: object):  # noqa: ANN001, ANN202
    """Variant of patch 4: plain causal SDPA over the whole sequence, as our model computes
    it (upstream's document mask is ignored); returns upstream's ``(out, aux)`` pair."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )
    return out, None


def _set_timeout(timeout: object, group: object = None) -> None:
    """``torch.distributed.set_timeout`` of newer torch, through ``ProcessGroup.set_timeout``."""
    import torch.distributed as dist

    (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _unavailable(name: str):  # noqa: ANN202
    def kernel(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"Triton kernel {name} is not available on CPU")

    return kernel


def build_config(args: argparse.Namespace):  # noqa: ANN201  (upstream's Trainer.Config)
    """Upstream's ``llama3_debugmodel`` config, changed to our debug model's shape and job."""
    from torchtitan.components.validate import Validator
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.protocols.model_spec import ModelSpec

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
        model_registry,
    )
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.trainer import Trainer

    dim, vocab = args.dim, args.vocab
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)
        ),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=args.n_layers,
            dim=dim,
            n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads,
            hidden_dim=args.ffn_hidden_dim,
            rope=ComplexRoPE.Config(
                dim=dim // args.n_heads, max_seq_len=args.seq_len, theta=10000.0, scaling="none"
            ),
            attn_backend="flex",
        ),
    )
    shipped = model_registry("debugmodel")
    spec = ModelSpec(**{**shipped.__dict__, "model": model})
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=args.tokenizer,
        dump_folder=args.dump,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=default_adamw(lr=2e-3),  # betas (0.9, 0.95), eps 1e-8, weight decay 0.1
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=20, decay_ratio=None, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=args.batch,
            seq_len=args.seq_len,
            steps=args.steps,
            max_norm=1.0,
            dtype="float32",
            mixed_precision_param="float32",  # upstream's default bf16 compute, ours fp32
            gc_freq=50,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=args.data),
        metrics=MetricsProcessor.Config(log_freq=args.log_freq, disable_color_printing=True),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="folder with a train.jsonl ('text')")
    parser.add_argument("--tokenizer", required=True, help="folder with tokenizer.json")
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-kv-heads", type=int, default=4)
    parser.add_argument("--ffn-hidden-dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=258)
    parser.add_argument("--attention", choices=["flex-eager", "sdpa"], default="flex-eager")
    args = parser.parse_args()

    for key, value in {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():  # fmt: skip
        os.environ.setdefault(key, value)
    apply_shim(args.attention)

    from torchtitan.tools.logging import init_logger

    init_logger()
    config = build_config(args)
    trainer = config.build()
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    n_params = sum(p.numel() for part in trainer.model_parts for p in part.parameters())
    trainer.close()
    print(json.dumps({"peer_result": {"train_seconds": elapsed, "n_params": n_params}}))


if __name__ == "__main__":
    main()
