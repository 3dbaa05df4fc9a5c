"""transformers' MoE blocks, as loaded and after `moe_kernels.patch_hf`: the drop-in's speed on real model
shapes.

Case: one sparse MoE block of a transformers 5.x family at a published model's shapes, built from its config
(weights random, std 0.02; the router's 2 / sqrt(H), logits of std 2 on the unit-variance input: routing decided
but not saturated; ERNIE's selection bias std 0.01, of the order of its probabilities), bf16 on a GPU (fp32 on
the CPU, tiny shapes); input [1, T, H], its gradient taken (as every layer's after the first). One op,
hf_block_fwd_bwd: the block's forward and backward (loss = mean of the squared output), every parameter's gradient.
  ours          the same block after patch_hf (router_topk where the router is patched, permute, our grouped
                GEMMs, swiglu (squared_relu for experts without a gate), unpermute; Llama 4's block forward over
                the routed rows only)
  transformers  the block as from_pretrained runs it by default: experts_implementation="grouped_mm" on a GPU
                (eager, a loop over the experts, on the CPU; named in the peer variant), or Llama 4's dense
                experts (every expert on every token: E / k times the routed FLOPs)
Models (GPU):
  qwen3-30b-a3b   Qwen3MoeSparseMoeBlock, H 2048, F 768, E 128, k 8, norm_topk_prob
  gpt-oss-120b    GptOssMLP, H 2880, F 2880, E 128, k 4 (biased experts, clamped SwiGLU)
  ernie-4.5-21b   Ernie4_5_MoeSparseMoeBlock, H 2560, F 1536, E 64, k 6, two shared experts
  llama4-scout    Llama4TextMoe, H 5120, F 8192, E 16, k 1, a shared expert of F 8192
  lfm2-8b-a1b     Lfm2MoeSparseMoeBlock, H 2048, F 1792, E 32, k 4 (sigmoid routing with an expert bias): transformers'
                  Lfm2MoeConfig defaults, whose docstring names LiquidAI/LFM2-8B-A1B
  trinity-mini    AfmoeSparseMoeBlock, H 2048, F 1408, E 64, k 6, two shared experts: AfmoeConfig's defaults, whose
                  docstring names arcee-ai/Trinity-Mini
  nemotron-3-nano NemotronHMoE, H 2688, F 1856, E 128, k 6, a shared expert of F 3712, experts without a gate
                  (squared ReLU), sigmoid routing with an expert bias, scaled 2.5: NVIDIA-Nemotron-3-Nano-30B-A3B
  dbrx            DbrxFFN, H 6144, F 10752, E 16, k 4: DBRX (databricks/dbrx-base); transformers' experts have no
                  experts interface: a loop over the experts hit (patched: our experts, transformers' router)
  jetmoe-8b       JetMoeMoE, H 2048, F 5632, E 8, k 2, a bias after the experts: JetMoeConfig's defaults, whose
                  docstring names jetmoe/jetmoe-8b; transformers reads the expert sizes on the host and runs each
                  expert's F.linear (patched: its router, permute, our grouped GEMMs, swiglu, unpermute)
FLOPs: the routed experts' forward and backward, 3 x 2 T k m H F, plus the shared experts' 3 x 2 T m H Fs, m the
weight matrices per expert (3 with a gate, 2 without; the work of the patched block; transformers' Llama 4 does
E / k times the routed part). Bytes: the expert weights read and their gradients written (bf16), x read and the
output written.
Checked first, on the first input set: the outputs of both, relative L2 error at most 4 x 2^-8 on the GPU (two
bf16 computations of one function that may round the activation differently: each rounding 2^-9 relative) and
1e-5 on the CPU (fp32); and the router weight's gradient within the same bound.
LoRA fine-tuning (cases <model>+lora, qwen3-30b-a3b and gpt-oss-120b): peft LoRA (r = 16, alpha = 32) on the
experts' gate_up_proj and down_proj, the base weights frozen, op hf_lora_fwd_bwd.
  ours          patch_hf on the peft model: the adapters as rank-r grouped products beside the frozen experts'
                (moe_kernels.integrations.peft; GPT-OSS's in the [E, K, N] layout), W + s B A never formed
  transformers  peft's ParamWrapper: W + s B A formed for every expert on each forward, then transformers' experts
FLOPs: the frozen routed experts' forward and input gradient, 2 x 2 T k 3 H F, plus the shared experts' (the
adapters' rank-r work is not counted: it is what the two sides do differently). Bytes: the frozen weights and the
adapters read, x read and the output written. Checked first: the outputs and the first adapter's B gradient, within
the bounds above.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

import moe_kernels

from . import harness as h

# name: (config class, module, block class, config kwargs, routed (H, F, E, k), shared F)
_TM = "transformers.models."
MODELS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", _TM + "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock",
                      dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           norm_topk_prob=True)),
    "gpt-oss-120b": ("GptOssConfig", _TM + "gpt_oss.modeling_gpt_oss", "GptOssMLP",
                     dict(hidden_size=2880, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4)),
    "ernie-4.5-21b": ("Ernie4_5_MoeConfig", _TM + "ernie4_5_moe.modeling_ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock",
                      dict(hidden_size=2560, moe_intermediate_size=1536, moe_num_experts=64, moe_k=6,
                           moe_num_shared_experts=2)),
    "llama4-scout": ("Llama4TextConfig", _TM + "llama4.modeling_llama4", "Llama4TextMoe",
                     dict(hidden_size=5120, intermediate_size=8192, num_local_experts=16, num_experts_per_tok=1)),
    "lfm2-8b-a1b": ("Lfm2MoeConfig", _TM + "lfm2_moe.modeling_lfm2_moe", "Lfm2MoeSparseMoeBlock",
                    dict(hidden_size=2048, moe_intermediate_size=1792, num_experts=32, num_experts_per_tok=4)),
    "trinity-mini": ("AfmoeConfig", _TM + "afmoe.modeling_afmoe", "AfmoeSparseMoeBlock",
                     dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=64, num_experts_per_tok=6,
                          num_shared_experts=2)),
    "nemotron-3-nano": ("NemotronHConfig", _TM + "nemotron_h.modeling_nemotron_h", "NemotronHMoE",
                        dict(hidden_size=2688, moe_intermediate_size=1856, n_routed_experts=128, num_experts_per_tok=6,
                             n_group=1, topk_group=1, moe_shared_expert_intermediate_size=3712,
                             routed_scaling_factor=2.5, norm_topk_prob=True)),
    "dbrx": ("DbrxConfig", _TM + "dbrx.modeling_dbrx", "DbrxFFN",
             dict(d_model=6144, ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4))),
    "jetmoe-8b": ("JetMoeConfig", _TM + "jetmoe.modeling_jetmoe", "JetMoeMoE",
                  dict(hidden_size=2048, intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2)),
}
TINY = {  # the CPU's shapes: the same families, every code path
    "qwen3-30b-a3b": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=True),
    "gpt-oss-120b": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "ernie-4.5-21b": dict(hidden_size=64, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                          moe_num_shared_experts=1),
    "llama4-scout": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=1),
    "lfm2-8b-a1b": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "trinity-mini": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         num_shared_experts=1),
    "nemotron-3-nano": dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                            n_group=1, topk_group=1, moe_shared_expert_intermediate_size=64,
                            routed_scaling_factor=2.5, norm_topk_prob=True),
    "dbrx": dict(d_model=64, ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2)),
    "jetmoe-8b": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
}
TOKENS = (4096, 8192)
CPU_TOKENS = 64
LORA_MODELS = ("qwen3-30b-a3b", "gpt-oss-120b")  # cases "<model>+lora"
RANK = 16
_LORA = "+lora"


Case = h.ModelCase


def cases(ctx: h.Context) -> list[Case]:
    if not ctx.is_cuda:
        return [Case(m, CPU_TOKENS) for m in (*TINY, *(m + _LORA for m in LORA_MODELS))]
    models, tokens = ctx.pick(MODELS, (4096,) if ctx.quick else TOKENS)
    return [Case(m, T) for m in (*models, *(m + _LORA for m in LORA_MODELS if m in models)) for T in tokens]


def _block(ctx: h.Context, model: str, dtype: torch.dtype) -> nn.Module:
    import transformers

    config_cls, module, block_cls, kw = MODELS[model]
    kw = kw if ctx.is_cuda else TINY[model]
    # from_pretrained's default experts implementation: "grouped_mm" where torch dispatches it (a GPU)
    impl = {"experts_implementation": "grouped_mm"} if ctx.is_cuda else {}
    config = getattr(transformers, config_cls)(**kw, **impl)
    with torch.device("meta"):
        block = getattr(importlib.import_module(module), block_cls)(config).to(dtype)  # (DbrxFFN: from ffn_config)
        if model == "ernie-4.5-21b":
            block.gate.float()  # ERNIE keeps its router in fp32 (_keep_in_fp32_modules_strict)
    block = block.to_empty(device=ctx.device)
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    H = _dims(kw)[0]
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("e_score_correction_bias"):  # selection bias: reorders some picks
                std = 0.01
            elif name.endswith("_bias"):
                std = 0.0
            else:  # router logits of std 2 on unit inputs: decided, not saturated
                routers = ("gate.weight", "router.weight", "router.gate.weight", "router.layer.weight")
                std = 2 / H**0.5 if name in routers else 0.02
            p.copy_(torch.randn(p.shape, generator=g, device=ctx.device, dtype=torch.float32) * std)
        for name, b in block.named_buffers():
            b.zero_()
    return block.train()


def _dims(kw: dict) -> tuple[int, int, int, int]:
    """(H, F, E, k) from a case's config kwargs (DBRX's: d_model and its ffn_config)."""
    ffn = kw.get("ffn_config", {})
    H = kw.get("hidden_size", kw.get("d_model"))
    F = kw.get("moe_intermediate_size", kw.get("intermediate_size", ffn.get("ffn_hidden_size")))
    E = kw.get("num_experts", kw.get("num_local_experts", kw.get("moe_num_experts", kw.get(
        "n_routed_experts", ffn.get("moe_num_experts")))))
    k = kw.get("num_experts_per_tok", kw.get("moe_k", ffn.get("moe_top_k")))
    return H, F, E, k


def _peer_variant(block: nn.Module) -> str:
    import transformers

    from moe_kernels.integrations.hf.common import _experts_of

    lora = hasattr(block, "get_base_model")  # a peft model
    block = block.get_base_model() if lora else block
    experts = _experts_of(block)
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if type(experts).__name__ == "DbrxExperts":
        how = "its experts' loop over the experts hit"
    elif experts is None and hasattr(block, "input_linear"):  # JetMoE's block holds its experts' projections
        how = "a loop over every expert (F.linear each), the expert sizes read on the host"
    elif experts is not None and not hasattr(type(experts).forward, "__wrapped__"):
        how = "dense experts (every expert on every token)"
    else:
        how = f'experts_implementation="{impl or "eager"}"'
    if lora:
        import peft

        how += f", peft {peft.__version__} LoRA (W + s B A formed)"
    return f"transformers {transformers.__version__} {type(block).__name__}, {how}"


def _step(block: nn.Module):
    def run(x):
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        return out
    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _router_weight(block: nn.Module) -> torch.Tensor:
    from moe_kernels.integrations.hf.common import _gate_weight, _router_of

    return _gate_weight(_router_of(block))


def _lora_b(model: nn.Module) -> torch.Tensor:
    return next(p for n, p in model.named_parameters() if "lora_B" in n)


def _check(ctx: h.Context, c: Case, ours: nn.Module, theirs: nn.Module, x: torch.Tensor) -> None:
    bound = 4 * 2.0**-8 if ctx.is_cuda else 1e-5
    lora = c.model.endswith(_LORA)
    outs = []
    for block in (ours, theirs):
        block.zero_grad(set_to_none=True)
        out = _step(block)(x)
        outs.append((out.detach(), (_lora_b(block) if lora else _router_weight(block)).grad.clone()))
    grad = "adapter B gradient" if lora else "router weight gradient"
    for what, a, b in (("output", outs[0][0], outs[1][0]), (grad, outs[0][1], outs[1][1])):
        err = _rel(a, b)
        if not err <= bound:
            raise AssertionError(f"{c.name} hf block: {what} relative L2 error {err:.3g} > {bound:.3g} against "
                                 "transformers")


def _lora(block: nn.Module) -> nn.Module:
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=[], init_lora_weights=False,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    return peft.get_peft_model(block, config)


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    lora = c.model.endswith(_LORA)
    model = c.model.removesuffix(_LORA)
    theirs = _block(ctx, model, dtype)
    if lora:
        theirs = _lora(theirs)
    ours = moe_kernels.patch_hf(copy.deepcopy(theirs))
    if not moe_kernels.integrations.hf.is_patched(ours):
        raise AssertionError(f"{c.name}: patch_hf left the block on transformers' code")
    fused = sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in ours.modules())
    if lora and fused != 2:
        raise AssertionError(f"{c.name}: {fused} of the 2 adapters fused")
    kw = MODELS[model][3] if ctx.is_cuda else TINY[model]
    H, F, E, k = _dims(kw)
    shared = kw.get("moe_num_shared_experts", 0) + kw.get("num_shared_experts", 0)  # experts of F each
    Fs = F * shared + (F if model == "llama4-scout" else 0) + kw.get("moe_shared_expert_intermediate_size", 0)
    from moe_kernels.integrations.hf.common import _experts_of

    m = 3 if getattr(_experts_of(theirs.get_base_model() if lora else theirs), "has_gate", True) else 2
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    # the input's gradient taken, as every layer's after the first: each GEMM's input gradient runs (the FLOPs)
    sets = [(torch.randn(1, c.T, H, generator=g, device=ctx.device, dtype=dtype).requires_grad_(),)
            for _ in range(ctx.n_input_sets)]
    _check(ctx, c, ours, theirs, sets[0][0])
    t_ours, t_theirs = ctx.time_ab(_step(ours), sets, _step(theirs), sets)
    es = torch.finfo(dtype).bits // 8
    products = 2 if lora else 3  # frozen base weights: forward and input gradient, no weight gradient
    flops = products * 2 * c.T * m * H * (k * F + Fs)
    # weights read (their gradients written; with LoRA the adapters read instead, E r (3 H + 3 F))
    nbytes = es * ((1 if lora else 2) * m * H * (E * F + Fs) + 2 * c.T * H
                   + (E * RANK * (3 * H + 3 * F) if lora else 0))
    op = "hf_lora_fwd_bwd" if lora else "hf_block_fwd_bwd"
    shape = dict(T=c.T, H=H, F=F, E=E, k=k, Fs=Fs, **({"m": m} if m != 3 else {}))  # m: without a gate only
    return [h.make_result(ctx, op=op, case=c.name, shape=shape, dtype=dtype, timing=t_ours, nbytes=nbytes,
                          flops=flops, peers={"transformers": t_theirs},
                          peer_variant={"transformers": _peer_variant(theirs)})]


def headline(results: list[h.Result]) -> list[str]:
    return [f"{r.op} {r.case}: {r.speedup['transformers']:.2f}x transformers "
            f"({r.peer_variant['transformers']})" for r in results]


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "hf_blocks", cases(ctx), run_case)
    return h.Report(results, headline(results) if results else [], failures, skipped)
