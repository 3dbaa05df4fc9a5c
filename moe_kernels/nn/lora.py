"""Low-rank adapters on grouped expert weights, without forming W + BA.

For expert weights W [E, N, K] with adapters (per expert) A [E, r, K] and B [E, N, r] and a scaling s, the
adapted product over the permuted rows of expert e is

    x W_e^T + s (x A_e^T) B_e^T = grouped_mm(x, W) + s grouped_mm(grouped_mm(x, A), B)

two extra grouped GEMMs of rank r on the same rows: no per-expert loop and no dense delta (peft's
`target_parameters` path forms W + BA, a full copy of the expert weights, on every forward). Forward and
backward are grouped_mm's, so gradients reach W (if it trains), A and B.

The terms live on the experts module while an adapter wrapper runs it (moe_kernels.integrations.peft swaps
peft's wrappers for ones that put them here instead of parametrizing the weight): `lora_terms(module, name)`
is the list of (B [E, N, r], A [E, r, K], s) for the weight `name`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from moe_kernels.ops.grouped_mm import grouped_mm

LORA_ATTR = "_moe_kernels_lora"
# On an expert-parallel rank's experts module: (first, count, total), the experts [first, first + count) of the
# layer's `total` that it holds (moe_kernels.parallel.apply_expert_parallel). An adapter wrapper applies those
# experts' slices of its factors (moe_kernels.integrations.peft).
EXPERT_RANGE_ATTR = "_moe_kernels_expert_range"
# Set (a count) on such experts while moe_kernels.integrations.peft's wrapper parametrizes their weights with this
# rank's slice of its delta (peft's own path: several adapters, non-float weights).
SLICED_DELTA_ATTR = "_moe_kernels_sliced_delta"
# On an expert-tensor-parallel rank's experts module: (lo, width, ffn), the slice [lo, lo + width) of each expert's
# ffn width `ffn` that it holds (w13's gate rows and up rows, or its rows without a gate; w2's columns). An adapter
# wrapper applies that slice of its factors too.
FFN_SLICE_ATTR = "_moe_kernels_ffn_slice"


def ffn_slice(t: Tensor, name: str, held: tuple[int, int, int], gated: bool, dim: int) -> Tensor:
    """The part of `t` (an expert weight `name`, "w13" or "w2", or a factor or delta of it, whose ffn axis is `dim`)
    that an expert-tensor-parallel rank holding `held` = (lo, width, ffn) keeps: w13's gate and up rows of the slice
    (or its rows without a gate), w2's columns."""
    lo, f, F = held
    if name == "w13" and gated:
        return torch.cat([t.narrow(dim, lo, f), t.narrow(dim, F + lo, f)], dim)
    return t.narrow(dim, lo, f)


def check_expert_parallel_weights(experts: nn.Module) -> None:
    """ValueError where an expert-parallel rank's experts module has its weights parametrized by anything but our
    adapter wrapper's sliced delta: peft's own LoRA wrapper, made after apply_expert_parallel from this rank's
    experts alone, would train adapters that differ per rank under names every rank shares."""
    if (EXPERT_RANGE_ATTR in experts.__dict__ and parametrize.is_parametrized(experts)
            and not experts.__dict__.get(SLICED_DELTA_ATTR)):
        raise ValueError(
            f"moe_kernels: the weights of the expert-parallel {type(experts).__name__} are parametrized (peft's own "
            "LoRA wrapper?): adapters must be created (get_peft_model, PeftModel.from_pretrained) before "
            "apply_expert_parallel, which keeps every expert's factors on every rank and applies this rank's slices")


def wrapped_module(module: nn.Module) -> nn.Module | None:
    """The module an adapter wrapper holds (peft's keep it as the submodule `base_layer`), or None. A dict lookup:
    getattr on an nn.Module without the attribute raises inside nn.Module.__getattr__, a microsecond a call."""
    return module._modules.get("base_layer")


def unwrapped(module: nn.Module) -> nn.Module:
    """The module (the experts, or any other) inside any adapter wrappers (peft's keep it as `base_layer`)."""
    while (base := wrapped_module(module)) is not None:
        module = base
    return module


def experts_path(layer: nn.Module, name: str = "experts") -> str:
    """The attribute path from `layer` to its experts module inside any adapter wrappers: "experts", or
    "experts.base_layer" (one wrapper), ... (the prefix of the experts' parameter names in layer's state dict)."""
    path, module = name, getattr(layer, name)
    while (base := wrapped_module(module)) is not None:
        path, module = path + ".base_layer", base
    return path


def lora_terms(module: nn.Module, name: str) -> list[tuple[Tensor, Tensor, float]]:
    """The low-rank terms (B, A, scaling) active on `module`'s weight `name` (empty without adapters)."""
    return module.__dict__.get(LORA_ATTR, {}).get(name, [])


def grouped_mm_lora(x: Tensor, w: Tensor, group_sizes: Tensor, terms, mm=grouped_mm) -> Tensor:
    """[R, K] rows grouped by expert times (W + sum of s B A)^T per group, as grouped_mm(x, W) plus s x A^T B^T
    for each term (rank-r grouped GEMMs in x's dtype). `mm` computes the base product (a precision recipe's,
    or grouped_mm); rows past the groups are unspecified, as in grouped_mm."""
    out = mm(x, w, group_sizes)
    for b, a, scaling in terms:
        a, b = a.to(x.dtype).contiguous(), b.to(x.dtype).contiguous()  # small: E (N + K) r elements
        low = grouped_mm(grouped_mm(x, a, group_sizes), b, group_sizes)  # [R, r] -> [R, N]
        out = out + scaling * low.to(out.dtype)
    return out
