"""expert_mlp (the gather-fused expert MLP), CPU tier: the definition against the composition it replaces,
fp64 gradcheck of its backward, opcheck, argument checks, and the activation bytes it does not keep."""

import pytest
import torch

from moe_kernels.ops.activation import swiglu
from moe_kernels.ops.expert_mlp import expert_mlp, expert_mlp_reference, rows_to_tokens_reference
from moe_kernels.ops.grouped_mm import grouped_mm
from moe_kernels.ops.permute import permute, permuted_row_values, permuted_rows, unpermute
from moe_kernels.testing import assert_exact, random_routing


def _problem(T=13, H=12, F=10, E=4, k=2, align=1, kind="uniform", drop=0.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    w13 = (torch.randn(E, 2 * F, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, F, generator=g, dtype=torch.float64) / F**0.5).to(dtype)
    idx = random_routing(T, E, k, kind=kind, drop=drop, seed=seed)
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).to(dtype if dtype == torch.float64 else torch.float32)
    return x, w13, w2, idx, weights, E, align


def _composition(x, w13, w2, idx, weights, E, align):
    x_perm, row_map, gs = permute(x, idx, E, align=align)
    rw = permuted_row_values(weights, row_map, x_perm.shape[0])
    return unpermute(grouped_mm(swiglu(grouped_mm(x_perm, w13, gs), rw), w2, gs), row_map, None)


def _fused(x, w13, w2, idx, weights, E, align):
    R = permuted_rows(x.shape[0], idx.shape[1], E, align)
    _, row_map, gs = permute(x[:, :0], idx, E, align=align)
    return expert_mlp(x, row_map, gs, w13, w2, permuted_row_values(weights, row_map, R), num_rows=R)


@pytest.mark.parametrize("case", [
    dict(), dict(align=8), dict(kind="hot"), dict(kind="empty", drop=0.3), dict(T=0), dict(T=1, k=1, E=1),
    dict(H=7, F=3, E=5, k=3, align=4, drop=0.2),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_equals_the_composition(case, dtype):
    """On the CPU both run the references: the same products in the same order, so bit for bit."""
    x, w13, w2, idx, weights, E, align = _problem(dtype=dtype, **case)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = _fused(*leaves[:3], idx, leaves[3], E, align)
    g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    got = [out, *torch.autograd.grad(out, leaves, g, allow_unused=True)]
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = _composition(*leaves[:3], idx, leaves[3], E, align)
    want = [out, *torch.autograd.grad(out, leaves, g, allow_unused=True)]
    for name, a, b in zip(["out", "dx", "dw13", "dw2", "dweights"], got, want):
        if b is None:  # no token routed: no path from the weights to the output
            assert a is None or not a.any(), name
            continue
        assert_exact(a, b, name)


def test_gradcheck():
    x, w13, w2, idx, weights, E, align = _problem(T=6, H=5, F=3, E=3, k=2, align=2, drop=0.2)
    R = permuted_rows(6, 2, E, align)
    _, row_map, gs = permute(x[:, :0], idx, E, align=align)
    rw = permuted_row_values(weights, row_map, R)
    args = [t.requires_grad_() for t in (x, w13, w2, rw)]
    assert torch.autograd.gradcheck(
        lambda x, w13, w2, rw: expert_mlp(x, row_map, gs, w13, w2, rw, num_rows=R), args)
    assert torch.autograd.gradcheck(lambda x, w13, w2: expert_mlp(x, row_map, gs, w13, w2, None, num_rows=R), args[:3])


def test_opcheck():
    x, w13, w2, idx, weights, E, align = _problem(dtype=torch.float32)
    R = permuted_rows(x.shape[0], idx.shape[1], E, align)
    _, row_map, gs = permute(x[:, :0], idx, E, align=align)
    rw = permuted_row_values(weights, row_map, R)
    torch.library.opcheck(torch.ops.moe_kernels.expert_mlp,
                          (x.requires_grad_(), row_map, gs, w13.requires_grad_(), w2, rw.detach().requires_grad_(), R))


def test_rows_to_tokens():
    row_map = torch.tensor([[3, -1], [0, 5], [1, 2]], dtype=torch.int32)
    assert rows_to_tokens_reference(row_map, 7).tolist() == [1, 2, 2, 0, -1, 1, -1]


def test_keeps_fewer_activation_bytes():
    """Saved for the backward, beyond the inputs and weights: the composition keeps x_perm [R, H] and the
    activation [R, F] that the fused op does not; the fused op adds row_token [R] int32."""
    x, w13, w2, idx, weights, E, align = _problem(T=16, H=24, F=20, E=4, k=2, align=4, dtype=torch.float32)
    R = permuted_rows(16, 2, E, align)
    own = {t.untyped_storage().data_ptr() for t in (x, w13, w2, weights)}

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            p = t.untyped_storage().data_ptr()
            if p not in own:
                seen[p] = t.untyped_storage().nbytes()
            return t

        leaves = [t.requires_grad_() for t in (x, w13, w2, weights)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*leaves[:3], idx, leaves[3], E, align)
        return sum(seen.values())

    H, F = 24, 20
    assert saved_bytes(_composition) - saved_bytes(_fused) == R * (H + F) * 4 - R * 4


@pytest.mark.parametrize("change,match", [
    (dict(row_map=lambda rm: rm.long()), "row_map"),
    (dict(row_map=lambda rm: rm[:-1]), "row_map"),
    (dict(w13=lambda w: w[:, :-1]), "w13"),
    (dict(w13=lambda w: w[..., :-1].contiguous()), "w13"),
    (dict(w2=lambda w: w[:, :, :-1].contiguous()), "w2"),
    (dict(w2=lambda w: w.double()), "w2"),
    (dict(group_sizes=lambda g: g[:-1]), "group_sizes"),
    (dict(row_weights=lambda r: r[:-1]), "row_weights"),
    (dict(num_rows=lambda n: -1), "num_rows"),
    (dict(num_rows=lambda n: n - 3, row_weights=lambda r: None), "row_map"),  # rows past num_rows
    (dict(group_sizes=lambda g: g + 100), "group_sizes"),  # sizes summing past num_rows
])
def test_bad_arguments_name_the_argument(change, match):
    x, w13, w2, idx, weights, E, align = _problem(dtype=torch.float32)
    R = permuted_rows(x.shape[0], idx.shape[1], E, align)
    _, row_map, gs = permute(x[:, :0], idx, E, align=align)
    args = dict(x=x, row_map=row_map, group_sizes=gs, w13=w13, w2=w2,
                row_weights=permuted_row_values(weights, row_map, R), num_rows=R)
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises((ValueError, TypeError), match=match):
        expert_mlp(args["x"], args["row_map"], args["group_sizes"], args["w13"], args["w2"], args["row_weights"],
                   num_rows=args["num_rows"])


@pytest.mark.parametrize("change,match", [
    (dict(dout=lambda t: t[:-1]), "`dout` must have shape"),
    (dict(dout=lambda t: t.double()), "`dout` must have dtype"),
    (dict(h=lambda t: t[:, :-2].contiguous()), "`h` must have shape"),
    (dict(row_token=lambda t: t[:-1]), "`row_token` must have shape"),
    (dict(row_token=lambda t: t.long()), "`row_token` must have dtype"),
])
def test_backward_op_checks_its_arguments(change, match):
    # The registered backward op, called directly with tensors unlike the forward's: a ValueError or TypeError
    # naming the argument, before any kernel reads them.
    x, w13, w2, idx, weights, E, align = _problem(dtype=torch.float32)
    R = permuted_rows(x.shape[0], idx.shape[1], E, align)
    _, row_map, gs = permute(x[:, :0], idx, E, align=align)
    rw = permuted_row_values(weights, row_map, R)
    _, row_token, h = torch.ops.moe_kernels.expert_mlp(x, row_map, gs, w13, w2, rw, R)
    args = dict(dout=torch.randn_like(x), row_token=row_token, h=h)
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises((ValueError, TypeError), match=f"expert_mlp backward: {match}"):
        torch.ops.moe_kernels.expert_mlp_bwd(args["dout"], x, args["row_token"], row_map, args["h"], w13, w2, gs, rw,
                                             True, True, True, True)
