"""Expert parallelism: each rank of a group keeps E / P of every MoE layer's routed experts.

`apply_expert_parallel(model, group)` walks the model, slices each MoELayer's GroupedExperts down to the
experts this rank owns (rank r: [r*E/P, (r+1)*E/P)) and gives the layer a token dispatcher over the
group. The router, shared experts and everything else stay replicated: each rank routes its own tokens,
the dispatcher moves them to the experts' owners and back. Build the model identically on every rank
(same seed or the same checkpoint) before applying it.

transformers models take the same path once their experts run moe_kernels' experts implementation
(`patch_hf(model)`, or `from_pretrained(..., experts_implementation="moe_kernels")`): each experts module
keeps its rank's slice of `gate_up_proj` / `down_proj` (DBRX's: of its GLU's w1, v1 and w2, E * F rows each) and
a dispatcher, and the experts forward
dispatches the rows, runs the local grouped GEMMs and combines, while transformers' router, block and
shared experts run as they are.

peft LoRA adapters on the experts (either kind of model; created before this call) stay whole on every rank,
replicated parameters like the router: each rank applies its experts' slices of them (the experts module
records the range it holds, EXPERT_RANGE_ATTR; moe_kernels.integrations.peft slices), a rank's backward leaves
the other experts' slices zero, and the data-parallel mean of their gradients is exact. (transformers' own
expert-parallel interface shards through DTensor hooks and its own all-to-all; ours keeps plain local tensors and
our dispatchers, so the same backends, tests and checkpoints serve both kinds of model.)

Gradients: expert weights now differ per rank and already hold the gradient contributions of every
rank's tokens routed to them; the replicated parameters hold only the local tokens' contributions and
need the usual data-parallel all-reduce over the group (`expert_parameters` tells them apart). The
router's expert-bias counts are local too: sum `tokens_seen` over the group before updating the bias. Two kinds
of replicated parameter are read on the experts' side of the dispatch, so a rank's gradient of them holds its
experts' rows (every rank's tokens routed there) rather than its own tokens: LoRA adapters on the experts (zeros
outside the rank's slices) and a norm applied to each expert's output (transformers' post_expert_norm, Muse
Spark's). Summed (or averaged) over the group, as the data-parallel reduction does, they equal the one-rank
model's, as every replicated parameter's does.

Expert tensor parallelism (`etp_group`, n ranks): each of the rank's experts keeps 1/n of its ffn width, the
rows [t*F/n, (t+1)*F/n) of the gate and, separately, of the up projection (contiguous halves of w13 would
break SwiGLU; experts without a gate: those rows of w13, the up projection), and the same columns of w2. The n
ranks of an etp group gather their tokens (tokens, routing
weights and expert choices: every rank of the group then dispatches the same pairs over its ep group and its
experts see the same rows), each computes its slice's part of every expert output, combines it over the ep
group (in the experts' output dtype), and the group reduce-scatters the parts in fp32, each rank keeping the
sums for its own tokens. The all-gather's backward is a reduce-scatter and the reduce-scatter's an
all-gather, so a slice's gradient holds every token of the group's ranks, as the ep dispatch gives the
experts theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.dispatch import LocalDispatcher, NvlinkDispatcher, collectives, make_dispatcher
from moe_kernels.dispatch.all_gather import gather_tokens
from moe_kernels.dispatch.base import Dispatched, Dispatcher
from moe_kernels.nn import GroupedExperts, MoELayer
from moe_kernels.nn.lora import EXPERT_RANGE_ATTR, FFN_SLICE_ATTR, ffn_slice, unwrapped, wrapped_module


def _local_experts(experts: GroupedExperts, first: int, count: int, part: int = 0, parts: int = 1) -> GroupedExperts:
    """Experts [first, first + count), each with the part-th of `parts` slices of its ffn width."""
    F = experts.ffn_size
    f, lo = F // parts, part * (F // parts)
    local = GroupedExperts(count, experts.hidden_size, f, activation=experts.activation, device="meta",
                           dtype=experts.w13.dtype)
    held = (lo, f, F)
    w13 = ffn_slice(experts.w13.detach()[first : first + count], "w13", held, experts.gated, 1)
    w2 = ffn_slice(experts.w2.detach()[first : first + count], "w2", held, experts.gated, 2)
    # Own contiguous copies (a narrow of the full tensor would keep it alive; torch.cat already copied).
    w13, w2 = (t.clone(memory_format=torch.contiguous_format) if t._base is not None else t for t in (w13, w2))
    local.w13 = nn.Parameter(w13, requires_grad=experts.w13.requires_grad)
    local.w2 = nn.Parameter(w2, requires_grad=experts.w2.requires_grad)
    return local


@dataclass(eq=False)
class _EtpHandle:
    inner: Any  # the ep dispatcher's handle
    num_tokens: int  # this rank's T


class ExpertTensorParallelDispatcher(Dispatcher):
    """A token dispatcher over an ep group, run by the n ranks of an etp group on their gathered tokens
    (module docstring). dispatch takes this rank's tokens; combine returns this rank's outputs, the sums of
    the n slices' parts. The group's ranks may hold different numbers of tokens (one exchange of T and a host
    sync; none over an nvlink dispatcher, where each rank pads to its max_tokens_per_rank)."""

    def __init__(self, inner: Dispatcher, group):
        self.inner, self.group = inner, group
        self.etp = dist.get_world_size(group)
        # An nvlink dispatcher is sized for the etp group's gathered tokens (apply_expert_parallel multiplies
        # max_tokens_per_rank by etp): each rank pads to its share, so the gather exchanges no T (no host sync).
        self.pad_to = inner.max_tokens_per_rank // self.etp if isinstance(inner, NvlinkDispatcher) else None
        super().__init__(inner.num_experts, inner.num_ranks, inner.rank)

    def dispatch(self, x, weights, indices, *, align=1, scales=None) -> Dispatched:
        indices = self._check(x, weights, indices, align, scales)
        x_all, w_all, i_all, s_all = gather_tokens(x, weights, indices, scales, self.group, pad_to=self.pad_to)
        d = self.inner.dispatch(x_all, w_all, i_all, align=align, scales=s_all)
        d.handle = _EtpHandle(d.handle, x.shape[0])
        return d

    def combine(self, y: Tensor, handle: _EtpHandle, *, weighted: bool = True) -> Tensor:
        part = self.inner.combine(y, handle.inner, weighted=weighted)  # [n * Tmax, H]: this slice's part, y's dtype
        out = collectives.reduce_scatter(part.float(), self.group)  # the parts summed in rank order, in fp32
        return out[: handle.num_tokens].to(y.dtype)

    def __repr__(self) -> str:
        return f"ExpertTensorParallelDispatcher({self.inner!r}, etp={self.etp})"


def _hf_experts(model: nn.Module) -> list[nn.Module]:
    """transformers experts modules running moe_kernels' experts forward (the "moe_kernels" experts implementation,
    or experts whose forward patch_hf replaced: Llama 4's, DBRX's; JetMoE's patched blocks, which hold their
    experts' projections)."""
    from moe_kernels.integrations.hf.patching import runs_our_experts

    return [m for m in model.modules()
            if runs_our_experts(m) and _hf_expert_count(m) is not None and _hf_expert_tensors(m)]


def _hf_expert_count(experts: nn.Module) -> int | None:
    """E: the experts module's num_experts, or a JetMoE block's (its projections')."""
    from moe_kernels.integrations.hf.jetmoe import expert_count

    E = getattr(experts, "num_experts", None)
    E = expert_count(experts) if E is None else E
    return E if isinstance(E, int) else None


# [E, ...] each (up_proj: experts without a gate, Nemotron-H's)
_HF_EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_DBRX_EXPERT_TENSORS = ("w1", "v1", "w2")  # [E * F, H] each, on the experts' GLU module (`mlp`)


def _hf_expert_tensors(experts: nn.Module) -> list[tuple[nn.Module, str, int]]:
    """(module, name, rows per expert) of the experts' per-expert parameters, each expert a block of rows: the
    weights (and GPT-OSS's biases) on the experts module, [E, ...]; DBRX's on its GLU module, [E * F, H]; JetMoE's on
    the block's projections, [E, N, K]. Empty for any other module."""
    from moe_kernels.integrations.hf.jetmoe import expert_tensors

    if tensors := expert_tensors(experts):  # JetMoE's
        return tensors
    names = [n for n in _HF_EXPERT_TENSORS if isinstance(getattr(experts, n, None), torch.Tensor)]
    if any(n in names for n in ("gate_up_proj", "up_proj")) and "down_proj" in names:
        return [(experts, n, 1) for n in names]
    mlp, F = experts._modules.get("mlp"), getattr(experts, "ffn_hidden_size", None)
    if (mlp is not None and isinstance(F, int)
            and all(isinstance(getattr(mlp, n, None), torch.Tensor) for n in _DBRX_EXPERT_TENSORS)):
        return [(mlp, n, F) for n in _DBRX_EXPERT_TENSORS]
    return []


def _shard_hf_experts(experts: nn.Module, backend: str, group, options: dict) -> None:
    from moe_kernels.integrations.hf import DISPATCHER_ATTR
    from moe_kernels.integrations.hf.jetmoe import dispatched_rows_per_token, expert_tensors

    if DISPATCHER_ATTR in experts.__dict__ or getattr(experts, "_is_expert_parallel", False):
        raise ValueError("apply_expert_parallel: the model is already expert-parallel")
    E = _hf_expert_count(experts)
    tensors = _hf_expert_tensors(experts)
    if any(getattr(module, name).shape[0] != E * per for module, name, per in tensors):
        raise ValueError("apply_expert_parallel: the layer's experts are not the full set")
    rows = dispatched_rows_per_token(experts)  # (JetMoE's MoA dispatches each of a token's k slots as a token)
    if rows > 1 and options.get("max_tokens_per_rank") is not None:
        options = {**options, "max_tokens_per_rank": options["max_tokens_per_rank"] * rows}
    dispatcher = make_dispatcher(backend, E, group, **options)
    lo, El = dispatcher.first_expert, dispatcher.num_local_experts
    for module, name, per in tensors:
        w = getattr(module, name)
        setattr(module, name, nn.Parameter(w.detach()[lo * per : (lo + El) * per].clone(),
                                           requires_grad=w.requires_grad))
    experts.__dict__[DISPATCHER_ATTR] = dispatcher
    experts.__dict__[EXPERT_RANGE_ATTR] = (lo, El, E)
    for module, _, _ in expert_tensors(experts):  # JetMoE's projections: peft's wrappers around them apply this
        # rank's slices of their factors
        module.__dict__[EXPERT_RANGE_ATTR] = (lo, El, E)


def apply_expert_parallel(model: nn.Module, group=None, *, etp_group=None, backend: str = "all_to_all",
                          max_tokens_per_rank: int | None = None, capacity: int | None = None,
                          num_sms: int | None = None) -> nn.Module:
    """Shard the routed experts of every MoELayer in `model` over `group` (default: the world), in place;
    also those of a transformers model whose experts run on moe_kernels (module docstring).

    etp_group: expert tensor parallelism over its ranks (each expert's ffn width split; module docstring);
    `group` is then the expert-parallel group (a group of one rank: every expert on every rank).
    backend: "all_to_all" (each (token, expert) pair sent once; the default), "all_gather" (every rank
    sees every token; for small groups and large k) or "nvlink" (our kernels over peer buffers within one
    node: each token sent once per rank, no host sync; needs max_tokens_per_rank, the most tokens one
    rank passes to a layer per call, and takes capacity and num_sms: moe_kernels.dispatch.nvlink).
    Returns the model.
    """
    etp = 1 if etp_group is None else dist.get_world_size(etp_group)
    if etp > 1 and group is None:
        raise ValueError("apply_expert_parallel: with etp_group, pass the expert-parallel group as `group` too "
                         "(the world would hold the etp ranks twice)")
    if etp > 1:
        shared = set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(etp_group))
        if shared != {dist.get_rank()}:
            raise ValueError(f"apply_expert_parallel: `group` and `etp_group` must share this rank only (an etp "
                             f"group's ranks each in another ep group); they share ranks {sorted(shared)}")
    if etp > 1 and max_tokens_per_rank is not None:
        max_tokens_per_rank *= etp  # the ep dispatch carries the etp group's gathered tokens
    options = {"max_tokens_per_rank": max_tokens_per_rank, "capacity": capacity, "num_sms": num_sms}
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    hf_experts = _hf_experts(model)
    if hf_experts and not layers and etp > 1:
        raise NotImplementedError("apply_expert_parallel: expert tensor parallelism (etp_group) is for "
                                  "moe_kernels models; transformers experts take expert parallelism only")
    if hf_experts and not layers:
        from moe_kernels.integrations.peft import fuse_lora

        for experts in hf_experts:
            _shard_hf_experts(experts, backend, group, options)
        fuse_lora(model)  # peft's adapters on the experts: this rank's slices (peft's own wrapper would take them all)
        return model
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no MoELayer (nor transformers experts on moe_kernels: "
                         "patch_hf(model) or experts_implementation='moe_kernels' first)")
    for layer in layers:
        if layer.dispatcher is not None:
            raise ValueError("apply_expert_parallel: the model is already expert-parallel")
        if layer.config.backend == "torch":
            raise ValueError("apply_expert_parallel: the torch-native backend has no expert-parallel path")
        if unwrapped(layer.experts).num_experts != layer.config.num_experts:
            raise ValueError("apply_expert_parallel: the layer's experts are not the full set")
        if etp > 1 and layer.config.ffn_size % etp:
            raise ValueError(f"apply_expert_parallel: the {etp} ranks of etp_group must divide the expert ffn size "
                             f"{layer.config.ffn_size}")
    etp_rank = 0 if etp == 1 else dist.get_rank(etp_group)
    one_rank = group is not None and dist.get_world_size(group) == 1
    for layer in layers:
        E = layer.config.num_experts
        dispatcher = LocalDispatcher(E) if one_rank and etp > 1 else make_dispatcher(backend, E, group, **options)
        first, count = dispatcher.first_expert, dispatcher.num_local_experts
        local = _local_experts(unwrapped(layer.experts), first, count, etp_rank, etp)
        local.__dict__[EXPERT_RANGE_ATTR] = (first, count, E)
        if etp > 1:  # an adapter wrapper applies this slice of its factors too
            F = layer.config.ffn_size
            local.__dict__[FFN_SLICE_ATTR] = (etp_rank * (F // etp), F // etp, F)
        _replace_unwrapped(layer, "experts", local)
        layer.dispatcher = dispatcher if etp == 1 else ExpertTensorParallelDispatcher(dispatcher, etp_group)
    if any(unwrapped(layer.experts) is not layer.experts for layer in layers):
        from moe_kernels.integrations.peft import fuse_lora

        fuse_lora(model)  # peft's adapters on the experts: this rank's slices (peft's own wrapper would take them all)
    return model


def _replace_unwrapped(parent: nn.Module, name: str, new: nn.Module) -> None:
    """parent.<name> = new, or, where adapter wrappers hold the module (base_layer), the innermost one's base_layer."""
    module = getattr(parent, name)
    while (base := wrapped_module(module)) is not None:
        parent, name, module = module, "base_layer", base
    setattr(parent, name, new)


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters sharded by apply_expert_parallel (not to be all-reduced over the expert group)."""
    from moe_kernels.integrations.hf import DISPATCHER_ATTR

    for m in model.modules():
        if isinstance(m, MoELayer) and m.dispatcher is not None:
            yield from unwrapped(m.experts).parameters()  # (an adapter wrapper's factors stay replicated)
        elif DISPATCHER_ATTR in m.__dict__:
            for module, name, _ in _hf_expert_tensors(m):
                yield getattr(module, name)
