"""One training step (forward, backward, AdamW) of a qwen3-30b-a3b-shaped model with fewer layers on one
GPU: our kernels against the same model on the torch-native composition (MoE layers with
backend="torch": argsort dispatch + torch._grouped_mm + index_add_). Same weights, same batch.

Timing: 3 untimed steps, then 10 timed steps (5 with --quick), each between CUDA events (perf_counter on
the CPU); the median is reported. FLOPs per token from moe_kernels.models.flops_per_token (active experts
only, fwd + bwd); MFU against the GPU's bf16 datasheet peak (989 TFLOP/s on H100/H200) and against the
matmul ceiling measured in the same run.

A second op, train_step_fp8: the same step with the routed experts on the FP8 blockwise recipe
(moe_kernels.quant.Fp8BlockwiseRecipe: E4M3 forward and dgrad, bf16 wgrad), against our bf16 step and the
torch-native one; its first loss must be within 5% of the bf16 step's (FP8 rounding). On the CPU the tiny
model is widened to 128 (the recipe's block) so this path runs there too.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from moe_kernels.models import PRESETS, build_model, flops_per_token
from moe_kernels.quant import RECIPES
from moe_kernels.train.metrics import peak_flops

from . import bars
from . import harness as h

_BAR = bars.bar("train")


def _cases(ctx: h.Context):
    if not ctx.is_cuda:
        return [("tiny-qwen3-moe", dict(vocab_size=256, hidden_size=128, ffn_size=128), 4, 64)]
    seq = 1024 if ctx.quick else 2048
    # ctx.tokens (perf mode): tokens per step, as batches of `seq`-token sequences.
    batches = [max(1, t // seq) for t in ctx.tokens] if ctx.tokens else [4]
    return [("qwen3-30b-a3b-4layers", {}, b, seq) for b in batches]


def _time_steps(ctx: h.Context, step, warmup: int, reps: int) -> h.Timing:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e6)
    q = statistics.quantiles(times, n=5) if len(times) > 1 else [times[0]] * 4
    return h.Timing(us=statistics.median(times), p20_us=q[0], p80_us=q[-1])


def _build(preset: str, overrides: dict, backend: str, device, state=None, recipe=None):
    torch.manual_seed(0)
    model = build_model(PRESETS[preset](**overrides, backend=backend, recipe=recipe), device=device)
    if state is not None:
        model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt


def _step_fn(ctx: h.Context, model, opt, x, y):
    autocast = torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16, enabled=ctx.is_cuda)

    def step():
        with autocast:
            logits, aux = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) + aux
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run(ctx: h.Context) -> h.Report:
    results, headline, failures = [], [], []
    warmup, reps = 3, (5 if ctx.quick else 10)
    all_cases = _cases(ctx)
    for i, (preset, overrides, batch, seq) in enumerate(all_cases):
        if i:  # the previous case is done (the loop below may `continue` past its end)
            ctx.case_done("train", i - 1, len(all_cases))
        overrides = {**overrides, "max_seq_len": seq}
        cfg = PRESETS[preset](**overrides)
        case = f"{preset}/B{batch}xS{seq}"
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(ctx.device)
        y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(ctx.device)
        ours, ours_opt = _build(preset, overrides, "kernels", ctx.device)
        state = {k: v.clone() for k, v in ours.state_dict().items()}
        step = _step_fn(ctx, ours, ours_opt, x, y)
        first = step()
        timing = _time_steps(ctx, step, warmup, reps)
        if ctx.profile:  # one profiled step, kept as its key_averages table (no raw trace)
            ctx.out_dir.mkdir(parents=True, exist_ok=True)
            table = h.profile_table(step, (), device=ctx.device, reps=1)
            (ctx.out_dir / f"profile_train_step_B{batch}xS{seq}.txt").write_text(f"{case}, one step\n{table}\n")
        del ours, ours_opt, step
        if ctx.is_cuda:
            torch.cuda.empty_cache()
        peer, peer_opt = _build(preset, overrides, "torch", ctx.device, state)
        peer_step = _step_fn(ctx, peer, peer_opt, x, y)
        peer_first = peer_step()
        # Same weights and batch: the first losses agree to bf16 precision (routing near-ties aside).
        if abs(float(first) - float(peer_first)) > 2e-2 * max(1.0, abs(float(peer_first))):
            failures.append(f"{case}: first-step loss {float(first):.4f} vs torch-native {float(peer_first):.4f}")
            continue
        peer_timing = _time_steps(ctx, peer_step, warmup, reps)
        del peer, peer_opt, peer_step
        fp8 = _fp8_step(ctx, preset, overrides, state, x, y, float(first), warmup, reps, case, failures)
        tokens = batch * seq
        flops = flops_per_token(cfg, seq) * tokens
        res = h.make_result(ctx, op="train_step", case=case, shape={"batch": batch, "seq": seq, "layers": cfg.num_layers},
                            dtype=torch.bfloat16 if ctx.is_cuda else torch.float32, timing=timing, nbytes=0,
                            flops=flops, peers={"torch_native": peer_timing})
        results.append(res)
        tflops = flops / timing.us / 1e6
        peak = peak_flops(ctx.device)
        mfu = f"MFU {100 * tflops * 1e12 / peak:.1f}% of the {peak / 1e12:.0f} TFLOP/s datasheet peak" if peak else "MFU n/a"
        # The % of ceiling is read after the family's end measurement (ctx.finish) has judged it again.
        headline.append(lambda res=res, case=case, timing=timing, tokens=tokens, tflops=tflops, mfu=mfu: (
            f"train_step {case}: {1e6 / timing.us:.2f} steps/s, {tokens / timing.us * 1e6:,.0f} tokens/s, "
            f"{res.speedup['torch_native']:.2f}x the torch-native composition (bar: >= {_BAR.threshold('speedup:torch_native').value:g}x); "
            f"{tflops:.1f} TFLOP/s, {mfu} (bar: >= {_BAR.threshold('mfu_pct').value:g}%), {res.pct_of_ceiling:.1f}% of the measured matmul ceiling"
        ))
        if fp8 is not None:
            res8 = h.make_result(ctx, op="train_step_fp8", case=case, shape=res.shape, dtype=torch.float8_e4m3fn,
                                 timing=fp8, nbytes=0, flops=flops,
                                 peers={"moe_kernels_bf16": timing, "torch_native": peer_timing})
            results.append(res8)
            headline.append(
                f"train_step_fp8 {case}: {tokens / fp8.us * 1e6:,.0f} tokens/s, {res8.speedup['moe_kernels_bf16']:.2f}x "
                f"our bf16 step, {res8.speedup['torch_native']:.2f}x the torch-native composition"
            )
    ctx.finish("train", results)
    return h.Report(results=results, headline=[line() if callable(line) else line for line in headline],
                    failures=failures)


def _fp8_step(ctx, preset, overrides, state, x, y, bf16_loss, warmup, reps, case, failures) -> h.Timing | None:
    recipe = RECIPES["fp8-blockwise"]
    try:
        PRESETS[preset](**overrides, recipe=recipe)
    except ValueError as e:  # sizes off the recipe's 128 blocks
        failures.append(f"{case}: no FP8 step ({e})")
        return None
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    model, opt = _build(preset, overrides, "kernels", ctx.device, state, recipe=recipe)
    step = _step_fn(ctx, model, opt, x, y)
    first = float(step())
    if abs(first - bf16_loss) > 5e-2 * max(1.0, abs(bf16_loss)):
        failures.append(f"{case}: FP8 first-step loss {first:.4f} vs bf16 {bf16_loss:.4f}")
        return None
    timing = _time_steps(ctx, step, warmup, reps)
    del model, opt, step
    return timing
