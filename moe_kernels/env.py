"""Environment report: `python -m moe_kernels`."""

from __future__ import annotations

import importlib
import platform

import torch

from moe_kernels import __version__, _ext

# Public op -> the extension functions its CUDA path needs.
CUDA_OPS = {
    "permute": ("permute_fwd",),
    "unpermute": ("unpermute_fwd", "unpermute_bwd"),
    "tokens_per_expert": ("tokens_per_expert",),
    "router_topk": ("router_topk_fwd", "router_topk_bwd"),
    "router_aux_scores": ("router_aux_scores_fwd", "router_aux_scores_bwd"),
    "aux_loss": ("balance_loss_fwd", "balance_loss_bwd"),
    "seq_aux_loss": ("balance_loss_fwd", "balance_loss_bwd"),
    "z_loss": ("z_loss_fwd", "z_loss_bwd"),
    "apply_capacity": ("apply_capacity",),
    "update_expert_bias": ("update_expert_bias",),
    "grouped_mm": ("grouped_mm",),
    "grouped_mm_fp8": ("grouped_mm",),
    "swiglu": ("swiglu_fwd", "swiglu_bwd"),
    "squared_relu": ("squared_relu_fwd", "squared_relu_bwd"),
    "expert_mlp": ("expert_mlp_fwd", "expert_mlp_bwd"),
    "quantize_fp8": ("fp8_quantize",),
    "dequantize_fp8": ("fp8_dequantize",),
    "quantize_nvfp4": ("nvfp4_quantize",),
    "dequantize_nvfp4": ("nvfp4_dequantize",),
}

_version_str = _ext.version_str
GATHER_OPT_IN = "MOE_KERNELS_GATHER_CUTLASS"


def collect() -> dict:
    info: dict = {
        "moe_kernels": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "extension_built": _ext.has_cuda_kernels(),
    }
    C = _ext._C
    archs: list[str] = []
    if C is not None:
        archs = _ext.built_archs()
        info["extension_archs"] = [_ext.describe_arch(a) for a in archs]
        info["extension_cuda_runtime"] = _version_str(C.cuda_runtime_version())
        info["cuda_driver"] = _version_str(C.cuda_driver_version())
        if getattr(C, "grouped_mm_has_sm90", False) and hasattr(C, "grouped_mm_sm90_table"):
            rows = C.grouped_mm_sm90_table()
            info["grouped_mm_sm90_table"] = (f"{len(C.grouped_mm_sm90_kernels())} instances; tuning table of "
                                             f"{len(rows)} problems, {sum(r['tuned'] for r in rows)} tuned on a GPU "
                                             "(the rest: the rule)")
        if getattr(C, "grouped_mm_has_sm100", False):
            from moe_kernels.ops.grouped_mm import SM100_OPT_IN, sm100_opted_in

            nvfp4 = "; NVFP4 block-scaled fwd" if hasattr(C, "grouped_mm_nvfp4_blocked_scales") else ""
            info["grouped_mm_sm100"] = ("bf16 fwd, dgrad, wgrad; FP8 blockwise fwd, wgrad" + nvfp4 +
                                        " for sm_100f (B200, B300), "
                                        + ("on" if sm100_opted_in() else f"off (opt-in: {SM100_OPT_IN}=1)")
                                        + "; not yet run on a Blackwell GPU by this project")
        if hasattr(C, "expert_mlp_fwd"):  # MoELayer.expert_path says which path a layer's last forward took
            enabled = getattr(C, "grouped_mm_gather_enabled", None)
            gather = ("on" if enabled() else f"off (opt-in: {GATHER_OPT_IN}=1)") \
                if enabled is not None and getattr(C, "grouped_mm_has_sm90", False) else "not in this build"
            from moe_kernels.ops.grouped_mm import PORTABLE_MMA_OPT_IN, portable_mma_opted_in

            cores = "on" if portable_mma_opted_in() else f"off (opt-in: {PORTABLE_MMA_OPT_IN}=1)"
            info["expert_mlp"] = ("opt-in: MoEConfig(gather_experts=True); its gathered products on sm_90a's cp.async "
                                  f"gather kernels {gather}, not yet run on a GPU; elsewhere the portable grouped GEMM "
                                  f"(bf16 and fp16 on tensor cores from sm_80 on: {cores}; not yet run on a GPU)")
    else:
        info["extension_error"] = _ext.import_error()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            gpus.append(
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "compute_capability": f"{cc[0]}.{cc[1]}",
                    "kernels_run_here": C is not None and _ext.arch_runs_on(archs, cc),
                }
            )
    info["gpus"] = gpus
    # Expert/data parallelism (moe_kernels.dispatch, moe-train under torchrun) runs on these backends.
    dist_ok = torch.distributed.is_available()
    info["distributed_backends"] = [
        name for name, ok in (("nccl", dist_ok and torch.distributed.is_nccl_available()),
                              ("gloo", dist_ok and torch.distributed.is_gloo_available())) if ok
    ]
    driver_problem = _ext.driver_problem() if C is not None else None
    if driver_problem:
        for g in gpus:
            g["kernels_run_here"] = False
    on_gpu = bool(gpus) and gpus[0]["kernels_run_here"]
    info["ops"] = {
        op: ("CUDA kernel" if on_gpu and all(hasattr(C, f) for f in fns) else "PyTorch reference")
        for op, fns in CUDA_OPS.items()
    }
    if gpus:  # the grouped GEMMs choose per GPU and dtype (ops/grouped_mm.py, `grouped_mm_backend`)
        info["ops"]["grouped_mm"] = importlib.import_module("moe_kernels.ops.grouped_mm").describe_backend(0)
        info["ops"]["grouped_mm_fp8"] = importlib.import_module("moe_kernels.ops.grouped_mm_fp8").describe_backend(0)
    notes = []
    if driver_problem:  # the same rule as the ops' fallback (_ext.kernels)
        notes.append(f"{driver_problem}; until then every op runs its PyTorch reference")
    elif gpus and C is not None and not on_gpu:
        notes.append(
            f"the extension was built for {', '.join(info['extension_archs'])}, not this GPU's "
            f"sm_{gpus[0]['compute_capability'].replace('.', '')}: rebuild with MOE_KERNELS_CUDA_ARCHS"
        )
    info["notes"] = notes
    return info


def report() -> str:
    info = collect()
    lines = [f"moe_kernels {info['moe_kernels']}"]
    width = 24
    for key in ("python", "torch", "torch_cuda", "extension_built", "extension_archs", "extension_cuda_runtime",
                "cuda_driver", "grouped_mm_sm90_table", "grouped_mm_sm100", "expert_mlp", "extension_error"):
        if key in info:
            value = info[key]
            if isinstance(value, list):
                value = ", ".join(value)
            lines.append(f"  {key:<{width}}{value}")
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(
                f"  gpu {g['index']:<{width - 4}}{g['name']} (compute capability {g['compute_capability']}), "
                f"kernels {'run here' if g['kernels_run_here'] else 'not built for it'}"
            )
    else:
        lines.append(f"  {'gpu':<{width}}none visible to torch")
    lines.append(f"  {'distributed_backends':<{width}}{', '.join(info['distributed_backends']) or 'none'}")
    lines.append("  ops:")
    for op, backend in info["ops"].items():
        lines.append(f"    {op:<{width - 2}}{backend}")
    for note in info["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
