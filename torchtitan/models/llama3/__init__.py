"""Llama 3 family: model, flavors and train spec."""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.protocols.train_spec import TrainSpec

__all__ = [
    "Transformer",
    "TransformerModelArgs",
    "llama3_configs",
    "llama3_train_spec",
    "parallelize_llama",
]

# Shared instances: copy one (copy.deepcopy) before update_from_config mutates it.
llama3_configs: dict[str, TransformerModelArgs] = {
    # 258-token byte vocabulary: 4,854,016 parameters (measured).
    "debugmodel": TransformerModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4),
    # For tests: 2 layers, width 64 (about 0.13M parameters with 258 tokens).
    "debugmodel_small": TransformerModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32
    ),
    # Published Llama 3.2 / 3 / 3.1 shapes (vocabulary of the Llama 3 tokenizer). Llama 3.1's
    # long-context rope scaling is not implemented. 1B: Llama 3.2's shape with the output
    # layer untied from the embedding (0.97 B parameters with the byte tokenizer).
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000,
    ),
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000,
    ),
}

llama3_train_spec = TrainSpec(
    name="llama3",
    model_cls=Transformer,
    model_args=llama3_configs,
    parallelize_fn=parallelize_llama,
    build_loss_fn=build_cross_entropy_loss,
)
