"""SwiGLU (or squared-ReLU) experts on grouped GEMMs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moe_kernels.nn.lora import check_expert_parallel_weights, grouped_mm_lora, lora_terms
from moe_kernels.ops.activation import squared_relu, swiglu
from moe_kernels.ops.grouped_mm import grouped_mm

ACTIVATIONS = ("swiglu", "squared_relu")


def squared_relu_act(h, row_weights=None, *, op=squared_relu):
    """squared_relu (or `op`: its reference) in the experts' activation signature (the squared ReLU takes no
    routing weights)."""
    if row_weights is not None:
        raise ValueError("squared-ReLU experts take no row weights (routing weights apply in unpermute)")
    return op(h)


class GroupedExperts(nn.Module):
    """E SwiGLU MLPs applied to permuted rows: y = (silu(x W_gate^T) * (x W_up^T)) W_down^T per expert; or, with
    activation="squared_relu", E MLPs without a gate: y = relu(x W_up^T)^2 W_down^T (Nemotron-H's experts).

    Weights: w13 [E, 2F, H] holds the gate rows [0, F) then the up rows [F, 2F) (the Hugging Face 5.x
    `gate_up_proj` order), or the up rows alone [E, F, H] without a gate; w2 [E, H, F]. Input rows come grouped
    by expert (permute's output with its group_sizes); `row_weights` [R], when given, scale each row's activation
    (routing weights applied inside the expert instead of in unpermute; SwiGLU only).

    Low-rank adapters: peft's LoRA with `target_parameters=["...experts.w13", "...experts.w2"]`, made to run as
    grouped rank-r GEMMs by moe_kernels.integrations.peft.fuse_lora (moe_kernels.nn.lora).
    """

    activation = "swiglu"  # (the class default: modules pickled before the option existed are SwiGLU ones)

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, *, activation: str = "swiglu", device=None,
                 dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"GroupedExperts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.num_experts, self.hidden_size, self.ffn_size = num_experts, hidden_size, ffn_size
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        rows = 2 * ffn_size if self.gated else ffn_size
        self.w13 = nn.Parameter(torch.empty(num_experts, rows, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        nn.init.uniform_(self.w13, -1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.ffn_size), 1 / math.sqrt(self.ffn_size))

    @property
    def gated(self) -> bool:
        """w13 holds gate and up rows (SwiGLU); False: the up rows alone (squared ReLU)."""
        return self.activation == "swiglu"

    def forward(
        self, x: Tensor, group_sizes: Tensor, row_weights: Tensor | None = None, *, mm=grouped_mm, act=None
    ) -> Tensor:
        """x [R, H] grouped by expert, group_sizes [E] int32 -> [R, H] (rows past the groups unspecified).

        `mm` and `act` are the grouped product and the fused activation (the ops, or their references; None: this
        module's activation op)."""
        check_expert_parallel_weights(self)
        h = grouped_mm_lora(x, self.w13, group_sizes, lora_terms(self, "w13"), mm=mm)  # [R, 2F] ([R, F] ungated)
        return self.forward_from_gate_up(h, group_sizes, row_weights, mm=mm, act=act)

    def forward_from_gate_up(
        self, h: Tensor, group_sizes: Tensor, row_weights: Tensor | None = None, *, mm=grouped_mm, act=None
    ) -> Tensor:
        """The rest of forward once the gate/up product h = x W13^T [R, 2F] (the up product [R, F] without a gate)
        is computed (e.g. fused with the permute by a precision recipe)."""
        act = act if act is not None else (swiglu if self.gated else squared_relu_act)
        return grouped_mm_lora(act(h, row_weights), self.w2, group_sizes, lora_terms(self, "w2"), mm=mm)  # -> [R, H]

    @classmethod
    def from_per_expert_linears(
        cls, gate_projs: Sequence[nn.Linear], up_projs: Sequence[nn.Linear], down_projs: Sequence[nn.Linear]
    ) -> "GroupedExperts":
        """Stack per-expert nn.Linear layers (gate/up: H -> F, down: F -> H, no biases) into one module."""
        if not (len(gate_projs) == len(up_projs) == len(down_projs)) or not gate_projs:
            raise ValueError("from_per_expert_linears: need the same non-zero number of gate, up and down layers")
        if any(l.bias is not None for l in (*gate_projs, *up_projs, *down_projs)):
            raise ValueError("from_per_expert_linears: expert linears with biases are not supported")
        F_, H = gate_projs[0].weight.shape
        w = gate_projs[0].weight
        experts = cls(len(gate_projs), H, F_, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            experts.w13.copy_(torch.stack([torch.cat([g.weight, u.weight]) for g, u in zip(gate_projs, up_projs)]))
            experts.w2.copy_(torch.stack([d.weight for d in down_projs]))
        return experts
