"""FP8 weight gradient (groups split the tokens): CPU tier, the reference against an independent
formulation, its operands, edge cases and bad input."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.grouped_mm_fp8 import grouped_mm_fp8_wgrad_reference
from moe_kernels.testing import assert_exact, assert_within_fp32_rounding, quantized_sqnr_floor_db, sqnr_db

E4M3 = torch.float8_e4m3fn


def _operands(M, N, K, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(M, N, generator=g) * torch.logspace(-1, 1, N)
    x = torch.randn(M, K, generator=g)
    return dout, x, torch.tensor(sizes, dtype=torch.int32)


def _blockwise_sum(aq, asc, bq, bsc, sizes):
    """fp64, block by block: dW[e] = sum over group e's token blocks tb of (a[:, tb] / sa[:, tb]) (b[:, tb] / sb[:, tb])^T."""
    E, N, K = len(sizes), aq.shape[0], bq.shape[0]
    out, start = torch.zeros(E, N, K, dtype=torch.float64), 0
    for e, n in enumerate(sizes):
        for b0 in range(start, start + n, 128):
            tb = b0 // 128
            a = aq[:, b0 : b0 + 128].double() / asc[:, tb, None].double()
            b = bq[:, b0 : b0 + 128].double() / bsc[:, tb, None].double()
            out[e] += a @ b.t()
        start += n
    return out


@pytest.mark.parametrize("sizes", [[128, 0, 256, 128], [0, 0, 0], [512], [128, 128, 0, 0, 128]])
def test_reference_matches_blockwise_sum_in_fp64(sizes):
    M = sum(sizes) + 40  # rows past the groups are ignored
    dout, x, gs = _operands(M, 96, 160, sizes, seed=len(sizes))
    a, b = mk.quantize_fp8_tokens(dout), mk.quantize_fp8_tokens(x)
    got = mk.grouped_mm_fp8_wgrad(*a, *b, gs)
    want = _blockwise_sum(*a, *b, sizes)
    magnitude = _blockwise_sum(a[0].float().abs().to(E4M3), a[1], b[0].float().abs().to(E4M3), b[1], sizes)
    assert got.dtype == torch.float32 and got.shape == (len(sizes), 96, 160)
    assert_within_fp32_rounding(got, want, magnitude, "fp8 wgrad reference")
    for e, n in enumerate(sizes):
        if n == 0:
            assert torch.all(got[e] == 0), "an empty expert's gradient is zero"


def test_quantize_fp8_tokens_pads_whole_blocks():
    t = torch.randn(300, 40)
    q, s = mk.quantize_fp8_tokens(t)
    assert q.shape == (40, 384) and s.shape == (40, 3) and q.dtype == E4M3
    ref_q, ref_s = mk.quantize_fp8(torch.nn.functional.pad(t, (0, 0, 0, 84)).t().contiguous(), "block")
    assert_exact(q.view(torch.uint8), ref_q.view(torch.uint8), "codes")
    assert_exact(s, ref_s, "scales")
    assert torch.all(q[:, 300:].float() == 0)


def test_close_to_the_exact_weight_gradient():
    dout, x, gs = _operands(640, 128, 256, [128, 256, 0, 128], seed=3)
    got = mk.grouped_mm_fp8_wgrad(*mk.quantize_fp8_tokens(dout), *mk.quantize_fp8_tokens(x), gs)
    exact = torch.ops.moe_kernels.grouped_mm_wgrad(dout.double(), x.double(), gs)
    # Two E4M3 operands (moe_kernels.testing's quantization error model).
    assert sqnr_db(got, exact) > quantized_sqnr_floor_db(2)


def test_zero_scale_blocks_are_zeros():
    # A block whose scale is 0 (never from quantize_fp8, but from zero-filled padding) is a block of zeros.
    dout, x, gs = _operands(256, 16, 24, [256])
    a_q, a_s = mk.quantize_fp8_tokens(dout)
    b_q, b_s = mk.quantize_fp8_tokens(x)
    a_s[:, 1] = 0
    got = mk.grouped_mm_fp8_wgrad(a_q, a_s, b_q, b_s, gs)
    want = mk.grouped_mm_fp8_wgrad(a_q[:, :128].contiguous(), a_s[:, :1].contiguous(), b_q[:, :128].contiguous(),
                                   b_s[:, :1].contiguous(), torch.tensor([128], dtype=torch.int32))
    assert torch.isfinite(got).all()
    assert_exact(got, want, "second block dropped")


def test_bad_input():
    dout, x, gs = _operands(256, 32, 48, [128, 128])
    a, b = mk.quantize_fp8_tokens(dout), mk.quantize_fp8_tokens(x)
    with pytest.raises(TypeError, match="dout_t_q"):
        mk.grouped_mm_fp8_wgrad(a[0].float(), a[1], *b, gs)
    with pytest.raises(ValueError, match="`x_t_q` has 128 tokens, `dout_t_q` has 256"):
        mk.grouped_mm_fp8_wgrad(*a, b[0][:, :128].contiguous(), b[1][:, :1].contiguous(), gs)
    with pytest.raises(ValueError, match="dout_t_scale"):
        mk.grouped_mm_fp8_wgrad(a[0], a[1][:, :1].contiguous(), *b, gs)
    with pytest.raises(ValueError, match="x_t_scale"):
        mk.grouped_mm_fp8_wgrad(*a, b[0], b[1][:5].contiguous(), gs)
    with pytest.raises(TypeError, match="group_sizes"):
        mk.grouped_mm_fp8_wgrad(*a, *b, gs.long())
    with pytest.raises(ValueError, match="sums to 384"):
        mk.grouped_mm_fp8_wgrad(*a, *b, torch.tensor([128, 256], dtype=torch.int32))
    with pytest.raises(ValueError, match="group 1 has 100 rows; every group must be a multiple of 128"):
        mk.grouped_mm_fp8_wgrad(*a, *b, torch.tensor([128, 100], dtype=torch.int32))
    with pytest.raises(ValueError, match="negative"):
        mk.grouped_mm_fp8_wgrad(*a, *b, torch.tensor([-128, 128], dtype=torch.int32))
    with pytest.raises(ValueError, match="`out_dtype` must be torch.float32 or torch.bfloat16"):
        mk.grouped_mm_fp8_wgrad(*a, *b, gs, out_dtype=torch.float16)


def test_bf16_output_is_the_fp32_result_rounded_once():
    dout, x, gs = _operands(384, 32, 48, [128, 0, 256])
    args = (*mk.quantize_fp8_tokens(dout), *mk.quantize_fp8_tokens(x), gs)
    out = mk.grouped_mm_fp8_wgrad(*args, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, mk.grouped_mm_fp8_wgrad(*args).to(torch.bfloat16))


def test_opcheck():
    dout, x, gs = _operands(256, 32, 48, [128, 0, 128])
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    args = (*mk.quantize_fp8_tokens(dout), *mk.quantize_fp8_tokens(x), gs)
    torch.library.opcheck(torch.ops.moe_kernels.grouped_mm_fp8_wgrad, args, test_utils=utils)
    torch.library.opcheck(torch.ops.moe_kernels.grouped_mm_fp8_wgrad, (*args, torch.bfloat16), test_utils=utils)


def test_reference_in_fp64_is_exact_per_group():
    dout, x, gs = _operands(256, 8, 8, [256])
    a, b = mk.quantize_fp8_tokens(dout), mk.quantize_fp8_tokens(x)
    ref64 = grouped_mm_fp8_wgrad_reference(*a, *b, gs, acc=torch.float64)
    assert ref64.dtype == torch.float64
    # Two fp64 summation orders of 256 terms: within 256 eps_fp64 of the terms' magnitude.
    magnitude = _blockwise_sum(a[0].float().abs().to(E4M3), a[1], b[0].float().abs().to(E4M3), b[1], [256])
    assert torch.all((ref64 - _blockwise_sum(*a, *b, [256])).abs() <= 256 * torch.finfo(torch.float64).eps * magnitude)


# The positional parameters of the extension's grouped_mm_path, grouped_mm_workspace_bytes and grouped_mm
# (python_api/gemm.cpp), for stubs that record a call by name.
_SHAPE = ("op", "dtype", "num_groups", "M", "N", "K", "a", "b", "d", "device", "sfa", "sfb", "fp8_wgrad_out", "kernel",
          "raster", "a_global", "b_global", "portable")
_PATH = (*_SHAPE, "a_rows", "b_rows", "act")
_LAUNCH = ("op", "a", "b", "d", "group_sizes", "num_groups", "M", "N", "K", "dtype", "workspace", "workspace_bytes",
           "device", "stream", "sfa", "sfb", "group_align", "fp8_wgrad_out", "kernel", "raster", "accumulate",
           "group_order", "a_global", "b_global", "portable")


class _Stub:
    """An extension whose FP8 GEMM path query answers the sm_90a kernel, recording each call's arguments by name."""

    def __init__(self, path):
        self.calls, self._path = {}, path

    def grouped_mm_path(self, *args):
        assert len(args) == len(_PATH)
        self.calls["path"] = dict(zip(_PATH, args))
        return self._path

    def grouped_mm_workspace_bytes(self, *args):
        assert len(args) == len(_SHAPE)
        self.calls["workspace"] = dict(zip(_SHAPE, args))
        return 0

    def grouped_mm(self, *args):
        assert len(args) == len(_LAUNCH)
        self.calls["launch"] = dict(zip(_LAUNCH, args))


@pytest.mark.parametrize("out_dtype,code", [(torch.float32, 0), (torch.bfloat16, 2)])
def test_the_launch_takes_the_output_dtype_its_path_and_workspace_were_chosen_for(out_dtype, code):
    """The kernel chosen, its workspace and the launch must all see the output's dtype: a bf16 output run by
    the fp32 instance would write twice its bytes. A stub extension records the three calls' arguments."""
    import importlib

    g = importlib.import_module("moe_kernels.ops.grouped_mm_fp8")

    stub = _Stub(g._FP8_PATH)
    calls = stub.calls

    a, b = torch.zeros(32, 256, dtype=E4M3), torch.zeros(48, 256, dtype=E4M3)
    out = torch.empty(2, 32, 48, dtype=out_dtype)
    scales = torch.ones(2, 32), torch.ones(2, 48)
    assert g._launch_fp8(stub, g._WGRAD, a, b, out, *scales, torch.tensor([128, 128], dtype=torch.int32), 256, 32, 48)
    for name in ("path", "workspace", "launch"):
        assert calls[name]["fp8_wgrad_out"] == code, name
        assert calls[name]["d"] == out.data_ptr() and calls[name]["op"] == g._WGRAD, name
    shared = ("op", "dtype", "num_groups", "M", "N", "K", "a", "b", "d", "sfa", "sfb")
    assert {k: calls["launch"][k] for k in shared} == {k: calls["path"][k] for k in shared}


@pytest.mark.parametrize("sizes", [[128, 0, 256], [0, 0], [256]])
def test_into_a_buffer_written_or_accumulated(sizes):
    """out= writes the fp32 product into the buffer; accumulate=True adds it there (out + dW, bit for bit),
    empty experts keeping what they held."""
    dout, x, gs = _operands(sum(sizes) + 16, 32, 48, sizes, seed=5)
    args = (*mk.quantize_fp8_tokens(dout), *mk.quantize_fp8_tokens(x), gs)
    dw = mk.grouped_mm_fp8_wgrad(*args)
    before = torch.randn(len(sizes), 32, 48, generator=torch.Generator().manual_seed(3))
    out = before.clone()
    assert mk.grouped_mm_fp8_wgrad(*args, out=out, accumulate=True) is out
    assert torch.equal(out, before + dw)
    empty = gs == 0
    assert torch.equal(out[empty], before[empty])
    mk.grouped_mm_fp8_wgrad(*args, out=out)
    assert torch.equal(out, dw)


def test_into_opcheck():
    dout, x, gs = _operands(256, 32, 48, [128, 0, 128])
    args = (*mk.quantize_fp8_tokens(dout), *mk.quantize_fp8_tokens(x), gs)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")  # (test_schema perturbs inputs: no float8 mul on CPU)
    for accumulate in (False, True):
        torch.library.opcheck(torch.ops.moe_kernels.grouped_mm_fp8_wgrad_into,
                              (*args, torch.randn(3, 32, 48), accumulate), test_utils=utils)


def test_the_launch_passes_accumulate():
    import importlib

    g = importlib.import_module("moe_kernels.ops.grouped_mm_fp8")
    stub = _Stub(g._FP8_PATH)
    a, b = torch.zeros(32, 256, dtype=E4M3), torch.zeros(48, 256, dtype=E4M3)
    out = torch.empty(2, 32, 48)
    scales = torch.ones(2, 32), torch.ones(2, 48)
    gs = torch.tensor([128, 128], dtype=torch.int32)
    for accumulate in (False, True):
        assert g._launch_fp8(stub, g._WGRAD, a, b, out, *scales, gs, 256, 32, 48, accumulate=accumulate)
        assert stub.calls["launch"]["accumulate"] is accumulate
