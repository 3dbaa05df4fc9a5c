"""Balancing losses, capacity and the expert-bias update: GPU tier, CUDA kernels against the references."""

import math

import pytest
import torch

import moe_kernels as mk
from moe_kernels.nn import Router, RouterConfig
from moe_kernels.ops.router_losses import (
    apply_capacity_reference,
    aux_loss_reference,
    balance_loss_bwd_reference,
    capacity,
    seq_aux_loss_reference,
    update_expert_bias_reference,
    z_loss_bwd_reference,
    z_loss_reference,
)
from moe_kernels.ops.permute import tokens_per_expert_reference
from moe_kernels.testing import assert_close_to_fp64, assert_exact, assert_within_fp32_rounding, random_routing
from tests.emulation import EMULATED, skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**20  # [T, E] elements per case
CAPACITY_BUDGET = 2**15  # (token, slot) pairs per apply_capacity case (24 cases per shape)


def _scores(T, E, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(T, E, generator=gen), -1).to(dtype)


# ---------------------------------------------------------------------------------------------------
# aux_loss and seq_aux_loss


# The last block's sums: 16-byte loads (E % 4 == 0) or single floats (E = 7, 13), one item a thread or
# several lanes an item (E 8: two items, 128 lanes), one pass (E 1024: 256 items) or several (E 2048).
@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (1, 8, 1), (7, 64, 4), (300, 7, 2), (2048, 13, 3), (2048, 64, 4),
                                   (2048, 256, 8), (16384, 8, 2), (16384, 256, 8), (4096, 1024, 32),
                                   (512, 2048, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_aux_loss(cuda, T, E, k, dtype, count_dtype):
    skip_if_too_large(T * E, EMULATION_BUDGET, "scores")
    scores = _scores(T, E, dtype, seed=T + E)
    counts = tokens_per_expert_reference(random_routing(T, E, k, kind="zipf", seed=E), E).to(count_dtype)
    x = scores.to(cuda, copy=True).requires_grad_()
    loss = mk.aux_loss(x, counts.to(cuda), k, 0.01)
    assert loss.dtype == torch.float32 and loss.shape == ()
    ref64 = aux_loss_reference(scores.double(), counts, k, 0.01)
    scale = 0.01 * E / (k * T * T) if T else 0.0
    magnitude = (scores.double().sum(0).abs() * counts.double()).sum() * scale
    assert_within_fp32_rounding(loss.detach(), ref64, magnitude, "aux_loss")
    loss.backward(torch.tensor(3.0, device=cuda))
    expected = (torch.tensor(3.0) * scale * counts.float()).expand(T, E).to(dtype)
    assert x.grad.dtype == dtype
    assert_within_fp32_rounding(x.grad.float(), expected.float(), expected.float().abs(), "aux_loss grad")


def test_aux_loss_ticket_and_broadcast_gradient(cuda):
    # One launch: the last block's ticket counter is left at zero for the next launch on the stream, and a
    # second call gives the same bits. The gradient is one [E] row broadcast over the T rows (as sum's
    # backward): no [T, E] write; the leaf's .grad is a dense copy of it.
    from moe_kernels import _ext

    T, E, k = 4096, 64, 4
    scores = _scores(T, E, torch.float32, seed=3).to(cuda)
    counts = tokens_per_expert_reference(random_routing(T, E, k, seed=4), E).to(cuda)
    x = scores.clone().requires_grad_()
    first = mk.aux_loss(x, counts, k, 0.01)
    assert all(int(c.sum()) == 0 for c in _ext._counters.values()), "ticket counter not left at zero"
    again = mk.aux_loss(scores, counts, k, 0.01)
    assert_exact(again, first.detach(), "aux_loss, called twice")
    (g,) = torch.autograd.grad(first, x, torch.tensor(2.0, device=cuda))
    assert g.shape == (T, E) and g.stride() == (0, 1)
    want = (torch.tensor(2.0) * 0.01 * E / (k * T * T) * counts.cpu().float()).expand(T, E)
    assert_within_fp32_rounding(g.cpu(), want, want.abs(), "broadcast aux_loss grad")
    reg = torch.ops.moe_kernels.aux_loss(x, counts, k, 0.01)
    (g2,) = torch.autograd.grad(reg, x, torch.tensor(2.0, device=cuda))
    assert g2.stride() == (0, 1)
    assert_exact(g2, g, "registered op's gradient")


@pytest.mark.parametrize("B,S,E,k", [(1, 1, 8, 2), (3, 7, 8, 2), (5, 100, 6, 2), (4, 128, 64, 4), (1, 2048, 64, 4),
                                     (4, 4096, 256, 8), (64, 33, 128, 8), (2, 512, 1024, 32), (9, 64, 125, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seq_aux_loss(cuda, B, S, E, k, dtype):
    T = B * S
    skip_if_too_large(T * E, EMULATION_BUDGET, "scores")
    scores = _scores(T, E, dtype, seed=B * S)
    idx = random_routing(T, E, k, kind="zipf", drop=0.1, seed=S)
    x = scores.to(cuda, copy=True).requires_grad_()
    loss, counts = torch.ops.moe_kernels.seq_aux_loss(x, idx.to(cuda), 0.01, S)
    ref64, ref_counts = seq_aux_loss_reference(scores.double(), idx, 0.01, S)
    assert_exact(counts.cpu(), ref_counts, "per-sequence counts")
    scale = 0.01 * E / (k * S * S) / B
    magnitude = (scores.double().view(B, S, E).sum(1).abs() * ref_counts.double()).sum() * scale
    assert_within_fp32_rounding(loss.detach(), ref64, magnitude, "seq_aux_loss")
    loss.backward(torch.tensor(0.5, device=cuda))
    expected = balance_loss_bwd_reference(torch.tensor(0.5), ref_counts, T, S, scale, dtype)
    assert_within_fp32_rounding(x.grad.float(), expected.float(), expected.float().abs(), "seq_aux_loss grad")
    # The public wrapper equals aux_loss for one sequence.
    if B == 1:
        one = mk.aux_loss(x.detach(), mk.tokens_per_expert(idx.to(cuda), E), k, 0.01)
        assert_within_fp32_rounding(one, ref64, magnitude, "aux_loss of one sequence")


def test_seq_aux_loss_int64_indices_and_checks(cuda, checks_on):
    scores = _scores(64, 16, torch.float32, seed=1).to(cuda)
    idx = random_routing(64, 16, 2, seed=2).to(cuda)
    a = mk.seq_aux_loss(scores, idx, 0.1, seq_len=16)
    b = mk.seq_aux_loss(scores, idx.long(), 0.1, seq_len=16)
    assert_exact(a, b, "int32 vs int64 indices")
    bad = idx.clone()
    bad[5, 1] = 16
    with pytest.raises(ValueError, match="indices"):
        mk.seq_aux_loss(scores, bad, 0.1, seq_len=16)


def test_wide_experts_and_no_experts(cuda):
    # E past the shared-memory histogram limit runs the reference on the GPU; E = 0 gives 0 like the CPU.
    E = 10000
    scores = _scores(64, E, torch.float32, seed=4)
    idx = random_routing(64, E, 2, seed=5)
    for seq in (64, 16):
        got = mk.seq_aux_loss(scores.to(cuda), idx.to(cuda), 0.1, seq_len=seq)
        want = seq_aux_loss_reference(scores, idx, 0.1, seq)[0]
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=0)
    counts = tokens_per_expert_reference(idx, E)
    torch.testing.assert_close(mk.aux_loss(scores.to(cuda), counts.to(cuda), 2, 0.1).cpu(),
                               aux_loss_reference(scores, counts, 2, 0.1), rtol=1e-5, atol=0)
    empty = torch.empty(8, 0, device=cuda)
    assert mk.aux_loss(empty, torch.empty(0, dtype=torch.int32, device=cuda), 1, 0.1).item() == 0.0
    assert mk.seq_aux_loss(empty, torch.full((8, 1), -1, dtype=torch.int32, device=cuda), 0.1, seq_len=4).item() == 0.0


def test_int64_indices_outside_int32_are_dropped(cuda):
    # Without the checking mode a GPU never syncs to validate: an index past int32 is a dropped slot,
    # never wrapped into a valid expert.
    if cuda.type != "cuda" and not EMULATED:
        pytest.skip("the CPU references raise instead (tested in the CPU tier)")
    w = torch.rand(4, 2, device=cuda)
    idx = torch.tensor([[0, 1], [2, 2**32 + 3], [1, 1], [0, -1]], device=cuda)
    out_w, out_i = mk.apply_capacity(w, idx, 8, 4.0)
    assert out_i[1, 1].item() == -1 and out_w[1, 1].item() == 0.0
    assert_exact(out_i[0], idx[0].to(torch.int32), "in-range slots kept")
    scores = _scores(4, 8, torch.float32, seed=1).to(cuda)
    clean = idx.clone()
    clean[1, 1] = -1
    assert_exact(mk.seq_aux_loss(scores, idx, 0.1, seq_len=2), mk.seq_aux_loss(scores, clean, 0.1, seq_len=2),
                 "wide index dropped")


# ---------------------------------------------------------------------------------------------------
# z_loss


@pytest.mark.parametrize("T,E", [(0, 8), (1, 8), (7, 3), (2048, 64), (16384, 256), (4096, 1024), (33, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_z_loss(cuda, T, E, dtype):
    skip_if_too_large(T * E, EMULATION_BUDGET, "logits")
    gen = torch.Generator().manual_seed(T * 7 + E)
    logits = (torch.randn(T, E, generator=gen) * 3).to(dtype)
    x = logits.to(cuda, copy=True).requires_grad_()
    loss, lse = torch.ops.moe_kernels.z_loss(x, 1e-3)
    ref32, lse32 = z_loss_reference(logits.float(), 1e-3)
    ref64, lse64 = z_loss_reference(logits.double(), 1e-3)
    assert loss.dtype == lse.dtype == torch.float32
    # fp32 results: no floor beyond assert_close_to_fp64's 8 fp32 ulps of the reference's magnitude (the
    # loss is one scalar: torch's error on it is one draw of rounding noise and can be 0).
    assert_close_to_fp64(lse.cpu(), lse32, lse64, "log-sum-exp", floor=0.0)
    assert_close_to_fp64(loss.detach().cpu(), ref32, ref64, "z_loss", floor=0.0)
    g = torch.tensor(2.0)
    loss.backward(g.to(cuda))
    d32 = z_loss_bwd_reference(g, logits.float(), lse32, 1e-3)
    d64 = z_loss_bwd_reference(g.double(), logits.double(), lse64, 1e-3)
    if dtype == torch.float32:
        assert_close_to_fp64(x.grad, d32, d64, "z_loss grad", floor=0.0)
    else:  # rounded to the logits' dtype like the reference's result
        assert x.grad.dtype == dtype
        assert_close_to_fp64(x.grad.float(), d32.to(dtype).float(), d64, "z_loss grad", floor=1e-6)


def test_z_loss_non_finite(cuda):
    # Documented behaviour (torch.logsumexp): a NaN makes the row's lse NaN; +inf gives +inf; a row of
    # -inf gives -inf; the loss is then NaN or inf accordingly.
    logits = torch.randn(6, 16)
    logits[0, 3] = float("nan")
    logits[1, 2] = float("inf")
    logits[2] = float("-inf")
    logits[3, :4] = float("-inf")
    _, lse = torch.ops.moe_kernels.z_loss(logits.to(cuda), 1e-3)
    _, ref = z_loss_reference(logits, 1e-3)
    _, ref64 = z_loss_reference(logits.double(), 1e-3)
    lse = lse.cpu()
    assert math.isnan(lse[0]) and lse[1] == math.inf and lse[2] == -math.inf
    # The finite rows: within 2x torch's fp32 error of fp64 plus 8 fp32 ulps of max|lse| (assert_close_to_fp64).
    assert_close_to_fp64(lse[3:], ref[3:], ref64[3:], "log-sum-exp of finite rows", floor=0.0)
    assert math.isnan(mk.z_loss(logits.to(cuda), 1e-3).item())
    assert mk.z_loss(logits[1:3].to(cuda), 1e-3).item() == math.inf


# ---------------------------------------------------------------------------------------------------
# apply_capacity: exact


def _capacity_cases():
    for T, E, k in [(1, 8, 1), (7, 8, 2), (2048, 64, 8), (4096, 256, 8), (16384, 256, 8), (333, 1024, 4)]:
        for kind in ("uniform", "zipf", "hot", "empty"):
            yield T, E, k, kind


@pytest.mark.parametrize("T,E,k,kind", list(_capacity_cases()))
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_apply_capacity_exact(cuda, T, E, k, kind, policy, factor):
    skip_if_too_large(T * k, CAPACITY_BUDGET, "pairs")
    gen = torch.Generator().manual_seed(T + E + k)
    idx = random_routing(T, E, k, kind=kind, drop=0.05, seed=T)
    # Weights on a coarse grid: many exact ties, which must go to the earlier (token, slot).
    w = torch.randint(0, 16, (T, k), generator=gen).float() / 16
    ref_w, ref_i = apply_capacity_reference(w, idx, E, factor, policy)
    out_w, out_i = mk.apply_capacity(w.to(cuda), idx.to(cuda), E, factor, policy)
    assert_exact(out_i.cpu(), ref_i, "kept indices")
    assert_exact(out_w.cpu(), ref_w, "kept weights")
    kept = mk.tokens_per_expert(out_i, E).cpu()
    C = capacity(T, k, E, factor)
    assert int(kept.max()) <= C
    assert torch.equal(kept, torch.minimum(tokens_per_expert_reference(idx, E), torch.tensor(C, dtype=kept.dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_capacity_dtypes_and_specials(cuda, dtype):
    T, E, k = 1024, 16, 4
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(T, k, generator=gen)
    w[::7, 0] = float("nan")
    w[::11, 1] = -0.0
    w[::13, 2] = 0.0
    w[::17, 3] = float("-inf")
    w = w.to(dtype)
    idx = random_routing(T, E, k, kind="zipf", drop=0.1, seed=6)
    for policy in ("probs", "position"):
        ref_w, ref_i = apply_capacity_reference(w, idx, E, 0.75, policy)
        out_w, out_i = mk.apply_capacity(w.to(cuda), idx.to(cuda), E, 0.75, policy)
        assert_exact(out_i.cpu(), ref_i, f"{policy} indices")
        assert_exact(out_w.cpu(), ref_w, f"{policy} weights")


def test_apply_capacity_edge_cases(cuda, checks_on):
    # 0 tokens; a single expert holding every pair (one block ranks 131072 pairs); all pairs dropped.
    w, i = mk.apply_capacity(torch.empty(0, 2, device=cuda), torch.empty(0, 2, dtype=torch.int32, device=cuda), 8, 1.0)
    assert w.shape == (0, 2) and i.shape == (0, 2)
    gen = torch.Generator().manual_seed(9)
    w = torch.rand(16384, 8, generator=gen)
    idx = torch.zeros(16384, 8, dtype=torch.int32)
    ref_w, ref_i = apply_capacity_reference(w, idx, 256, 1.0, "probs")
    out_w, out_i = mk.apply_capacity(w.to(cuda), idx.to(cuda), 256, 1.0, "probs")
    assert_exact(out_i.cpu(), ref_i, "hot expert indices")
    assert_exact(out_w.cpu(), ref_w, "hot expert weights")
    assert int((out_i >= 0).sum()) == capacity(16384, 8, 256, 1.0)
    dropped = torch.full((64, 2), -1, dtype=torch.int32)
    out_w, out_i = mk.apply_capacity(torch.rand(64, 2).to(cuda), dropped.to(cuda), 8, 1.0)
    assert bool((out_i == -1).all()) and bool((out_w == 0).all())
    bad = idx[:4].clone()
    bad[0, 0] = 256
    with pytest.raises(ValueError, match="indices"):
        mk.apply_capacity(w[:4].to(cuda), bad.to(cuda), 256, 1.0)


def test_apply_capacity_grad(cuda):
    w = torch.rand(512, 4, device=cuda, requires_grad=True)
    idx = random_routing(512, 8, 4, kind="zipf", seed=3).to(cuda)
    out_w, out_i = mk.apply_capacity(w, idx, 8, 0.5)
    g = torch.randn_like(out_w)
    out_w.backward(g)
    assert_exact(w.grad, torch.where(out_i >= 0, g, 0.0), "capacity grad")


# ---------------------------------------------------------------------------------------------------
# update_expert_bias: exact


@pytest.mark.parametrize("E", [1, 8, 256, 4096, 8192])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_update_expert_bias_exact(cuda, E, count_dtype):
    gen = torch.Generator().manual_seed(E)
    bias = torch.randn(E, generator=gen) * 0.01
    counts = torch.randint(0, 5000, (E,), generator=gen).to(count_dtype)
    counts[: E // 4] = int(counts.double().mean().round())  # some exactly at (or next to) the mean
    expected = bias.clone()
    update_expert_bias_reference(expected, counts, 1e-3)
    got = bias.to(cuda)
    mk.update_expert_bias(got, counts.to(cuda), 1e-3)
    assert_exact(got.cpu(), expected, "bias")


# ---------------------------------------------------------------------------------------------------
# Determinism and graph capture


def test_losses_deterministic(cuda):
    skip_if_too_large(16384 * 256, EMULATION_BUDGET, "scores")
    scores = _scores(16384, 256, torch.float32, seed=11).to(cuda)
    idx = random_routing(16384, 256, 8, kind="zipf", seed=12).to(cuda)
    counts = mk.tokens_per_expert(idx, 256)
    logits = torch.randn(16384, 256, device=cuda)
    first = [mk.aux_loss(scores, counts, 8, 0.01), mk.seq_aux_loss(scores, idx, 0.01, seq_len=4096),
             mk.z_loss(logits, 1e-3)]
    for _ in range(3):
        again = [mk.aux_loss(scores, counts, 8, 0.01), mk.seq_aux_loss(scores, idx, 0.01, seq_len=4096),
                 mk.z_loss(logits, 1e-3)]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.cuda_device
def test_router_with_losses_in_cuda_graph(cuda):
    cfg = RouterConfig(hidden_size=128, num_experts=64, k=4, score="sigmoid", aux_loss_coeff=1e-2,
                             seq_aux_loss_coeff=1e-3, z_loss_coeff=1e-3, capacity_factor=1.0)
    router = Router(cfg).to(cuda)
    x = torch.randn(512, 128, device=cuda, requires_grad=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the graph
            out = router(x, seq_len=128)
            (out.weights.sum() + out.aux_loss).backward()
    torch.cuda.current_stream().wait_stream(stream)
    x.grad = None
    router.zero_grad(set_to_none=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router(x, seq_len=128)
        (out.weights.sum() + out.aux_loss).backward()
    graph.replay()
    torch.cuda.synchronize()
    eager_x = x.detach().clone().requires_grad_()
    router.zero_grad(set_to_none=True)
    ref = router(eager_x, seq_len=128)
    (ref.weights.sum() + ref.aux_loss).backward()
    assert_exact(out.indices, ref.indices, "graph indices")
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, eager_x.grad, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.gpu_memory
def test_balance_backward_past_2_31_elements(cuda):
    # [T, E] gradient with T * E > 2^31 (bf16, 4.3 GB): 64-bit offsets in the backward kernel.
    T, E = (1 << 23) + 3, 256
    skip_if_too_large(T * E, EMULATION_BUDGET, "gradient elements")
    if cuda.type != "cuda":
        pytest.skip("the references need about 40 GB of host memory here")
    counts = torch.arange(E, dtype=torch.int32, device=cuda)
    g = torch.ops.moe_kernels.balance_loss_bwd(torch.tensor(1.0, device=cuda), counts.view(1, E), T, T, 1.0,
                                               torch.bfloat16)
    assert g.shape == (T, E)
    for t in (0, T // 2, T - 1):
        assert_exact(g[t].float().cpu(), counts.float().cpu().to(torch.bfloat16).float(), f"row {t}")
    del g


def test_apply_capacity_loop_bound(cuda):
    # The per-expert select loops count passes of 512 pairs in 64 bits: a segment of 2^31 - 1 pairs (the
    # most apply_capacity takes) ends after 2^22 passes, where an int32 index would overflow and spin.
    from moe_kernels import _ext

    C = _ext.kernels("apply_capacity", torch.empty(1, device=cuda))
    if C is None:
        pytest.skip("the loop bound is the extension's")
    assert C.capacity_select_passes(2**31 - 1) == 2**22
    for n in (0, 1, 511, 512, 513, 5000, 2**31 - 512, 2**31 - 1):
        passes = C.capacity_select_passes(n)
        assert passes * 512 >= n > (passes - 1) * 512 or n == passes == 0, n
    # More than one pass for one expert, both policies: the reference.
    T, E, k = 3000, 4, 1
    w = torch.randint(0, 16, (T, k), generator=torch.Generator().manual_seed(7)).float() / 16
    idx = random_routing(T, E, k, kind="hot", seed=7)
    for policy in ("probs", "position"):
        ref_w, ref_i = apply_capacity_reference(w, idx, E, 1.0, policy)
        out_w, out_i = mk.apply_capacity(w.to(cuda), idx.to(cuda), E, 1.0, policy)
        assert_exact(out_i.cpu(), ref_i, f"{policy} indices")
        assert_exact(out_w.cpu(), ref_w, f"{policy} weights")
