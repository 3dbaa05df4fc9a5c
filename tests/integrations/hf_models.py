"""Tiny random transformers models of every family patch_hf runs, and the helpers the drop-in's tests share
(tests/integrations/test_hf.py, test_hf_patch.py, test_peft.py, test_onnx.py and
tests/parallel/test_expert_parallel_hf.py)."""

import contextlib
import copy
import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers", minversion="5.0")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import hf  # noqa: E402
from moe_kernels.testing import assert_close_to_fp64  # noqa: E402

V, H = 64, 32
COMMON = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)


def _config(family: str, layers: int = 2, **overrides):
    T = transformers
    if family == "mixtral":
        return T.MixtralConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                               num_hidden_layers=layers, **COMMON, **overrides)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers, **COMMON, **overrides)
    if family == "qwen3_moe":
        kw = dict(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=layers, **COMMON)
        return T.Qwen3MoeConfig(**{**kw, **overrides})
    if family == "olmoe":
        return T.OlmoeConfig(intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers,
                             **COMMON, **overrides)
    if family == "deepseek_v3":
        kw = dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                  n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                  num_hidden_layers=layers + 1, **{**COMMON, "num_key_value_heads": 4})
        return T.DeepseekV3Config(**{**kw, **overrides})
    if family == "gpt_oss":
        kw = dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                  num_hidden_layers=layers, **COMMON)
        return T.GptOssConfig(**{**kw, **overrides})
    if family in MATCHED:
        return _matched_config(family, layers, overrides)
    raise ValueError(family)


# Families patched by their router's code (hf.families._matched_family) or named for a routing of their own, built from
# the sizes below, each taken where the family's config has that argument.
MATCHED = {  # family -> (config class, model class, the routing patch_hf must report)
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4_moe (DeepSeek-V3 routing)"),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", "dots1 (DeepSeek-V3 routing)"),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", "exaone_moe (DeepSeek-V3 routing)"),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", "solar_open (DeepSeek-V3 routing)"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "qwen3_next (Qwen2-MoE routing)"),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", "flex_olmo (Qwen2-MoE routing)"),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", "minimax (Mixtral routing)"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "qwen3_5_moe (Qwen3-VL-MoE routing)"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", "MiniMax-M2"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepSeek-V2"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "ERNIE-4.5"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", "Llama 4"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepSeek-V4"),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", "Mistral 4"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", "Gemma 4"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", "Granite-MoE"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         "granitemoehybrid (Granite-MoE routing)"),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         "granitemoeshared (Granite-MoE routing)"),
    "jamba": ("JambaConfig", "JambaForCausalLM", "Jamba"),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", "HunYuan-MoE-V1"),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", "LFM2-MoE"),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", "AFMoE"),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", "Cohere2-MoE"),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", "HY-V3"),
    "laguna": ("LagunaConfig", "LagunaForCausalLM", "Laguna"),
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", "MiniCPM5-MoE"),
    "axk2": ("AXK2Config", "AXK2ForCausalLM", "AXK2"),
    "beam": ("BeamConfig", "BeamForCausalLM", "Beam"),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", "Lara-Mini"),
    "flint": ("FlintConfig", "FlintForCausalLM", "Flint"),
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM", "Inkling2"),
    "minimax_m3_vl": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", "MiniMax-M3"),
    "aria": ("AriaTextConfig", "AriaTextForCausalLM", "Aria"),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", "Longcat-Flash"),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", "PhiMoE"),  # transformers' router, our experts
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", "Kolibri"),  # transformers' router, our experts
    "zaya": ("ZayaConfig", "ZayaForCausalLM", "Zaya"),  # transformers' router, our experts
    "kolibri1_1": ("Kolibri1_1Config", "Kolibri1_1ForCausalLM", "Kolibri 1.1"),  # transformers' router, our experts
    "inkling": ("InklingTextConfig", "InklingForCausalLM", "Inkling"),  # transformers' router, our experts
    # sigmoid routing with a selection bias; experts without a gate stored [E, K, N], an RMSNorm per expert after them
    "ergo": ("ErgoConfig", "ErgoForCausalLM", "Ergo"),
    # DeepSeek-V3's router, experts without a gate (squared ReLU), an optional latent projection around the experts
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", "nemotron_h (DeepSeek-V3 routing)"),
}
_SIZES = dict(COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, head_dim=8,
              num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.5, max_position_embeddings=64,
              q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
              linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


_EXTRA = {
    "deepseek_v2": {"num_key_value_heads": 4},  # its latent attention has as many KV heads as heads
    "ernie4_5_moe": {"moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 1, "moe_layer_start_index": 0},
    "llama4": {"intermediate_size": 16, "intermediate_size_mlp": 48, "attention_chunk_size": 64},
    # a learned router in layer 0, a hash-routed layer 1 (transformers' router, our experts)
    "deepseek_v4": {"intermediate_size": 16, "mlp_layer_types": ["moe", "hash_moe"]},
    "mistral4": {"num_key_value_heads": 4},  # latent attention: as many KV heads as heads
    "gemma4": {"enable_moe_block": True, "top_k_experts": 2},  # the decoder layer is the MoE block (GELU experts)
    "granitemoeshared": {"shared_intermediate_size": 24},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16},  # (layers all attention: the Mamba sizes unused)
    # every layer attention and MoE (no Mamba layers: the test stays small)
    "jamba": {"expert_layer_period": 1, "expert_layer_offset": 0, "attn_layer_period": 1, "attn_layer_offset": 0,
              "use_mamba_kernels": False},
    "hunyuan_v1_moe": {"moe_topk": 2},
    "lfm2_moe": {"num_dense_layers": 0},
    "afmoe": {"num_dense_layers": 0, "num_shared_experts": 1, "route_scale": 2.5},
    "hy_v3": {"num_shared_experts": 1, "router_scaling_factor": 2.5},
    "laguna": {"moe_routed_scaling_factor": 2.5},
    "flint": {"mlp_only_layers": []},
    "axk2": {"num_key_value_heads": 4},  # latent attention: as many KV heads as heads
    "aria": {"intermediate_size": 16, "moe_num_experts": 8, "moe_topk": 2, "moe_num_shared_experts": 1},
    # 8 routed experts and 2 zero-computation ones (a token's share of those passes through as is)
    "longcat_flash": {"ffn_hidden_size": 48, "expert_ffn_hidden_size": 16, "moe_topk": 2, "zero_expert_num": 2,
                      "num_key_value_heads": 4},
    # NVFP4-rounded keys and values: head_dim a multiple of 16; every layer MoE
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 2, "mlp_only_layers": []},
    # every layer MoE (by default the first is dense)
    "ergo": {"num_dense_blocks": 0, "shared_intermediate_size": 24, "moe_routed_scaling_factor": 2.5},
    "nemotron_h": {"moe_shared_expert_intermediate_size": 24, "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "n_groups": 2, "ssm_state_size": 8, "chunk_size": 8},
}
# the attention of the hybrid families' layers
_LAYER_TYPE = {"deepseek_v4": "sliding_attention", "granitemoehybrid": "attention", "inkling2": "hybrid",
               "zaya": "hybrid", "axk2": "indexed_attention", "kolibri1_1": "sliding_attention"}
_SPARSE_MLP = ("cohere2_moe", "hy_v3", "laguna", "minicpm5_moe", "beam", "axk2")  # mlp_layer_types: every layer MoE


def _matched_config(family: str, layers: int, overrides: dict):
    cls = getattr(transformers, MATCHED[family][0])
    accepted = inspect.signature(cls.__init__).parameters
    kw = {key: v for key, v in {**_SIZES, **_EXTRA.get(family, {})}.items() if key in accepted}
    if "layer_types" in accepted:  # hybrid families (linear attention): full attention keeps the test small
        kw["layer_types"] = [_LAYER_TYPE.get(family, "full_attention")] * layers
    if family in _SPARSE_MLP:
        kw["mlp_layer_types"] = ["sparse"] * layers
    if "layers_block_type" in accepted:  # Nemotron-H: a layer is one mixer (Mamba, attention, MLP or MoE)
        types = ["full_attention", "moe"] * layers  # each MoE layer after an attention one, the first a Mamba one
        types[0] = "linear_attention" if layers > 1 else types[0]
        return cls(layers_block_type=types, **{**kw, **overrides})
    if "num_layers" in accepted:  # Longcat-Flash: a layer is two attention and MLP sublayers, one MoE block
        return cls(num_layers=layers, **{**kw, **overrides})
    return cls(num_hidden_layers=layers, **{**kw, **overrides})


_CLASSES = {
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
    **{family: model for family, (_, model, _) in MATCHED.items()},
}

# (family, config overrides): every routing variant the patch distinguishes.
CASES = [
    ("mixtral", {}),
    ("qwen2_moe", {"norm_topk_prob": False}),
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("olmoe", {"norm_topk_prob": False}),
    ("olmoe", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
    ("glm4_moe", {"norm_topk_prob": True}),
    ("glm4_moe", {"norm_topk_prob": False}),
    ("dots1", {}),
    ("exaone_moe", {}),
    ("solar_open", {}),
    ("qwen3_next", {"norm_topk_prob": True}),
    ("qwen3_next", {"norm_topk_prob": False}),
    ("flex_olmo", {}),
    ("minimax", {}),
    ("qwen3_5_moe", {}),
    ("minimax_m2", {}),
    ("gpt_oss", {}),
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    ("ernie4_5_moe", {}),
    ("ernie4_5_moe", {"moe_k": 3}),
    ("deepseek_v4", {}),  # sqrt-softplus
    ("deepseek_v4", {"scoring_func": "sigmoid"}),
    ("mistral4", {}),  # 2 groups, the best kept, renormalised
    ("mistral4", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
    ("gemma4", {}),
    ("llama4", {"num_experts_per_tok": 1}),  # Llama 4 Scout's and Maverick's k
    ("llama4", {}),
    ("granitemoe", {}),
    ("granitemoehybrid", {}),
    ("granitemoeshared", {}),
    ("jamba", {}),
    ("hunyuan_v1_moe", {}),
    ("lfm2_moe", {}),  # expert bias, renormalised (+1e-6)
    ("lfm2_moe", {"use_expert_bias": False, "norm_topk_prob": False}),
    ("afmoe", {}),
    ("cohere2_moe", {"expert_selection_fn": "softmax"}),
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": True}),
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False}),
    ("hy_v3", {}),
    ("laguna", {}),
    ("laguna", {"moe_router_logit_softcapping": 1.5}),
    ("minicpm5_moe", {}),  # 2 groups, the best kept
    ("axk2", {"n_group": None, "topk_group": None}),  # its light checkpoints: no group limit (grouped: refused)
    ("beam", {}),
    ("lara_mini", {"norm_topk_prob": True}),
    ("lara_mini", {"norm_topk_prob": False}),
    ("flint", {"norm_topk_prob": True}),
    ("flint", {"norm_topk_prob": False}),
    ("inkling2", {}),
    ("minimax_m3_vl", {}),
    ("aria", {}),  # experts stored [E, K, N], bias-free
    ("longcat_flash", {}),
    ("longcat_flash", {"zero_expert_num": 0}),
    ("phimoe", {}),
    ("kolibri1", {}),
    ("zaya", {"num_experts_per_tok": 1}),  # (Zaya's only k)
    ("kolibri1_1", {}),
    ("inkling", {}),
    ("ergo", {}),  # experts without a gate stored [E, K, N], a norm per expert after them
    ("nemotron_h", {}),  # experts without a gate: act_fn(up) (squared ReLU)
    ("nemotron_h", {"moe_latent_size": 24, "n_group": 1, "topk_group": 1}),  # the experts on a latent width
]
# Llama 4: the block's forward is patched, its router stays transformers' (no router_topk call to compare); PhiMoE
# and Kolibri: transformers' routers, our experts
EXPERTS_ONLY = ("llama4", "phimoe", "kolibri1", "zaya", "kolibri1_1", "inkling")
ROUTER_CASES = [(f, o) for f, o in CASES if f not in EXPERTS_ONLY]
ROUTER_IDS = [f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in ROUTER_CASES]
IDS = [f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in CASES]


def build(family: str, seed: int = 0, layers: int = 2, **overrides) -> nn.Module:
    """A tiny random model; router and expert weights scaled up so routing is decisive and the experts'
    output is a visible part of the logits (transformers' init makes both tiny)."""
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[family])(_config(family, layers, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)
            elif name.endswith((".gate.weight", ".router.weight", ".router.proj.weight", ".gate.wg.weight",
                                ".router.classifier.weight", ".gate.linear.weight")):
                p.normal_(0.0, 1.0)
            elif name.endswith("experts.post_expert_norm.weight"):  # a weight row per expert (Ergo's): not ones
                p.normal_(1.0, 0.5)
        for module in model.modules():
            for bias in ("e_score_correction_bias", "expert_bias"):  # selection biases (buffers)
                if isinstance(getattr(module, bias, None), torch.Tensor):
                    getattr(module, bias).normal_(0.0, 0.1)
    return model


def inputs(seed: int = 1, batch: int = 2, seq: int = 12, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, seq), generator=g).to(device)


def patched_copy(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # supported models patch without a warning
        mk.patch_hf(other)
    return other


def run(model, ids, **kw):
    """The model's output with its router logits: recorded at the gates where the output lacks them (transformers
    5.17's DeepSeek-V3 returns neither router_logits nor aux_loss)."""
    with _recorded_routing(model) as (_, logits):
        out = model(ids, output_router_logits=True, **kw)
    if getattr(out, "router_logits", None) is None:
        out.router_logits = tuple(logits)
    if not hasattr(out, "aux_loss"):
        out.aux_loss = None
    return out


# Routers that transformers runs in fp32 whatever the model's dtype (their forward casts the hidden states to fp32):
# an fp64 copy of the model keeps them in fp32.
FP32_ROUTERS = ("Inkling2TopKRouter",)


def _fp64_copy(model):
    """transformers' model in fp64 on the same weights (fp32 -> fp64 is exact), its experts on transformers' eager
    loop (its grouped_mm experts take no fp64), the routers of FP32_ROUTERS kept in fp32."""
    ref64 = copy.deepcopy(model)
    if hasattr(ref64, "set_experts_implementation"):
        ref64.set_experts_implementation("eager")
    ref64.to(torch.float64)
    for block in moe_blocks(ref64):
        router = hf.common._router_of(block)
        if type(router).__name__ in FP32_ROUTERS:
            router.to(torch.float32)
    return ref64


class _Fp32Draws(TorchDispatchMode):
    """Random draws into fp64 tensors made in fp32 and widened (exactly): from the same seed, an fp64 model draws the
    numbers its fp32 twin draws (PhiMoE's sparsemixer samples, DBRX's and PhiMoE's input jitter)."""

    _INPLACE = (torch.ops.aten.uniform_.default, torch.ops.aten.exponential_.default, torch.ops.aten.normal_.default,
                torch.ops.aten.bernoulli_.float)
    _LIKE = (torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._INPLACE and args[0].dtype == torch.float64:
            narrow = args[0].float()
            func(narrow, *args[1:], **kwargs)
            return args[0].copy_(narrow)
        if func in self._LIKE and (kwargs.get("dtype") or args[0].dtype) == torch.float64:
            return func(args[0].float(), *args[1:], **{**kwargs, "dtype": torch.float32}).double()
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs) and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in torch.utils._pytree.tree_leaves(out)):
            raise AssertionError(f"_Fp32Draws: {func} draws fp64 numbers the fp32 model does not draw")
        return out


def _draws(func, args, kwargs) -> bool:
    """Whether a seeded op draws random numbers: not a dropout (attention's included) of probability 0."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in ("p", "dropout_p"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else arg.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def assert_same_sgd_step(model, ref_model, ids, run_fn=None):
    """One SGD step (lr 0.5) in training mode on the same ids of the patched `model`, transformers' own `ref_model`
    and a copy of it in fp64 (_fp64_copy; the same random draws: torch's seed set before each, for routers that
    sample or jitter in training): each gradient and each parameter after the step by _assert_by_fp64_rule.
    run_fn(model, ids, labels=): the forward (default `run`)."""
    models = (_fp64_copy(ref_model), ref_model, model)
    _forward_backward(models, ids, run_fn or run, run_fn or run)
    _assert_by_fp64_rule(models)
    for m in models:
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    _assert_by_fp64_rule(models, after_step=True)


def assert_compiled_matches(model, ref_model, ids):
    """torch.compile(model, fullgraph=True) (one graph: the ops are registered custom ops with fake implementations)
    against transformers' eager ref_model and its fp64 copy, all in training mode: the logits and every gradient by
    _assert_by_fp64_rule (compiled graphs may reorder fp32 sums)."""
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    models = (_fp64_copy(ref_model), ref_model, model)
    outs = _forward_backward(models, ids, lambda m, ids, labels: m(ids, labels=labels),
                             lambda _, ids, labels: compiled(ids, labels=labels))
    assert_close_to_fp64(outs[2].logits, outs[1].logits, outs[0].logits, "logits")
    _assert_by_fp64_rule(models)


def _forward_backward(models, ids, run_fn, patched_run_fn):
    """models = (fp64 reference, transformers' fp32 model, patched model): each one's forward on ids (labels = ids)
    and backward, torch's seed set before each, the fp64 model drawing its random numbers as the fp32 ones do
    (_Fp32Draws). The fp64 model selects the experts transformers' fp32 model selects for every token (else each fp32
    model's error would be a routing change). Returns the three outputs."""
    outs, picks = [], []
    for m, fn in zip(models, (run_fn, run_fn, patched_run_fn), strict=True):
        m.train()
        torch.manual_seed(0)
        draws = _Fp32Draws() if m is models[0] else contextlib.nullcontext()
        # the references' picks recorded (the patched model runs as it would, no hook of ours added)
        recorded = contextlib.nullcontext(([], [])) if m is models[2] else _recorded_routing(m)
        with recorded as (chosen, _), draws:
            out = fn(m, ids, labels=ids)
            out.loss.backward()
        outs.append(out)
        picks.append(chosen)
    assert picks[0], "no router ran"
    for a, b in zip(picks[0], picks[1], strict=True):
        assert torch.equal(a, b), "the fp64 reference routes some token to other experts than transformers' fp32 model"
    return outs


# transformers' fp32 model against its fp64 copy: rounding moves a gradient or parameter by some fp32 ulps of its
# largest element (up to 2e-4 of it, Gemma 4's scaled embeddings, where the terms cancel), a discrete choice taken
# otherwise (a routing mask, a pick for one of the 24 tokens) by a few percent of it or more. Between the two: the
# fp64 rule compares rounding errors only where this holds.
_ROUNDING_ONLY = 2.0**-8


def _assert_by_fp64_rule(models, after_step=False, check=assert_close_to_fp64, theirs_within=_ROUNDING_ONLY):
    """models = (fp64 reference, transformers' model, patched model): each gradient (and each parameter, after a
    step: then the gradients are not checked again) of the patched model by `check`, by default within
    assert_close_to_fp64's bound of transformers' own fp32 error against the fp64 model (at most twice it + 1e-6 +
    8 fp32 ulps of the reference's max), the flash-attention rule; transformers' own error first within
    `theirs_within` x the reference's largest magnitude (+1e-6), so that the rule never compares against an error
    that is not rounding. The "fp64" model runs in fp32 where transformers casts to fp32 in any dtype (norms,
    attention softmax, some routers): what both fp32 models share there stays out of the comparison. A fixed fp32
    tolerance between the two fp32 models would hang on both their rounding errors, and transformers' alone grows
    with how its CPU sums split across threads (its grouped_mm experts: 2.5x its one-thread error at flex_olmo with
    two threads, ours unchanged)."""
    named = [dict(m.named_parameters()) for m in models]
    assert named[0].keys() == named[1].keys() == named[2].keys()
    for name, p64 in named[0].items():
        theirs, ours = named[1][name], named[2][name]
        assert (p64.grad is None) == (theirs.grad is None) == (ours.grad is None), name
        if after_step:
            a, b, ref, what = ours, theirs, p64, f"{name} after the step"
        elif p64.grad is not None:
            a, b, ref, what = ours.grad, theirs.grad, p64.grad, f"grad {name}"
        else:
            continue
        if theirs_within is not None and ref.numel():
            r = ref.detach().double()
            err, size = (b.detach().double() - r).abs().max().item(), r.abs().max().item()
            assert err <= theirs_within * size + 1e-6, (
                f"{what}: transformers' own error {err:.3g} is no rounding error (max|ref| {size:.3g}): the fp64 "
                "model took another discrete choice")
        check(a, b, ref, what)


def assert_same_outputs(out, ref, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(out.logits, ref.logits, rtol=rtol, atol=atol)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    for a, b in zip(out.router_logits, ref.router_logits):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    if ref.aux_loss is not None:
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=rtol, atol=atol)
    else:
        assert out.aux_loss is None


def moe_blocks(model):
    """The MoE blocks: a router and experts (JetMoE's blocks hold their experts' projections themselves)."""
    return [m for m in model.modules()
            if (hasattr(m, "experts") or hasattr(m, "input_linear")) and hf.common._router_of(m) is not None]


@contextlib.contextmanager
def _recorded_routing(model):
    """Collects, per forward of `model`, each MoE layer's selected experts per token (sorted ascending) and its
    router logits (the gate's first output, what `output_router_logits` returns on the transformers versions
    whose DeepSeek-V3 returns them; 5.17's does not)."""
    picks, logits = [], []

    def record(m, _args, out):
        if len(out) in (2, 5):  # Llama 4's router: (scores, logits); JetMoE's: (..., logits); the top-k by logit
            picks.append(torch.topk(out[-1], m.top_k, dim=1).indices.sort(-1).values)
            logits.append(out[-1])
            return
        picks.append(out[2].long().sort(-1).values)
        logits.append(out[0])

    hooks = [hf.common._router_of(block).register_forward_hook(record) for block in moe_blocks(model)]
    try:
        yield picks, logits
    finally:
        for h in hooks:
            h.remove()


def _decisive_ids(model, ref64, k, device):
    """Inputs on which the routing is decided: no exact tie at the top-k boundary of the bf16 model's router
    logits (there transformers' topk and ours may pick different experts, both correctly), and the bf16 model
    selects the experts the fp64 reference selects for every token (a token routed elsewhere would swamp every
    error compared against the reference)."""
    for seed in range(50):
        ids = inputs(seed, device=device)
        with torch.no_grad(), _recorded_routing(model) as (picks, _), _recorded_routing(ref64) as (picks64, _):
            logits = run(model, ids).router_logits
            run(ref64, ids)
        boundary = [lg.float().sort(-1, descending=True).values[:, k - 1 : k + 1] for lg in logits]
        if all((b[:, 0] != b[:, 1]).all() for b in boundary) and all(
            torch.equal(a, b) for a, b in zip(picks, picks64, strict=True)
        ):
            return ids
    raise AssertionError("no input found whose routing is decided the same way in bf16 and fp64")
