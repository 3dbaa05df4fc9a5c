"""FP8 weight gradient: GPU tier, the CUTLASS sm_90a K-grouped kernel against the fp64 reference, and
against the bf16 weight gradient within FP8's error. Emulated (or off Hopper) the op dequantizes and runs
the portable fp32 wgrad."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels._ext import reference_ops
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8_wgrad_reference
from moe_kernels.testing import FP8_MMA_MAGNITUDE, assert_within_fp32_rounding, quantized_sqnr_floor_db, sqnr_db
from tests.emulation import skip_if_too_large
from tests.ops.test_grouped_mm_fp8_gpu import fallback_path

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2.5e8  # GEMM FLOP per case (the portable fp32 wgrad)


def _sizes(E, blocks, kind, seed):
    """Group sizes in whole 128-row blocks: `blocks` of them spread by `kind`."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one_group":
        s = torch.zeros(E, dtype=torch.int64)
        s[E // 2] = blocks
    elif kind == "empty":  # half the experts get nothing
        s = torch.zeros(E, dtype=torch.int64)
        live = torch.randperm(E, generator=g)[: max(1, E // 2)]
        s[live] = torch.bincount(live[torch.randint(0, len(live), (blocks,), generator=g)], minlength=E)[live]
    else:
        s = torch.bincount(torch.randint(0, E, (blocks,), generator=g), minlength=E)
    return (s * 128).to(torch.int32)


def _case(M_extra, N, K, E, blocks, kind, seed):
    """Operands quantized along the tokens (on the CPU, by the reference), M = the groups + M_extra rows."""
    gs = _sizes(E, blocks, kind, seed)
    M = int(gs.sum()) + M_extra
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(M, N, generator=g) * torch.logspace(-1, 1, N)
    x = torch.randn(M, K, generator=g)
    with reference_ops():
        a, b = mk.quantize_fp8_tokens(dout), mk.quantize_fp8_tokens(x)
    return dout, x, a, b, gs


def _check(out, a, b, gs, what):
    dev = out.device  # the fp64 references on the device: fp64 GEMMs are slow on a host
    a, b, gs = tuple(t.to(dev) for t in a), tuple(t.to(dev) for t in b), gs.to(dev)
    ref64 = grouped_mm_fp8_wgrad_reference(*a, *b, gs, acc=torch.float64)
    abs_a, abs_b = (a[0].float().abs().to(torch.float8_e4m3fn), a[1]), (b[0].float().abs().to(torch.float8_e4m3fn), b[1])
    magnitude = grouped_mm_fp8_wgrad_reference(*abs_a, *abs_b, gs, acc=torch.float64)
    # fp32 output, with the FP8 tensor cores' accumulation inside each 128-token block (FP8_MMA_MAGNITUDE).
    assert_within_fp32_rounding(out, ref64, FP8_MMA_MAGNITUDE * magnitude, what)


@pytest.mark.parametrize("N,K,E,blocks", [(128, 128, 1, 1), (256, 384, 8, 9),
                                          pytest.param(2048, 7168, 32, 64, marks=pytest.mark.gpu_memory),
                                          pytest.param(1536, 4096, 16, 48, marks=pytest.mark.gpu_memory),
                                          (200, 196, 4, 6), (64, 100, 2, 3)])
@pytest.mark.parametrize("kind", ["uniform", "empty", "one_group"])
def test_matches_fp64_reference(cuda, N, K, E, blocks, kind):
    skip_if_too_large(2 * blocks * 128 * N * K, EMULATION_BUDGET, "GEMM FLOP")
    _, _, a, b, gs = _case(16, N, K, E, blocks, kind, seed=N + K + E)
    out = mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs)))
    assert out.shape == (E, N, K) and out.dtype == torch.float32
    _check(out, a, b, gs, f"fp8 wgrad N={N} K={K} E={E} {kind}")
    assert torch.all(out[gs.to(cuda) == 0] == 0), "empty experts give zeros"


def test_close_to_the_bf16_weight_gradient(cuda):
    # Against the bf16 wgrad of the unquantized operands: within FP8's error (two E4M3 operands; bf16's own
    # rounding, 2^-9 relative, is negligible beside E4M3's 2^-4).
    dout, x, a, b, gs = _case(0, 256, 256, 4, 8, "uniform", seed=4)
    out = mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs))).cpu()
    dw_bf16 = torch.ops.moe_kernels.grouped_mm_wgrad(dout.to(cuda, torch.bfloat16), x.to(cuda, torch.bfloat16), gs.to(cuda))
    assert sqnr_db(out, dw_bf16.cpu().double()) > quantized_sqnr_floor_db(2)


def test_expert_of_exactly_128_rows_and_rows_past_the_groups(cuda):
    # One 128-row expert between empty ones; the rows past the groups hold NaN and must not leak in.
    dout, x, a, b, gs = _case(0, 128, 256, 3, 1, "one_group", seed=8)
    dout = torch.cat([dout, torch.full((100, 128), float("nan"))])
    x = torch.cat([x, torch.full((100, 256), float("nan"))])
    with reference_ops():
        a, b = mk.quantize_fp8_tokens(dout), mk.quantize_fp8_tokens(x)
    out = mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs))).cpu()
    assert torch.isfinite(out).all()
    _check(out, a, b, gs, "128-row expert")


def test_misaligned_groups_raise_when_checked(cuda, checks_on):
    _, _, a, b, _ = _case(0, 64, 64, 2, 4, "uniform", seed=5)
    bad = torch.tensor([100, 156], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 128"):
        mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, bad)))


def test_misaligned_groups_give_nan_unchecked(cuda):
    # Without value checks (no host sync) the kernels cannot refuse: a misaligned group gets NaN, never a
    # plausible wrong value, on the sm_90a kernel and on the fallback alike; aligned groups are unaffected.
    _, _, a, b, _ = _case(0, 128, 128, 3, 4, "uniform", seed=6)
    gs = torch.tensor([128, 100, 284], dtype=torch.int32)
    out = mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs))).cpu()
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    _check(out[:1], a, b, gs[:1], "the aligned group")
    assert not torch.isnan(out[0]).any()


def test_takes_the_blockwise_kernel_on_hopper(cuda):
    if cuda.type != "cuda":
        pytest.skip("kernel choice exists on a GPU only")
    from moe_kernels import _ext

    C = _ext.kernels("grouped_mm_fp8_wgrad", torch.empty(1, device=cuda))
    cc = torch.cuda.get_device_capability(cuda)
    _, _, a, b, gs = _case(0, 256, 256, 2, 2, "uniform", seed=1)
    a, b = [t.to(cuda) for t in a], [t.to(cuda) for t in b]
    out = torch.empty(2, 256, 256, device=cuda)
    shape = dict(op=2, dtype=3, num_groups=2, M=256, N=256, K=256, a=a[0].data_ptr(), b=b[0].data_ptr(),
                 d=out.data_ptr(), device=cuda.index or 0, sfa=a[1].data_ptr(), sfb=b[1].data_ptr())
    assert C.grouped_mm_path(**shape) == (3 if cc == (9, 0) and C.grouped_mm_has_sm90 else fallback_path(C, shape))


@pytest.mark.cuda_device
def test_cuda_graph_replay(cuda):
    _, _, a, b, gs = _case(0, 512, 1024, 8, 24, "uniform", seed=2)
    args = [t.to(cuda) for t in (*a, *b, gs)]
    eager = mk.grouped_mm_fp8_wgrad(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.grouped_mm_fp8_wgrad(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_deterministic(cuda):
    skip_if_too_large(2 * 32 * 128 * 1024 * 2048, EMULATION_BUDGET, "GEMM FLOP")
    _, _, a, b, gs = _case(0, 1024, 2048, 16, 32, "uniform", seed=3)
    args = [t.to(cuda) for t in (*a, *b, gs)]
    first = mk.grouped_mm_fp8_wgrad(*args)
    for _ in range(3):
        assert torch.equal(mk.grouped_mm_fp8_wgrad(*args), first)


@pytest.mark.parametrize("N,K,E,blocks,kind", [(256, 384, 8, 9, "empty"), (128, 128, 1, 1, "one_group"),
                                               (200, 200, 4, 6, "uniform"), (64, 100, 2, 3, "uniform"),
                                               pytest.param(2048, 7168, 32, 64, "uniform", marks=pytest.mark.gpu_memory)])
def test_bf16_output_is_the_fp32_result_rounded_once(cuda, N, K, E, blocks, kind):
    """out_dtype=bfloat16: the epilogue rounds the fp32 accumulators once, so it equals the fp32 output cast
    to bf16 bit for bit (the same kernel and accumulation order; K % 8 != 0 takes the fallback, which casts),
    empty experts zero, and no fp32 [E, N, K] is written."""
    skip_if_too_large(2 * blocks * 128 * N * K, EMULATION_BUDGET, "GEMM FLOP")
    _, _, a, b, gs = _case(16, N, K, E, blocks, kind, seed=N + K + E + 1)
    args = [t.to(cuda) for t in (*a, *b, gs)]
    fp32 = mk.grouped_mm_fp8_wgrad(*args)
    bf16 = mk.grouped_mm_fp8_wgrad(*args, out_dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (E, N, K)
    assert torch.equal(bf16, fp32.to(torch.bfloat16))
    assert torch.all(bf16[gs.to(cuda) == 0] == 0)


def test_bf16_output_misaligned_groups_give_nan(cuda):
    _, _, a, b, _ = _case(0, 128, 128, 3, 4, "uniform", seed=6)
    gs = torch.tensor([128, 100, 284], dtype=torch.int32)
    out = mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs)), out_dtype=torch.bfloat16).cpu()
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all() and not torch.isnan(out[0]).any()


def test_bf16_output_takes_its_own_blockwise_kernel_on_hopper(cuda):
    if cuda.type != "cuda":
        pytest.skip("kernel choice exists on a GPU only")
    from moe_kernels import _ext

    C = _ext.kernels("grouped_mm_fp8_wgrad", torch.empty(1, device=cuda))
    cc = torch.cuda.get_device_capability(cuda)
    _, _, a, b, gs = _case(0, 256, 256, 2, 2, "uniform", seed=1)
    a, b = [t.to(cuda) for t in a], [t.to(cuda) for t in b]
    out = torch.empty(2, 256, 256, device=cuda, dtype=torch.bfloat16)
    shape = dict(op=2, dtype=3, num_groups=2, M=256, N=256, K=256, a=a[0].data_ptr(), b=b[0].data_ptr(),
                 d=out.data_ptr(), device=cuda.index or 0, sfa=a[1].data_ptr(), sfb=b[1].data_ptr(), fp8_wgrad_out=2)
    assert C.grouped_mm_path(**shape) == (3 if cc == (9, 0) and C.grouped_mm_has_sm90 else fallback_path(C, shape))
    narrow = dict(shape, K=252)  # bf16 rows of 252 elements: not 16-byte stores, no CUTLASS kernel
    assert C.grouped_mm_path(**narrow) == fallback_path(C, narrow)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["uniform", "empty", "one_group"])
def test_raster_orders_are_bitwise_equal(cuda, kind, out_dtype):
    """The raster order (a run-time argument of the tuning table) and the order the groups are visited in
    (group_order) change which tile a CTA takes next, not the order of any tile's reduction: the same bits."""
    from moe_kernels import _ext
    from moe_kernels.ops.grouped_mm_fp8 import _inverse_scale, _launch_fp8

    if cuda.type != "cuda" or torch.cuda.get_device_capability(cuda) != (9, 0) or not _ext._C.grouped_mm_has_sm90:
        pytest.skip("the sm_90a instances need an H100/H200 and a build with them")
    C = _ext._C
    _, _, a, b, gs = _case(64, 256, 384, 8, 9, kind, seed=3)
    (aq, as_), (bq, bs), gs = [t.to(cuda) for t in a], [t.to(cuda) for t in b], gs.to(cuda)
    N, M = aq.shape
    K = bq.shape[0]
    inv_a, inv_b = _inverse_scale(as_).t().contiguous(), _inverse_scale(bs).t().contiguous()
    outs = []
    for raster, group_order in ((0, -1), (1, -1), (0, 0), (1, 1)):  # the groups largest first by default
        out = torch.full((8, N, K), float("nan"), device=cuda, dtype=out_dtype)
        assert _launch_fp8(C, 2, aq, bq, out, inv_a, inv_b, gs, M, N, K, raster=raster, group_order=group_order)
        outs.append(out)
    for other in outs[1:]:
        assert torch.equal(outs[0], other), kind
    assert torch.equal(outs[0], mk.grouped_mm_fp8_wgrad(aq, as_, bq, bs, gs, out_dtype=out_dtype)), kind


@pytest.mark.parametrize("N,K,E,blocks,kind", [(256, 384, 8, 9, "uniform"), (200, 200, 4, 6, "empty"),
                                               (72, 104, 2, 3, "one_group"), (320, 128, 16, 5, "empty")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_wgrad_instance_is_bitwise_the_default(cuda, N, K, E, blocks, kind, out_dtype):
    """Every wgrad instance of the tuning set (cooperative 128x128 tiles, ping-pong 64x128), forced whatever
    the table says, in both raster orders and group orders: the same k-blocks, MMA instruction (m64n128k32)
    and promotion per element, so the same bits as the default choice, written afresh over NaN and, for fp32,
    accumulated into a buffer (the epilogue's source read). N and K off the tiles make partial tiles in both
    directions (K a multiple of 8: bf16 rows of 16-byte stores); the empty and one-group cases leave experts
    with no tokens (zeros written, the buffer kept)."""
    from moe_kernels import _ext
    from moe_kernels.ops.grouped_mm_fp8 import _inverse_scale, _launch_fp8

    if cuda.type != "cuda" or torch.cuda.get_device_capability(cuda) != (9, 0) or not _ext._C.grouped_mm_has_sm90:
        pytest.skip("the sm_90a instances need an H100/H200 and a build with them")
    C = _ext._C
    _, _, a, b, gs = _case(64, N, K, E, blocks, kind, seed=N + K + blocks)
    (aq, as_), (bq, bs), gs = [t.to(cuda) for t in a], [t.to(cuda) for t in b], gs.to(cuda)
    M = aq.shape[1]
    inv_a, inv_b = _inverse_scale(as_).t().contiguous(), _inverse_scale(bs).t().contiguous()
    expected = mk.grouped_mm_fp8_wgrad(aq, as_, bq, bs, gs, out_dtype=out_dtype)
    before = torch.randn(E, N, K, generator=torch.Generator().manual_seed(7)).to(cuda)
    code = _ext.dtype_code(out_dtype)
    names = []
    for i, spec in enumerate(C.grouped_mm_sm90_kernels()):
        if (spec["dtype"], spec["op"], spec["out"]) != (3, 2, code):
            continue
        names.append(spec["name"])
        for raster, group_order in ((0, -1), (1, -1), (0, 0), (1, 1)):  # largest group first, then expert order
            out = torch.full((E, N, K), float("nan"), device=cuda, dtype=out_dtype)
            assert _launch_fp8(C, 2, aq, bq, out, inv_a, inv_b, gs, M, N, K, kernel=i, raster=raster,
                               group_order=group_order)
            assert torch.equal(out, expected), f"{spec['name']} raster={raster} group_order={group_order}"
            if group_order != -1:
                continue
            if out_dtype == torch.float32:
                acc = before.clone()
                assert _launch_fp8(C, 2, aq, bq, acc, inv_a, inv_b, gs, M, N, K, kernel=i, raster=raster,
                                   accumulate=True)
                assert torch.equal(acc, before + expected), f"{spec['name']} raster={raster} accumulate"
    assert any("pingpong" in n for n in names) and any("pingpong" not in n for n in names), names


# Into an fp32 buffer (an fp32 main gradient), written afresh or accumulated (out=, accumulate=)

@pytest.mark.parametrize("N,K,E,blocks,kind", [(256, 384, 8, 9, "empty"), (128, 128, 1, 1, "one_group"),
                                               (200, 196, 4, 6, "uniform"), (64, 100, 2, 3, "uniform"),
                                               pytest.param(2048, 7168, 32, 64, "uniform", marks=pytest.mark.gpu_memory)])
def test_accumulate_adds_the_product_once_in_fp32(cuda, N, K, E, blocks, kind):
    """out += dW: one fp32 addition per element of the same accumulators (the kernel's epilogue reads `out` as
    its source, beta 1), so bit for bit `out + grouped_mm_fp8_wgrad(...)`; empty experts keep `out`. Written
    afresh (accumulate=False), `out` equals the fp32 result, empty experts zero, whatever it held."""
    skip_if_too_large(2 * blocks * 128 * N * K, EMULATION_BUDGET, "GEMM FLOP")
    _, _, a, b, gs = _case(16, N, K, E, blocks, kind, seed=N + K + E + 2)
    args = [t.to(cuda) for t in (*a, *b, gs)]
    dw = mk.grouped_mm_fp8_wgrad(*args)
    before = torch.randn(E, N, K, generator=torch.Generator().manual_seed(1)).to(cuda)
    out = before.clone()
    assert mk.grouped_mm_fp8_wgrad(*args, out=out, accumulate=True) is out
    assert torch.equal(out, before + dw)
    empty = gs.to(cuda) == 0
    assert torch.equal(out[empty], before[empty]), "an empty expert adds nothing"
    fresh = torch.full((E, N, K), float("nan"), device=cuda)
    mk.grouped_mm_fp8_wgrad(*args, out=fresh)
    assert torch.equal(fresh, dw) and torch.all(fresh[empty] == 0)


def test_accumulate_misaligned_groups_give_nan(cuda):
    _, _, a, b, _ = _case(0, 128, 128, 3, 4, "uniform", seed=6)
    gs = torch.tensor([128, 100, 284], dtype=torch.int32)
    out = torch.ones(3, 128, 128, device=cuda)
    mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs)), out=out, accumulate=True)
    out = out.cpu()
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all() and not torch.isnan(out[0]).any()


def test_accumulate_no_tokens(cuda):
    _, _, a, b, _ = _case(0, 128, 128, 2, 1, "uniform", seed=7)
    gs = torch.zeros(2, dtype=torch.int32)
    a, b = (a[0][:, :0], a[1][:, :0]), (b[0][:, :0], b[1][:, :0])
    out = torch.ones(2, 128, 128, device=cuda)
    mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs)), out=out, accumulate=True)
    assert torch.all(out == 1)
    mk.grouped_mm_fp8_wgrad(*(t.to(cuda) for t in (*a, *b, gs)), out=out)
    assert torch.all(out == 0)


def test_accumulate_refuses_a_wrong_buffer(cuda):
    _, _, a, b, gs = _case(0, 128, 128, 2, 2, "uniform", seed=9)
    args = [t.to(cuda) for t in (*a, *b, gs)]
    for bad, error, why in ((torch.zeros(2, 128, 128, device=cuda, dtype=torch.bfloat16), TypeError, "float32"),
                            (torch.zeros(2, 128, 64, device=cuda), ValueError, r"\[E, N, K\]"),
                            (torch.zeros(2, 128, 256, device=cuda)[:, :, :128], ValueError, "contiguous")):
        with pytest.raises(error, match=why):
            mk.grouped_mm_fp8_wgrad(*args, out=bad, accumulate=True)
    with pytest.raises(ValueError, match="accumulate"):
        mk.grouped_mm_fp8_wgrad(*args, accumulate=True)
    with pytest.raises(ValueError, match="out_dtype"):
        mk.grouped_mm_fp8_wgrad(*args, out_dtype=torch.bfloat16, out=torch.zeros(2, 128, 128, device=cuda))


@pytest.mark.cuda_device
def test_accumulate_cuda_graph_replay_adds_each_time(cuda):
    _, _, a, b, gs = _case(0, 256, 256, 4, 8, "uniform", seed=12)
    args = [t.to(cuda) for t in (*a, *b, gs)]
    dw = mk.grouped_mm_fp8_wgrad(*args)
    out = torch.zeros(4, 256, 256, device=cuda)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk.grouped_mm_fp8_wgrad(*args, out=out, accumulate=True)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dw + dw)
