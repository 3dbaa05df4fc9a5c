"""permute_quantize_fp8: CPU tier (the reference against permute then quantize, schema, bad input)."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.testing import assert_exact, random_routing


def _mapped(row_map, rows):
    m = torch.zeros(rows, dtype=torch.bool)
    m[row_map[row_map >= 0].long()] = True
    return m


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_reference_is_permute_then_quantize(align, pow2):
    T, E, k, H = 37, 5, 2, 300
    x = (torch.randn(T, H) * torch.logspace(-2, 2, H)).to(torch.bfloat16)
    idx = random_routing(T, E, k, kind="zipf", drop=0.1, seed=2)
    q, s, row_map, gs, x_perm = mk.permute_quantize_fp8(x, idx, E, align=align, pow2_scale=pow2, keep_rows=True)
    p_ref, map_ref, gs_ref = mk.permute(x, idx, E, align=align)
    assert_exact(row_map, map_ref, "row_map")
    assert_exact(gs, gs_ref, "group_sizes")
    assert_exact(x_perm, p_ref, "x_perm")
    q_ref, s_ref = mk.quantize_fp8(p_ref, "block", pow2_scale=pow2)
    n = int(gs.sum())
    mapped = _mapped(row_map, q.shape[0])[:n]
    assert q.dtype == torch.float8_e4m3fn and q.shape == p_ref.shape and s.shape == (p_ref.shape[0], 3)
    assert_exact(q[:n].view(torch.uint8), q_ref[:n].view(torch.uint8), "codes")
    assert_exact(s[:n][mapped], s_ref[:n][mapped], "scales of the tokens' rows")
    if align > 1:
        assert bool((~mapped).any()), "the case must hold padding rows"
    assert torch.all(s[:n][~mapped] == 0) and torch.all(q[:n][~mapped].float() == 0), "padding: zero codes, scale 0"


def test_without_rows_and_empty_batch():
    x = torch.randn(0, 256)
    idx = torch.zeros(0, 2, dtype=torch.int32)
    q, s, row_map, gs, x_perm = mk.permute_quantize_fp8(x, idx, 4)
    assert q.shape == (0, 256) and s.shape == (0, 2) and row_map.shape == (0, 2) and x_perm is None
    assert torch.all(gs == 0)


def test_bad_input():
    x = torch.randn(4, 256)
    idx = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        mk.permute_quantize_fp8(x.double(), idx, 4)
    with pytest.raises(TypeError, match="`x`"):
        mk.permute_quantize_fp8(x.to(torch.float8_e4m3fn), idx, 4)
    with pytest.raises(ValueError, match="indices"):
        mk.permute_quantize_fp8(x, idx[:3], 4)
    with pytest.raises(ValueError, match="holds 4, outside"):
        mk.permute_quantize_fp8(x, idx + 4, 4)
    with pytest.raises(ValueError, match="align"):
        mk.permute_quantize_fp8(x, idx, 4, align=0)
    with pytest.raises(ValueError, match="num_experts"):
        mk.permute_quantize_fp8(x, idx, 0)


def test_opcheck():
    x = torch.randn(6, 200)
    idx = random_routing(6, 3, 2, drop=0.2, seed=6)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for keep_rows in (False, True):
        torch.library.opcheck(torch.ops.moe_kernels.permute_quantize_fp8, (x, idx, 3, 128, False, keep_rows),
                              test_utils=utils)
