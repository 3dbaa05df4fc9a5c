"""permute_quantize_fp8: GPU tier, the fused kernel against permute + quantize_fp8's references, bit for bit; and
unpermute_bwd_quantize_fp8 against unpermute_bwd + the two quantizations on the same device."""

import itertools

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.permute import permute_quantize_fp8_reference, permuted_rows, unpermute_bwd_quantize_fp8
from moe_kernels.testing import assert_exact, random_routing
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**21  # token elements read per case (a fiber per 8 elements)


def _compare(dev, x, idx, E, align, pow2, keep_rows):
    """The kernel's outputs against the reference on every row the spec defines: the groups' rows
    (codes, scales; the tokens' rows and the padding rows alike), row_map and group_sizes."""
    q, s, row_map, gs, x_perm = mk.permute_quantize_fp8(x.to(dev), idx.to(dev), E, align=align, pow2_scale=pow2,
                                                        keep_rows=keep_rows)
    rq, rs, rmap, rgs, rperm = permute_quantize_fp8_reference(x, idx, E, align, pow2)
    T, k = idx.shape
    assert q.shape == (permuted_rows(T, k, E, align), x.shape[1]) and s.shape == rs.shape
    assert_exact(row_map.cpu(), rmap, "row_map")
    assert_exact(gs.cpu(), rgs, "group_sizes")
    n = int(rgs.sum())
    assert_exact(q[:n].cpu().view(torch.uint8), rq[:n].view(torch.uint8), "codes")
    assert_exact(s[:n].cpu(), rs[:n], "scales")
    if keep_rows:
        assert_exact(x_perm[:n].cpu(), rperm[:n], "x_perm")
    else:
        assert x_perm is None


CASES = list(itertools.product((0, 1, 7, 300), ((1, 1), (8, 2), (64, 8))))
HIDDEN = (100, 129, 256, 1032)  # under one block, odd, whole blocks, and a ragged last block


@pytest.mark.parametrize("T,Ek", CASES)
@pytest.mark.parametrize("align", [1, 128])
def test_matches_reference(cuda, T, Ek, align):
    E, k = Ek
    H = HIDDEN[(T + E + k) % len(HIDDEN)]
    skip_if_too_large(T * H, EMULATION_BUDGET, "token elements")
    gen = torch.Generator().manual_seed(T * 31 + E + k)
    x = (torch.randn(T, H, generator=gen) * torch.logspace(-3, 3, H)).to(torch.bfloat16)
    idx = random_routing(T, E, k, kind="uniform", drop=0.05, seed=T + E)
    _compare(cuda, x, idx, E, align, pow2=False, keep_rows=align == 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hot", "empty", "zipf"])
@pytest.mark.parametrize("pow2", [False, True])
def test_dtypes_routing_and_pow2(cuda, dtype, kind, pow2):
    T, E, k, H = 97, 16, 4, 264  # H % 8 == 0: the vector path (272 would be too: 264 keeps a ragged block)
    x = (torch.randn(T, H) * 10).to(dtype)
    idx = random_routing(T, E, k, kind=kind, drop=0.1, seed=5)
    _compare(cuda, x, idx, E, 16, pow2, keep_rows=True)


def test_non_finite_and_zero_blocks(cuda):
    # A NaN in a block makes its amax NaN (scale 1, NaN codes stay NaN); inf gives scale 1 too; an all-zero
    # block gets scale 1 and zero codes; huge values saturate at 448.
    T, H = 6, 384
    x = torch.randn(T, H)
    x[0, 5] = float("nan")
    x[1, 130] = float("inf")
    x[2, 256:] = 0
    x[3, :128] = 3e38
    idx = torch.tensor([[0, 1], [1, -1], [2, 0], [0, 2], [-1, -1], [1, 2]], dtype=torch.int32)
    _compare(cuda, x, idx, 3, 128, pow2=False, keep_rows=True)


def test_unaligned_rows_take_the_scalar_path(cuda):
    # A contiguous tensor starting one element past the 16-byte grid cannot use vector loads.
    T, H = 50, 256
    x = torch.randn(T, H).to(torch.bfloat16)
    flat = torch.empty(T * H + 1, dtype=torch.bfloat16, device=cuda)
    shifted = flat[1:].view(T, H)
    shifted.copy_(x.to(cuda))
    assert shifted.data_ptr() % 16 != 0
    idx = random_routing(T, 4, 2, kind="uniform", seed=3)
    q, s, _, gs, x_perm = mk.permute_quantize_fp8(shifted, idx.to(cuda), 4, keep_rows=True)
    rq, rs, _, _, rperm = permute_quantize_fp8_reference(x, idx, 4, 128)
    n = int(gs.sum())
    assert_exact(q[:n].cpu().view(torch.uint8), rq[:n].view(torch.uint8), "codes")
    assert_exact(s[:n].cpu(), rs[:n], "scales")
    assert_exact(x_perm[:n].cpu(), rperm[:n], "x_perm")


def test_feeds_grouped_mm_fp8_like_the_unfused_path(cuda):
    # The fused rows into the FP8 GEMM give the same output as permute + quantize_fp8 (padding rows: zeros).
    T, E, k, H, N = 64, 4, 2, 256, 128
    x = torch.randn(T, H).to(torch.bfloat16).to(cuda)
    idx = random_routing(T, E, k, kind="zipf", seed=9).to(cuda)
    wq, ws = mk.quantize_fp8_experts((torch.randn(E, N, H) * 0.05).to(cuda))
    q, s, _, gs, _ = mk.permute_quantize_fp8(x, idx, E)
    p, _, gs2 = mk.permute(x, idx, E, align=128)
    q2, s2 = mk.quantize_fp8(p, "block")
    n = int(gs.sum())
    fused = mk.grouped_mm_fp8(q, s, wq, ws, gs)[:n]
    plain = mk.grouped_mm_fp8(q2, s2, wq, ws, gs2)[:n]
    assert_exact(fused.cpu(), plain.cpu(), "grouped_mm_fp8 on fused vs unfused rows")


# unpermute_bwd_quantize_fp8: the unpermute backward writing dy in E4M3, both layouts, against unpermute_bwd then
# quantize_fp8(., "block", pad_to_block=True) and quantize_fp8_tokens, each run on the same device (H % 8 == 0: the
# codes past H zero).


def _check_unpermute_bwd(dout, row_map, weights, y, R, pow2, what):
    got = unpermute_bwd_quantize_fp8(dout, row_map, weights, y, R, pow2_scale=pow2)
    dy, dw = torch.ops.moe_kernels.unpermute_bwd(dout, row_map, weights, y, R)
    want = (*mk.quantize_fp8(dy, "block", pow2_scale=pow2, pad_to_block=True), *mk.quantize_fp8_tokens(dy, pow2_scale=pow2),
            dw)
    for name, a, b in zip(("dy_q", "dy_scale", "dy_t_q", "dy_t_scale", "dweights"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {name}"
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert_exact(a.cpu(), b.cpu(), f"{what} {name}")


def _unpermute_problem(dev, T, E, k, H, dtype, kind="uniform", drop=0.0, seed=0, align=128):
    idx = random_routing(T, E, k, kind=kind, drop=drop, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    x_perm, row_map, _ = mk.permute(x.to(dev), idx.to(dev), E, align=align)
    R = x_perm.shape[0]
    dout = (torch.randn(T, H, generator=g) * torch.logspace(-2, 2, T)[:, None]).to(dtype).to(dev)
    weights = torch.rand(T, k, generator=g).to(dev)
    y = torch.randn(R, H, generator=g).to(dtype).to(dev)
    return dout, row_map, weights, y, R


@pytest.mark.parametrize("T,E,k", [(0, 4, 2), (1, 4, 1), (37, 8, 2), (300, 16, 4)])
@pytest.mark.parametrize("H", [8, 128, 200, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unpermute_bwd_fp8_matches_composition(cuda, T, E, k, H, dtype):
    skip_if_too_large(T * k * H, EMULATION_BUDGET, "elements")
    dout, row_map, weights, y, R = _unpermute_problem(cuda, T, E, k, H, dtype, seed=T + H)
    _check_unpermute_bwd(dout, row_map, weights, y, R, False, f"{T}-{E}-{k} H={H} {dtype}")
    _check_unpermute_bwd(dout, row_map, None, None, R, False, f"{T}-{E}-{k} H={H} {dtype} no weights")


@pytest.mark.parametrize("pow2", [False, True])
def test_unpermute_bwd_fp8_hot_empty_dropped_and_specials(cuda, pow2):
    # One hot expert (zipf), empty experts, dropped slots (rows no slot maps to: zeros), NaN / inf / zero rows
    # of dout, a zero routing weight.
    dout, row_map, weights, y, R = _unpermute_problem(cuda, 200, 8, 2, 256, torch.bfloat16, kind="zipf", drop=0.2,
                                                      seed=5)
    dout[3, 5], dout[17, 130], dout[29, 9] = float("nan"), float("inf"), -float("inf")
    dout[40:50] = 0.0
    weights[7, 0] = 0.0
    _check_unpermute_bwd(dout, row_map, weights, y, R, pow2, f"specials pow2={pow2}")
    dout, row_map, weights, y, R = _unpermute_problem(cuda, 130, 6, 2, 128, torch.float16, kind="empty", seed=6)
    _check_unpermute_bwd(dout, row_map, weights, y, R, pow2, f"odd experts empty pow2={pow2}")


def test_unpermute_bwd_fp8_h_off_128_gathers_padded_rows(cuda):
    # H = 2880 % 128 = 64 (GPT-OSS): each row's last forward block holds 64 values, its codes past H zero; the
    # gather without weights (the FP8 layer's first GEMM input) and with them (the output gradient).
    dout, row_map, weights, y, R = _unpermute_problem(cuda, 40, 8, 4, 2880, torch.bfloat16, kind="zipf", drop=0.1,
                                                      seed=11)
    _check_unpermute_bwd(dout, row_map, weights, y, R, False, "H=2880")
    _check_unpermute_bwd(dout, row_map, None, None, R, True, "H=2880 gather")
    q = unpermute_bwd_quantize_fp8(dout, row_map, None, None, R)[0]
    assert q.shape == (R, 2944) and not q[:, 2880:].view(torch.uint8).any()


@pytest.mark.parametrize("R", [0, 130])
def test_unpermute_bwd_fp8_no_slots(cuda, R):
    # k = 0: no slot maps to any row, so dy is all zeros (and dweights [T, 0]), as unpermute_bwd gives.
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(6, 128, generator=g).to(torch.bfloat16).to(cuda)
    row_map = torch.empty((6, 0), dtype=torch.int32, device=cuda)
    weights = torch.empty((6, 0), device=cuda)
    y = torch.randn(R, 128, generator=g).to(torch.bfloat16).to(cuda)
    _check_unpermute_bwd(dout, row_map, weights, y, R, False, f"k=0 R={R}")
    _check_unpermute_bwd(dout, row_map, None, None, R, False, f"k=0 R={R} no weights")


def test_unpermute_bwd_fp8_misaligned_dout(cuda):
    dout, row_map, weights, y, R = _unpermute_problem(cuda, 50, 4, 2, 128, torch.bfloat16, seed=7)
    base = torch.empty(dout.numel() + 1, dtype=dout.dtype, device=cuda)
    d = base[1:].view(dout.shape)
    d.copy_(dout)
    assert d.data_ptr() % 16 != 0
    _check_unpermute_bwd(d, row_map, weights, y, R, False, "misaligned")


def test_unpermute_bwd_fp8_bad_input_raises_before_the_kernel(cuda):
    dout, row_map, weights, y, R = _unpermute_problem(cuda, 20, 4, 2, 128, torch.bfloat16, seed=8)
    with pytest.raises(ValueError, match="multiple of 8"):
        unpermute_bwd_quantize_fp8(dout[:, :100].contiguous(), row_map, weights, None, R)
    with pytest.raises(ValueError, match="`weights` must have shape"):
        unpermute_bwd_quantize_fp8(dout, row_map, weights[:, :1].contiguous(), None, R)
    with pytest.raises(TypeError, match="`grad_output` must have dtype"):
        unpermute_bwd_quantize_fp8(dout.double(), row_map, weights, None, R)
