"""quantize_fp8_experts_dual (the weight cache's quantization: 128x128 tiles in the forward's layout and in
dgrad's transposed one from one read of the weight): GPU tier, the one-pass kernel against the composition it
replaces (per-expert tile quantization, then the transposes of codes and scales) bit for bit."""

import pytest
import torch

from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_experts_dual, quantize_fp8_experts_dual_reference
from moe_kernels.testing import assert_exact
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**22  # elements per case

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weights(E, N, K, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread along both axes and across experts, so the tiles' scales differ.
    w = (torch.randn(E, N, K, generator=g) * torch.logspace(-3, 3, max(K, 1))[:K]
         * torch.logspace(-2, 2, max(N, 1))[:N, None] * torch.logspace(-4, 4, max(E, 1))[:E, None, None])
    if specials and N >= 200 and K >= 200:
        w[0, 3, 5], w[0, 17, 9], w[0, 29, 130] = float("nan"), float("inf"), -float("inf")
        w[0, 40:45, 7] = 0.0
        w[0, 50, 11] = -0.0
        w[0, 60, 12] = 1e-42  # fp32 denormal
        w[1, :128, :128] = 0.0  # a tile of zeros
        w[1, 128:, 128:] = 0.0  # a partial tile of zeros
        w[1, 130, 3] = float("nan")  # NaN in one tile only
        w[-1] = 0.0  # an expert of zeros
    return w.to(dtype)


def _check(w_cpu, w_dev, pow2, what, pad=False):
    got = quantize_fp8_experts_dual(w_dev, pow2_scale=pow2, pad_to_block=pad)
    want = quantize_fp8_experts_dual_reference(w_cpu, pow2, pad)
    for name, a, b in zip(("codes", "scales", "transposed codes", "transposed scales"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {name}"
        a, b = a.cpu(), b
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert_exact(a, b, f"{what} {name}")


@pytest.mark.parametrize("E", [1, 3])
@pytest.mark.parametrize("N, K", [(128, 128), (256, 384), (200, 130), (1, 1), (129, 7), (300, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(cuda, E, N, K, dtype):
    skip_if_too_large(E * N * K, EMULATION_BUDGET, "elements")
    w = _weights(E, N, K, dtype, seed=E * 1000 + N * 7 + K)
    _check(w, w.to(cuda), False, f"{E}x{N}x{K} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_specials_and_pow2(cuda, dtype, pow2):
    # NaN, +-inf, zeros, -0, denormals; whole and partial zero tiles; an expert of zeros; partial last tiles.
    w = _weights(3, 260, 300, torch.float32, seed=11, specials=True).to(dtype)
    _check(w, w.to(cuda), pow2, f"specials {dtype} pow2={pow2}")


@pytest.mark.parametrize("shape", [(0, 128, 128), (2, 0, 128), (2, 128, 0), (0, 0, 0)])
def test_empty(cuda, shape):
    w = torch.zeros(shape, dtype=torch.bfloat16)
    _check(w, w.to(cuda), False, f"empty {shape}")


def test_deepseek_w2_layout(cuda):
    # The wide case of the recipe: N = H = 7168 rows (bf16), K = F = 256, two experts.
    skip_if_too_large(2 * 7168 * 256, EMULATION_BUDGET, "elements")
    w = _weights(2, 7168, 256, torch.bfloat16, seed=3)
    _check(w, w.to(cuda), False, "2x7168x256")


def test_misaligned_and_strided_inputs(cuda):
    # Not 16-byte aligned (the scalar loads), and a transposed view (made contiguous first).
    w = _weights(2, 256, 256, torch.bfloat16, seed=5)
    base = torch.empty(w.numel() + 1, dtype=w.dtype, device=cuda)
    dev = base[1:].view(2, 256, 256)
    dev.copy_(w.to(cuda))
    assert dev.data_ptr() % 16 != 0
    _check(w, dev, False, "misaligned")
    wt = _weights(2, 384, 256, torch.float32, seed=6)
    _check(wt.transpose(1, 2), wt.to(cuda).transpose(1, 2), True, "transposed view")


@pytest.mark.parametrize("N", [16, 48, 200])
def test_rows_not_a_multiple_of_128(cuda, N):
    # N % 16 == 0 takes the 16-byte transposed stores with a partial last tile; 200 the scalar ones.
    w = _weights(2, N, 256, torch.bfloat16, seed=N)
    _check(w, w.to(cuda), False, f"N={N}")


def test_bad_input_raises_before_the_kernel(cuda):
    with pytest.raises(ValueError, match="`w` must be 3-D"):
        quantize_fp8_experts_dual(torch.zeros(128, 128, device=cuda))
    with pytest.raises(TypeError, match="`w` must have dtype"):
        quantize_fp8_experts_dual(torch.zeros(1, 128, 128, dtype=torch.float64, device=cuda))


@pytest.mark.parametrize("N, K", [(200, 130), (1, 1), (129, 7), (300, 256), (256, 200), (136, 1856 % 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_padded_layouts(cuda, N, K, dtype, pow2):
    # pad_to_block: each layout's rows zero-padded to a multiple of 128 in the same pass (q [E, N, ceil(K/128)*128],
    # q_t [E, K, ceil(N/128)*128]), bit for bit the unpadded codes followed by pad_codes_to_block; the codes
    # past the edges are 0, the scales those of the elements present. Specials where the sizes allow.
    w = _weights(3, N, K, torch.float32, seed=N * 31 + K, specials=True).to(dtype)
    _check(w, w.to(cuda), pow2, f"padded {N}x{K} {dtype} pow2={pow2}", pad=True)
    q, _, q_t, _ = quantize_fp8_experts_dual(w.to(cuda), pow2_scale=pow2, pad_to_block=True)
    assert q.shape == (3, N, -(-K // 128) * 128) and q_t.shape == (3, K, -(-N // 128) * 128)
    assert torch.all(q.view(torch.uint8)[..., K:] == 0) and torch.all(q_t.view(torch.uint8)[..., N:] == 0)


def test_padded_layouts_past_the_first_tiles_are_unpadded_codes(cuda):
    # The padded layouts hold the unpadded ones in their leading columns.
    w = _weights(2, 300, 200, torch.bfloat16, seed=5)
    got = quantize_fp8_experts_dual(w.to(cuda), pad_to_block=True)
    plain = quantize_fp8_experts_dual(w.to(cuda))
    assert_exact(got[0][..., :200].cpu().view(torch.uint8), plain[0].cpu().view(torch.uint8), "codes")
    assert_exact(got[2][..., :300].cpu().view(torch.uint8), plain[2].cpu().view(torch.uint8), "transposed codes")
    for a, b in ((got[1], plain[1]), (got[3], plain[3])):
        assert_exact(a.cpu(), b.cpu(), "scales")


# The copying form (copy_to): fp32 masters rounded to the compute dtype, written there, and the rounded values
# quantized in the same pass; bit for bit copy_to.copy_(w), then the dual tiles of copy_to.

def _masters(E, N, K, seed, copy_dtype):
    w = _weights(E, N, K, torch.float32, seed=seed, specials=True)
    if N >= 4 and K >= 4:
        # fp32 values halfway between two neighbours of the copy's dtype (ties to even, both ways), and values
        # that round past its largest finite value.
        mant = 8 if copy_dtype == torch.bfloat16 else 11  # significand bits kept, the implicit one included
        base = torch.tensor([1.0, 1.5, 3.0, 100.0])
        w[-1, 0, :4] = base * (1 + 2.0 ** -mant)
        w[-1, 1, :4] = base * (1 + 3 * 2.0 ** -mant)
        w[-1, 2, :4] = -base * (1 + 2.0 ** -mant)
        big = torch.finfo(copy_dtype).max
        w[-1, 3, :4] = torch.tensor([big * (1 + 2.0 ** -(mant + 1)), big * (1 + 2.0 ** -mant), 3.0e38, -3.0e38])
    return w


def _check_copy(w_cpu, w_dev, copy_dev, pow2, what, pad=False):
    got = quantize_fp8_experts_dual(w_dev, pow2_scale=pow2, copy_to=copy_dev, pad_to_block=pad)
    want_copy = w_cpu.to(copy_dev.dtype)
    want = quantize_fp8_experts_dual_reference(want_copy, pow2, pad)
    assert_exact(copy_dev.cpu(), want_copy, f"{what} copy")
    for name, a, b in zip(("codes", "scales", "transposed codes", "transposed scales"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {name}"
        a = a.cpu()
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert_exact(a, b, f"{what} {name}")


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E, N, K", [(3, 260, 300), (1, 128, 128), (2, 129, 7), (2, 256, 384), (1, 1, 1), (2, 48, 256)])
def test_copy_matches_the_copy_then_the_quantization(cuda, copy_dtype, E, N, K):
    skip_if_too_large(E * N * K, EMULATION_BUDGET, "elements")
    w = _masters(E, N, K, seed=E * 31 + N + K, copy_dtype=copy_dtype)
    copy = torch.full((E, N, K), 7.0, dtype=copy_dtype, device=cuda)
    for pow2 in (False, True):
        _check_copy(w, w.to(cuda), copy, pow2, f"{E}x{N}x{K} {copy_dtype} pow2={pow2}")
    _check_copy(w, w.to(cuda), copy, False, f"{E}x{N}x{K} {copy_dtype} padded", pad=True)


def test_copy_misaligned_and_strided(cuda):
    # The scalar loads and stores: a master and a copy that do not start on 16 bytes; a transposed master.
    w = _masters(2, 256, 256, seed=8, copy_dtype=torch.bfloat16)
    base = torch.empty(w.numel() + 1, device=cuda)
    dev = base[1:].view(w.shape)
    dev.copy_(w.to(cuda))
    cbase = torch.empty(w.numel() + 1, dtype=torch.bfloat16, device=cuda)
    copy = cbase[1:].view(w.shape)
    assert dev.data_ptr() % 16 and copy.data_ptr() % 16
    _check_copy(w, dev, copy, False, "misaligned")
    # An aligned master with a copy that is not on 16 bytes: the copy alone keeps the kernel off its vector stores.
    for shift in (1, 4):
        cbase = torch.empty(w.numel() + shift, dtype=torch.bfloat16, device=cuda)
        copy = cbase[shift:].view(w.shape)
        assert copy.data_ptr() % 16
        _check_copy(w, w.to(cuda), copy, False, f"copy shifted by {shift}")
    wt = _masters(2, 384, 256, seed=9, copy_dtype=torch.bfloat16).transpose(1, 2)
    _check_copy(wt, wt.to(cuda), torch.empty(wt.shape, dtype=torch.bfloat16, device=cuda), True, "transposed master")
    # Padded layouts on the scalar paths: a misaligned master and copy, sizes off 128 (and off 16 for q_t).
    w = _masters(2, 200, 136, seed=10, copy_dtype=torch.float16)
    base = torch.empty(w.numel() + 1, device=cuda)
    dev = base[1:].view(w.shape)
    dev.copy_(w.to(cuda))
    cbase = torch.empty(w.numel() + 1, dtype=torch.float16, device=cuda)
    _check_copy(w, dev, cbase[1:].view(w.shape), False, "misaligned padded", pad=True)


@pytest.mark.parametrize("shape", [(0, 128, 128), (2, 0, 128), (2, 128, 0)])
def test_copy_empty(cuda, shape):
    w = torch.zeros(shape)
    _check_copy(w, w.to(cuda), torch.empty(shape, dtype=torch.bfloat16, device=cuda), False, f"empty {shape}")


def test_copy_bad_input_raises_before_the_kernel(cuda):
    w = torch.randn(2, 128, 128, device=cuda)
    copy = torch.zeros(2, 128, 128, dtype=torch.bfloat16, device=cuda)
    with pytest.raises(TypeError, match="`w` must have dtype in \\(float32\\)"):
        quantize_fp8_experts_dual(w.bfloat16(), copy_to=copy)
    with pytest.raises(TypeError, match="`copy_to` must have dtype"):
        quantize_fp8_experts_dual(w, copy_to=copy.float())
    with pytest.raises(ValueError, match="`copy_to` must have shape \\(2, 128, 128\\)"):
        quantize_fp8_experts_dual(w, copy_to=copy[:1])
    with pytest.raises(ValueError, match="`copy_to` must be contiguous"):
        quantize_fp8_experts_dual(w, copy_to=copy.transpose(1, 2))
    with pytest.raises(ValueError, match="`copy_to` is on meta"):
        quantize_fp8_experts_dual(w, copy_to=copy.to("meta"))
    with pytest.raises(ValueError, match="`copy_to` shares its storage with `w`"):
        quantize_fp8_experts_dual(w, copy_to=w.view(-1).view(torch.bfloat16)[:w.numel()].view(w.shape))
    assert torch.count_nonzero(copy) == 0  # nothing written
