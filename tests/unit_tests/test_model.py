"""Llama 3 model, its args, loss and the train-spec registry (tiny models, CPU)."""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

from tests.kernel_sets import kernel_sets, run_python
from torchtitan.components.loss import build_cross_entropy_loss, cross_entropy_loss
from torchtitan.config.job_config import JobConfig
from torchtitan.config.model_names import MODEL_FLAVORS
from torchtitan.models import get_train_spec, train_spec_names
from torchtitan.models.llama3 import (
    Transformer,
    TransformerModelArgs,
    llama3_configs,
    parallelize_llama,
)

VOCAB = 258


def tiny_args(**overrides: object) -> TransformerModelArgs:
    args = copy.deepcopy(llama3_configs["debugmodel_small"])
    args.max_seq_len = 32
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_forward_returns_float32_logits_of_shape_batch_seq_vocab() -> None:
    model = build(tiny_args())
    tokens = torch.randint(0, VOCAB, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_sequence_longer_than_max_seq_len_is_rejected() -> None:
    model = build(tiny_args(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_param_count_matches_num_flops_per_token() -> None:
    for flavor in ("debugmodel", "debugmodel_small"):
        args = llama3_configs[flavor]
        with torch.device("meta"):
            model = Transformer(args)
        n_params, flops = args.num_flops_per_token(256)
        assert n_params == sum(p.numel() for p in model.parameters())
        embedding = args.vocab_size * args.dim
        head_dim = args.dim // args.n_heads
        attention = 6 * args.n_layers * args.n_heads * head_dim * 256  # causal: half of T x T
        assert flops == 6 * (n_params - embedding) + attention
    assert llama3_configs["debugmodel"].num_params() == 4_854_016


def test_published_flavor_sizes() -> None:
    # Llama 3 / 3.1 8B, 70B and 405B parameter counts, in billions.
    expected = {"8B": 8.03, "70B": 70.55, "405B": 405.85}
    for flavor, billions in expected.items():
        assert llama3_configs[flavor].num_params() / 1e9 == pytest.approx(billions, abs=0.01)
    assert llama3_configs["8B"].ffn_hidden_dim == 14336


def test_update_from_config_sets_vocab_and_seq_len() -> None:
    job_config = JobConfig()
    job_config.training.seq_len = 123
    args = tiny_args()
    args.update_from_config(job_config, vocab_size=1000)
    assert (args.vocab_size, args.max_seq_len) == (1000, 123)


def test_future_tokens_do_not_change_earlier_logits() -> None:
    model = build(tiny_args())
    tokens = torch.randint(0, VOCAB, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_grouped_query_attention_has_fewer_kv_weights() -> None:
    model = build(tiny_args(n_heads=4, n_kv_heads=1))
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (64, 64)
    assert attention.wk.weight.shape == (16, 64)
    assert attention.wv.weight.shape == (16, 64)
    assert model(torch.randint(0, VOCAB, (2, 8))).shape == (2, 8, VOCAB)


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    gqa = build(tiny_args(n_heads=4, n_kv_heads=2))
    mha = Transformer(tiny_args(n_heads=4, n_kv_heads=4))
    state = gqa.state_dict()
    for i in ("0", "1"):
        for name in ("wk", "wv"):
            key = f"layers.{i}.attention.{name}.weight"
            # [kv_heads * head_dim, dim] -> every kv head serves two consecutive query heads.
            state[key] = state[key].unflatten(0, (2, 16)).repeat_interleave(2, 0).flatten(0, 1)
    mha.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_invalid_head_counts_name_the_field() -> None:
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        Transformer(tiny_args(n_heads=4, n_kv_heads=3))
    with pytest.raises(ValueError, match="n_heads=5"):
        Transformer(tiny_args(n_heads=5))


def test_meta_build_then_init_equals_cpu_build_with_same_seed() -> None:
    args = tiny_args()
    cpu = build(args, seed=7)
    with torch.device("meta"):
        meta = Transformer(args)
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    for (name, a), (_, b) in zip(cpu.state_dict().items(), meta.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # The rotary tables are buffers outside the state dict; init_weights rebuilds them.
    torch.testing.assert_close(cpu.rope_cos, meta.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(cpu.rope_sin, meta.rope_sin, rtol=0, atol=0)
    tokens = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(cpu(tokens), meta(tokens), rtol=0, atol=0)


def test_init_is_deterministic_and_depth_scaled() -> None:
    a, b = build(tiny_args(), seed=3), build(tiny_args(), seed=3)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    assert not torch.equal(a.output.weight, build(tiny_args(), seed=4).output.weight)
    std = [a.layers[i].attention.wo.weight.std().item() for i in ("0", "1")]
    assert std[1] < std[0]


def test_module_names_are_layers_by_index() -> None:
    model = Transformer(tiny_args())
    children = [name for name, _ in model.named_children()]
    assert children == ["tok_embeddings", "layers", "norm", "output"]
    names = {name for name, _ in model.named_modules()}
    assert {"layers.0", "layers.1", "tok_embeddings", "norm", "output"} <= names
    assert "layers.0.attention.wq.weight" in dict(model.named_parameters())
    assert not any(key.startswith("rope") for key in model.state_dict())


def test_tiny_model_overfits_one_batch() -> None:
    torch.manual_seed(0)
    model = build(tiny_args())
    tokens = torch.randint(0, VOCAB, (4, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = cross_entropy_loss(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.5)
    assert losses[-1] < 0.5 * losses[0]


def test_cross_entropy_ignores_minus_100_and_averages_over_tokens() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    labels = torch.tensor([[1, 2, -100], [0, -100, 4]])
    loss = cross_entropy_loss(logits, labels)
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep].float(), labels[keep])
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, expected)
    assert build_cross_entropy_loss(JobConfig()) is cross_entropy_loss


def test_activation_checkpointing_keeps_names_and_gradients() -> None:
    tokens = torch.randint(0, VOCAB, (2, 16))
    grads = []
    for mode in ("none", "full"):
        job_config = JobConfig()
        job_config.activation_checkpoint.mode = mode
        model = parallelize_llama(build(tiny_args()), None, job_config)
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_train_spec_registry() -> None:
    spec = get_train_spec("llama3")
    assert spec.model_cls is Transformer
    assert "debugmodel" in spec.model_args
    assert "llama3" in train_spec_names()
    with pytest.raises(KeyError, match="known: llama3"):
        get_train_spec("gpt5")


def test_config_knows_exactly_the_registered_models_and_flavors() -> None:
    """The config validates ``model.name``/``model.flavor`` against its own table (so that it
    need not import the models): the table must match the train-spec registry, flavors in the
    registry's order (the order the error message lists them in)."""
    registered = {name: tuple(get_train_spec(name).model_args) for name in train_spec_names()}
    assert registered == dict(MODEL_FLAVORS)


def _fsdp_worker(rank: int, world_size: int, port: int, reference: dict[str, torch.Tensor]) -> None:
    """One rank of ``test_fsdp_matches_single_process``: init and train step under FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        job_config = JobConfig()
        job_config.activation_checkpoint.mode = "full"
        with torch.device("meta"):
            model = Transformer(tiny_args())
        parallelize_llama(model, init_device_mesh("cpu", (world_size,)), job_config)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value.full_tensor(), reference[f"init.{name}"], msg=name)
        tokens = reference["tokens"].chunk(world_size)[rank]
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad.full_tensor(), reference[f"grad.{name}"])
    finally:
        dist.destroy_process_group()
    # Checked: leave without the interpreter's teardown, in which a thread torch left joinable
    # aborts the process now and then (std::terminate with no Python frame; 1 run in 8 at
    # 54143db), which spawn would report as this rank's failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_fsdp_matches_single_process() -> None:
    """2 gloo ranks: sharded init equals 1-rank init, and gradients equal the full batch's."""
    import socket

    import torch.multiprocessing as mp

    model = build(tiny_args())
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1))
    reference = {f"init.{k}": v.clone() for k, v in model.state_dict().items()}
    cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    reference |= {f"grad.{k}": p.grad for k, p in model.named_parameters()}
    reference["tokens"] = tokens
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_fsdp_worker, args=(2, port, reference), nprocs=2)


_BF16_FORWARD = """
import torch
from tests.unit_tests.test_model import build, tiny_args
model = build(tiny_args())
tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(tokens)
assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_a_bf16_forward_runs_on_every_kernel_set(kernel_set: str) -> None:
    """In bf16 autocast on every ATen kernel set of this host. (torch 2.13's CPU flash
    attention raises on a CPU with AMX run on kernels below AVX-512: the model takes the math
    backend there.)"""
    done = run_python(kernel_set, ["-c", _BF16_FORWARD])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().lower() == kernel_set
