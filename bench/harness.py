"""The harness every bench file uses: timing, ceilings, correctness checks, results and reports.

Timing method (specs/perf.md):
- CUDA: `warmup` untimed calls (10; 5 with --quick), then `reps` timed calls (100; 30 with --quick),
  each between its own pair of CUDA events on the current stream. Before each timed call a buffer
  of twice the L2 size is overwritten outside the event pair, so nothing is still in L2 from the
  previous call, and the calls rotate over 3 pre-built input sets (random data, never zeros).
  There is one synchronisation after all reps, none between them: host launch latency overlaps the
  flush instead of being timed. Reported: the median, with p20 and p80.
- CPU: time.perf_counter around each call after one warm-up call, 5 reps (3 with --quick), one
  thread. The CPU run checks that the suite works; its numbers mean little.
- Ceilings, measured once per run: device copy bandwidth (a 512 MiB bf16 `copy_`, bytes read +
  written) and dense matmul TFLOP/s (bf16 8192^3 through torch.mm; fp8 through torch._scaled_mm
  with tensorwise scales and fast accumulation, where the GPU has fp8).
- Correctness is checked before timing with moe_kernels.testing's tolerance policy.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

import moe_kernels
from moe_kernels.testing import assert_exact

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Timing:
    us: float  # median
    p20_us: float
    p80_us: float


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float
    copy_bytes: int
    matmul_bf16_tflops: float
    matmul_shape: tuple[int, int, int]
    matmul_fp8_tflops: float | None  # None: no fp8 on this device (or on the CPU)


@dataclass
class Context:
    """One run: device, size of the sweep, where reports go, and the ceilings measured once."""

    device: torch.device
    quick: bool
    out_dir: Path
    seed: int = 0
    _ceilings: Ceilings | None = field(default=None, init=False, repr=False)
    _flush: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def ours_runs_kernels(self) -> bool:
        """False where moe_kernels' ops run their PyTorch references (CPU, or no compiled extension)."""
        return self.is_cuda and moe_kernels.has_cuda_kernels()

    @property
    def warmup(self) -> int:
        return (5 if self.quick else 10) if self.is_cuda else 1

    @property
    def reps(self) -> int:
        return (30 if self.quick else 100) if self.is_cuda else (3 if self.quick else 5)

    @property
    def n_input_sets(self) -> int:
        return 3 if self.is_cuda else 2

    def time(self, fn: Callable[..., Any], inputs_list: Sequence[tuple]) -> Timing:
        return time_fn(fn, inputs_list=inputs_list, warmup=self.warmup, reps=self.reps,
                       device=self.device, flush=self.l2_flush_buffer())

    def ceilings(self) -> Ceilings:
        if self._ceilings is None:
            self._ceilings = measure_ceilings(self)
        return self._ceilings

    def l2_flush_buffer(self) -> torch.Tensor | None:
        if self.is_cuda and self._flush is None:
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 64 << 20
            self._flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device=self.device)
        return self._flush


def time_fn(fn: Callable[..., Any], *, inputs_list: Sequence[tuple], warmup: int, reps: int,
            device: torch.device, flush: torch.Tensor | None = None) -> Timing:
    """Times fn(*inputs_list[i % len(inputs_list)]) as the module docstring describes."""
    n = len(inputs_list)
    for i in range(warmup):
        fn(*inputs_list[i % n])
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize(device)
        for i in range(reps):
            if flush is not None:
                flush.zero_()
            starts[i].record()
            fn(*inputs_list[i % n])
            ends[i].record()
        torch.cuda.synchronize(device)
        times_us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        times_us = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*inputs_list[i % n])
            times_us.append((time.perf_counter() - t0) * 1e6)
    p20, p50, p80 = np.percentile(times_us, [20, 50, 80])
    return Timing(us=float(p50), p20_us=float(p20), p80_us=float(p80))


def measure_ceilings(ctx: Context) -> Ceilings:
    dev = ctx.device
    # 512 MiB dwarfs the 50 MB L2 of an H100/H200; on the CPU a small copy keeps the run short.
    n = (256 << 20) if ctx.is_cuda else (4 << 20)
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * src.element_size()
    copy_us = ctx.time(lambda s, d: d.copy_(s), [(src, dst)]).us
    del src, dst

    m = 8192 if ctx.is_cuda else 256
    a = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    mm_us = ctx.time(lambda: torch.mm(a, b), [()]).us
    return Ceilings(
        copy_gbps=copy_bytes / _nonzero(copy_us) / 1e3,
        copy_bytes=copy_bytes,
        matmul_bf16_tflops=2 * m**3 / _nonzero(mm_us) / 1e6,
        matmul_shape=(m, m, m),
        matmul_fp8_tflops=_fp8_matmul_tflops(ctx, a, b),
    )


def _nonzero(us: float) -> float:
    # A CPU timer can read 0 for a tiny call; rates must stay finite.
    return max(us, 1e-3)


def _fp8_matmul_tflops(ctx: Context, a: torch.Tensor, b: torch.Tensor) -> float | None:
    if not ctx.is_cuda or torch.cuda.get_device_capability(ctx.device) < (8, 9):
        return None
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # _scaled_mm takes its second operand column-major
    one = torch.ones((), dtype=torch.float32, device=ctx.device)

    def mm():
        return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    try:
        mm()
    except (RuntimeError, TypeError):  # a torch or GPU without this fp8 path: no ceiling, not an error
        return None
    return 2 * a.shape[0] * a.shape[1] * b.shape[0] / _nonzero(ctx.time(mm, [()]).us) / 1e6


def check_exact(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """moe_kernels.testing.assert_exact, with the comparison done on the device first: a passing
    check of a multi-GB tensor then costs no copy to the host."""
    if ours.shape != ref.shape or ours.dtype != ref.dtype or not torch.equal(ours, ref):
        assert_exact(ours, ref, what)


def check_peer(what: str, peer: torch.Tensor, ref: torch.Tensor) -> None:
    """A peer may round differently from the reference, but must agree within its output dtype's
    precision (torch.testing's default tolerance for the dtype): it computes the same function."""
    torch.testing.assert_close(peer, ref, msg=lambda m: f"{what}: {m}")


@dataclass
class Result:
    op: str  # e.g. "permute_fwd"
    case: str  # e.g. "deepseek-v3/T8192/uniform"
    shape: dict[str, int]
    dtype: str
    us: float
    p20_us: float
    p80_us: float
    bytes: int  # each input read once + each output written once
    flops: int
    gbps: float
    tflops: float | None  # None for ops without GEMM work
    ceiling: str  # the measured ceiling pct_of_ceiling refers to
    pct_of_ceiling: float
    peer_us: dict[str, float]
    speedup: dict[str, float]  # peer time / our time
    peer_variant: dict[str, str] = field(default_factory=dict)  # which variant set the peer's time
    extra: dict[str, float] = field(default_factory=dict)  # other measurements of the case (e.g. peak memory)


@dataclass
class Report:
    results: list[Result]
    headline: list[str]
    failures: list[str]  # cases not timed because a correctness check failed


def model_sweep(ctx: Context, models: dict, cpu_models: dict, tokens: Sequence[int], quick_tokens: Sequence[int],
                cpu_tokens: Sequence[int] = (64,)) -> list[tuple]:
    """(model name, T, *model parameters) for every model and token count: the perf.md shapes on a GPU
    (`quick_tokens` with --quick), the tiny ones on the CPU."""
    if ctx.is_cuda:
        chosen, counts = models, (quick_tokens if ctx.quick else tokens)
    else:
        chosen, counts = cpu_models, cpu_tokens
    return [(m, T, *chosen[m]) for m in chosen for T in counts]


def run_cases(ctx: Context, family: str, cases: Sequence, run_case: Callable[[Context, Any], list]) -> tuple[list, list[str]]:
    """Runs each case; a case whose correctness check fails (AssertionError) is reported, not timed, and
    the other cases still run. Returns (results, failures)."""
    print(f"{family} on {ctx.device}: ours runs {'the CUDA kernels' if ctx.ours_runs_kernels else 'the reference'}")
    results, failures = [], []
    for c in cases:
        try:
            results += run_case(ctx, c)
        except AssertionError as e:
            failures.append(f"{c.name}: {e}")
    return results, failures


def make_result(ctx: Context, *, op: str, case: str, shape: dict[str, int], dtype: torch.dtype,
                timing: Timing, nbytes: int, flops: int, peers: dict[str, Timing],
                peer_variant: dict[str, str] | None = None) -> Result:
    c = ctx.ceilings()
    us = _nonzero(timing.us)
    gbps = nbytes / us / 1e3
    tflops = flops / us / 1e6 if flops else None
    # Judged against whichever ceiling binds: copy bandwidth, or matmul throughput for GEMMs.
    mem_bound = tflops is None or tflops / c.matmul_bf16_tflops < gbps / c.copy_gbps
    pct = 100 * (gbps / c.copy_gbps if mem_bound else tflops / c.matmul_bf16_tflops)
    return Result(
        op=op, case=case, shape=shape, dtype=str(dtype).removeprefix("torch."), us=timing.us,
        p20_us=timing.p20_us, p80_us=timing.p80_us, bytes=nbytes, flops=flops, gbps=gbps,
        tflops=tflops, ceiling="copy" if mem_bound else "matmul_bf16", pct_of_ceiling=pct,
        peer_us={p: t.us for p, t in peers.items()},
        speedup={p: _nonzero(t.us) / us for p, t in peers.items()},
        peer_variant=peer_variant or {},
    )


def device_name(ctx: Context) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else (platform.processor() or platform.machine())


def run_metadata(ctx: Context) -> dict[str, Any]:
    driver = None
    if ctx.is_cuda:
        driver = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                       f"--id={ctx.device.index or 0}"])
    commit = _cmd(["git", "rev-parse", "HEAD"])
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": ctx.device.type,
        "device_name": device_name(ctx),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "moe_kernels": getattr(moe_kernels, "__version__", None),
        "has_cuda_kernels": moe_kernels.has_cuda_kernels(),
        "ours": "cuda kernels" if ctx.ours_runs_kernels else "pytorch reference",
        "commit": commit,
        "dirty": bool(_cmd(["git", "status", "--porcelain", "--untracked-files=no"])) if commit else None,
        "quick": ctx.quick,
        "warmup": ctx.warmup,
        "reps": ctx.reps,
        "input_sets": ctx.n_input_sets,
        "l2_flush_bytes": ctx.l2_flush_buffer().numel() * 4 if ctx.is_cuda else 0,
    }


def _cmd(argv: list[str]) -> str | None:
    try:
        p = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def report(ctx: Context, name: str, rep: Report) -> tuple[Path, Path]:
    """Prints the table, one `RESULT` line per case, `GEOMEAN` per op and peer, `HEADLINE` and
    `FAILED` lines; writes bench_<name>.json and bench_<name>.png under ctx.out_dir."""
    from rich.console import Console
    from rich.table import Table

    c, results = ctx.ceilings(), rep.results
    ops = list(dict.fromkeys(r.op for r in results))
    peers = sorted({p for r in results for p in r.speedup}, key=lambda p: (p != "torch_eager", p))
    title = (f"{name} on {device_name(ctx)} (ours: {'cuda kernels' if ctx.ours_runs_kernels else 'reference'}):"
             f" copy {c.copy_gbps:.0f} GB/s, bf16 matmul {c.matmul_bf16_tflops:.1f} TFLOP/s")
    table = Table(title=title)
    for col in ("op", "case", "us (p20-p80)", "GB/s", "TFLOP/s", "% of ceiling", *(f"vs {p}" for p in peers)):
        table.add_column(col, justify="left" if col in ("op", "case") else "right")
    for r in results:
        table.add_row(r.op, r.case, f"{r.us:.1f} ({r.p20_us:.1f}-{r.p80_us:.1f})", f"{r.gbps:.1f}",
                      _fmt(r.tflops, ".1f"), f"{r.pct_of_ceiling:.1f}% {r.ceiling}",
                      *(_fmt(r.speedup.get(p), ".2f", "x") for p in peers))
    console = Console()
    (console if console.is_terminal else Console(width=170)).print(table)

    for r in results:
        dims = " ".join(f"{k}={v}" for k, v in r.shape.items())
        vs = " ".join(f"{p}={s:.2f}x" for p, s in r.speedup.items())
        print(f"RESULT {r.op} {r.case} {dims} {r.dtype} us={r.us:.2f} GB/s={r.gbps:.1f} "
              f"TFLOP/s={_fmt(r.tflops, '.2f')} {r.ceiling}%={r.pct_of_ceiling:.1f} {vs}")
    for op in ops:
        for p in peers:
            s = [r.speedup[p] for r in results if r.op == op and p in r.speedup]
            if s:
                print(f"GEOMEAN {op} vs {p}: {math.exp(statistics.fmean(map(math.log, s))):.2f}x over {len(s)} cases")
    for line in rep.headline:
        print(f"HEADLINE {line}")
    for line in rep.failures:
        print(f"FAILED {line}")

    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = ctx.out_dir / f"bench_{name}.json", ctx.out_dir / f"bench_{name}.png"
    payload = {"suite": name, "meta": run_metadata(ctx), "ceilings": asdict(c), "method": __doc__,
               "headline": rep.headline, "failures": rep.failures, "results": [asdict(r) for r in results]}
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    plot(results, c, png_path, title=title)
    print(f"wrote {json_path} and {png_path}")
    return json_path, png_path


def plot(results: list[Result], c: Ceilings, path: Path, *, title: str) -> None:
    """One row per op: GB/s per case against the copy ceiling, and speedup per peer against 1x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in results)) or ["(no results)"]
    n_cases = max(sum(r.op == op for r in results) for op in ops)
    fig, axes = plt.subplots(len(ops), 2, squeeze=False, figsize=(max(12, 0.9 * n_cases), 4.5 * len(ops)))
    for (ax_bw, ax_sp), op in zip(axes, ops):
        rs = [r for r in results if r.op == op]
        x = np.arange(len(rs))
        ax_bw.bar(x, [r.gbps for r in rs], color="tab:blue")
        ax_bw.axhline(c.copy_gbps, color="tab:red", linestyle="--", label=f"copy {c.copy_gbps:.0f} GB/s")
        ax_bw.set(ylabel="GB/s", title=f"{op}: bandwidth")
        ax_bw.legend(loc="lower right", fontsize="small")
        peers = list(dict.fromkeys(p for r in rs for p in r.speedup))
        width = 0.8 / max(1, len(peers))
        for i, p in enumerate(peers):
            ax_sp.bar(x + (i - (len(peers) - 1) / 2) * width, [r.speedup.get(p, 0.0) for r in rs], width,
                      label=p)
        ax_sp.axhline(1.0, color="black", linewidth=0.8)
        ax_sp.set(ylabel="speedup (peer time / ours)", title=f"{op}: speedup")
        if peers:
            ax_sp.legend(loc="upper right", fontsize="small")
        for ax in (ax_bw, ax_sp):
            ax.set_xticks(x, [r.case for r in rs], rotation=90, fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
