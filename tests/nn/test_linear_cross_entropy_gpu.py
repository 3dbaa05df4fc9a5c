"""linear_cross_entropy on the GPU: the fp32-output GEMMs (torch.mm / addmm with out_dtype) against fp64, and its
peak memory below the [N, V] fp32 logits. The error model is the CPU test's (test_linear_cross_entropy)."""

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.nn import linear_cross_entropy
from moe_kernels.testing import FP32_EPS, assert_norm_close_to_fp64, assert_within_fp32_rounding
from tests.nn.test_linear_cross_entropy import _grads, _inputs, _reference64

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_on_cuda(cuda, dtype):
    N, H, V = 333, 128, 4099
    h, w, b, t = _inputs(N, H, V, dtype, 7, bias=True)
    hc, wc, bc = (x.detach().to(cuda).requires_grad_() for x in (h, w, b))
    loss = linear_cross_entropy(hc, wc, t.to(cuda), bias=bc, chunk_size=64)
    ours = [g.cpu() for g in _grads(loss, [hc, wc, bc], 2.0)]
    loss64, p64, mags, loss_mag = _reference64(h, w, b, t, "mean")
    assert_within_fp32_rounding(loss.cpu(), loss64, loss_mag, f"loss ({dtype})")
    grads64 = _grads(loss64, list(p64), 2.0)
    if dtype == torch.float32:
        for g, g64, m in zip(ours, grads64, mags):
            assert_within_fp32_rounding(g, g64, m * 2.0, "fp32 gradient")
    else:
        base = _grads(F.cross_entropy(F.linear(hc, wc, bc).float(), t.to(cuda)), [hc, wc, bc], 2.0)
        for g, bg, g64 in zip(ours, base, grads64):
            assert g.dtype == torch.bfloat16
            assert_norm_close_to_fp64(g, bg.cpu(), g64, "bf16 gradient", floor=64 * FP32_EPS)


@pytest.mark.cuda_device  # the device's allocator statistics
def test_peak_memory_below_the_logits(cuda):
    N, H, V = 4096, 256, 32768  # the logits would be 512 MiB in fp32
    h = torch.randn(N, H, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device=cuda, dtype=torch.bfloat16) / 16).requires_grad_()
    t = torch.randint(0, V, (N,), device=cuda)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    linear_cross_entropy(h, w, t, chunk_size=512).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < N * V * 4 / 2, f"peak {peak / 2**20:.0f} MiB"
