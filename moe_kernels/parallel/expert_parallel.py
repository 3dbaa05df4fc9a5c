"""Expert parallelism: each rank of a group keeps E / P of every MoE layer's routed experts.

`apply_expert_parallel(model, group)` walks the model, slices each MoELayer's GroupedExperts down to the
experts this rank owns (rank r: [r*E/P, (r+1)*E/P)) and gives the layer a token dispatcher over the
group. The router, shared experts and everything else stay replicated: each rank routes its own tokens,
the dispatcher moves them to the experts' owners and back. Build the model identically on every rank
(same seed or the same checkpoint) before applying it.

transformers models take the same path once their experts run moe_kernels' experts implementation
(`patch_hf(model)`, or `from_pretrained(..., experts_implementation="moe_kernels")`): each experts module
keeps its rank's slice of `gate_up_proj` / `down_proj` and a dispatcher, and the experts forward
dispatches the rows, runs the local grouped GEMMs and combines, while transformers' router, block and
shared experts run as they are. (transformers' own expert-parallel interface shards through DTensor
hooks and its own all-to-all; ours keeps plain local tensors and our dispatchers, so the same backends,
tests and checkpoints serve both kinds of model.)

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


def _hf_experts(model: nn.Module) -> list[nn.Module]:
    """transformers experts modules running moe_kernels' experts implementation."""
    from moe_kernels.integrations.hf import EXPERTS_IMPLEMENTATION

    return [m for m in model.modules()
            if getattr(getattr(m, "config", None), "_experts_implementation", None) == EXPERTS_IMPLEMENTATION
            and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(m, "down_proj", None), torch.Tensor) and hasattr(m, "num_experts")]


def _shard_hf_experts(experts: nn.Module, backend: str, group, options: dict) -> None:
    from moe_kernels.integrations.hf import DISPATCHER_ATTR

    if DISPATCHER_ATTR in experts.__dict__ or getattr(experts, "_is_expert_parallel", False):
        raise ValueError("apply_expert_parallel: the model is already expert-parallel")
    E = experts.num_experts
    if experts.gate_up_proj.shape[0] != E or experts.down_proj.shape[0] != E:
        raise ValueError("apply_expert_parallel: the layer's experts are not the full set")
    dispatcher = make_dispatcher(backend, E, group, **options)
    lo, El = dispatcher.first_expert, dispatcher.num_local_experts
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name)
        setattr(experts, name, nn.Parameter(w.detach()[lo : lo + El].clone(), requires_grad=w.requires_grad))
    experts.__dict__[DISPATCHER_ATTR] = dispatcher


def apply_expert_parallel(model: nn.Module, group=None, *, backend: str = "all_to_all",
                          max_tokens_per_rank: int | None = None, capacity: int | None = None,
                          num_sms: int | None = None) -> nn.Module:
    """Shard the routed experts of every MoELayer in `model` over `group` (default: the world), in place;
    also those of a transformers model whose experts run on moe_kernels (module docstring).

    backend: "all_to_all" (each (token, expert) pair sent once; the default), "all_gather" (every rank
    sees every token; for small groups and large k) or "nvlink" (our kernels over peer buffers within one
    node: each token sent once per rank, no host sync; needs max_tokens_per_rank, the most tokens one
    rank passes to a layer per call, and takes capacity and num_sms: moe_kernels.dispatch.nvlink).
    Returns the model.
    """
    options = {"max_tokens_per_rank": max_tokens_per_rank, "capacity": capacity, "num_sms": num_sms}
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    hf_experts = _hf_experts(model)
    if hf_experts and not layers:
        for experts in hf_experts:
            _shard_hf_experts(experts, backend, group, options)
        return model
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no MoELayer (nor transformers experts on moe_kernels: "
                         "patch_hf(model) or experts_implementation='moe_kernels' first)")
    for layer in layers:
        if layer.dispatcher is not None:
            raise ValueError("apply_expert_parallel: the model is already expert-parallel")
        if layer.config.backend == "torch":
            raise ValueError("apply_expert_parallel: the torch-native backend has no expert-parallel path")
        if layer.experts.num_experts != layer.config.num_experts:
            raise ValueError("apply_expert_parallel: the layer's experts are not the full set")
    for layer in layers:
        dispatcher = make_dispatcher(backend, layer.config.num_experts, group, **options)
        layer.experts = _local_experts(layer.experts, dispatcher.first_expert, dispatcher.num_local_experts)
        layer.dispatcher = dispatcher
    return model


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters sharded by apply_expert_parallel (not to be all-reduced over the expert group)."""
    from moe_kernels.integrations.hf import DISPATCHER_ATTR

    for m in model.modules():
        if isinstance(m, MoELayer) and m.dispatcher is not None:
            yield from m.experts.parameters()
        elif DISPATCHER_ATTR in m.__dict__:
            yield m.gate_up_proj
            yield m.down_proj
