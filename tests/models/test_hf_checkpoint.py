"""Hugging Face checkpoints: tiny random transformers models saved with save_pretrained load into our model with
the same logits (fp32, CPU), and what we save loads back into transformers with the same logits again."""

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers", minversion="5.0")

from moe_kernels.models import config_from_hf, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from moe_kernels.models.transformer import rope_inv_freq  # noqa: E402

V = 128
TOL = dict(rtol=1e-4, atol=1e-4)

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_config(family: str, **overrides):
    T = transformers
    if family == "mixtral":
        kw = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=V)
        return T.MixtralConfig(**{**kw, **overrides})
    if family == "qwen3_moe":
        kw = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                  vocab_size=V)
        return T.Qwen3MoeConfig(**{**kw, **overrides})
    kw = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
              num_experts_per_tok=2, vocab_size=V, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1)
    return T.DeepseekV3Config(**{**kw, **overrides})


def hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model; router and expert weights scaled up (transformers' init makes both tiny)
    so routing is decisive and the experts are a visible part of the logits; a random DeepSeek expert bias."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def inputs(batch=2, seq=24):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(1))


CASES = [
    ("mixtral", {}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen3_moe", {"norm_topk_prob": True, "tie_word_embeddings": True, "mlp_only_layers": [0]}),
    ("deepseek_v3", {}),  # interleaved rotary, q low-rank, 4 groups / top 2, normalised
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False, "n_group": 1,
                     "topk_group": 1}),
    ("deepseek_v3", {"rope_parameters": _YARN, "max_position_embeddings": 256}),
]
IDS = [f + "".join(f"-{k}" for k in o) for f, o in CASES]


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=IDS)
def test_round_trip(family, overrides, tmp_path):
    hf = hf_model(family, **overrides)
    hf.save_pretrained(tmp_path / "hf")
    x = inputs()
    with torch.no_grad():
        expected = hf(x).logits

    # transformers -> ours
    ours = load_hf_checkpoint(tmp_path / "hf").eval()
    assert ours.config.family == family
    with torch.no_grad():
        logits, _ = ours(x)
    torch.testing.assert_close(logits, expected, **TOL)

    # ours -> transformers (sharded for one case: the index file path)
    save_hf_checkpoint(ours, tmp_path / "ours", max_shard_bytes=200_000 if family == "deepseek_v3" else 5 * 2**30)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists() == (family == "deepseek_v3")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, logits, **TOL)
    # and our own reader takes what we wrote, config included
    again = load_hf_checkpoint(tmp_path / "ours")
    assert again.config == ours.config
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_expert_layout_and_routing_fields(tmp_path):
    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    block, layer = hf.model.layers[1].mlp, ours.layers[1].mlp
    torch.testing.assert_close(layer.experts.w13, block.experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(layer.experts.w2, block.experts.down_proj, rtol=0, atol=0)
    torch.testing.assert_close(layer.router.expert_bias, block.gate.e_score_correction_bias, rtol=0, atol=0)
    r = ours.config.moe.router
    assert (r.score, r.num_groups, r.group_topk, r.group_score_topk, r.scaling_factor, r.normalize) == (
        "sigmoid", 4, 2, 2, 2.5, True)
    assert r.expert_bias and r.seq_aux_loss_coeff == 1e-4 and r.aux_loss_coeff == 0
    assert ours.config.first_k_dense == 1 and ours.config.moe.shared_ffn_size == 32
    mix = config_from_hf(hf_config("mixtral", router_aux_loss_coef=0.02).to_dict())
    assert (mix.moe.router.score, mix.moe.router.pre_softmax, mix.moe.router.aux_loss_coeff) == ("softmax", False, 0.02)
    qwen = config_from_hf(hf_config("qwen3_moe", norm_topk_prob=False).to_dict())
    assert qwen.moe.router.pre_softmax and qwen.qk_norm and qwen.head_dim == 32


def test_fused_expert_layout_loads(tmp_path):
    """transformers' in-memory names (fused gate_up_proj / down_proj) load too."""
    hf = hf_model("qwen3_moe", norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    ours = load_hf_checkpoint(tmp_path).eval()
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits, **TOL)


def test_comparison_is_sensitive_to_routing(tmp_path):
    """Control: the same weights with Qwen3's other renormalisation give clearly different logits."""
    hf = hf_model("qwen3_moe", norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    wrong = load_hf_checkpoint(tmp_path, pre_softmax=True).eval()
    x = inputs()
    with torch.no_grad():
        assert (wrong(x)[0] - hf(x).logits).abs().max() > 1e-2


def test_gradients_match_transformers(tmp_path):
    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path, seq_aux_loss_coeff=0.0)
    x = inputs()
    torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), x.flatten()).backward()
    logits, aux = ours(x)
    assert aux.item() == 0.0
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    pairs = [
        (ours.embed_tokens.weight, hf.model.embed_tokens.weight),
        (ours.lm_head.weight, hf.lm_head.weight),
        (ours.layers[0].self_attn.kv_b_proj.weight, hf.model.layers[0].self_attn.kv_b_proj.weight),
        (ours.layers[2].self_attn.q_a_proj.weight, hf.model.layers[2].self_attn.q_a_proj.weight),
        (ours.layers[1].mlp.experts.w13, hf.model.layers[1].mlp.experts.gate_up_proj),
        (ours.layers[1].mlp.experts.w2, hf.model.layers[1].mlp.experts.down_proj),
        (ours.layers[2].mlp.router.weight, hf.model.layers[2].mlp.gate.weight),
        (ours.layers[2].mlp.shared_experts.up_proj.weight, hf.model.layers[2].mlp.shared_experts.up_proj.weight),
    ]
    for a, b in pairs:
        torch.testing.assert_close(a.grad, b.grad, **TOL)


def test_yarn_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = hf_config("deepseek_v3", rope_parameters=dict(_YARN), max_position_embeddings=256)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    freq, factor = rope_inv_freq(config_from_hf(hf_cfg.to_dict()))
    torch.testing.assert_close(freq, want_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor)
    plain, _ = rope_inv_freq(config_from_hf(hf_config("deepseek_v3").to_dict()))
    assert not torch.allclose(freq, plain)  # the case is not trivially the default rotary


def test_bf16_load(tmp_path):
    hf_model("mixtral").save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(layer.router.weight.dtype == torch.float32 for layer in model.moe_layers())
    logits, _ = model(inputs())
    assert logits.dtype == torch.bfloat16


def _base(family: str) -> dict:
    return hf_config(family).to_dict()


@pytest.mark.parametrize(("family", "change", "match"), [
    ("mixtral", {"sliding_window": 4096}, "sliding-window"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "leading dense"),
    ("mixtral", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rotary type"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("deepseek_v3", {"model_type": "deepseek_v2"}, "model_type"),
])
def test_unsupported_configs_are_rejected(family, change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**_base(family), **change})


def test_mtp_layers_are_skipped_and_strays_rejected(tmp_path):
    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    extra = {"model.layers.3.embed_tokens.weight": torch.zeros(2), "model.layers.3.eh_proj.weight": torch.zeros(2)}
    save_file(extra, str(tmp_path / "mtp.safetensors"))
    load_hf_checkpoint(tmp_path)  # past num_hidden_layers: the multi-token-prediction module, skipped
    save_file({"model.layers.0.stray.weight": torch.zeros(2)}, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ValueError, match="no place for"):
        load_hf_checkpoint(tmp_path)


def test_written_config_is_plain_json(tmp_path):
    hf_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    save_hf_checkpoint(load_hf_checkpoint(tmp_path / "hf"), tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert written["num_experts"] == 8 and written["norm_topk_prob"] is False


# The released config.json files (transformers 4.x format: rope_theta / rope_scaling), fields that matter here.
PUBLISHED_CONFIGS = {
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "model_type": "qwen3_moe", "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
    },
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3, without its fp8 quantization_config
        "model_type": "deepseek_v3", "attention_bias": False, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
    },
}
PUBLISHED_CONFIGS["qwen3-235b-a22b"] = {  # Qwen/Qwen3-235B-A22B: the 30B-A3B file with these fields changed
    **PUBLISHED_CONFIGS["qwen3-30b-a3b"], "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94,
}


@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_presets_are_the_published_configs(name):
    from moe_kernels.models import PRESETS

    assert config_from_hf(PUBLISHED_CONFIGS[name]) == PRESETS[name]()
