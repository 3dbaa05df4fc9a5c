"""The peers of bench_moe_layer, over our layer's very parameter tensors: torch_native
(MoELayer(backend="torch")), the Hugging Face block of the model's family with its experts run by the
per-expert loop or grouped_mm, and Liger's fused MoE experts inside torch_native's router and shared
experts. What each computes and how its weights are set: bench_moe_layer's docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_kernels.nn import MoEConfig, MoELayer, torch_native

PEERS = ("torch_native", "hf_eager", "hf_grouped_mm", "liger")  # what build_peers builds, where it can


@dataclass(frozen=True)
class Spec:
    """A model case: the preset it runs and the Hugging Face family of its peers."""

    preset: str  # moe_kernels.nn.PRESETS key; also the perf.md shape the case stands for
    hf: str | None  # transformers family: "qwen3_moe", "deepseek_v3", "mixtral"; None: no peer
    overrides: tuple[tuple[str, object], ...] = ()  # preset overrides (the tiny CPU shapes)
    ep: int = 1  # perf.md's expert parallelism: E // ep is the floor when memory forces fewer experts
    why_no_hf: str = ""


@dataclass
class Impl:
    """One implementation of the layer, ours or a peer, as timed and checked."""

    name: str
    module: nn.Module
    variant: str
    router_weight: nn.Parameter  # the parameter its router multiplies by
    route: Callable[[Tensor], Tensor] | None  # x [T, H] -> indices [T, k]; None for ours
    fp32_router: bool = True

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        out = self.module(x)
        return out if isinstance(out, tuple) else (out, None)

    def params(self) -> list[Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]


def ours_impl(layer: MoELayer) -> Impl:
    return Impl("ours", layer, "MoELayer(backend=\"kernels\")", layer.router.weight, None)


def reason(e: BaseException) -> str:
    """The exception's type and first line, as `peer_skipped` and the failures record it."""
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:300]


def build_torch_native(layer: MoELayer) -> Impl:
    peer = MoELayer(layer.config.replace(backend="torch"), device="meta")
    # keep_vars + assign: the peer holds our very parameter and buffer tensors
    peer.load_state_dict(layer.state_dict(keep_vars=True), assign=True)
    _assert_no_meta(peer)
    if not all(a is b for a, b in zip(peer.parameters(), layer.parameters(), strict=True)):
        raise RuntimeError("bench setup: torch_native does not hold our parameters")
    cfg, router = layer.config.router, peer.router

    def route(x2):
        logits = torch_native.router_logits(x2, router.weight)  # as MoELayer(backend="torch") does
        return torch_native.route(logits, cfg, router.expert_bias)[1]

    return Impl("torch_native", peer.train(), 'MoELayer(backend="torch"): topk routing, argsort dispatch, '
                "torch._grouped_mm, index_add_", router.weight, route)


class LigerMoE(nn.Module):
    """torch_native's layer with its experts step replaced by Liger's fused MoE (bench_moe_layer's
    docstring). Holds our router, experts and shared experts modules, so its parameters are ours."""

    def __init__(self, layer: MoELayer, fused_moe: Callable):
        super().__init__()
        self.config = layer.config
        self.router, self.experts, self.shared_experts = layer.router, layer.experts, layer.shared_experts
        self.fused_moe = fused_moe  # (x [T, H], w13 [E, 2F, H], w2 [E, H, F], indices int32, weights) -> [T, H]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        shape, cfg = x.shape, self.config.router
        x2 = x.reshape(-1, shape[-1])  # [T, H]
        logits = torch_native.router_logits(x2, self.router.weight)  # [T, E] fp32
        weights, indices = torch_native.route(logits, cfg, self.router.expert_bias)  # [T, k] fp32, int64
        out = self.fused_moe(x2, self.experts.w13, self.experts.w2, indices.to(torch.int32), weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        return out.view(shape), torch_native.aux_losses(logits, cfg, shape[-2])


def liger_fused_moe() -> tuple[Callable, str]:
    """(Liger's fused MoE autograd function's apply, its version); ImportError where it is not installed
    or has no fused MoE."""
    import importlib.metadata

    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return LigerFusedMoEFunction.apply, version


def _as_runtime_error(fn: Callable, who: str) -> Callable:
    """fn, its exceptions other than AssertionError raised as RuntimeError: a Triton compile error (say, a
    Triton this Liger does not support) leaves the peer out with its reason instead of ending the run."""
    def call(*args):
        try:
            return fn(*args)
        except (AssertionError, RuntimeError):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised as the type run_case records
            raise RuntimeError(f"{who} raised {reason(e)}") from e

    return call


def build_liger(layer: MoELayer) -> Impl:
    """LigerMoE over our layer (bench_moe_layer's docstring); raises where Liger cannot run here."""
    try:
        fused_moe, version = liger_fused_moe()
    except ImportError as e:
        raise ImportError(f"liger_kernel's fused MoE not importable ({e})") from e
    if layer.experts.w13.device.type != "cuda":
        raise RuntimeError(f"Liger's fused MoE runs Triton kernels on a GPU; this run is on "
                           f"{layer.experts.w13.device.type}")
    peer = LigerMoE(layer, _as_runtime_error(fused_moe, "Liger's fused MoE"))
    cfg, router = layer.config.router, layer.router

    def route(x2):
        return torch_native.route(torch_native.router_logits(x2, router.weight), cfg, router.expert_bias)[1]

    return Impl("liger", peer.train(), f"liger-kernel {version} LigerFusedMoEFunction (Triton, {liger_tuning()}): "
                "torch_native's fp32 topk routing and shared experts", router.weight, route)


def liger_tuning() -> str:
    """Whether Liger's fused MoE autotunes its Triton kernels in this process (liger-kernel reads
    LIGER_FUSED_MOE_AUTOTUNE when it is imported; "0" pins one config per kernel)."""
    try:
        from liger_kernel.ops import fused_moe_kernels
    except ImportError:
        return "autotune unknown"
    off = getattr(fused_moe_kernels, "_AUTOTUNE_DISABLED", None)
    return "autotune unknown" if off is None else ("autotune off: one config per kernel" if off else "autotuned")


def _assert_no_meta(peer: nn.Module) -> None:
    for name, t in [*peer.named_parameters(), *peer.named_buffers()]:
        if t.is_meta:
            raise RuntimeError(f"bench setup: the peer's {name} was left on the meta device")


def hf_semantics(cfg: MoEConfig, family: str) -> dict:
    """transformers config kwargs computing the same routing as `cfg`; ValueError where none does."""
    r = cfg.router
    kw = dict(hidden_size=r.hidden_size, num_experts_per_tok=r.k, hidden_act="silu")
    plain_softmax = (r.score == "softmax" and r.num_groups is None and not r.expert_bias
                     and r.scaling_factor is None and not cfg.shared_ffn_size)
    if family == "qwen3_moe":
        if not plain_softmax:
            raise ValueError("Qwen3-MoE routes by plain softmax top-k, without shared experts")
        return dict(kw, num_experts=r.num_experts, moe_intermediate_size=cfg.ffn_size,
                    norm_topk_prob=not r.pre_softmax or bool(r.normalize))
    if family == "mixtral":
        if not plain_softmax or r.pre_softmax:
            raise ValueError("Mixtral renormalises the softmax over the top-k, without shared experts")
        return dict(kw, num_local_experts=r.num_experts, intermediate_size=cfg.ffn_size, router_jitter_noise=0.0)
    if family == "deepseek_v3":
        G, g = r.num_groups or 1, r.group_topk or 1
        gst = r.group_score_topk if r.group_score_topk is not None else max(1, r.k // g)
        if r.score != "sigmoid" or not r.expert_bias or (G > 1 and gst != min(2, r.num_experts // G)):
            raise ValueError("DeepSeek-V3 routes by sigmoid + expert bias, a group scored by its top 2")
        if not cfg.shared_ffn_size or cfg.shared_ffn_size % cfg.ffn_size or cfg.shared_gate:
            raise ValueError("DeepSeek-V3's shared experts are n_shared_experts x moe_intermediate_size, ungated")
        return dict(kw, n_routed_experts=r.num_experts, moe_intermediate_size=cfg.ffn_size,
                    n_shared_experts=cfg.shared_ffn_size // cfg.ffn_size, n_group=G, topk_group=g,
                    routed_scaling_factor=r.scaling_factor or 1.0,
                    norm_topk_prob=r.normalize if r.normalize is not None else r.k > 1)
    raise ValueError(f"no transformers family {family!r}")


_HF_CLASSES = {  # family -> (config class, module, block class)
    "qwen3_moe": ("Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "deepseek_v3": ("DeepseekV3Config", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
    "mixtral": ("MixtralConfig", "transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
}


def build_hf(layer: MoELayer, family: str, implementation: str, bf16_router: nn.Parameter | None) -> Impl:
    """The transformers block over our weights (bench_moe_layer's docstring), its experts run by
    `implementation`."""
    import importlib

    import transformers

    cfg = layer.config
    kw = hf_semantics(cfg, family)
    config_cls, module, block_cls = _HF_CLASSES[family]
    hf_config = getattr(transformers, config_cls)(**kw, experts_implementation=implementation)
    with torch.device("meta"):
        block = getattr(importlib.import_module(module), block_cls)(hf_config)
    experts = block.experts
    if experts.config._experts_implementation != implementation:
        raise RuntimeError(f"transformers did not take experts_implementation={implementation!r}")
    for hf_w, ours_w in ((experts.gate_up_proj, layer.experts.w13), (experts.down_proj, layer.experts.w2),
                         (block.gate.weight, layer.router.weight)):
        if hf_w.shape != ours_w.shape:
            raise RuntimeError(f"bench setup: the {block_cls} built from {kw} holds {tuple(hf_w.shape)} "
                               f"where ours is {tuple(ours_w.shape)}")
    experts.gate_up_proj = layer.experts.w13  # [E, 2F, H], gate rows first: our layout
    experts.down_proj = layer.experts.w2  # [E, H, F]
    if family == "deepseek_v3":
        block.gate.weight = layer.router.weight  # fp32; transformers upcasts to fp32 anyway
        block.gate.e_score_correction_bias = layer.router.expert_bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.shared_experts, name, getattr(layer.shared_experts, name))
    else:
        block.gate.weight = bf16_router
    _assert_no_meta(block)
    gate = block.gate
    version = getattr(transformers, "__version__", "?")
    how = {"eager": "per-expert loop", "grouped_mm": hf_grouped_mm_path(layer)}.get(implementation, implementation)
    return Impl(f"hf_{implementation}", block.train(),
                f'transformers {version} {block_cls}, experts_implementation="{implementation}" ({how})',
                gate.weight, lambda x2: gate(x2)[2], fp32_router=family == "deepseek_v3")


def hf_grouped_mm_path(layer: MoELayer) -> str:
    """Which GEMM transformers' grouped_mm experts will call for these weights (its private dispatch)."""
    try:
        from transformers.integrations import moe as hf_moe

        w = layer.experts.w13.detach().transpose(-2, -1)
        x = w.new_zeros(8, w.shape[1])
        offs = torch.full((w.shape[0],), 8, dtype=torch.int32, device=w.device)
        if not hf_moe._can_use_grouped_mm(x, w, offs):
            return "transformers' per-expert fallback loop"
        return "torch.nn.functional.grouped_mm" if hasattr(F, "grouped_mm") else "torch._grouped_mm"
    except (ImportError, AttributeError, RuntimeError, TypeError) as e:
        return f"grouped_mm path unknown: {type(e).__name__}"


def build_peers(layer: MoELayer, spec: Spec) -> tuple[dict[str, Impl], dict[str, str]]:
    """(peer -> Impl, peer -> why it is left out)."""
    peers, skipped = {}, {}
    try:
        peers["torch_native"] = build_torch_native(layer)
    except (RuntimeError, ValueError, TypeError) as e:
        skipped["torch_native"] = reason(e)
    try:
        peers["liger"] = build_liger(layer)
    except (ImportError, RuntimeError, ValueError, TypeError) as e:
        skipped["liger"] = reason(e)
    hf_names = ("hf_eager", "hf_grouped_mm")
    if spec.hf is None:
        return peers, {**skipped, **{p: spec.why_no_hf for p in hf_names}}
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return peers, {**skipped, **{p: f"transformers not importable: {e}" for p in hf_names}}
    bf16_router = None
    if spec.hf != "deepseek_v3":
        bf16_router = nn.Parameter(layer.router.weight.detach().to(torch.bfloat16))
    for impl in ("eager", "grouped_mm"):
        try:
            peers[f"hf_{impl}"] = build_hf(layer, spec.hf, impl, bf16_router)
        except (ImportError, AttributeError, RuntimeError, ValueError, TypeError, KeyError) as e:
            skipped[f"hf_{impl}"] = reason(e)
    return peers, skipped
