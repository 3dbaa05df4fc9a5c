import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_kernels as mk
from moe_kernels.nn import GroupedExperts
from moe_kernels.testing import random_routing


def dense_swiglu(x, gate, up, down):
    return down(F.silu(gate(x)) * up(x))


def _linears(E, H, Fs):
    torch.manual_seed(0)
    gates = [nn.Linear(H, Fs, bias=False) for _ in range(E)]
    ups = [nn.Linear(H, Fs, bias=False) for _ in range(E)]
    downs = [nn.Linear(Fs, H, bias=False) for _ in range(E)]
    return gates, ups, downs


def test_equals_per_expert_loop_through_permute():
    E, H, Fs, T, k = 4, 12, 10, 20, 2
    gates, ups, downs = _linears(E, H, Fs)
    experts = GroupedExperts.from_per_expert_linears(gates, ups, downs)
    x = torch.randn(T, H)
    idx = random_routing(T, E, k, seed=1)
    w = torch.rand(T, k)
    x_perm, row_map, sizes = mk.permute(x, idx, E, align=4)
    out = mk.unpermute(experts(x_perm, sizes), row_map, w)
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            expected[t] += w[t, j] * dense_swiglu(x[t], gates[e], ups[e], downs[e])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_one_expert_equals_dense_mlp_and_gradients_flow():
    H, Fs, T = 8, 6, 5
    gates, ups, downs = _linears(1, H, Fs)
    experts = GroupedExperts.from_per_expert_linears(gates, ups, downs)
    x = torch.randn(T, H, requires_grad=True)
    out = experts(x, torch.tensor([T], dtype=torch.int32))
    torch.testing.assert_close(out, dense_swiglu(x, gates[0], ups[0], downs[0]), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert experts.w13.grad.abs().sum() > 0 and experts.w2.grad.abs().sum() > 0 and x.grad is not None


def test_row_weights_inside_equal_weights_in_unpermute():
    E, H, Fs, T, k = 3, 8, 4, 9, 2
    experts = GroupedExperts(E, H, Fs)
    x, idx, w = torch.randn(T, H), random_routing(T, E, k, seed=2), torch.rand(T, k)
    x_perm, row_map, sizes = mk.permute(x, idx, E)
    row_weights = torch.zeros(x_perm.shape[0])
    row_weights[row_map.flatten().long()] = w.flatten()
    inside = mk.unpermute(experts(x_perm, sizes, row_weights), row_map)
    outside = mk.unpermute(experts(x_perm, sizes), row_map, w)
    torch.testing.assert_close(inside, outside, rtol=1e-5, atol=1e-6)


def test_init_and_validation():
    experts = GroupedExperts(2, 16, 8)
    assert experts.w13.shape == (2, 16, 16) and experts.w2.shape == (2, 16, 8)
    assert experts.w13.abs().max() <= 16**-0.5 and experts.w2.abs().max() <= 8**-0.5
    with pytest.raises(ValueError, match="same"):
        GroupedExperts.from_per_expert_linears([nn.Linear(4, 2, bias=False)], [], [])
    with pytest.raises(ValueError, match="biases"):
        GroupedExperts.from_per_expert_linears([nn.Linear(4, 2)], [nn.Linear(4, 2)], [nn.Linear(2, 4)])
