"""moe_kernels: CUDA kernels and a thin training layer for Mixture-of-Experts models in PyTorch."""

from moe_kernels._ext import checks_enabled, has_cuda_kernels, set_checks
from moe_kernels.ops import permute, tokens_per_expert, unpermute

__version__ = "0.1.0"

__all__ = [
    "permute",
    "unpermute",
    "tokens_per_expert",
    "set_checks",
    "checks_enabled",
    "has_cuda_kernels",
]
