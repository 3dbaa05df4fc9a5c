"""Registered ops, one module per family."""

from moe_kernels.ops.permute import permute, tokens_per_expert, unpermute

__all__ = ["permute", "unpermute", "tokens_per_expert"]
