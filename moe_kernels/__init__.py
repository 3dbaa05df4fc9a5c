"""moe_kernels: CUDA kernels and a thin training layer for Mixture-of-Experts models in PyTorch."""

from moe_kernels._ext import checks_enabled, has_cuda_kernels, set_checks
from moe_kernels.integrations import patch_hf, unpatch_hf
from moe_kernels.ops import (
    apply_capacity,
    aux_loss,
    dequantize_fp8,
    dequantize_nvfp4,
    grouped_mm,
    grouped_mm_fp8,
    grouped_mm_fp8_wgrad,
    permute,
    permute_quantize_fp8,
    quantize_fp8,
    quantize_fp8_experts,
    quantize_fp8_tokens,
    quantize_nvfp4,
    router_aux_scores,
    router_fused,
    router_topk,
    seq_aux_loss,
    tokens_per_expert,
    unpermute,
    update_expert_bias,
    z_loss,
)

__version__ = "0.1.0"

__all__ = [
    "permute",
    "permute_quantize_fp8",
    "unpermute",
    "tokens_per_expert",
    "router_fused",
    "router_topk",
    "router_aux_scores",
    "aux_loss",
    "seq_aux_loss",
    "z_loss",
    "apply_capacity",
    "update_expert_bias",
    "grouped_mm",
    "grouped_mm_fp8",
    "grouped_mm_fp8_wgrad",
    "quantize_fp8_experts",
    "quantize_fp8_tokens",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "set_checks",
    "checks_enabled",
    "has_cuda_kernels",
    "patch_hf",
    "unpatch_hf",
]
