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
- the MoE block (`_block_forward`): its experts as a transformers experts module whose gate_up_proj [E, 2F, H] (gate
  rows, then up) is input_linear's weight and down_proj [E, H, F] output_linear's (`_Experts`), run by
  `moe_kernels_experts_forward` (the fused "moe" region on a GPU; a precision recipe's GEMMs and, for FP8, its fused
  producers; the SiLU gate as our swiglu, another activation as act_fn(gate) * up), then the block's bias.
- the MoA (`_moa_map`, `_moa_reduce`): map permutes the tokens by expert, runs the grouped GEMM on input_linear's
  weight [E, D, H] and gathers each slot's row back to token order ([B, S, k, D]: unpermute with one slot per row);
  reduce permutes the k attention outputs of each token by their experts, runs the grouped GEMM on output_linear's
  weight [E, H, D] and sums them with the routing weights (unpermute, fp32, rounded once), then the bias. A
  precision recipe: its grouped_mm, the rows padded to its alignment.

Expert-parallel (moe_kernels.parallel.apply_expert_parallel: each projection keeps this rank's E / P experts), the
MoE block takes the dispatcher's dispatch and combine as transformers' experts do; the MoA sends each slot as a token
of one expert (map: the token's row once per slot; reduce: each slot's attention output), so the combine returns
each slot's row unsummed, and reduce weighs and sums a token's k rows in fp32 (rounded once, as unpermute does).

peft adapters on the projections (a ParamWrapper around input_linear or output_linear) run on transformers' code:
patch_hf leaves such blocks alone (named in its warning), and a wrapper added after patch_hf is a clear error.
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import Tensor, nn

from moe_kernels.ops.grouped_mm import grouped_mm
from moe_kernels.ops.permute import permute, unpermute
from moe_kernels.ops.router import router_topk

from moe_kernels.nn.lora import EXPERT_RANGE_ATTR

from .common import _RECIPE_ATTR, _SHARDED, _TM, _WEIGHT_DTYPES, DISPATCHER_ATTR, _is_dtensor
from .experts import moe_kernels_experts_forward

_MODULE = _TM + "jetmoe.modeling_jetmoe"
_PROJECTIONS = ("input_linear", "output_linear")


def jetmoe_router_forward(self: nn.Module, hidden_states: Tensor) -> tuple:
    """JetMoeTopKGating on router_topk: its `layer`'s logits in fp32, top-k by logit, softmax over the k (fp32),
    the weights cast to the input's dtype. Returns (experts [T, k] int64, weights [T, k], None, None, logits [T, E]
    fp32): the logits where transformers' output recorder reads them (index 4)."""
    logits = self.layer(hidden_states).float()
    weights, indices = router_topk(logits, self.top_k, score="softmax", pre_softmax=False)
    return indices.long(), weights.to(hidden_states.dtype), None, None, logits


class _Experts:
    """A JetMoE block's experts as a transformers experts module (what moe_kernels_experts_forward reads):
    gate_up_proj [E, 2F, H] = input_linear's weight (gate rows, then up: JetMoE chunks the product in two, the
    activation on the first half), down_proj [E, H, F] = output_linear's, act_fn = the block's activation, and the
    patched block's precision recipe and expert-parallel dispatcher. transformers' default gate (`_apply_gate`) is set on the class on first use
    (`_experts`), so that a SiLU activation runs as our swiglu, as transformers' experts do."""

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
    if "_apply_gate" not in _Experts.__dict__:
        _Experts._apply_gate = importlib.import_module("transformers.integrations.moe")._default_apply_gate
    return _Experts(block)


def _check_projections(block: nn.Module) -> None:
    """NotImplementedError where a projection is no longer transformers' JetMoeParallelExperts (an adapter wrapper
    added after patch_hf: its delta would be skipped), before any kernel runs."""
    cls = getattr(sys.modules.get(_MODULE), "JetMoeParallelExperts", None)
    for name in _PROJECTIONS:
        module = block._modules.get(name)
        if type(module) is not cls:
            raise NotImplementedError(
                f"moe_kernels: JetMoE's {type(block).__name__}.{name} is a {type(module).__name__}, not transformers' "
                "JetMoeParallelExperts (an adapter wrapper added after patch_hf?); unpatch_hf(model) runs transformers' "
                "code, which applies it")


def _block_forward(self: nn.Module, layer_input: Tensor) -> Tensor:
    """JetMoeMoE: the router, the routed experts (`_Experts`, moe_kernels_experts_forward), the block's bias.
    layer_input [B, S, H]; returns [B, S, H] in its dtype."""
    _check_projections(self)
    bsz, length, emb = layer_input.shape
    x = layer_input.reshape(-1, emb)
    indices, weights, _, _, _ = self.router(x)
    out = moe_kernels_experts_forward(_experts(self), x, indices, weights)
    return out.view(bsz, length, emb) + self.bias


def _moa_mm(self: nn.Module, x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    recipe = self.__dict__.get(_RECIPE_ATTR)
    return (grouped_mm if recipe is None else recipe.grouped_mm)(x, w.contiguous(), group_sizes)


def _align(self: nn.Module) -> int:
    recipe = self.__dict__.get(_RECIPE_ATTR)
    return 1 if recipe is None else recipe.align


def _moa_map(self: nn.Module, layer_input: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """JetMoeMoA.map: each token's query projection by each of its k experts. layer_input [B, S, H]; returns the
    queries [B, S, k, D] (slot j of a token: its j-th expert's), the router logits, and the routing (experts [T, k],
    weights [T, k]) that `_moa_reduce` takes, where transformers passes its sorted slots."""
    _check_projections(self)
    bsz, length, emb = layer_input.shape
    w = self.input_linear.weight  # [E, D, H]
    x = layer_input.reshape(-1, emb).to(w.dtype).contiguous()
    indices, weights, _, _, router_logits = self.router(x)
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:  # each slot a token of one expert: the combine returns the slots' rows unsummed
        slot_experts = indices.to(torch.int32).reshape(-1, 1)
        d = dispatcher.dispatch(x.repeat_interleave(self.top_k, 0), torch.ones(slot_experts.shape, device=x.device),
                                slot_experts, align=_align(self))
        slots = dispatcher.combine(_moa_mm(self, d.x, w, d.group_sizes), d.handle, weighted=False)  # [T k, D]
    else:
        x_perm, row_map, group_sizes = permute(x, indices.to(torch.int32), self.num_experts, align=_align(self))
        q = _moa_mm(self, x_perm, w, group_sizes)  # [R, D]
        slots = unpermute(q, row_map.view(-1, 1))  # [T k, D]: each slot's own row (one term: exact)
    return slots.view(bsz, length, self.top_k, -1).to(layer_input.dtype), router_logits, (indices, weights)


def _moa_reduce(self: nn.Module, layer_input: Tensor, topo_info: tuple[Tensor, Tensor]) -> Tensor:
    """JetMoeMoA.reduce: each slot's attention output [B, S, k, D] projected by its expert, the k summed with the
    routing weights (fp32, rounded once), the bias. Returns [B, S, H]."""
    _check_projections(self)
    indices, weights = topo_info
    bsz, length, k, width = layer_input.shape
    w = self.output_linear.weight  # [E, H, D]
    a = layer_input.reshape(-1, width).to(w.dtype).contiguous()  # [T k, D]
    slot_experts = indices.to(torch.int32).reshape(-1, 1)
    dispatcher = self.__dict__.get(DISPATCHER_ATTR)
    if dispatcher is not None:  # each slot a token of one expert; a token's k rows weighed and summed here
        d = dispatcher.dispatch(a, torch.ones(slot_experts.shape, device=a.device), slot_experts, align=_align(self))
        y = dispatcher.combine(_moa_mm(self, d.x, w, d.group_sizes), d.handle, weighted=False)  # [T k, H]
        terms = y.view(-1, k, y.shape[1]).float() * weights.float()[:, :, None]
        out = terms[:, 0]
        for j in range(1, k):  # ascending j in fp32, rounded once: unpermute's order
            out = out + terms[:, j]
    else:
        a_perm, row_map, group_sizes = permute(a, slot_experts, self.num_experts, align=_align(self))
        y = _moa_mm(self, a_perm, w, group_sizes)  # [R, H]
        out = unpermute(y, row_map.view(-1, k), weights.float().contiguous())  # [T, H]
    return out.to(layer_input.dtype).view(bsz, length, -1) + self.bias


BLOCK_METHODS = (("forward", _block_forward),)
MOA_METHODS = (("map", _moa_map), ("reduce", _moa_reduce))


def _problem(block: nn.Module, gated: bool) -> str | None:
    """Why a JetMoE block (gated: the MoE block; else the MoA) cannot run on our ops, or None."""
    cls = getattr(sys.modules.get(_MODULE), "JetMoeParallelExperts", None)
    for name in _PROJECTIONS:
        module = block._modules.get(name)
        if type(module) is not cls:
            return (f"its {name} is a {type(module).__name__}, not transformers' JetMoeParallelExperts (peft adapters "
                    "on JetMoE's experts run on transformers' code)")
    w1, w2, wg = block.input_linear.weight, block.output_linear.weight, getattr(block.router.layer, "weight", None)
    bias = block.bias
    if not all(isinstance(t, Tensor) for t in (w1, w2, wg, bias)):
        return "it lacks its projections', router's or bias tensors"
    if any(_is_dtensor(t) for t in (w1, w2, wg, bias)):
        return _SHARDED
    if w1.dtype not in _WEIGHT_DTYPES or w2.dtype != w1.dtype:
        return f"its expert weights are {w1.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    E, k = block.input_linear.num_experts, block.router.top_k
    held = block.__dict__.get(EXPERT_RANGE_ATTR)  # apply_expert_parallel's: this rank's experts (patched already)
    E_held = E if held is None else held[1]
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != E_held or w2.shape[0] != E_held:
        return f"its projections are not [E, N, K] for its {E_held} experts"
    H, N = w1.shape[2], w1.shape[1]
    inner = N // 2 if gated else N
    if (gated and N % 2) or tuple(w2.shape[1:]) != (H, inner) or tuple(wg.shape) != (E, H) or bias.shape != (H,):
        return (f"unexpected weight shapes input_linear {tuple(w1.shape)}, output_linear {tuple(w2.shape)}, router "
                f"{tuple(wg.shape)}, bias {tuple(bias.shape)}")
    if block.router.num_experts != E or not isinstance(k, int) or not 1 <= k <= E:
        return "its router has no valid top_k or expert count"
    if not gated and k != getattr(block, "top_k", k):
        return "its router's top_k is not the attention's"
    return None


def jetmoe_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _problem(block, gated=True)


def jetmoe_moa_problem(gate: nn.Module, block: nn.Module, E: int) -> str | None:
    return _problem(block, gated=False)


def jetmoe_dims(block: nn.Module) -> tuple[int, int, object]:
    """(H, F, weight dtype) of a JetMoE MoE block's experts for a precision recipe's check."""
    w1 = block.input_linear.weight
    return w1.shape[2], w1.shape[1] // 2, w1.dtype


def jetmoe_moa_dims(block: nn.Module) -> tuple[int, int, object]:
    """(H, D, weight dtype) of a JetMoE MoA's projections (D = kv_channels x num_key_value_heads)."""
    w1 = block.input_linear.weight
    return w1.shape[2], w1.shape[1], w1.dtype


def expert_tensors(block: nn.Module) -> list[tuple[nn.Module, str, int]]:
    """(module, name, rows per expert) of a JetMoE block's per-expert weights, for apply_expert_parallel: its
    projections' [E, N, K] weights; empty for a module that is none."""
    cls = getattr(sys.modules.get(_MODULE), "JetMoeParallelExperts", None)
    projections = [block._modules.get(name) for name in _PROJECTIONS]
    return [(m, "weight", 1) for m in projections] if all(type(m) is cls for m in projections) else []
