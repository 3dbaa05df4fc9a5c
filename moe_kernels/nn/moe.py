"""The MoE layer: Router -> (capacity) -> permute -> GroupedExperts -> unpermute, plus shared experts."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _nn_module

from moe_kernels.nn import fused, fused_fp8, torch_native
from moe_kernels.nn.experts import ACTIVATIONS, GroupedExperts, squared_relu_act
from moe_kernels.nn.lora import lora_terms, unwrapped, wrapped_module
from moe_kernels.nn.router import Router, RouterConfig
from moe_kernels.ops.activation import squared_relu, squared_relu_reference, swiglu, swiglu_reference
from moe_kernels.ops.expert_mlp import expert_mlp_reference
from moe_kernels.ops.grouped_mm import autocast_input, grouped_mm, grouped_mm_reference
from moe_kernels.ops.permute import (
    permute,
    permute_reference,
    permuted_row_values,
    permuted_rows,
    unpermute,
    unpermute_reference,
)
from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe

BACKENDS = ("kernels", "reference", "torch")
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, nn.Parameter)


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The autocast dtype on t's device type, None when autocast is off there."""
    device_type = t.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _gemm_dtype(w: Tensor, autocast: torch.dtype | None) -> torch.dtype:
    """w's dtype in the expert GEMMs: the autocast dtype under torch.autocast (autocast_input)."""
    return autocast if autocast is not None and w.dtype != torch.float64 else w.dtype


def _nn_hooks() -> bool:
    """Whether global nn.Module forward hooks are registered (a fused region would skip them)."""
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)


# The same layer on the plain PyTorch references (readable, slow, host-syncing), for comparisons.
_REFERENCE_OPS = SimpleNamespace(
    permute=permute_reference, unpermute=unpermute_reference, grouped_mm=grouped_mm_reference, swiglu=swiglu_reference,
    squared_relu=functools.partial(squared_relu_act, op=squared_relu_reference),
)
_KERNEL_OPS = SimpleNamespace(
    permute=lambda x, idx, E, align: permute(x, idx, E, align=align), unpermute=unpermute, grouped_mm=grouped_mm,
    swiglu=swiglu, squared_relu=squared_relu_act,
)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    router: RouterConfig
    ffn_size: int  # per routed expert
    shared_ffn_size: int = 0  # 0: no shared experts (several shared experts = one wider MLP)
    shared_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(x . w_gate)
    align: int = 1  # rows per expert padded to this (16 or 128 for FP8 recipes)
    weights_in_activation: bool = False  # Megatron's fusion; default: weights applied in unpermute
    # The routed experts as one gather-fused op (ops/expert_mlp.py): tokens read straight into the first GEMM,
    # no permuted copy, no expert-output gradient; needs weights_in_activation. Opt-in: its gathered products
    # have sm_90a kernels, themselves opt-in (MOE_KERNELS_GATHER_CUTLASS=1). MoELayer.expert_path says what ran.
    gather_experts: bool = False
    backend: str = "kernels"  # "reference": the plain references; "torch": the torch-native composition
    recipe: Fp8BlockwiseRecipe | Nvfp4Recipe | None = None  # routed experts' GEMM precision; None: the input's
    # The experts' (and shared experts') MLP: "swiglu" (gate and up projections), or "squared_relu": relu(x W_up^T)^2
    # W_down^T without a gate (Nemotron-H's experts), the routing weights applied in the unpermute.
    activation: str = "swiglu"

    def __post_init__(self):
        if self.ffn_size < 1 or self.shared_ffn_size < 0:
            raise ValueError("MoEConfig: ffn_size must be >= 1 and shared_ffn_size >= 0")
        if self.align < 1:
            raise ValueError("MoEConfig: align must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"MoEConfig: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.shared_gate and not self.shared_ffn_size:
            raise ValueError("MoEConfig: shared_gate needs shared experts (shared_ffn_size > 0)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "squared_relu" and self.weights_in_activation:
            raise ValueError("MoEConfig: weights_in_activation applies the routing weights in the SwiGLU; with "
                             "activation='squared_relu' they apply in the unpermute (weights_in_activation=False)")
        if self.gather_experts:
            if not self.weights_in_activation:
                raise ValueError("MoEConfig: gather_experts needs weights_in_activation=True (the routing weights "
                                 "applied in the activation, so the expert outputs need not be kept)")
            if self.recipe is not None:
                raise ValueError("MoEConfig: gather_experts has no low-precision recipe yet (recipe must be None)")
            if self.backend == "torch":
                raise ValueError("MoEConfig: gather_experts runs the kernels or the references, not backend='torch'")
        if self.recipe is not None:
            if self.backend == "torch":
                raise ValueError("MoEConfig: the torch-native backend has no low-precision recipe")
            self.recipe.check_shapes(self.router.hidden_size, self.ffn_size)

    @property
    def permute_align(self) -> int:
        """Rows per expert padded to a multiple of both `align` and the recipe's."""
        return math.lcm(self.align, self.recipe.align) if self.recipe is not None else self.align

    @property
    def hidden_size(self) -> int:
        return self.router.hidden_size

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)


class SharedExperts(nn.Module):
    """Dense SwiGLU MLP every token goes through, with Qwen2-MoE's optional sigmoid gate; with
    activation="squared_relu", down(relu(up(x))^2) without a gate projection (Nemotron-H's shared expert)."""

    def __init__(self, hidden_size: int, ffn_size: int, *, gate: bool = False, activation: str = "swiglu",
                 device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"SharedExperts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        factory = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(hidden_size, ffn_size, **factory) if activation == "swiglu" else None
        self.up_proj = nn.Linear(hidden_size, ffn_size, **factory)
        self.down_proj = nn.Linear(ffn_size, hidden_size, **factory)
        self.gate = nn.Linear(hidden_size, 1, **factory) if gate else None

    def forward(self, x: Tensor, *, kernels: bool = False, launch: fused.Launch | None = None) -> Tensor:
        """x [..., H] -> [..., H]. kernels: the MLP as the `mlp` fused region (our grouped GEMM over one group and
        the fused SwiGLU; `launch`: its thin path, None: the registered ops), where the projections are plain
        bias-free nn.Linear weights without hooks; else (and by default) the nn.Linear modules."""
        if self.gate_proj is None:  # squared ReLU: our fused op on the kernels' path, torch's relu then square else
            up = self.up_proj(x)
            out = self.down_proj(squared_relu(up) if kernels else F.relu(up).square())
            return out if self.gate is None else torch.sigmoid(self.gate(x)) * out
        weights = self._region_weights(x) if kernels else None
        if weights is not None:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            out = fused.run("mlp", launch, autocast_input(x2), *weights)
            out = out if x.dim() == 2 else out.view(x.shape)
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out

    def _region_weights(self, x: Tensor) -> list[Tensor] | None:
        """The gate, up and down weights as the `mlp` region takes them (in the autocast dtype under autocast), or
        None where the region would skip what the modules do or cannot take them."""
        autocast = _autocast_dtype(x)
        dtype = _gemm_dtype(x, autocast)
        if dtype not in _FUSED_DTYPES or not x.is_contiguous() or _nn_hooks():
            return None
        mods = self._modules
        weights = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            m = mods[name]
            # (accelerate's offloading replaces `forward` on the instance and keeps the weight on meta until it runs)
            if type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
                return None
            params = m._parameters
            w = params["weight"]
            if (params["bias"] is not None or type(w) not in _PLAIN or not w.is_contiguous()
                    or w.device != x.device):
                return None
            if w.dtype is not dtype:
                if _gemm_dtype(w, autocast) != dtype:
                    return None
                w = w.to(dtype)  # under autocast, as nn.Linear casts it
            weights.append(w)
        return weights


class MoELayer(nn.Module):
    """forward(x [..., H]) -> (out [..., H], aux_loss scalar). No process groups inside.

    The sequence-wise aux loss takes sequences of x.shape[-2] tokens ([B, S, H]: B sequences; [T, H]:
    one sequence) unless forward(..., seq_len=S) says otherwise (e.g. [B*S, H] input)."""

    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.router = Router(config.router).to(device=device)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.ffn_size,
                                      activation=config.activation, device=device, dtype=dtype)
        self.shared_experts = (
            SharedExperts(config.hidden_size, config.shared_ffn_size, gate=config.shared_gate,
                          activation=config.activation, device=device, dtype=dtype)
            if config.shared_ffn_size
            else None
        )
        # Expert parallelism (moe_kernels.parallel.apply_expert_parallel) sets a token dispatcher and
        # keeps only this rank's experts in `experts`; None: every expert is local.
        self.dispatcher = None
        # How the last forward ran the routed experts: "gathered" (the gather-fused op), "fused" (the fused
        # regions over a permuted copy), "dispatched", "fused_fp8" (the FP8 recipe's `moe_fp8` region), "recipe"
        # (the recipe's fused permute and functions) or "ops"; None before the first forward.
        self.expert_path: str | None = None

    def forward(self, x: Tensor, *, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        cfg = self.config
        if x.dim() < 2:
            raise ValueError(f"MoELayer: x must be [..., T, H], got shape {tuple(x.shape)}")
        seq_len = x.shape[-2] if seq_len is None else seq_len
        if cfg.backend == "torch":
            if self.dispatcher is not None:
                raise ValueError("MoELayer: the torch-native backend has no expert-parallel path")
            if self._adapted():
                raise ValueError("MoELayer: the torch-native backend runs no adapters on the experts (peft's LoRA); "
                                 "use backend='kernels' or 'reference'")
            return self._forward_torch_native(x, seq_len)
        ops = _REFERENCE_OPS if cfg.backend == "reference" else _KERNEL_OPS
        if cfg.recipe is not None:
            ops = SimpleNamespace(**{**vars(ops), "grouped_mm": cfg.recipe.grouped_mm})
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [T, H]
        launch = self._launch(x2) if cfg.backend == "kernels" else None
        # An empty batch ([0, H] or [B, 0, H]) still routes (its rank must reach the dispatcher's collectives).
        routed = self.router(x2, seq_len=seq_len or 1, reference=cfg.backend == "reference",
                             **({"launch": launch} if launch is not None else {}))
        # Under autocast the copies move in the autocast dtype (half the bytes of fp32 activations).
        x_in = autocast_input(x2)
        if cfg.gather_experts and self._gathered_fit(x_in):
            self._took("gathered")
            out = self._forward_gathered(launch, x_in, routed)
        elif launch is not None and self._fused_experts_fit(launch, x_in):
            self._took("fused")
            out = self._forward_fused(launch, x_in, routed)
        elif self.dispatcher is not None:
            self._took("dispatched")
            out = self._forward_dispatched(launch, x_in, routed.weights, routed.indices, ops)
        elif getattr(cfg.recipe, "fused_permute", False) and (experts := self._plain_experts(x_in)) is not None:
            self._took("recipe")
            out = self._forward_recipe(launch, x_in, routed, experts, ops)
        else:
            self._took("ops")
            x_perm, row_map, group_sizes = ops.permute(x_in, routed.indices, cfg.num_experts, cfg.permute_align)
            row_weights = None
            if cfg.weights_in_activation:
                row_weights = permuted_row_values(routed.weights, row_map, x_perm.shape[0])
            y = self.experts(x_perm, group_sizes, row_weights, mm=ops.grouped_mm, act=getattr(ops, cfg.activation))
            out = ops.unpermute(y, row_map, None if cfg.weights_in_activation else routed.weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2, kernels=cfg.backend == "kernels", launch=launch)
        return out.view(shape), routed.aux_loss

    def _forward_recipe(self, launch: fused.Launch | None, x_in: Tensor, routed, experts: GroupedExperts,
                        ops) -> Tensor:
        """The routed experts on the recipe's fused permute. The FP8 recipe with the routing weights in the unpermute
        is the `moe_fp8` region: eagerly, where it fits, one autograd node (moe_kernels.nn.fused_fp8), else the
        recipe's functions."""
        cfg = self.config
        gated = cfg.activation == "swiglu"
        # The recipe fuses the permute with its first GEMM's input quantization.
        fused_act = hasattr(cfg.recipe, "swiglu_grouped_mm")
        if fused_act and not cfg.weights_in_activation:
            fit = launch is not None and fused_fp8.fits(launch, cfg.recipe, x_in, routed.indices, experts.w13,
                                                        experts.w2, cfg.num_experts, cfg.permute_align)
            if fit:
                self._took("fused_fp8")
            return fused.run("moe_fp8", launch if fit else None, x_in, routed.indices, routed.weights, experts.w13,
                             experts.w2, cfg.num_experts, cfg.permute_align, cfg.recipe,
                             fused_fp8.SWIGLU if gated else fused_fp8.SQUARED_RELU)
        # With the fused activation as h's only consumer, h's gradient travels in FP8 (swiglu_next,
        # squared_relu_next).
        h, row_map, group_sizes = cfg.recipe.permute_grouped_mm(
            x_in, routed.indices, cfg.num_experts, cfg.permute_align, experts.w13,
            swiglu_next=fused_act and gated, squared_relu_next=fused_act and not gated,
        )
        row_weights = None
        if cfg.weights_in_activation:
            row_weights = permuted_row_values(routed.weights, row_map, h.shape[0])
        weights = None if cfg.weights_in_activation else routed.weights
        if fused_act:
            # The activation writes the second GEMM's FP8 input itself (both layouts in one pass); in the
            # backward the unpermute writes that GEMM's output gradient in FP8 (both layouts in the gather).
            if gated:
                y = cfg.recipe.swiglu_grouped_mm(h, row_weights, experts.w2, group_sizes, unpermute_next=True)
            else:
                y = cfg.recipe.squared_relu_grouped_mm(h, experts.w2, group_sizes, unpermute_next=True)
            out = cfg.recipe.unpermute(y, row_map, weights)
        else:
            y = experts.forward_from_gate_up(h, group_sizes, row_weights, mm=ops.grouped_mm,
                                             act=getattr(ops, cfg.activation))
            out = ops.unpermute(y, row_map, weights)
        return out

    def _took(self, path: str) -> None:
        """Records the expert path of this forward; nn.Module's attribute setter runs only when it changes."""
        if self.expert_path != path:
            self.expert_path = path

    def _adapted(self) -> bool:
        """Adapters may apply to the experts: an adapter wrapper holds them with its adapters on (peft's, whose
        forward hands the experts their LoRA terms: moe_kernels.integrations.peft; not while disabled, nor while
        merged into the weights, but disabled after merging its forward unmerges first), or terms are set."""
        module = self.experts
        while (base := wrapped_module(module)) is not None:
            if getattr(module, "disable_adapters", False) == getattr(module, "merged", False):
                return True
            module = base
        return bool(lora_terms(module, "w13") or lora_terms(module, "w2"))

    def _plain_experts(self, x: Tensor) -> GroupedExperts | None:
        """The experts module whose weights the fast paths (the fused regions, the gathered experts, the recipe's
        fused permute) read in place of calling it, or None where calling it does more: adapters on (`_adapted`),
        hooks on it or global ones (accelerate's offloading, which also replaces `forward`, pruning, FSDP2's
        unsharding), another module in its place (a subclass), or weights not on x's device (offloaded to meta)."""
        if _nn_hooks():
            return None
        module = self.experts
        while True:  # the experts and any adapter wrappers around them
            if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
                return None
            base = wrapped_module(module)
            if base is None:
                break
            if getattr(module, "disable_adapters", False) == getattr(module, "merged", False):
                return None  # its adapters on (or merged, then disabled: its forward unmerges first)
            module = base
        if (type(module) is not GroupedExperts or lora_terms(module, "w13") or lora_terms(module, "w2")
                or module.w13.device != x.device or module.w2.device != x.device):
            return None
        return module

    def _launch(self, x: Tensor) -> fused.Launch | None:
        """The fused regions' launch for this call (moe_kernels.nn.fused), or None for the registered ops."""
        return fused.launch_for(x)

    def _fused_experts_fit(self, launch: fused.Launch, x: Tensor) -> bool:
        """The fused regions cover the plain local layer: no dispatcher, no precision recipe, no adapters,
        plain tensors (not DTensor shards) in a dtype the kernels take (the weights' after autocast)."""
        if self.dispatcher is not None:
            return False
        experts = self._fused_experts(launch, x)
        return experts is not None and experts.num_experts <= launch.C.permute_max_experts

    def _fused_experts(self, launch: fused.Launch, x: Tensor) -> GroupedExperts | None:
        """The experts whose weights the `experts` region reads for rows x (the permuted tokens, or on the
        expert-parallel path the dispatched rows), or None for the registered ops: no precision recipe, no
        adapters or hooks (`_plain_experts`), x and the weights plain contiguous tensors in a dtype the kernels
        take (the weights' after autocast), no more local experts than the grouped GEMM's groups."""
        if self.config.recipe is not None or x.dtype not in _FUSED_DTYPES:
            return None
        experts = self._plain_experts(x)
        if experts is None:
            return None
        w13, w2 = experts.w13, experts.w2
        if not (x.is_contiguous() and type(w13) in _PLAIN and type(w2) in _PLAIN and w13.is_contiguous()
                and w2.is_contiguous() and experts.num_experts <= launch.C.grouped_mm_max_groups):
            return None
        autocast = _autocast_dtype(x)
        if _gemm_dtype(w13, autocast) != x.dtype or _gemm_dtype(w2, autocast) != x.dtype:
            return None
        return experts

    def _forward_fused(self, launch: fused.Launch, x: Tensor, routed) -> Tensor:
        cfg = self.config
        experts = unwrapped(self.experts)
        w13, w2 = autocast_input(experts.w13), autocast_input(experts.w2)
        squared = cfg.activation == "squared_relu"
        if fused.experts_fit(x):
            # One node for the routed experts, tokens in, tokens out (the routing weights in the unpermute, or in the
            # activation).
            region = ("moe_weights_in_activation" if cfg.weights_in_activation else "moe_squared_relu" if squared
                      else "moe")
            return fused.run(region, launch, x, routed.indices, routed.weights, w13, w2, cfg.num_experts,
                             cfg.permute_align)
        x_perm, row_map, group_sizes = fused.run("permute", launch, x, routed.indices, cfg.num_experts,
                                                 cfg.permute_align)
        row_weights = None
        if cfg.weights_in_activation:
            row_weights = permuted_row_values(routed.weights, row_map, x_perm.shape[0])
        if squared:  # (no row weights: the squared ReLU's routing weights apply in the unpermute)
            y = fused.run("experts_squared_relu", launch, x_perm, group_sizes, w13, w2)
        else:
            y = fused.run("experts", launch, x_perm, group_sizes, w13, w2, row_weights)
        return fused.run("unpermute", launch, y, row_map, None if cfg.weights_in_activation else routed.weights)

    def _gathered_fit(self, x: Tensor) -> bool:
        """The gather-fused experts take the plain local layer (no dispatcher, no adapters, plain weights in x's
        dtype after autocast); elsewhere the layer keeps its other paths."""
        experts = None if self.dispatcher is not None else self._plain_experts(x)
        if experts is None:
            return False
        w13, w2 = experts.w13, experts.w2
        autocast = _autocast_dtype(x)
        return (type(w13) in _PLAIN and type(w2) in _PLAIN and _gemm_dtype(w13, autocast) == x.dtype
                and _gemm_dtype(w2, autocast) == x.dtype)

    def _forward_gathered(self, launch: fused.Launch | None, x: Tensor, routed) -> Tensor:
        cfg = self.config
        E, align = cfg.num_experts, cfg.permute_align
        R = permuted_rows(x.shape[0], routed.indices.shape[1], E, align)
        experts = unwrapped(self.experts)
        w13, w2 = autocast_input(experts.w13), autocast_input(experts.w2)
        if cfg.backend == "reference":
            _, row_map, group_sizes = permute_reference(x[:, :0], routed.indices, E, align)
            row_weights = permuted_row_values(routed.weights, row_map, R)
            return expert_mlp_reference(x, row_map, group_sizes, w13, w2, row_weights, R)
        x = x.contiguous()
        if launch is not None and not self._fused_experts_fit(launch, x):
            launch = None  # the registered ops
        # The routing alone (row_map, group_sizes): a permute of zero-width rows copies nothing.
        _, row_map, group_sizes = fused.run("permute", launch, x[:, :0], routed.indices, E, align)
        row_weights = permuted_row_values(routed.weights, row_map, R)
        return fused.run("expert_mlp", launch, x, row_map, group_sizes, w13, w2, row_weights, R)

    def _forward_dispatched(self, launch: fused.Launch | None, x: Tensor, weights: Tensor, indices: Tensor,
                            ops) -> Tensor:
        cfg = self.config
        d = self.dispatcher.dispatch(x, weights, indices, align=cfg.permute_align)  # rows for the local experts
        row_weights = d.weights if cfg.weights_in_activation else None
        experts = self._plain_experts(x) if hasattr(cfg.recipe, "swiglu_grouped_mm") else None
        if experts is not None:
            # FP8: the activation writes the second GEMM's E4M3 input, and backward the first GEMM's output gradient
            # (both layouts each), as on the one-rank recipe path; the dispatched rows and the gradient the combine
            # hands back are quantized in both layouts by one pass each (the recipe's grouped_mm).
            gated = experts.gated
            h = cfg.recipe.grouped_mm(d.x, experts.w13, d.group_sizes, swiglu_next=gated, squared_relu_next=not gated)
            if gated:
                y = cfg.recipe.swiglu_grouped_mm(h, row_weights, experts.w2, d.group_sizes)
            else:
                y = cfg.recipe.squared_relu_grouped_mm(h, experts.w2, d.group_sizes)
        elif launch is not None and (experts := self._fused_experts(launch, d.x)) is not None:
            # The `experts` region on the dispatched rows (rows past the groups are unspecified here as on the
            # registered ops; the combine reads none of them): one extension call each way, the activation
            # written again in the backward rather than kept.
            w13, w2 = autocast_input(experts.w13), autocast_input(experts.w2)
            if cfg.activation == "squared_relu":
                y = fused.run("experts_squared_relu", launch, d.x, d.group_sizes, w13, w2)
            else:
                y = fused.run("experts", launch, d.x, d.group_sizes, w13, w2, row_weights)
        else:
            y = self.experts(d.x, d.group_sizes, row_weights, mm=ops.grouped_mm, act=getattr(ops, cfg.activation))
        return self.dispatcher.combine(y, d.handle, weighted=not cfg.weights_in_activation)

    def _forward_torch_native(self, x: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        router = self.router
        logits = torch_native.router_logits(x2, router.weight)
        weights, indices = torch_native.route(logits, router.config, router.expert_bias)
        experts = unwrapped(self.experts)
        out = torch_native.experts(x2, weights, indices, experts.w13, experts.w2, activation=self.config.activation)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        aux = torch_native.aux_losses(logits, router.config, seq_len)
        return out.view(shape), aux


# ---------------------------------------------------------------------------------------------------
# Presets: the five routing styles of specs/perf.md (real per-layer sizes; pass **overrides to shrink)


def _preset(router: dict, layer: dict, overrides: dict) -> MoEConfig:
    """Overrides name RouterConfig or MoEConfig fields, e.g. hidden_size=64, num_experts=8, ffn_size=32."""
    router_keys = {f.name for f in dataclasses.fields(RouterConfig)}
    router = {**router, **{k: v for k, v in overrides.items() if k in router_keys}}
    layer = {**layer, **{k: v for k, v in overrides.items() if k not in router_keys}}
    return MoEConfig(router=RouterConfig(**router), **layer)


def deepseek_v3(**overrides) -> MoEConfig:
    """Sigmoid scores + aux-loss-free expert bias, 8 groups / top-4 groups, scale 2.5, 1 shared expert."""
    router = dict(hidden_size=7168, num_experts=256, k=8, score="sigmoid", num_groups=8, group_topk=4,
                  scaling_factor=2.5, expert_bias=True, seq_aux_loss_coeff=1e-4)
    return _preset(router, dict(ffn_size=2048, shared_ffn_size=2048), overrides)


def qwen3_235b(**overrides) -> MoEConfig:
    """Softmax over all experts, top-8 renormalised (selection by logits), global aux loss."""
    router = dict(hidden_size=4096, num_experts=128, k=8, score="softmax", aux_loss_coeff=1e-3)
    return _preset(router, dict(ffn_size=1536), overrides)


def qwen3_30b_a3b(**overrides) -> MoEConfig:
    router = dict(hidden_size=2048, num_experts=128, k=8, score="softmax", aux_loss_coeff=1e-3)
    return _preset(router, dict(ffn_size=768), overrides)


def mixtral_8x7b(**overrides) -> MoEConfig:
    """Softmax over the top-2 logits."""
    router = dict(hidden_size=4096, num_experts=8, k=2, score="softmax", aux_loss_coeff=1e-2)
    return _preset(router, dict(ffn_size=14336), overrides)


def gpt_oss_120b(**overrides) -> MoEConfig:
    """Softmax over the top-4 logits."""
    router = dict(hidden_size=2880, num_experts=128, k=4, score="softmax", aux_loss_coeff=1e-3)
    return _preset(router, dict(ffn_size=2880), overrides)


PRESETS = {
    "deepseek-v3": deepseek_v3,
    "qwen3-235b": qwen3_235b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "mixtral-8x7b": mixtral_8x7b,
    "gpt-oss-120b": gpt_oss_120b,
}
