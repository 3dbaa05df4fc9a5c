"""The GPU perf mode: one short run that measures every open speed question, part by part.

    python -m bench.perf OUT [--parts env,host,gemm,layer,fp8,permute,dispatch,step,hf] [--budget 360] [--dry-run]

Parts, in priority order (`--parts` picks and orders them; scripts/gpu_check.sh `perf:host,layer` passes
them through):
  env       the environment report, GPU clocks and throttle reasons, the ceilings, and the L2 flush's
            effect: a 16 MiB copy and router_topk at deepseek-v3 / 4096 tokens (both fit in L2) timed with
            the read-only flush, the old zero-fill and no flush
  host      host issue vs kernel vs CUDA-graph replay time: router_topk and the router losses (with
            tokens_per_expert) on every perf.md shape at 16384 tokens, the small-H permute family
            (qwen3-30b-a3b, 8192 tokens), and the MoE layer's host overhead (bench_overhead: fused regions,
            registered ops and torch-native, qwen3-30b-a3b at 8192 tokens, with the gating linear at
            deepseek-v3 / 16384); then where one router_topk fwd+bwd's host time goes, ours and torch
            eager, beside the machine's floor (an aten op with its launch, autograd.grad over one op):
            profile_host_router_<case>.txt and a HOST line per case (bench/host_profile.py)
  gemm      grouped_mm against torch._grouped_mm, interleaved rep by rep, over the perf.md shapes, and
            qwen3-30b-a3b at 32768 tokens (the 500 TFLOP/s forward bar)
  layer     the qwen3-30b-a3b MoE layer at 8192 and 32768 tokens, one family run (and JSON) per token
            count: ours, torch-native, Hugging Face and Liger (where liger_kernel imports, its autotune
            pinned off), eager and graph-replayed; a `[moe_layer]` line per check, timing and mode pass; then
            the gather-fused experts (bench_expert_mlp, on the sm_90a gather kernels) against the permuted path at
            8192 tokens
  fp8       the FP8 GEMMs and recipe at deepseek-v3 and qwen3-30b-a3b, with the recipe's fwd+bwd
            profiled kernel by kernel (profile_fp8_recipe_*.txt); the FP8 MoE layer against the BF16 layer
            at deepseek-v3 EP-8 local and qwen3-30b-a3b shapes, 8192 tokens; the byte model's table
  permute   the permute family at deepseek-v3 / 8192 tokens (the 85% bar), unpermute backward included
  dispatch  virtual-rank dispatch and combine at 20 SMs and at all SMs
  step      the training step at 1, 4 and 16 micro-batches of 4k tokens (4k, 16k, 64k tokens a step), fwd+bwd
            and optimizer time apart, peak memory, and one profiled step's key_averages table
            (profile_train_step_*.txt)
  hf        transformers' MoE blocks (Qwen3-MoE, GPT-OSS, ERNIE-4.5, Llama 4 Scout shapes, 4096 tokens) as
            from_pretrained runs them and after patch_hf, fwd+bwd (bench_hf_blocks)
Each part runs its families through the bench harness (same timing method, ceilings at the start,
middle and end, provenance in every JSON) and writes perf_<part>_<family>.json and its log line as soon
as the family ends (bench_perf_<part>_<family>[_T<tokens>].json), so a run cut short keeps what it
measured; an interrupted part is recorded as such in perf_summary.json. `--budget` (seconds, default 360) bounds
the whole run: a part starts only while at least its `min_s` is left (a part's later runs, their own
`min_s`), and parts after the budget are listed as skipped in perf_summary.json. A case a family could
not run for lack of GPU memory is skipped there (harness.run_cases) and listed under the part's
`skipped`, which makes its status other than "ok".

`--dry-run` runs every part on the CPU with the families' tiny shapes (on the CPU-executed kernels when
MOE_KERNELS_EMULATE=1), so CI proves the script end to end between GPU runs; its times mean nothing, and
the timings that take the run's warmup and reps make one call each (harness.Context.dry_run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import typer

from . import harness as h
from . import host_profile


@dataclass(frozen=True)
class Run:
    """One bench family with its sweep narrowed for a part."""

    family: str
    models: tuple[str, ...] | None = None
    tokens: tuple[int, ...] | None = None
    quick: bool = True
    profile: bool = False
    modes: bool = False  # host / kernel / graph-replay time where the family makes it optional
    min_s: int = 0  # a run after a part's first starts only while this much of the budget is left
    env: tuple[tuple[str, str], ...] = ()  # set before the family runs, unless the environment sets them


@dataclass(frozen=True)
class Part:
    name: str
    runs: tuple[Run, ...]
    min_s: int  # do not start with less than this left of the budget
    extra: Callable[[h.Context, Path], None] | None = None  # measurements outside the families, first
    after: Callable[[h.Context, Path], list[str]] | None = None  # the same after the families; its files


ALL_MODELS = ("deepseek-v3", "qwen3-235b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b")
# Liger's fused MoE autotunes 240 Triton configs on first use (minutes on a fresh machine): the perf mode
# pins one config per kernel with liger-kernel's own switch (read when liger_kernel is imported).
LIGER_PINNED = (("LIGER_FUSED_MOE_AUTOTUNE", "0"),)


def _env(ctx: h.Context, out: Path) -> None:
    """The environment report and the flush's effect (a family of its own: bench_perf_env_flush.json)."""
    env = subprocess.run([sys.executable, "-m", "moe_kernels"], capture_output=True, text=True, timeout=120)
    (out / "env.txt").write_text(env.stdout + env.stderr)
    results = []
    n = (8 << 20) if ctx.is_cuda else (1 << 16)  # 16 MiB of bf16 on a GPU: L2-resident without a flush
    src = torch.randn(n, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    logits = torch.randn(4096 if ctx.is_cuda else 64, 256 if ctx.is_cuda else 16, device=ctx.device)
    import moe_kernels

    k = 8 if ctx.is_cuda else 4
    cases = {
        "copy_16MiB": (lambda s, d: d.copy_(s), [(src, dst)], 2 * src.numel() * 2),
        "router_topk_fwd_T4096": (lambda x: moe_kernels.router_topk(x, k), [(logits,)],
                                  logits.numel() * 4 + 2 * logits.shape[0] * k * 4),
    }
    for mode in ("read", "write", "none"):
        mctx = ctx.derive(flush_mode=mode) if ctx.is_cuda else ctx
        for name, (fn, inputs, nbytes) in cases.items():
            results.append(h.make_result(ctx, op=f"flush_{mode}", case=name, shape={}, dtype=src.dtype,
                                         timing=mctx.time(fn, inputs), nbytes=nbytes, flops=0, peers={}))
    for r in results:
        base = next(x for x in results if x.case == r.case and x.op == "flush_read")
        r.extra["us_vs_read_flush"] = r.us / max(base.us, 1e-3)
    head = [f"{name}: " + ", ".join(f"{m} flush {next(r.us for r in results if r.case == name and r.op == f'flush_{m}'):.1f} us"
                                    for m in ("read", "write", "none")) for name in cases]
    h.report(ctx.derive(out_dir=out), "perf_env_flush", h.Report(results, head, []))


PARTS: dict[str, Part] = {p.name: p for p in (
    Part("env", (), min_s=20, extra=_env),
    Part("host", (Run("router", tokens=(16384,)), Run("router_losses", tokens=(16384,)),
                  Run("permute", models=("qwen3-30b-a3b",), tokens=(8192,), modes=True),
                  Run("overhead", models=("qwen3-30b-a3b",), tokens=(8192,))), min_s=50,
         after=host_profile.write_router_profiles),
    Part("gemm", (Run("grouped_mm", tokens=(8192,)),
                  Run("grouped_mm", models=("qwen3-30b-a3b",), tokens=(32768,))), min_s=60),
    # One run per token count, so 8192's JSON is written before 32768 starts. Expected on an H100 (from its
    # 2026-11-27 kernel times: ours 5.7 ms fwd+bwd at 8192, torch-native 10.8 ms; 4x at 32768; the Hugging
    # Face eager loop's fwd+bwd ~0.3 s, capped at QUICK_TIME_BUDGET_S = 3 s per op): per routing case, the
    # four peers' checks ~3 s (fp64 layer per check), ten timed ops ~6 s (hf_eager's two ~4 s of it), three
    # time_modes passes ~4 s: ~14 s a case at 8192, ~28 s at 32768; plus ~20 s once (layer, peers, Liger's
    # Triton compiles with its autotune off, the first profiler pass). 8192: ~50 s, 32768: ~60 s, the part
    # ~110 s; with Liger's autotune on add minutes (bench_moe_layer's docstring).
    Part("layer", (Run("moe_layer", models=("qwen3-30b-a3b",), tokens=(8192,), modes=True, env=LIGER_PINNED),
                   Run("moe_layer", models=("qwen3-30b-a3b",), tokens=(32768,), modes=True, env=LIGER_PINNED,
                       min_s=60),
                   # The gather-fused experts against the permuted path: time, and peak memory measured (~20 s).
                   Run("expert_mlp", models=("qwen3-30b-a3b",), tokens=(8192,), min_s=30,
                       env=(("MOE_KERNELS_GATHER_CUTLASS", "1"),))), min_s=60),
    Part("fp8", (Run("grouped_mm_fp8", models=("deepseek-v3", "qwen3-30b-a3b"), tokens=(8192,), profile=True),
                 Run("moe_layer_fp8", tokens=(8192,), min_s=30), Run("bytes", tokens=(8192,), min_s=10)),
         min_s=60),
    # The memory-bound kernels: permute family at deepseek-v3, the experts' activations (~10 s).
    Part("permute", (Run("permute", models=("deepseek-v3",), tokens=(8192,)),
                     Run("activation", models=("qwen3-30b-a3b", "nemotron-3-nano"), tokens=(8192,), min_s=10)),
         min_s=30),
    Part("dispatch", (Run("dispatch", models=("deepseek-v3",)),), min_s=30),
    Part("step", (Run("train", tokens=(4096, 16384, 65536), profile=True),), min_s=90),
    # transformers' blocks as loaded and patched (patch_hf) at six models' shapes and two with peft LoRA, 4096
    # tokens: Llama 4 Scout's dense experts dominate (~0.1 s a fwd+bwd on an H100, ~10 s timed); ~50 s in all.
    Part("hf", (Run("hf_blocks", tokens=(4096,)),), min_s=60),
)}

app = typer.Typer(add_completion=False)


@app.command()
def main(
    out: Path = typer.Argument(..., help="directory for perf_<part>_<family>.json, logs and profiles"),
    parts: str = typer.Option(",".join(PARTS), "--parts", help="comma-separated parts, in the order to run"),
    budget: int = typer.Option(360, "--budget", help="seconds for the whole run"),
    dry_run: bool = typer.Option(False, "--dry-run", help="every part on the CPU, tiny shapes"),
) -> None:
    """The GPU perf mode (module docstring)."""
    import importlib

    from . import BENCHES

    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise typer.BadParameter(f"unknown {unknown}; known: {', '.join(PARTS)}", param_hint="--parts")
    if not dry_run and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA device: the perf mode measures a GPU (--dry-run checks it on a CPU)")
    device = torch.device("cpu" if dry_run else "cuda")
    if dry_run:
        torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    summary: dict = {"budget_s": budget, "dry_run": dry_run, "parts": {}}

    def save() -> None:
        (out / "perf_summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    base = h.Context(device=device, quick=True, out_dir=out, dry_run=dry_run)
    base.measure_ceilings("start")
    failed = False
    for name in chosen:
        part, left = PARTS[name], budget - (time.monotonic() - t0)
        # min_s is a GPU part's length; a dry run's tiny parts take seconds and stop only at the budget.
        if left < (1 if dry_run else part.min_s):
            summary["parts"][name] = {"status": f"skipped: {left:.0f} s left, needs {part.min_s}"}
            print(f"[perf] {name}: skipped ({left:.0f} s left of the budget, needs {part.min_s})", flush=True)
            save()
            continue
        start = time.monotonic()
        status, files, skipped = "ok", [], []
        try:
            if part.extra is not None:
                part.extra(base, out)
                files.append("bench_perf_env_flush.json")
            for j, run in enumerate(part.runs):
                family = f"perf_{name}_{run.family}" + (f"_T{'-'.join(map(str, run.tokens))}" if run.tokens else "")
                left = budget - (time.monotonic() - t0)
                if dry_run and any(prev.family == run.family for prev in part.runs[:j]):
                    # The CPU's tiny shapes ignore models and tokens: the same family again proves nothing new.
                    print(f"[perf] {name}: {family} not repeated on the CPU (tiny shapes: the same as before)",
                          flush=True)
                    continue
                if j and not dry_run and left < run.min_s:
                    skipped.append(f"{family}: {left:.0f} s left, needs {run.min_s}")
                    print(f"[perf] {name}: {family} skipped ({left:.0f} s left of the budget, needs {run.min_s})",
                          flush=True)
                    continue
                for key, value in run.env:
                    os.environ.setdefault(key, value)
                ctx = base.derive(quick=run.quick, models=run.models, tokens=run.tokens, profile=run.profile,
                                  modes=run.modes)
                rep = importlib.import_module(BENCHES[run.family]).run(ctx)
                h.report(ctx, family, rep)
                files.append(f"bench_{family}.json")
                if rep.failures:
                    status = "failures"
                skipped += [f"{family} {why}" for why in rep.skipped]
                summary["parts"][name] = {"status": "running", "seconds": round(time.monotonic() - start, 1),
                                          "files": files, "skipped": skipped}
                save()
            if part.after is not None:
                files += part.after(base, out)
        except KeyboardInterrupt:  # gpu_check.sh's timeout (SIGINT): keep what was measured, say where it stopped
            summary["parts"][name] = {"status": "interrupted", "seconds": round(time.monotonic() - start, 1),
                                      "files": files, "skipped": skipped}
            save()
            raise typer.Exit(130)
        except Exception as e:  # noqa: BLE001 - a part that breaks is recorded; the next part still runs
            status = f"error: {type(e).__name__}: {e}"
            traceback.print_exc()
        if status == "ok" and skipped:  # something not measured (out of memory, out of time): not "ok"
            status = f"skipped {len(skipped)}: " + "; ".join(skipped)[:300]
        failed |= status != "ok"
        summary["parts"][name] = {"status": status, "seconds": round(time.monotonic() - start, 1), "files": files,
                                  "skipped": skipped}
        print(f"[perf] {name}: {status} in {time.monotonic() - start:.0f} s", flush=True)
        save()
    summary["seconds"] = round(time.monotonic() - t0, 1)
    save()
    # A dry run exists to run every part: one skipped for time is a failure there.
    failed |= dry_run and any(p["status"].startswith("skipped") for p in summary["parts"].values())
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
