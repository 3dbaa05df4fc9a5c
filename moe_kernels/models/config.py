"""Model configuration: one frozen, keyword-only dataclass per component, validated on construction.

`ModelConfig` holds the transformer; its MoE layers are a nested `moe_kernels.nn.MoEConfig` (router included),
DeepSeek-V3's multi-head latent attention a nested `MLAConfig`, YaRN context extension a nested `YarnConfig`.
`ModelConfig.replace(**changes)` takes the field names of all four (hidden_size goes to the model and its
router), so presets and loaders accept flat overrides such as `vocab_size=256, num_experts=8, backend="reference"`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_kernels.nn import MoEConfig, RouterConfig

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank bottleneck (or one projection
    when q_lora_rank is None), keys and values from one shared latent of width kv_lora_rank plus one shared
    rotary key of width qk_rope_head_dim."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self):
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError("MLAConfig: q_lora_rank must be >= 1 or None")
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError("MLAConfig: kv_lora_rank and the head dims must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class YarnConfig:
    """YaRN rotary scaling (https://arxiv.org/abs/2309.00071), with the parameters and defaults of transformers'
    `_compute_yarn_parameters`. factor None: max_seq_len / original_max_seq_len. attention_factor None: derived
    from factor, mscale and mscale_all_dim (it scales cos and sin). DeepSeek-V3 also multiplies its softmax scale
    by yarn_mscale(factor, mscale_all_dim)^2."""

    factor: float | None
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.factor is not None and self.factor <= 0:
            raise ValueError("YarnConfig: factor must be > 0")
        if self.original_max_seq_len < 1:
            raise ValueError("YarnConfig: original_max_seq_len must be >= 1")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only MoE transformer.

    family: "mixtral" (grouped-query attention), "qwen3_moe" (grouped-query attention with per-head RMSNorm on
    q and k) or "deepseek_v3" (multi-head latent attention, `mla` required). The first `first_k_dense` layers
    have a dense SwiGLU MLP of width `dense_ffn_size`, the rest are `moe` layers.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention; MLA has one key/value head per query head
    head_dim: int | None = None  # None: hidden_size // num_heads (grouped-query attention only)
    moe: MoEConfig
    first_k_dense: int = 0
    dense_ffn_size: int = 0
    mla: MLAConfig | None = None
    max_seq_len: int
    rope_theta: float = 10000.0
    rope_scaling: YarnConfig | None = None
    rope_interleave: bool = False  # rotary dims paired (0,1),(2,3).. (DeepSeek's layout) instead of (i, i+D/2)
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02  # normal init of every matrix; output projections get init_std / sqrt(2 * num_layers)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig: family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(
                f"ModelConfig: moe.router.hidden_size={self.moe.hidden_size} != hidden_size={self.hidden_size}"
            )
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"ModelConfig: first_k_dense must be in [0, num_layers={self.num_layers}]")
        if self.first_k_dense and self.dense_ffn_size < 1:
            raise ValueError("ModelConfig: dense layers (first_k_dense > 0) need dense_ffn_size >= 1")
        if (self.family == "deepseek_v3") != (self.mla is not None):
            raise ValueError("ModelConfig: family 'deepseek_v3' needs `mla`, and only it takes one")
        if self.mla is None:
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"ModelConfig: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
            if self.head_dim is None and self.hidden_size % self.num_heads:
                raise ValueError("ModelConfig: hidden_size must be a multiple of num_heads when head_dim is None")
        elif self.num_kv_heads != self.num_heads:
            raise ValueError("ModelConfig: multi-head latent attention has num_kv_heads == num_heads")
        if self.rope_dim % 2:
            raise ValueError(f"ModelConfig: the rotary dim must be even, got {self.rope_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("ModelConfig: rope_theta, rms_norm_eps and init_std must be > 0")

    @property
    def attn_head_dim(self) -> int:
        """Width of one grouped-query attention head."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.attn_head_dim

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3_moe"

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    def replace(self, **changes) -> "ModelConfig":
        """A copy with fields changed; names may be fields of ModelConfig, MoEConfig, RouterConfig or MLAConfig."""
        return _replace(self, changes)


_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_MOE_FIELDS = {f.name for f in dataclasses.fields(MoEConfig)} - {"router"}
_ROUTER_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)}
_MLA_FIELDS = {f.name for f in dataclasses.fields(MLAConfig)}


def _replace(cfg: ModelConfig, changes: dict) -> ModelConfig:
    unknown = set(changes) - _MODEL_FIELDS - _MOE_FIELDS - _ROUTER_FIELDS - _MLA_FIELDS
    if unknown:
        raise TypeError(
            f"unknown config field(s) {sorted(unknown)}; accepted: fields of ModelConfig, MoEConfig, RouterConfig "
            "and MLAConfig"
        )
    model, moe, router, mla = ({k: v for k, v in changes.items() if k in names}
                               for names in (_MODEL_FIELDS, _MOE_FIELDS, _ROUTER_FIELDS, _MLA_FIELDS))
    if mla:
        if cfg.mla is None and "mla" not in model:
            raise TypeError(f"{sorted(mla)} apply to multi-head latent attention; this {cfg.family} config has none")
        model["mla"] = dataclasses.replace(model.get("mla", cfg.mla), **mla)
    if moe or router:
        base = model.get("moe", cfg.moe)
        model["moe"] = dataclasses.replace(base, router=dataclasses.replace(base.router, **router), **moe)
    return dataclasses.replace(cfg, **model)
