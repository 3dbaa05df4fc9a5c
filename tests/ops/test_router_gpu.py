"""Router ops: GPU tier, CUDA kernels against the CPU references on fresh random logits."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.router import (
    resolve_topk_options,
    router_aux_scores_bwd_reference,
    router_aux_scores_reference,
    router_group_scores,
    router_selection_scores,
    router_topk_bwd_reference,
    router_weights_reference,
)
from moe_kernels._ext import reference_ops
from moe_kernels.testing import FP32_EPS, assert_close_to_fp64, assert_exact
from tests.emulation import EMULATED, skip_if_too_large
from tests.ops.test_router import router_bwd_bad_inputs

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**20  # logits per case: a warp per token, about twenty collectives each

CONFIGS = {
    "softmax": dict(score="softmax"),
    "softmax_pre": dict(score="softmax", pre_softmax=True),
    "sigmoid": dict(score="sigmoid"),
    "deepseek": dict(score="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, bias=True),
    "sqrtsoftplus": dict(score="sqrtsoftplus", bias=True, scaling_factor=1.5),
    "sigmoid_unnormalized": dict(score="sigmoid", normalize=False),
    # ERNIE-4.5: selection by probability + bias, the chosen probabilities renormalised
    "softmax_pre_bias": dict(score="softmax", pre_softmax=True, normalize=True, bias=True),
    "softmax_pre_bias_groups": dict(score="softmax", pre_softmax=True, num_groups=8, group_topk=4, bias=True),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # the logits dtypes the kernels take
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# E <= 16 without a group limit takes the thread-per-token kernels (8 slots up to E = 8, 16 past it); up to E = 256
# the forward holds a row in registers (E = 256 with 8 groups: a group per register, scored without rescans), past
# it in shared memory.
SHAPES = [(0, 8, 2), (1, 8, 1), (1, 1024, 8), (777, 5, 3), (2048, 8, 2), (2048, 8, 8), (999, 16, 4), (300, 11, 11),
          (2048, 64, 4), (2048, 128, 8), (300, 256, 8), (64, 1024, 32), (2048, 1024, 32), (16384, 256, 8)]


def _cases():
    for name, cfg in CONFIGS.items():
        for T, E, k in SHAPES:
            if "num_groups" in cfg and E < 16:
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


def assert_grad_close(grad, d32, d64, dtype, what):
    """Gradient w.r.t. logits against fp64: <= 2x torch's fp32 error. A bf16/fp16 gradient is the fp32
    one rounded to the logits dtype, so the baseline gets the same rounding, and the floor (1e-3, about
    one fp16 step at magnitude 1) covers an element whose fp32 values round to neighbouring values."""
    assert grad.dtype == dtype
    if dtype == torch.float32:
        assert_close_to_fp64(grad, d32, d64, what)
    else:
        assert_close_to_fp64(grad.float(), d32.to(dtype).float(), d64, f"{what} ({dtype})", floor=1e-3)


@pytest.mark.parametrize("name,T,E,k", list(_cases()))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_router_topk_matches_reference(cuda, name, T, E, k, dtype):
    skip_if_too_large(T * E, EMULATION_BUDGET, "logits")
    cfg = CONFIGS[name]
    logits, bias = _inputs(T, E, dtype, cfg, seed=T + E + k)
    kw = _kwargs(cfg, bias)
    with reference_ops():
        ref_w, ref_idx = mk.router_topk(logits, k, **kw)
    x = logits.to(cuda, copy=True).requires_grad_()
    w, idx = mk.router_topk(x, k, **{**kw, "expert_bias": None if bias is None else bias.to(cuda)})
    assert w.dtype == torch.float32 and idx.dtype == torch.int32 and w.shape == (T, k)
    sel = router_selection_scores(logits, cfg["score"], cfg.get("pre_softmax", False), bias)
    assert_same_choice(idx.cpu(), ref_idx, sel, cfg, "router_topk indices")

    # Weights and gradients for the experts the kernel chose, against fp64 (policy: <= 2x torch fp32 error).
    chosen = idx.cpu()
    norm = kw.get("normalize", k > 1 and cfg["score"] != "softmax")  # router_topk's default
    scale = kw.get("scaling_factor", 1.0)
    args = (cfg["score"], kw.get("pre_softmax", False), norm, scale)
    w32 = router_weights_reference(logits.float(), chosen, *args)
    w64 = router_weights_reference(logits.double(), chosen, *args)
    assert_close_to_fp64(w.detach(), w32, w64, "weights")
    g = torch.randn(T, k)
    w.backward(g.to(cuda))
    d32 = router_topk_bwd_reference(g, logits.float(), chosen, *args)
    d64 = router_topk_bwd_reference(g.double(), logits.double(), chosen, *args)
    assert_grad_close(x.grad, d32, d64, dtype, "grad logits")


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (1, 64, 8), (256, 256, 8), (64, 1024, 32), (2048, 256, 8), (4096, 1024, 32)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_aux_scores_match_reference(cuda, score, T, E, k, dtype):
    skip_if_too_large(T * E, EMULATION_BUDGET, "logits")
    logits, _ = _inputs(T, E, dtype, {}, seed=E + k)
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
    assert_grad_close(x.grad, d32, d64, dtype, "aux scores grad")


NON_FINITE_K = 4
NON_FINITE_CONFIGS = {  # E = 32: groups of 8
    "softmax": dict(score="softmax"),
    "softmax_pre": dict(score="softmax", pre_softmax=True),
    "sigmoid": dict(score="sigmoid"),
    "sigmoid_unnormalized": dict(score="sigmoid", normalize=False),
    "sqrtsoftplus": dict(score="sqrtsoftplus", scaling_factor=1.5),
    "sqrtsoftplus_unnormalized": dict(score="sqrtsoftplus", normalize=False),
    "sigmoid_bias": dict(score="sigmoid", bias=True),
    "sqrtsoftplus_bias": dict(score="sqrtsoftplus", normalize=False, bias=True),
    "deepseek": dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True),
    "groups_score_top1": dict(score="sigmoid", num_groups=4, group_topk=2, group_score_topk=1),
    "sqrtsoftplus_groups": dict(score="sqrtsoftplus", num_groups=4, group_topk=2, bias=True),
    "softmax_groups": dict(score="softmax", num_groups=4, group_topk=2),
    "softmax_pre_groups": dict(score="softmax", pre_softmax=True, num_groups=4, group_topk=1),
    "softmax_pre_bias": dict(score="softmax", pre_softmax=True, normalize=True, bias=True),
}


def _non_finite_inputs(dtype, with_bias):
    """[64, 32] logits: rows 0-15 hand-placed NaN/+inf/-inf patterns, the rest sprinkled at random.

    The finite logits are a per-row permutation of 32 values at least 0.12 apart whose pairwise sums
    differ too (a quadratic term), and the bias takes values 0, 4, 8, so selection and group scores are
    exactly tied or far apart and the comparison of indices can be bit-exact; `_assert_no_near_ties`
    checks that on the drawn inputs."""
    nan, inf = float("nan"), float("inf")
    gen = torch.Generator().manual_seed(11)
    T, E = 64, 32
    m = torch.arange(E) - 16.0
    grid = 0.25 * m + 0.004 * m**2 + 0.1
    logits = torch.stack([grid[torch.randperm(E, generator=gen)] for _ in range(T)])
    logits[0, :5] = -inf
    logits[1, 3] = nan
    logits[2] = nan
    logits[3, 7] = inf
    logits[4, [2, 9]] = inf
    logits[5] = -inf
    logits[6, :3] = torch.tensor([nan, inf, -inf])
    logits[7, 2:] = nan  # two non-NaN experts: NaN experts fill the other slots
    logits[8, 8:16] = nan  # a whole group NaN
    logits[9, 9:16] = nan  # the group holding the best logit has one non-NaN expert
    logits[9, 8] = 5.0
    logits[10, 16:24] = nan  # +inf and NaN in one group
    logits[10, 16] = inf
    logits[11, 24] = inf  # +inf in a group of finite logits
    logits[12, [3, 11]] = inf  # two groups at +inf: the lower group wins the tie
    logits[13, 8:] = nan  # only group 0 has non-NaN experts
    logits[14, 1::2] = -inf
    logits[15, 3:] = -inf  # three finite logits: with pre_softmax a probability-0 expert fills the last slot
    u = torch.rand(T - 16, E, generator=gen)
    rest = logits[16:]
    rest[u < 0.05] = nan
    rest[(u >= 0.05) & (u < 0.1)] = inf
    rest[(u >= 0.1) & (u < 0.2)] = -inf
    bias = torch.randint(0, 3, (E,), generator=gen).float() * 4 if with_bias else None
    return logits.to(dtype), bias


def _assert_no_near_ties(scores, what, rel=1e-5, top=None):
    """The finite scores of each row (computed in fp64) are equal or differ by more than `rel`; with `top`, only
    the `top` largest distinct ones (a top-k without groups depends on the order of its k + 1 best alone)."""
    for t, row in enumerate(scores.double()):
        v = torch.unique(row[torch.isfinite(row)])  # sorted
        if top is not None:
            v = v[-top:]
        if v.numel() > 1:
            gap = (v[1:] - v[:-1]) / torch.maximum(v[1:].abs(), v[:-1].abs())
            assert bool((gap > rel).all()), f"{what}: row {t} has near-tied scores; the test input needs another draw"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(NON_FINITE_CONFIGS))
def test_non_finite_logits(cuda, name, dtype):
    """NaN/+inf/-inf logits: the same experts in the same order as the reference, bit for bit, and the
    same weights, NaN and +-inf in the same slots (router_topk's docstring gives the rules)."""
    cfg = NON_FINITE_CONFIGS[name]
    k, score, pre = NON_FINITE_K, cfg["score"], cfg.get("pre_softmax", False)
    logits, bias = _non_finite_inputs(dtype, cfg.get("bias", False))
    kw = _kwargs(cfg, bias)
    sel = router_selection_scores(logits.double(), score, pre, None if bias is None else bias.double())
    # probabilities + a bias of 0, 4 or 8 crowd the small probabilities together: there only the k + 1 best count
    _assert_no_near_ties(sel, f"{name} selection scores", top=k + 1 if "num_groups" not in cfg else None)
    if "num_groups" in cfg:
        G, _, gst, _, _ = resolve_topk_options(k, cfg["num_groups"], cfg["group_topk"], cfg.get("group_score_topk"),
                                               None, None, score=score)
        _assert_no_near_ties(router_group_scores(sel, G, gst), f"{name} group scores")

    with reference_ops():
        ref_w, ref_idx = mk.router_topk(logits, k, **kw)
    w, idx = mk.router_topk(logits.to(cuda), k, **{**kw, "expert_bias": None if bias is None else bias.to(cuda)})
    assert_exact(idx.cpu(), ref_idx, f"indices {name} {dtype}")
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6, equal_nan=True,
                               msg=lambda m: f"weights {name} {dtype}: {m}")
    assert not torch.isfinite(ref_w).all(), f"{name}: the inputs should reach non-finite weights"


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if "num_groups" not in c])
@pytest.mark.parametrize("E,k", [(2, 1), (5, 3), (8, 2), (9, 9), (16, 4)])
def test_few_experts_match_the_warp_kernels(cuda, name, E, k):
    # router_topk's thread-per-token kernels (E <= 16) against router_fused's warp per token, which shares the
    # warp kernels' code: the same picks, weights and logits gradient bit for bit (the thread replays the
    # warp's butterfly sums), on ties and non-finite logits too.
    cfg = CONFIGS[name]
    T = 513
    logits, bias = _inputs(T, E, torch.float32, cfg, seed=E * 31 + k)
    logits[::7] = logits[::7].round()  # ties
    logits[5, 0], logits[6, :] = float("nan"), float("-inf")
    kw = _kwargs(cfg, None if bias is None else bias.to(cuda))
    kw.setdefault("normalize", k > 1 and cfg["score"] != "softmax")  # router_topk's default; router_fused's resolved
    g = torch.randn(T, k).to(cuda)
    x = logits.to(cuda, copy=True).requires_grad_()
    w, idx = mk.router_topk(x, k, **kw)
    w.backward(g)
    y = logits.to(cuda, copy=True).requires_grad_()
    out = mk.router_fused(y, k, **kw)
    out[0].backward(g)
    assert_exact(idx, out[1], "indices")
    assert_exact(w.detach(), out[0].detach(), "weights")
    assert_exact(x.grad, y.grad, "logits gradient")


def test_deterministic(cuda):
    skip_if_too_large(4096 * 256, EMULATION_BUDGET, "logits")
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
    if cuda.type != "cuda" and not EMULATED:
        pytest.skip("kernel limits apply to the CUDA path (the references take any size)")
    with pytest.raises(TypeError, match="fp64"):
        mk.router_topk(torch.randn(4, 8, device=cuda, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="experts"):
        mk.router_topk(torch.randn(4, 8192, device=cuda), 2)
    with pytest.raises(ValueError, match="`k`"):
        mk.router_topk(torch.randn(4, 64, device=cuda), 33)
    with pytest.raises(ValueError, match="num_groups"):
        mk.router_topk(torch.randn(4, 128, device=cuda), 2, num_groups=64, group_topk=2, score="sigmoid")
    if cuda.type != "cuda":
        return  # device mismatches need a physical device
    with pytest.raises(ValueError, match="expert_bias"):
        mk.router_topk(torch.randn(4, 8, device=cuda), 2, score="sigmoid", expert_bias=torch.zeros(8))


def test_backward_ops_check_inputs_on_gpu(cuda):
    """The backward helper ops, called directly with mismatched inputs, raise before any kernel runs."""
    for op, args, exc, match in router_bwd_bad_inputs(cuda):
        with pytest.raises(exc, match=match):
            op(*args)
    if cuda.type != "cuda":
        return
    logits = torch.randn(6, 8, device=cuda)
    idx = torch.zeros(6, 2, dtype=torch.int32, device=cuda)
    with pytest.raises(ValueError, match="grad_weights"):  # on another device than logits
        torch.ops.moe_kernels.router_topk_bwd(torch.randn(6, 2), logits, idx, "softmax", False, False, 1.0)
    with pytest.raises(ValueError, match="indices"):
        torch.ops.moe_kernels.router_topk_bwd(torch.randn(6, 2, device=cuda), logits, idx.cpu(), "softmax", False,
                                              False, 1.0)
    with pytest.raises(ValueError, match="grad_scores"):
        torch.ops.moe_kernels.router_aux_scores_bwd(torch.randn(6, 8), logits, "softmax")


def test_losses_on_gpu(cuda):
    logits = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    with reference_ops():  # expected values
        scores, idx = mk.router_aux_scores(logits, 4)
        counts = mk.tokens_per_expert(idx, 64)
        want = (mk.aux_loss(scores, counts, 4, 0.01), mk.seq_aux_loss(scores, idx, 0.01, seq_len=128),
                mk.z_loss(logits, 1e-3))
        w, i = mk.router_topk(logits, 4)
        rw, ri = mk.apply_capacity(w, i, 64, 1.0)
    gs, gi = scores.to(cuda), idx.to(cuda)
    torch.testing.assert_close(mk.aux_loss(gs, counts.to(cuda), 4, 0.01).cpu(), want[0])
    torch.testing.assert_close(mk.seq_aux_loss(gs, gi, 0.01, seq_len=128).cpu(), want[1])
    torch.testing.assert_close(mk.z_loss(logits.to(cuda), 1e-3).cpu(), want[2])
    cw, ci = mk.apply_capacity(w.to(cuda), i.to(cuda), 64, 1.0)
    assert_exact(ci.cpu(), ri, "capacity indices")
    assert_exact(cw.cpu(), rw, "capacity weights")


def test_launch_grid_fits_any_token_count(cuda):
    # ceil(T / W) blocks (W = 1 warp per block at E = 4096) would pass gridDim.x's 2^31 - 1 for huge T:
    # the grid is capped and the kernels stride over the tokens past it.
    from moe_kernels import _ext

    C = _ext.kernels("router_topk", torch.empty(1, device=cuda))
    if C is None:
        pytest.skip("launch geometry is the extension's")
    assert C.router_fwd_warps(4096) == 1 and C.router_fwd_warps(8) == 8
    assert 1 <= C.router_max_blocks <= 2**31 - 1
    for W in (C.router_fwd_warps(4096), C.router_fwd_warps(1024), C.router_bwd_warps):
        for T in (1, 4097, 2**31, 2**40, 2**62):
            assert C.router_blocks(T, W) == min(-(-T // W), C.router_max_blocks), f"T={T} W={W}"


@pytest.mark.parametrize("E,normalize", [(8, True), (32, False)])
def test_tokens_past_the_grid(cuda, E, normalize):
    # More tokens than one capped grid covers: each warp routes several, in the forward and backward of
    # router_topk and router_aux_scores. E = 8 takes the few-expert kernel; E = 32 the warp-per-token one,
    # whose next token overwrites the warp's shared row after the lanes read it (unnormalised sigmoid: no
    # collective between, only the __syncwarp). Expected: the references.
    from moe_kernels import _ext
    from moe_kernels.ops.router import router_selection_reference

    C = _ext.kernels("router_topk", torch.empty(1, device=cuda))
    if C is None:
        pytest.skip("needs the kernels")
    k = 2
    T = C.router_max_blocks * C.router_fwd_warps(E) + 37
    assert T > C.router_blocks(T, C.router_fwd_warps(E)) * C.router_fwd_warps(E)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(4))
    x = logits.to(cuda, copy=True).requires_grad_()
    w, idx = mk.router_topk(x, k, score="sigmoid", normalize=normalize)
    scores, aux_idx = mk.router_aux_scores(x, k, score="softmax")
    g, gs = torch.randn(T, k), torch.randn(T, E)
    torch.autograd.backward([w, scores], [g.to(cuda), gs.to(cuda)])
    sel = router_selection_scores(logits, "sigmoid", False, None)
    ref_idx = router_selection_reference(logits, k, "sigmoid", False, 1, 1, 1, None)
    assert_same_choice(idx.cpu(), ref_idx, sel, {}, "router_topk indices")
    args = ("sigmoid", False, normalize, 1.0)
    assert_close_to_fp64(w.detach().cpu(), router_weights_reference(logits, idx.cpu(), *args),
                         router_weights_reference(logits.double(), idx.cpu(), *args), "weights")
    ref_scores, ref_idx = router_aux_scores_reference(logits, k, "softmax")
    ref64 = router_aux_scores_reference(logits.double(), k, "softmax")[0]
    assert_close_to_fp64(scores.detach().cpu(), ref_scores, ref64, "aux scores")
    assert_same_choice(aux_idx.cpu(), ref_idx, ref_scores, {}, "aux indices")
    d32 = (router_topk_bwd_reference(g, logits, idx.cpu(), *args)
           + router_aux_scores_bwd_reference(gs, logits, "softmax"))
    d64 = (router_topk_bwd_reference(g.double(), logits.double(), idx.cpu(), *args)
           + router_aux_scores_bwd_reference(gs.double(), logits.double(), "softmax"))
    assert_close_to_fp64(x.grad.cpu(), d32, d64, "grad logits")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sqrtsoftplus_gradient_at_underflow_and_minus_inf(cuda, dtype):
    # softplus underflows to 0 in fp32 below about -104 and is 0 at -inf: s = 0, where sigmoid / (2 s) is
    # 0 / 0. The kernels' gradient is finite there, about sqrt(e^x) / 2 (0 at -inf), in router_topk with
    # every expert chosen (k = E) and in router_aux_scores. Expected: the references in fp32 and fp64,
    # relative to each element at the tiny ones (a max-error check cannot see them).
    T, E = 64, 32
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(T, E, generator=gen) * 3
    u, r = torch.rand(T, E, generator=gen), torch.rand(T, E, generator=gen)
    logits = torch.where(u < 0.3, -40.0 - 260.0 * r, logits)  # -300 .. -40: through the underflow
    logits[u < 0.1] = -float("inf")
    logits = logits.to(dtype)
    tiny = logits.float() < -40
    tol = dict(rtol=1e-4, atol=1e-37) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-37)

    def check(grad, d32, d64, what):
        assert bool(torch.isfinite(d32).all()) and bool(torch.isfinite(grad).all()), what
        assert bool((grad.cpu()[torch.isinf(logits)] == 0).all()), f"{what}: -inf"
        assert_grad_close(grad.cpu(), d32, d64, dtype, what)
        torch.testing.assert_close(grad.cpu()[tiny].double(), d64[tiny].to(dtype).double(), **tol)

    for normalize in (True, False):
        x = logits.to(cuda, copy=True).requires_grad_()
        w, idx = mk.router_topk(x, E, score="sqrtsoftplus", normalize=normalize, scaling_factor=1.5)
        g = torch.randn(T, E, generator=gen)
        w.backward(g.to(cuda))
        args = ("sqrtsoftplus", False, normalize, 1.5)
        check(x.grad, router_topk_bwd_reference(g, logits.float(), idx.cpu(), *args),
              router_topk_bwd_reference(g.double(), logits.double(), idx.cpu(), *args), f"topk normalize={normalize}")
    x = logits.to(cuda, copy=True).requires_grad_()
    scores, _ = mk.router_aux_scores(x, 4, score="sqrtsoftplus")
    gs = torch.randn(T, E, generator=gen)
    scores.backward(gs.to(cuda))
    check(x.grad, router_aux_scores_bwd_reference(gs, logits.float(), "sqrtsoftplus"),
          router_aux_scores_bwd_reference(gs.double(), logits.double(), "sqrtsoftplus"), "aux scores")
