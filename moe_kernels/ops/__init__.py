"""Registered ops, one module per family."""

from moe_kernels.ops.activation import squared_relu, swiglu
from moe_kernels.ops.grouped_mm import grouped_mm
from moe_kernels.ops.grouped_mm_fp8 import (
    grouped_mm_fp8,
    grouped_mm_fp8_wgrad,
    quantize_fp8_experts,
    quantize_fp8_experts_dual,
    quantize_fp8_tokens,
)
from moe_kernels.ops.permute import permute, permute_quantize_fp8, tokens_per_expert, unpermute
from moe_kernels.ops.quant import dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
from moe_kernels.ops.router import router_aux_scores, router_topk
from moe_kernels.ops.router_fused import router_fused
from moe_kernels.ops.router_losses import apply_capacity, aux_loss, capacity, seq_aux_loss, update_expert_bias, z_loss

__all__ = [
    "permute",
    "permute_quantize_fp8",
    "unpermute",
    "tokens_per_expert",
    "router_topk",
    "router_aux_scores",
    "router_fused",
    "aux_loss",
    "seq_aux_loss",
    "z_loss",
    "apply_capacity",
    "update_expert_bias",
    "capacity",
    "grouped_mm",
    "grouped_mm_fp8",
    "grouped_mm_fp8_wgrad",
    "quantize_fp8_experts",
    "quantize_fp8_experts_dual",
    "quantize_fp8_tokens",
    "squared_relu",
    "swiglu",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_nvfp4",
    "dequantize_nvfp4",
]
