"""FP8 blockwise grouped GEMM: GPU tier, the CUTLASS sm_90a kernel against an fp64 reference."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8_reference
from moe_kernels._ext import reference_ops
from moe_kernels.testing import assert_close_to_fp64, random_routing
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
# Emulated, the op dequantizes and runs the portable fp32 GEMM (no sm_90a): GEMM FLOP per case.
EMULATION_BUDGET = 2.5e8


def _sizes(M, E, kind, seed):
    if kind == "one_group":
        s = torch.zeros(E, dtype=torch.int32)
        s[E // 2] = M
        return s
    idx = random_routing(M, E, 1, kind=kind, seed=seed)
    return torch.bincount(idx.view(-1).long(), minlength=E).to(torch.int32)


def _case(M, N, K, E, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, K)
    w = torch.randn(E, N, K, generator=g) * 0.05
    with reference_ops():
        xq, xs = mk.quantize_fp8(x, "block")
        wq, ws = mk.quantize_fp8_experts(w)
    return xq, xs, wq, ws, _sizes(M, E, kind, seed)


@pytest.mark.parametrize("M,N,K,E", [(1, 128, 128, 1), (300, 256, 384, 8),
                                     pytest.param(4096, 2048, 7168, 32, marks=pytest.mark.gpu_memory),
                                     pytest.param(8192, 1536, 4096, 16, marks=pytest.mark.gpu_memory), (777, 4096, 768, 8), (2048, 1040, 512, 4), (64, 200, 256, 2), (64, 196, 256, 2)])
@pytest.mark.parametrize("kind", ["uniform", "zipf", "empty", "one_group"])
def test_matches_fp64_reference(cuda, M, N, K, E, kind):
    skip_if_too_large(2 * M * N * K, EMULATION_BUDGET, "GEMM FLOP")
    xq, xs, wq, ws, gs = _case(M, N, K, E, kind, seed=M + N + K)
    dev = [t.to(cuda) for t in (xq, xs, wq, ws, gs)]
    out = mk.grouped_mm_fp8(*dev)
    ref64 = grouped_mm_fp8_reference(*dev, acc=torch.float64)  # on the device: fp64 GEMMs are slow on a host
    rows = int(gs.sum())
    # bf16 output: the kernel's error against fp64 may be at most twice that of the fp32 reference
    # rounded to bf16 (plus a floor for Hopper's FP8 accumulation inside each 128-wide K block).
    baseline = grouped_mm_fp8_reference(*dev).to(torch.bfloat16)
    assert_close_to_fp64(out[:rows].float(), baseline[:rows].float(), ref64[:rows], f"fp8 {M}x{N}x{K} E={E} {kind}",
                         floor=1e-3 * float(ref64.abs().max()) + 1e-6)


def fallback_path(C, shape: dict) -> int:
    """grouped_mm_path's code for an FP8 problem that no CUTLASS kernel takes: the tensor-core portable kernel (8)
    where MOE_KERNELS_PORTABLE_MMA=1 and it takes the problem on this GPU, else none (0: the op dequantizes)."""
    if not C.grouped_mm_portable_mma_enabled():
        return 0
    try:
        return C.grouped_mm_path(**dict(shape, portable=1))
    except ValueError:
        return 0


def test_takes_the_blockwise_kernel_on_hopper(cuda):
    if cuda.type != "cuda":
        pytest.skip("kernel choice exists on a GPU only")
    from moe_kernels import _ext

    C = _ext.kernels("grouped_mm_fp8", torch.empty(1, device=cuda))
    cc = torch.cuda.get_device_capability(cuda)
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _case(256, 256, 256, 2, "uniform", seed=1))
    out = torch.empty(256, 256, dtype=torch.bfloat16, device=cuda)
    shape = dict(op=0, dtype=3, num_groups=2, M=256, N=256, K=256, a=xq.data_ptr(), b=wq.data_ptr(),
                 d=out.data_ptr(), device=cuda.index or 0, sfa=xs.data_ptr(), sfb=ws.data_ptr())
    assert C.grouped_mm_path(**shape) == (3 if cc == (9, 0) and C.grouped_mm_has_sm90 else fallback_path(C, shape))


@pytest.mark.cuda_device
def test_cuda_graph_replay(cuda):
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _case(1024, 512, 1024, 8, "zipf", seed=2))
    eager = mk.grouped_mm_fp8(xq, xs, wq, ws, gs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.grouped_mm_fp8(xq, xs, wq, ws, gs)
    graph.replay()
    torch.cuda.synchronize()
    rows = int(gs.sum())
    assert torch.equal(out[:rows], eager[:rows])


def test_deterministic(cuda):
    skip_if_too_large(2 * 4096 * 1024 * 2048, EMULATION_BUDGET, "GEMM FLOP")
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _case(4096, 1024, 2048, 16, "zipf", seed=3))
    first = mk.grouped_mm_fp8(xq, xs, wq, ws, gs)
    for _ in range(3):
        assert torch.equal(mk.grouped_mm_fp8(xq, xs, wq, ws, gs), first)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "default"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "registered"])
def test_autocast_does_not_change_the_product(cuda, monkeypatch, direct, fallback):
    # The op takes E4M3 codes and returns bf16 from fp32 accumulators on every path: autocast must not reach inside
    # (the dequantizing fallback once rounded its fp32 operands to bf16 under it). The same bits with and without
    # it, the op called in grad mode (registered) and without (its implementation straight); `fallback` forces the
    # dequantizing path (no FP8 kernel takes the problem) on any device.
    import importlib

    if fallback:
        monkeypatch.setattr(importlib.import_module("moe_kernels.ops.grouped_mm_fp8"), "_run_forward",
                            lambda *args, **kwargs: None)
    xq, xs, wq, ws, gs = (t.to(cuda) for t in _case(300, 256, 384, 8, "zipf", seed=5))
    with torch.set_grad_enabled(not direct):
        plain = mk.grouped_mm_fp8(xq, xs, wq, ws, gs)
        with torch.autocast(cuda.type, dtype=torch.bfloat16):
            under = mk.grouped_mm_fp8(xq, xs, wq, ws, gs)
    rows = int(gs.sum())
    assert torch.equal(under[:rows], plain[:rows])


def test_permuted_padding_rows_give_zeros_and_finite_gradients(cuda):
    # quantize -> permute(align=128) on the device: padding rows have codes 0 and scale 0, a block of
    # zeros for the GEMM (the CUTLASS kernel's inverse scale stays 0, not inf), so the next GEMM's wgrad
    # over those rows is finite. Expected: the references on the CPU, from the device's permuted operands.
    from moe_kernels.ops.grouped_mm import grouped_mm_reference, grouped_mm_wgrad_reference
    from moe_kernels.ops.permute import unpermute_bwd_reference
    from moe_kernels.ops.quant import dequantize_fp8_reference
    from moe_kernels.testing import FP8_MMA_MAGNITUDE, assert_within_fp32_rounding, assert_within_rounding_to
    from tests.ops.test_grouped_mm_fp8 import padding_rows, permuted_fp8_operands, permuted_fp8_pipeline

    with reference_ops():
        x, idx, weights, w1q, w1s, w2 = permuted_fp8_operands(T=300, E=8, K=512, N=256, H=128, seed=6)
    h, row_map, sizes, out, dw = (t.cpu() for t in permuted_fp8_pipeline(x, idx, weights, w1q, w1s, w2, 128, cuda))
    rows = int(sizes.sum())
    pad = padding_rows(row_map, sizes)
    assert bool(pad.any()), "the case must hold padding rows"
    assert bool(torch.isfinite(h[:rows]).all()) and bool((h[:rows][pad] == 0).all()), "padding rows are zeros"
    assert bool(torch.isfinite(dw).all()), "wgrad over the padding rows"
    xq, xs = mk.quantize_fp8(x.to(cuda), "block")
    q, _, _ = mk.permute(xq, idx.to(cuda), 8, align=128)
    s, _, _ = mk.permute(xs, idx.to(cuda), 8, align=128)
    ref = grouped_mm_fp8_reference(q.cpu(), s.cpu(), w1q, w1s, sizes).to(torch.bfloat16).float()
    assert bool(torch.isfinite(ref[:rows]).all()) and bool((ref[:rows][pad] == 0).all()), "reference padding rows"
    # Both bf16 roundings of sums of the same dequantized products: one ulp + the sums' rounding, with the FP8
    # tensor cores' accumulation inside each 128-wide K block (FP8_MMA_MAGNITUDE).
    q_deq = dequantize_fp8_reference(q.cpu(), s.cpu(), "block", torch.float32).abs()
    w_deq = torch.stack([dequantize_fp8_reference(w1q[e], w1s[e], "tile", torch.float32) for e in range(8)]).abs()
    terms = grouped_mm_reference(q_deq, w_deq, sizes)[:rows]
    assert_within_rounding_to(h[:rows], ref[:rows], FP8_MMA_MAGNITUDE * terms, torch.bfloat16, "FP8 GEMM over permuted operands")
    # dw2 = dy^T h over the groups, dy from unpermute's backward (zero in the padding rows).
    dy = unpermute_bwd_reference(2 * out, row_map, weights, None, h.shape[0])[0]
    dw_ref = grouped_mm_wgrad_reference(dy, h, sizes)
    assert_within_fp32_rounding(dw, dw_ref, grouped_mm_wgrad_reference(dy.abs(), h.abs(), sizes), "dw2")


@pytest.mark.parametrize("raster", [0, 1], ids=["along_m", "along_n"])
@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_group"])
def test_every_fp8_forward_instance_is_bitwise_the_default(cuda, kind, raster):
    """The FP8 forward instances share the K-block order, the MMA instruction (m64n128k32, one per warpgroup
    and 64 rows) and the promotion per element, so a cluster, a raster order or ping-pong's 64-row tiles
    change how tiles are loaded and visited, not a bit of the result."""
    from moe_kernels import _ext
    from moe_kernels.ops.grouped_mm_fp8 import _inverse_scale, _launch_fp8

    if cuda.type != "cuda" or torch.cuda.get_device_capability(cuda) != (9, 0) or not _ext._C.grouped_mm_has_sm90:
        pytest.skip("the sm_90a instances need an H100/H200 and a build with them")
    C = _ext._C
    M, N, K, E = 777, 512, 768, 8
    xq, xs, wq, ws, gs = [t.to(cuda) for t in _case(M, N, K, E, kind, seed=11)]
    expected = mk.grouped_mm_fp8(xq, xs, wq, ws, gs)
    rows = int(gs.sum())
    names = []
    for i, spec in enumerate(C.grouped_mm_sm90_kernels()):
        if spec["dtype"] != 3 or spec["op"] != 0:
            continue
        names.append(spec["name"])
        out = torch.full((M, N), float("nan"), device=cuda, dtype=torch.bfloat16)
        assert _launch_fp8(C, 0, xq, wq, out, _inverse_scale(xs), _inverse_scale(ws), gs, M, N, K, kernel=i,
                           raster=raster)
        assert torch.equal(out[:rows], expected[:rows]), f"{spec['name']} raster={raster} {kind}"
    assert any("pingpong" in n for n in names) and any("_c2x1" in n for n in names), names
