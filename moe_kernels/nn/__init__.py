"""Modules built from the ops. No process groups inside."""

from moe_kernels.nn.experts import GroupedExperts
from moe_kernels.nn.linear_cross_entropy import linear_cross_entropy
from moe_kernels.nn.moe import PRESETS, MoEConfig, MoELayer, SharedExperts
from moe_kernels.nn.router import Router, RouterConfig, RouterOutput

__all__ = ["GroupedExperts", "MoEConfig", "MoELayer", "PRESETS", "Router", "RouterConfig", "RouterOutput", "SharedExperts",
           "linear_cross_entropy"]
