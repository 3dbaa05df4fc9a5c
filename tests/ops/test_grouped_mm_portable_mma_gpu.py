"""grouped_mm's portable kernel on tensor cores (csrc/gemm/portable_mma.cuh): GPU tier.

The kernel is asked for by name (`portable=1`) on whatever GPU runs the tier, so an H100/H200 checks the
mma.sync and ldmatrix fragments that an A100 or an RTX GPU would run. Each product is compared with fp64:
its error at most twice that of torch's own per-expert matmul at the same precision, plus the ULP floor
(moe_kernels.testing's rule, as for every grouped GEMM path). On the CPU-executed build the instructions are
spelled with warp shuffles that sum each output's products in fp32 along the contraction, the order of the
CUDA-core portable kernel, so there the two kernels must agree bit for bit: an element that a fragment or
an ldmatrix address puts in the wrong place cannot hide inside a tolerance.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from moe_kernels import _ext
from moe_kernels.ops.grouped_mm import grouped_mm_dgrad_reference, grouped_mm_reference, grouped_mm_wgrad_reference
from moe_kernels.testing import assert_close_to_fp64, assert_exact
from tests.emulation import EMULATED, SANITIZED, skip_if_emulated, skip_if_sanitized
from tests.ops.test_grouped_mm_gpu import _loop_bwd, _loop_fwd, splits

G = importlib.import_module("moe_kernels.ops.grouped_mm")
pytestmark = pytest.mark.gpu
MMA_PATH, CUDA_CORE_PATH = 8, 0  # grouped_mm_path's codes


def _run(op: str, a, b, gs, M: int, N: int, K: int, portable: int):
    """One product through the launcher with the portable kernel named; the output starts as NaN, so an
    element the kernel does not write shows."""
    shape = {"fwd": (M, N), "dgrad": (M, K), "wgrad": (gs.shape[0], N, K)}[op]
    out = torch.full(shape, float("nan"), dtype=a.dtype, device=a.device)
    G._launch(op, a, b, out, gs, M, N, K, _ext.kernels("grouped_mm", a), portable=portable)
    return out


def _check(dev, x, w, gs, what: str, *, offset: int = 0) -> None:
    """fwd, dgrad and wgrad of one problem on the tensor-core kernel against fp64 (and, on the CPU-executed
    build, bit for bit against the CUDA-core kernel). offset > 0 shifts every operand off 16-byte alignment."""
    M, K = x.shape
    E, N, _ = w.shape
    n = int(gs.sum().clamp(max=M))
    gen = torch.Generator().manual_seed(M + N + K)
    g = torch.randn(M, N, generator=gen).to(x.dtype)

    def on_dev(t):  # a copy on the device, `offset` elements into a buffer
        buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=dev)
        view = buf[offset:].view(t.shape)
        view.copy_(t)
        return view

    xd, wd, gd, gsd = on_dev(x), on_dev(w), on_dev(g), gs.to(dev)
    outs = {op: _run(op, a, b, gsd, M, N, K, 1) for op, a, b in (("fwd", xd, wd), ("dgrad", gd, wd), ("wgrad", gd, xd))}
    x64, w64, g64 = xd.double(), wd.double(), gd.double()
    base_dx, base_dw = _loop_bwd(gd, xd, wd, gs)
    assert_close_to_fp64(outs["fwd"][:n], _loop_fwd(xd, wd, gs)[:n], grouped_mm_reference(x64, w64, gsd)[:n],
                         f"fwd {what}", floor=1e-3)
    assert_close_to_fp64(outs["dgrad"][:n], base_dx[:n], grouped_mm_dgrad_reference(g64, w64, gsd)[:n],
                         f"dgrad {what}", floor=1e-3)
    assert bool((outs["dgrad"][n:] == 0).all()), f"dgrad {what}: rows past the groups must be zero"
    assert_close_to_fp64(outs["wgrad"], base_dw, grouped_mm_wgrad_reference(g64, x64, gsd), f"wgrad {what}",
                         floor=1e-3)
    for e in (gs == 0).nonzero().flatten().tolist():
        assert bool((outs["wgrad"][e] == 0).all()), f"wgrad {what}: empty group {e} must be zero"
    if EMULATED:
        for op, a, b in (("fwd", xd, wd), ("dgrad", gd, wd), ("wgrad", gd, xd)):
            cores = _run(op, a, b, gsd, M, N, K, 0)
            rows = slice(0, n) if op == "fwd" else slice(None)  # fwd rows past the groups are unspecified
            assert_exact(outs[op][rows], cores[rows], f"{op} {what}: tensor-core vs CUDA-core kernel")


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "single"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_fp64(cuda, kind, dtype):
    # Rows, N and K past a tile (128, 128, 32) and not multiples of it; three rows past the groups.
    E, M, N, K = 8, 300, 136, 200
    if dtype == torch.float16 and kind != "uniform":
        skip_if_sanitized("fp16 makes bf16's 2-byte loads and stores; every bf16 case and fp16's uniform one run here")
    gs = splits(kind, M - 3, E, seed=2)
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) / K**0.5).to(dtype)
    _check(cuda, x, w, gs, f"{kind} {dtype}")


@pytest.mark.parametrize("N,K,offset", [(33, 19, 0), (72, 40, 1), (8, 8, 0), (130, 1, 0), (1, 130, 3)],
                         ids=["odd", "misaligned_pointers", "one_fragment", "k1", "n1"])
def test_unaligned_and_tiny(cuda, N, K, offset):
    # Leading dimensions off 8 elements or base pointers off 16 bytes take the element-wise loads.
    E, M = 5, 157
    gs = splits("skewed", M, E, seed=4)
    x = torch.randn(M, K).to(torch.bfloat16)
    w = (torch.randn(E, N, K) / K**0.5).to(torch.bfloat16)
    _check(cuda, x, w, gs, f"N={N} K={K} offset={offset}", offset=offset)


@pytest.mark.parametrize("E,M", [(1, 260), (128, 200), (3, 0)], ids=["dense", "128_experts", "no_rows"])
def test_group_counts(cuda, E, M):
    gs = splits("skewed", M, E, seed=5) if M else torch.zeros(E, dtype=torch.int32)
    x = torch.randn(M, 64).to(torch.bfloat16)
    w = (torch.randn(E, 48, 64) / 8).to(torch.bfloat16)
    _check(cuda, x, w, gs, f"E={E} M={M}")


def test_hot_expert_and_sizes_past_m(cuda):
    # One expert holds almost every row; the sizes sum past M (clamped on the device, nothing outside read).
    E, M, N, K = 4, 400, 64, 96
    gs = torch.tensor([3, 390, 0, 60], dtype=torch.int32)
    x = torch.randn(M, K).to(torch.bfloat16)
    w = (torch.randn(E, N, K) / K**0.5).to(torch.bfloat16)
    clamped = torch.tensor([3, 390, 0, 7], dtype=torch.int32)
    xd, wd = x.to(cuda), w.to(cuda)
    out = _run("fwd", xd, wd, gs.to(cuda), M, N, K, 1)
    assert_close_to_fp64(out, _loop_fwd(xd, wd, clamped), grouped_mm_reference(xd.double(), wd.double(), clamped),
                         "fwd, sizes past M", floor=1e-3)


def test_zero_length_contraction(cuda):
    gs = torch.tensor([3, 2], dtype=torch.int32, device=cuda)
    x = torch.randn(6, 0, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(2, 8, 0, device=cuda, dtype=torch.bfloat16)
    out = _run("fwd", x, w, gs, 6, 8, 0, 1)
    assert bool((out[:5] == 0).all()), "K = 0: the product is zeros"
    dx = _run("dgrad", torch.randn(6, 0, device=cuda, dtype=torch.bfloat16), torch.randn(2, 0, 16, device=cuda,
              dtype=torch.bfloat16), gs, 6, 0, 16, 1)
    assert bool((dx == 0).all()), "N = 0: dgrad is zeros"


@pytest.mark.parametrize("stages", ["2", "3", "4"])
def test_every_stage_count_gives_the_same_bits(cuda, stages, monkeypatch):
    # The launcher fits as many shared-memory stages as the SM holds for two CTAs (4 on an A100 or H100, 2 on
    # 8.6, 8.9 and 12.x GPUs); MOE_KERNELS_MMA_STAGES asks for another count. Stages change when a slice arrives,
    # never what a thread sums in which order, so every count gives the default's bits (the fused products run at 3
    # stages in test_gathered_products_and_swiglu_epilogue). K = 200 is 7 slices of 32 (bf16 and fp16); K = 40 is 2,
    # fewer than the stages in flight; K = 37 puts the leading dimensions off 8 elements, so the operands strided
    # by K take the element-wise loads in every slice.
    cases = ((200, torch.bfloat16), (200, torch.float16), (40, torch.bfloat16), (37, torch.bfloat16))
    if SANITIZED:  # the sanitized kernels: one count, the short contractions
        if stages != "3":
            pytest.skip("under ASan 3 stages only; every count runs in the emulated tier and on a GPU")
        cases = cases[2:]
    E, M, N = 6, 300, 136
    gs = splits("skewed", M - 3, E, seed=7)
    n = M - 3
    for K, dtype in cases:
        gen = torch.Generator().manual_seed(K)
        x = torch.randn(M, K, generator=gen).to(dtype).to(cuda)
        w = (torch.randn(E, N, K, generator=gen) / K**0.5).to(dtype).to(cuda)
        g = torch.randn(M, N, generator=gen).to(dtype).to(cuda)
        problems = (("fwd", x, w), ("dgrad", g, w), ("wgrad", g, x))
        monkeypatch.delenv("MOE_KERNELS_MMA_STAGES", raising=False)
        default = {op: _run(op, a, b, gs.to(cuda), M, N, K, 1) for op, a, b in problems}
        monkeypatch.setenv("MOE_KERNELS_MMA_STAGES", stages)
        for op, a, b in problems:
            out = _run(op, a, b, gs.to(cuda), M, N, K, 1)
            rows = slice(0, n) if op == "fwd" else slice(None)  # fwd rows past the groups are unspecified
            assert_exact(out[rows], default[op][rows], f"{op} K={K} {dtype}: {stages} stages vs the default")
            assert not bool(out[rows].isnan().any()), f"{op} K={K} {dtype}: NaN (NaN equals NaN in assert_exact)"


@pytest.mark.parametrize("value", ["5", "1", "two"])
def test_stage_count_override_is_checked(cuda, value, monkeypatch):
    gs = torch.tensor([2, 2], dtype=torch.int32, device=cuda)
    x = torch.randn(4, 32, device=cuda).to(torch.bfloat16)
    w = torch.randn(2, 16, 32, device=cuda).to(torch.bfloat16)
    monkeypatch.setenv("MOE_KERNELS_MMA_STAGES", value)
    with pytest.raises(ValueError, match=f"MOE_KERNELS_MMA_STAGES must be 2, 3 or 4, not '{value}'"):
        _run("fwd", x, w, gs, 4, 16, 32, 1)


def test_path_choice_and_refusals(cuda):
    C = _ext.kernels("grouped_mm", torch.empty(0, device=cuda))
    dev = _ext.launch_args(torch.empty(0, device=cuda))["device"]
    bf16, fp32 = _ext.dtype_code(torch.bfloat16), _ext.dtype_code(torch.float32)
    shape = dict(op=0, num_groups=4, M=256, N=64, K=64, a=256, b=256, d=256, device=dev)
    assert C.grouped_mm_path(dtype=bf16, **shape, portable=1) == MMA_PATH
    assert C.grouped_mm_path(dtype=bf16, **shape, portable=0) == CUDA_CORE_PATH
    if not C.grouped_mm_portable_mma_enabled() and not (cuda.type == "cuda" and C.grouped_mm_has_sm90):
        assert C.grouped_mm_path(dtype=bf16, **shape) == CUDA_CORE_PATH, "opt-in: the default stays on CUDA cores"
    # The gather-fused expert MLP's products take it too: gathered rows (fwd, dgrad, wgrad) and the SwiGLU epilogue.
    for op, fusion in ((0, dict(a_rows=256, act=256)), (1, dict(a_rows=256)), (2, dict(a_rows=256, b_rows=256))):
        assert C.grouped_mm_path(dtype=bf16, **dict(shape, op=op), portable=1, **fusion) == MMA_PATH
    with pytest.raises(ValueError, match="tensor-core portable kernel was requested, but it takes bf16, fp16 and E4M3"):
        C.grouped_mm_path(dtype=fp32, **shape, portable=1)
    with pytest.raises(ValueError, match="portable must be"):
        C.grouped_mm_path(dtype=bf16, **shape, portable=2)
    with pytest.raises(ValueError, match="both requested"):
        C.grouped_mm_path(dtype=bf16, **shape, portable=1, kernel=0)
    x = torch.randn(8, 16, device=cuda, dtype=torch.float32)
    w = torch.randn(2, 4, 16, device=cuda, dtype=torch.float32)
    with pytest.raises(ValueError, match="takes bf16, fp16 and E4M3"):
        _run("fwd", x, w, torch.tensor([4, 4], dtype=torch.int32, device=cuda), 8, 4, 16, 1)


def test_opt_in_switch_runs_it_for_the_op(cuda):
    # MOE_KERNELS_PORTABLE_MMA=1 makes it the default where it fits: the public op then gives the bits of the
    # kernel asked for by name. A child process (the switch is read once per process).
    code = f"""
import importlib, torch
import moe_kernels as mk
from moe_kernels import _ext
G = importlib.import_module("moe_kernels.ops.grouped_mm")
dev = torch.device({str(cuda)!r})
C = _ext.kernels("grouped_mm", torch.empty(0, device=dev))
assert C.grouped_mm_portable_mma_enabled()
g = torch.Generator().manual_seed(0)
x = torch.randn(100, 40, generator=g).to(torch.bfloat16).to(dev)
w = torch.randn(3, 24, 40, generator=g).to(torch.bfloat16).to(dev)
gs = torch.tensor([50, 0, 50], dtype=torch.int32, device=dev)
out = mk.grouped_mm(x, w, gs)
named = torch.empty_like(out)
G._launch("fwd", x, w, named, gs, 100, 24, 40, C, portable=1)
assert torch.equal(out, named), "the switched-on default is the tensor-core kernel"
print("ok")
"""
    env = dict(os.environ, MOE_KERNELS_PORTABLE_MMA="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.long
def test_gathered_products_and_swiglu_epilogue(cuda):
    """The gather-fused expert MLP (gathered operand rows in every product, the SwiGLU epilogue in the forward) on
    the tensor-core kernel: expert_mlp's own bf16 and fp16 tests (fresh random inputs, 0 tokens, empty experts, a
    hot expert, dropped slots, padding rows, odd sizes, H = 1, several tiles a group, operands off 16-byte
    alignment) rerun in a process with MOE_KERNELS_PORTABLE_MMA=1 (read once per process), at 3 shared-memory
    stages (the default is 4 or 2: the plain products' tests cover those). The composition they compare with runs
    this kernel too where no CUTLASS kernel takes it, so on the CPU-executed build the two agree bit for bit; on a
    GPU both are held to the fp64 rule."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MOE_KERNELS_PORTABLE_MMA="1", MOE_KERNELS_GATHER_CUTLASS="0",  # not sm_90a's gather kernels
               MOE_KERNELS_MMA_STAGES="3")
    check = f"""
import torch
from moe_kernels import _ext
dev = torch.device({str(cuda)!r})
C = _ext.kernels("grouped_mm", torch.empty(0, device=dev))
d = _ext.launch_args(torch.empty(0, device=dev))["device"]
bf16 = _ext.dtype_code(torch.bfloat16)
shape = dict(dtype=bf16, num_groups=4, M=256, N=64, K=64, a=256, b=256, d=256, device=d)
assert C.grouped_mm_path(op=0, **shape, a_rows=256, act=256) == {MMA_PATH}, "the SwiGLU forward"
assert C.grouped_mm_path(op=1, **shape, a_rows=256) == {MMA_PATH}, "the gathered dgrad"
assert C.grouped_mm_path(op=2, **shape, a_rows=256, b_rows=256) == {MMA_PATH}, "the gathered wgrad"
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", check], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
    select = "(test_matches_composition_and_fp64 and not float32) or test_unaligned_operands"
    if SANITIZED:  # the sanitized kernels: bf16, the cases of one or two tiles
        select = "(test_matches_composition_and_fp64 or test_unaligned_operands) and bfloat16 and not tiles"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",  # -s: a
                           # sanitizer's report, printed before it aborts the child, reaches this test's message
                           "tests/ops/test_expert_mlp_gpu.py", "-k", select],
                          env=env, cwd=root, capture_output=True, text=True, timeout=900)
    first = next((line for line in proc.stdout.splitlines() if line.startswith("E ")), "")  # the first failure's
    assert proc.returncode == 0 and " passed" in proc.stdout, (f"expert_mlp on the tensor-core kernel: {first}\n"
                                                              + proc.stdout[-6000:] + proc.stderr[-3000:])


@pytest.mark.gpu_memory
def test_past_2_31_elements(cuda):
    # x and dx hold 2^31 + 2^16 elements: 64-bit offsets in the loads and the epilogue.
    skip_if_emulated("4.3 GB operands")
    M, N, K = 2**21 + 64, 16, 1024
    gen = torch.Generator(cuda).manual_seed(7)
    x = torch.randn(M, K, device=cuda, generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(2, N, K, device=cuda, generator=gen) / 32).to(torch.bfloat16)
    dout = torch.randn(M, N, device=cuda, generator=gen, dtype=torch.bfloat16)
    gs = torch.tensor([M - 200, 200], dtype=torch.int32, device=cuda)
    tail = slice(M - 200, M)  # group 1, past 2^31 elements into x and dx
    out = _run("fwd", x, w, gs, M, N, K, 1)
    ref = x[tail].double() @ w[1].double().t()
    assert_close_to_fp64(out[tail], (x[tail] @ w[1].t()), ref, "fwd past 2^31", floor=1e-3)
    dx = _run("dgrad", dout, w, gs, M, N, K, 1)
    ref = dout[tail].double() @ w[1].double()
    assert_close_to_fp64(dx[tail], dout[tail] @ w[1], ref, "dgrad past 2^31", floor=1e-3)
    dw = _run("wgrad", dout, x, gs, M, N, K, 1)
    ref = dout[tail].double().t() @ x[tail].double()
    assert_close_to_fp64(dw[1], dout[tail].t() @ x[tail], ref, "wgrad past 2^31", floor=1e-3)
