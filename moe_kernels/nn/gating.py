"""The router's gating linear: logits = x W^T in the weight's precision (fp32), for x of any float dtype.

Autograd's linear on x.float() keeps the fp32 copy for the backward: T x H x 4 bytes a layer for a bf16 x, where x
itself takes 2 and other nodes of the layer may keep it anyway. Here the node keeps x in its own dtype and casts it
again in the backward, as Megatron-Core's router gating does; outputs and gradients are F.linear's on the copy, bit
for bit (tests/nn/test_router_module.py). The router region (moe_kernels.nn.fused) runs the same products inside its
own autograd node; the registered-op path takes `gating_linear`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_kernels import _ext

_AUTOCAST = ("cuda", "cpu")  # the device types autocast is asked about (others, e.g. meta, raise)


def gating_saved(ctx, x: Tensor, weight: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """What the gating linear's backward reads, as autograd's linear keeps it: x for W's gradient, W for x's (a frozen
    router keeps no x). x's dtype is noted for dx's cast."""
    need_x, need_w = ctx.needs_input_grad[:2]
    ctx.x_dtype = x.dtype
    return (x if need_w else None), (weight if need_x else None)


def gating_grads(ctx, grad: Tensor, x: Tensor | None, weight: Tensor | None):
    """The gating linear's backward from the logits' gradient: the two products autograd's linear takes on x's copy in
    the weight's precision (dx = grad W, then cast to x's dtype; dW = grad^T x), that copy made again here."""
    need_x, need_w = ctx.needs_input_grad[:2]
    dx = grad.mm(weight).to(ctx.x_dtype) if need_x else None
    dw = grad.t().mm(x.to(grad.dtype)) if need_w else None
    return dx, dw


class _Gating(torch.autograd.Function):
    """logits = x W^T in W's precision, keeping x itself for the backward rather than its copy (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(*gating_saved(ctx, x, weight))
        return torch.nn.functional.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx, grad):
        return gating_grads(ctx, grad, *ctx.saved_tensors)


def gating_linear(x: Tensor, weight: Tensor) -> Tensor:
    """The router's logits x W^T [T, E] in W's precision for x [T, H] of any float dtype. Where x is narrower than W
    and a gradient is recorded, the autograd node keeps x, not its copy (`_Gating`); compiling, exporting and tracing
    see F.linear, whose graph they partition themselves, and so does autocast (Router turns it off around this)."""
    if (x.element_size() >= weight.element_size() or not torch.is_grad_enabled() or not x.is_floating_point()
            or _ext._transformed(x) or (x.device.type in _AUTOCAST and torch.is_autocast_enabled(x.device.type))):
        return torch.nn.functional.linear(x.to(weight.dtype), weight)
    return _Gating.apply(x, weight)
