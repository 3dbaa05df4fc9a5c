"""router_topk with non-finite logits: the rules of its docstring, hand-worked and against an independent loop."""

import math

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.router import resolve_topk_options


NAN, INF = math.nan, math.inf


def sig(x):
    return 1 / (1 + math.exp(-x))


def ssp(x):
    return math.sqrt(x if x > 20 else math.log1p(math.exp(x)))


def assert_routed(out, indices, weights):
    w, idx = out
    assert idx.tolist() == indices
    torch.testing.assert_close(w, torch.tensor(weights, dtype=torch.float32), equal_nan=True)


def test_non_finite_logits():
    rows = [
        [-INF, 1.0, -INF, 0.5],  # -inf is never preferred to a finite logit
        [NAN, 0.0, 1.0, 2.0],  # NaN ranks as -inf
        [-INF, NAN, -INF, 2.0],  # NaN and -inf tie: the lower index fills the slot, weight 0
        [NAN, -INF, NAN, 2.0],  # ... here a NaN, which makes the softmax over the chosen NaN
        [INF, 0.0, 1.0, 2.0],  # +inf ranks first; softmax over a +inf is NaN
        [0.0, INF, INF, 1.0],  # +inf ties go to the lower index
        [-INF, -INF, -INF, -INF],  # softmax over k -inf is NaN
    ]
    e = math.exp(1.0)
    assert_routed(
        mk.router_topk(torch.tensor(rows), 2),
        [[1, 3], [3, 2], [3, 0], [3, 0], [0, 3], [1, 2], [0, 1]],
        [[e**0.5 / (e**0.5 + 1), 1 / (e**0.5 + 1)], [e / (e + 1), 1 / (e + 1)], [1.0, 0.0], [NAN, NAN],
         [NAN, NAN], [NAN, NAN], [NAN, NAN]],
    )
    assert_routed(mk.router_topk(torch.tensor([[INF, 0.0, 1.0]]), 1), [[0]], [[NAN]])
    assert_routed(mk.router_topk(torch.full((1, 4), NAN), 2), [[0, 1]], [[NAN, NAN]])


def test_non_finite_logits_pre_softmax():
    # A NaN or +inf anywhere, or a row of only -inf: the softmax over E is NaN everywhere.
    rows = [[NAN, 0.0, 1.0, 2.0], [0.0, 1.0, INF, 2.0], [-INF] * 4, [-INF, -INF, 1.0, 2.0], [-INF, 2.0, -INF, -INF]]
    e = math.exp(1.0)
    assert_routed(
        mk.router_topk(torch.tensor(rows), 3, pre_softmax=True),
        [[0, 1, 2], [0, 1, 2], [0, 1, 2], [3, 2, 0], [1, 0, 2]],
        [[NAN] * 3, [NAN] * 3, [NAN] * 3, [e / (1 + e), 1 / (1 + e), 0.0], [1.0, 0.0, 0.0]],
    )


ACTIVATION_ROWS = [
    [NAN, 0.0, 1.0, 2.0],
    [INF, 0.0, 1.0, 2.0],
    [INF, INF, 1.0, 2.0],
    [-INF, -INF, -INF, 1.0],  # -inf is not masked: score 0, weight 0
    [NAN, NAN, NAN, 1.0],
    [-INF] * 4,
    [NAN] * 4,
]
ACTIVATION_INDICES = [[3, 2], [0, 3], [0, 1], [3, 0], [3, 0], [0, 1], [0, 1]]


def test_non_finite_logits_sigmoid():
    # s(NaN) = NaN, s(+inf) = 1, s(-inf) = 0.
    raw = [[sig(2), sig(1)], [1.0, sig(2)], [1.0, 1.0], [sig(1), 0.0], [sig(1), NAN], [0.0, 0.0], [NAN, NAN]]
    out = mk.router_topk(torch.tensor(ACTIVATION_ROWS), 2, score="sigmoid", normalize=False)
    assert_routed(out, ACTIVATION_INDICES, raw)
    normalized = [[a / (a + b + 1e-20), b / (a + b + 1e-20)] for a, b in raw]  # NaN if either is
    assert normalized[3] == [1.0, 0.0] and normalized[5] == [0.0, 0.0]
    out = mk.router_topk(torch.tensor(ACTIVATION_ROWS), 2, score="sigmoid", normalize=True)
    assert_routed(out, ACTIVATION_INDICES, normalized)


def test_non_finite_logits_sqrtsoftplus():
    # s(NaN) = NaN, s(+inf) = +inf, s(-inf) = 0; normalising a +inf gives inf / inf = NaN, the others 0.
    raw = [[ssp(2), ssp(1)], [INF, ssp(2)], [INF, INF], [ssp(1), 0.0], [ssp(1), NAN], [0.0, 0.0], [NAN, NAN]]
    out = mk.router_topk(torch.tensor(ACTIVATION_ROWS), 2, score="sqrtsoftplus", normalize=False, scaling_factor=2.0)
    assert_routed(out, ACTIVATION_INDICES, [[2 * v for v in r] for r in raw])
    out = mk.router_topk(torch.tensor(ACTIVATION_ROWS), 2, score="sqrtsoftplus", normalize=True)
    n0 = ssp(2) + ssp(1)
    assert_routed(out, ACTIVATION_INDICES,
                  [[ssp(2) / n0, ssp(1) / n0], [NAN, 0.0], [NAN, NAN], [1.0, 0.0], [NAN, NAN], [0.0, 0.0], [NAN, NAN]])


def test_non_finite_logits_expert_bias():
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0])
    rows = torch.tensor([
        [-INF, 0.0, 1.0, 2.0],  # -inf scores 0 + 5: chosen first, weight 0
        [NAN, 0.0, 1.0, 2.0],  # NaN ranks last whatever its bias
        [INF, 0.0, 1.0, 2.0],
    ])
    out = mk.router_topk(rows, 2, score="sigmoid", expert_bias=bias, normalize=False)
    assert_routed(out, [[0, 3], [3, 2], [0, 3]], [[0.0, sig(2)], [sig(2), sig(1)], [1.0, sig(2)]])
    out = mk.router_topk(rows, 2, score="sigmoid", expert_bias=bias)
    n = sig(2) + sig(1)
    assert_routed(out, [[0, 3], [3, 2], [0, 3]],
                  [[0.0, 1.0], [sig(2) / n, sig(1) / n], [1 / (1 + sig(2)), sig(2) / (1 + sig(2))]])
    # sigmoid(+inf) = 1 competes with 1 + bias; sqrtsoftplus(+inf) = +inf beats any finite bias.
    bias = torch.tensor([-30.0, 0.0, 0.0, 0.5])
    out = mk.router_topk(rows[2:], 2, score="sigmoid", expert_bias=bias, normalize=False)
    assert_routed(out, [[3, 2]], [[sig(2), sig(1)]])
    out = mk.router_topk(rows[2:], 2, score="sqrtsoftplus", expert_bias=bias)
    assert_routed(out, [[0, 3]], [[NAN, 0.0]])
    out = mk.router_topk(rows[:1], 2, score="sqrtsoftplus", expert_bias=torch.tensor([5.0, 0.0, 0.0, 0.0]))
    assert_routed(out, [[0, 3]], [[0.0, 1.0]])


def test_non_finite_logits_group_limited():
    def route(row, k, G, g, gst, score="sigmoid", **kw):
        return mk.router_topk(torch.tensor([row]), k, score=score, num_groups=G, group_topk=g, group_score_topk=gst,
                              normalize=False, **kw)

    # Four groups of two. A group's score counts NaN as -inf: with one score per group a NaN beside a
    # finite expert is harmless; with two, the NaN puts the group at -inf and drops it.
    row = [0.1, NAN, 0.2, 0.3, 3.0, NAN, -1.0, -2.0]
    assert_routed(route(row, 2, 4, 2, 1), [[4, 3]], [[sig(3), sig(0.3)]])
    assert_routed(route(row, 2, 4, 2, 2), [[3, 2]], [[sig(0.3), sig(0.2)]])
    # The bias of a NaN expert does not lift its group.
    assert_routed(route([0.1, NAN, 0.2, 0.3], 2, 2, 1, 1, expert_bias=torch.tensor([0.0, 10.0, 0.0, 0.0])),
                  [[3, 2]], [[sig(0.3), sig(0.2)]])
    # Too few experts above -inf in the kept group: the next slot goes to the lowest-index expert ranked
    # -inf, here expert 0 of the dropped group (its weight from its own logit).
    assert_routed(route([0.1, 0.2, 5.0, NAN], 2, 2, 1, 1), [[2, 0]], [[sig(5), sig(0.1)]])
    # Groups at -inf tie: the lower group is kept.
    assert_routed(route([NAN, NAN, NAN, NAN], 2, 2, 1, 1), [[0, 1]], [[NAN, NAN]])
    # +inf + -inf in a group score is NaN, ranked -inf; +inf alone makes the group +inf.
    e = math.exp(0.1)
    assert_routed(route([0.1, 0.2, INF, NAN], 2, 2, 1, 2, score="softmax"), [[1, 0]], [[e / (1 + e), 1 / (1 + e)]])
    # With one score per group, group 1 is +inf and kept; its NaN expert ties expert 0 of the dropped group.
    assert_routed(route([0.1, 0.2, INF, NAN], 2, 2, 1, 1, score="softmax"), [[2, 0]], [[NAN, NAN]])
    assert_routed(route([0.1, 0.2, INF, NAN], 2, 2, 1, 2, score="sqrtsoftplus"), [[1, 0]], [[ssp(0.2), ssp(0.1)]])
    assert_routed(route([0.1, 0.2, INF, 0.0], 2, 2, 1, 2, score="sqrtsoftplus"), [[2, 3]], [[INF, ssp(0.0)]])


def loop_router_non_finite(logits, k, score, pre_softmax, G, g, gst, bias, normalize, scale):
    """The rules of router_topk's docstring, one token at a time in Python floats (IEEE fp64)."""
    def key(v):  # the rank of a score: NaN as -inf
        return -math.inf if math.isnan(v) else v

    out = []
    for row in logits.tolist():
        E, size = len(row), len(row) // G
        if score == "softmax":
            if pre_softmax:
                m = max(row, key=key)
                ex = [math.exp(x - m) for x in row]
                probs = [v / sum(ex) for v in ex]
                sel = [v + b for v, b in zip(probs, bias)] if bias is not None else probs
            else:
                sel = list(row)
        else:
            act = sig if score == "sigmoid" else ssp
            s = [act(x) for x in row]
            sel = [v + b for v, b in zip(s, bias)] if bias is not None else s
        if G > 1:
            gscores = []
            for i in range(G):
                top = sorted((key(v) for v in sel[i * size:(i + 1) * size]), reverse=True)[:gst]
                total = top[0]
                for v in top[1:]:
                    total += v
                gscores.append(key(total))
            kept = sorted(range(G), key=lambda i: (-gscores[i], i))[:g]
            sel = [v if e // size in kept else -math.inf for e, v in enumerate(sel)]
        chosen = sorted(range(E), key=lambda e: (-key(sel[e]), e))[:k]
        if score == "softmax" and pre_softmax and not normalize:
            ws = [probs[e] for e in chosen]
        elif score == "softmax":
            xs = [row[e] for e in chosen]
            m = max(xs, key=key)
            ex = [math.exp(x - m) for x in xs]
            ws = [v / sum(ex) for v in ex]
        else:
            ws = [act(row[e]) for e in chosen]
            if normalize:
                total = sum(ws) + 1e-20
                ws = [v / total for v in ws]
        out.append((chosen, [v * scale for v in ws]))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(score="softmax"),
        dict(score="softmax", pre_softmax=True),
        dict(score="sigmoid"),
        dict(score="sigmoid", normalize=False, with_bias=True),
        dict(score="sqrtsoftplus", scaling_factor=2.5),
        dict(score="sqrtsoftplus", normalize=False, with_bias=True),
        dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, with_bias=True),
        dict(score="sigmoid", num_groups=4, group_topk=2, group_score_topk=1),
        dict(score="sqrtsoftplus", num_groups=4, group_topk=2, group_score_topk=3, with_bias=True),
        dict(score="softmax", num_groups=4, group_topk=2),
        dict(score="softmax", pre_softmax=True, num_groups=4, group_topk=1),
        dict(score="softmax", pre_softmax=True, normalize=True, with_bias=True),
        dict(score="softmax", pre_softmax=True, num_groups=4, group_topk=2, with_bias=True),
    ],
)
def test_non_finite_logits_match_loop(kw):
    kw = dict(kw)
    gen = torch.Generator().manual_seed(5)
    T, E, k = 300, 16, 4
    logits = torch.randn(T, E, generator=gen)
    u = torch.rand(T, E, generator=gen)
    density = torch.rand(T, 1, generator=gen)  # from a few non-finite logits per row to nearly all
    logits[u < 0.3 * density] = NAN
    logits[(u >= 0.3 * density) & (u < 0.45 * density)] = INF
    logits[(u >= 0.45 * density) & (u < 0.9 * density)] = -INF
    logits[-10:, 3:] = NAN  # NaN experts must fill a slot, whatever the score function
    bias = torch.randn(E, generator=gen) * 0.5 if kw.pop("with_bias", False) else None
    w, idx = mk.router_topk(logits, k, expert_bias=bias, **kw)
    G, g, gst, scale, norm = resolve_topk_options(k, kw.get("num_groups"), kw.get("group_topk"),
                                                   kw.get("group_score_topk"), kw.get("scaling_factor"),
                                                   kw.get("normalize"), score=kw["score"])
    expected = loop_router_non_finite(logits, k, kw["score"], kw.get("pre_softmax", False), G, g, gst,
                                      None if bias is None else bias.tolist(), norm, scale)
    assert idx.tolist() == [chosen for chosen, _ in expected]
    torch.testing.assert_close(w, torch.tensor([ws for _, ws in expected]), rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isnan(w).any() and torch.isfinite(w).any()


# sqrt-softplus logits at which softplus underflows to 0 in fp32 (about -104 and below) or is 0 (-inf, a
# masked expert): s = 0 there, and the textbook ds/dx = sigmoid(x) / (2 s) is 0 / 0.
UNDERFLOW_ROWS = [[1.0, -INF, -104.0, 0.5, -120.0, -60.0, 2.0, -1000.0],
                  [-INF, -0.5, -200.0, -104.5, 3.0, -INF, -30.0, 0.0]]


def sqrtsoftplus_grad64(logits, loss_of_s):
    """d loss / d logits in fp64 autograd through sqrt(softplus(x)), logits below -700 taken at -700
    (their true gradient, about sqrt(e^x) / 2, is 0 in fp32 from there down)."""
    x = logits.detach().double().clamp(min=-700.0).requires_grad_()
    loss_of_s(torch.sqrt(torch.nn.functional.softplus(x))).backward()
    return x.grad


def test_sqrtsoftplus_gradient_finite_at_underflow_and_minus_inf_aux_loss():
    # router_aux_scores -> aux_loss: every expert's score is differentiated, the masked ones included.
    from moe_kernels.ops.router_losses import aux_loss_reference

    logits = torch.tensor(UNDERFLOW_ROWS, requires_grad=True)
    scores, idx = mk.router_aux_scores(logits, 2, score="sqrtsoftplus")
    counts = mk.tokens_per_expert(idx, 8)
    mk.aux_loss(scores, counts, 2, 0.1).backward()
    assert bool(torch.isfinite(logits.grad).all()), logits.grad
    assert bool((logits.grad[torch.isinf(logits)] == 0).all())
    expected = sqrtsoftplus_grad64(
        logits, lambda s: aux_loss_reference(s / (s.sum(-1, keepdim=True) + 1e-20), counts, 2, 0.1))
    torch.testing.assert_close(logits.grad, expected.float(), rtol=1e-5, atol=1e-37)
    assert 0 < abs(float(logits.grad[0, 2])) < 1e-20  # -104: about sqrt(e^-104) / 2 times the loss's slope


@pytest.mark.parametrize("normalize", [True, False])
def test_sqrtsoftplus_gradient_finite_at_underflow_and_minus_inf_topk(normalize):
    # k = E: the -inf and underflowing experts are chosen (weight 0), and their gradient is about 0.
    logits = torch.tensor(UNDERFLOW_ROWS, requires_grad=True)
    g = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    w, idx = mk.router_topk(logits, 8, score="sqrtsoftplus", normalize=normalize, scaling_factor=1.5)
    (w * g).sum().backward()
    assert bool(torch.isfinite(logits.grad).all()), logits.grad
    assert bool((logits.grad[torch.isinf(logits)] == 0).all())

    def loss(s):
        chosen = s.gather(1, idx.long())
        return ((chosen / (chosen.sum(-1, keepdim=True) + 1e-20) if normalize else chosen) * 1.5 * g).sum()

    torch.testing.assert_close(logits.grad, sqrtsoftplus_grad64(logits, loss).float(), rtol=1e-5, atol=1e-37)
