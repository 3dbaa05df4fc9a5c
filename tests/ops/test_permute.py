"""permute / unpermute / tokens_per_expert: CPU tier (reference, schema, autograd, compile, bad input)."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.permute import permute_reference, permuted_rows, unpermute_reference
from moe_kernels.testing import assert_exact, random_routing


def loop_permute(x, indices, E, align):
    """Independent formulation: walk experts, then tokens, then slots."""
    T, k = indices.shape
    rows, row_map, sizes, start = [], torch.full((T, k), -1, dtype=torch.int32), [], 0
    for e in range(E):
        n = 0
        for t in range(T):
            for j in range(k):
                if indices[t, j] == e:
                    row_map[t, j] = start + n
                    rows.append(x[t])
                    n += 1
        padded = -(-n // align) * align
        rows += [x.new_zeros(x.shape[1])] * (padded - n)
        sizes.append(padded)
        start += padded
    body = torch.stack(rows) if rows else x.new_zeros((0, x.shape[1]))
    return body, row_map, torch.tensor(sizes, dtype=torch.int32)


def test_hand_worked_example():
    x = torch.arange(10, dtype=torch.float32).view(5, 2)
    idx = torch.tensor([[0, 2], [1, -1], [2, 2], [0, 1], [3, 0]], dtype=torch.int32)
    x_perm, row_map, sizes = mk.permute(x, idx, 4, align=2)
    assert row_map.tolist() == [[0, 6], [4, -1], [7, 8], [1, 5], [10, 2]]
    assert sizes.tolist() == [4, 2, 4, 2]
    assert x_perm.shape == (10 + 4 * 1, 2)
    assert x_perm[:12, 0].tolist() == [0, 6, 8, 0, 2, 6, 0, 4, 4, 0, 8, 0]
    out = mk.unpermute(x_perm, row_map, torch.full((5, 2), 0.5))
    assert out[:, 0].tolist() == [0.0, 1.0, 4.0, 6.0, 8.0]  # token 1 has one live slot
    assert mk.tokens_per_expert(idx, 4).tolist() == [3, 2, 3, 1]


@pytest.mark.parametrize("T,E,k,align", [(0, 4, 2, 1), (1, 1, 1, 1), (7, 3, 2, 4), (33, 8, 3, 16), (20, 5, 8, 1)])
@pytest.mark.parametrize("kind", ["uniform", "hot", "empty"])
def test_reference_matches_loop(T, E, k, align, kind):
    x = torch.randn(T, 5)
    idx = random_routing(T, E, k, kind=kind, drop=0.1, seed=T + E)
    x_perm, row_map, sizes = permute_reference(x, idx, E, align)
    body, loop_map, loop_sizes = loop_permute(x, idx, E, align)
    assert_exact(row_map, loop_map, "row_map")
    assert_exact(sizes, loop_sizes, "group_sizes")
    assert_exact(x_perm[: int(sizes.sum())], body, "x_perm")
    assert x_perm.shape[0] == permuted_rows(T, k, E, align) >= int(sizes.sum())


def test_unpermute_reference_order_and_precision():
    # bf16 y, fp32 accumulation: 256 + 1 + 1 is 258 in fp32, but 256 in bf16 step by step.
    y = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    row_map = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    assert mk.unpermute(y, row_map).item() == 258.0
    w = torch.tensor([[1.0, 0.5, 0.25]])
    assert mk.unpermute(y, row_map, w).item() == torch.tensor(256.75).to(torch.bfloat16).item()


def test_unpermute_reference_equals_loop():
    T, k, H, E = 9, 3, 6, 4
    idx = random_routing(T, E, k, drop=0.2, seed=3)
    y = torch.randn(permuted_rows(T, k, E, 1), H)
    _, row_map, _ = mk.permute(torch.randn(T, H), idx, E)
    w = torch.rand(T, k)
    out = unpermute_reference(y, row_map, w)
    for t in range(T):
        acc = torch.zeros(H)
        for j in range(k):
            if row_map[t, j] >= 0:
                acc = acc + w[t, j] * y[row_map[t, j]]
        assert torch.equal(out[t], acc)


def test_tokens_per_expert_ignores_dropped():
    idx = random_routing(50, 6, 2, kind="zipf", drop=0.3, seed=1)
    counts = mk.tokens_per_expert(idx, 6)
    expected = torch.tensor([int((idx == e).sum()) for e in range(6)], dtype=torch.int32)
    assert_exact(counts, expected, "counts")


def test_int64_indices_accepted():
    x = torch.randn(4, 3)
    idx = random_routing(4, 4, 2, seed=2)
    a = mk.permute(x, idx.long(), 4)
    b = mk.permute(x, idx, 4)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_permute_backward_sums_copies():
    x = torch.randn(6, 4, requires_grad=True)
    idx = random_routing(6, 3, 2, drop=0.2, seed=5)
    x_perm, row_map, _ = mk.permute(x, idx, 3, align=4)
    g = torch.randn_like(x_perm)
    (x_perm * g).sum().backward()
    expected = torch.stack([sum((g[r] for r in row_map[t] if r >= 0), torch.zeros(4)) for t in range(6)])
    torch.testing.assert_close(x.grad, expected)


def test_unpermute_backward_values():
    T, k, H, E = 5, 2, 3, 3
    idx = random_routing(T, E, k, drop=0.2, seed=9)
    _, row_map, _ = mk.permute(torch.zeros(T, H), idx, E, align=2)
    y = torch.randn(permuted_rows(T, k, E, 2), H, requires_grad=True)
    w = torch.rand(T, k, requires_grad=True)
    dout = torch.randn(T, H)
    mk.unpermute(y, row_map, w).backward(dout)
    mapped = set(int(r) for r in row_map.flatten() if r >= 0)
    for r in range(y.shape[0]):
        if r not in mapped:
            assert torch.equal(y.grad[r], torch.zeros(H)), "unmapped rows get zero gradient"
    for t in range(T):
        for j in range(k):
            r = int(row_map[t, j])
            if r < 0:
                assert w.grad[t, j] == 0
            else:
                torch.testing.assert_close(y.grad[r], w[t, j].detach() * dout[t])
                torch.testing.assert_close(w.grad[t, j], (y[r].detach() * dout[t]).sum())


def test_gradcheck_fp64():
    T, k, H, E = 4, 2, 3, 3
    idx = random_routing(T, E, k, drop=0.25, seed=4)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        x_perm, row_map, _ = mk.permute(x, idx, E, align=2)
        return mk.unpermute(x_perm * 1.5, row_map, w)

    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.autograd.gradgradcheck(lambda x: mk.permute(x, idx, E)[0], (x,))


def test_opcheck():
    T, k, H, E = 6, 2, 4, 3
    idx = random_routing(T, E, k, drop=0.2, seed=6)
    x = torch.randn(T, H, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_kernels.permute, (x, idx, E, 4))
    x_perm, row_map, _ = mk.permute(x.detach(), idx, E)
    y = x_perm.clone().requires_grad_()
    w = torch.rand(T, k, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_kernels.unpermute, (y, row_map, w))
    torch.library.opcheck(torch.ops.moe_kernels.unpermute, (y, row_map, None))
    torch.library.opcheck(torch.ops.moe_kernels.tokens_per_expert, (idx, E))
    dout = torch.randn(T, H)
    torch.library.opcheck(torch.ops.moe_kernels.unpermute_bwd, (dout, row_map, w.detach(), y.detach(), y.shape[0]))


def test_compile_fullgraph():
    T, k, H, E = 8, 2, 4, 4
    idx = random_routing(T, E, k, seed=7)
    w = torch.rand(T, k)

    def f(x):
        x_perm, row_map, sizes = mk.permute(x, idx, E, align=2)
        return mk.unpermute(x_perm * 2.0, row_map, w), sizes

    x = torch.randn(T, H, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, sizes = compiled(x)
    ref_out, ref_sizes = f(x)
    assert torch.equal(out, ref_out) and torch.equal(sizes, ref_sizes)
    out.sum().backward()
    g_compiled = x.grad.clone()
    x.grad = None
    ref_out.sum().backward()
    assert torch.equal(g_compiled, x.grad)
    inductor = torch.compile(f, fullgraph=True)
    assert torch.equal(inductor(x)[0], ref_out)


# ---------------------------------------------------------------------------------------------------
# Bad input: clear exceptions naming the argument, on every backend


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: (torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.float32), 4), TypeError, "indices"),
        (lambda: (torch.randn(4, 3), torch.zeros(5, 2, dtype=torch.int32), 4), ValueError, "indices"),
        (lambda: (torch.randn(4), torch.zeros(4, 2, dtype=torch.int32), 4), ValueError, "`x`"),
        (lambda: (torch.randn(4, 3), torch.zeros(4, dtype=torch.int32), 4), ValueError, "indices"),
        (lambda: (torch.randn(3, 4).t(), torch.zeros(4, 2, dtype=torch.int32), 4), ValueError, "contiguous"),
        (lambda: (torch.randn(4, 3), torch.zeros(2, 4, dtype=torch.int32).t(), 4), ValueError, "contiguous"),
        (lambda: (torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.int32), 0), ValueError, "num_experts"),
        # past int32: named as such (compared with int32 indices, 2^31 would wrap and blame `indices`)
        (lambda: (torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.int32), 2**31), ValueError, "`num_experts` must be in"),
        (lambda: (torch.randn(4, 3), torch.full((4, 2), 4, dtype=torch.int32), 4), ValueError, "outside"),
        (lambda: (torch.randn(4, 3), torch.full((4, 2), -2, dtype=torch.int32), 4), ValueError, "outside"),
    ],
)
def test_permute_bad_input(make, exc, match):
    x, idx, E = make()
    with pytest.raises(exc, match=match):
        mk.permute(x, idx, E)


def test_tokens_per_expert_num_experts_past_int32():
    with pytest.raises(ValueError, match="`num_experts` must be in"):
        mk.tokens_per_expert(torch.zeros(0, 2, dtype=torch.int32), 2**31)  # named, before a 2^31-entry count


def test_permute_bad_align():
    with pytest.raises(ValueError, match="align"):
        mk.permute(torch.randn(2, 2), torch.zeros(2, 1, dtype=torch.int32), 2, align=0)


def test_unpermute_bad_input():
    y = torch.randn(6, 3)
    rm = torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="weights"):
        mk.unpermute(y, rm, torch.rand(3, 3))
    with pytest.raises(TypeError, match="row_map"):
        mk.unpermute(y, rm.float())
    with pytest.raises(TypeError, match="`y`"):
        mk.unpermute(y.to(torch.int32), rm)
    with pytest.raises(ValueError, match="outside"):
        mk.unpermute(y, torch.tensor([[6, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="twice"):
        mk.unpermute(y, torch.tensor([[1, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        mk.unpermute(torch.randn(3, 6).t(), rm)


def test_too_many_rows_rejected():
    x = torch.empty((2**28, 4), device="meta")
    idx = torch.empty((2**28, 8), dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="int32"):
        mk.permute(x, idx, 8)


def test_unpermute_bwd_quantize_fp8_reference_is_the_composition():
    # CPU tier: the FP8-writing unpermute backward's reference is unpermute_bwd, then both quantizations of dy;
    # shapes under fake tensors; slot_of_row inverts row_map.
    from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_tokens
    from moe_kernels.ops.permute import slot_of_row, unpermute_bwd_quantize_fp8
    from moe_kernels.ops.quant import quantize_fp8

    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 2], [1, -1], [2, 0]], dtype=torch.int32)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    x_perm, row_map, _ = mk.permute(x, idx, 3, align=128)
    R = x_perm.shape[0]
    dout = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    w = torch.rand(3, 2, generator=g)
    y = torch.randn(R, 256, generator=g).to(torch.bfloat16)
    dy, dw = torch.ops.moe_kernels.unpermute_bwd(dout, row_map, w, y, R)
    want = (*quantize_fp8(dy, "block"), *quantize_fp8_tokens(dy), dw)
    for a, b in zip(unpermute_bwd_quantize_fp8(dout, row_map, w, y, R), want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    inv = slot_of_row(row_map, R)
    for s, r in enumerate(row_map.flatten().tolist()):
        if r >= 0:
            assert inv[r] == s
    assert int((inv >= 0).sum()) == int((row_map >= 0).sum())
    # Entries past the rows are taken as dropped (as the kernels take them), never scattered out of bounds.
    bad = row_map.clone()
    bad[0, 0] = R + 5
    inv_bad = slot_of_row(bad, R)
    assert inv_bad.shape == (R,) and int((inv_bad >= 0).sum()) == int((row_map >= 0).sum()) - 1
    assert not (inv_bad == 0).any()
    q, s, qt, st, dwm = unpermute_bwd_quantize_fp8(dout.to("meta"), row_map.to("meta"), None, None, R)
    Rp = -(-R // 128) * 128
    assert (q.shape, s.shape, qt.shape, st.shape, dwm.shape) == ((R, 256), (R, 2), (256, Rp), (256, Rp // 128), (0,))
    q, s, qt, st, _ = unpermute_bwd_quantize_fp8(dout[:, :200].to("meta"), row_map.to("meta"), None, None, R)
    assert (q.shape, s.shape, qt.shape, st.shape) == ((R, 256), (R, 2), (200, Rp), (200, Rp // 128))
    with pytest.raises(ValueError, match="multiple of 8"):
        unpermute_bwd_quantize_fp8(dout[:, :100].contiguous(), row_map, w, None, R)
