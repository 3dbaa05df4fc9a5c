"""FP8 quantization: GPU tier, CUDA kernels against the reference bit for bit."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.quant import dequantize_fp8_reference, quantize_fp8_reference
from moe_kernels.testing import assert_exact
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**22  # elements per case

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRANS = ("tensor", "row", "block", "tile")
SHAPES = [(0, 128), (1, 1), (7, 300), (128, 128), (130, 7168), (4096, 2048), (33, 8)]


def _input(M, K, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-4, 4, K) if K else torch.empty(M, 0)
    if specials and M * K > 40:
        flat = x.view(-1)
        flat[3], flat[17], flat[29] = float("nan"), float("inf"), -float("inf")
        flat[5:9] = 0.0
        flat[31] = -0.0
        flat[33] = 1e-42  # fp32 denormal
    return x.to(dtype)


def _check(x_cpu, x_dev, gran, fp8_dtype, pow2, what):
    q, s = mk.quantize_fp8(x_dev, gran, fp8_dtype=fp8_dtype, pow2_scale=pow2)
    rq, rs = quantize_fp8_reference(x_cpu, gran, fp8_dtype, pow2)
    assert_exact(s.cpu(), rs, f"{what} scales")
    assert_exact(q.cpu().view(torch.uint8), rq.view(torch.uint8), f"{what} codes")
    for dt in (torch.float32, torch.bfloat16):
        out = mk.dequantize_fp8(q, s, gran, dtype=dt)
        assert_exact(out.cpu(), dequantize_fp8_reference(rq, rs, gran, dt), f"{what} dequant {dt}")


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("M,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_reference(cuda, gran, M, K, dtype):
    skip_if_too_large(M * K, EMULATION_BUDGET, "elements")
    x = _input(M, K, dtype, seed=M + K)
    _check(x, x.to(cuda), gran, E4M3, False, f"{gran} {M}x{K} {dtype}")


@pytest.mark.parametrize("M,K", [(7, 300), (130, 1856), (3, 136), (5, 7), (2, 128), (0, 200), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_codes_zero_padded_to_128(cuda, M, K, dtype):
    # pad_to_block: rows of ceil(K / 128) * 128 codes, zeros past K, written by the same pass (the vector path
    # where K % 8 == 0, else the scalar one); the scales as without it.
    x = _input(M, K, dtype, seed=M * K + 1, specials=True).to(cuda)
    Kp = -(-K // 128) * 128
    # Codes of 0x7f where q's block is likely to be allocated next (freed to the allocator), so padding left
    # unwritten shows.
    torch.full((M, Kp), 0x7F, dtype=torch.uint8, device=cuda).view(E4M3)
    q, s = mk.quantize_fp8(x, "block", pad_to_block=True)
    x = x.cpu()
    rq, rs = quantize_fp8_reference(x, "block", E4M3, False, pad_to_block=True)
    assert q.shape == (M, Kp)
    assert_exact(s.cpu(), rs, "scales")
    assert_exact(q.cpu().view(torch.uint8), rq.view(torch.uint8), "codes")
    assert not q.cpu().view(torch.uint8)[:, K:].any()


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_specials_formats_and_pow2(cuda, gran, fp8_dtype, pow2):
    # NaN, +-inf, zeros, -0 and denormals; a block of all zeros; both formats; power-of-two scales.
    x = _input(260, 515, torch.float32, seed=7, specials=True)
    x[200:, 256:384] = 0.0
    _check(x, x.to(cuda), gran, fp8_dtype, pow2, f"{gran} {fp8_dtype} pow2={pow2}")


@pytest.mark.parametrize("gran", ["block", "row", "tile"])
def test_misaligned_rows_take_the_scalar_path(cuda, gran):
    # A contiguous tensor whose storage starts one element in: 16-byte loads are not allowed.
    x = _input(9, 256, torch.bfloat16, seed=3)
    base = torch.empty(x.numel() + 1, dtype=x.dtype, device=cuda)
    dev = base[1:].view(9, 256)
    dev.copy_(x.to(cuda))
    assert dev.data_ptr() % 16 != 0
    _check(x, dev, gran, E4M3, False, f"misaligned {gran}")


def test_deterministic(cuda):
    skip_if_too_large(4096 * 7168, EMULATION_BUDGET, "elements")
    x = torch.randn(4096, 7168, device=cuda, dtype=torch.bfloat16)
    first = mk.quantize_fp8(x, "tensor")
    for _ in range(3):
        again = mk.quantize_fp8(x, "tensor")
        assert torch.equal(first[0].view(torch.uint8), again[0].view(torch.uint8)) and torch.equal(first[1], again[1])


@pytest.mark.slow
@pytest.mark.gpu_memory
def test_past_2_31_elements(cuda):
    M, K = (1 << 18) + 3, 8192  # 2^31 + 24576 elements, bf16: 4 GB in, 2 GB out
    skip_if_too_large(M * K, EMULATION_BUDGET, "elements")
    if cuda.type != "cuda":
        pytest.skip("needs GPU memory")
    x = torch.randn(M, K, device=cuda, dtype=torch.bfloat16)
    q, s = mk.quantize_fp8(x, "block")
    for r in (0, M // 2, M - 1):
        rq, rs = quantize_fp8_reference(x[r : r + 1].cpu(), "block")
        assert_exact(q[r : r + 1].cpu().view(torch.uint8), rq.view(torch.uint8), f"row {r} codes")
        assert_exact(s[r : r + 1].cpu(), rs, f"row {r} scales")
    del q, s
    q, s = mk.quantize_fp8(x, "tile")  # 128-row tiles: the first, the middle and the last (3 rows)
    for r in (0, (M // 2) // 128 * 128, M - 3):
        rows = min(128, M - r)
        rq, rs = quantize_fp8_reference(x[r : r + rows].cpu(), "tile")
        assert_exact(q[r : r + rows].cpu().view(torch.uint8), rq.view(torch.uint8), f"tile at row {r} codes")
        assert_exact(s[r // 128 : r // 128 + 1].cpu(), rs, f"tile at row {r} scales")


@pytest.mark.parametrize("H", [1024, 7168])
def test_payload_and_scales_travel_through_permute(cuda, H):
    from moe_kernels.testing import random_routing

    skip_if_too_large(1000 * 8 * H, EMULATION_BUDGET, "permuted elements")
    x = (torch.randn(1000, H, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16).to(cuda)
    q, s = mk.quantize_fp8(x, "block")
    idx = random_routing(1000, 64, 8, kind="zipf", drop=0.05, seed=4).to(cuda)
    q_perm, row_map, sizes = mk.permute(q, idx, 64, align=128)
    s_perm, row_map_s, sizes_s = mk.permute(s, idx, 64, align=128)
    assert_exact(row_map_s, row_map, "row maps")
    assert_exact(sizes_s, sizes, "group sizes")
    back = mk.dequantize_fp8(q_perm, s_perm, "block", dtype=torch.float32)
    expected = mk.dequantize_fp8(q, s, "block", dtype=torch.float32)
    valid = row_map >= 0
    tokens = torch.arange(1000, device=cuda)[:, None].expand_as(row_map)[valid]
    assert_exact(back[row_map[valid].long()], expected[tokens], "dequantized rows")


def test_float32_rows_16_bytes_off_32(cuda):
    # fp32 packs of 8 are 32 bytes: a base 16 bytes off a 32-byte boundary must take the scalar path.
    x = _input(6, 256, torch.float32, seed=8)
    base = torch.empty(x.numel() + 4, dtype=x.dtype, device=cuda)
    dev = base[4:].view(6, 256)
    dev.copy_(x.to(cuda))
    _check(x, dev, "block", E4M3, False, "fp32 at 16 mod 32")


def test_zero_scale_is_a_block_of_zeros(cuda):
    # permute's padding rows carry scale 0: the kernel dequantizes such a block to 0 (not 0 / 0 = NaN)
    # whatever its codes, as the reference does; the other blocks keep q / scale.
    from moe_kernels.ops.quant import _expand

    g = torch.Generator().manual_seed(10)
    for gran in GRANS:
        q, s = quantize_fp8_reference(torch.randn(300, 260, generator=g) * 3, gran)
        zero = torch.rand(s.shape, generator=g) < 0.5
        zero.view(-1)[0] = True
        s0 = torch.where(zero, torch.where(torch.rand(s.shape, generator=g) < 0.5, 0.0, -0.0), s)
        mask = _expand(zero, gran, *q.shape)
        for dt in (torch.float32, torch.bfloat16):
            out = mk.dequantize_fp8(q.to(cuda), s0.to(cuda), gran, dtype=dt).cpu()
            assert_exact(out, dequantize_fp8_reference(q, s0, gran, dt), f"{gran} {dt}")
            assert bool((out[mask] == 0).all()), f"{gran} {dt}: a zero scale gives zeros"
