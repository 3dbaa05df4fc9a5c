"""swiglu_quantize_fp8 and swiglu_bwd_quantize_fp8: CPU tier (the references are the compositions; shapes under
fake tensors)."""

import pytest
import torch

from moe_kernels.ops.activation import swiglu, swiglu_bwd_quantize_fp8, swiglu_quantize_fp8
from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_tokens
from moe_kernels.ops.quant import quantize_fp8


def test_equals_the_composition():
    h = torch.randn(130, 512, dtype=torch.bfloat16)
    w = torch.rand(130)
    a = swiglu(h, w)
    want = (*quantize_fp8(a, "block", pow2_scale=True), *quantize_fp8_tokens(a, pow2_scale=True))
    got = swiglu_quantize_fp8(h, w, pow2_scale=True)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)


def test_shapes_on_meta():
    q, s, qt, st = swiglu_quantize_fp8(torch.empty(300, 512, device="meta", dtype=torch.bfloat16))
    assert (q.shape, s.shape, qt.shape, st.shape) == ((300, 256), (300, 2), (256, 384), (256, 3))
    q, s = quantize_fp8_tokens(torch.empty(300, 70, device="meta"))
    assert (q.shape, s.shape) == ((70, 384), (70, 3))


def test_shapes_on_meta_f_off_128():
    # F = 200: the forward blocks' codes padded to 256; dh's 2F = 400 padded to 512.
    h = torch.empty(300, 400, device="meta", dtype=torch.bfloat16)
    q, s, qt, st = swiglu_quantize_fp8(h)
    assert (q.shape, s.shape, qt.shape, st.shape) == ((300, 256), (300, 2), (200, 384), (200, 3))
    q, s, qt, st, _ = swiglu_bwd_quantize_fp8(torch.empty(300, 200, device="meta", dtype=torch.bfloat16), h)
    assert (q.shape, s.shape, qt.shape, st.shape) == ((300, 512), (300, 4), (400, 384), (400, 3))


@pytest.mark.parametrize("F", [8, 200])
def test_f_off_128_equals_the_padded_composition(F):
    g = torch.Generator().manual_seed(F)
    h = torch.randn(130, 2 * F, generator=g).to(torch.bfloat16)
    da = torch.randn(130, F, generator=g).to(torch.bfloat16)
    a = swiglu(h)
    want = (*quantize_fp8(a, "block", pad_to_block=True), *quantize_fp8_tokens(a))
    dh, _ = torch.ops.moe_kernels.swiglu_bwd(da, h, None, False)
    want_bwd = (*quantize_fp8(dh, "block", pad_to_block=True), *quantize_fp8_tokens(dh))
    for got, want in ((swiglu_quantize_fp8(h), want), (swiglu_bwd_quantize_fp8(da, h)[:4], want_bwd)):
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)


def test_rejects_f_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        swiglu_quantize_fp8(torch.zeros(4, 200))


@pytest.mark.parametrize("weights", [False, True])
def test_backward_equals_the_composition(weights):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(130, 512, generator=g).to(torch.bfloat16)
    da = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    w = torch.rand(130, generator=g) if weights else None
    dh, dw = torch.ops.moe_kernels.swiglu_bwd(da, h, w, weights)
    want = (*quantize_fp8(dh, "block", pow2_scale=True), *quantize_fp8_tokens(dh, pow2_scale=True), dw)
    got = swiglu_bwd_quantize_fp8(da, h, w, need_dw=weights, pow2_scale=True)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)


def test_backward_shapes_on_meta():
    h = torch.empty(300, 512, device="meta", dtype=torch.bfloat16)
    q, s, qt, st, dw = swiglu_bwd_quantize_fp8(torch.empty(300, 256, device="meta", dtype=torch.bfloat16), h,
                                               need_dw=True)
    assert (q.shape, s.shape, qt.shape, st.shape, dw.shape) == ((300, 512), (300, 4), (512, 384), (512, 3), (300,))


def test_backward_rejects_bad_input():
    h = torch.zeros(4, 256)
    with pytest.raises(ValueError, match="multiple of 8"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 100), torch.zeros(4, 200))
    with pytest.raises(ValueError, match="`dout` must have shape"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 256), h)
    with pytest.raises(TypeError, match="`dout` must have dtype"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 128, dtype=torch.bfloat16), h)
    with pytest.raises(TypeError, match="`h` must have dtype"):
        swiglu_bwd_quantize_fp8(torch.zeros(4, 128, dtype=torch.float64), h.double())
