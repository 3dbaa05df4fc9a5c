"""tune_grouped_mm: sweeps the sm_90a grouped GEMM instances over the specs/perf.md shapes and writes the tuning
table the extension compiles in (csrc/gemm/sm90_table.h; the choice it drives: csrc/gemm/sm90_kernels.h).

Problems (one table row each): every perf.md model's local expert problem (bench_grouped_mm.MODELS: E / EP
experts), T in {4096, 8192, 16384, 32768} tokens, both expert GEMMs (w13: N = 2F, K = H; w2: N = H, K = F):
  bf16  fwd, dgrad, wgrad         M = T*k rows (the layer's permuted rows, align 1)
  fp8   fwd (bf16 out), wgrad (fp32 out, bf16 out)   M = T*k + min(E, T*k) * 127 (the FP8 path's 128-row
        alignment, the worst case the ops allocate without a host sync)
Candidates per problem: every compiled instance that serves its op and dtypes (C.grouped_mm_sm90_kernels())
x both raster orders (along M, along N). Each candidate runs on the same inputs under two routings of the M
rows (bench_grouped_mm.split_rows: uniform, and Zipf with empty experts; the FP8 groups rounded to 128 rows),
is checked against the table's current choice (bf16 precision: torch.testing's bf16 rtol, atol one bf16 unit
of the output's rms), then timed (CUDA events, L2 flushed by reading, median). The winner minimises the
geometric mean of its two routings' times; torch._grouped_mm's times (bf16) are recorded beside it. Order:
T = 8192 first, then 32768, 16384, 4096, so a sweep cut by its budget (--budget, default 230 s after the
ceilings) has the most used rows; rows it did not reach keep the rule's choice, marked untuned.

Output: <out>/tune_grouped_mm.json (every timing, the GPU, commit, date) and <out>/sm90_table.h; copy the latter
to csrc/gemm/sm90_table.h and rebuild to use it. Without an sm_90a GPU and a build with its instances, the run
prints the plan (problems, candidates) and writes nothing. `--rule` writes the rule's choice for every problem
as the table (every row untuned): the table a build ships before any GPU has swept it.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_kernels import _ext

from . import bench_grouped_mm as G
from . import harness as h

ROOT = Path(__file__).resolve().parent.parent
TABLE_PATH = ROOT / "csrc" / "gemm" / "sm90_table.h"
TOKENS = (4096, 8192, 16384, 32768)
SWEEP_ORDER = (8192, 32768, 16384, 4096)
OPS = {"fwd": 0, "dgrad": 1, "wgrad": 2}
OP_NAMES = {v: k for k, v in OPS.items()}
DTYPES = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8": 3}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CPP_OP = {0: "GemmOp::kFwd", 1: "GemmOp::kDgrad", 2: "GemmOp::kWgrad"}
CPP_DTYPE = {0: "DType::kFloat32", 1: "DType::kFloat16", 2: "DType::kBFloat16", 3: "DType::kFloat8E4M3"}
CPP_RASTER = {0: "Raster::kAlongM", 1: "Raster::kAlongN"}
RASTERS = (0, 1)
FP8_ALIGN = 128
BUDGET_S = 230.0
WARMUP, REPS = 3, 15


@dataclass(frozen=True)
class Problem:
    model: str
    T: int
    gemm: str  # w13 or w2
    op: int  # OPS
    dtype: int  # DTYPES: operands
    out: int  # DTYPES: output
    E: int
    M: int
    N: int
    K: int

    @property
    def name(self) -> str:
        suffix = "" if self.dtype != DTYPES["fp8"] else f"/fp8->{DTYPE_NAMES[self.out]}"
        return f"{self.model}/T{self.T}/{self.gemm}/{OP_NAMES[self.op]}{suffix}"

    @property
    def key(self) -> tuple:
        return (self.op, self.dtype, self.out, self.E, self.M, self.N, self.K)


def problems(models: dict | None = None, tokens=TOKENS) -> list[Problem]:
    """Every table row's problem (module docstring), distinct by key, in sweep order."""
    models = G.MODELS if models is None else models
    out, seen = [], set()
    for T in sorted(tokens, key=lambda t: SWEEP_ORDER.index(t) if t in SWEEP_ORDER else len(SWEEP_ORDER)):
        for m, (H, F, E_total, k, EP) in models.items():
            E = E_total // EP
            for gemm, (N, K) in (("w13", (2 * F, H)), ("w2", (H, F))):
                fp8_rows = T * k + min(E, T * k) * (FP8_ALIGN - 1)
                todo = [(OPS[op], DTYPES["bf16"], DTYPES["bf16"], T * k) for op in ("fwd", "dgrad", "wgrad")]
                todo += [(OPS["fwd"], DTYPES["fp8"], DTYPES["bf16"], fp8_rows),
                         (OPS["wgrad"], DTYPES["fp8"], DTYPES["fp32"], fp8_rows),
                         (OPS["wgrad"], DTYPES["fp8"], DTYPES["bf16"], fp8_rows)]
                for op, dt, o, M in todo:
                    p = Problem(m, T, gemm, op, dt, o, E, M, N, K)
                    if p.key not in seen:
                        seen.add(p.key)
                        out.append(p)
    return out


def candidates(p: Problem, kernels: list[dict]) -> list[tuple[str, int]]:
    """(kernel name, raster) for every instance serving p's op and dtypes, both raster orders."""
    return [(k["name"], r) for k in kernels if (k["op"], k["dtype"], k["out"]) == (p.op, p.dtype, p.out)
            for r in RASTERS]


def pick(times: dict[tuple[str, int], dict[str, float]]) -> tuple[str, int]:
    """The candidate with the least geometric mean of its routings' times (ties: the first listed)."""
    def score(item):
        return math.exp(sum(math.log(max(t, 1e-9)) for t in item[1].values()) / len(item[1]))
    return min(times.items(), key=score)[0]


# ---------------------------------------------------------------------------------------------------
# The table file


@dataclass(frozen=True)
class Row:
    op: int
    dtype: int
    out: int
    E: int
    M: int
    N: int
    K: int
    kernel: str
    raster: int
    tuned: bool
    label: str = ""


def render(rows: list[Row], source: str) -> str:
    """The C++ header the extension compiles (sm90_kernels.cu includes it)."""
    lines = [
        "// The sm_90a grouped GEMM tuning table: the instance and raster order for each perf.md problem.",
        "// Written by `python -m bench tune_grouped_mm` (bench/bench_tune_grouped_mm.py); edit by running it.",
        f"// Source: {source}",
        "// Fields: op, operand dtype, output dtype, E, M (rows for all groups), N, K, kernel, raster, tuned.",
        "// tuned = false: the rule's choice (sm90_kernels.cu, rule_sm90), written down until a GPU sweeps the shape.",
        "#pragma once",
        "",
        "const TableRow kSm90Table[] = {",
    ]
    for r in rows:
        lines.append(f"    {{{CPP_OP[r.op]}, {CPP_DTYPE[r.dtype]}, {CPP_DTYPE[r.out]}, {r.E}, {r.M}, {r.N}, {r.K}, "
                     f"\"{r.kernel}\", {CPP_RASTER[r.raster]}, {'true' if r.tuned else 'false'}}},"
                     + (f"  // {r.label}" if r.label else ""))
    lines += ["};", ""]
    return "\n".join(lines)


_ROW = re.compile(r"\{GemmOp::k(\w+), DType::k(\w+), DType::k(\w+), (\d+), (\d+), (\d+), (\d+), \"(\w+)\", "
                  r"Raster::kAlong([MN]), (true|false)\},(?:\s*// (.*))?")
_OP_OF = {"Fwd": 0, "Dgrad": 1, "Wgrad": 2}
_DT_OF = {"Float32": 0, "Float16": 1, "BFloat16": 2, "Float8E4M3": 3}


def parse(text: str) -> list[Row]:
    rows = []
    for m in _ROW.finditer(text):
        op, dt, out, E, M, N, K, kernel, raster, tuned, label = m.groups()
        rows.append(Row(_OP_OF[op], _DT_OF[dt], _DT_OF[out], int(E), int(M), int(N), int(K), kernel,
                        0 if raster == "M" else 1, tuned == "true", (label or "").strip()))
    return rows


def rule_rows(C, probs: list[Problem]) -> list[Row]:
    rows = []
    for p in probs:
        kernel, raster, _ = C.grouped_mm_sm90_rule(p.op, p.dtype, p.out, p.E, p.M, p.N, p.K)
        rows.append(Row(p.op, p.dtype, p.out, p.E, p.M, p.N, p.K, kernel, raster, False, p.name))
    return rows


def _any_extension():
    """The extension in use, else whichever is built (the choice is host code, the same in both); None if none."""
    C = _ext.extension()
    if C is None:
        try:
            from moe_kernels import _C_emu as C  # type: ignore[attr-defined]
        except ImportError:
            return None
    return C


def write_rule_table(path: Path = TABLE_PATH, C=None) -> Path:
    """The rule's choice for every problem as the table (no GPU needed)."""
    C = C or _any_extension()
    if C is None:
        raise SystemExit("tune_grouped_mm --rule needs a built extension (moe_kernels._C or _C_emu)")
    path.write_text(render(rule_rows(C, problems()), "the rule (no GPU has swept these shapes): every row untuned"))
    return path


# ---------------------------------------------------------------------------------------------------
# The GPU sweep


def _sizes(p: Problem, routing: str) -> tuple[int, ...]:
    if p.dtype != DTYPES["fp8"]:
        return G.split_rows(p.M, p.E, routing)
    # FP8: each group's rows padded to 128 (permute's alignment), the real rows T*k split as in bf16.
    real = G.split_rows(_fp8_real_rows(p), p.E, routing)
    return tuple((n + FP8_ALIGN - 1) // FP8_ALIGN * FP8_ALIGN for n in real)


def _fp8_real_rows(p: Problem) -> int:
    return p.T * G.MODELS[p.model][3]  # T*k


def _inputs(p: Problem, device: torch.device, seed: int) -> dict:
    """Operands for p (random, bf16 or quantized E4M3 with their dequantization scales)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if p.dtype == DTYPES["bf16"]:
        a_rows, a_cols = (p.M, p.K) if p.op == 0 else (p.M, p.N)
        a = torch.randn(a_rows, a_cols, device=device, generator=g, dtype=torch.bfloat16)
        if p.op == 2:
            b = torch.randn(p.M, p.K, device=device, generator=g, dtype=torch.bfloat16)
        else:
            b = torch.randn(p.E, p.N, p.K, device=device, generator=g, dtype=torch.bfloat16) / math.sqrt(p.K)
        return {"a": a, "b": b}
    from moe_kernels.ops.grouped_mm_fp8 import _inverse_scale, quantize_fp8_experts, quantize_fp8_tokens
    from moe_kernels.quant import quantize_fp8

    if p.op == 0:
        x = torch.randn(p.M, p.K, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(p.E, p.N, p.K, device=device, generator=g, dtype=torch.bfloat16) / math.sqrt(p.K)
        xq, xs = quantize_fp8(x, "block")
        wq, ws = quantize_fp8_experts(w)
        return {"a": xq, "b": wq, "sfa": _inverse_scale(xs), "sfb": _inverse_scale(ws)}
    dout = torch.randn(p.M, p.N, device=device, generator=g, dtype=torch.bfloat16)
    x = torch.randn(p.M, p.K, device=device, generator=g, dtype=torch.bfloat16)
    aq, as_ = quantize_fp8_tokens(dout)
    bq, bs = quantize_fp8_tokens(x)
    return {"a": aq, "b": bq, "sfa": _inverse_scale(as_).t().contiguous(), "sfb": _inverse_scale(bs).t().contiguous()}


def _runner(C, p: Problem, inp: dict, sizes: torch.Tensor, kernel: int, raster: int):
    """fn() -> the output of our kernel `kernel` on p."""
    from moe_kernels.ops.grouped_mm import _launch
    from moe_kernels.ops.grouped_mm_fp8 import _launch_fp8

    out_dtype = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}[p.out]
    shape = (p.M, p.N) if p.op == 0 else (p.M, p.K) if p.op == 1 else (p.E, p.N, p.K)
    out = torch.empty(shape, dtype=out_dtype, device=inp["a"].device)

    if p.dtype == DTYPES["fp8"]:
        def fn():
            if not _launch_fp8(C, p.op, inp["a"], inp["b"], out, inp["sfa"], inp["sfb"], sizes, p.M, p.N, p.K,
                               kernel=kernel, raster=raster):
                raise RuntimeError(f"{p.name}: the FP8 kernel does not take this problem")
            return out
    else:
        def fn():
            _launch(OP_NAMES[p.op], inp["a"], inp["b"], out, sizes, p.M, p.N, p.K, C, kernel=kernel, raster=raster)
            return out
    return fn


def _torch_peer(p: Problem, inp: dict, sizes: torch.Tensor):
    if p.dtype != DTYPES["bf16"] or not hasattr(torch, "_grouped_mm"):
        return None
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    f = G.TORCH_GROUPED_MM[OP_NAMES[p.op]]
    return lambda: f(inp["a"], inp["b"], offs)


def _valid_rows(p: Problem, t: torch.Tensor, total: int) -> torch.Tensor:
    return t if p.op == 2 else t[:total]


def _write(ctx: h.Context, C, meta: dict, rows: dict, records: list, failures: list) -> list[Row]:
    """The table (measured rows, the rule elsewhere) and every timing so far, rewritten after each problem so
    a run cut short keeps what it measured."""
    table = [rows.get(p.key) or r for p, r in zip(problems(), rule_rows(C, problems()))]
    source = (f"{meta.get('device_name', 'GPU')} {str(meta.get('date', ''))[:10]}, commit {meta.get('commit', '?')}"
              f"{' (dirty tree)' if meta.get('dirty') else ''}; {sum(r.tuned for r in table)} of {len(table)} "
              "rows tuned")
    (ctx.out_dir / "sm90_table.h").write_text(render(table, source))
    (ctx.out_dir / "tune_grouped_mm.json").write_text(json.dumps(
        {"meta": meta, "method": __doc__, "records": records, "failures": failures}, indent=1) + "\n")
    return table


def _gm(d: dict[str, float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in d.values()) / len(d))


def sweep(ctx: h.Context, C, budget_s: float) -> tuple[list[Row], list[dict], list[str]]:
    kernels = C.grouped_mm_sm90_kernels()
    ids = {k["name"]: i for i, k in enumerate(kernels)}
    probs = problems(*ctx.pick(G.MODELS, TOKENS)) if ctx.models or ctx.tokens else problems()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    meta = h.run_metadata(ctx)
    rows, records, failures = {}, [], []
    table = _write(ctx, C, meta, rows, records, failures)
    start = time.monotonic()
    for p in probs:
        if time.monotonic() - start > budget_s:
            print(f"TUNE budget of {budget_s:.0f} s spent: {p.name} and later rows keep the rule", flush=True)
            break
        current, _, _ = C.grouped_mm_sm90_choice(p.op, p.dtype, p.out, p.E, p.M, p.N, p.K)
        times: dict[tuple[str, int], dict[str, float]] = {}
        peer: dict[str, float] = {}
        try:
            inp = _inputs(p, ctx.device, ctx.seed)
            for routing in G.ROUTINGS:
                split = _sizes(p, routing)
                sizes = torch.tensor(split, dtype=torch.int32, device=ctx.device)
                expected = _runner(C, p, inp, sizes, ids[current], 0)().clone()
                for name, raster in candidates(p, kernels):
                    fn = _runner(C, p, inp, sizes, ids[name], raster)
                    G.check_close(f"{p.name}/{routing} {name}/{raster}", _valid_rows(p, fn().float(), sum(split)),
                                  _valid_rows(p, expected.float(), sum(split)))
                    t = h.time_fn(lambda *_: fn(), inputs_list=[()], warmup=WARMUP, reps=REPS, device=ctx.device,
                                  flush=ctx.flush)
                    times.setdefault((name, raster), {})[routing] = t.us
                peer_fn = _torch_peer(p, inp, sizes)
                if peer_fn is not None:
                    peer[routing] = h.time_fn(lambda *_: peer_fn(), inputs_list=[()], warmup=WARMUP, reps=REPS,
                                              device=ctx.device, flush=ctx.flush).us
            del inp
        except AssertionError as e:
            failures.append(f"{p.name}: {e}")
            h.release(ctx)
            continue
        except torch.OutOfMemoryError as e:
            h.skip_case("tune_grouped_mm", p.name, e, failures)
            h.release(ctx)
            continue
        best = pick(times)
        rows[p.key] = Row(p.op, p.dtype, p.out, p.E, p.M, p.N, p.K, best[0], best[1], True, p.name)
        records.append({"problem": asdict(p), "name": p.name, "rule": current, "best": list(best),
                        "times_us": {f"{k}/{'along_n' if r else 'along_m'}": v for (k, r), v in times.items()},
                        "torch_grouped_mm_us": peer})
        ratio = f", torch._grouped_mm / best {_gm(peer) / _gm(times[best]):.2f}x" if peer else ""
        print(f"TUNE {p.name}: best {best[0]} along {'N' if best[1] else 'M'} {_gm(times[best]):.1f} us, was "
              f"{current} {_gm(times[(current, 0)]):.1f} us{ratio}", flush=True)
        table = _write(ctx, C, meta, rows, records, failures)
        h.release(ctx)
    return table, records, failures


def run(ctx: h.Context, budget_s: float = BUDGET_S) -> h.Report:
    C = _ext.extension()
    plan_C = C or _any_extension()
    kernels = plan_C.grouped_mm_sm90_kernels() if plan_C is not None else []
    probs = problems()
    plan = (f"tune_grouped_mm: {len(probs)} problems, {sum(len(candidates(p, kernels)) for p in probs)} "
            f"candidates (instances x raster orders), 2 routings each")
    print(plan, flush=True)
    gpu_ok = (ctx.ours_runs_kernels and C is not None and C.grouped_mm_has_sm90
              and torch.cuda.get_device_capability(ctx.device) == (9, 0))
    if not gpu_ok:
        return h.Report([], [plan + "; not run: it needs an sm_90a GPU and a build with its instances "
                                    "(nothing written)"], [])
    table, records, failures = sweep(ctx, C, budget_s)
    rule = rule_rows(C, problems())
    changed = sum(r.tuned and (r.kernel, r.raster) != (rr.kernel, rr.raster) for r, rr in zip(table, rule))
    head = [f"tune_grouped_mm: {len(records)} of {len(table)} rows tuned, {changed} differ from the rule; table "
            f"written to {ctx.out_dir / 'sm90_table.h'} (copy to csrc/gemm/sm90_table.h and rebuild)"]
    return h.Report([], head, failures)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.bench_tune_grouped_mm",
                                 description="The tuning table without a GPU (`python -m bench tune_grouped_mm` "
                                             "sweeps on one).")
    ap.add_argument("--rule", action="store_true", help="write the rule's choice for every problem as the table")
    ap.add_argument("--out", type=Path, default=TABLE_PATH, help=f"where (default {TABLE_PATH.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    if not args.rule:
        ap.error("nothing to do: pass --rule (the GPU sweep is `python -m bench tune_grouped_mm`)")
    print(f"wrote {write_rule_table(args.out)}")


if __name__ == "__main__":
    main()
