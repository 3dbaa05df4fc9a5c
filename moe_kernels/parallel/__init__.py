"""Parallelism applied to a finished model from outside (ARCHITECTURE.md, decision 7)."""

from moe_kernels.parallel.expert_parallel import apply_expert_parallel, expert_parameters

__all__ = ["apply_expert_parallel", "expert_parameters"]
