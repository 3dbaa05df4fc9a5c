"""Expert parallelism: each rank of a group keeps E / P of every MoE layer's routed experts.

`apply_expert_parallel(model, group)` walks the model, slices each MoELayer's GroupedExperts down to the
experts this rank owns (rank r: [r*E/P, (r+1)*E/P)) and gives the layer a token dispatcher over the
group. The router, shared experts and everything else stay replicated: each rank routes its own tokens,
the dispatcher moves them to the experts' owners and back. Build the model identically on every rank
(same seed or the same checkpoint) before applying it.

Gradients: expert weights now differ per rank and already hold the gradient contributions of every
rank's tokens routed to them; the replicated parameters hold only the local tokens' contributions and
need the usual data-parallel all-reduce over the group (`expert_parameters` tells them apart). The
router's expert-bias counts are local too: sum `tokens_seen` over the group before updating the bias.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moe_kernels.dispatch import make_dispatcher
from moe_kernels.nn import GroupedExperts, MoELayer


def _local_experts(experts: GroupedExperts, first: int, count: int) -> GroupedExperts:
    local = GroupedExperts(count, experts.hidden_size, experts.ffn_size, device="meta", dtype=experts.w13.dtype)
    with torch.no_grad():
        local.w13 = nn.Parameter(experts.w13[first : first + count].clone(), requires_grad=experts.w13.requires_grad)
        local.w2 = nn.Parameter(experts.w2[first : first + count].clone(), requires_grad=experts.w2.requires_grad)
    return local


def apply_expert_parallel(model: nn.Module, group=None, *, backend: str = "all_to_all") -> nn.Module:
    """Shard the routed experts of every MoELayer in `model` over `group` (default: the world), in place.

    backend: "all_to_all" (each (token, expert) pair sent once; the default) or "all_gather" (every rank
    sees every token; for small groups and large k). Returns the model.
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no MoELayer")
    for layer in layers:
        if layer.dispatcher is not None:
            raise ValueError("apply_expert_parallel: the model is already expert-parallel")
        if layer.config.backend == "torch":
            raise ValueError("apply_expert_parallel: the torch-native backend has no expert-parallel path")
        if layer.experts.num_experts != layer.config.num_experts:
            raise ValueError("apply_expert_parallel: the layer's experts are not the full set")
    for layer in layers:
        dispatcher = make_dispatcher(backend, layer.config.num_experts, group)
        layer.experts = _local_experts(layer.experts, dispatcher.first_expert, dispatcher.num_local_experts)
        layer.dispatcher = dispatcher
    return model


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters sharded by apply_expert_parallel (not to be all-reduced over the expert group)."""
    for m in model.modules():
        if isinstance(m, MoELayer) and m.dispatcher is not None:
            yield from m.experts.parameters()
