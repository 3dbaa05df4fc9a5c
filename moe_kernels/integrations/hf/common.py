"""Names and small helpers shared by the transformers drop-in's modules."""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from moe_kernels.nn.lora import unwrapped

EXPERTS_IMPLEMENTATION = "moe_kernels"  # the name in transformers' ExpertsInterface
_PATCH_ATTR = "_moe_kernels_patch"  # router: its previous `_old_forward` (accelerate); experts: previous implementation
_RECIPE_ATTR = "_moe_kernels_recipe"  # on patched experts modules given a precision recipe
DISPATCHER_ATTR = "_moe_kernels_dispatcher"  # on experts sharded by moe_kernels.parallel.apply_expert_parallel
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TM = "transformers.models."

_SHARDED = (
    "holds sharded (DTensor) weights: transformers' tensor or expert parallelism was applied "
    "(from_pretrained(..., tp_plan= or distributed_config=)). moe_kernels' ops take whole local tensors and do "
    "not run transformers' sharded experts; load the model without transformers' parallelism to patch it"
)


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _router_of(block: nn.Module):
    """The block's router module: `gate` in most families, `router` in GPT-OSS and Llama 4."""
    gate = block._modules.get("gate")
    return gate if isinstance(gate, nn.Module) else block._modules.get("router")



def _experts_of(block: nn.Module):
    """The block's experts module, inside any adapter wrappers (peft's ParamWrapper keeps it as base_layer)."""
    experts = getattr(block, "experts", None)
    return unwrapped(experts) if isinstance(experts, nn.Module) else experts


_ROUTER_LINEARS = ("proj", "wg", "gate", "classifier", "layer", "linear")  # Gemma 4's, HunYuan-MoE-V1's, AFMoE's,
# Longcat-Flash's, DBRX's, Ergo's


def _gate_weight(gate: nn.Module):
    """The router's [E, H] weight: its own, or its projection Linear's (`proj`, `wg`, `gate`, `classifier`, `layer`
    or `linear`)."""
    w = getattr(gate, "weight", None)
    if isinstance(w, Tensor):
        return w
    for name in _ROUTER_LINEARS:
        linear = gate._modules.get(name)
        if isinstance(linear, nn.Linear):
            return linear.weight
    return None


def _up_name(experts: nn.Module) -> str:
    """The experts' first projection: `gate_up_proj` [E, 2F, H] (gate rows, then up) for gated experts, `up_proj`
    [E, F, H] for experts without a gate (transformers' has_gate=False: Nemotron-H's, act_fn(up) alone)."""
    return "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"


def _gate_top_k(gate: nn.Module) -> int:
    """The router's k: `top_k`, or its config's `top_k_experts` (Gemma 4)."""
    k = getattr(gate, "top_k", None)
    return k if isinstance(k, int) else getattr(getattr(gate, "config", None), "top_k_experts", 0)




def _is_dbrx_glu(mlp) -> bool:
    """transformers' DbrxExpertGLU itself (not inside an adapter wrapper, nor a subclass)."""
    cls = getattr(sys.modules.get(_TM + "dbrx.modeling_dbrx"), "DbrxExpertGLU", None)
    return cls is not None and type(mlp) is cls


def _base_class(module: nn.Module) -> type:
    return getattr(type(module), "_moe_kernels_base", type(module))

