"""Router ops: GPU tier, CUDA kernels against the CPU references on fresh random logits."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.router import (
    router_aux_scores_bwd_reference,
    router_aux_scores_reference,
    router_group_scores,
    router_selection_scores,
    router_topk_bwd_reference,
    router_weights_reference,
)
from moe_kernels.testing import FP32_EPS, assert_close_to_fp64, assert_exact

pytestmark = pytest.mark.gpu

CONFIGS = {
    "softmax": dict(score="softmax"),
    "softmax_pre": dict(score="softmax", pre_softmax=True),
    "sigmoid": dict(score="sigmoid"),
    "deepseek": dict(score="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, bias=True),
    "sqrtsoftplus": dict(score="sqrtsoftplus", bias=True, scaling_factor=1.5),
    "sigmoid_unnormalized": dict(score="sigmoid", normalize=False),
}
SHAPES = [(0, 8, 2), (1, 8, 1), (1, 1024, 8), (2048, 8, 8), (2048, 64, 4), (2048, 128, 8), (2048, 1024, 32),
          (16384, 256, 8)]


def _cases():
    for name, cfg in CONFIGS.items():
        for T, E, k in SHAPES:
            if "num_groups" in cfg and (E < 16 or k > cfg["group_topk"] * E // cfg["num_groups"]):
                continue
            yield name, T, E, k


def assert_same_choice(idx, ref_idx, sel, cfg, what):
    """Exact, except where the differing choices are near-ties of the fp32 selection (or group) scores."""
    idx, ref_idx = idx.long(), ref_idx.long()
    rows = torch.nonzero((idx != ref_idx).any(1)).flatten().tolist()
    assert len(rows) <= max(2, idx.shape[0] // 1000), f"{what}: {len(rows)} tokens chose different experts"
    tol = 8 * FP32_EPS
    for t in rows:
        a, b = sel[t, idx[t]].double(), sel[t, ref_idx[t]].double()
        if torch.allclose(a, b, rtol=tol, atol=0):
            continue
        G = cfg.get("num_groups")
        assert G, f"{what}: token {t} chose {idx[t].tolist()} vs {ref_idx[t].tolist()}, scores {a} vs {b}"
        k = idx.shape[1]
        gst = cfg.get("group_score_topk") or max(1, k // cfg["group_topk"])  # the op's default
        gs = router_group_scores(sel[t : t + 1], G, gst)[0].double()
        size = sel.shape[1] // G
        ga, gb = set((idx[t] // size).tolist()), set((ref_idx[t] // size).tolist())
        va, vb = sorted(gs[list(ga - gb)].tolist()), sorted(gs[list(gb - ga)].tolist())
        assert torch.allclose(torch.tensor(va), torch.tensor(vb), rtol=tol, atol=0), f"{what}: token {t} groups"


def _inputs(T, E, dtype, cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.05 if cfg.get("bias") else None
    return logits, bias


def _kwargs(cfg, bias):
    kw = {key: v for key, v in cfg.items() if key != "bias"}
    kw["expert_bias"] = bias
    return kw


@pytest.mark.parametrize("name,T,E,k", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk_matches_reference(cuda, name, T, E, k, dtype):
    cfg = CONFIGS[name]
    logits, bias = _inputs(T, E, dtype, cfg, seed=T + E + k)
    kw = _kwargs(cfg, bias)
    ref_w, ref_idx = mk.router_topk(logits, k, **kw)  # CPU reference
    x = logits.to(cuda, copy=True).requires_grad_()
    w, idx = mk.router_topk(x, k, **{**kw, "expert_bias": None if bias is None else bias.to(cuda)})
    assert w.dtype == torch.float32 and idx.dtype == torch.int32 and w.shape == (T, k)
    sel = router_selection_scores(logits, cfg["score"], cfg.get("pre_softmax", False), bias)
    assert_same_choice(idx.cpu(), ref_idx, sel, cfg, "router_topk indices")

    # Weights and gradients for the experts the kernel chose, against fp64 (policy: <= 2x torch fp32 error).
    chosen = idx.cpu()
    norm = kw.get("normalize", k > 1)
    scale = kw.get("scaling_factor", 1.0)
    args = (cfg["score"], kw.get("pre_softmax", False), norm, scale)
    w32 = router_weights_reference(logits.float(), chosen, *args)
    w64 = router_weights_reference(logits.double(), chosen, *args)
    assert_close_to_fp64(w.detach(), w32, w64, "weights")
    g = torch.randn(T, k)
    w.backward(g.to(cuda))
    d32 = router_topk_bwd_reference(g, logits.float(), chosen, *args)
    d64 = router_topk_bwd_reference(g.double(), logits.double(), chosen, *args)
    assert x.grad.dtype == dtype
    if dtype == torch.float32:
        assert_close_to_fp64(x.grad, d32, d64, "grad logits")
    else:  # the gradient is rounded to bf16 like the logits: compare after the same rounding
        assert_close_to_fp64(x.grad.float(), d32.to(dtype).float(), d64, "grad logits (bf16)", floor=1e-3)


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (1, 64, 8), (2048, 256, 8), (4096, 1024, 32)])
def test_aux_scores_match_reference(cuda, score, T, E, k):
    logits, _ = _inputs(T, E, torch.float32, {}, seed=E + k)
    ref_scores, ref_idx = router_aux_scores_reference(logits, k, score)
    x = logits.to(cuda, copy=True).requires_grad_()
    scores, idx = mk.router_aux_scores(x, k, score=score)
    ref64, _ = router_aux_scores_reference(logits.double(), k, score)
    assert_close_to_fp64(scores.detach(), ref_scores, ref64, "aux scores")
    assert_same_choice(idx.cpu(), ref_idx, ref_scores, {}, "aux indices")
    g = torch.randn(T, E)
    scores.backward(g.to(cuda))
    d32 = router_aux_scores_bwd_reference(g, logits, score)
    d64 = router_aux_scores_bwd_reference(g.double(), logits.double(), score)
    assert_close_to_fp64(x.grad, d32, d64, "aux scores grad")


def test_non_finite_logits(cuda):
    logits = torch.randn(64, 32)
    logits[0, :5] = float("-inf")
    logits[1, 3] = float("nan")
    logits[2] = float("nan")
    logits[3, 7] = float("inf")
    for kw in (dict(score="softmax"), dict(score="sigmoid"), dict(score="softmax", pre_softmax=True)):
        ref_w, ref_idx = mk.router_topk(logits, 4, **kw)
        w, idx = mk.router_topk(logits.to(cuda), 4, **kw)
        assert_exact(idx.cpu(), ref_idx, f"indices {kw}")
        assert torch.equal(torch.isnan(w.cpu()), torch.isnan(ref_w)), f"NaN pattern {kw}"
        finite = ~torch.isnan(ref_w)
        torch.testing.assert_close(w.cpu()[finite], ref_w[finite], rtol=1e-5, atol=1e-6)


def test_deterministic(cuda):
    logits = torch.randn(4096, 256, device=cuda, requires_grad=True)
    bias = torch.randn(256, device=cuda) * 0.05
    g = torch.randn(4096, 8, device=cuda)
    runs = []
    for _ in range(3):
        logits.grad = None
        w, idx = mk.router_topk(logits, 8, score="sigmoid", num_groups=8, group_topk=4, expert_bias=bias,
                                scaling_factor=2.5)
        w.backward(g)
        runs.append((w.detach().clone(), idx.clone(), logits.grad.clone()))
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)


def test_bad_input_on_gpu(cuda):
    if cuda.type != "cuda":
        pytest.skip("kernel limits apply to the CUDA path")
    with pytest.raises(TypeError, match="fp64"):
        mk.router_topk(torch.randn(4, 8, device=cuda, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="experts"):
        mk.router_topk(torch.randn(4, 8192, device=cuda), 2)
    with pytest.raises(ValueError, match="`k`"):
        mk.router_topk(torch.randn(4, 64, device=cuda), 33)
    with pytest.raises(ValueError, match="num_groups"):
        mk.router_topk(torch.randn(4, 128, device=cuda), 2, num_groups=64, group_topk=2, score="sigmoid")
    with pytest.raises(ValueError, match="expert_bias"):
        mk.router_topk(torch.randn(4, 8, device=cuda), 2, score="sigmoid", expert_bias=torch.zeros(8))


def test_losses_on_gpu(cuda):
    logits = torch.randn(512, 64)
    scores, idx = mk.router_aux_scores(logits, 4)
    counts = mk.tokens_per_expert(idx, 64)
    gs, gi = scores.to(cuda), idx.to(cuda)
    torch.testing.assert_close(mk.aux_loss(gs, counts.to(cuda), 4, 0.01).cpu(), mk.aux_loss(scores, counts, 4, 0.01))
    torch.testing.assert_close(mk.seq_aux_loss(gs, gi, 0.01, seq_len=128).cpu(),
                               mk.seq_aux_loss(scores, idx, 0.01, seq_len=128))
    torch.testing.assert_close(mk.z_loss(logits.to(cuda), 1e-3).cpu(), mk.z_loss(logits, 1e-3))
    w, i = mk.router_topk(logits, 4)
    cw, ci = mk.apply_capacity(w.to(cuda), i.to(cuda), 64, 1.0)
    rw, ri = mk.apply_capacity(w, i, 64, 1.0)
    assert_exact(ci.cpu(), ri, "capacity indices")
    assert_exact(cw.cpu(), rw, "capacity weights")
