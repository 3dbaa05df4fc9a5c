"""moe_kernels.models: the forward contract, presets at published sizes on the meta device, the FLOP count by
hand, activation checkpointing, meta -> real materialisation and config validation (CPU, fp32 references)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.models import PRESETS, ModelConfig, active_matmul_params, build_model, flops_per_token
from moe_kernels.models.transformer import MoETransformer
from moe_kernels.nn import MoELayer

TINY = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3"]


def tiny(name: str, **overrides) -> ModelConfig:
    return PRESETS[name](**overrides)


def ids(batch=2, seq=16, vocab=256, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, tokens):
    logits, aux = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux


# ---------------------------------------------------------------------------------------------------
# Forward contract


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_layer_forward_contract(name, dtype):
    # One MoE layer (DeepSeek's leading dense layer off), so the block under test is the MoE one.
    cfg = tiny(name, vocab_size=96, num_layers=1, first_k_dense=0)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype)
    assert isinstance(model, MoETransformer) and model.config is cfg
    logits, aux = model(ids(3, 10, vocab=96))
    assert logits.shape == (3, 10, 96) and logits.dtype == dtype
    assert aux.shape == () and aux.dtype == torch.float32 and aux.requires_grad
    assert torch.isfinite(logits).all() and aux.item() > 0
    layers = list(model.moe_layers())
    assert len(layers) == 1 and isinstance(layers[0], MoELayer)
    assert layers[0].router.weight.dtype == torch.float32  # routers stay fp32 in a bf16 model
    (logits.float().square().mean() + aux).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_aux_loss_is_the_sum_over_moe_layers(name):
    model = build_model(tiny(name, num_layers=3)).eval()
    x = ids()
    _, aux = model(x)
    h = model.embed_tokens(x)
    from moe_kernels.models.transformer import rope_cos_sin

    cos, sin = rope_cos_sin(model.config, x.shape[1], h.device, h.dtype)
    expected = torch.zeros(())
    for block in model.layers:
        h, layer_aux = block(h, cos, sin)
        expected = expected + layer_aux
    assert len(list(model.moe_layers())) == model.config.num_layers - model.config.first_k_dense
    torch.testing.assert_close(aux, expected)


@pytest.mark.parametrize("name", TINY)
def test_causal(name):
    """Changing later tokens leaves earlier logits alone (routing is per token: no capacity here). Up to fp32
    rounding: the expert GEMMs group rows differently when other tokens route elsewhere."""
    model = build_model(tiny(name)).eval()
    a = ids(2, 24)
    b = a.clone()
    b[:, 12:] = (b[:, 12:] + 1) % 256
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :12], lb[:, :12])
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_tied_embeddings_share_the_matrix():
    model = build_model(tiny("tiny-qwen3-moe", tie_embeddings=True))
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    final = {}
    model.norm.register_forward_hook(lambda mod, args, out: final.update(h=out))
    logits, _ = model(ids())
    torch.testing.assert_close(logits, final["h"] @ model.embed_tokens.weight.T)


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = build_model(tiny("tiny-mixtral", max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(ids(1, 9))


# ---------------------------------------------------------------------------------------------------
# Activation checkpointing


@pytest.mark.parametrize("name", TINY)
def test_activation_checkpointing_same_loss_and_gradients(name):
    torch.manual_seed(0)
    model = build_model(tiny(name))
    x = ids(2, 32)
    loss = lm_loss(model, x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_activation_checkpointing(True)
    loss_ckpt = lm_loss(model, x)
    loss_ckpt.backward()
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=lambda m: f"{n}: {m}")


def test_activation_checkpointing_counts_tokens_once():
    # The recomputation in the backward runs the routers again; their expert-bias counts must not double.
    torch.manual_seed(0)
    model = build_model(tiny("tiny-deepseek-v3"))
    layers = list(model.moe_layers())
    assert layers and all(layer.router.tokens_seen is not None for layer in layers)
    x = ids(2, 32)
    lm_loss(model, x).backward()
    plain = [layer.router.tokens_seen.clone() for layer in layers]
    assert all(int(c.sum()) == 2 * 32 * layer.router.config.k for c, layer in zip(plain, layers))
    for layer in layers:
        layer.router.tokens_seen.zero_()
    model.set_activation_checkpointing(True)
    lm_loss(model, x).backward()
    for c, layer in zip(plain, layers):
        assert torch.equal(layer.router.tokens_seen, c)


# ---------------------------------------------------------------------------------------------------
# Presets


# name -> (published total parameters, published active parameters)
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "deepseek-v3": (671e9, 37e9),  # without the 14B multi-token-prediction module
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_sizes_on_meta(name):
    cfg = PRESETS[name]()
    model = build_model(cfg, device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    # active = embedding row + norms + the matmul weights one token passes through (k routed experts)
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    active = cfg.vocab_size * cfg.hidden_size + norms + active_matmul_params(cfg)
    want_total, want_active = PUBLISHED[name]
    assert abs(total / want_total - 1) < 0.02, f"{name}: {total / 1e9:.2f}B parameters, published {want_total / 1e9}B"
    assert abs(active / want_active - 1) < 0.02, f"{name}: {active / 1e9:.2f}B active, published {want_active / 1e9}B"


def test_every_preset_builds_on_meta_and_runs_a_meta_forward():
    for name, preset in PRESETS.items():
        cfg = preset(num_layers=min(4, preset().num_layers), vocab_size=512, max_seq_len=64)
        model = build_model(cfg, device="meta")
        logits, aux = model(torch.zeros(2, 8, dtype=torch.int64, device="meta"))
        assert logits.shape == (2, 8, 512) and aux.shape == (), name


def test_preset_overrides():
    cfg = PRESETS["tiny-qwen3-moe"](vocab_size=1000, num_layers=3, max_seq_len=64, hidden_size=32, num_experts=4,
                                    k=1, backend="reference", aux_loss_coeff=0.0)
    assert (cfg.vocab_size, cfg.num_layers, cfg.max_seq_len, cfg.hidden_size) == (1000, 3, 64, 32)
    assert cfg.moe.router.hidden_size == 32 and cfg.moe.num_experts == 4 and cfg.moe.router.k == 1
    assert cfg.moe.backend == "reference" and cfg.moe.router.aux_loss_coeff == 0.0
    assert PRESETS["tiny-deepseek-v3"](kv_lora_rank=8).mla.kv_lora_rank == 8
    four = PRESETS["qwen3-30b-a3b-4layers"]()
    assert four.num_layers == 4 and four == PRESETS["qwen3-30b-a3b"](num_layers=4)
    with pytest.raises(TypeError, match="unknown config field"):
        PRESETS["tiny-mixtral"](vocab=10)
    with pytest.raises(TypeError, match="latent attention"):
        PRESETS["tiny-mixtral"](kv_lora_rank=8)


def test_config_is_frozen_and_validated():
    cfg = tiny("tiny-mixtral")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 3
    with pytest.raises(TypeError):
        ModelConfig("mixtral")  # keyword-only
    bad = [
        dict(family="llama"),
        dict(num_kv_heads=3),
        dict(first_k_dense=1),  # dense layers need dense_ffn_size
        dict(vocab_size=0),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            cfg.replace(**change)
    with pytest.raises(ValueError, match="mla"):
        cfg.replace(family="deepseek_v3")
    with pytest.raises(ValueError, match="hidden_size"):
        dataclasses.replace(cfg, hidden_size=32)  # the router would keep 64; replace() moves both


# ---------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_per_token_by_hand():
    cfg = PRESETS["tiny-qwen3-moe"](vocab_size=256)
    S = 128
    # H=64, 2 layers, 4 query heads, 2 key/value heads, head dim 32, 8 experts, k=2, expert FFN 32, V=256.
    q = 64 * 4 * 32  # 8192
    kv = 2 * 64 * 2 * 32  # 8192
    o = 4 * 32 * 64  # 8192
    router = 8 * 64  # 512
    experts = 2 * 3 * 64 * 32  # two routed experts of gate+up+down: 12288
    per_layer = q + kv + o + router + experts  # 37376
    lm_head = 256 * 64  # 16384
    matmul_params = 2 * per_layer + lm_head  # 91136
    # attention: QK^T 2*S*heads*32 + AV 2*S*heads*32 per layer for the full square, half of it causal
    attention = 2 * (2 * S * 4 * 32 + 2 * S * 4 * 32) // 2  # 2 layers * 32768 = 65536
    forward = 2 * matmul_params + attention  # 247808
    assert flops_per_token(cfg, S) == 3 * forward == 743424
    assert flops_per_token(cfg, S, causal=False) == 3 * (2 * matmul_params + 2 * attention)


def test_flops_per_token_by_hand_mla():
    cfg = PRESETS["tiny-deepseek-v3"](vocab_size=256)
    S = 64
    # H=64, 3 layers (1 dense FFN 128, 2 MoE), 4 heads; q_lora 32, kv_lora 32, nope 16, rope 8, v 16;
    # 8 experts, k=2, expert FFN 32, one shared expert of 32.
    attn = 64 * 32 + 32 * 4 * 24 + 64 * (32 + 8) + 32 * 4 * (16 + 16) + 4 * 16 * 64  # 2048+3072+2560+4096+4096
    dense = 3 * 64 * 128
    moe = 8 * 64 + 2 * 3 * 64 * 32 + 3 * 64 * 32
    matmul_params = 3 * attn + dense + 2 * moe + 256 * 64
    attention = 3 * S * 4 * (24 + 16)  # causal half of 2*S*heads*(d_qk + d_v)
    assert flops_per_token(cfg, S) == 3 * (2 * matmul_params + attention)


@pytest.mark.parametrize("name", list(PRESETS))
def test_active_matmul_params_match_the_model(name):
    """The analytic count equals the model's matmul weights minus the experts a token skips."""
    cfg = PRESETS[name](num_layers=4 if name != "tiny-mixtral" else 2)
    model = build_model(cfg, device="meta")
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n)
    skipped = (cfg.moe.num_experts - cfg.moe.router.k) * 3 * cfg.hidden_size * cfg.moe.ffn_size * cfg.num_moe_layers
    tied_head = cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0
    assert active_matmul_params(cfg) == matrices - skipped + tied_head


# ---------------------------------------------------------------------------------------------------
# Initialisation and the meta device


def test_meta_then_to_empty_and_init_weights():
    cfg = tiny("tiny-deepseek-v3")
    model = build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    for layer in model.moe_layers():
        assert torch.equal(layer.router.expert_bias, torch.zeros(cfg.moe.num_experts))
        assert torch.equal(layer.router.tokens_seen, torch.zeros(cfg.moe.num_experts, dtype=torch.int64))
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden_size))
    std = model.layers[1].mlp.experts.w13.std().item()
    assert 0.015 < std < 0.025  # init_std = 0.02
    logits, aux = model(ids())
    assert torch.isfinite(logits).all() and torch.isfinite(aux)


def test_tiny_step_trains():
    """A few AdamW steps on one batch lower the loss (the whole graph is differentiable and wired)."""
    torch.manual_seed(0)
    model = build_model(tiny("tiny-deepseek-v3"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for layer in model.moe_layers():
        layer.router.register_bias_update_hook(opt)
    x = ids(2, 16)
    losses = []
    for _ in range(6):
        loss = lm_loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert any(layer.router.expert_bias.abs().sum() > 0 for layer in model.moe_layers())
