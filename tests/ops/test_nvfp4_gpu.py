"""NVFP4 quantization: GPU tier, CUDA kernels against the reference bit for bit."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.quant import dequantize_nvfp4_reference, quantize_nvfp4_reference
from moe_kernels.testing import assert_exact
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**22  # elements per case

SHAPES = [(0, 16), (1, 16), (7, 48), (17, 64), (130, 7168), (4096, 2048)]


def _input(M, K, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)
    if specials and M * K > 64:
        flat = x.view(-1)
        flat[16:32] = 0.0  # an all-zero block
        flat[40] = -0.0
        flat[50] = 1e-42
        flat[64:80] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties of the grid
    return x.to(dtype)


def _check(x_cpu, x_dev, what, **kw):
    dev_kw = {k: (v.to(x_dev.device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    p, sb, sg = mk.quantize_nvfp4(x_dev, **dev_kw)
    rp, rsb, rsg = quantize_nvfp4_reference(x_cpu, kw.get("global_amax"), kw.get("tile_2d", False), kw.get("rng"))
    assert_exact(sg.cpu(), rsg, f"{what} global scale")
    assert_exact(sb.cpu().view(torch.uint8), rsb.view(torch.uint8), f"{what} block scales")
    assert_exact(p.cpu(), rp, f"{what} codes")
    for dt in (torch.float32, torch.bfloat16):
        assert_exact(mk.dequantize_nvfp4(p, sb, sg, dtype=dt).cpu(), dequantize_nvfp4_reference(rp, rsb, rsg, dt),
                     f"{what} dequant {dt}")


@pytest.mark.parametrize("M,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["1d", "2d", "stochastic", "given_amax"])
def test_quantize_matches_reference(cuda, M, K, dtype, mode):
    skip_if_too_large(M * K, EMULATION_BUDGET, "elements")
    x = _input(M, K, dtype, seed=M + K, specials=True)
    kw = {"1d": {}, "2d": {"tile_2d": True}, "stochastic": {"rng": torch.tensor([2024, 77])},
          "given_amax": {"global_amax": torch.tensor(50.0)}}[mode]
    _check(x, x.to(cuda), f"{mode} {M}x{K} {dtype}", **kw)


def test_nan_and_inf(cuda):
    x = _input(4, 64, torch.float32, seed=1)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    _check(x, x.to(cuda), "non-finite")
    _check(x, x.to(cuda), "non-finite, given amax", global_amax=torch.tensor(10.0))


def test_misaligned_input_takes_the_scalar_path(cuda):
    x = _input(9, 64, torch.bfloat16, seed=3)
    base = torch.empty(x.numel() + 1, dtype=x.dtype, device=cuda)
    dev = base[1:].view(9, 64)
    dev.copy_(x.to(cuda))
    assert dev.data_ptr() % 16 != 0
    _check(x, dev, "misaligned")
    _check(x, dev, "misaligned, stochastic", rng=torch.tensor([5, 0]))


@pytest.mark.cuda_device
def test_rng_offset_read_on_device_in_cuda_graph(cuda):
    # The (seed, offset) pair is a device tensor: a captured graph reads it at every replay, so the caller
    # advances the offset between replays and gets fresh, reproducible draws.
    x = torch.full((32, 256), 1.2, device=cuda)
    x[:, ::16] = 6.0
    rng = torch.tensor([99, 0], device=cuda)
    amax = torch.tensor(2688.0, device=cuda)
    mk.quantize_nvfp4(x, global_amax=amax, rng=rng)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.quantize_nvfp4(x, global_amax=amax, rng=rng)
    seen = []
    for offset in (0, 8192, 16384):
        rng[1] = offset
        graph.replay()
        torch.cuda.synchronize()
        ref = quantize_nvfp4_reference(x.cpu(), amax.cpu(), False, torch.tensor([99, offset]))
        assert_exact(out[0].cpu(), ref[0], f"replay at offset {offset}")
        seen.append(out[0].clone())
    assert not torch.equal(seen[0], seen[1])


def test_deterministic(cuda):
    skip_if_too_large(4096 * 7168, EMULATION_BUDGET, "elements")
    x = torch.randn(4096, 7168, device=cuda, dtype=torch.bfloat16)
    first = mk.quantize_nvfp4(x)
    for _ in range(3):
        again = mk.quantize_nvfp4(x)
        assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])


# The scales' conversion into CUTLASS's blocked layout (the sm_100f NVFP4 GEMM's input; it runs on every build)


@pytest.mark.parametrize("K", [16, 48, 64, 1024, 7168])
@pytest.mark.parametrize("sizes", [[5, 0, 130, 7], [0], [300], [128, 128, 0, 1], [0, 0, 0], [100, 100, 100]],
                         ids=["mixed", "empty", "one-group", "aligned-then-one", "all-empty", "past-m"])
def test_blocked_scales_of_grouped_rows(cuda, K, sizes):
    """Each group's rows padded to 128 and laid out in atoms of 128 rows x 4 scales (nvfp4_blocked_scales_reference:
    CUTLASS's Sm1xxBlockScaledConfig), through grouped_mm's own prepare kernel; sizes past the rows are clamped
    (past-m: 300 rows asked of 250), atom rows past the groups' stay untouched."""
    from moe_kernels.ops.grouped_mm_nvfp4 import nvfp4_blocked_scales, nvfp4_blocked_scales_reference

    M = 250 if len(sizes) == 3 and sum(sizes) == 300 else sum(sizes) + 3
    g = torch.Generator().manual_seed(K + M)
    scale = torch.randint(1, 255, (M, K // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    gs = torch.tensor(sizes, dtype=torch.int32)
    got = nvfp4_blocked_scales(scale.to(cuda), gs.to(cuda))
    assert_exact(got.cpu(), nvfp4_blocked_scales_reference(scale, gs), f"K={K} sizes={sizes}")


@pytest.mark.parametrize("E,N,K", [(1, 128, 64), (3, 200, 48), (4, 16, 1024), (2, 2048, 7168)])
def test_blocked_scales_of_expert_weights(cuda, E, N, K):
    from moe_kernels.ops.grouped_mm_nvfp4 import nvfp4_blocked_scales, nvfp4_blocked_scales_reference

    g = torch.Generator().manual_seed(E * N + K)
    scale = torch.randint(1, 255, (E, N, K // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert_exact(nvfp4_blocked_scales(scale.to(cuda)).cpu(), nvfp4_blocked_scales_reference(scale), f"{E}x{N}x{K}")


def test_blocked_scales_reference_is_cutlass_layout():
    """The reference's byte order, written out for one atom: row i, scale c at (i % 32) * 16 + (i // 32) * 4 + c
    (Sm1xxBlockScaledBasicChunk's K-major atom: Shape((32, 4), (16, 4)), Stride((16, 4), (0, 1)))."""
    from moe_kernels.ops.grouped_mm_nvfp4 import nvfp4_blocked_scales_reference

    rows = torch.arange(128, dtype=torch.int64)
    scale = torch.stack([(rows * 4 + c) % 251 for c in range(4)], 1).to(torch.uint8)  # [128, 4]: K = 64
    got = nvfp4_blocked_scales_reference(scale.view(torch.float8_e4m3fn)[None])  # one expert of 128 rows
    for i in (0, 1, 31, 32, 33, 127):
        for c in range(4):
            assert int(got[(i % 32) * 16 + (i // 32) * 4 + c]) == int(scale[i, c])


def test_nvfp4_grouped_mm_off_blackwell_takes_the_emulation(cuda):
    """Where no sm_100f NVFP4 kernel runs (every GPU but an opted-in 10.0/10.3, the CPU-executed build), the
    extension answers the portable path, grouped_mm_nvfp4 runs the exact emulation, and asking the extension
    for the NVFP4 product anyway is a clear error."""
    from moe_kernels import _ext
    from moe_kernels.ops.grouped_mm_nvfp4 import grouped_mm_nvfp4, grouped_mm_nvfp4_reference, quantize_nvfp4_experts

    C = _ext.kernels("grouped_mm_nvfp4", torch.empty(1, device=cuda))
    if C is None:
        pytest.skip("no extension kernels on this device")
    if cuda.type == "cuda" and torch.cuda.get_device_capability(cuda)[0] == 10:
        pytest.skip("a Blackwell GPU: tests/ops/test_grouped_mm_sm100_gpu.py")
    E, M, N, K = 3, 40, 32, 64
    g = torch.Generator().manual_seed(7)
    x_q, x_s, x_g = mk.quantize_nvfp4(torch.randn(M, K, generator=g).to(cuda))
    w_q, w_s, w_g = quantize_nvfp4_experts(torch.randn(E, N, K, generator=g).to(cuda))
    gs = torch.tensor([10, 0, 30], dtype=torch.int32, device=cuda)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=cuda)
    x_g1, w_g1 = x_g.reshape(1), w_g.reshape(1)
    shape = dict(op=0, dtype=6, num_groups=E, M=M, N=N, K=K, a=x_q.data_ptr(), b=w_q.data_ptr(), d=out.data_ptr(),
                 sfa=x_s.data_ptr(), sfb=w_s.data_ptr(), a_global=x_g1.data_ptr(), b_global=w_g1.data_ptr())
    assert C.grouped_mm_path(**shape, device=_ext.launch_args(x_q)["device"]) == 0
    nbytes = C.grouped_mm_workspace_bytes(**shape, device=_ext.launch_args(x_q)["device"])
    ws, ws_ptr = _ext.workspace(nbytes, x_q)
    with pytest.raises(ValueError, match="nvfp4: the block-scaled kernel needs"):
        C.grouped_mm(**shape, group_sizes=gs.data_ptr(), workspace=ws_ptr, workspace_bytes=nbytes,
                     **_ext.launch_args(x_q))
    got = grouped_mm_nvfp4(x_q, x_s, x_g, w_q, w_s, w_g, gs)
    ref = grouped_mm_nvfp4_reference(x_q.cpu(), x_s.cpu(), x_g.cpu(), w_q.cpu(), w_s.cpu(), w_g.cpu(), gs.cpu())
    # The emulation: exact block-scaled values, fp32 accumulation over K = 64, then one bf16 rounding (2^-9
    # relative); 2^-7 relative leaves 4x margin, the absolute term covers the fp32 sums of values near 0.
    assert torch.allclose(got[:40].double().cpu(), ref[:40], rtol=2**-7, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_e2m1_input_rounds_as_the_reference(cuda, dtype):
    """The E2M1 rounding on every bf16 magnitude in [0, 8] and, in fp32, one ulp either side of each tie and grid
    point, both signs: each block holds a 6 (its amax) and the global amax is 2688 = 448 * 6, so the block scale is
    1 and the codes are those of the values themselves."""
    mags = torch.arange(0, 0x4100 + 1, dtype=torch.int16).view(torch.bfloat16).float()  # bf16 bits 0 .. 8.0
    if dtype == torch.float32:
        pts = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
        mags = torch.cat([mags, torch.nextafter(pts, torch.zeros(())), torch.nextafter(pts, torch.full((), 9.0))])
    vals = torch.cat([mags, -mags, torch.tensor([float("inf"), -float("inf"), float("nan")])])
    vals = torch.cat([vals, vals.new_zeros(-vals.numel() % (15 * 8))]).view(-1, 15)  # blocks: a multiple of 8
    x = torch.cat([vals, torch.full((vals.shape[0], 1), 6.0)], dim=1).reshape(-1, 16 * 8).to(dtype)
    _check(x, x.to(cuda), f"every e2m1 input {dtype}", global_amax=torch.tensor(2688.0))
    p, sb, _ = mk.quantize_nvfp4(x.to(cuda), global_amax=torch.tensor(2688.0, device=cuda))
    blocks = x.view(-1, 16).float()
    unit = torch.isfinite(blocks).all(dim=1) & (blocks.abs().amax(dim=1) <= 6)  # amax 6: block scale 1
    assert unit.sum() > 0.9 * unit.numel()
    assert (sb.cpu().view(torch.uint8).view(-1)[unit] == 0x38).all()  # E4M3 1.0: the codes are the values' own
