"""A Llama-3-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Build on any device, including ``meta``; then ``to_empty(device=...)`` and ``init_weights()``
give real, deterministic weights (the constructor's default init is not the scheme we train
with, so always call ``init_weights`` after seeding).

Module names are part of the interface: ``tok_embeddings``, ``layers.0`` .. ``layers.{L-1}``,
``norm``, ``output``. Checkpoints and the fault-tolerance experiment's model fragments use them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan.models.llama3.args import TransformerModelArgs


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``[max_seq_len, head_dim // 2]`` in float32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs ``(x[2i], x[2i+1])`` of ``x: [B, T, heads, head_dim]``.

    The interleaved-pair layout is the one of Meta's original Llama checkpoints.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_kv_heads`` key/value heads shared by groups of
    ``n_heads / n_kv_heads`` query heads."""

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # Read once: a constant for torch.compile.
        self.math_for_half_on_cpu = cpu_flash_attention_breaks()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA wants [B, heads, T, head_dim].
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_kv_heads != self.n_heads:
            # Expand the shared key/value heads explicitly: every SDPA backend accepts it, and
            # the extra memory is small next to the activations of q.
            repeat = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        if self.math_for_half_on_cpu and q.device.type == "cpu" and q.dtype in _HALF:
            with sdpa_kernel(SDPBackend.MATH):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def cpu_flash_attention_breaks() -> bool:
    """Whether torch's CPU flash attention would raise on half-precision inputs here: it packs
    them for AMX whenever the CPU has AMX, with code built only into ATen's AVX-512 kernels, so
    on such a CPU run with ``ATEN_CPU_CAPABILITY=default`` or ``avx2`` (torch 2.13: "pack_vnni2
    is only supported when avx512 is supported"). The math backend computes the same
    attention."""
    has_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return bool(has_amx) and torch.backends.cpu.get_cpu_capability() != "AVX512"


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, layer_id: int, args: TransformerModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Output projections write into the residual stream; scaling them down with depth keeps
        # its variance from growing with the number of blocks.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for linear in (self.attention.wq, self.attention.wk, self.attention.wv):
            _trunc_normal(linear.weight, 0.02)
        for linear in (self.feed_forward.w1, self.feed_forward.w3):
            _trunc_normal(linear.weight, 0.02)
        for linear in (self.attention.wo, self.feed_forward.w2):
            _trunc_normal(linear.weight, self.out_proj_std)


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens[B, T]) -> float32 logits[B, T, vocab]``."""

    # Buffers, declared for the type checker: register_buffer leaves them untyped.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so not saved in checkpoints (persistent=False); init_weights
        # recomputes them after to_empty.
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place; deterministic given the torch seed.

        ``buffer_device``: where to build the rotary tables (default: where they are now),
        e.g. ``"cuda"`` when the parameters were materialised on CPU.
        """
        device = self.rope_cos.device if buffer_device is None else buffer_device
        self.rope_cos, self.rope_sin = rope_tables(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device
        )
        # The embedding feeds RMSNorms, so its scale does not matter much; unit variance keeps
        # the residual stream O(1) from the start.
        _init_(self.tok_embeddings.weight, nn.init.normal_)
        for layer in self.layers.values():
            # cast: a ModuleDict types its values as plain Modules.
            cast(TransformerBlock, layer).init_weights()
        self.norm.reset_parameters()
        # The last norm's output has unit RMS; std dim**-0.5 gives logits of unit scale.
        _trunc_normal(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds the model's max_seq_len={self.args.max_seq_len} "
                "(set from training.seq_len)"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at 3 std (torch's default cut-off of +-2 is absolute)."""
    _init_(weight, lambda w: nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std))


def _init_(weight: torch.Tensor, init_fn: Callable[[torch.Tensor], object]) -> None:
    """Apply a random ``init_fn`` to ``weight`` so that the result does not depend on sharding.

    A sharded DTensor (after FSDP2) is filled by drawing the full tensor on every rank and
    keeping the local shard: a random op on the DTensor itself would, on CPU, give every rank
    the same numbers (duplicated rows) and, anywhere, weights that differ from a 1-rank run.
    """
    if isinstance(weight, DTensor):
        full = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        init_fn(full)
        # src_data_rank=None: every rank holds the same full tensor, so slice locally.
        weight.copy_(
            distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None)
        )
    else:
        init_fn(weight)
