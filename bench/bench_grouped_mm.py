"""grouped_mm bf16: forward, dgrad and wgrad, at the specs/perf.md "Grouped GEMM" shapes.

Cases: for each model the local expert problem of expert parallelism, E_local = E / EP experts
(EP = 8 for deepseek-v3 and qwen3-235b, 1 otherwise) and M = T*k rows in total, T in {4096, 8192,
16384} tokens (8192 with --quick); two GEMMs per model, w13 (N = 2F, K = H) and w2 (N = H, K = F);
two splits of the M rows over the experts: uniform (equal groups) and zipf (a multinomial split with
P(rank r) ~ 1/r^1.2, the coldest eighth of the experts given no rows, so empty groups are included,
and ranks shuffled over the experts). The three ops are the registered ops, each timed alone (never
through autograd):
  grouped_mm_fwd    out[M, N]    = x[M, K] @ w[e]^T per group       (torch.ops.moe_kernels.grouped_mm)
  grouped_mm_dgrad  dx[M, K]     = dout[M, N] @ w[e] per group      (torch.ops.moe_kernels.grouped_mm_dgrad)
  grouped_mm_wgrad  dw[E, N, K]  = dout[rows of e]^T @ x[rows of e] (torch.ops.moe_kernels.grouped_mm_wgrad)
FLOPs = 2*M*N*K per op (M = sum(group_sizes)). Bytes, each input read once and each output written
once (bf16, group_sizes 4 B each; only non-empty experts' weights are read):
  fwd    x M*K + w E_live*N*K + group_sizes E     -> out M*N
  dgrad  dout M*N + w E_live*N*K + group_sizes E  -> dx M*K
  wgrad  dout M*N + x M*K + group_sizes E         -> dw E*N*K
Peers, timed in the same run on the same inputs:
  torch_grouped_mm  torch._grouped_mm with offs = cumsum(group_sizes) as int32, computed once per
                    case outside the timing: fwd _grouped_mm(x, w.transpose(-2, -1), offs), dgrad
                    _grouped_mm(dout, w, offs), wgrad _grouped_mm(dout.t(), x, offs). Where torch
                    lacks it, or it fails or disagrees with the reference on a small probe (or raises
                    on a case), it is left out for that op and the reason recorded (`peer_skipped`
                    per result, a `note:` line after the headline).
  expert_loop       one torch.mm per non-empty expert into slices of one output, the sizes known on
                    the host in advance (generous to the peer: no device-to-host copy of the sizes).
  dense_mm          one dense torch.mm of equal FLOPs in the op's own layout (fwd x[M, K] @ W[N, K]^T,
                    dgrad dout[M, N] @ W[N, K], wgrad dout^T[N, M] @ x[M, K]): the ceiling at this
                    size; its "speedup" is the fraction of dense cuBLAS throughput we reach.
  reference         moe_kernels' per-expert reference loops called directly, on the CPU only.
  portable_mma      (where ours runs its kernels) ours with the tensor-core portable kernel named (portable=1,
                    csrc/gemm/portable_mma.cuh: mma.sync m16n8k16 and ldmatrix, 128x128x32 tiles): what an A100,
                    L40 or RTX GPU runs with MOE_KERNELS_PORTABLE_MMA=1, timed on this GPU beside the kernel
                    this GPU takes; checked against the baseline like ours before timing. On a Hopper GPU
                    mma.sync runs below WGMMA's rate, so its speedup says how far it is from the sm_90a kernels,
                    not how it does on an A100.
  portable_mma_2_stages  (where portable_mma runs) the same kernel with 2 shared-memory stages
                    (MOE_KERNELS_MMA_STAGES=2) instead of as many as fit (4 on an A100, H100 or B200): what the
                    deeper cp.async pipeline gains; checked bit for bit against portable_mma before timing.
  expert_order      (wgrad, where ours runs its kernels) ours with the groups visited in expert order
                    (group_order=0) instead of the default, largest first: the same kernel and bits (checked
                    equal), timed to show what visiting the largest groups first gains under skewed routing
                    (the `expert_order` speedup > 1 where it helps; one headline line over the zipf cases).
`pct_of_ceiling` is against the harness's ceiling (the dense 8192^3 bf16 matmul for a GEMM); `pct_of_dense`
against dense_mm.
Checked before timing, on the first input set (x, dout ~ randn, w ~ randn / sqrt(K)):
  - every case: ours against torch._grouped_mm (the expert loop where torch's peer is left out) within
    bf16 precision: torch.testing's bf16 rtol 1.6e-2, atol one bf16 unit (2^-8) of the expected
    output's rms (torch's fixed 1e-5 assumes outputs of magnitude ~1; wgrad sums over a group's rows
    and grows with their square root). Rows past sum(group_sizes) are not compared.
  - the first case of each op, GEMM (w13, w2) and routing: ours against the fp64 reference with
    moe_kernels.testing's policy (assert_close_to_fp64: our max error at most 2x the torch peer's,
    + 1e-3), the errors computed on the device.
  - the torch._grouped_mm and expert_loop peers against the reference on a small probe with an
    empty group (E=4, M=64, N=32, K=48), once per run.
A case's op that fails a check is reported (FAILED) instead of timed; the other ops still are.
`kernel_path` per result: which of our kernels ran (portable, sm90_pingpong, sm90_cooperative, from
the extension's grouped_mm_path, then the sm_90a instance and raster order the tuning table chose), or
"reference" where ours runs the PyTorch reference.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_kernels import _ext
from moe_kernels.ops.grouped_mm import _OPS as OP_CODES
from moe_kernels.ops.grouped_mm import (grouped_mm_dgrad_reference, grouped_mm_reference,
                                        grouped_mm_wgrad_reference)
from moe_kernels.testing import ULP_FLOOR, assert_close_to_fp64

from . import bars
from . import harness as h

# name: (H, F (expert FFN), E, k, EP)
MODELS = {
    "deepseek-v3": (7168, 2048, 256, 8, 8),
    "qwen3-235b": (4096, 1536, 128, 8, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 1),
    "mixtral-8x7b": (4096, 14336, 8, 2, 1),
    "gpt-oss-120b": (2880, 2880, 128, 4, 1),
}
TOKENS = (4096, 8192, 16384)
# Tiny shapes keep the CPU run (CI) to seconds: tiny has E_local=4, M=64, w13 N=32, K=48; tiny-ep
# has EP=2 (E_local=8). N and K stay multiples of 8, as torch._grouped_mm's strides must be.
CPU_MODELS = {"tiny": (48, 16, 4, 2, 1), "tiny-ep": (64, 24, 16, 4, 2)}
CPU_TOKENS = (32, 64)
ROUTINGS = ("uniform", "zipf")
GEMMS = ("w13", "w2")
OPS = ("fwd", "dgrad", "wgrad")
OP_NAMES = {op: f"grouped_mm_{op}" for op in OPS}
ZIPF_EXPONENT = 1.2
EMPTY_FRACTION = 8  # the coldest E // 8 experts (at least one) get no rows in the zipf split

_BAR = bars.bar("grouped_mm")
BAR_TORCH_GEOMEAN = _BAR.threshold("speedup:torch_grouped_mm", "geomean over the perf.md shapes").value
BAR_TORCH_MIN = _BAR.threshold("speedup:torch_grouped_mm", "every case").value
BAR_TORCH = f">= {BAR_TORCH_GEOMEAN:g}x torch._grouped_mm geomean, no case < {BAR_TORCH_MIN:g}x"
BAR_DENSE_PCT = _BAR.threshold("pct_of_dense").value
BAR_DENSE = f">= {BAR_DENSE_PCT:g}%"
LARGE_GROUP_ROWS = 1024  # the dense bar applies where every group holds at least this many rows
CPU_LARGE_GROUP_ROWS = 16  # the tiny CPU shapes: exercises the same headline line

BF16_RTOL = 1.6e-2  # torch.testing's default rtol for bf16
FP64_FLOOR = 1e-3
PATHS = {0: "portable", 1: "sm90_pingpong", 2: "sm90_cooperative"}
_CHUNK = 1 << 26  # elements per piece when comparing huge outputs on the device


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    H: int
    F: int
    E_total: int
    k: int
    EP: int
    routing: str  # "uniform" or "zipf"
    gemm: str  # "w13" or "w2"

    @property
    def E(self) -> int:
        return self.E_total // self.EP

    @property
    def M(self) -> int:
        return self.T * self.k

    @property
    def N(self) -> int:
        return 2 * self.F if self.gemm == "w13" else self.H

    @property
    def K(self) -> int:
        return self.H if self.gemm == "w13" else self.F

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}/{self.routing}/{self.gemm}"

    def sizes(self, seed: int) -> tuple[int, ...]:
        return split_rows(self.M, self.E, self.routing, seed)

    def shape(self, seed: int) -> dict[str, int]:
        s = self.sizes(seed)
        return dict(T=self.T, EP=self.EP, E=self.E, M=self.M, N=self.N, K=self.K, min_rows=min(s),
                    max_rows=max(s), empty=sum(n == 0 for n in s))


def cases(ctx: h.Context) -> list[Case]:
    """Every model x tokens x routing x GEMM."""
    if ctx.is_cuda:
        models, tokens = ctx.pick(MODELS, (8192,) if ctx.quick else TOKENS)
    else:
        models, tokens = CPU_MODELS, (CPU_TOKENS[:1] if ctx.quick else CPU_TOKENS)
    return [Case(m, T, *models[m], r, g) for m in models for T in tokens for r in ROUTINGS for g in GEMMS]


@functools.lru_cache(maxsize=None)
def split_rows(M: int, E: int, routing: str, seed: int = 0) -> tuple[int, ...]:
    """Rows per expert, summing to M: equal groups, or a Zipf-like multinomial split with empty experts."""
    if routing == "uniform":
        return tuple(M // E + (e < M % E) for e in range(E))
    if routing != "zipf":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** ZIPF_EXPONENT
    if E > 1:
        p[E - max(1, E // EMPTY_FRACTION):] = 0.0
    counts = torch.bincount(torch.multinomial(p, M, replacement=True, generator=g), minlength=E)
    return tuple(counts[torch.randperm(E, generator=g)].tolist())  # hot experts anywhere, not first


# ---------------------------------------------------------------------------------------------------
# Implementations. Each op takes (a, b) from the input set, as ours does: fwd (x, w), dgrad (dout, w),
# wgrad (dout, x); ours and the reference also take group_sizes, torch._grouped_mm takes offs.


def _operands(op: str, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return {"fwd": (s["x"], s["w"]), "dgrad": (s["dout"], s["w"]), "wgrad": (s["dout"], s["x"])}[op]


OURS: dict[str, Callable] = {
    "fwd": torch.ops.moe_kernels.grouped_mm,
    "dgrad": torch.ops.moe_kernels.grouped_mm_dgrad,
    "wgrad": torch.ops.moe_kernels.grouped_mm_wgrad,
}
REFERENCE: dict[str, Callable] = {
    "fwd": grouped_mm_reference,
    "dgrad": grouped_mm_dgrad_reference,
    "wgrad": grouped_mm_wgrad_reference,
}


def torch_grouped_mm_fwd(x, w, offs):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def torch_grouped_mm_dgrad(dout, w, offs):
    return torch._grouped_mm(dout, w, offs=offs)


def torch_grouped_mm_wgrad(dout, x, offs):
    return torch._grouped_mm(dout.t(), x, offs=offs)


TORCH_GROUPED_MM: dict[str, Callable] = {
    "fwd": torch_grouped_mm_fwd, "dgrad": torch_grouped_mm_dgrad, "wgrad": torch_grouped_mm_wgrad,
}
TORCH_VARIANT = {
    "fwd": "_grouped_mm(x, w.transpose(-2, -1), offs)",
    "dgrad": "_grouped_mm(dout, w, offs)",
    "wgrad": "_grouped_mm(dout.t(), x, offs)",
}


def expert_loop(op: str, sizes: tuple[int, ...]) -> Callable:
    """fn(a, b): one torch.mm per non-empty expert, into row slices (fwd, dgrad) or dw[e] (wgrad)."""
    spans, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            spans.append((e, slice(start, start + n)))
        start += n
    total, empty = start, [e for e, n in enumerate(sizes) if n == 0]

    def fwd(x, w):
        out = x.new_empty((x.shape[0], w.shape[1]))  # rows past the groups are unspecified, as in ours
        for e, rows in spans:
            torch.mm(x[rows], w[e].t(), out=out[rows])
        return out

    def dgrad(dout, w):
        dx = dout.new_empty((dout.shape[0], w.shape[2]))
        for e, rows in spans:
            torch.mm(dout[rows], w[e], out=dx[rows])
        if total < dx.shape[0]:
            dx[total:].zero_()
        return dx

    def wgrad(dout, x):
        dw = dout.new_empty((len(sizes), dout.shape[1], x.shape[1]))
        for e, rows in spans:
            torch.mm(dout[rows].t(), x[rows], out=dw[e])
        for e in empty:
            dw[e].zero_()
        return dw

    return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}[op]


def wgrad_expert_order(c: Case, group_sizes: torch.Tensor) -> Callable:
    """fn(dout, x): ours' wgrad with the groups visited in expert order (group_order=0), into a fresh output
    as the op allocates it."""
    from moe_kernels.ops.grouped_mm import _launch

    def fn(dout, x):
        out = torch.empty((c.E, c.N, c.K), dtype=dout.dtype, device=dout.device)
        _launch("wgrad", dout, x, out, group_sizes, c.M, c.N, c.K, _ext.kernels(OP_NAMES["wgrad"], dout),
                group_order=0)
        return out

    return fn


def portable_mma(op: str, c: Case, group_sizes: torch.Tensor) -> Callable:
    """fn(a, b): ours with the tensor-core portable kernel named (portable=1), into a fresh output as the op
    allocates it: the kernel an A100, L40 or RTX GPU runs (with MOE_KERNELS_PORTABLE_MMA=1), timed on this GPU."""
    from moe_kernels.ops.grouped_mm import _launch

    shape = {"fwd": (c.M, c.N), "dgrad": (c.M, c.K), "wgrad": (c.E, c.N, c.K)}[op]

    def fn(a, b):
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
        _launch(op, a, b, out, group_sizes, c.M, c.N, c.K, _ext.kernels(OP_NAMES[op], a), portable=1)
        return out

    return fn


@contextlib.contextmanager
def mma_stages(count: str):
    """MOE_KERNELS_MMA_STAGES (read by the launcher at every call) set to `count` inside the block."""
    saved = os.environ.get("MOE_KERNELS_MMA_STAGES")
    os.environ["MOE_KERNELS_MMA_STAGES"] = count
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MOE_KERNELS_MMA_STAGES"]
        else:
            os.environ["MOE_KERNELS_MMA_STAGES"] = saved


def dense_mm(op: str) -> tuple[Callable, Callable]:
    """(fn, operands from an input set): one dense matmul with the op's FLOPs and layout."""
    return {
        "fwd": (lambda x, wd: torch.mm(x, wd.t()), lambda s: (s["x"], s["wd"])),
        "dgrad": (lambda dout, wd: torch.mm(dout, wd), lambda s: (s["dout"], s["wd"])),
        "wgrad": (lambda dout, x: torch.mm(dout.t(), x), lambda s: (s["dout"], s["x"])),
    }[op]


# ---------------------------------------------------------------------------------------------------
# Checks


def _pieces(*ts: torch.Tensor):
    flat = [t.reshape(-1) for t in ts]
    for i in range(0, flat[0].numel(), _CHUNK):
        yield i, [f[i : i + _CHUNK] for f in flat]


def _rms(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    total = sum(float(p.double().square().sum()) for _, (p,) in _pieces(t))
    return math.sqrt(total / t.numel())


def check_close(what: str, actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = BF16_RTOL,
                atol: float | None = None) -> None:
    """|actual - expected| <= atol + rtol * |expected| everywhere (NaN fails), compared on the device
    in pieces so an output of several GB needs no copy to the host. atol defaults to one bf16 unit of
    expected's rms (at least 1e-5, torch.testing's bf16 atol)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if atol is None:
        atol = max(1e-5, 2.0**-8 * _rms(expected))
    n_bad, first = 0, None
    for i, (a, e) in _pieces(actual, expected):
        a, e = a.float(), e.float()
        bad = ~((a - e).abs() <= atol + rtol * e.abs())
        nb = int(bad.sum())
        if nb and first is None:
            j = int(torch.nonzero(bad)[0])
            first = (i + j, a[j].item(), e[j].item())
        n_bad += nb
    if n_bad:
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(first[0]), tuple(actual.shape)))
        raise AssertionError(f"{what}: {n_bad} of {actual.numel()} elements beyond rtol {rtol:g}, atol {atol:.3g}; "
                             f"first at {idx}: {first[1]} vs {first[2]}")


def _max_err(t: torch.Tensor, ref64: torch.Tensor) -> float:
    return max((float((a.double() - r).abs().max()) for _, (a, r) in _pieces(t, ref64) if a.numel()), default=0.0)


def check_fp64(what: str, ours: torch.Tensor, baseline: torch.Tensor, ref64: torch.Tensor,
               floor: float = FP64_FLOOR) -> None:
    """moe_kernels.testing.assert_close_to_fp64, with the errors computed on the device first: a
    passing check of a multi-GB tensor then costs no copy to the host."""
    assert ours.shape == baseline.shape == ref64.shape, f"{what}: shapes {ours.shape}, {baseline.shape}, {ref64.shape}"
    mine, theirs = _max_err(ours, ref64), _max_err(baseline, ref64)
    ulps = ULP_FLOOR * max((float(r.abs().max()) for _, (r,) in _pieces(ref64) if r.numel()), default=0.0)
    if mine > 2 * theirs + floor + ulps:
        assert_close_to_fp64(ours, baseline, ref64, what, floor=floor)  # raises with the policy's message
        raise AssertionError(f"{what}: max error {mine:.3g} > 2 x torch's {theirs:.3g} (+{floor:g} +{ulps:.3g})")


def _probe_inputs(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1234)
    E, M, N, K = 4, 64, 32, 48
    gs = torch.tensor([10, 0, 30, 24], dtype=torch.int32, device=device)
    return {
        "x": torch.randn(M, K, generator=g, device=device).to(torch.bfloat16),
        "w": (torch.randn(E, N, K, generator=g, device=device) / K**0.5).to(torch.bfloat16),
        "dout": torch.randn(M, N, generator=g, device=device).to(torch.bfloat16),
        "group_sizes": gs,
        "offs": torch.cumsum(gs, 0, dtype=torch.int32),
    }


def _rows(op: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """The defined part of an op's output: rows past the groups are unspecified in fwd (and in the peers')."""
    return t if op == "wgrad" else t[:n]


def torch_peer_status(ctx: h.Context) -> dict[str, str | None]:
    """op -> None where torch._grouped_mm is timed, else why not: missing, a signature without offs,
    or it raises or disagrees with the reference on a small probe with an empty group."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return {op: f"torch {torch.__version__} has no torch._grouped_mm" for op in OPS}
    try:
        schema = str(torch.ops.aten._grouped_mm.default._schema)
    except (AttributeError, RuntimeError):
        schema = ""
    if "offs" not in schema:
        return {op: f"torch._grouped_mm's signature has no offs: {schema or 'unknown'}" for op in OPS}
    s = _probe_inputs(ctx.device)
    n = int(s["group_sizes"].sum())
    status: dict[str, str | None] = {}
    for op in OPS:
        a, b = _operands(op, s)
        try:
            out = TORCH_GROUPED_MM[op](a, b, s["offs"])
            ref = REFERENCE[op](a, b, s["group_sizes"])
            check_close(f"torch._grouped_mm {op} probe", _rows(op, out, n), _rows(op, ref, n))
            status[op] = None
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError) as e:
            status[op] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return status


def check_expert_loop(ctx: h.Context) -> None:
    s = _probe_inputs(ctx.device)
    sizes = tuple(s["group_sizes"].tolist())
    for op in OPS:
        a, b = _operands(op, s)
        n = sum(sizes)
        check_close(f"expert_loop {op} probe", _rows(op, expert_loop(op, sizes)(a, b), n),
                    _rows(op, REFERENCE[op](a, b, s["group_sizes"]), n))


# ---------------------------------------------------------------------------------------------------
# One case


@dataclass
class GemmResult(h.Result):
    kernel_path: str | None = None  # which of our kernels ran, or "reference"
    pct_of_dense: float | None = None  # 100 * dense_mm time / ours: % of dense throughput at equal FLOPs
    peer_skipped: dict[str, str] = field(default_factory=dict)  # peer -> why it was not timed


def make_inputs(ctx: h.Context, c: Case, seed: int, group_sizes: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    dev, bf16 = ctx.device, torch.bfloat16
    return {
        "x": torch.randn(c.M, c.K, generator=g, device=dev, dtype=bf16),  # [M, K]
        "w": torch.randn(c.E, c.N, c.K, generator=g, device=dev, dtype=bf16).div_(c.K**0.5),  # [E, N, K]
        "dout": torch.randn(c.M, c.N, generator=g, device=dev, dtype=bf16),  # [M, N]
        "wd": torch.randn(c.N, c.K, generator=g, device=dev, dtype=bf16).div_(c.K**0.5),  # dense peer's weight
        "group_sizes": group_sizes,  # [E] int32
        "offs": torch.cumsum(group_sizes, 0, dtype=torch.int32),  # [E] torch._grouped_mm's group ends
    }


def kernel_path(ctx: h.Context, op: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: Case) -> str:
    if not ctx.ours_runs_kernels:
        return "reference"
    C = _ext.kernels(OP_NAMES[op], a)
    if C is None:
        return "reference"
    path = getattr(C, "grouped_mm_path", None)
    if path is None:
        return "unknown (the extension has no grouped_mm_path)"
    code = path(OP_CODES[op], _ext.dtype_code(a.dtype), c.E, c.M, c.N, c.K, a.data_ptr(), b.data_ptr(),
                d.data_ptr(), a.device.index or 0)
    name = PATHS.get(code, f"path {code}")
    if code in (1, 2) and hasattr(C, "grouped_mm_sm90_choice"):  # the instance and raster order the table chose
        dt = _ext.dtype_code(a.dtype)
        kernel, raster, row = C.grouped_mm_sm90_choice(OP_CODES[op], dt, dt, c.E, c.M, c.N, c.K)
        name += f" {kernel}/{'along_n' if raster else 'along_m'}{'' if row >= 0 else ' (rule)'}"
    return name


def nbytes(op: str, c: Case, sizes: tuple[int, ...]) -> int:
    M, N, K, E, es = sum(sizes), c.N, c.K, c.E, 2
    w_read = sum(n > 0 for n in sizes) * N * K * es
    gs = E * 4
    return {
        "fwd": M * K * es + w_read + gs + M * N * es,
        "dgrad": M * N * es + w_read + gs + M * K * es,
        "wgrad": M * N * es + M * K * es + gs + E * N * K * es,
    }[op]


def check_op(ctx: h.Context, c: Case, op: str, s: dict[str, torch.Tensor], sizes: tuple[int, ...],
             torch_ok: bool, fp64: bool) -> tuple[str, str | None]:
    """Raises AssertionError where ours disagrees (module docstring). Returns (kernel path, why the
    torch peer is left out of this case or None)."""
    a, b = _operands(op, s)
    gs, n, what = s["group_sizes"], sum(sizes), f"{c.name} {OP_NAMES[op]}"
    ours = OURS[op](a, b, gs)
    path = kernel_path(ctx, op, a, b, ours, c)
    skip = None
    base, base_name = None, "torch._grouped_mm"
    if torch_ok:
        try:
            base = TORCH_GROUPED_MM[op](a, b, s["offs"])
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            skip = f"raised on this case: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if base is None:
        base, base_name = expert_loop(op, sizes)(a, b), "expert_loop"
    check_close(f"{what} vs {base_name}", _rows(op, ours, n), _rows(op, base, n))
    if op == "wgrad" and path != "reference":
        assert torch.equal(wgrad_expert_order(c, gs)(a, b), ours), f"{what}: expert order changed the bits"
    if path != "reference":
        mma = portable_mma(op, c, gs)(a, b)
        check_close(f"{what} portable_mma vs {base_name}", _rows(op, mma, n), _rows(op, base, n))
        with mma_stages("2"):
            assert torch.equal(_rows(op, portable_mma(op, c, gs)(a, b), n), _rows(op, mma, n)), \
                f"{what}: the portable kernel's bits changed with 2 shared-memory stages"
    if fp64:
        ref64 = REFERENCE[op](a.double(), b.double(), gs)
        check_fp64(f"{what} vs fp64 (baseline {base_name})", _rows(op, ours, n), _rows(op, base, n),
                   _rows(op, ref64, n))
    return path, skip


def run_case(ctx: h.Context, c: Case, torch_status: dict[str, str | None],
             fp64_todo: set) -> tuple[list[h.Result], list[str]]:
    sizes = c.sizes(ctx.seed)
    gs = torch.tensor(sizes, dtype=torch.int32, device=ctx.device)
    sets = [make_inputs(ctx, c, ctx.seed + i, gs) for i in range(ctx.n_input_sets)]
    results, failures = [], []
    for op in OPS:
        key = (op, c.gemm, c.routing)
        torch_ok = torch_status[op] is None
        try:
            path, case_skip = check_op(ctx, c, op, sets[0], sizes, torch_ok, fp64=key in fp64_todo)
        except AssertionError as e:  # a wrong result is not timed; the other ops and cases still are
            failures.append(f"{c.name} {OP_NAMES[op]}: {e}")
            continue
        fp64_todo.discard(key)
        skipped = {}
        if not torch_ok:
            skipped["torch_grouped_mm"] = torch_status[op]
        elif case_skip:
            skipped["torch_grouped_mm"] = case_skip

        inputs = [_operands(op, s) for s in sets]
        ours_fn = lambda a, b, _f=OURS[op]: _f(a, b, gs)  # noqa: E731
        peers: dict[str, h.Timing] = {}
        variant: dict[str, str] = {}
        if "torch_grouped_mm" not in skipped:
            # The peer this family is judged against: interleaved rep by rep with ours (time_ab).
            timing, peers["torch_grouped_mm"] = ctx.time_ab(
                ours_fn, inputs, TORCH_GROUPED_MM[op], [(*_operands(op, s), s["offs"]) for s in sets])
            variant["torch_grouped_mm"] = TORCH_VARIANT[op]
        else:
            timing = ctx.time(ours_fn, inputs)
        peers["expert_loop"] = ctx.time(expert_loop(op, sizes), inputs)
        variant["expert_loop"] = "torch.mm per expert, out= slices"
        fn, operands = dense_mm(op)
        peers["dense_mm"] = ctx.time(fn, [operands(s) for s in sets])
        variant["dense_mm"] = {"fwd": "mm(x, W.t())", "dgrad": "mm(dout, W)", "wgrad": "mm(dout.t(), x)"}[op]
        if not ctx.is_cuda:
            peers["reference"] = ctx.time(lambda a, b, _f=REFERENCE[op]: _f(a, b, gs), inputs)
            variant["reference"] = REFERENCE[op].__name__
        if path != "reference":
            peers["portable_mma"] = ctx.time(portable_mma(op, c, gs), inputs)
            variant["portable_mma"] = "ours, the tensor-core portable kernel named (portable=1)"
            with mma_stages("2"):
                peers["portable_mma_2_stages"] = ctx.time(portable_mma(op, c, gs), inputs)
            variant["portable_mma_2_stages"] = "ours, the tensor-core portable kernel, MOE_KERNELS_MMA_STAGES=2"
        if op == "wgrad" and path != "reference":
            peers["expert_order"] = ctx.time(wgrad_expert_order(c, gs), inputs)
            variant["expert_order"] = "ours, group_order=0 (the default visits the largest groups first)"

        r = h.make_result(ctx, op=OP_NAMES[op], case=c.name, shape=c.shape(ctx.seed), dtype=torch.bfloat16,
                          timing=timing, nbytes=nbytes(op, c, sizes), flops=2 * sum(sizes) * c.N * c.K,
                          peers=peers, peer_variant=variant)
        results.append(GemmResult(**vars(r), kernel_path=path, pct_of_dense=100 * r.speedup["dense_mm"],
                                  peer_skipped=skipped))
    return results, failures


# ---------------------------------------------------------------------------------------------------
# Headline


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def headline(ctx: h.Context, results: list[GemmResult]) -> list[str]:
    lines = []
    for op in OPS:
        name = OP_NAMES[op]
        rs = [r for r in results if r.op == name and "torch_grouped_mm" in r.speedup]
        if not any(r.op == name for r in results):
            lines.append(f"{name}: no case timed (see FAILED) (bar: {BAR_TORCH})")
            continue
        if not rs:
            why = sorted({r.peer_skipped.get("torch_grouped_mm", "") for r in results if r.op == name} - {""})
            lines.append(f"{name}: torch._grouped_mm not timed ({'; '.join(why)}) (bar: {BAR_TORCH})")
            continue
        s = [r.speedup["torch_grouped_mm"] for r in rs]
        g, worst = _geomean(s), min(rs, key=lambda r: r.speedup["torch_grouped_mm"])
        n_all = sum(r.op == name for r in results)
        ok = g >= BAR_TORCH_GEOMEAN and min(s) >= BAR_TORCH_MIN
        lines.append(f"{name}: {g:.2f}x torch._grouped_mm geomean over {len(rs)}"
                     f"{'' if len(rs) == n_all else f' of {n_all}'} cases, min {min(s):.2f}x at {worst.case} "
                     f"(bar: {BAR_TORCH}) [{'meets bar' if ok else 'below bar'}]")
    ordered = [r for r in results if r.op == OP_NAMES["wgrad"] and "expert_order" in r.speedup]
    for routing in ROUTINGS:
        rs = [r for r in ordered if r.case.split("/")[2] == routing]
        if rs:
            s = [r.speedup["expert_order"] for r in rs]
            worst = min(rs, key=lambda r: r.speedup["expert_order"])
            lines.append(f"grouped_mm_wgrad, groups visited largest first vs expert order ({routing} routing): "
                         f"{_geomean(s):.2f}x geomean over {len(rs)} cases, min {min(s):.2f}x at {worst.case}, "
                         f"max {max(s):.2f}x")
    rows = LARGE_GROUP_ROWS if ctx.is_cuda else CPU_LARGE_GROUP_ROWS
    for op in OPS:
        name = OP_NAMES[op]
        rs = [r for r in results if r.op == name and r.shape["min_rows"] >= rows]
        if not rs:
            lines.append(f"{name}: % of dense cuBLAS where groups hold >= {rows} rows: no such case (bar: {BAR_DENSE})")
            continue
        pct = [r.pct_of_dense for r in rs]
        worst = min(rs, key=lambda r: r.pct_of_dense)
        m = ctx.ceilings().matmul_shape[0]
        ceil = (_geomean([100 * r.tflops / ctx.ceiling_of(r).matmul_bf16_tflops for r in rs])
                if all(r.tflops for r in rs) else 0.0)
        lines.append(f"{name}: % of dense cuBLAS where groups hold >= {rows} rows: {_geomean(pct):.1f}% geomean "
                     f"(equal-FLOPs torch.mm, same run) over {len(rs)} cases, min {min(pct):.1f}% at {worst.case}; "
                     f"{ceil:.1f}% of the {m}^3 matmul ceiling (bar: {BAR_DENSE}) "
                     f"[{'meets bar' if min(pct) >= BAR_DENSE_PCT else 'below bar'}]")
    return lines


def run(ctx: h.Context) -> h.Report:
    print(f"grouped_mm on {ctx.device}: ours runs {'the CUDA kernels' if ctx.ours_runs_kernels else 'the reference'}")
    torch_status = torch_peer_status(ctx)
    notes = [f"torch_grouped_mm not timed for {OP_NAMES[op]}: {why}" for op, why in torch_status.items() if why]
    failures = []
    try:
        check_expert_loop(ctx)
    except AssertionError as e:  # the loop peer is plain torch.mm; a mismatch means the bench is wrong
        failures.append(f"expert_loop peer: {e}")
        return h.Report([], [], failures)
    all_cases = cases(ctx)
    fp64_todo = {(op, c.gemm, c.routing) for c in all_cases for op in OPS}
    results: list[GemmResult] = []
    skipped: list[str] = []
    for i, c in enumerate(all_cases):
        try:
            rs, fs = run_case(ctx, c, torch_status, fp64_todo)
        except torch.OutOfMemoryError as e:  # not measured, said so; the next case still runs
            h.skip_case("grouped_mm", c.name, e, skipped)
        else:
            results += rs
            failures += fs
        h.release(ctx)
        ctx.case_done("grouped_mm", i, len(all_cases))
    ctx.finish("grouped_mm", results)
    for r in results:
        why = r.peer_skipped.get("torch_grouped_mm")
        if why and torch_status[r.op.removeprefix("grouped_mm_")] is None:
            notes.append(f"torch_grouped_mm not timed for {r.op} {r.case}: {why}")
    paths = sorted({(r.op, r.kernel_path) for r in results if r.kernel_path not in (None, "reference")})
    if paths:
        by_op = {}
        for op, p in paths:
            by_op.setdefault(op, []).append(p)
        notes.append("kernel paths: " + "; ".join(f"{op} {', '.join(ps)}" for op, ps in by_op.items()))
    return h.Report(results, (headline(ctx, results) if results else []) + [f"note: {n}" for n in notes], failures,
                    skipped)
