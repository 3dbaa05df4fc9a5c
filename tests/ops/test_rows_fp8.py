"""squared_relu_quantize_fp8, squared_relu_bwd_quantize_fp8 and quantize_fp8_dual: CPU tier (the references are the compositions;
shapes under fake tensors; bad input named before any kernel)."""

import pytest
import torch

from moe_kernels.ops.activation import (quantize_fp8_dual, squared_relu, squared_relu_bwd_quantize_fp8,
                                        squared_relu_bwd_reference, squared_relu_quantize_fp8)
from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_tokens
from moe_kernels.ops.quant import quantize_fp8


def _same(got, want):
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)


@pytest.mark.parametrize("F", [256, 200])
def test_equals_the_composition(F):
    g = torch.Generator().manual_seed(F)
    h = torch.randn(130, F, generator=g).to(torch.bfloat16)
    a = squared_relu(h)
    _same(squared_relu_quantize_fp8(h, pow2_scale=True),
          (*quantize_fp8(a, "block", pow2_scale=True, pad_to_block=True), *quantize_fp8_tokens(a, pow2_scale=True)))


@pytest.mark.parametrize("F", [256, 200])
def test_backward_equals_the_composition(F):
    g = torch.Generator().manual_seed(F + 1)
    h = torch.randn(130, F, generator=g).to(torch.bfloat16)
    d = torch.randn(130, F, generator=g).to(torch.bfloat16)
    dh = squared_relu_bwd_reference(d, h)
    _same(squared_relu_bwd_quantize_fp8(d, h),
          (*quantize_fp8(dh, "block", pad_to_block=True), *quantize_fp8_tokens(dh)))


@pytest.mark.parametrize("C", [256, 200])
def test_dual_equals_the_composition(C):
    t = torch.randn(130, C, generator=torch.Generator().manual_seed(C + 2)).to(torch.bfloat16)
    _same(quantize_fp8_dual(t), (*quantize_fp8(t, "block", pad_to_block=True), *quantize_fp8_tokens(t)))


def test_shapes_on_meta():
    q, s, qt, st = quantize_fp8_dual(torch.empty(300, 1856, device="meta", dtype=torch.bfloat16))
    assert [tuple(t.shape) for t in (q, s, qt, st)] == [(300, 1920), (300, 15), (1856, 384), (1856, 3)]
    h = torch.empty(300, 1856, device="meta", dtype=torch.bfloat16)
    for out in (squared_relu_quantize_fp8(h), squared_relu_bwd_quantize_fp8(torch.empty_like(h), h)):
        assert [tuple(t.shape) for t in out] == [(300, 1920), (300, 15), (1856, 384), (1856, 3)]
        assert [t.dtype for t in out] == [torch.float8_e4m3fn, torch.float32] * 2


def test_rejects_bad_input():
    h = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        squared_relu_quantize_fp8(torch.zeros(4, 100))
    with pytest.raises(ValueError, match="`h` must be 2-D|`h` must have 2"):
        squared_relu_quantize_fp8(torch.zeros(4, 16, 2))
    with pytest.raises(TypeError, match="`h` must have dtype"):
        squared_relu_quantize_fp8(torch.zeros(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="`dout` must have shape"):
        squared_relu_bwd_quantize_fp8(torch.zeros(4, 128, dtype=torch.bfloat16), h)
    with pytest.raises(TypeError, match="`dout` must have dtype"):
        squared_relu_bwd_quantize_fp8(torch.zeros(4, 256, dtype=torch.float16), h)
