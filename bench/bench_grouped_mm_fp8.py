"""FP8 blockwise grouped GEMM (forward) at the grouped_mm shapes of specs/perf.md.

FLOPs = 2 * M * N * K; bytes = x M*K + w E*N*K (1 byte each) + their scales + out M*N*2.
Cases: every model x tokens x routing (uniform, zipf) x GEMM (w13, w2) of bench_grouped_mm whose K is a
multiple of 128 (the blockwise kernel's requirement); the operands are quantized before timing.
Peer, timed in the same run on the same problems:
  moe_kernels_bf16   our bf16 grouped_mm on the unquantized operands (the perf.md bar: >= 1.6x)
Checked before timing, on the first input set: against the fp32 reference of the dequantized operands,
within twice the error of that reference rounded to bf16 (plus a floor) against fp64.

A second op per case, grouped_mm_fp8_wgrad: the weight gradient with the groups splitting the tokens,
dout and x quantized along the tokens (quantize_fp8_tokens, before timing), each group padded to 128
rows (Mp rows in all), fp32 output; FLOPs = 2 * Mp * N * K; bytes = dout Mp*N + x Mp*K (1 byte) + their
scales + dW E*N*K*4. Peer: moe_kernels_bf16, our bf16 grouped_mm_wgrad on the same padded bf16
operands. Checked first: against the fp64 reference on the device, within fp32 rounding of the terms'
magnitude times moe_kernels.testing.FP8_MMA_MAGNITUDE (Hopper's FP8 accumulation keeps ~14 bits inside
each 128-token block).

Where the sm_90a instances run (an H100/H200 and a build with them), the forward and wgrad rows also time every
instance of the tuning set that serves the product (csrc/gemm/sm90_kernels.cu: cooperative 128x128x128 with
a 1x1 or 2x1 cluster, ping-pong 64x128x128), each forced by id on the same operands, as peers named
`instance:<name>`: one of them is the default choice (a speedup of about 1), and a speedup below 1 is an
instance faster than that choice. The table (`bench tune_grouped_mm`) is what changes the choice; these
columns say, in every run of this family, whether a sweep would.

Where the FP8 tensor-core portable kernel runs (csrc/gemm/portable_mma_fp8.cuh: E4M3 mma.sync, any GPU of 8.9
and later whose build holds its code), the forward and wgrad rows also time it by name (portable=1, the op's
own steps otherwise: the inverse scales, the output) as the peer `portable_mma`: on an L40S or RTX GPU what the
ops run with MOE_KERNELS_PORTABLE_MMA=1; on an H100/H200 how far it is from the CUTLASS kernels (there the
instruction is lowered to f16 conversions and the f16 one). Its output is checked as the op's first.

A third op per case, fp8_recipe_fwd_bwd: Fp8BlockwiseRecipe().grouped_mm forward and backward (dx, dw)
from bf16 x and w, all three products in FP8, quantization of x, w and dout included (each training step
quantizes them anew), on the 128-padded groups, against bf16 grouped_mm forward and backward; FLOPs =
3 * 2 * Mp * N * K; bytes from the byte model (bench/bytes.py: every kernel's reads and writes, the
quantizations included), with the bf16 path's count and their ratio in `extra`. Checked first: out, dx
and dw within relative L2 error 0.1 of the bf16 ones (FP8 keeps ~3 significant bits; a wrong scale or
layout is far outside).
"""

from __future__ import annotations

import torch

import moe_kernels
from moe_kernels import _ext
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8_reference, grouped_mm_fp8_wgrad_reference
from moe_kernels.quant import Fp8BlockwiseRecipe
from moe_kernels.testing import FP8_MMA_MAGNITUDE, assert_errors_within_fp64_rule, assert_within_fp32_rounding

from . import bench_grouped_mm as bg
from . import bytes as byte_model
from . import bars
from . import harness as h

HEADLINE_MODEL = "deepseek-v3"
BAR = bars.quote("grouped_mm_fp8")


# The CPU run (CI) needs K a multiple of 128 too: H = F = 128, 32 tokens, 4 experts, top-2.
CPU_MODEL = ("tiny-fp8", 32, 128, 128, 4, 2, 1)


def cases(ctx: h.Context) -> list[bg.Case]:
    if not ctx.is_cuda:
        return [bg.Case(*CPU_MODEL, r, g) for r in bg.ROUTINGS for g in bg.GEMMS]
    return [c for c in bg.cases(ctx) if c.K % 128 == 0]


def _inputs(ctx: h.Context, c: bg.Case, seed: int) -> dict:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    x = torch.randn(c.M, c.K, generator=g, device=ctx.device).to(torch.bfloat16)
    w = (torch.randn(c.E, c.N, c.K, generator=g, device=ctx.device) * c.K**-0.5).to(torch.bfloat16)
    sizes = torch.tensor(c.sizes(seed), dtype=torch.int32, device=ctx.device)
    xq, xs = moe_kernels.quantize_fp8(x, "block")
    wq, ws = moe_kernels.quantize_fp8_experts(w)
    # wgrad and training: each group padded to 128 rows (permute(..., align=128) in the recipe).
    padded = [-(-n // 128) * 128 for n in c.sizes(seed)]
    Mp = sum(padded)
    xp = torch.randn(Mp, c.K, generator=g, device=ctx.device).to(torch.bfloat16)
    dp = torch.randn(Mp, c.N, generator=g, device=ctx.device).to(torch.bfloat16)
    psizes = torch.tensor(padded, dtype=torch.int32, device=ctx.device)
    wgrad = (*moe_kernels.quantize_fp8_tokens(dp), *moe_kernels.quantize_fp8_tokens(xp), psizes)
    return dict(x=x, w=w, sizes=sizes, fp8=(xq, xs, wq, ws, sizes), Mp=Mp, wgrad=wgrad, wgrad_bf16=(dp, xp, psizes),
                train=(xp.clone().requires_grad_(), w.requires_grad_(), psizes, dp))


RECIPE = Fp8BlockwiseRecipe()


def _fwd_bwd(mm):
    def step(x, w, sizes, dout):
        out = mm(x, w, sizes)
        return (out, *torch.autograd.grad(out, (x, w), dout))
    return step


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, summed in fp64 a piece at a time (dw of deepseek-v3 is 2 GB in bf16)."""
    num = den = 0.0
    for _, (x, y) in bg._pieces(a.detach(), b.detach()):
        y = y.double()
        num += float((x.double() - y).square().sum())
        den += float(y.square().sum())
    return num**0.5 / max(den**0.5, 1e-30)


def _check_recipe(c: bg.Case, train: tuple) -> None:
    rows = int(train[2].sum())
    ours = _fwd_bwd(RECIPE.grouped_mm)(*train)
    bf16 = _fwd_bwd(moe_kernels.grouped_mm)(*train)
    for name, a, b in zip(("out", "dx", "dw"), ours, bf16):
        if name != "dw":
            a, b = a[:rows], b[:rows]
        err = _rel_l2(a, b)
        if not err <= 0.1:
            raise AssertionError(f"{c.name} fp8 recipe: {name} relative L2 error {err:.3g} > 0.1 against bf16")


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    """(first row, rows) of each group."""
    out, start = [], 0
    for n in sizes:
        out.append((start, n))
        start += n
    return out


def _check_fwd(c: bg.Case, fp8: tuple, run=None, what: str = "grouped_mm_fp8") -> None:
    """assert_close_to_fp64 of the forward (`run`, default the op), its references built one expert at a time:
    the fp64 reference dequantizes its operands in fp64, which for all of deepseek-v3's local experts at once is
    tens of GB."""
    xq, xs, wq, ws, sizes = fp8
    ours = (run or moe_kernels.grouped_mm_fp8)(*fp8)
    mine = theirs = ref_max = torch.zeros((), dtype=torch.float64, device=ours.device)  # maxima; NaN stays NaN
    for e, (r0, n) in enumerate(_offsets(sizes.tolist())):
        if n == 0:
            continue
        part = (xq[r0 : r0 + n], xs[r0 : r0 + n], wq[e : e + 1], ws[e : e + 1], sizes[e : e + 1])
        ref64 = grouped_mm_fp8_reference(*part, acc=torch.float64)
        base = grouped_mm_fp8_reference(*part).to(torch.bfloat16).double()
        mine = torch.maximum(mine, (ours[r0 : r0 + n].double() - ref64).abs().max())
        theirs = torch.maximum(theirs, (base - ref64).abs().max())
        ref_max = torch.maximum(ref_max, ref64.abs().max())
        del ref64, base
    mine, theirs, ref_max = float(mine), float(theirs), float(ref_max)
    assert_errors_within_fp64_rule(mine, theirs, ref_max, f"{c.name} {what}", floor=1e-3 * ref_max + 1e-6)


def _tensor_core_kernel_runs(ctx: h.Context) -> bool:
    """Whether the FP8 tensor-core portable kernel runs on the bench's device: a GPU of 8.9 and later whose build
    holds its code, or the CPU-executed kernels of an emulated 8.9 GPU (MOE_KERNELS_EMU_CAPABILITY)."""
    from moe_kernels.ops.grouped_mm_fp8 import tensor_core_refusal

    return tensor_core_refusal(ctx.device) is None


def _tensor_core_fwd(xq, xs, wq, ws, sizes):
    """grouped_mm_fp8's steps with the FP8 tensor-core portable kernel named (portable=1)."""
    from moe_kernels.ops.grouped_mm_fp8 import _run_forward

    out = _run_forward(_ext.kernels("grouped_mm_fp8", xq), xq, xs, wq, ws, sizes, portable=1)
    if out is None:
        raise RuntimeError("the FP8 tensor-core portable kernel did not take the forward")
    return out


def _tensor_core_wgrad(aq, as_, bq, bs, sizes):
    """grouped_mm_fp8_wgrad's steps (fp32 out) with the FP8 tensor-core portable kernel named (portable=1)."""
    from moe_kernels.ops.grouped_mm_fp8 import _run_wgrad

    out = torch.empty((sizes.shape[0], aq.shape[0], bq.shape[0]), dtype=torch.float32, device=aq.device)
    if not _run_wgrad(_ext.kernels("grouped_mm_fp8", aq), aq, as_, bq, bs, sizes, out, portable=1):
        raise RuntimeError("the FP8 tensor-core portable kernel did not take the wgrad")
    return out


def _instance_peers(ctx: h.Context, op: int, out_dtype: torch.dtype, sets: list[dict]) -> dict[str, h.Timing]:
    """Each sm_90a instance serving FP8 `op` (0 forward, 2 wgrad) with `out_dtype`, forced by id and timed on
    every input set; {} where the instances do not run (not an H100/H200, or a build without them)."""
    from moe_kernels.ops.grouped_mm_fp8 import _inverse_scale, _launch_fp8

    C = _ext._C
    if (not ctx.is_cuda or C is None or not getattr(C, "grouped_mm_has_sm90", False)
            or torch.cuda.get_device_capability(ctx.device) != (9, 0)):
        return {}
    launches = []
    for s in sets:
        if op == 0:
            xq, xs, wq, ws, sizes = s["fp8"]
            (M, K), N = xq.shape, wq.shape[1]
            a, b, sfa, sfb = xq, wq, _inverse_scale(xs), _inverse_scale(ws)
            out = torch.empty(M, N, device=ctx.device, dtype=torch.bfloat16)
        else:
            aq, as_, bq, bs, sizes = s["wgrad"]
            (N, M), K = aq.shape, bq.shape[0]
            a, b = aq, bq
            sfa, sfb = _inverse_scale(as_).t().contiguous(), _inverse_scale(bs).t().contiguous()
            out = torch.empty(sizes.shape[0], N, K, device=ctx.device, dtype=out_dtype)
        launches.append((a, b, out, sfa, sfb, sizes, M, N, K))
    product = (_ext.dtype_code(torch.float8_e4m3fn), op, _ext.dtype_code(out_dtype))
    peers = {}
    for i, spec in enumerate(C.grouped_mm_sm90_kernels()):
        if (spec["dtype"], spec["op"], spec["out"]) != product:
            continue

        def launch(a, b, out, sfa, sfb, sizes, M, N, K, i=i):
            if not _launch_fp8(C, op, a, b, out, sfa, sfb, sizes, M, N, K, kernel=i):
                raise RuntimeError(f"instance {i} did not take the problem")

        peers[f"instance:{spec['name']}"] = ctx.time(launch, launches)
    return peers


def run_case(ctx: h.Context, c: bg.Case) -> list[h.Result]:
    sets = [_inputs(ctx, c, ctx.seed + i) for i in range(ctx.n_input_sets)]
    s0 = sets[0]
    sizes = s0["sizes"]
    _check_fwd(c, s0["fp8"])  # its temporaries are gone before the next check and the timing
    ours = ctx.time(lambda *a: moe_kernels.grouped_mm_fp8(*a), [s["fp8"] for s in sets])
    peer = ctx.time(lambda x, w, sz: moe_kernels.grouped_mm(x, w, sz), [(s["x"], s["w"], s["sizes"]) for s in sets])
    peers, variants = {"moe_kernels_bf16": peer}, {"moe_kernels_bf16": "grouped_mm"}
    peers.update(_instance_peers(ctx, 0, torch.bfloat16, sets))
    tensor_cores = _tensor_core_kernel_runs(ctx)
    if tensor_cores:
        _check_fwd(c, s0["fp8"], _tensor_core_fwd, "FP8 tensor-core portable kernel")
        peers["portable_mma"] = ctx.time(_tensor_core_fwd, [s["fp8"] for s in sets])
        variants["portable_mma"] = "ours, the FP8 tensor-core portable kernel named (portable=1)"
    flops = 2 * c.M * c.N * c.K
    nbytes = c.M * c.K + c.E * c.N * c.K + 4 * (c.M * c.K // 128 + c.E * (-(-c.N // 128)) * (c.K // 128)) + 2 * c.M * c.N
    fwd = h.make_result(ctx, op="grouped_mm_fp8_fwd", case=c.name, shape=c.shape(ctx.seed), dtype=torch.float8_e4m3fn,
                        timing=ours, nbytes=nbytes, flops=flops, peers=peers, peer_variant=variants)

    Mp = s0["Mp"]
    _check_wgrad(c, s0["wgrad"])
    ours_wgrad = ctx.time(lambda *a: moe_kernels.grouped_mm_fp8_wgrad(*a), [s["wgrad"] for s in sets])
    peer_wgrad = ctx.time(lambda *a: torch.ops.moe_kernels.grouped_mm_wgrad(*a), [s["wgrad_bf16"] for s in sets])
    wgrad_bytes = Mp * (c.N + c.K) + 4 * (c.N + c.K) * (Mp // 128) + 4 * c.E * c.N * c.K
    wgrad_peers = {"moe_kernels_bf16": peer_wgrad, **_instance_peers(ctx, 2, torch.float32, sets)}
    wgrad_variants = {"moe_kernels_bf16": "grouped_mm_wgrad"}
    if tensor_cores:
        _check_wgrad(c, s0["wgrad"], _tensor_core_wgrad, "FP8 tensor-core portable kernel")
        wgrad_peers["portable_mma"] = ctx.time(_tensor_core_wgrad, [s["wgrad"] for s in sets])
        wgrad_variants["portable_mma"] = "ours, the FP8 tensor-core portable kernel named (portable=1)"
    wgrad = h.make_result(ctx, op="grouped_mm_fp8_wgrad", case=c.name, shape=c.shape(ctx.seed),
                          dtype=torch.float8_e4m3fn, timing=ours_wgrad, nbytes=wgrad_bytes, flops=2 * Mp * c.N * c.K,
                          peers=wgrad_peers, peer_variant=wgrad_variants)

    _check_recipe(c, s0["train"])
    ours_train = ctx.time(_fwd_bwd(RECIPE.grouped_mm), [s["train"] for s in sets])
    peer_train = ctx.time(_fwd_bwd(moe_kernels.grouped_mm), [s["train"] for s in sets])
    if ctx.profile and c.gemm == "w13" and c.routing == "uniform":
        # Kernel by kernel: where the recipe's time goes beside the GEMMs (quantization, transposes).
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        tables = [f"{what}, {c.name}, one fwd+bwd a rep\n{h.profile_table(fn, s0['train'], device=ctx.device)}"
                  for what, fn in (("fp8 recipe", _fwd_bwd(RECIPE.grouped_mm)), ("bf16", _fwd_bwd(moe_kernels.grouped_mm)))]
        name = c.name.replace("/", "_")
        (ctx.out_dir / f"profile_fp8_recipe_{name}.txt").write_text("\n\n".join(tables) + "\n")
    # Bytes from the byte model (bench/bytes.py): every kernel's reads and writes, quantization included.
    fp8_bytes = byte_model.expert_gemm(c.E, c.N, c.K, Mp, recipe=RECIPE).bytes
    bf16_bytes = byte_model.expert_gemm(c.E, c.N, c.K, Mp).bytes
    # Its GEMMs run in FP8 (forward and dgrad): judged against the FP8 ceiling, as the GEMMs alone are.
    train = h.make_result(ctx, op="fp8_recipe_fwd_bwd", case=c.name, shape=c.shape(ctx.seed), dtype=torch.bfloat16,
                          ceiling="matmul_fp8" if ctx.ceilings().matmul_fp8_tflops else None,
                          timing=ours_train, nbytes=fp8_bytes, flops=3 * 2 * Mp * c.N * c.K,
                          peers={"moe_kernels_bf16": peer_train}, peer_variant={"moe_kernels_bf16": "grouped_mm fwd+bwd"})
    train.extra.update(bf16_bytes=bf16_bytes, bytes_vs_bf16=fp8_bytes / bf16_bytes)
    return [fwd, wgrad, train]


def _check_wgrad(c: bg.Case, args: tuple, run=None, what: str = "grouped_mm_fp8_wgrad") -> None:
    """Within fp32 rounding x FP8_MMA_MAGNITUDE of the fp64 reference (`run`, default the op), one expert at a
    time: the fp64 reference and its magnitude of all the local experts at once (2 x E*N*K fp64) do not fit an
    80 GB GPU beside the bench's buffers. Each group holds a whole number of 128-token scale blocks."""
    ours = (run or moe_kernels.grouped_mm_fp8_wgrad)(*args)
    a_q, a_s, b_q, b_s, sizes = args
    absq = lambda q: q.float().abs().to(torch.float8_e4m3fn)  # noqa: E731
    for e, (r0, n) in enumerate(_offsets(sizes.tolist())):
        cols, blocks = slice(r0, r0 + n), slice(r0 // 128, (r0 + n) // 128)
        part = (a_q[:, cols], a_s[:, blocks], b_q[:, cols], b_s[:, blocks], sizes[e : e + 1])
        ref64 = grouped_mm_fp8_wgrad_reference(*part, acc=torch.float64)
        magnitude = grouped_mm_fp8_wgrad_reference(absq(part[0]), part[1], absq(part[2]), part[3], part[4],
                                                   acc=torch.float64)
        assert_within_fp32_rounding(ours[e : e + 1], ref64, FP8_MMA_MAGNITUDE * magnitude,
                                    f"{c.name} {what} expert {e}")
        del ref64, magnitude


def headline(results: list[h.Result]) -> list[str]:
    lines = []
    for op in ("grouped_mm_fp8_fwd", "grouped_mm_fp8_wgrad", "fp8_recipe_fwd_bwd"):
        chosen = [r for r in results if r.op == op]
        if chosen:
            lines += _headline(op, chosen)
    return lines


def _headline(op: str, results: list[h.Result]) -> list[str]:
    picked = [r for r in results if r.case.startswith(HEADLINE_MODEL)] or results
    s = [r.speedup["moe_kernels_bf16"] for r in picked]
    geo = torch.tensor(s, dtype=torch.float64).log().mean().exp().item()
    best = max(r.tflops or 0.0 for r in picked)
    bar = f" ({BAR})" if op == "grouped_mm_fp8_fwd" else ""
    ratios = [r.extra["bytes_vs_bf16"] for r in picked if "bytes_vs_bf16" in r.extra]
    moved = f"; bytes moved {min(ratios):.2f}-{max(ratios):.2f}x the bf16 path's (byte model)" if ratios else ""
    return [f"{op} {picked[0].case.split('/')[0]}: {geo:.2f}x our bf16 grouped_mm (geomean over "
            f"{len(s)} cases), up to {best:.0f} TFLOP/s{bar}{moved}"]


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "grouped_mm_fp8", cases(ctx), run_case)
    return h.Report(results, headline(results) if results else [], failures, skipped)
