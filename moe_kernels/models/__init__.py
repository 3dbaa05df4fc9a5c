"""Full decoder-only MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3) from small frozen configs, and Hugging Face
checkpoint load/save. No parallelism inside: moe_kernels.parallel applies it from outside.

    cfg = PRESETS["tiny-qwen3-moe"](vocab_size=256)
    model = build_model(cfg)                      # device=None, dtype=None; device="meta" for accounting
    logits, aux_loss = model(input_ids)           # [B, S] int64 -> [B, S, V], fp32 scalar
    flops_per_token(cfg, seq_len)                 # training FLOPs per token (active experts only)
"""

from moe_kernels.models.config import FAMILIES, MLAConfig, ModelConfig, YarnConfig
from moe_kernels.models.flops import active_matmul_params, flops_per_token
from moe_kernels.models.hf import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from moe_kernels.models.presets import PRESETS
from moe_kernels.models.transformer import MoETransformer, build_model

__all__ = [
    "FAMILIES",
    "MLAConfig",
    "ModelConfig",
    "MoETransformer",
    "PRESETS",
    "YarnConfig",
    "active_matmul_params",
    "build_model",
    "config_from_hf",
    "config_to_hf",
    "flops_per_token",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]
