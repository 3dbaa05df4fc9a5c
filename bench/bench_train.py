"""One training step (forward, backward, AdamW) of a qwen3-30b-a3b-shaped model with fewer layers on one
GPU: our kernels against the same model on the torch-native composition (MoE layers with
backend="torch": argsort dispatch + torch._grouped_mm + index_add_). Same weights, same batches, the same
step for both: the LM loss fused with the lm_head (linear_cross_entropy, moe-train's default) under bf16
autocast, fused AdamW, gradient accumulation over the step's micro-batches.

Cases: micro-batches of B4 x S1024 (S2048 without --quick), 1, 4 and 16 of them a step (4k, 16k and 64k
tokens); in the perf mode `ctx.tokens` gives the tokens a step (4096, 16384, 65536 -> 1, 4, 16
micro-batches). Timing: 3 untimed steps, then 10 timed (5 with --quick), each between CUDA events, split
at the end of the last backward: fwd+bwd and optimizer (AdamW step and zero_grad) reported separately
(`extra`: fwd_bwd_us, optim_us, optim_share_pct) beside the step's median; peak memory of the step
(`peak_mem_gb`). FLOPs per token from moe_kernels.models.flops_per_token (active experts only, fwd + bwd);
MFU against the GPU's bf16 datasheet peak (989 TFLOP/s on H100/H200) and against the matmul ceiling
measured in the same run.

A second op, train_step_fp8 (one micro-batch a step): the same step with the routed experts on the FP8
blockwise recipe (moe_kernels.quant.Fp8BlockwiseRecipe), against our bf16 step and the torch-native one;
its first loss must be within 5% of the bf16 step's (FP8 rounding). On the CPU the tiny model is widened to
128 (the recipe's block) so this path runs there too.

A third op on CUDA, train_step_graphed (one micro-batch a step): the same bf16 step captured whole in one CUDA
graph and replayed (moe-train --cuda-graphs: fused AdamW capturable, its learning rate a device tensor), against
the eager step; its first loss must equal the eager step's bit for bit (same weights, same batch). Bar: the
captured step at least 10% faster than the eager one (bars: train_graph).
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from moe_kernels.models import PRESETS, build_model, flops_per_token
from moe_kernels.quant import RECIPES, weight_cache
from moe_kernels.train.metrics import peak_flops

from . import bars
from . import harness as h

_BAR = bars.bar("train")
_GRAPH_BAR = bars.bar("train_graph").threshold("speedup:eager_step")


MICRO_BATCH = 4  # sequences per micro-batch
MICRO_BATCHES = (1, 4, 16)


def _cases(ctx: h.Context):
    """(preset, overrides, sequences per micro-batch, seq, micro-batches a step)."""
    if not ctx.is_cuda:
        tiny = ("tiny-qwen3-moe", dict(vocab_size=256, hidden_size=128, ffn_size=128))
        return [(*tiny, 4, 64, 1), (*tiny, 4, 64, 2)]
    seq = 1024 if ctx.quick else 2048
    per_micro = MICRO_BATCH * seq
    if ctx.tokens:  # perf mode: tokens a step
        shapes = [(min(MICRO_BATCH, max(1, t // seq)), max(1, t // per_micro)) for t in ctx.tokens]
    else:
        shapes = [(MICRO_BATCH, n) for n in MICRO_BATCHES]
    return [("qwen3-30b-a3b-4layers", {}, b, seq, n) for b, n in shapes]


@dataclass
class StepTiming:
    step: h.Timing
    fwd_bwd_us: float  # medians of the parts
    optim_us: float


def _median_timing(times: list[float]) -> h.Timing:
    q = statistics.quantiles(times, n=5) if len(times) > 1 else [times[0]] * 4
    return h.Timing(us=statistics.median(times), p20_us=q[0], p80_us=q[-1])


def _time_steps(ctx: h.Context, step, warmup: int, reps: int) -> StepTiming:
    """`step(mark)` calls `mark()` between the last backward and the optimizer."""
    for _ in range(warmup):
        step(lambda: None)
    total, fwd_bwd = [], []
    for _ in range(reps):
        if ctx.is_cuda:
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            step(mid.record)
            end.record()
            end.synchronize()
            total.append(start.elapsed_time(end) * 1e3)
            fwd_bwd.append(start.elapsed_time(mid) * 1e3)
        else:
            marks = []
            t0 = time.perf_counter()
            step(lambda: marks.append(time.perf_counter()))
            t1 = time.perf_counter()
            total.append((t1 - t0) * 1e6)
            fwd_bwd.append((marks[-1] - t0) * 1e6)
    fb = statistics.median(fwd_bwd)
    return StepTiming(_median_timing(total), fb, statistics.median(t - f for t, f in zip(total, fwd_bwd)))


def _build(preset: str, overrides: dict, backend: str, device, state=None, recipe=None):
    torch.manual_seed(0)
    model = build_model(PRESETS[preset](**overrides, backend=backend, recipe=recipe), device=device)
    if state is not None:
        model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt


def _step_fn(ctx: h.Context, model, opt, xs, ys):
    """One optimizer step over the micro-batches xs, ys: each loss scaled by 1 / len(xs), gradients summed."""
    autocast = torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16, enabled=ctx.is_cuda)
    n = len(xs)

    def step(mark=lambda: None):
        total = torch.zeros((), device=xs[0].device)
        for x, y in zip(xs, ys):
            with autocast:
                loss, aux = model(x, y)
            ((loss + aux) / n).backward()
            total += loss.detach() / n
        mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _peak_gb(ctx: h.Context, step) -> float:
    """Peak memory allocated during one step (0 on the CPU)."""
    if not ctx.is_cuda:
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(ctx.device) / 1e9


def run(ctx: h.Context) -> h.Report:
    results, headline, failures = [], [], []
    warmup, reps = (0, 1) if ctx.dry_run else (3, 5 if ctx.quick else 10)
    all_cases = _cases(ctx)
    peak = peak_flops(ctx.device)
    for i, (preset, overrides, batch, seq, micro) in enumerate(all_cases):
        if i:  # the previous case is done (the loop below may `continue` past its end)
            ctx.case_done("train", i - 1, len(all_cases))
        overrides = {**overrides, "max_seq_len": seq}
        cfg = PRESETS[preset](**overrides)
        case = f"{preset}/B{batch}xS{seq}" + (f"x{micro}" if micro > 1 else "")
        g = torch.Generator().manual_seed(0)
        xs = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(ctx.device) for _ in range(micro)]
        ys = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(ctx.device) for _ in range(micro)]
        ours, ours_opt = _build(preset, overrides, "kernels", ctx.device)
        state = {k: v.clone() for k, v in ours.state_dict().items()}
        step = _step_fn(ctx, ours, ours_opt, xs, ys)
        first = step()
        timing = _time_steps(ctx, step, warmup, reps)
        peak_gb = _peak_gb(ctx, step)
        if ctx.profile and micro == 1:  # one profiled step, kept as its key_averages table (no raw trace)
            ctx.out_dir.mkdir(parents=True, exist_ok=True)
            table = h.profile_table(step, (), device=ctx.device, reps=1)
            (ctx.out_dir / f"profile_train_step_B{batch}xS{seq}.txt").write_text(f"{case}, one step\n{table}\n")
        del ours, ours_opt, step
        if ctx.is_cuda:
            torch.cuda.empty_cache()
        peer, peer_opt = _build(preset, overrides, "torch", ctx.device, state)
        peer_step = _step_fn(ctx, peer, peer_opt, xs, ys)
        peer_first = peer_step()
        # Same weights and batches: the first losses agree to bf16 precision (routing near-ties aside).
        if abs(float(first) - float(peer_first)) > 2e-2 * max(1.0, abs(float(peer_first))):
            failures.append(f"{case}: first-step loss {float(first):.4f} vs torch-native {float(peer_first):.4f}")
            continue
        peer_timing = _time_steps(ctx, peer_step, warmup, reps)
        del peer, peer_opt, peer_step
        if ctx.is_cuda:
            torch.cuda.empty_cache()
        fp8 = graphed = None
        if micro == 1:
            fp8 = _fp8_step(ctx, preset, overrides, state, xs, ys, float(first), warmup, reps, case, failures)
        if micro == 1 and ctx.is_cuda:
            graphed = _graphed_step(ctx, preset, overrides, state, xs, ys, first, warmup, reps, case, failures)
        tokens = batch * seq * micro
        flops = flops_per_token(cfg, seq) * tokens
        res = h.make_result(ctx, op="train_step", case=case,
                            shape={"batch": batch, "seq": seq, "micro_batches": micro, "layers": cfg.num_layers},
                            dtype=torch.bfloat16 if ctx.is_cuda else torch.float32, timing=timing.step, nbytes=0,
                            flops=flops, peers={"torch_native": peer_timing.step})
        tflops = flops / timing.step.us / 1e6
        res.extra.update(fwd_bwd_us=timing.fwd_bwd_us, optim_us=timing.optim_us,
                         optim_share_pct=100 * timing.optim_us / max(timing.step.us, 1e-9), peak_mem_gb=peak_gb,
                         tokens_per_step=tokens, mfu_datasheet_pct=100 * tflops * 1e12 / peak if peak else 0.0,
                         peer_fwd_bwd_us=peer_timing.fwd_bwd_us, peer_optim_us=peer_timing.optim_us)
        results.append(res)
        mfu = f"MFU {100 * tflops * 1e12 / peak:.1f}% of the {peak / 1e12:.0f} TFLOP/s datasheet peak" if peak else "MFU n/a"
        # The % of ceiling is read after the family's end measurement (ctx.finish) has judged it again.
        headline.append(lambda res=res, case=case, timing=timing, tokens=tokens, tflops=tflops, mfu=mfu, peak_gb=peak_gb: (
            f"train_step {case}: {tokens:,} tokens a step, {tokens / timing.step.us * 1e6:,.0f} tokens/s, "
            f"{res.speedup['torch_native']:.2f}x the torch-native composition (bar: >= {_BAR.threshold('speedup:torch_native').value:g}x); "
            f"{tflops:.1f} TFLOP/s, {mfu} (bar: >= {_BAR.threshold('mfu_pct').value:g}%), {res.pct_of_ceiling:.1f}% of the measured "
            f"matmul ceiling; fwd+bwd {timing.fwd_bwd_us / 1e3:.1f} ms, optimizer {timing.optim_us / 1e3:.1f} ms "
            f"({res.extra['optim_share_pct']:.0f}%), peak {peak_gb:.1f} GB"
        ))
        if fp8 is not None:
            res8 = h.make_result(ctx, op="train_step_fp8", case=case, shape=res.shape, dtype=torch.float8_e4m3fn,
                                 timing=fp8.step, nbytes=0, flops=flops,
                                 peers={"moe_kernels_bf16": timing.step, "torch_native": peer_timing.step})
            res8.extra.update(fwd_bwd_us=fp8.fwd_bwd_us, optim_us=fp8.optim_us)
            results.append(res8)
            headline.append(
                f"train_step_fp8 {case}: {tokens / fp8.step.us * 1e6:,.0f} tokens/s, {res8.speedup['moe_kernels_bf16']:.2f}x "
                f"our bf16 step, {res8.speedup['torch_native']:.2f}x the torch-native composition"
            )
        if graphed is not None:
            resg = h.make_result(ctx, op="train_step_graphed", case=case, shape=res.shape, dtype=torch.bfloat16,
                                 timing=graphed, nbytes=0, flops=flops, peers={"eager_step": timing.step})
            results.append(resg)
            headline.append(
                f"train_step_graphed {case}: {tokens / graphed.us * 1e6:,.0f} tokens/s, {resg.speedup['eager_step']:.2f}x "
                f"the eager step (bar: >= {_GRAPH_BAR.value:g}x), step {graphed.us / 1e3:.1f} ms against "
                f"{timing.step.us / 1e3:.1f} ms"
            )
    ctx.finish("train", results)
    return h.Report(results=results, headline=[line() if callable(line) else line for line in headline],
                    failures=failures)


def _graphed_step(ctx, preset, overrides, state, xs, ys, eager_first, warmup, reps, case, failures) -> h.Timing | None:
    """The bf16 step of one micro-batch captured in a CUDA graph after `warmup` eager steps on a side stream (as
    torch.cuda.graphs asks) and timed as replays; xs, ys are its static inputs (the same batch every step, as
    in the eager timing). None, with the reason in `failures`, where the capture fails or the first loss differs
    from the eager step's."""
    torch.cuda.empty_cache()
    model, _ = _build(preset, overrides, "kernels", ctx.device, state)
    lr = torch.tensor(1e-4, device=ctx.device)  # fp32: what fused AdamW reads on the device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
    step = _step_fn(ctx, model, opt, xs, ys)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            first = step()
            for _ in range(warmup - 1):
                step()
        torch.cuda.current_stream().wait_stream(side)
        if not torch.equal(first, eager_first):
            failures.append(f"{case}: captured step's first loss {float(first):.6f} vs eager {float(eager_first):.6f}")
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as e:  # a capture that fails says why; the other results stand
        failures.append(f"{case}: the step could not be captured ({e})")
        return None

    def replay(mark=lambda: None):
        graph.replay()
        mark()

    timing = _time_steps(ctx, replay, 1, reps).step
    del graph, model, opt, step
    torch.cuda.empty_cache()
    return timing


def _fp8_step(ctx, preset, overrides, state, xs, ys, bf16_loss, warmup, reps, case, failures) -> StepTiming | None:
    recipe = RECIPES["fp8-blockwise"]
    try:
        PRESETS[preset](**overrides, recipe=recipe)
    except ValueError as e:  # sizes off the recipe's 128 blocks
        failures.append(f"{case}: no FP8 step ({e})")
        return None
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    weight_cache.enable()  # one process, weights changed only by the optimizer: as moe-train runs it
    model, opt = _build(preset, overrides, "kernels", ctx.device, state, recipe=recipe)
    step = _step_fn(ctx, model, opt, xs, ys)
    first = float(step())
    if abs(first - bf16_loss) > 5e-2 * max(1.0, abs(bf16_loss)):
        failures.append(f"{case}: FP8 first-step loss {first:.4f} vs bf16 {bf16_loss:.4f}")
        return None
    timing = _time_steps(ctx, step, warmup, reps)
    del model, opt, step
    return timing
