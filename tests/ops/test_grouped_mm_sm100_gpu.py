"""The Blackwell (sm_100f) grouped GEMM instances, GPU tier, on a 10.x GPU with MOE_KERNELS_SM100_CUTLASS=1 (they
are opt-in until these tests have passed on one): bf16 forward, dgrad and wgrad through the public ops against
fp64 with the bound of the per-expert torch loop in bf16 (odd M, rows past the groups, empty experts, one hot
expert, tiles straddling groups, sizes that are not multiples of the 256x256 tile), and the E4M3 blockwise
instances taking the FP8 ops. With the switch set, the FP8 GPU tests (test_grouped_mm_fp8_gpu.py,
test_grouped_mm_fp8_wgrad_gpu.py, the accumulate cases included) and the bf16 ones (test_grouped_mm_gpu.py)
run these instances too. Skipped elsewhere (there is no CPU-executed form of a CUTLASS kernel); the choice itself
is tested on the CPU (test_grouped_mm_dispatch)."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels import _ext
from moe_kernels.ops.grouped_mm import grouped_mm_dgrad_reference, grouped_mm_reference, grouped_mm_wgrad_reference
from moe_kernels.testing import assert_close_to_fp64
from tests.ops.test_grouped_mm_gpu import _loop_bwd, _loop_fwd, splits

pytestmark = pytest.mark.gpu

SM100_PATH = 4  # grouped_mm_path's code for the sm_100f instances


def _sm100_or_skip(cuda, N=256, K=384):
    if cuda.type != "cuda" or torch.cuda.get_device_capability(cuda)[0] != 10:
        pytest.skip("the sm_100f instances need a B200 / B300")
    C = _ext._C
    if not getattr(C, "grouped_mm_has_sm100", False):
        pytest.skip("this build has no sm_100f instances (MOE_KERNELS_CUDA_ARCHS without a 10.x target)")
    x = torch.empty(16, K, device=cuda, dtype=torch.bfloat16)
    w = torch.empty(2, N, K, device=cuda, dtype=torch.bfloat16)
    path = C.grouped_mm_path(op=0, dtype=_ext.dtype_code(torch.bfloat16), num_groups=2, M=16, N=N, K=K,
                             a=x.data_ptr(), b=w.data_ptr(), d=x.data_ptr(), device=cuda.index or 0)
    if path != SM100_PATH:
        pytest.skip("the sm_100f instances are opt-in: run with MOE_KERNELS_SM100_CUTLASS=1")
    return C


@pytest.mark.parametrize("E,M,N,K", [(8, 1003, 256, 384), (32, 4096, 2048, 7168 // 4), (3, 77, 200, 136),
                                     (128, 8192, 1536, 512)])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "single", "none"])
def test_products_match_fp64(cuda, E, M, N, K, kind):
    _sm100_or_skip(cuda, N, K)
    gs = splits(kind, M - 3, E, seed=E + M) if kind != "none" else torch.zeros(E, dtype=torch.int32)
    n = int(gs.sum())
    gen = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=gen).to(cuda, torch.bfloat16)
    w = (torch.randn(E, N, K, generator=gen) / K**0.5).to(cuda, torch.bfloat16)
    g = torch.randn(M, N, generator=gen).to(cuda, torch.bfloat16)
    gsd = gs.to(cuda)
    what = f"sm_100f E={E} M={M} N={N} K={K} {kind}"
    x64, w64, g64 = x.double(), w.double(), g.double()
    out = mk.grouped_mm(x, w, gsd)
    if n:  # rows past the groups are unspecified
        assert_close_to_fp64(out[:n], _loop_fwd(x, w, gs)[:n], grouped_mm_reference(x64, w64, gsd)[:n],
                             f"{what} fwd", floor=1e-3)
    dx = torch.ops.moe_kernels.grouped_mm_dgrad(g, w, gsd)
    dx_loop, dw_loop = _loop_bwd(g, x, w, gs)
    if n:
        assert_close_to_fp64(dx[:n], dx_loop[:n], grouped_mm_dgrad_reference(g64, w64, gsd)[:n], f"{what} dgrad",
                             floor=1e-3)
    assert bool((dx[n:] == 0).all()), f"{what}: dgrad rows past the groups must be zero"
    dw = torch.ops.moe_kernels.grouped_mm_wgrad(g, x, gsd)
    assert_close_to_fp64(dw, dw_loop, grouped_mm_wgrad_reference(g64, x64, gsd), f"{what} wgrad", floor=1e-3)
    for e in (gs == 0).nonzero().flatten().tolist():
        assert bool((dw[e] == 0).all()), f"{what}: empty expert {e} must have a zero gradient"


def test_deterministic_and_graph_capturable(cuda):
    _sm100_or_skip(cuda)
    E, M, N, K = 16, 4096, 1024, 2048
    gs = splits("skewed", M, E, seed=1).to(cuda)
    x = torch.randn(M, K, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=cuda, dtype=torch.bfloat16)
    first = mk.grouped_mm(x, w, gs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.grouped_mm(x, w, gs)
    graph.replay()
    torch.cuda.synchronize()
    n = int(gs.sum())
    assert torch.equal(out[:n], first[:n]) and torch.equal(mk.grouped_mm(x, w, gs)[:n], first[:n])


def test_a_requested_sm90_instance_is_refused(cuda):
    C = _sm100_or_skip(cuda)
    from moe_kernels.ops.grouped_mm import _launch

    x = torch.randn(64, 128, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(2, 64, 128, device=cuda, dtype=torch.bfloat16)
    gs = torch.tensor([32, 32], dtype=torch.int32, device=cuda)
    with pytest.raises(ValueError, match="sm_100f"):
        _launch("fwd", x, w, torch.empty(64, 64, device=cuda, dtype=torch.bfloat16), gs, 64, 64, 128, C, kernel=0)


def test_fp8_products_take_the_sm100_instances(cuda):
    _sm100_or_skip(cuda)
    from moe_kernels.ops.grouped_mm_fp8 import _SM100_FP8_PATH

    C = _ext._C
    code = _ext.dtype_code(torch.float8_e4m3fn)
    a = torch.empty(256, 256, device=cuda, dtype=torch.float8_e4m3fn)
    s = torch.empty(256, 2, device=cuda)
    for op, out_dtype in ((0, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16)):
        d = torch.empty(2, 256, 256, device=cuda, dtype=out_dtype)
        extra = {"fp8_wgrad_out": _ext.dtype_code(out_dtype)} if op == 2 and out_dtype != torch.float32 else {}
        path = C.grouped_mm_path(op=op, dtype=code, num_groups=2, M=256, N=256, K=256, a=a.data_ptr(),
                                 b=a.data_ptr(), d=d.data_ptr(), device=cuda.index or 0, sfa=s.data_ptr(),
                                 sfb=s.data_ptr(), **extra)
        assert path == _SM100_FP8_PATH, (op, out_dtype)


# NVFP4 block-scaled forward (grouped_mm_nvfp4 on a 10.x GPU, opted in)

NVFP4_PATH = 7  # grouped_mm_path's code for the sm_100f NVFP4 instance


def _nvfp4_operands(cuda, E, M, N, K, seed):
    from moe_kernels.ops.grouped_mm_nvfp4 import quantize_nvfp4_experts

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)  # blocks of very different scales
    w = torch.randn(E, N, K, generator=g) / K**0.5
    # 16x16 weight tiles need N % 16; N = 200 (N % 8, narrower than a tile) takes 1x16 blocks
    return (*mk.quantize_nvfp4(x.to(cuda)), *quantize_nvfp4_experts(w.to(cuda), tile_2d=N % 16 == 0))


@pytest.mark.parametrize("E,M,N,K", [(8, 1003, 256, 384), (3, 77, 200, 128), (32, 4096, 2048, 1792),
                                     (128, 8192, 1536, 512)])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "single", "none"])
def test_nvfp4_matches_fp64(cuda, E, M, N, K, kind):
    """The block-scaled kernel against the fp64 value of the same codes and scales, with the emulation (exact
    block-scaled values, fp32 accumulation, one bf16 rounding) as the error baseline (moe_kernels.testing's
    policy: at most 2x its error + 1e-3). Groups start at any row (the scales are re-blocked per group)."""
    from moe_kernels.ops.grouped_mm_nvfp4 import _launch_sm100, grouped_mm_nvfp4, grouped_mm_nvfp4_reference

    _sm100_or_skip(cuda)
    x_q, x_s, x_g, w_q, w_s, w_g = _nvfp4_operands(cuda, E, M, N, K, seed=E + M + K)
    gs = splits(kind, M - 3, E, seed=E + M) if kind != "none" else torch.zeros(E, dtype=torch.int32)
    gsd, n = gs.to(cuda), int(gs.sum())
    ours = _launch_sm100(x_q, x_s, x_g, w_q, w_s, w_g, gsd)
    assert ours is not None, "the NVFP4 kernel must take this problem (K % 32 == 0, N % 8 == 0)"
    emulated = grouped_mm_nvfp4(x_q, x_s, x_g, w_q, w_s, w_g, gsd, out_dtype=torch.float32).to(torch.bfloat16)
    ref = grouped_mm_nvfp4_reference(x_q, x_s, x_g, w_q, w_s, w_g, gsd)
    if n:
        assert_close_to_fp64(ours[:n], emulated[:n], ref[:n], f"nvfp4 E={E} M={M} N={N} K={K} {kind}", floor=1e-3)
    assert torch.equal(grouped_mm_nvfp4(x_q, x_s, x_g, w_q, w_s, w_g, gsd)[:n], ours[:n]), "the op takes the kernel"


def test_nvfp4_path_and_determinism(cuda):
    from moe_kernels.ops.grouped_mm_nvfp4 import _launch_sm100

    C = _sm100_or_skip(cuda)
    x_q, x_s, x_g, w_q, w_s, w_g = _nvfp4_operands(cuda, 4, 300, 256, 256, seed=1)
    out = torch.empty(300, 256, device=cuda, dtype=torch.bfloat16)
    xg, wg = x_g.reshape(1), w_g.reshape(1)
    shape = dict(op=0, dtype=6, num_groups=4, M=300, N=256, K=256, a=x_q.data_ptr(), b=w_q.data_ptr(),
                 d=out.data_ptr(), device=cuda.index or 0, sfa=x_s.data_ptr(), sfb=w_s.data_ptr(),
                 a_global=xg.data_ptr(), b_global=wg.data_ptr())
    assert C.grouped_mm_path(**shape) == NVFP4_PATH
    assert C.grouped_mm_path(**dict(shape, K=240)) == 0  # K % 32
    assert C.grouped_mm_path(**dict(shape, b_global=0)) == 0  # no global scale
    gs = torch.tensor([100, 0, 150, 47], dtype=torch.int32, device=cuda)
    a = _launch_sm100(x_q, x_s, x_g, w_q, w_s, w_g, gs)
    b = _launch_sm100(x_q, x_s, x_g, w_q, w_s, w_g, gs)
    assert torch.equal(a[:297], b[:297])
