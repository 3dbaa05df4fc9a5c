"""swiglu_quantize_fp8: CPU tier (the reference is the composition; shapes under fake tensors)."""

import pytest
import torch

from moe_kernels.ops.activation import swiglu, swiglu_quantize_fp8
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


def test_rejects_f_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_quantize_fp8(torch.zeros(4, 200))
