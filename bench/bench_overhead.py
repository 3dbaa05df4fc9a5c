"""Host overhead of the MoE layer: microseconds of host work and the calls behind them, per layer fwd+bwd.

Three paths of the same MoELayer, on the same inputs:
  fused       the fused regions (moe_kernels.nn.fused): one autograd node per region, positional calls
              into the extension; the default eager path
  registered  the same layer through the registered custom ops (what torch.compile and export take)
  torch       the torch-native composition (MoEConfig(backend="torch"))
and the router alone (its region: the gating linear, top-k and losses, from x), fused region against registered ops.

Counted per layer fwd+bwd (steady state, after a warm-up call of the same shape):
  extension launches  calls into moe_kernels' extension that launch kernels (size queries excluded)
  aten ops            ATen ops dispatched (a TorchDispatchMode counts them; custom ops count as one each)
Timed, median of the reps:
  CPU  host_us: the CUDA code path on the CPU-executed build (MOE_KERNELS_EMULATE=1) with the extension's
       launches stubbed out (counted, not run), at small hidden sizes (the real E and k of each preset), so
       what remains is host work: Python, autograd, the dispatcher, allocations, and the tiny aten ops'
       CPU time. The pybind argument conversion of the real launches is not in it (the stub is a Python
       call). These are CPU numbers, not a GPU's.
  GPU  host issue time, kernel time and CUDA-graph replay time of one layer fwd+bwd (harness.time_modes),
       qwen3-30b-a3b at 8192 tokens by default (the bar: host issue time below the GPU time), and the
       router's gating linear alone (x @ W^T in fp32 from bf16 x, fwd+bwd: nn.gating.gating_linear) beside the router
       region (that linear included) at deepseek-v3 / 16384 tokens.
FP8 (the blockwise recipe's layer, bf16 weights, the weight cache on as moe-train has it: a later micro-batch,
every weight's codes a cache hit), three paths of the same layer:
  fp8             the `moe_fp8` fused region (moe_kernels.nn.fused_fp8): one autograd node, one extension call
                  each way (moe_fp8_fwd / moe_fp8_bwd)
  fp8_recipe      the recipe's autograd functions calling the ops' implementations straight (_ext.direct)
  fp8_registered  the recipe's functions through the registered custom ops
  On the CPU the stub also answers the FP8 GEMMs' path queries (grouped_mm_path, and the region's moe_fp8_path) as
  the sm_90a kernels would (the CPU-executed build has no FP8 GEMM and would run its dequantizing fallback: real
  fp32 GEMMs, not host work), at H = F = 128.
  Timed as above. Counted under the counting dispatch mode, where _ext.direct hands every op to the registered
  op (a dispatch mode observes ops), so the recipe's two paths count the same aten ops and the same extension calls
  (one a kernel); the region's count is its extension calls, each of which launches several kernels (the recipe's
  and rows_to_tokens, the slot of each permuted row, which the recipe's functions compute with aten ops, twice).
Bar (specs/perf.md via bench.bars, issue 25): host time per MoE layer fwd+bwd of the fused path at most
1/3 of the registered-op path's (CPU, reported, never asserted by a timed test).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import torch

from moe_kernels import _ext
from moe_kernels.nn import PRESETS, MoELayer, fused
from moe_kernels.nn.gating import gating_linear
from moe_kernels.testing import extension_calls

from . import harness as h

CPU_SIZES = dict(hidden_size=16, ffn_size=8)  # real E and k; tiny rows, so the aten ops' own CPU time is small
CPU_TOKENS = 64  # host work does not grow with T; the tiny aten ops' own CPU time does
GPU_MODELS = ("qwen3-30b-a3b",)
GPU_TOKENS = (8192,)
PATHS = ("fused", "registered", "torch")
FP8_PATHS = ("fp8", "fp8_recipe", "fp8_registered")
FP8_CPU_SIZES = dict(hidden_size=128, ffn_size=128)
BAR = "fused host time per layer fwd+bwd <= 1/3 of the registered-op path's (CPU)"


class _CountAten(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _layer(name: str, ctx: h.Context) -> MoELayer:
    kw = {} if ctx.is_cuda else dict(CPU_SIZES, shared_ffn_size=CPU_SIZES["ffn_size"] if name == "deepseek-v3" else 0)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    layer = MoELayer(PRESETS[name](**kw)).to(ctx.device, dtype)
    layer.router.float()
    return layer


def _path(layer: MoELayer, path: str) -> MoELayer:
    if path == "torch":
        other = MoELayer(layer.config.replace(backend="torch")).to(layer.experts.w13.device, layer.experts.w13.dtype)
        other.router.float()
        other.load_state_dict(layer.state_dict())
        return other
    return layer


def _fp8_layer(name: str, ctx: h.Context) -> MoELayer:
    from moe_kernels.quant import Fp8BlockwiseRecipe

    kw = {} if ctx.is_cuda else dict(FP8_CPU_SIZES, shared_ffn_size=FP8_CPU_SIZES["ffn_size"] if name == "deepseek-v3"
                                     else 0)
    torch.manual_seed(0)
    layer = MoELayer(PRESETS[name](**kw).replace(recipe=Fp8BlockwiseRecipe())).to(ctx.device, torch.bfloat16)
    layer.router.float()
    return layer


class _Fp8Recipe:
    """Inside, the FP8 layer runs the recipe's autograd functions (the `moe_fp8` region does not fit)."""

    def __enter__(self):
        from moe_kernels.nn import fused_fp8

        self.saved = fused_fp8.fits
        fused_fp8.fits = lambda *args: False

    def __exit__(self, *exc):
        from moe_kernels.nn import fused_fp8

        fused_fp8.fits = self.saved


class _Fp8Registered(_Fp8Recipe):
    """Inside, the FP8 layer runs the recipe's functions and they take the registered ops (_ext.direct forwards to
    them)."""

    def __enter__(self):
        super().__enter__()
        self.direct = _ext.direct
        _ext.direct = lambda op, t, *args: op(*args)

    def __exit__(self, *exc):
        _ext.direct = self.direct
        super().__exit__(*exc)


_FP8_MODES = {"fp8": None, "fp8_recipe": _Fp8Recipe, "fp8_registered": _Fp8Registered}


@contextlib.contextmanager
def _fp8_cache():
    """The weight cache on (moe-train's setting) for the FP8 paths, as it was after."""
    from moe_kernels.quant import weight_cache

    was = weight_cache.enabled()
    weight_cache.enable()
    try:
        yield
    finally:
        if not was:
            weight_cache.enable(False)


def _stub_fp8_paths(ext) -> None:
    """The stubbed CPU-executed extension answers the FP8 GEMMs' path query as the sm_90a kernel does (module
    docstring); a GPU's own extension answers for itself."""
    from moe_kernels.ops.grouped_mm_fp8 import _FP8_PATH

    if _ext._EMU is not ext:  # extension_calls put the counting stand-in in the CPU-executed build's place
        return

    fp8 = _ext.dtype_code(torch.float8_e4m3fn)
    real = ext._module.grouped_mm_path
    # (positional: op, dtype, ...; python_api/gemm.cpp)
    ext.grouped_mm_path = lambda *args, **kw: (_FP8_PATH if (args[1] if len(args) > 1 else kw.get("dtype")) == fp8
                                               else real(*args, **kw))
    ext.moe_fp8_path = lambda *args: True  # (the FP8 region's query over its GEMMs)


class _Registered:
    """Inside, launch_for answers None: every layer takes the registered ops."""

    def __enter__(self):
        self.saved = fused.launch_for
        fused.launch_for = lambda x: None

    def __exit__(self, *exc):
        fused.launch_for = self.saved


def _step_fn(layer: MoELayer, g: torch.Tensor):
    params = list(layer.parameters())

    def step(x):
        for p in params:  # as after zero_grad(set_to_none=True): no accumulation into old gradients
            p.grad = None
        x.grad = None
        out, aux = layer(x)
        ((out.float() * g).sum() + aux).backward()

    return step


def _router_fn(layer: MoELayer, seq_len: int):
    router = layer.router

    def step(x):
        launch = fused.launch_for(x)
        if launch is not None and not router._thin_path_fits(x, router.weight, launch):
            launch = None
        w, _, _, loss, _ = fused.run("router", launch, router, x, router.weight, seq_len)
        (w.sum() + loss).backward()

    return step


def _host_us(fn, x, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _count(fn, x, fp8_paths: bool = False) -> tuple[int, int]:
    """Extension launches and aten ops of one call of fn; for the FP8 paths after a first call, as timed (the
    weight cache holding every weight's codes)."""
    with extension_calls(stub=True) as ext:
        if fp8_paths:
            _stub_fp8_paths(ext)
            fn(x)
            ext.calls.clear()
        with _CountAten() as aten:
            fn(x)
    return sum(ext.calls.values()), aten.n


def _cpu_case(ctx: h.Context, name: str) -> dict:
    """Each path warmed up, then timed in interleaved rounds (drift of a shared CPU lands on every path alike);
    the median over all rounds."""
    base = _layer(name, ctx)
    T, H = CPU_TOKENS, base.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, generator=gen).requires_grad_()
    g = torch.randn(1, T, H, generator=gen)
    x_router = x.detach().view(T, H).requires_grad_()
    row = {"model": name, "T": T, "H": H, "E": base.config.num_experts, "k": base.config.router.k}
    rounds, reps, warmup = (1, 1, 1) if ctx.dry_run else (3, 10, 10) if ctx.quick else (8, 25, 10)
    jobs = []  # (key, fn, input, the context it runs in)
    for path in PATHS:
        layer = _path(base, path)
        jobs.append((f"layer_{path}", _step_fn(layer, g), x, _Registered if path == "registered" else None))
        if path != "torch":
            jobs.append((f"router_{path}", _router_fn(layer, T), x_router,
                         _Registered if path == "registered" else None))
    fp8 = _fp8_layer(name, ctx)
    H8 = fp8.config.hidden_size
    x8 = torch.randn(1, T, H8, generator=gen).to(torch.bfloat16).requires_grad_()
    g8 = torch.randn(1, T, H8, generator=gen)
    for path in FP8_PATHS:
        jobs.append((f"layer_{path}", _step_fn(fp8, g8), x8, _FP8_MODES[path]))
    times: dict[str, list[float]] = {key: [] for key, *_ in jobs}
    with extension_calls(stub=True) as ext, _fp8_cache():
        _stub_fp8_paths(ext)
        for r in range(rounds + 1):
            for key, fn, inp, mode in jobs:
                ctxm = mode() if mode else contextlib.nullcontext()
                with ctxm:
                    if r == 0:
                        for _ in range(warmup):  # workspace sizes, caches, the allocator
                            fn(inp)
                    else:
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            fn(inp)
                            times[key].append((time.perf_counter() - t0) * 1e6)
    for key, fn, inp, mode in jobs:
        row[f"{key}_host_us"] = statistics.median(times[key])
        with mode() if mode else contextlib.nullcontext(), _fp8_cache():
            row[f"{key}_launches"], row[f"{key}_aten_ops"] = _count(fn, inp, fp8_paths=key.startswith("layer_fp8"))
    row["layer_ratio"] = row["layer_fused_host_us"] / row["layer_registered_host_us"]
    row["fp8_H"], row["fp8_F"] = H8, fp8.config.ffn_size
    return row


def _gpu_case(ctx: h.Context, name: str, T: int) -> dict:
    base = _layer(name, ctx)
    H = base.config.hidden_size
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    dtype = base.experts.w13.dtype  # bf16 on a GPU
    xs = [(torch.randn(T, H, generator=gen, device=ctx.device, dtype=dtype).requires_grad_(),)
          for _ in range(ctx.n_input_sets)]
    g = torch.randn(T, H, generator=gen, device=ctx.device)
    row = {"model": name, "T": T, "H": H, "E": base.config.num_experts, "k": base.config.router.k}
    for path in PATHS:
        layer = _path(base, path)
        fn = _step_fn(layer, g)
        registered = _Registered() if path == "registered" else None
        if registered:
            registered.__enter__()
        try:
            m = ctx.time_modes(fn, xs)
            row[f"layer_{path}_launches"], row[f"layer_{path}_aten_ops"] = _count(fn, xs[0][0])
        finally:
            if registered:
                registered.__exit__()
        row[f"layer_{path}_host_us"], row[f"layer_{path}_kernel_us"] = m.host_us, m.kernel_us
        row[f"layer_{path}_graph_us"], row[f"layer_{path}_modes_note"] = m.graph_us, m.why_not
        del layer
    fp8 = _fp8_layer(name, ctx)
    H8 = fp8.config.hidden_size  # H on a GPU; the CPU's dry run has the FP8 layer's own small H
    xs8 = xs if H8 == H else [(torch.randn(T, H8, generator=gen, device=ctx.device, dtype=torch.bfloat16)
                               .requires_grad_(),) for _ in range(ctx.n_input_sets)]
    g8 = g if H8 == H else torch.randn(T, H8, generator=gen, device=ctx.device)
    for path in FP8_PATHS:
        fn = _step_fn(fp8, g8)
        mode = _FP8_MODES[path]
        with mode() if mode else contextlib.nullcontext(), _fp8_cache():
            m = ctx.time_modes(fn, xs8)
            row[f"layer_{path}_launches"], row[f"layer_{path}_aten_ops"] = _count(fn, xs8[0][0], fp8_paths=True)
        row[f"layer_{path}_host_us"], row[f"layer_{path}_kernel_us"] = m.host_us, m.kernel_us
        row[f"layer_{path}_graph_us"], row[f"layer_{path}_modes_note"] = m.graph_us, m.why_not
    row["layer_ratio"] = row["layer_fused_host_us"] / row["layer_registered_host_us"]
    return row


def _gating_case(ctx: h.Context, T: int = 16384) -> dict:
    """deepseek-v3 / 16384: the gating linear (x @ W^T in fp32 from bf16 x) beside the router region, which includes
    it."""
    H, E = 7168, 256
    router = _layer_router(ctx)
    x = torch.randn(T, H, device=ctx.device, dtype=torch.bfloat16).requires_grad_()
    w = router.weight

    def gating(x):
        gating_linear(x, w).sum().backward()

    def route(x):
        weights, _, _, loss, _ = fused.run("router", fused.launch_for(x), router, x, w, T)
        (weights.sum() + loss).backward()

    out = {"case": f"deepseek-v3/T{T}", "gating_flops_fwd": 2 * T * H * E, "gating_copy_bytes": T * H * (2 + 4)}
    for what, fn, inp in (("gating", gating, x), ("router", route, x)):
        m = ctx.time_modes(fn, [(inp,)])
        out.update({f"{what}_host_us": m.host_us, f"{what}_kernel_us": m.kernel_us, f"{what}_graph_us": m.graph_us})
    return out


def _layer_router(ctx: h.Context):
    from moe_kernels.nn import Router

    router = Router(PRESETS["deepseek-v3"]().router).to(ctx.device)
    router.expert_bias.copy_(0.01 * torch.randn(router.config.num_experts, device=ctx.device))
    return router


def run(ctx: h.Context) -> h.Report:
    failures: list[str] = []
    rows: list[dict] = []
    if not ctx.is_cuda and _ext.emulation() is None:
        failures.append("overhead on the CPU needs the CUDA code path: run with MOE_KERNELS_EMULATE=1")
        return h.Report([], [], failures)
    if ctx.is_cuda:
        models, tokens = ctx.pick({m: None for m in GPU_MODELS}, GPU_TOKENS)
        cases = [(m, T) for m in models for T in tokens]
    else:
        cases = [(m, CPU_TOKENS) for m in (("qwen3-30b-a3b", "deepseek-v3") if ctx.quick else PRESETS)]
    for i, (name, T) in enumerate(cases):
        try:
            rows.append(_gpu_case(ctx, name, T) if ctx.is_cuda else _cpu_case(ctx, name))
        except (AssertionError, RuntimeError) as e:
            failures.append(f"{name}/T{T}: {type(e).__name__}: {e}")
        ctx.case_done("overhead", i, len(cases))
    ctx.out_dir.mkdir(parents=True, exist_ok=True)

    def write(gating):  # the rows first, so a failure in the gating case keeps them
        (ctx.out_dir / "overhead_table.json").write_text(json.dumps(
            {"device": h.device_name(ctx), "meta": h.run_metadata(ctx), "rows": rows, "gating": gating,
             "method": __doc__}, indent=1) + "\n")

    write(None)
    gating = None
    if ctx.is_cuda:
        try:
            gating = _gating_case(ctx)
        except (AssertionError, RuntimeError, ValueError) as e:
            failures.append(f"gating linear case: {type(e).__name__}: {e}")
        write(gating)
    _print(ctx, rows, gating)
    where = "CPU, launches stubbed" if not ctx.is_cuda else h.device_name(ctx)
    head = []
    for r in rows:
        head.append(
            f"{r['model']}/T{r['T']} layer fwd+bwd host ({where}): fused {r['layer_fused_host_us']:.0f} us, "
            f"registered ops {r['layer_registered_host_us']:.0f} us ({r['layer_ratio']:.2f}x of it; bar <= 0.33x), "
            f"torch-native {r['layer_torch_host_us']:.0f} us; extension launches {r['layer_fused_launches']} vs "
            f"{r['layer_registered_launches']}; aten ops {r['layer_fused_aten_ops']} vs {r['layer_registered_aten_ops']}"
            + (f"; GPU time (kernels) {r['layer_fused_kernel_us']:.0f} us" if ctx.is_cuda and r.get('layer_fused_kernel_us') else ""))
        if "layer_fp8_host_us" in r:
            head.append(
                f"{r['model']}/T{r['T']} FP8 recipe layer fwd+bwd host ({where}, weight cache hit): fused region "
                f"{r['layer_fp8_host_us']:.0f} us, the recipe's functions {r['layer_fp8_recipe_host_us']:.0f} us "
                f"(direct calls), {r['layer_fp8_registered_host_us']:.0f} us (registered ops); extension launches "
                f"{r['layer_fp8_launches']} vs {r['layer_fp8_recipe_launches']}; aten ops {r['layer_fp8_aten_ops']} vs "
                f"{r['layer_fp8_recipe_aten_ops']}"
                + (f"; GPU time (kernels) {r['layer_fp8_kernel_us']:.0f} us" if ctx.is_cuda and r.get('layer_fp8_kernel_us') else ""))
    return h.Report([], head, failures)


def _print(ctx: h.Context, rows: list[dict], gating: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"MoE layer host overhead per fwd+bwd on {h.device_name(ctx)}"
                    + ("" if ctx.is_cuda else " (CPU: the CUDA code path, launches stubbed)"))
    cols = ["case"] + [f"{p} host us" for p in PATHS] + ["fused / registered"]
    if ctx.is_cuda:
        cols += [f"{p} kernel / graph us" for p in PATHS]
    else:
        cols += ["router fused / registered host us"]
    cols += [f"{p} launches / aten ops" for p in PATHS]
    for c in cols:
        t.add_column(c, justify="left" if c == "case" else "right")
    for r in rows:
        cells = [f"{r['model']}/T{r['T']}"] + [f"{r[f'layer_{p}_host_us']:.0f}" for p in PATHS] + [f"{r['layer_ratio']:.2f}x"]
        if ctx.is_cuda:
            cells += [f"{h._fmt(r[f'layer_{p}_kernel_us'], '.0f')} / {h._fmt(r[f'layer_{p}_graph_us'], '.0f')}" for p in PATHS]
        else:
            cells.append(f"{r['router_fused_host_us']:.0f} / {r['router_registered_host_us']:.0f}")
        cells += [f"{r[f'layer_{p}_launches']} / {r[f'layer_{p}_aten_ops']}" for p in PATHS]
        t.add_row(*cells)
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(t)
    for r in rows:
        extra = "" if ctx.is_cuda else f" router_fused_host_us={r['router_fused_host_us']:.1f} router_registered_host_us={r['router_registered_host_us']:.1f}"
        print(f"OVERHEAD {r['model']}/T{r['T']} " + " ".join(
            f"{p}:host_us={r[f'layer_{p}_host_us']:.1f},launches={r[f'layer_{p}_launches']},aten={r[f'layer_{p}_aten_ops']}"
            for p in PATHS + FP8_PATHS if f"layer_{p}_host_us" in r) + f" ratio={r['layer_ratio']:.3f}{extra}")
    if gating:
        print("GATING " + " ".join(f"{k}={v}" for k, v in gating.items()))


def markdown_rows(data: dict, dir_name: str) -> list[list[str]]:
    """README rows of one overhead_table.json (bench.readme's overhead block)."""
    meta = data.get("meta", {})
    cpu = meta.get("device") == "cpu"
    where = f"{'CPU, launches stubbed' if cpu else data['device']}, {str(meta.get('date', dir_name))[:10]}"
    commit = (meta.get("commit") or "?")[:7] + (" (dirty tree)" if meta.get("dirty") else "")
    out = []
    for r in data["rows"]:
        gpu = "" if cpu else (f"; kernels {h._fmt(r.get('layer_fused_kernel_us'), '.0f')} us, graph replay "
                              f"{h._fmt(r.get('layer_fused_graph_us'), '.0f')} us")
        out.append([where, f"{r['model']}/T{r['T']}", f"{r['layer_fused_host_us']:.0f}{gpu}",
                    f"{r['layer_registered_host_us']:.0f}", f"{r['layer_ratio']:.2f}x",
                    f"{r['layer_torch_host_us']:.0f}",
                    f"{r['layer_fused_launches']} / {r['layer_registered_launches']}",
                    f"{r['layer_fused_aten_ops']} / {r['layer_registered_aten_ops']}", _fp8_cell(r, cpu), commit])
    return out


def _fp8_cell(r: dict, cpu: bool) -> str:
    """The FP8 recipe layer's cell: host us on the fused region (tables before it: none) / the recipe's functions'
    direct calls / their registered ops, extension launches."""
    if "layer_fp8_host_us" not in r:
        return "-"
    gpu = "" if cpu else f"; kernels {h._fmt(r.get('layer_fp8_kernel_us'), '.0f')} us"
    if "layer_fp8_recipe_host_us" not in r:  # a table from before the fused region: fp8 was the direct calls
        return (f"- / {r['layer_fp8_host_us']:.0f} / {r['layer_fp8_registered_host_us']:.0f}{gpu}; "
                f"{r['layer_fp8_launches']} launches (H {r.get('fp8_H', r['H'])})")
    return (f"{r['layer_fp8_host_us']:.0f} / {r['layer_fp8_recipe_host_us']:.0f} / "
            f"{r['layer_fp8_registered_host_us']:.0f}{gpu}; {r['layer_fp8_launches']} launches (H {r.get('fp8_H', r['H'])})")


MARKDOWN_HEADER = ["where, date", "case", "fused regions: host us per fwd+bwd", "registered ops: host us",
                   "fused / registered (bar <= 0.33x)", "torch-native: host us", "extension launches: fused / registered",
                   "aten ops: fused / registered",
                   "FP8 recipe layer: host us fused region / recipe's functions / registered ops", "commit"]
