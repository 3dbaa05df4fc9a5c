"""quantize_fp8_experts_dual: CPU tier (the reference is quantize_fp8_experts then the transposes; shapes under
fake tensors; bad input raises before any kernel runs)."""

import pytest
import torch

from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_experts, quantize_fp8_experts_dual


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 200, 130), (0, 128, 128), (2, 0, 128)])
@pytest.mark.parametrize("pow2", [False, True])
def test_equals_quantize_fp8_experts_transposed(shape, pow2):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(torch.bfloat16)
    q, s = quantize_fp8_experts(w, pow2_scale=pow2)
    got = quantize_fp8_experts_dual(w, pow2_scale=pow2)
    want = (q, s, q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous())
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_shapes_on_meta():
    q, s, qt, st = quantize_fp8_experts_dual(torch.empty(4, 300, 7168, device="meta", dtype=torch.bfloat16))
    assert (q.shape, s.shape, qt.shape, st.shape) == ((4, 300, 7168), (4, 3, 56), (4, 7168, 300), (4, 56, 3))
    assert q.dtype == qt.dtype == torch.float8_e4m3fn and s.dtype == st.dtype == torch.float32


@pytest.mark.parametrize("bad, error, match", [
    (torch.zeros(128, 128), ValueError, "`w` must be 3-D"),
    (torch.zeros(1, 128, 128, dtype=torch.float64), TypeError, "`w` must have dtype"),
    (torch.zeros(1, 128, 128, dtype=torch.int32), TypeError, "`w` must have dtype"),
    ([[[1.0]]], TypeError, "`w` must be a torch.Tensor"),
])
def test_bad_input_names_the_argument(bad, error, match):
    with pytest.raises(error, match=match):
        quantize_fp8_experts_dual(bad)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copy_writes_the_rounded_master_and_its_tiles(copy_dtype):
    # copy_to on the CPU reference path (the op's wiring: the copy written, the copy's tiles returned; the kernel
    # is compared with the same composition in the GPU tier), and a copy that requires grad refused.
    w = torch.randn(2, 200, 384, generator=torch.Generator().manual_seed(3)) * 30
    copy = torch.zeros(2, 200, 384, dtype=copy_dtype)
    got = quantize_fp8_experts_dual(w, copy_to=copy)
    assert torch.equal(copy, w.to(copy_dtype))
    for a, b in zip(got, quantize_fp8_experts_dual(w.to(copy_dtype))):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    with pytest.raises(RuntimeError, match="`copy_to` requires grad"):
        quantize_fp8_experts_dual(w, copy_to=torch.nn.Parameter(copy))
    with torch.no_grad():
        quantize_fp8_experts_dual(w, copy_to=torch.nn.Parameter(copy))
