"""JetMoE (transformers' `jetmoe`): its MoE block (JetMoeMoE) and its attention experts (JetMoeMoA, a mixture of
attention heads: each token's query and output projections by its k experts) on moe_kernels' ops.

transformers routes both with a JetMoeTopKGating (top-k by logit, softmax over the k in fp32, cast to the input's
dtype), sorts the token slots by expert, reads the experts' sizes on the host (`.tolist()`: a host sync in every
block and attention layer, and no `fullgraph` compile), and runs each expert's projection as its own F.linear. The
experts' weights sit on the block: `input_linear` and `output_linear` (JetMoeParallelExperts, [E, N, K], the
grouped GEMM's layout), a bias [H] added after the k routes are summed.

Patched (none of it reads device data on the host):
- the router (`jetmoe_router_forward`): router_topk(score="softmax", pre_softmax=False) on its `layer`'s logits in
  fp32, the weights cast to the input's dtype. It returns (experts [T, k], weights [T, k], None, None, logits): the
  logits at index 4, where transformers' recorder reads them (output_router_logits, the aux loss); transformers'
  slot order, slot tokens and host list of expert sizes are not formed, and only the patched block and MoA call it.
- the projections (`_projection_forward`): called with the group sizes as a tensor (by the patched blocks, also
  through peft's wrappers), the grouped GEMM on the weight as stored (a precision recipe's where one is set; peft's
  LoRA terms from moe_kernels.integrations.peft's fused wrapper as rank-r products, or peft's own W + s B A in the
  weight); called with transformers' host list of sizes, transformers' loop.
- the MoE block (`_block_forward`): where its projections are plain modules (no adapter wrapper, no hook), its
  experts as a transformers experts module whose gate_up_proj [E, 2F, H] (gate rows, then up) is input_linear's
  weight and down_proj [E, H, F] output_linear's (`_Experts`), run by `moe_kernels_experts_forward` (the fused "moe"
  region on a GPU; a precision recipe's GEMMs and, for FP8, its fused producers; the SiLU gate as our swiglu,
  another activation as act_fn(gate) * up); otherwise permute, the projections called as modules (their wrappers
  and hooks run: peft's LoRA, accelerate's offloading), the same gate, unpermute. Then the block's bias.
- the MoA (`_moa_map`, `_moa_reduce`): map permutes the tokens by expert, calls input_linear ([E, D, H]) on the
  rows and gathers each slot's row back to token order ([B, S, k, D]: unpermute with one slot per row); reduce
  permutes the k attention outputs of each token by their experts, calls output_linear ([E, H, D]) and sums them
  with the routing weights (unpermute, fp32, rounded once), then the bias.

Expert-parallel (moe_kernels.parallel.apply_expert_parallel: each projection keeps this rank's E / P experts, peft's
adapters every expert's factors, applying this rank's slices), the MoE block takes the dispatcher's dispatch and
combine as transformers' experts do; the MoA sends each slot as a token of one expert (map: the token's row once per
slot; reduce: each slot's attention output), so the combine returns each slot's row unsummed, and reduce weighs and
sums a token's k rows in fp32 (rounded once, as unpermute does).
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from moe_kernels.nn.lora import (
    EXPERT_RANGE_ATTR,
    check_expert_parallel_weights,
    grouped_mm_lora,
    lora_terms,
    unwrapped,
    wrapped_module,
)
from moe_kernels.ops.grouped_mm import autocast_input, grouped_mm
from moe_kernels.ops.permute import permute, unpermute
from moe_kernels.ops.router import router_topk

from .common import _RECIPE_ATTR, _SHARDED, _TM, _WEIGHT_DTYPES, DISPATCHER_ATTR, _base_class, _is_dtensor
from .experts import _check_lora_experts, _gated, moe_kernels_experts_forward

_MODULE = _TM + "jetmoe.modeling_jetmoe"
_PROJECTIONS = ("input_linear", "output_linear")


def jetmoe_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple:
    """JetMoeTopKGating on router_topk: its `layer`'s logits in fp32, top-k by logit, softmax over the k (fp32),
    the weights cast to the input's dtype. Returns (experts [T, k] int64, weights [T, k], None, None, logits [T, E]
    fp32): the logits where transformers' output recorder reads them (index 4)."""
    logits = self.layer(hidden_states).float()
    weights, indices = router_topk(logits, self.top_k, score="softmax", pre_softmax=False)
    return indices.long(), weights.to(hidden_states.dtype), None, None, logits


def _projection_forward(self: nn.Module, inputs: Tensor, expert_size) -> Tensor:
    """JetMoeParallelExperts given rows grouped by expert [R, K] and the group sizes as a tensor: the grouped GEMM on
    its weight [E, N, K] (or this rank's E / P experts), with peft's LoRA terms as rank-r products (grouped_mm_lora)
    and the block's precision recipe (set on the projection by patch_hf), the rows padded to its alignment by the
    caller. Given transformers' host list of sizes: transformers' loop."""
    if not isinstance(expert_size, Tensor):
        return _base_class(self).forward(self, inputs, expert_size)
    check_expert_parallel_weights(self)  # (peft's own wrapper made after apply_expert_parallel: refused)
    w = autocast_input(self.weight)  # (peft's own path: W + s B A, parametrized)
    terms = lora_terms(self, "weight")
    _check_lora_experts(self, w.shape[0], terms)
    recipe = self.__dict__.get(_RECIPE_ATTR)
    mm = grouped_mm if recipe is None else recipe.grouped_mm
    return grouped_mm_lora(inputs.to(w.dtype).contiguous(), w.contiguous(), expert_size, terms, mm=mm)


def _projection_class():
    return getattr(sys.modules.get(_MODULE), "JetMoeParallelExperts", None)


def _projection(block: nn.Module, name: str):
    """The block's projection `name` inside any adapter wrappers, or None where it is no JetMoeParallelExperts."""
    module = block._modules.get(name)
    cls = _projection_class()
    inner = unwrapped(module) if isinstance(module, nn.Module) else module
    return inner if cls is not None and isinstance(inner, cls) else None


def _direct(block: nn.Module) -> bool:
    """The projections are plain modules (no adapter wrapper, hook or parametrization): the MoE block may read their
    weights without calling them."""
    for name in _PROJECTIONS:
        m = block._modules[name]
        if (wrapped_module(m) is not None or m._forward_hooks or m._forward_pre_hooks or "_hf_hook" in m.__dict__
                or parametrize.is_parametrized(m)):
            return False
    return True


class _Experts:
    """A JetMoE block's experts as a transformers experts module (what moe_kernels_experts_forward reads):
    gate_up_proj [E, 2F, H] = input_linear's weight (gate rows, then up: JetMoE chunks the product in two, the
    activation on the first half), down_proj [E, H, F] = output_linear's, act_fn = the block's activation, and the
    patched block's precision recipe and expert-parallel dispatcher. transformers' default gate (`_apply_gate`) is set
    on the class on first use (`_experts`), so that a SiLU activation runs as our swiglu, as transformers' experts
    do."""

    has_gate = True

    def __init__(self, block: nn.Module):
        self.gate_up_proj = block.input_linear.weight
        self.down_proj = block.output_linear.weight
        self.num_experts = block.input_linear.num_experts
        self.act_fn = block.activation
        self.__dict__[_RECIPE_ATTR] = block.__dict__.get(_RECIPE_ATTR)
        if DISPATCHER_ATTR in block.__dict__:
            self.__dict__[DISPATCHER_ATTR] = block.__dict__[DISPATCHER_ATTR]


def _experts(block: nn.Module) -> _Experts:
    if "_apply_gate" not in _Experts.__dict__:  # (a transformers without it: act_fn(gate) * up, our gate unfused)
        default = getattr(importlib.import_module("transformers.integrations.moe"), "_default_apply_gate", None)
        _Experts._apply_gate = default or _act_gate
    return _Experts(block)


def _act_gate(self: _Experts, h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def _projection_problem(block: nn.Module) -> str | None:
    """Which projection is no transformers' JetMoeParallelExperts (inside any peft adapter wrappers), or None."""
    for name in _PROJECTIONS:
        if _projection(block, name) is None:
            module = block._modules.get(name)
            return (f"its {name} is a {type(module).__name__}, not transformers' JetMoeParallelExperts (inside any "
                    "peft adapter wrappers)")
    return None


def _check_projections(block: nn.Module) -> None:
    """NotImplementedError where a projection was replaced after patch_hf, before any kernel runs."""
    if (problem := _projection_problem(block)) is not None:
        raise NotImplementedError(f"moe_kernels: JetMoE's {_base_class(block).__name__}: {problem}; unpatch_hf(model) "
                                  "runs transformers' code")


def _align(self: nn.Module) -> int:
    recipe = self.__dict__.get(_RECIPE_ATTR)
    return 1 if recipe is None else recipe.align


def _rows(self: nn.Module, x: Tensor, indices: Tensor, weights: Tensor):
    """(rows grouped by this rank's experts, group sizes, finish): permute, or the expert-parallel dispatcher's
    dispatch; finish(y) is unpermute with the routing weights (fp32, rounded once), or the combine."""
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    w = weights.float().contiguous()
    if dispatcher is not None:
        d = dispatcher.dispatch(x, w, indices, align=_align(self))
        return d.x, d.group_sizes, lambda y: dispatcher.combine(y, d.handle)
    rows, row_map, group_sizes = permute(x, indices, self.router.num_experts, align=_align(self))
    return rows, group_sizes, lambda y: unpermute(y, row_map, w)


def _block_forward(self: nn.Module, layer_input: Tensor) -> Tensor:
    """JetMoeMoE: the router, the routed experts (plain projections: `_Experts` through moe_kernels_experts_forward;
    otherwise the projections called as modules around the gate), the block's bias. layer_input [B, S, H]; returns
    [B, S, H] in its dtype."""
    _check_projections(self)
    bsz, length, emb = layer_input.shape
    x = layer_input.reshape(-1, emb)
    indices, weights, _, _, _ = self.router(x)
    if _direct(self):
        out = moe_kernels_experts_forward(_experts(self), x, indices, weights)
    else:
        rows, group_sizes, finish = _rows(self, x.contiguous(), indices.to(torch.int32).contiguous(), weights)
        h = self.input_linear(rows, group_sizes)  # [R, 2F]
        act = _gated(_experts(self), h)  # our swiglu for SiLU, else act_fn(gate) * up
        out = finish(self.output_linear(act.contiguous(), group_sizes)).to(x.dtype)
    return out.view(bsz, length, emb) + self.bias


def _moa_map(self: nn.Module, layer_input: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """JetMoeMoA.map: each token's query projection by each of its k experts. layer_input [B, S, H]; returns the
    queries [B, S, k, D] (slot j of a token: its j-th expert's), the router logits, and the routing (experts [T, k],
    weights [T, k]) that `_moa_reduce` takes, where transformers passes its sorted slots."""
    _check_projections(self)
    bsz, length, emb = layer_input.shape
    x = layer_input.reshape(-1, emb).contiguous()
    indices, weights, _, _, router_logits = self.router(x)
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:  # each slot a token of one expert: the combine returns the slots' rows unsummed
        slot_experts = indices.to(torch.int32).reshape(-1, 1)
        d = dispatcher.dispatch(x.repeat_interleave(self.top_k, 0), torch.ones(slot_experts.shape, device=x.device),
                                slot_experts, align=_align(self))
        slots = dispatcher.combine(self.input_linear(d.x, d.group_sizes), d.handle, weighted=False)  # [T k, D]
    else:
        x_perm, row_map, group_sizes = permute(x, indices.to(torch.int32), self.router.num_experts,
                                               align=_align(self))
        q = self.input_linear(x_perm, group_sizes)  # [R, D]
        slots = unpermute(q, row_map.view(-1, 1))  # [T k, D]: each slot's own row (one term: exact)
    return slots.view(bsz, length, self.top_k, -1).to(layer_input.dtype), router_logits, (indices, weights)


def _moa_reduce(self: nn.Module, layer_input: Tensor, topo_info: tuple[Tensor, Tensor]) -> Tensor:
    """JetMoeMoA.reduce: each slot's attention output [B, S, k, D] projected by its expert, the k summed with the
    routing weights (fp32, rounded once), the bias. Returns [B, S, H]."""
    _check_projections(self)
    if not (isinstance(topo_info, tuple) and len(topo_info) == 2):
        raise ValueError("moe_kernels: the patched JetMoeMoA.reduce takes the routing its patched map returned "
                         f"((experts, weights)), got a {type(topo_info).__name__} of {len(topo_info)} (transformers' "
                         "map's sorted slots?)")
    indices, weights = topo_info
    bsz, length, k, width = layer_input.shape
    a = layer_input.reshape(-1, width).contiguous()  # [T k, D]
    slot_experts = indices.to(torch.int32).reshape(-1, 1)
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:  # each slot a token of one expert; a token's k rows weighed and summed here
        d = dispatcher.dispatch(a, torch.ones(slot_experts.shape, device=a.device), slot_experts, align=_align(self))
        y = dispatcher.combine(self.output_linear(d.x, d.group_sizes), d.handle, weighted=False)  # [T k, H]
        terms = y.view(-1, k, y.shape[1]).float() * weights.float()[:, :, None]
        out = terms[:, 0]
        for j in range(1, k):  # ascending j in fp32, rounded once: unpermute's order
            out = out + terms[:, j]
    else:
        a_perm, row_map, group_sizes = permute(a, slot_experts, self.router.num_experts, align=_align(self))
        y = self.output_linear(a_perm, group_sizes)  # [R, H]
        out = unpermute(y, row_map.view(-1, k), weights.float().contiguous())  # [T, H]
    return out.to(layer_input.dtype).view(bsz, length, -1) + self.bias


BLOCK_METHODS = (("forward", _block_forward),)
MOA_METHODS = (("map", _moa_map), ("reduce", _moa_reduce))


def _problem(block: nn.Module, gated: bool) -> str | None:
    """Why a JetMoE block (gated: the MoE block; else the MoA) cannot run on our ops, or None."""
    if (problem := _projection_problem(block)) is not None:
        return problem
    p1, p2 = _projection(block, "input_linear"), _projection(block, "output_linear")
    w1, w2, wg = p1.weight, p2.weight, getattr(block.router.layer, "weight", None)
    bias = block.bias
    if not all(isinstance(t, Tensor) for t in (w1, w2, wg, bias)):
        return "it lacks its projections', router's or bias tensors"
    if any(_is_dtensor(t) for t in (w1, w2, wg, bias)):
        return _SHARDED
    if w1.dtype not in _WEIGHT_DTYPES or w2.dtype != w1.dtype:
        return f"its expert weights are {w1.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    E, k = p1.num_experts, block.router.top_k
    held = block.__dict__.get(EXPERT_RANGE_ATTR)  # apply_expert_parallel's: this rank's experts (patched already)
    E_held = E if held is None else held[1]
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != E_held or w2.shape[0] != E_held:
        return f"its projections are not [E, N, K] for its {E_held} experts"
    H, N = w1.shape[2], w1.shape[1]
    inner = N // 2 if gated else N
    if (gated and N % 2) or tuple(w2.shape[1:]) != (H, inner) or tuple(wg.shape) != (E, H) or bias.shape != (H,):
        return (f"unexpected weight shapes input_linear {tuple(w1.shape)}, output_linear {tuple(w2.shape)}, router "
                f"{tuple(wg.shape)}, bias {tuple(bias.shape)}")
    if block.router.num_experts != E or getattr(block, "num_experts", E) != E or not isinstance(k, int) or not (
            1 <= k <= E):
        return "its router has no valid top_k or expert count"
    if not gated and k != getattr(block, "top_k", k):
        return "its router's top_k is not the attention's"
    return None


def jetmoe_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _problem(block, gated=True)


def jetmoe_moa_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _problem(block, gated=False)


def jetmoe_dims(block: nn.Module) -> tuple[int, int, object]:
    """(H, F, weight dtype) for a precision recipe's check: a MoE block's experts' (input_linear [E, 2F, H]), or a
    MoA's (input_linear [E, D, H], D = kv_channels x num_key_value_heads, for F)."""
    w1 = _projection(block, "input_linear").weight
    return w1.shape[2], w1.shape[1] // (1 if isinstance(block, _moa_class()) else 2), w1.dtype


def _moa_class():
    return getattr(sys.modules.get(_MODULE), "JetMoeMoA", ())


def expert_count(block: nn.Module) -> int | None:
    """E of a JetMoE block (its projections'), or None for any other module."""
    projection = _projection(block, "input_linear") if isinstance(block, nn.Module) else None
    return None if projection is None else projection.num_experts


def dispatched_rows_per_token(block: nn.Module) -> int:
    """The rows an expert-parallel dispatch carries per token of the block: k for a JetMoE MoA (each of a token's k
    slots a token of one expert), 1 otherwise (each (token, expert) pair once)."""
    return block.router.top_k if isinstance(block, _moa_class()) else 1


def expert_tensors(block: nn.Module) -> list[tuple[nn.Module, str, int]]:
    """(module, name, rows per expert) of a JetMoE block's per-expert weights, for apply_expert_parallel: its
    projections' [E, N, K] weights (inside any peft wrappers, whose factors stay whole); empty for any other module."""
    projections = [_projection(block, name) for name in _PROJECTIONS]
    return [(m, "weight", 1) for m in projections] if all(m is not None for m in projections) else []
