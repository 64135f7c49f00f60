"""Hyper-parameters of the Llama 3 model family (one instance per size, a "flavor")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig


@dataclass
class TransformerModelArgs:
    """Shape of a Llama-3-style decoder. Implements ``torchtitan.protocols.ModelArgs``."""

    dim: int = 256
    """Width of the residual stream."""

    n_layers: int = 6
    """Number of transformer blocks."""

    n_heads: int = 8
    """Query heads per attention layer; ``dim`` must be divisible by it."""

    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide ``n_heads``. None: ``n_heads``."""

    vocab_size: int = 258
    """Vocabulary size; set from the tokenizer by ``update_from_config``."""

    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""

    ffn_dim_multiplier: float | None = None
    """Scales the feed-forward hidden size (after the usual 8/3 * dim). None: 1."""

    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""

    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""

    max_seq_len: int = 2048
    """Longest sequence the rotary table covers; set to ``training.seq_len`` by
    ``update_from_config``."""

    depth_init: bool = True
    """Scale the init of each block's output projections by its depth (``1/sqrt(2*(i+1))``)
    instead of by the total depth (``1/sqrt(2*n_layers)``)."""

    @property
    def kv_heads(self) -> int:
        """Key/value heads, with None resolved to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim (three matrices cost what two 4*dim ones would),
        times ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        """Raise ValueError when the heads do not fit the width."""
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"model dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "pick n_heads that divides dim"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dim dim/n_heads={self.head_dim} is odd; rotary embeddings need it even"
            )
        if self.kv_heads < 1 or self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must be a positive divisor of "
                f"n_heads={self.n_heads} (or None for n_heads)"
            )

    def update_from_config(self, job_config: JobConfig, vocab_size: int) -> None:
        """Take the vocabulary from the tokenizer and the sequence length from ``training``.

        Mutates ``self``: copy a flavor out of ``llama3_configs`` before calling this.
        """
        self.vocab_size = vocab_size
        self.max_seq_len = job_config.training.seq_len

    def num_params(self) -> int:
        """Exact parameter count of ``Transformer(self)``, embedding included."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        attention = 2 * d * d + 2 * d * kv  # wq, wo; wk, wv
        feed_forward = 3 * d * self.ffn_hidden_dim  # w1, w2, w3
        block = attention + feed_forward + 2 * d  # + two RMSNorm weights
        return 2 * self.vocab_size * d + self.n_layers * block + d  # embedding, output, norm

    def num_flops_per_token(self, seq_len: int) -> tuple[int, float]:
        """(parameter count, training FLOPs per token, forward + backward)."""
        n_params = self.num_params()
        # Every weight of a matmul costs 2 FLOPs (multiply + add) per token in forward and
        # twice that in backward (gradient of the input and of the weight): 6 per weight.
        # The embedding is a table lookup, not a matmul, so its weights do not count.
        matmul_params = n_params - self.vocab_size * self.dim
        # Attention has no weights but does real work: q.k and the weighted sum of values,
        # each 2 * H * Q FLOPs per (token, position) pair in forward (H heads of width Q),
        # times 3 for forward + backward. The mask is causal, so a token meets on average
        # half of the T positions: 2 * 2 * H * Q * (T / 2) * 3 = 6 * H * Q * T per layer.
        # (PaLM's convention counts the full T x T matrix: twice the work a causal model does.)
        attention = 6 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return n_params, float(6 * matmul_params + attention)
