"""Property-based tests of the permute (plain and fused with FP8 quantization) and router kernels against
their references: random T, E, k, H, align, dropped (-1) slots and hot experts, drawn by hypothesis (derandomized, so every run tries the
same examples). GPU tier: on a GPU, and on the CPU-executed kernels under MOE_KERNELS_EMULATE=1."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_kernels as mk
from moe_kernels.ops.permute import permute_quantize_fp8_reference, permute_reference, permuted_rows, unpermute_reference
from moe_kernels.ops.router import (
    resolve_topk_options,
    router_selection_scores,
    router_topk_reference,
    router_weights_reference,
)
from moe_kernels.testing import assert_close_to_fp64, assert_exact
from tests.ops.test_router_gpu import assert_same_choice

pytestmark = pytest.mark.gpu

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@st.composite
def routings(draw):
    T = draw(st.integers(0, 300))
    E = draw(st.integers(1, 300))
    k = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    hot = draw(st.floats(0.0, 1.0))  # the fraction of slots sent to one hot expert
    idx[torch.rand(T, k, generator=gen) < hot] = draw(st.integers(0, E - 1))
    drop = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    idx[torch.rand(T, k, generator=gen) < drop] = -1
    return idx, E, seed


@SETTINGS
@given(
    routing=routings(),
    H=st.integers(1, 300),
    align=st.sampled_from([1, 2, 3, 16, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
)
def test_permute_matches_reference(cuda, routing, H, align, dtype):
    idx, E, seed = routing
    T, k = idx.shape
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 256, (T, H), generator=gen, dtype=torch.uint8) if dtype == torch.uint8 else \
        torch.randn(T, H, generator=gen).to(dtype)
    ref_perm, ref_map, ref_sizes = permute_reference(x, idx, E, align)
    x_perm, row_map, sizes = mk.permute(x.to(cuda), idx.to(cuda), E, align=align)
    n = int(ref_sizes.sum())
    assert x_perm.shape == (permuted_rows(T, k, E, align), H)
    assert_exact(row_map.cpu(), ref_map, "row_map")
    assert_exact(sizes.cpu(), ref_sizes, "group_sizes")
    assert_exact(x_perm[:n].cpu(), ref_perm[:n], "x_perm (padding rows zero)")
    if dtype != torch.uint8:
        w = torch.rand(T, k, generator=gen)
        out = mk.unpermute(x_perm, row_map, w.to(cuda))
        assert_exact(out.cpu(), unpermute_reference(ref_perm, ref_map, w), "unpermute")


@SETTINGS
@given(
    routing=routings(),
    H=st.integers(1, 300),
    align=st.sampled_from([1, 16, 128]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale=st.sampled_from([1e-30, 1.0, 1e30]),
    pow2=st.booleans(),
)
def test_permute_quantize_fp8_matches_reference(cuda, routing, H, align, dtype, scale, pow2):
    idx, E, seed = routing
    T, k = idx.shape
    gen = torch.Generator().manual_seed(seed + 2)
    x = (torch.randn(T, H, generator=gen) * torch.logspace(-2, 2, H) * scale).to(dtype)  # overflows to inf in fp16
    q, s, row_map, sizes, x_perm = mk.permute_quantize_fp8(x.to(cuda), idx.to(cuda), E, align=align, pow2_scale=pow2,
                                                           keep_rows=True)
    rq, rs, rmap, rsizes, rperm = permute_quantize_fp8_reference(x, idx, E, align, pow2)
    n = int(rsizes.sum())
    assert q.shape == (permuted_rows(T, k, E, align), H)
    assert_exact(row_map.cpu(), rmap, "row_map")
    assert_exact(sizes.cpu(), rsizes, "group_sizes")
    assert_exact(q[:n].cpu().view(torch.uint8), rq[:n].view(torch.uint8), "codes")
    assert_exact(s[:n].cpu(), rs[:n], "scales (padding rows 0)")
    assert_exact(x_perm[:n].cpu(), rperm[:n], "x_perm")


@st.composite
def router_cases(draw):
    score = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    pre_softmax = score == "softmax" and draw(st.booleans())
    grouped = score != "softmax" and draw(st.booleans())
    if grouped:
        G = draw(st.sampled_from([2, 4, 8]))
        E = G * draw(st.integers(1, 32))
        g = draw(st.integers(1, G))
        k = draw(st.integers(1, min(8, E)))  # past the kept groups' experts too
    else:
        G = g = None
        E = draw(st.integers(1, 512))
        k = draw(st.integers(1, min(8, E)))
    T = draw(st.integers(0, 64))
    seed = draw(st.integers(0, 2**31 - 1))
    bias = score != "softmax" and draw(st.booleans())
    hot = draw(st.booleans())  # one expert's logit far above the rest for every token
    return dict(score=score, pre_softmax=pre_softmax, num_groups=G, group_topk=g, E=E, k=k, T=T, seed=seed,
                bias=bias, hot=hot)


@SETTINGS
@given(case=router_cases(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_router_topk_matches_reference(cuda, case, dtype):
    T, E, k = case["T"], case["E"], case["k"]
    gen = torch.Generator().manual_seed(case["seed"])
    logits = torch.randn(T, E, generator=gen)
    if case["hot"]:
        logits[:, int(torch.randint(0, E, (1,), generator=gen))] += 8.0
    logits = logits.to(dtype)
    bias = torch.randn(E, generator=gen) * 0.05 if case["bias"] else None
    G, g, gst, scale, norm = resolve_topk_options(k, case["num_groups"], case["group_topk"], None, None, None, E,
                                                  score=case["score"])
    _, ref_idx = router_topk_reference(logits, k, case["score"], case["pre_softmax"], G, g, gst, scale, bias, norm)
    w, idx = mk.router_topk(logits.to(cuda), k, score=case["score"], pre_softmax=case["pre_softmax"],
                            num_groups=case["num_groups"], group_topk=case["group_topk"],
                            expert_bias=None if bias is None else bias.to(cuda))
    sel = router_selection_scores(logits, case["score"], case["pre_softmax"], bias)
    cfg = {"num_groups": case["num_groups"], "group_topk": case["group_topk"]} if G > 1 else {}
    assert_same_choice(idx.cpu(), ref_idx, sel, cfg, "router_topk indices")
    chosen = idx.cpu()
    args = (case["score"], case["pre_softmax"], norm, scale)
    assert_close_to_fp64(w.cpu(), router_weights_reference(logits.float(), chosen, *args),
                         router_weights_reference(logits.double(), chosen, *args), "router_topk weights")
