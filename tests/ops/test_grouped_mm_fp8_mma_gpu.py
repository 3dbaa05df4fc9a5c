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
from moe_kernels.ops.grouped_mm_fp8 import (
    _run_forward,
    _run_wgrad,
    grouped_mm_fp8_reference,
    grouped_mm_fp8_wgrad_reference,
)
from moe_kernels.testing import FP8_MMA_MAGNITUDE, assert_within_fp32_rounding, assert_within_rounding_to
from tests.emulation import EMULATED, SANITIZED, skip_if_emulated, skip_if_sanitized_and_large, skip_if_too_large
from tests.ops.test_grouped_mm_fp8_gpu import _case
from tests.ops.test_grouped_mm_fp8_wgrad_gpu import _case as _wgrad_suite_case

pytestmark = pytest.mark.gpu
MMA_PATH = 8  # grouped_mm_path's code for the tensor-core portable kernel
FWD, WGRAD = 0, 2
E4M3 = torch.float8_e4m3fn
EMULATION_BUDGET = 2.5e8  # GEMM FLOP per case
SANITIZED_VARIANT_BUDGET = 2e7  # GEMM FLOP: past it, the sanitized kernels run only a shape's "uniform" case
CHILD = "MOE_KERNELS_FP8_MMA_RERUN"  # set in the process test_on_a_gpu_of_8_9 starts: it never starts another


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


def _run_fwd(xq, xs, wq, ws, gs, *, offset: int = 0):
    """The forward on the tensor-core kernel, by name; the output starts as NaN (an unwritten element shows) and lies
    `offset` elements into its buffer."""
    M, N = xq.shape[0], wq.shape[1]
    buf = torch.full((M * N + offset,), float("nan"), dtype=torch.bfloat16, device=xq.device)
    out = _run_forward(_kernels(xq.device), xq, xs, wq, ws, gs, buf[offset:].view(M, N), portable=1)
    assert out is not None, "the kernel named must run"
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
    if kind != "uniform":
        skip_if_sanitized_and_large(2 * M * N * K, SANITIZED_VARIANT_BUDGET, "GEMM FLOP")
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _case(M, N, K, E, kind, seed=M + N + K))
    out = _run_fwd(xq, xs, wq, ws, gs)
    _check_fwd(out.cpu(), *(t.cpu() for t in (xq, xs, wq, ws, gs)), f"fwd {M}x{N}x{K} E={E} {kind}")


@pytest.mark.parametrize("offset", [1, 8])
def test_forward_unaligned_operands(cuda, offset):
    # Codes off 16-byte alignment (byte-wise loads) and an output off 4 bytes (element-wise stores).
    _require_kernel(cuda)
    xq, xs, wq, ws, gs = _case(200, 136, 256, 3, "uniform", seed=offset)
    dev = [_on_dev(t, cuda, offset if t.dtype == E4M3 else 0) for t in (xq, xs, wq, ws)]
    out = _run_fwd(*dev, gs.to(cuda), offset=1)
    _check_fwd(out.cpu(), xq, xs, wq, ws, gs, f"fwd, operands {offset} bytes off")


def test_forward_rows_past_the_groups_and_zero_scales(cuda):
    # Groups summing past M are clamped; a block with a zero scale (permute's padding: codes 0) gives zeros.
    _require_kernel(cuda)
    xq, xs, wq, ws, _ = _case(260, 128, 256, 2, "uniform", seed=3)
    xq[10:20] = 0
    xs[10:20] = 0
    gs = torch.tensor([200, 100], dtype=torch.int32)
    out = _run_fwd(*(t.to(cuda) for t in (xq, xs, wq, ws, gs))).cpu()
    assert bool((out[10:20] == 0).all()), "zero-scale rows must be zeros, not 0 * inf"
    _check_fwd(out, xq, xs, wq, ws, gs, "fwd, sizes past M")


@pytest.mark.parametrize("stages", ["2", "3"])
def test_every_stage_count_gives_the_same_bits(cuda, stages, monkeypatch):
    # The default is as many shared-memory stages as fit one CTA (4 on every GPU of 8.9 or later);
    # MOE_KERNELS_MMA_STAGES asks for fewer. Stages change when a slice arrives, never what is summed in which order.
    # K = 384: 6 slices of 64 (3 scale blocks); the wgrad's 640 tokens: 10, with 5 more past the groups, so the
    # token rows are not whole 16-byte vectors and every slice takes the byte-wise loads.
    _require_kernel(cuda)
    if SANITIZED and stages != "3":
        pytest.skip("under ASan 3 stages only; every count runs in the emulated tier and on a GPU")
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _case(300, 256, 384, 8, "uniform", seed=11))
    a, b, wgs = _wgrad_case(5, 200, 196, 4, 5, "uniform", seed=12)
    dev_a, dev_b, dev_gs = tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), wgs.to(cuda)
    monkeypatch.delenv("MOE_KERNELS_MMA_STAGES", raising=False)
    fwd, dw = _run_fwd(xq, xs, wq, ws, gs), _run_wgrad_named(dev_a, dev_b, dev_gs)
    monkeypatch.setenv("MOE_KERNELS_MMA_STAGES", stages)
    rows = int(gs.sum())
    assert not bool(fwd[:rows].isnan().any()) and not bool(dw.isnan().any()), "the default run has NaN"
    assert torch.equal(_run_fwd(xq, xs, wq, ws, gs)[:rows], fwd[:rows]), f"fwd: {stages} stages vs the default"
    assert torch.equal(_run_wgrad_named(dev_a, dev_b, dev_gs), dw), f"wgrad: {stages} stages vs the default"
    # An aligned wgrad (token rows whole vectors: the cp.async copies) at this count, within the fp64 rule.
    a2, b2, gs2 = _wgrad_case(0, 200, 196, 4, 5, "uniform", seed=13)
    dw2 = _run_wgrad_named(tuple(t.to(cuda) for t in a2), tuple(t.to(cuda) for t in b2), gs2.to(cuda))
    _check_wgrad(dw2.cpu(), a2, b2, gs2, f"wgrad, {stages} stages")


def _wgrad_case(M_extra, N, K, E, blocks, kind, seed):
    """Operands quantized along the tokens (the FP8 wgrad suite's cases): (dout_t codes, scales), (x_t ...), sizes."""
    _, _, a, b, gs = _wgrad_suite_case(M_extra, N, K, E, blocks, kind, seed)
    return a, b, gs


def _run_wgrad_named(a, b, gs, out_dtype=torch.float32, *, out=None, accumulate=False):
    """The wgrad on the tensor-core kernel, by name, into `out` (default: NaN, so an unwritten element shows). The
    launcher's own pass after the kernel zeroes empty experts (unless accumulating) and NaNs misaligned ones."""
    (a_q, a_s), (b_q, b_s) = a, b
    if out is None:
        out = torch.full((gs.shape[0], a_q.shape[0], b_q.shape[0]), float("nan"), dtype=out_dtype, device=a_q.device)
    assert _run_wgrad(_kernels(a_q.device), a_q, a_s, b_q, b_s, gs, out, accumulate=accumulate, portable=1), \
        "the kernel named must run"
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
    # M_extra: tokens past the groups (quantize_fp8_tokens pads them to 128); K odd: element-wise stores.
    _require_kernel(cuda)
    skip_if_too_large(2 * blocks * 128 * N * K, EMULATION_BUDGET, "GEMM FLOP")
    if kind != "uniform":
        skip_if_sanitized_and_large(2 * blocks * 128 * N * K, SANITIZED_VARIANT_BUDGET, "GEMM FLOP")
    a, b, gs = _wgrad_case(M_extra, N, K, E, blocks, kind, seed=N + K + blocks)
    dev_a, dev_b, dev_gs = tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), gs.to(cuda)
    dw = _run_wgrad_named(dev_a, dev_b, dev_gs)
    for e in (gs == 0).nonzero().flatten().tolist():
        assert bool((dw[e] == 0).all()), f"empty expert {e} must be zeros"
    _check_wgrad(dw.cpu(), a, b, gs, f"wgrad {N}x{K} E={E} {kind}")
    dw16 = _run_wgrad_named(dev_a, dev_b, dev_gs, torch.bfloat16)
    live = gs > 0
    assert torch.equal(dw16[live.to(cuda)].cpu(), dw[live.to(cuda)].to(torch.bfloat16).cpu()), \
        "bf16 wgrad = the fp32 accumulators rounded once"
    assert bool((dw16[~live.to(cuda)] == 0).all()), "bf16 wgrad: empty experts are zeros"


def test_wgrad_accumulate_adds_once_and_keeps_empty_experts(cuda):
    _require_kernel(cuda)
    a, b, gs = _wgrad_case(0, 200, 136, 4, 5, "empty", seed=9)
    dev_a, dev_b, dev_gs = tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), gs.to(cuda)
    dw = _run_wgrad_named(dev_a, dev_b, dev_gs)
    base = torch.randn(dw.shape, generator=torch.Generator().manual_seed(1)).to(cuda)
    acc = _run_wgrad_named(dev_a, dev_b, dev_gs, out=base.clone(), accumulate=True)
    live = (gs > 0).to(cuda)
    assert torch.equal(acc[live], base[live] + dw[live]), "one fp32 addition per element"
    assert torch.equal(acc[~live], base[~live]), "empty experts keep their values, bit for bit"


def _widened(q: torch.Tensor, s: torch.Tensor, extra: int, offset: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [rows, M] widened by `extra` zero tokens (rows of M + extra bytes: not whole 16-byte vectors) with
    scales to match, on the device `offset` bytes into a buffer (off 16-byte alignment)."""
    wide = torch.cat([q.view(torch.uint8), torch.zeros(q.shape[0], extra, dtype=torch.uint8)], 1).view(E4M3)
    blocks = -(-wide.shape[1] // 128)
    scales = torch.cat([s, torch.ones(s.shape[0], blocks - s.shape[1])], 1)
    buf = torch.empty(wide.numel() + offset, dtype=torch.uint8, device=dev)
    codes = buf[offset:].view(wide.shape)
    codes.copy_(wide.view(torch.uint8))
    return codes.view(E4M3), scales.to(dev)


@pytest.mark.parametrize("extra,offset", [(5, 0), (0, 3), (13, 8)])
def test_wgrad_unaligned_operands(cuda, extra, offset):
    # Token rows that are not whole 16-byte vectors (M % 16 != 0) and codes off 16-byte alignment: byte-wise loads.
    _require_kernel(cuda)
    a, b, gs = _wgrad_case(0, 136, 72, 3, 4, "uniform", seed=extra + offset)
    dev_a, dev_b = _widened(*a, extra, offset, cuda), _widened(*b, extra, offset, cuda)
    dw = _run_wgrad_named(dev_a, dev_b, gs.to(cuda))
    _check_wgrad(dw.cpu(), a, b, gs, f"wgrad, tokens {extra} past 16-byte rows, codes {offset} bytes off")


def test_wgrad_misaligned_groups_give_nan(cuda):
    _require_kernel(cuda)
    a, b, _ = _wgrad_case(0, 128, 128, 3, 3, "uniform", seed=4)
    gs = torch.tensor([128, 100, 156], dtype=torch.int32)  # 384 tokens: group 0 whole 128-token blocks, 1 and 2 not
    dw = _run_wgrad_named(tuple(t.to(cuda) for t in a), tuple(t.to(cuda) for t in b), gs.to(cuda)).cpu()
    assert bool(torch.isnan(dw[1:]).all()), "a group whose scale blocks straddle two experts is NaN, never stale"
    _check_wgrad(dw[:1], a, b, gs[:1], "wgrad, the aligned group beside misaligned ones")


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
    with pytest.raises(ValueError, match="FP8 takes no gathered rows or SwiGLU epilogue"):
        _probe(cuda, portable=1, a_rows=256)
    with pytest.raises(ValueError, match="takes bf16, fp16 and fp32"):
        _probe(cuda, portable=0)
    C = _kernels(cuda)
    if dev_cc[0] not in (9, 10):  # no CUTLASS FP8 kernel: this one where opted in, else none (the op dequantizes)
        expected = MMA_PATH if C.grouped_mm_portable_mma_enabled() else 0
        assert _probe(cuda) == expected and _probe(cuda, op=WGRAD) == expected


@pytest.mark.gpu_memory
def test_past_2_31_elements(cuda):
    # x_q holds 2^31 + 2^17 codes and the output 2^31 + 2^17 elements: 64-bit offsets in the loads and the epilogue
    # (the row scales stay far below 2^31).
    skip_if_emulated("2.1 GB operands")
    _require_kernel(cuda)
    M, N, K = 2**21 + 128, 1024, 1024
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


@pytest.mark.long
def test_on_a_gpu_of_8_9(cuda):
    """Emulated, or on a GPU without the sm_90a FP8 kernels: the FP8 ops' suites, the FP8 recipe's and its fused
    region's (moe_fp8, which runs only where every expert GEMM has an FP8 kernel) rerun with
    MOE_KERNELS_PORTABLE_MMA=1 (read once per process), so the ops take this kernel by default. Emulated, the rerun
    reports an 8.9 GPU (MOE_KERNELS_EMU_CAPABILITY) and runs this file's tests too (under ASan, only those and two of
    the fused region's cases)."""
    if os.environ.get(CHILD):
        pytest.skip("this is the rerun")
    files = ["tests/ops/test_grouped_mm_fp8_gpu.py", "tests/ops/test_grouped_mm_fp8_wgrad_gpu.py",
             "tests/quant/test_recipe_gpu.py", "tests/nn/test_fused_fp8_gpu.py"]
    if not EMULATED:  # this file's tests ran the kernel by name above
        C = _kernels(cuda)
        if torch.cuda.get_device_capability(cuda)[0] == 9 and C.grouped_mm_has_sm90:
            pytest.skip("the FP8 ops take the sm_90a kernels here; the tests above ran this kernel by name")
        _require_kernel(cuda)
    elif SANITIZED:  # the sanitized kernels: this file's cases, and the fused FP8 region's entries (moe_fp8_fwd /
        # moe_fp8_bwd) on one token and on slots the capacity dropped
        region = "tests/nn/test_fused_fp8_gpu.py::test_region_equals_the_recipes_functions"
        files = ["tests/ops/test_grouped_mm_fp8_mma_gpu.py", f"{region}[one-token]", f"{region}[capacity]"]
    else:  # the emulated GPU is 8.0: this file's tests run in the rerun too
        files.insert(0, "tests/ops/test_grouped_mm_fp8_mma_gpu.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MOE_KERNELS_PORTABLE_MMA="1", MOE_KERNELS_EMU_CAPABILITY="8.9", **{CHILD: "1"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x", "-m", "gpu",
                           *files], env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    first = next((line for line in proc.stdout.splitlines() if line.startswith("E ")), "")
    assert proc.returncode == 0 and " passed" in proc.stdout, (f"the FP8 suites on the tensor-core kernel: {first}\n"
                                                              + proc.stdout[-6000:] + proc.stderr[-3000:])
