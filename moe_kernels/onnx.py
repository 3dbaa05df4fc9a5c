"""ONNX export of models that run moe_kernels' ops: `torch.onnx.export(model, args, dynamo=True)` as it is.

ONNX has no moe_kernels ops, so an exported graph must spell them in standard operators. While torch.onnx's
exporter runs (`exporting()`), the public ops `router_topk`, `permute`, `unpermute`, `grouped_mm`, `swiglu`,
`squared_relu` and `tokens_per_expert` run the traceable formulations below instead of their custom ops;
torch.export records their ATen ops and torch.onnx translates those. Nothing else changes: outside an ONNX export
(eager, torch.compile, a plain `torch.export.export`, which keeps the custom ops for AOTInductor) the ops run their
kernels as before. A model patched by `patch_hf` therefore exports with the exporter's defaults:

    model = moe_kernels.patch_hf(AutoModelForCausalLM.from_pretrained(..., use_cache=False))
    onnx_program = torch.onnx.export(model, (input_ids,), dynamo=True)

An ExportedProgram made beforehand holds the custom ops themselves; `decompositions()` maps each to its
formulation, for `ep.run_decompositions(moe_kernels.onnx.decompositions())` before `torch.onnx.export(ep)`.

Each formulation computes what its op's reference computes, with the op's argument checks, and its output
shapes follow from the input shapes (permute's row count is `permuted_rows`), so the graph exports with
static or dynamic batch and sequence dimensions:

- router_topk: the same scores and weights; selection by `torch.topk` (ONNX TopK), whose ties go to the lower
  index in ONNX, the router's own rule (NaN ranks as -inf, as in the op). The + 1e-20 of the sigmoid /
  sqrtsoftplus normalisation is a tensor, not a scalar constant, so that onnxscript's optimizer keeps it.
- permute, tokens_per_expert: their references, written with static shapes for this (permute sorts the
  distinct keys expert * T*k + slot, so any sort is the stable one, and gathers x_perm by row).
- grouped_mm: x split into its groups' rows by group_sizes, one product per expert, `rows_e @ w[e]^T` in the
  op's accumulation dtype, rows past the groups zero. The group sizes are data: torch.export holds them as
  unbacked sizes, ONNX as a runtime Split, so the graph does the kernel's FLOPs (no dense product over all
  experts) with E products per call in the graph.
- unpermute, swiglu, squared_relu: their references, which are already static (unpermute sums the k slots in
  ascending order in fp32, as the op does).

The other ops have no formulation: a model that calls one (the FP8 and NVFP4 ops of a precision recipe,
router_aux_scores and the losses, the backward ops) fails to export with torch.onnx's "No ONNX function
found" for that op.

Importing this module imports neither onnx nor onnxscript (torch.onnx does, when it exports).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor

_FLAGS_MODULE = "torch.onnx._internal.exporter._flags"


def exporting() -> bool:
    """Whether torch.onnx.export(..., dynamo=True) is running: the flag that torch.onnx.is_in_onnx_export()
    reads, set for the whole export, tracing included. Read here without importing anything (torch.onnx's
    function costs a microsecond per call, and TorchDynamo folds it to False, which would route a strict
    export to the custom ops); False until torch.onnx's exporter has been imported. The legacy TorchScript
    exporter (dynamo=False) does not set it: it cannot trace these formulations' data-dependent sizes."""
    flags = sys.modules.get(_FLAGS_MODULE)
    return flags is not None and bool(getattr(flags, "_is_onnx_exporting", False))


# ---------------------------------------------------------------------------------------------------
# Traceable formulations, one per op, with the op's signature


def router_topk_traceable(
    logits: Tensor, k: int, score: str, pre_softmax: bool, num_groups: int, group_topk: int,
    group_score_topk: int, scaling_factor: float, expert_bias: Tensor | None, normalize: bool,
) -> tuple[Tensor, Tensor]:
    """moe_kernels::router_topk: (weights [T, k] fp32, or fp64 for fp64 logits; indices [T, k] int32)."""
    from moe_kernels.ops.router import _check_topk, _rank_key, router_selection_scores

    _check_topk(logits, k, score, pre_softmax, num_groups, group_topk, group_score_topk, expert_bias)
    sel = router_selection_scores(logits, score, pre_softmax, expert_bias)
    T, E = sel.shape
    if num_groups > 1:
        size = E // num_groups
        top = torch.topk(_rank_key(sel).view(T, num_groups, size), group_score_topk, dim=-1, sorted=True).values
        group_score = top[..., 0]
        for i in range(1, group_score_topk):  # sequential sum, largest first, as the op
            group_score = group_score + top[..., i]
        keep = torch.topk(_rank_key(group_score), group_topk, dim=-1, sorted=True).indices  # [T, g]
        mask = torch.zeros((T, num_groups), dtype=torch.bool, device=sel.device).scatter(1, keep, True)
        sel = torch.where(mask.repeat_interleave(size, dim=1), sel, -torch.inf)
    indices = torch.topk(_rank_key(sel), k, dim=-1, sorted=True).indices
    return _router_weights(logits, indices, score, pre_softmax, normalize, scaling_factor), indices.to(torch.int32)


def _router_weights(logits: Tensor, indices: Tensor, score: str, pre_softmax: bool, normalize: bool,
                    scaling_factor: float) -> Tensor:
    """router_weights_reference, with the normalisation's + 1e-20 added as a tensor of the sum's shape:
    onnxscript's optimizer (0.7) rewrites `x + c` to x for a scalar constant c within 1e-8 of 0, which would
    turn k chosen scores of 0 into 0 / 0."""
    from moe_kernels.ops.router import GROUP_EPS, _acc, _activation, router_weights_reference

    if score == "softmax" or not normalize:
        return router_weights_reference(logits, indices, score, pre_softmax, normalize, scaling_factor)
    s = _activation(_acc(logits), score).gather(1, indices)
    total = s.sum(dim=-1, keepdim=True)
    return s / (total + torch.full_like(total, GROUP_EPS)) * scaling_factor


def permute_traceable(x: Tensor, indices: Tensor, num_experts: int, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """moe_kernels::permute: its reference (static shapes: a sort of distinct keys and gathers)."""
    from moe_kernels.ops.permute import _check_permute, permute_reference

    _check_permute(x, indices, num_experts, align)
    return permute_reference(x, indices, num_experts, align)


def unpermute_traceable(y: Tensor, row_map: Tensor, weights: Tensor | None = None) -> Tensor:
    """moe_kernels::unpermute: its reference (k gathers summed in ascending slot order, fp32)."""
    from moe_kernels.ops.permute import _check_unpermute, unpermute_reference

    _check_unpermute(y, row_map, weights)
    return unpermute_reference(y, row_map, weights)


def grouped_mm_traceable(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """moe_kernels::grouped_mm: [M, N], group e's rows x[start_e : start_e + group_sizes[e]] @ w[e]^T (products
    in fp32, fp64 for fp64), rows past sum(group_sizes) zero."""
    from moe_kernels.ops.grouped_mm import _acc, _check_fwd

    _check_fwd(x, w, group_sizes)
    acc = _acc(x.dtype)
    M, N = x.shape[0], w.shape[1]
    sizes = group_sizes.tolist()
    for n in sizes:
        torch._check(n >= 0)
    total = sum(sizes)
    torch._check(total <= M)
    *groups, rest = x.to(acc).split([*sizes, M - total])
    w_t = w.to(acc).transpose(1, 2)  # [E, K, N]
    out = [rows @ w_t[e] for e, rows in enumerate(groups)]
    return torch.cat([*out, rest.new_zeros((M - total, N))]).to(x.dtype)


def swiglu_traceable(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    """moe_kernels::swiglu: its reference, silu(gate) * up (* row_weights) in fp32."""
    from moe_kernels.ops.activation import _check, swiglu_reference

    _check(h, row_weights)
    return swiglu_reference(h, row_weights)


def squared_relu_traceable(h: Tensor) -> Tensor:
    """moe_kernels::squared_relu: its reference, torch's relu then square."""
    from moe_kernels.ops.activation import _check_squared_relu, squared_relu_reference

    _check_squared_relu(h)
    return squared_relu_reference(h)


def tokens_per_expert_traceable(indices: Tensor, num_experts: int) -> Tensor:
    """moe_kernels::tokens_per_expert: its reference (a scatter-add into E + 1 bins)."""
    from moe_kernels.ops.permute import tokens_per_expert_reference

    return tokens_per_expert_reference(indices, num_experts)


def decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """{custom op: its traceable formulation}, for `ExportedProgram.run_decompositions`: an ExportedProgram of a
    model on moe_kernels' ops becomes one that torch.onnx.export converts.

        ep = torch.export.export(model, (input_ids,))
        onnx_program = torch.onnx.export(ep.run_decompositions(moe_kernels.onnx.decompositions()))
    """
    ops = torch.ops.moe_kernels
    return {
        ops.router_topk.default: router_topk_traceable,
        ops.permute.default: permute_traceable,
        ops.unpermute.default: unpermute_traceable,
        ops.grouped_mm.default: grouped_mm_traceable,
        ops.swiglu.default: swiglu_traceable,
        ops.squared_relu.default: squared_relu_traceable,
        ops.tokens_per_expert.default: tokens_per_expert_traceable,
    }
