"""CPU tier: the FP8 producers' registrations (fake implementations agree with the real ones in shape, dtype
and strides; autograd registration; AOT dispatch), torch.library.opcheck on small inputs."""

import pytest
import torch

import moe_kernels as mk

UTILS = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _routing(T=6, k=2, E=3, H=256):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    idx[1, 1] = -1  # a dropped slot
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    x_perm, row_map, _ = mk.permute(x, idx, E, align=128)
    return g, row_map, x_perm.shape[0]


@pytest.mark.parametrize("pow2", [False, True])
def test_token_and_weight_quantizers(pow2):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8_tokens, (t, pow2), test_utils=UTILS)
    w = torch.randn(2, 256, 384, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8_experts_dual, (w, pow2), test_utils=UTILS)
    master, copy = torch.randn(2, 256, 384, generator=g), torch.empty(2, 256, 384, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8_experts_dual_copy, (master, copy, pow2),
                          test_utils=UTILS)
    w = torch.randn(2, 200, 136, generator=g).to(torch.bfloat16)  # both layouts padded
    torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8_experts_dual, (w, pow2, True), test_utils=UTILS)
    master, copy = torch.randn(2, 200, 136, generator=g), torch.empty(2, 200, 136, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8_experts_dual_copy, (master, copy, pow2, True),
                          test_utils=UTILS)


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_producers(weighted):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(37, 256, generator=g).to(torch.bfloat16)
    rw = torch.rand(37, generator=g) if weighted else None
    torch.library.opcheck(torch.ops.moe_kernels.swiglu_quantize_fp8, (h, rw, False), test_utils=UTILS)
    da = torch.randn(37, 128, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.swiglu_bwd_quantize_fp8, (da, h, rw, weighted, False), test_utils=UTILS)


@pytest.mark.parametrize("F", [256, 200])
def test_squared_relu_producers(F):
    g = torch.Generator().manual_seed(F)
    h = torch.randn(37, F, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.squared_relu_quantize_fp8, (h, False), test_utils=UTILS)
    d = torch.randn(37, F, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_kernels.squared_relu_bwd_quantize_fp8, (d, h, True), test_utils=UTILS)
    torch.library.opcheck(torch.ops.moe_kernels.quantize_fp8_dual, (h, False), test_utils=UTILS)


@pytest.mark.parametrize("with_y", [False, True])
def test_unpermute_backward_producer(with_y):
    g, row_map, R = _routing()
    dout = torch.randn(row_map.shape[0], 256, generator=g).to(torch.bfloat16)
    w = torch.rand(*row_map.shape, generator=g)
    y = torch.randn(R, 256, generator=g).to(torch.bfloat16) if with_y else None
    torch.library.opcheck(torch.ops.moe_kernels.unpermute_bwd_quantize_fp8, (dout, row_map, w, y, R, False),
                          test_utils=UTILS)
