"""Router ops: CPU tier (formulas against hand-worked cases and independent formulations)."""

import math

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.router import router_topk_reference, router_weights_reference
from moe_kernels.ops.router_losses import capacity
from moe_kernels.testing import assert_exact


def test_softmax_post_hand_worked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, idx = mk.router_topk(logits, 2)
    assert idx.tolist() == [[1, 2]]
    e = math.exp(1.0)
    torch.testing.assert_close(w, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))
    assert w.dtype == torch.float32 and idx.dtype == torch.int32


def test_softmax_pre_hand_worked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, idx = mk.router_topk(logits, 2, pre_softmax=True)
    p = torch.softmax(logits, -1)
    assert idx.tolist() == [[1, 2]]
    torch.testing.assert_close(w, p[:, [1, 2]])


def test_ties_go_to_lower_index():
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, 1.0]])
    _, idx = mk.router_topk(logits, 3)
    assert idx.tolist() == [[1, 2, 3]]
    _, idx = mk.router_topk(torch.zeros(1, 6), 2, score="sigmoid")
    assert idx.tolist() == [[0, 1]]


def test_sigmoid_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    w, idx = mk.router_topk(logits, 2, score="sigmoid", expert_bias=bias, normalize=False)
    assert idx.tolist() == [[3, 0]]
    torch.testing.assert_close(w, torch.sigmoid(logits[:, [3, 0]]))
    w, idx = mk.router_topk(logits, 2, score="sigmoid", expert_bias=bias, scaling_factor=2.5)
    s = torch.sigmoid(logits[:, [3, 0]])
    torch.testing.assert_close(w, s / (s.sum() + 1e-20) * 2.5)


def test_normalize_default_and_k1():
    logits = torch.randn(5, 8)
    w, _ = mk.router_topk(logits, 1, score="sigmoid")  # k == 1: no normalisation by default
    assert not torch.allclose(w, torch.ones_like(w))
    w, _ = mk.router_topk(logits, 3, score="sigmoid")
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


def test_sqrtsoftplus_threshold():
    logits = torch.tensor([[30.0, 25.0, -3.0, 0.5]])
    w, idx = mk.router_topk(logits, 2, score="sqrtsoftplus", normalize=False)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.sqrt(torch.tensor([[30.0, 25.0]])))


def loop_group_topk(logits, k, G, g, gst, bias):
    """Independent formulation of DeepSeek-V3 routing, one token at a time in Python floats."""
    out = []
    for row in logits.tolist():
        s = [1 / (1 + math.exp(-x)) for x in row]
        sel = [v + b for v, b in zip(s, bias.tolist())]
        size = len(row) // G
        gscores = [sum(sorted(sel[i * size:(i + 1) * size], reverse=True)[:gst]) for i in range(G)]
        groups = sorted(range(G), key=lambda i: (-gscores[i], i))[:g]
        eligible = [e for e in range(len(row)) if e // size in groups]
        chosen = sorted(eligible, key=lambda e: (-sel[e], e))[:k]
        ws = [s[e] for e in chosen]
        total = sum(ws) + 1e-20
        out.append((chosen, [2.5 * v / total for v in ws]))
    return out


def test_group_limited_routing_matches_loop():
    torch.manual_seed(0)
    T, E, k, G, g = 40, 32, 4, 8, 2
    logits = torch.randn(T, E)
    bias = torch.randn(E) * 0.1
    w, idx = mk.router_topk(logits, k, score="sigmoid", num_groups=G, group_topk=g, expert_bias=bias,
                            scaling_factor=2.5)
    # Only experts of the two chosen groups (of 4 experts each) appear.
    for (chosen, weights), i_row, w_row in zip(loop_group_topk(logits, k, G, g, 2, bias), idx.tolist(), w):
        assert i_row == chosen
        torch.testing.assert_close(w_row, torch.tensor(weights), rtol=1e-5, atol=1e-7)
    assert len({e // 4 for row in idx.tolist() for e in row[:1]}) > 1


def test_group_score_topk_default_is_k_over_g():
    torch.manual_seed(1)
    logits = torch.randn(16, 16)
    a = mk.router_topk(logits, 4, score="sigmoid", num_groups=4, group_topk=2)
    b = mk.router_topk(logits, 4, score="sigmoid", num_groups=4, group_topk=2, group_score_topk=2)
    assert torch.equal(a[1], b[1])


def test_group_score_topk_default_is_at_least_one_and_documented():
    # k < group_topk: k // group_topk is 0, and the group score takes max(1, k // group_topk) = 1 best
    # score, as the docstring says.
    from moe_kernels.ops.router import resolve_topk_options

    assert resolve_topk_options(1, 4, 2, None, None, None, score="sigmoid")[2] == 1
    assert resolve_topk_options(8, 4, 2, None, None, None, score="sigmoid")[2] == 4
    logits = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    a = mk.router_topk(logits, 1, score="sigmoid", num_groups=4, group_topk=2)
    b = mk.router_topk(logits, 1, score="sigmoid", num_groups=4, group_topk=2, group_score_topk=1)
    assert torch.equal(a[1], b[1])
    assert "`group_score_topk` (default max(1, k // group_topk), at most the group's size)" in " ".join(
        mk.router_topk.__doc__.split())
    assert resolve_topk_options(8, 4, 1, None, None, None, 16, score="sigmoid")[2] == 4  # capped at the group's 4 experts


def test_aux_scores():
    logits = torch.randn(6, 8)
    scores, idx = mk.router_aux_scores(logits, 2)
    torch.testing.assert_close(scores, torch.softmax(logits, -1))
    assert idx.tolist() == torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :2].tolist()
    scores, _ = mk.router_aux_scores(logits, 2, score="sigmoid")
    s = torch.sigmoid(logits)
    torch.testing.assert_close(scores, s / (s.sum(-1, keepdim=True) + 1e-20))


def test_aux_loss_uniform_is_coeff_exactly():
    T, E, k = 64, 8, 2
    scores = torch.full((T, E), 1.0 / E)
    counts = torch.full((E,), T * k // E, dtype=torch.int32)
    assert mk.aux_loss(scores, counts, k, 0.01).item() == torch.tensor(0.01).item()
    assert mk.aux_loss(scores.double(), counts, k, 0.01).item() == 0.01


def test_aux_loss_formula_and_grad():
    T, E, k = 10, 4, 2
    scores = torch.rand(T, E, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, E, (T, k), dtype=torch.int32)
    counts = mk.tokens_per_expert(idx, E)
    loss = mk.aux_loss(scores, counts, k, 0.1)
    expected = 0.1 * E / (k * T * T) * sum(scores[:, e].sum() * counts[e] for e in range(E))
    torch.testing.assert_close(loss, expected)
    assert torch.autograd.gradcheck(lambda s: mk.aux_loss(s, counts, k, 0.1), (scores,))


def test_seq_aux_loss():
    torch.manual_seed(2)
    S, E, k = 6, 5, 2
    scores = torch.rand(3 * S, E, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, E, (3 * S, k), dtype=torch.int32)
    one = mk.seq_aux_loss(scores[:S], idx[:S], 0.1, seq_len=S)
    torch.testing.assert_close(one, mk.aux_loss(scores[:S], mk.tokens_per_expert(idx[:S], E), k, 0.1))
    per_seq = [mk.aux_loss(scores[i * S:(i + 1) * S], mk.tokens_per_expert(idx[i * S:(i + 1) * S], E), k, 0.1)
               for i in range(3)]
    torch.testing.assert_close(mk.seq_aux_loss(scores, idx, 0.1, seq_len=S), sum(per_seq) / 3)
    assert torch.autograd.gradcheck(lambda s: mk.seq_aux_loss(s, idx, 0.1, seq_len=S), (scores,))


def test_z_loss():
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    expected = 0.5 * (math.log(2) ** 2 + (1 + math.log(2)) ** 2) * 1e-3
    assert math.isclose(mk.z_loss(logits, 1e-3).item(), expected, rel_tol=1e-12)
    assert torch.autograd.gradcheck(lambda x: mk.z_loss(x, 1e-3), (torch.randn(5, 4, dtype=torch.float64, requires_grad=True),))


def test_update_expert_bias():
    bias = torch.zeros(4)
    mk.update_expert_bias(bias, torch.tensor([10, 2, 4, 4]), 0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def test_update_expert_bias_sign_is_exact():
    # mean = 5 exactly: the expert at the mean keeps its bias, even with counts past fp32's 2^24.
    big = 2**26
    counts = torch.tensor([big + 4, big + 6, big + 5, big + 5], dtype=torch.int64)
    bias = torch.zeros(4)
    mk.update_expert_bias(bias, counts, 0.5)
    assert bias.tolist() == [0.5, -0.5, 0.0, 0.0]
    # float counts follow the same formula in the bias dtype
    bias = torch.zeros(3, dtype=torch.float64)
    mk.update_expert_bias(bias, torch.tensor([1.0, 2.0, 3.0]), 0.25)
    assert bias.tolist() == [0.25, 0.0, -0.25]


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -float("inf")])
def test_update_expert_bias_refuses_a_non_finite_rate(rate):
    bias = torch.zeros(4)
    with pytest.raises(ValueError, match="`rate` must be finite"):
        mk.update_expert_bias(bias, torch.tensor([10, 2, 4, 4]), rate)
    assert bias.tolist() == [0.0] * 4  # untouched


def test_losses_return_what_backward_needs():
    ops = torch.ops.moe_kernels
    logits = torch.randn(6, 5, dtype=torch.float64)
    loss, lse = ops.z_loss(logits, 1e-3)
    assert_exact(lse, torch.logsumexp(logits, -1), "lse")
    idx = torch.tensor([[0, 1], [1, 2], [-1, 4], [4, 4], [0, 0], [3, -1]], dtype=torch.int32)
    _, counts = ops.seq_aux_loss(torch.rand(6, 5), idx, 0.1, 3)
    assert counts.tolist() == [[1, 2, 1, 0, 1], [2, 0, 0, 1, 2]]


def test_z_loss_non_finite_follows_logsumexp():
    logits = torch.randn(4, 6)
    logits[0, 1] = float("nan")
    logits[1, 2] = float("inf")
    logits[2] = float("-inf")
    _, lse = torch.ops.moe_kernels.z_loss(logits, 1e-3)
    assert math.isnan(lse[0]) and lse[1] == math.inf and lse[2] == -math.inf and math.isfinite(lse[3])


def test_losses_twice_differentiable():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: mk.z_loss(x, 1e-2), (x,))
    s = torch.rand(6, 4, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 4, (6, 2), dtype=torch.int32)
    assert torch.autograd.gradgradcheck(lambda s: mk.aux_loss(s, mk.tokens_per_expert(idx, 4), 2, 0.1) ** 2, (s,))
    assert torch.autograd.gradgradcheck(lambda s: mk.seq_aux_loss(s, idx, 0.1, seq_len=3) ** 2, (s,))


def test_backward_ops_check_shapes():
    ops = torch.ops.moe_kernels
    with pytest.raises(ValueError, match="counts"):
        ops.balance_loss_bwd(torch.tensor(1.0), torch.zeros(1, 4, dtype=torch.int32), 8, 4, 1.0, torch.float32)
    with pytest.raises(ValueError, match="lse"):
        ops.z_loss_bwd(torch.tensor(1.0), torch.randn(4, 3), torch.zeros(5), 1e-3)
    with pytest.raises(ValueError, match="capacity_factor"):
        mk.apply_capacity(torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.int32), 2, float("inf"))


def router_bwd_bad_inputs(device):
    """(op, args, exception, match) for the router backward helper ops called directly with inputs that do
    not fit each other: T = 6 tokens, E = 8 experts, k = 2."""
    logits = torch.randn(6, 8, device=device)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [7, 6]], dtype=torch.int32, device=device)
    gw = torch.randn(6, 2, device=device)
    topk = torch.ops.moe_kernels.router_topk_bwd
    aux = torch.ops.moe_kernels.router_aux_scores_bwd
    rest = ("sigmoid", False, True, 1.0)
    return [
        (topk, (torch.randn(6, 3, device=device), logits, idx, *rest), ValueError, "grad_weights"),
        (topk, (torch.randn(5, 2, device=device), logits, idx, *rest), ValueError, "grad_weights"),
        (topk, (torch.randn(12, device=device), logits, idx, *rest), ValueError, "grad_weights"),
        (topk, (gw.to(torch.int32), logits, idx, *rest), TypeError, "grad_weights"),
        (topk, (torch.randn(2, 6, device=device).t(), logits, idx, *rest), ValueError, "grad_weights"),
        (topk, (gw, logits, idx[:5], *rest), ValueError, "indices"),
        (topk, (gw, logits, idx.long(), *rest), TypeError, "indices"),
        (topk, (gw.flatten(), logits, idx.flatten(), *rest), ValueError, "indices"),
        (topk, (torch.randn(6, 9, device=device), logits,
                torch.zeros(6, 9, dtype=torch.int32, device=device), *rest), ValueError, "indices"),
        (topk, (gw[:, :0], logits, idx[:, :0], *rest), ValueError, "indices"),
        (topk, (gw, logits.flatten(), idx, *rest), ValueError, "logits"),
        (topk, (gw, logits.to(torch.int32), idx, *rest), TypeError, "logits"),
        (topk, (gw, logits, idx, "relu", False, True, 1.0), ValueError, "score"),
        (topk, (gw, logits, idx, "sigmoid", True, True, 1.0), ValueError, "pre_softmax"),
        (aux, (torch.randn(6, 7, device=device), logits, "softmax"), ValueError, "grad_scores"),
        (aux, (torch.randn(7, 8, device=device), logits, "softmax"), ValueError, "grad_scores"),
        (aux, (torch.randn(48, device=device), logits, "softmax"), ValueError, "grad_scores"),
        (aux, (logits.to(torch.int32), logits, "softmax"), TypeError, "grad_scores"),
        (aux, (torch.randn(8, 6, device=device).t(), logits, "softmax"), ValueError, "grad_scores"),
        (aux, (logits, logits.view(6, 8, 1), "softmax"), ValueError, "logits"),
        (aux, (logits, logits.to(torch.int64), "softmax"), TypeError, "logits"),
        (aux, (logits[:, :0], logits[:, :0], "softmax"), ValueError, "logits"),
        (aux, (logits, logits, "relu"), ValueError, "score"),
    ]


@pytest.mark.parametrize("device", ["cpu", "meta"])  # the reference and the fake implementation
def test_router_backward_ops_check_inputs(device):
    for op, args, exc, match in router_bwd_bad_inputs(device):
        with pytest.raises(exc, match=match):
            op(*args)
    logits = torch.randn(6, 8, device=device)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [7, 6]], dtype=torch.int32, device=device)
    ops = torch.ops.moe_kernels
    assert ops.router_topk_bwd(torch.randn(6, 2, device=device), logits, idx, "softmax", True, False, 1.0).shape == (6, 8)
    assert ops.router_aux_scores_bwd(torch.randn(6, 8, device=device), logits, "sqrtsoftplus").shape == (6, 8)


def test_router_topk_bwd_checks_index_values_on_cpu():
    ops = torch.ops.moe_kernels
    logits, gw = torch.randn(3, 8), torch.randn(3, 2)
    for bad in (8, -1, 2**31 - 1):
        idx = torch.tensor([[0, 1], [2, bad], [4, 5]], dtype=torch.int32)
        with pytest.raises(ValueError, match="`indices` holds"):
            ops.router_topk_bwd(gw, logits, idx, "softmax", False, False, 1.0)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)  # fits the shapes, not 4 experts
    with pytest.raises(ValueError, match="`indices` holds 4"):
        ops.router_topk_bwd(gw, logits[:, :4].contiguous(), idx, "sigmoid", False, True, 1.0)


def test_out_of_range_indices_raise_on_cpu():
    w = torch.rand(4, 2)
    idx = torch.tensor([[0, 1], [2, 8], [1, 1], [0, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        mk.apply_capacity(w, idx, 8, 1.0)
    with pytest.raises(ValueError, match="outside"):
        mk.seq_aux_loss(torch.rand(4, 8), idx, 0.1, seq_len=2)
    wide = idx.long()
    wide[1, 1] = 2**32 + 3  # would wrap to expert 3 in int32
    with pytest.raises(ValueError, match="outside"):
        mk.apply_capacity(w, wide, 8, 1.0)


def test_capacity_probs_and_position():
    # 6 tokens, k=1, E=2, factor 1 -> C = 3.
    w = torch.tensor([[0.1], [0.9], [0.5], [0.5], [0.3], [0.8]])
    idx = torch.tensor([[0], [0], [0], [0], [1], [0]], dtype=torch.int32)
    assert capacity(6, 1, 2, 1.0) == 3
    cw, ci = mk.apply_capacity(w, idx, 2, 1.0, "probs")
    assert ci.flatten().tolist() == [-1, 0, 0, -1, 1, 0]  # 0.9, 0.8, then the lower of the two 0.5s
    assert cw.flatten().tolist() == pytest.approx([0, 0.9, 0.5, 0, 0.3, 0.8])
    _, ci = mk.apply_capacity(w, idx, 2, 1.0, "position")
    assert ci.flatten().tolist() == [0, 0, 0, -1, 1, -1]


def test_capacity_keeps_exactly_c_per_expert():
    torch.manual_seed(3)
    T, E, k = 100, 8, 2
    w, idx = mk.router_topk(torch.randn(T, E) * 3, k)
    C = capacity(T, k, E, 0.5)
    for policy in ("probs", "position"):
        cw, ci = mk.apply_capacity(w, idx, E, 0.5, policy)
        before, after = mk.tokens_per_expert(idx, E), mk.tokens_per_expert(ci, E)
        assert_exact(after, torch.minimum(before, torch.tensor(C, dtype=torch.int32)), f"kept counts ({policy})")
        assert bool(((ci == -1) == (cw == 0)).all())
        kept = ci >= 0
        assert torch.equal(cw[kept], w[kept]) and torch.equal(ci[kept], idx[kept])


@pytest.mark.parametrize(
    "kw",
    [
        dict(score="softmax"),
        dict(score="softmax", pre_softmax=True),
        dict(score="sigmoid"),
        dict(score="sigmoid", normalize=False),
        dict(score="sqrtsoftplus", scaling_factor=2.5),
        dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, with_bias=True),
    ],
)
def test_gradcheck_router_topk(kw):
    kw = dict(kw)
    torch.manual_seed(4)
    logits = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    if kw.pop("with_bias", False):
        kw["expert_bias"] = torch.randn(16, dtype=torch.float64) * 0.1
    assert torch.autograd.gradcheck(lambda x: mk.router_topk(x, 4, **kw)[0], (logits,))


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_gradcheck_aux_scores(score):
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mk.router_aux_scores(x, 2, score=score)[0], (logits,))


def test_gradcheck_capacity():
    w = torch.rand(12, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 3, (12, 2), dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda w: mk.apply_capacity(w, idx, 3, 0.5)[0], (w,))


def test_opcheck():
    logits = torch.randn(6, 16, requires_grad=True)
    bias = torch.randn(16)
    ops = torch.ops.moe_kernels
    torch.library.opcheck(ops.router_topk, (logits, 4, "sigmoid", False, 4, 2, 2, 2.5, bias, True))
    torch.library.opcheck(ops.router_topk, (logits, 3, "softmax", True, 1, 1, 1, 1.0, None, True))
    torch.library.opcheck(ops.router_aux_scores, (logits, 2, "sqrtsoftplus"))
    scores, idx = mk.router_aux_scores(logits.detach(), 2)
    scores.requires_grad_()
    torch.library.opcheck(ops.aux_loss, (scores, mk.tokens_per_expert(idx, 16), 2, 0.01))
    torch.library.opcheck(ops.seq_aux_loss, (scores, idx, 0.01, 3))
    torch.library.opcheck(ops.z_loss, (logits, 1e-3))
    w, i = mk.router_topk(logits.detach(), 2)
    torch.library.opcheck(ops.apply_capacity, (w.requires_grad_(), i, 16, 1.0, "probs"))
    torch.library.opcheck(ops.update_expert_bias, (torch.zeros(16), mk.tokens_per_expert(i, 16), 0.01))
    counts = torch.randint(0, 9, (2, 16), dtype=torch.int32)
    torch.library.opcheck(ops.balance_loss_bwd, (torch.tensor(2.0), counts, 6, 3, 0.5, torch.bfloat16))
    _, lse = ops.z_loss(logits.detach(), 1e-3)
    torch.library.opcheck(ops.z_loss_bwd, (torch.tensor(1.5), logits.detach(), lse, 1e-3))


def test_compile_router_and_losses():
    logits = torch.randn(8, 16, requires_grad=True)

    def f(x):
        w, idx = mk.router_topk(x, 4, score="sigmoid", num_groups=4, group_topk=2)
        scores, aux_idx = mk.router_aux_scores(x, 4, score="sigmoid")
        aux = mk.aux_loss(scores, mk.tokens_per_expert(aux_idx, 16), 4, 0.01)
        return w.sum() + aux + mk.z_loss(x, 1e-3)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(logits), f(logits))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(k=17), ValueError, "`k`"),
        (dict(k=0), ValueError, "`k`"),
        (dict(num_groups=3, group_topk=1), ValueError, "num_groups"),
        (dict(num_groups=4), ValueError, "go together"),
        (dict(num_groups=4, group_topk=5), ValueError, "group_topk"),
        (dict(num_groups=0, group_topk=1), ValueError, "`num_groups` must be a positive int, got 0"),
        (dict(num_groups=4, group_topk=0), ValueError, "`group_topk` must be a positive int"),
        (dict(num_groups=4, group_topk=2, group_score_topk=0), ValueError, "`group_score_topk` must be a positive"),
        (dict(num_groups=4.0, group_topk=2), ValueError, "`num_groups` must be a positive int, got 4.0"),
        (dict(expert_bias=torch.zeros(16)), ValueError, "expert_bias"),
        (dict(score="sigmoid", expert_bias=torch.zeros(15)), ValueError, "expert_bias"),
        (dict(pre_softmax=True, expert_bias=torch.zeros(15)), ValueError, "expert_bias"),
        (dict(score="relu"), ValueError, "score"),
        (dict(score="sigmoid", pre_softmax=True), ValueError, "pre_softmax"),
        (dict(score="sigmoid", normalize="yes"), ValueError, "`normalize` must be True, False or None"),
        (dict(scaling_factor="2.5"), ValueError, "`scaling_factor` must be a finite number"),
        (dict(scaling_factor=float("inf")), ValueError, "`scaling_factor` must be a finite number"),
        (dict(scaling_factor=True), ValueError, "`scaling_factor` must be a finite number"),
    ],
)
def test_router_bad_input(kw, exc, match):
    kw = dict(kw)
    k = kw.pop("k", 4)
    with pytest.raises(exc, match=match):
        mk.router_topk(torch.randn(4, 16), k, **kw)


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_with_expert_bias_selects_by_probability_plus_bias(normalize):
    # ERNIE-4.5's routing (normalize=True): p = softmax over all E, selection by p + bias, weights p over the sum of
    # the chosen p; without normalize the weights are p itself. In fp64, against the formula written out.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(16, generator=g, dtype=torch.float64) * 0.1  # large enough to reorder the picks
    w, idx = mk.router_topk(logits, 4, pre_softmax=True, expert_bias=bias, normalize=normalize, scaling_factor=2.0)
    p = logits.softmax(-1)
    ref_idx = torch.sort(p + bias, dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(idx.long(), ref_idx)
    assert not torch.equal(ref_idx, p.topk(4, dim=-1).indices)  # the bias changed some picks
    chosen = p.gather(1, ref_idx)
    ref_w = (chosen / chosen.sum(-1, keepdim=True) if normalize else chosen) * 2.0
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=0)
    # the gradient too: d(w . g)/d logits against autograd through the formula
    x = logits.clone().requires_grad_()
    w, _ = mk.router_topk(x, 4, pre_softmax=True, expert_bias=bias, normalize=normalize, scaling_factor=2.0)
    gw = torch.randn(64, 4, generator=g, dtype=torch.float64)
    (w * gw).sum().backward()
    y = logits.clone().requires_grad_()
    c = y.softmax(-1).gather(1, ref_idx)
    (((c / c.sum(-1, keepdim=True) if normalize else c) * 2.0) * gw).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)


def test_softmax_normalize_default_is_off():
    # normalize defaults to k > 1 for sigmoid only: a softmax over all E is not renormalised unless asked
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))
    w, idx = mk.router_topk(logits, 4, pre_softmax=True)
    torch.testing.assert_close(w, logits.softmax(-1).gather(1, idx.long()))


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_k_past_the_kept_groups_fills_from_the_dropped_groups(score):
    # 8 experts in 2 groups, 1 kept, k = 6: the 4 kept experts by score, then the dropped group's
    # experts lowest index first (they rank as -inf), each weighted by its own score.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 8, generator=g)
    w, idx = mk.router_topk(logits, 6, score=score, num_groups=2, group_topk=1)
    s = torch.sigmoid(logits) if score == "sigmoid" else logits
    kept = s.view(32, 2, 4).sum(-1).argmax(-1)  # group_score_topk: max(1, 6 // 1) capped at the group's 4
    for t in range(32):
        lo = int(kept[t]) * 4
        first4 = sorted(range(lo, lo + 4), key=lambda e: (-float(s[t, e]), e))
        rest = [e for e in range(8) if not lo <= e < lo + 4][:2]
        assert idx[t].tolist() == first4 + rest, t
    want = router_weights_reference(logits, idx, score, False, True, 1.0)
    torch.testing.assert_close(w, want, rtol=0, atol=0)
    # k = E: every expert, the same set and weights as without groups.
    w8, idx8 = mk.router_topk(logits, 8, score=score, num_groups=2, group_topk=1)
    wall, idxall = mk.router_topk(logits, 8, score=score)
    assert torch.equal(idx8.sort(-1).values, idxall.sort(-1).values)
    order8, order = idx8.long().argsort(-1), idxall.long().argsort(-1)
    torch.testing.assert_close(w8.gather(1, order8), wall.gather(1, order), rtol=1e-6, atol=1e-7)


def test_router_bad_tensors():
    with pytest.raises(TypeError, match="logits"):
        mk.router_topk(torch.randint(0, 3, (4, 8)), 2)
    for bad in (None, 0, torch.randn(())):  # checked before its shape is read
        with pytest.raises((TypeError, ValueError), match="`logits`"):
            mk.router_topk(bad, 2)
    with pytest.raises(ValueError, match="`k` must be in"):  # past int32, named before the kernel's argument
        mk.aux_loss(torch.rand(4, 8), torch.zeros(8, dtype=torch.int32), 2**31, 0.1)
    with pytest.raises(ValueError, match="logits"):
        mk.router_topk(torch.randn(4, 8, 2), 2)
    with pytest.raises(ValueError, match="contiguous"):
        mk.router_topk(torch.randn(8, 4).t(), 2)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        mk.aux_loss(torch.rand(4, 8), torch.zeros(7, dtype=torch.int32), 2, 0.1)
    with pytest.raises(ValueError, match="seq_len"):
        mk.seq_aux_loss(torch.rand(10, 8), torch.zeros(10, 2, dtype=torch.int32), 0.1, seq_len=3)
    with pytest.raises(ValueError, match="policy"):
        mk.apply_capacity(torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.int32), 8, 1.0, "random")


def test_reference_is_what_the_op_returns():
    logits = torch.randn(7, 32)
    bias = torch.randn(32)
    a = mk.router_topk(logits, 8, score="sigmoid", num_groups=8, group_topk=4, expert_bias=bias, scaling_factor=2.5)
    b = router_topk_reference(logits, 8, "sigmoid", False, 8, 4, 2, 2.5, bias, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------------
# router_fused: the router in one op (CPU tier: its reference against the composition it fuses)


@pytest.mark.parametrize("score,groups", [("softmax", None), ("sigmoid", (4, 2)), ("sqrtsoftplus", None)])
def test_router_fused_equals_the_composition(score, groups):
    torch.manual_seed(0)
    T, E, k, S = 96, 16, 4, 24
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(E, dtype=torch.float64) * 0.1 if score != "softmax" else None
    G, g = groups or (None, None)
    coeffs = dict(aux_coeff=1e-2, seq_coeff=1e-3, z_coeff=1e-3)
    w, idx, counts, aux_counts, seq_counts, loss = mk.router_fused(
        logits, k, score=score, num_groups=G or 1, group_topk=g or 1, group_score_topk=max(1, k // (g or 1)),
        expert_bias=bias, seq_len=S, **coeffs)
    w2, idx2 = mk.router_topk(logits, k, score=score, num_groups=G, group_topk=g, expert_bias=bias)
    scores, aux_idx = mk.router_aux_scores(logits, k, score=score)
    aux_c = mk.tokens_per_expert(aux_idx, E)
    want = (mk.aux_loss(scores, aux_c, k, 1e-2) + mk.seq_aux_loss(scores, aux_idx, 1e-3, seq_len=S)
            + mk.z_loss(logits, 1e-3))
    assert torch.equal(idx, idx2) and torch.equal(counts, mk.tokens_per_expert(idx2, E)) and torch.equal(aux_counts, aux_c)
    assert seq_counts.shape == (T // S, E) and int(seq_counts.sum()) == T * k
    torch.testing.assert_close(w, w2, rtol=1e-12, atol=0)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    gw = torch.randn(T, k, dtype=torch.float64)
    got = torch.autograd.grad((w * gw).sum() + 3 * loss, logits)[0]
    ref = torch.autograd.grad((w2 * gw).sum() + 3 * want, logits)[0]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)


def test_router_fused_gradcheck_and_compile():
    torch.manual_seed(1)
    logits = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    kw = dict(score="sigmoid", aux_coeff=1e-1, seq_coeff=1e-2, seq_len=6, z_coeff=1e-2)

    def f(x):
        w, _, _, _, _, loss = mk.router_fused(x, 3, **kw)
        return w, loss

    assert torch.autograd.gradcheck(f, (logits,))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(logits), f(logits)):
        torch.testing.assert_close(a, b)


def test_router_fused_bad_input():
    x = torch.randn(12, 8)
    with pytest.raises(ValueError, match="not whole sequences"):
        mk.router_fused(x, 2, seq_coeff=1e-2, seq_len=5)
    with pytest.raises(ValueError, match="`aux_coeff` must be >= 0"):
        mk.router_fused(x, 2, aux_coeff=float("nan"))
    with pytest.raises(ValueError, match="`num_groups`"):
        mk.router_fused(x, 2, num_groups=3, group_topk=1)
