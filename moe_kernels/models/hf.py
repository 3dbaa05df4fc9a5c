"""Hugging Face checkpoints (config.json + safetensors) <-> MoETransformer, for Mixtral, Qwen3-MoE and DeepSeek-V3.

    model = load_hf_checkpoint("path/to/Qwen3-30B-A3B")            # any local transformers checkpoint directory
    save_hf_checkpoint(model, "out/")                               # AutoModelForCausalLM.from_pretrained("out/")

Reading needs only safetensors (transformers is not imported). Written against transformers 5.x:

- Tensor names. Ours are transformers' in-memory names without the `model.` prefix, except inside MoE layers:
  `mlp.router.weight` <- `mlp.gate.weight`, `mlp.router.expert_bias` <- `mlp.gate.e_score_correction_bias`
  (DeepSeek-V3), `mlp.experts.w13` [E, 2F, H] <- gate rows then up rows, `mlp.experts.w2` [E, H, F] <- down.
- Expert layout. transformers 5.x holds fused `experts.gate_up_proj` [E, 2F, H] / `experts.down_proj` [E, H, F] in
  memory, but its save_pretrained (5.23 checked) writes the released per-expert layout back: Qwen3-MoE and
  DeepSeek-V3 `mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
  (w1 gate, w3 up, w2 down). We read both layouts and write the per-expert one, which every transformers
  version and the released checkpoints use.
- Routing (config -> RouterConfig): Mixtral softmax over the top-k logits (score="softmax"); Qwen3-MoE softmax
  over all experts, renormalised over the top-k only with norm_topk_prob (True -> pre_softmax=False, False ->
  pre_softmax=True); DeepSeek-V3 sigmoid, selection by score + e_score_correction_bias, n_group/topk_group with a
  group's score the sum of its top 2, normalised with norm_topk_prob, times routed_scaling_factor.
- Losses (training only): router_aux_loss_coef -> aux_loss_coeff (Mixtral, Qwen3; transformers applies it to the
  layer-averaged Switch loss, we add each layer's loss, so the same coefficient weighs num_moe_layers times more);
  DeepSeek-V3 -> aux-loss-free expert bias on and the sequence-wise aux loss at 1e-4 (the paper's alpha).

Not supported, rejected with a ValueError naming the field: quantised checkpoints (quantization_config, e.g. the
released DeepSeek-V3 fp8 weights: dequantize first), activations other than silu, attention biases, sliding-window
attention, rotary types other than default and yarn, partial rotary, Qwen3 dense layers other than leading ones.
Training-only settings we do not model (Mixtral's router jitter, attention dropout) are dropped with a warning.
DeepSeek-V3's multi-token-prediction layers (model.layers.{num_hidden_layers}.*) are skipped, as transformers does.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor

from moe_kernels.models.config import MLAConfig, ModelConfig, YarnConfig
from moe_kernels.models.transformer import MoETransformer, _yarn_factor, build_model
from moe_kernels.nn import MoEConfig, RouterConfig

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Where config.json leaves a field out, transformers' config class defaults apply; these differ by family.
_DEFAULT_THETA = {"mixtral": 1e6, "qwen3_moe": 10000.0, "deepseek_v3": 10000.0}
_DEFAULT_EPS = {"mixtral": 1e-5, "qwen3_moe": 1e-6, "deepseek_v3": 1e-6}
_DEEPSEEK_SEQ_AUX_LOSS = 1e-4
_MISSING = object()


# ---------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _get(hf: dict, *names: str, default=_MISSING):
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is _MISSING:
        raise ValueError(f"config.json: `{names[0]}` is missing")
    return default


def _rope_from_hf(hf: dict, family: str) -> dict:
    # transformers 5.x writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_THETA[family]))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return dict(rope_theta=float(theta), rope_scaling=None)
    if rope_type != "yarn":
        raise ValueError(f"config.json: rotary type {rope_type!r} is not supported (only 'default' and 'yarn')")
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    yarn = YarnConfig(
        factor=params.get("factor"),
        original_max_seq_len=int(original or _get(hf, "max_position_embeddings")),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
    return dict(rope_theta=float(theta), rope_scaling=yarn)


def config_from_hf(hf: dict | str | os.PathLike, **overrides) -> ModelConfig:
    """ModelConfig from a transformers config (a dict, a config.json path, or a checkpoint directory)."""
    if not isinstance(hf, dict):
        path = Path(hf)
        hf = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise ValueError(f"config.json: model_type {family!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    if hf.get("quantization_config"):
        raise ValueError("config.json: quantised checkpoints (quantization_config) are not supported; dequantize first")
    if _get(hf, "hidden_act", default="silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; only silu (SwiGLU) is supported")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=True is not supported")
    if hf.get("sliding_window") is not None and (family == "mixtral" or hf.get("use_sliding_window")):
        raise ValueError("config.json: sliding-window attention is not supported")
    for name in ("attention_dropout", "router_jitter_noise"):
        if hf.get(name):
            warnings.warn(f"config.json: {name}={hf[name]} is a training-time setting this model does not have; dropped")
    H, L = _get(hf, "hidden_size"), _get(hf, "num_hidden_layers")
    common = dict(
        family=family, vocab_size=_get(hf, "vocab_size"), hidden_size=H, num_layers=L,
        num_heads=_get(hf, "num_attention_heads"), max_seq_len=_get(hf, "max_position_embeddings"),
        rms_norm_eps=float(_get(hf, "rms_norm_eps", default=_DEFAULT_EPS[family])),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", default=False)), **_rope_from_hf(hf, family),
    )
    E, k = _get(hf, "num_local_experts", "num_experts", "n_routed_experts"), _get(hf, "num_experts_per_tok")
    aux = float(_get(hf, "router_aux_loss_coef", default=0.001))
    if family == "mixtral":
        router = RouterConfig(hidden_size=H, num_experts=E, k=k, score="softmax", aux_loss_coeff=aux)
        cfg = ModelConfig(**common, num_kv_heads=_get(hf, "num_key_value_heads"), head_dim=hf.get("head_dim"),
                          moe=MoEConfig(router=router, ffn_size=_get(hf, "intermediate_size")))
    elif family == "qwen3_moe":
        step, mlp_only = _get(hf, "decoder_sparse_step", default=1), set(_get(hf, "mlp_only_layers", default=[]))
        dense = [i for i in range(L) if i in mlp_only or (i + 1) % step != 0]
        if dense != list(range(len(dense))):
            raise ValueError(f"config.json: dense layers {dense} (mlp_only_layers / decoder_sparse_step); only "
                             "leading dense layers are supported")
        router = RouterConfig(hidden_size=H, num_experts=E, k=k, score="softmax",
                              pre_softmax=not _get(hf, "norm_topk_prob", default=False), aux_loss_coeff=aux)
        cfg = ModelConfig(**common, num_kv_heads=_get(hf, "num_key_value_heads"), head_dim=hf.get("head_dim"),
                          moe=MoEConfig(router=router, ffn_size=_get(hf, "moe_intermediate_size")),
                          first_k_dense=len(dense), dense_ffn_size=_get(hf, "intermediate_size") if dense else 0)
    else:
        F = _get(hf, "moe_intermediate_size")
        groups = _get(hf, "n_group", default=8)
        grouped = groups > 1
        router = RouterConfig(
            hidden_size=H, num_experts=E, k=k, score="sigmoid", num_groups=groups if grouped else None,
            group_topk=_get(hf, "topk_group", default=4) if grouped else None,
            group_score_topk=min(2, E // groups) if grouped else None,
            scaling_factor=float(_get(hf, "routed_scaling_factor", default=2.5)),
            normalize=bool(_get(hf, "norm_topk_prob", default=True)), expert_bias=True,
            seq_aux_loss_coeff=_DEEPSEEK_SEQ_AUX_LOSS,
        )
        mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=_get(hf, "kv_lora_rank"),
                        qk_nope_head_dim=_get(hf, "qk_nope_head_dim"), qk_rope_head_dim=_get(hf, "qk_rope_head_dim"),
                        v_head_dim=_get(hf, "v_head_dim"))
        first_k = min(_get(hf, "first_k_dense_replace", default=3), L)
        cfg = ModelConfig(
            **common, num_kv_heads=common["num_heads"], mla=mla, rope_interleave=bool(hf.get("rope_interleave", True)),
            moe=MoEConfig(router=router, ffn_size=F, shared_ffn_size=F * _get(hf, "n_shared_experts", default=1)),
            first_k_dense=first_k, dense_ffn_size=_get(hf, "intermediate_size") if first_k else 0,
        )
    return cfg.replace(**overrides) if overrides else cfg


def _hf_incompatibilities(cfg: ModelConfig) -> list[str]:
    """What of `cfg` the transformers class of its family cannot express (empty when saving is exact)."""
    moe, r = cfg.moe, cfg.moe.router
    bad = []
    if moe.activation != "swiglu":
        bad.append(f"activation={moe.activation!r} (its experts are SwiGLU)")
    if moe.shared_gate:
        bad.append("shared_gate (Qwen2-MoE's gated shared expert)")
    if cfg.family == "deepseek_v3":
        if r.score != "sigmoid":
            bad.append(f"score={r.score!r} (DeepSeek-V3 routes with sigmoid)")
        if r.num_groups is not None and r.group_score_topk != min(2, r.num_experts // r.num_groups):
            bad.append(f"group_score_topk={r.group_score_topk} (transformers sums each group's top 2)")
        if moe.shared_ffn_size % moe.ffn_size:
            bad.append(f"shared_ffn_size={moe.shared_ffn_size} is not a multiple of ffn_size={moe.ffn_size}")
        return bad
    if r.score != "softmax" or r.num_groups is not None or r.expert_bias or r.scaling_factor not in (None, 1.0):
        bad.append("routing other than softmax top-k (sigmoid, groups, expert bias or scaling)")
    if cfg.family == "mixtral" and r.pre_softmax:
        bad.append("pre_softmax=True (Mixtral renormalises over the top-k)")
    if moe.shared_ffn_size:
        bad.append("shared experts")
    if cfg.family == "mixtral" and cfg.first_k_dense:
        bad.append("dense layers (first_k_dense)")
    if cfg.rope_interleave:
        bad.append("rope_interleave")
    return bad


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json transformers 5.x reads for `cfg` (raises ValueError when it cannot express it)."""
    bad = _hf_incompatibilities(cfg)
    if bad:
        raise ValueError(f"{cfg.family} checkpoints cannot express: {', '.join(bad)}")
    r = cfg.moe.router
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": _yarn_factor(cfg),
                "original_max_position_embeddings": y.original_max_seq_len, "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow, "truncate": y.truncate}
        rope.update({k: v for k, v in (("mscale", y.mscale), ("mscale_all_dim", y.mscale_all_dim),
                                       ("attention_factor", y.attention_factor)) if v is not None})
    hf = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope, "num_experts_per_tok": r.k,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
    }
    if cfg.head_dim is not None:
        hf["head_dim"] = cfg.head_dim
    if cfg.family == "mixtral":
        hf.update(num_local_experts=r.num_experts, intermediate_size=cfg.moe.ffn_size,
                  router_aux_loss_coef=r.aux_loss_coeff, sliding_window=None)
    elif cfg.family == "qwen3_moe":
        hf.update(num_experts=r.num_experts, moe_intermediate_size=cfg.moe.ffn_size,
                  norm_topk_prob=not r.pre_softmax or bool(r.normalize), router_aux_loss_coef=r.aux_loss_coeff, decoder_sparse_step=1,
                  mlp_only_layers=list(range(cfg.first_k_dense)), use_sliding_window=False,
                  intermediate_size=cfg.dense_ffn_size or cfg.moe.ffn_size)
    else:
        m = cfg.mla
        hf.update(
            n_routed_experts=r.num_experts, moe_intermediate_size=cfg.moe.ffn_size,
            n_shared_experts=cfg.moe.shared_ffn_size // cfg.moe.ffn_size,
            intermediate_size=cfg.dense_ffn_size or cfg.moe.ffn_size, first_k_dense_replace=cfg.first_k_dense,
            n_group=r.num_groups or 1, topk_group=r.group_topk or 1,
            routed_scaling_factor=r.scaling_factor if r.scaling_factor is not None else 1.0,
            norm_topk_prob=r.normalize if r.normalize is not None else r.k > 1,
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=cfg.rope_interleave,
            num_nextn_predict_layers=0,
        )
    return hf


# ---------------------------------------------------------------------------------------------------
# Tensor names

_MOE_KEY = re.compile(
    r"layers\.(\d+)\.mlp\.(router\.weight|router\.expert_bias|router\.tokens_seen|experts\.w13|experts\.w2)$"
)
# transformers' names, normalised: Mixtral's block_sparse_moe -> mlp, its w1/w3/w2 -> gate_proj/up_proj/down_proj.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _normalise(name: str) -> str:
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])\.weight$", lambda m: f"{m[1]}{_MIXTRAL_EXPERT[m[2]]}.weight", name)


def _hf_name(family: str, name: str) -> str:
    """Normalised transformers name -> the name save_pretrained writes."""
    if family != "mixtral" or ".mlp." not in name:
        return name
    inverse = {v: k for k, v in _MIXTRAL_EXPERT.items()}
    name = name.replace(".mlp.", ".block_sparse_moe.")
    return re.sub(r"(\.experts\.\d+\.)(\w+_proj)\.weight$", lambda m: f"{m[1]}{inverse[m[2]]}.weight", name)


class _Shards:
    """The tensors of a checkpoint directory, read one at a time (model.safetensors.index.json when present,
    else every *.safetensors file)."""

    def __init__(self, path: Path, stack: ExitStack):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self._handles = [stack.enter_context(safe_open(str(path / f), framework="pt")) for f in files]
        self.where = {}  # normalised name -> (handle, original name)
        for handle in self._handles:
            for name in handle.keys():
                self.where[_normalise(name)] = (handle, name)

    def get(self, name: str) -> Tensor:
        handle, original = self.where[name]
        return handle.get_tensor(original)


def _read_state_dict(cfg: ModelConfig, shards: _Shards, targets: dict[str, Tensor], device) -> dict[str, Tensor]:
    """Our state dict from the checkpoint; `targets` gives every key's shape and dtype (from a meta model)."""
    used: set[str] = set()

    def take(name: str) -> Tensor:
        if name not in shards.where:
            raise ValueError(f"checkpoint: tensor `{name}` is missing")
        used.add(name)
        return shards.get(name)

    def experts(prefix: str, kind: str) -> Tensor:
        fused = f"{prefix}.experts.{'gate_up_proj' if kind == 'w13' else 'down_proj'}"
        if fused in shards.where:
            return take(fused)
        E = cfg.moe.num_experts
        if kind == "w2":
            return torch.stack([take(f"{prefix}.experts.{e}.down_proj.weight") for e in range(E)])
        return torch.stack([torch.cat([take(f"{prefix}.experts.{e}.gate_proj.weight"),
                                       take(f"{prefix}.experts.{e}.up_proj.weight")]) for e in range(E)])

    out = {}
    for key, target in targets.items():
        moe_key = _MOE_KEY.match(key)
        if moe_key is None:
            t = take(key if key == "lm_head.weight" else "model." + key)
        else:
            prefix, what = f"model.layers.{moe_key[1]}.mlp", moe_key[2]
            if what == "router.tokens_seen":
                t = torch.zeros(target.shape, dtype=target.dtype)
            elif what.startswith("router."):
                t = take(prefix + (".gate.weight" if what == "router.weight" else ".gate.e_score_correction_bias"))
            else:
                t = experts(prefix, what.split(".")[1])
        if tuple(t.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint: `{key}` has shape {tuple(t.shape)}, the config needs {tuple(target.shape)}")
        out[key] = t.to(device=device, dtype=target.dtype)  # routers and the expert bias stay fp32
    leftover = []
    for name in set(shards.where) - used:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer[1]) >= cfg.num_layers:  # multi-token-prediction layers sit past the last one
            continue
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_embeddings):
            continue
        leftover.append(name)
    if leftover:
        raise ValueError(f"checkpoint: {len(leftover)} tensors this model has no place for, e.g. {sorted(leftover)[:5]}")
    return out


def load_hf_checkpoint(path: str | os.PathLike, *, device="cpu", dtype: torch.dtype | None = None,
                       **overrides) -> MoETransformer:
    """A transformers Mixtral / Qwen3-MoE / DeepSeek-V3 checkpoint directory as an MoETransformer.

    dtype: None -> the checkpoint's config `dtype` (or `torch_dtype`), else float32; routers stay fp32.
    overrides: config fields that do not change tensor shapes (e.g. backend="reference", aux_loss_coeff=0.0,
    max_seq_len=8192)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf, **overrides)
    if dtype is None:
        name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        dtype = getattr(torch, name) if isinstance(getattr(torch, name, None), torch.dtype) else torch.float32
    model = build_model(cfg, device="meta", dtype=dtype)
    with ExitStack() as stack:
        state = _read_state_dict(cfg, _Shards(path, stack), model.state_dict(), device)
        model.load_state_dict(state, strict=True, assign=True)
    return model


# ---------------------------------------------------------------------------------------------------
# Saving


def _hf_tensors(model: MoETransformer) -> Iterator[tuple[str, Tensor]]:
    """(name save_pretrained writes, tensor) pairs; experts split into per-expert matrices."""
    cfg = model.config
    for key, t in model.state_dict().items():
        moe_key = _MOE_KEY.match(key)
        if moe_key is None:
            yield (key if key == "lm_head.weight" else "model." + key), t
            continue
        prefix, what = f"model.layers.{moe_key[1]}.mlp", moe_key[2]
        if what == "router.weight":
            yield _hf_name(cfg.family, prefix + ".gate.weight"), t
        elif what == "router.expert_bias":
            yield prefix + ".gate.e_score_correction_bias", t
        elif what == "experts.w13":
            F = cfg.moe.ffn_size
            for e in range(t.shape[0]):
                yield _hf_name(cfg.family, f"{prefix}.experts.{e}.gate_proj.weight"), t[e, :F]
                yield _hf_name(cfg.family, f"{prefix}.experts.{e}.up_proj.weight"), t[e, F:]
        elif what == "experts.w2":
            for e in range(t.shape[0]):
                yield _hf_name(cfg.family, f"{prefix}.experts.{e}.down_proj.weight"), t[e]
    if cfg.family == "deepseek_v3" and not cfg.moe.router.expert_bias:
        for i in range(cfg.first_k_dense, cfg.num_layers):  # transformers' router always has the (zero) bias
            yield f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(cfg.moe.num_experts)


def save_hf_checkpoint(model: MoETransformer, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors (one model.safetensors, or shards of at most `max_shard_bytes` plus
    model.safetensors.index.json) that transformers' AutoModelForCausalLM.from_pretrained loads. Tensors keep
    their dtype (routers fp32)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = config_to_hf(model.config, model.embed_tokens.weight.dtype)
    # Plan the shards from sizes alone, then copy one shard at a time (bounded host memory).
    plan: list[list[str]] = [[]]
    size = total = 0
    for name, t in _hf_tensors(model):
        nbytes = t.numel() * t.element_size()
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += nbytes
        total += nbytes
    n = len(plan)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tensors = _hf_tensors(model)  # the same order as the plan
    for file, names in zip(files, plan):
        # CPU copies: safetensors refuses tensors that share storage (the per-expert slices do).
        shard = {name: next(tensors)[1].detach().to("cpu", copy=True).contiguous() for name in names}
        save_file(shard, str(path / file), metadata={"format": "pt"})
    if n > 1:
        weight_map = {name: file for file, names in zip(files, plan) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
