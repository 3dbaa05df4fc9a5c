"""The FP8 blockwise grouped GEMM on tensor cores (csrc/gemm/portable_mma_fp8.cuh): GPU tier.

The kernel is asked for by name (`portable=1`) on whatever GPU of 8.9 or later runs the tier, so an H100/H200
checks the fragments, scales and promotion that an L40S or an RTX GPU would run (there the instruction is the
native E4M3 mma.sync; on 9.0 and 10.x ptxas lowers it to f16 conversions and the f16 one, the same products).
The error model is the CUTLASS kernels': fp32 accumulators promoted by the two block scales every 128 of the
contraction, with the FP8 tensor cores' accumulation inside each block (FP8_MMA_MAGNITUDE). Bits that a model
pins exactly are asserted exactly: the bf16 wgrad is the fp32 one rounded once, accumulating adds it once.

On the CPU-executed build the emulated GPU is 8.0 (no FP8 tensor cores): there the refusal is checked, and
`test_on_a_gpu_of_8_9` reruns this file, the FP8 ops' own suites and the FP8 recipe's in a process that
reports 8.9 with MOE_KERNELS_PORTABLE_MMA=1, where the ops take this kernel by default.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import moe_kernels as mk
from moe_kernels import _ext
from moe_kernels._ext import reference_ops
from moe_kernels.ops.grouped_mm_fp8 import (
    _inverse_scale,
    _launch_fp8,
    grouped_mm_fp8_reference,
    grouped_mm_fp8_wgrad_reference,
)
from moe_kernels.testing import FP8_MMA_MAGNITUDE, assert_within_fp32_rounding, assert_within_rounding_to
from tests.emulation import EMULATED, skip_if_emulated, skip_if_too_large

pytestmark = pytest.mark.gpu
MMA_PATH = 8  # grouped_mm_path's code for the tensor-core portable kernel
FWD, WGRAD = 0, 2
E4M3 = torch.float8_e4m3fn
EMULATION_BUDGET = 2.5e8  # GEMM FLOP per case


def _kernels(cuda):
    return _ext.kernels("grouped_mm_fp8", torch.empty(0, device=cuda))


def _probe(cuda, op: int = FWD, **over) -> int:
    """grouped_mm_path of a small FP8 problem on `cuda` (ValueError where the kernel named is refused)."""
    C = _kernels(cuda)
    shape = dict(op=op, dtype=_ext.dtype_code(E4M3), num_groups=2, M=256, N=256, K=256, a=256, b=256, d=256,
                 device=_ext.launch_args(torch.empty(0, device=cuda))["device"], sfa=256, sfb=256)
    shape.update(over)
    return C.grouped_mm_path(**shape)


def _require_kernel(cuda):
    try:
        _probe(cuda, portable=1)
    except ValueError as e:
        pytest.skip(f"the FP8 tensor-core kernel does not run here: {e}")


def _on_dev(t: torch.Tensor, dev, offset: int = 0) -> torch.Tensor:
    """A copy of t on the device, `offset` elements into a buffer (offset > 0: off 16-byte alignment)."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=dev)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    return view


def _sizes(M: int, E: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "one_group":
        s = torch.zeros(E, dtype=torch.int32)
        s[E // 2] = M
        return s
    if kind == "empty":  # half the experts get nothing
        live = torch.randperm(E, generator=g)[: max(1, E // 2)]
        pick = live[torch.randint(0, len(live), (M,), generator=g)]
        return torch.bincount(pick, minlength=E).to(torch.int32)
    return torch.bincount(torch.randint(0, E, (M,), generator=g), minlength=E).to(torch.int32)


def _fwd_case(M, N, K, E, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, K)
    w = torch.randn(E, N, K, generator=g) * 0.05
    with reference_ops():
        xq, xs = mk.quantize_fp8(x, "block")
        wq, ws = mk.quantize_fp8_experts(w)
    return xq, xs, wq, ws, _sizes(M, E, kind, seed)


def _run_fwd(xq, xs, wq, ws, gs, *, offset: int = 0):
    """The forward on the tensor-core kernel, by name; the output starts as NaN (an unwritten element shows)."""
    dev = xq.device
    M, K = xq.shape
    N = wq.shape[1]
    buf = torch.full((M * N + offset,), float("nan"), dtype=torch.bfloat16, device=dev)
    out = buf[offset:].view(M, N)
    assert _launch_fp8(_kernels(dev), FWD, xq, wq, out, _inverse_scale(xs), _inverse_scale(ws), gs, M, N, K,
                       portable=1), "the kernel named must run"
    return out


def _check_fwd(out, xq, xs, wq, ws, gs, what):
    rows = int(gs.sum().clamp(max=xq.shape[0]))
    ref64 = grouped_mm_fp8_reference(xq, xs, wq, ws, gs, acc=torch.float64)[:rows]
    # The sum of |terms| per output: the reference on the codes' magnitudes (the scales are positive).
    terms = grouped_mm_fp8_reference(xq.float().abs().to(E4M3), xs, wq.float().abs().to(E4M3), ws, gs,
                                     acc=torch.float64)[:rows]
    assert_within_rounding_to(out[:rows], ref64.to(torch.bfloat16), FP8_MMA_MAGNITUDE * terms, torch.bfloat16, what)


@pytest.mark.parametrize("M,N,K,E", [(1, 128, 128, 1), (300, 256, 384, 8), (777, 200, 256, 4), (64, 196, 128, 2),
                                     (513, 136, 640, 3),
                                     pytest.param(4096, 2048, 7168, 32, marks=pytest.mark.gpu_memory)])
@pytest.mark.parametrize("kind", ["uniform", "empty", "one_group"])
def test_forward_matches_fp64(cuda, M, N, K, E, kind):
    # Rows and N past a tile and not multiples of it (N % 8 != 0 included), several K blocks, empty experts.
    _require_kernel(cuda)
    skip_if_too_large(2 * M * N * K, EMULATION_BUDGET, "GEMM FLOP")
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _fwd_case(M, N, K, E, kind, seed=M + N + K))
    out = _run_fwd(xq, xs, wq, ws, gs)
    _check_fwd(out.cpu(), *(t.cpu() for t in (xq, xs, wq, ws, gs)), f"fwd {M}x{N}x{K} E={E} {kind}")


@pytest.mark.parametrize("offset", [1, 8])
def test_forward_unaligned_operands(cuda, offset):
    # Codes off 16-byte alignment (byte-wise loads) and an output off 4 bytes (element-wise stores).
    _require_kernel(cuda)
    xq, xs, wq, ws, gs = _fwd_case(200, 136, 256, 3, "uniform", seed=offset)
    dev = [_on_dev(t, cuda, offset if t.dtype == E4M3 else 0) for t in (xq, xs, wq, ws)]
    out = _run_fwd(*dev, gs.to(cuda), offset=1)
    _check_fwd(out.cpu(), xq, xs, wq, ws, gs, f"fwd, operands {offset} bytes off")


def test_forward_rows_past_the_groups_and_zero_scales(cuda):
    # Groups summing past M are clamped; a block with a zero scale (permute's padding: codes 0) gives zeros.
    _require_kernel(cuda)
    xq, xs, wq, ws, _ = _fwd_case(260, 128, 256, 2, "uniform", seed=3)
    xq[10:20] = 0
    xs[10:20] = 0
    gs = torch.tensor([200, 100], dtype=torch.int32)
    out = _run_fwd(*(t.to(cuda) for t in (xq, xs, wq, ws, gs))).cpu()
    assert bool((out[10:20] == 0).all()), "zero-scale rows must be zeros, not 0 * inf"
    _check_fwd(out, xq, xs, wq, ws, gs, "fwd, sizes past M")


def _wgrad_case(M_extra, N, K, E, blocks, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "one_group":
        s = torch.zeros(E, dtype=torch.int64)
        s[E // 2] = blocks
    elif kind == "empty":
        s = torch.zeros(E, dtype=torch.int64)
        s[torch.randperm(E, generator=g)[0]] = blocks
    else:
        s = torch.bincount(torch.randint(0, E, (blocks,), generator=g), minlength=E)
    gs = (s * 128).to(torch.int32)
    M = int(gs.sum()) + M_extra
    dout = torch.randn(M, N, generator=g) * torch.logspace(-1, 1, N)
    x = torch.randn(M, K, generator=g)
    with reference_ops():
        a, b = mk.quantize_fp8_tokens(dout), mk.quantize_fp8_tokens(x)
    # Tokens past the padded operands' width stay inside them: quantize_fp8_tokens pads M up to 128.
    return a, b, gs


def _run_wgrad(a, b, gs, out_dtype=torch.float32, *, out=None, accumulate=False):
    (a_q, a_s), (b_q, b_s) = a, b
    N, M = a_q.shape
    K = b_q.shape[0]
    if out is None:
        out = torch.full((gs.shape[0], N, K), float("nan"), dtype=out_dtype, device=a_q.device)
    inv_a = _inverse_scale(a_s).t().contiguous()
    inv_b = _inverse_scale(b_s).t().contiguous()
    # The launcher's own pass after the kernel zeroes empty experts (unless accumulating) and NaNs misaligned ones.
    assert _launch_fp8(_kernels(a_q.device), WGRAD, a_q, b_q, out, inv_a, inv_b, gs, M, N, K, accumulate=accumulate,
                       portable=1), "the kernel named must run"
    return out


def _check_wgrad(out, a, b, gs, what):
    ref64 = grouped_mm_fp8_wgrad_reference(*a, *b, gs, acc=torch.float64)
    abs_a, abs_b = (a[0].float().abs().to(E4M3), a[1]), (b[0].float().abs().to(E4M3), b[1])
    magnitude = grouped_mm_fp8_wgrad_reference(*abs_a, *abs_b, gs, acc=torch.float64)
    assert_within_fp32_rounding(out, ref64, FP8_MMA_MAGNITUDE * magnitude, what)


@pytest.mark.parametrize("N,K,E,blocks,M_extra", [(128, 128, 1, 1, 0), (256, 384, 8, 9, 0), (200, 196, 4, 6, 5),
                                                  (64, 100, 2, 3, 0), (72, 199, 3, 4, 3)])
@pytest.mark.parametrize("kind", ["uniform", "empty", "one_group"])
def test_wgrad_matches_fp64(cuda, N, K, E, blocks, M_extra, kind):
    # fp32 against the fp64 reference; bf16 is that fp32 result rounded once (same accumulators, bit for bit).
    # M_extra: tokens past the groups (and past 16-byte rows: byte-wise loads); K odd: element-wise stores.
    _require_kernel(cuda)
    skip_if_too_large(2 * blocks * 128 * N * K, EMULATION_BUDGET, "GEMM FLOP")
    a, b, gs = _wgrad_case(M_extra, N, K, E, blocks, kind, seed=N + K + blocks)
    dev_a, dev_b, dev_gs = tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), gs.to(cuda)
    dw = _run_wgrad(dev_a, dev_b, dev_gs)
    for e in (gs == 0).nonzero().flatten().tolist():
        assert bool((dw[e] == 0).all()), f"empty expert {e} must be zeros"
    _check_wgrad(dw.cpu(), a, b, gs, f"wgrad {N}x{K} E={E} {kind}")
    dw16 = _run_wgrad(dev_a, dev_b, dev_gs, torch.bfloat16)
    live = gs > 0
    assert torch.equal(dw16[live.to(cuda)].cpu(), dw[live.to(cuda)].to(torch.bfloat16).cpu()), \
        "bf16 wgrad = the fp32 accumulators rounded once"


def test_wgrad_accumulate_adds_once_and_keeps_empty_experts(cuda):
    _require_kernel(cuda)
    a, b, gs = _wgrad_case(0, 200, 136, 4, 5, "empty", seed=9)
    dev_a, dev_b, dev_gs = tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), gs.to(cuda)
    dw = _run_wgrad(dev_a, dev_b, dev_gs)
    base = torch.randn(dw.shape, generator=torch.Generator().manual_seed(1)).to(cuda)
    acc = _run_wgrad(dev_a, dev_b, dev_gs, out=base.clone(), accumulate=True)
    live = (gs > 0).to(cuda)
    assert torch.equal(acc[live], base[live] + dw[live]), "one fp32 addition per element"
    assert torch.equal(acc[~live], base[~live]), "empty experts keep their values, bit for bit"


def test_wgrad_misaligned_groups_give_nan(cuda):
    _require_kernel(cuda)
    a, b, _ = _wgrad_case(0, 128, 128, 2, 3, "uniform", seed=4)
    gs = torch.tensor([100, 284], dtype=torch.int32)  # 384 tokens; neither group on whole 128-token blocks
    dw = _run_wgrad(tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), gs.to(cuda)).cpu()
    assert bool(torch.isnan(dw).all()), "a group whose scale blocks straddle two experts is NaN, never stale"


def _capability(cuda) -> tuple[int, int]:
    if EMULATED:  # the emulated GPU's (tools/cuda_on_cpu/src/cuda_api.cpp)
        major, minor = os.environ.get("MOE_KERNELS_EMU_CAPABILITY", "8.0").split(".")
        return int(major), int(minor)
    return torch.cuda.get_device_capability(cuda)


def test_path_choice_and_refusals(cuda):
    dev_cc = _capability(cuda)
    if dev_cc < (8, 9):
        with pytest.raises(ValueError, match="FP8 needs compute capability 8.9 or later"):
            _probe(cuda, portable=1)
        return
    _require_kernel(cuda)
    assert _probe(cuda, portable=1) == MMA_PATH
    assert _probe(cuda, op=WGRAD, portable=1) == MMA_PATH
    assert _probe(cuda, op=WGRAD, portable=1, fp8_wgrad_out=_ext.dtype_code(torch.bfloat16)) == MMA_PATH
    with pytest.raises(ValueError, match="dgrad is the forward on transposed tiles"):
        _probe(cuda, op=1, portable=1)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        _probe(cuda, K=200, portable=1)
    with pytest.raises(ValueError, match="both scale tensors"):
        _probe(cuda, sfb=0, portable=1)
    with pytest.raises(ValueError, match="takes bf16, fp16 and fp32"):
        _probe(cuda, portable=0)
    C = _kernels(cuda)
    if dev_cc[0] not in (9, 10):  # no CUTLASS FP8 kernel: this one where opted in, else none (the op dequantizes)
        expected = MMA_PATH if C.grouped_mm_portable_mma_enabled() else 0
        assert _probe(cuda) == expected and _probe(cuda, op=WGRAD) == expected


@pytest.mark.gpu_memory
def test_past_2_31_elements(cuda):
    # x_q holds 2^31 + 2^17 codes: 64-bit offsets in the loads, the row scales and the epilogue.
    skip_if_emulated("2.1 GB operands")
    _require_kernel(cuda)
    M, N, K = 2**21 + 128, 16, 1024
    gen = torch.Generator(cuda).manual_seed(7)
    x = torch.randn(M, K, device=cuda, generator=gen)
    xq, xs = mk.quantize_fp8(x, "block")
    del x
    wq, ws = mk.quantize_fp8_experts(torch.randn(2, N, K, device=cuda, generator=gen) * 0.05)
    gs = torch.tensor([M - 200, 200], dtype=torch.int32, device=cuda)
    out = _run_fwd(xq, xs, wq, ws, gs)
    tail = slice(M - 200, M)
    sub = torch.tensor([0, 200], dtype=torch.int32, device=cuda)
    _check_fwd(out[tail].cpu(), xq[tail].cpu(), xs[tail].cpu(), wq.cpu(), ws.cpu(), sub.cpu(), "fwd past 2^31")


def test_on_a_gpu_of_8_9(cuda):
    """Emulated (8.0), or on a GPU without the sm_90a FP8 kernels: this file, the FP8 ops' suites and the FP8
    recipe's rerun with MOE_KERNELS_PORTABLE_MMA=1 (read once per process), so the ops take this kernel by
    default; emulated, the child reports 8.9 (MOE_KERNELS_EMU_CAPABILITY)."""
    if not EMULATED:
        C = _kernels(cuda)
        if torch.cuda.get_device_capability(cuda)[0] == 9 and C.grouped_mm_has_sm90:
            pytest.skip("the FP8 ops take the sm_90a kernels here; the tests above ran this kernel by name")
        _require_kernel(cuda)
    elif os.environ.get("MOE_KERNELS_EMU_CAPABILITY"):
        pytest.skip("already the child")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MOE_KERNELS_PORTABLE_MMA="1", MOE_KERNELS_EMU_CAPABILITY="8.9")
    files = ["tests/ops/test_grouped_mm_fp8_mma_gpu.py", "tests/ops/test_grouped_mm_fp8_gpu.py",
             "tests/ops/test_grouped_mm_fp8_wgrad_gpu.py", "tests/quant/test_recipe_gpu.py"]
    if os.environ.get("MOE_KERNELS_EMULATE") == "asan":  # the sanitized kernels: this file's cases
        files = files[:1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x", "-m", "gpu",
                           *files], env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    first = next((line for line in proc.stdout.splitlines() if line.startswith("E ")), "")
    assert proc.returncode == 0 and " passed" in proc.stdout, (f"the FP8 suites on the tensor-core kernel: {first}\n"
                                                              + proc.stdout[-6000:] + proc.stderr[-3000:])
