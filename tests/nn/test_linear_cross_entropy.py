"""linear_cross_entropy against the composition F.cross_entropy(F.linear(h, w, b).float(), t), on fresh random inputs.

Error model (moe_kernels.testing's policy, each reduction within 64 eps_fp32 x the sum of its |terms|):
- loss: each logit is an H-term dot product, z_iv = sum_k h_ik w_vk, with A_iv = sum_k |h_ik w_vk|; the
  log-sum-exp moves by at most the largest logit error (softmax weights sum to 1), the target logit by its
  own; the mean then sums the rows' losses. So the loss's magnitude is
  mean_i (max_v A_iv + A_i,t_i + |loss_i|), and fused and composed fp32 losses differ by at most 64 eps_fp32
  of it. Measured: under 1% of the tolerance, while the unfused bf16 path, whose logits are rounded to bf16,
  lands 1x to 7x beyond it: the bound tells fp32 logits from bf16 ones.
- fp32 gradients (tight, against fp64): grad_h_i = s sum_v (p_iv - onehot_iv) w_v and grad_w_v = s sum_i
  (p_iv - onehot_iv) h_i; besides the GEMM's own terms, an error dz in the logits moves p by p x 2 max|dz|,
  so each term's magnitude also counts p_iv x 2 max_u A_iu.
- bf16 gradients: the flash-attention rule in the L2 norm (assert_norm_close_to_fp64): at most twice the error
  of the unfused bf16 composition (autograd through F.linear in bf16) against fp64, plus 64 eps_fp32 of the
  reference's norm. The norm, not the max: the elements' errors are bf16 roundings, a few ulps each, and the
  max over a few dozen of them is one draw of that noise (with N = 5 the max alone failed 1 run in 24).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moe_kernels.nn import linear_cross_entropy
from moe_kernels.nn.linear_cross_entropy import CHUNK_BYTES, default_chunk_size
from moe_kernels.testing import FP32_EPS, assert_norm_close_to_fp64, assert_within_fp32_rounding


def _inputs(N, H, V, dtype, seed, *, ignored=0.2, bias=False, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * 3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g)).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignored] = ignore_index
    return h, w, b, t


def _grads(loss, params, scale=1.0):
    (loss * scale).backward()
    out = [p.grad.clone() if p is not None else None for p in params]
    for p in params:
        if p is not None:
            p.grad = None
    return out


def _reference64(h, w, b, t, reduction, ignore_index=-100):
    """The composition in fp64 on the same input values, with the magnitudes of the error model."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    z = F.linear(h64, w64, b64)
    loss = F.cross_entropy(z, t, reduction=reduction, ignore_index=ignore_index)
    with torch.no_grad():
        valid = t != ignore_index
        A = h64.abs() @ w64.abs().t()  # [N, V]: sum_k |h_ik w_vk|
        if b64 is not None:
            A = A + b64.abs()
        safe = torch.where(valid, t, 0)
        rows = -F.log_softmax(z, dim=1).gather(1, safe[:, None]).squeeze(1)
        n = max(int(valid.sum()), 1)
        per_row = (A.max(1).values + A.gather(1, safe[:, None]).squeeze(1) + rows.abs()) * valid
        loss_mag = per_row.sum() / (n if reduction == "mean" else 1)
        s = (1.0 / n if reduction == "mean" else 1.0) * valid.double()[:, None]  # [N, 1]
        p = torch.softmax(z, dim=1)
        dz = (p - F.one_hot(safe, w.shape[0]).double()).abs() + p * 2 * A.max(1, keepdim=True).values
        dz = dz * s
        mag_h, mag_w, mag_b = dz @ w64.abs(), dz.t() @ h64.abs(), dz.sum(0)
    return loss, (h64, w64, b64), (mag_h, mag_w, mag_b), loss_mag


CASES = [  # N, H, V, chunk_size, bias: N not a multiple of the chunk, V prime, one chunk, one row a chunk
    (37, 24, 1009, 8, False),
    (64, 32, 331, None, True),
    (5, 16, 97, 1, False),
]


@pytest.mark.parametrize("N,H,V,chunk,bias", CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_composition(N, H, V, chunk, bias, reduction, dtype):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs; the seed is in the failure message
    h, w, b, t = _inputs(N, H, V, dtype, seed, bias=bias)
    params = [h, w, b]
    scale = 2.5  # an upstream gradient other than 1
    fused = linear_cross_entropy(h, w, t, bias=b, reduction=reduction, chunk_size=chunk)
    assert fused.dtype == torch.float32 and fused.shape == ()
    ours = _grads(fused, params, scale)
    # The fp32 composition on the same values.
    z32 = F.linear(h.detach().float(), w.detach().float(), b.detach().float() if b is not None else None)
    composed32 = F.cross_entropy(z32, t, reduction=reduction)
    loss64, p64, mags, loss_mag = _reference64(h, w, b, t, reduction)
    what = f"seed {seed}, {dtype}, N={N} H={H} V={V} chunk={chunk} {reduction}"
    assert_within_fp32_rounding(fused, composed32, loss_mag, f"loss vs the fp32 composition ({what})")
    assert_within_fp32_rounding(fused, loss64, loss_mag, f"loss vs fp64 ({what})")
    grads64 = _grads(loss64, list(p64), scale)
    names = ["grad_hidden", "grad_weight", "grad_bias"]
    if dtype == torch.float32:
        for name, g, g64, m in zip(names, ours, grads64, mags):
            if g is not None:
                assert g.dtype == torch.float32
                assert_within_fp32_rounding(g, g64, m * scale, f"{name} ({what})")
    else:  # the unfused bf16 path: F.linear in bf16, the loss over its logits in fp32
        baseline = _grads(F.cross_entropy(F.linear(h, w, b).float(), t, reduction=reduction), params, scale)
        for name, g, base, g64 in zip(names, ours, baseline, grads64):
            if g is not None:
                assert g.dtype == torch.bfloat16
                assert_norm_close_to_fp64(g, base, g64, f"{name} ({what})", floor=64 * FP32_EPS)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_and_empty(reduction):
    for N in (6, 0):
        h, w, _, t = _inputs(N, 8, 13, torch.float32, 0, ignored=1.1)
        loss = linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=4)
        ref = F.cross_entropy(F.linear(h, w), t, reduction=reduction)
        if reduction == "mean":  # F.cross_entropy's convention: 0 / 0, with zero gradients
            assert torch.isnan(loss) and torch.isnan(ref)
        else:
            assert loss.item() == 0.0 == ref.item()
        gh, gw = _grads(loss, [h, w])
        assert gh.shape == (N, 8) and not gh.any() and not gw.any()


def test_ignore_index_other_value():
    h, w, _, t = _inputs(20, 8, 31, torch.float32, 1, ignore_index=7)  # (7 is also a word: rows with it count)
    t[:3] = 7
    loss = linear_cross_entropy(h, w, t, ignore_index=7, chunk_size=6)
    ref = F.cross_entropy(F.linear(h, w), t, ignore_index=7)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_tied_embedding():
    """The weight is also the embedding's: both uses' gradients add up in one."""
    torch.manual_seed(3)
    emb = torch.nn.Embedding(53, 16)
    ids, t = torch.randint(0, 53, (4, 9)), torch.randint(0, 53, (4, 9))
    t[0, :2] = -100

    def run(fused):
        emb.weight.grad = None
        h = torch.tanh(emb(ids))
        if fused:
            loss = linear_cross_entropy(h, emb.weight, t, chunk_size=5)
        else:
            loss = F.cross_entropy(F.linear(h, emb.weight).flatten(0, 1), t.flatten())
        loss.backward()
        return loss.detach(), emb.weight.grad.clone()

    (lf, gf), (lr, gr) = run(True), run(False)
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gf, gr, rtol=1e-4, atol=1e-6)


def test_autocast_and_no_grad():
    h, w, _, t = _inputs(12, 16, 41, torch.float32, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t)
        ref = F.cross_entropy(F.linear(h, w).float(), t)
    assert loss.dtype == torch.float32
    gh, gw = _grads(loss, [h, w])
    rh, rw = _grads(ref, [h, w])
    assert gh.dtype == gw.dtype == torch.float32  # through the autocast casts to the fp32 leaves
    torch.testing.assert_close(gh, rh, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(gw, rw, rtol=0.05, atol=2e-3)
    with torch.no_grad():
        assert linear_cross_entropy(h, w, t).grad_fn is None


def test_second_backward_refused_and_bad_arguments():
    h, w, _, t = _inputs(4, 8, 11, torch.float32, 0)
    loss = linear_cross_entropy(h, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="must match"):
        linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="one floating dtype"):
        linear_cross_entropy(h, w.detach().double(), t)


def test_default_chunk_size():
    assert default_chunk_size(151_936) == 432  # 263 MB of fp32 logits
    assert 4 * 151_936 * default_chunk_size(151_936) <= CHUNK_BYTES
    assert default_chunk_size(2**30) == 1 and default_chunk_size(1000) % 16 == 0


class _Allocations(TorchDispatchMode):
    """Records (bytes, dtype, shape) of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((t.numel() * t.element_size(), t.dtype, tuple(t.shape), str(func)))
        return out


def _largest(fn):
    with _Allocations() as mode:
        fn()
    return max(mode.outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_allocates_the_logits(dtype):
    """No tensor of N x V fp32 elements (nor anything that large) in the forward and backward; the unfused
    path allocates one (so the check can fail). N > H keeps grad_weight [V, H] fp32 below N x V."""
    N, H, V = 300, 32, 1000
    h, w, _, t = _inputs(N, H, V, dtype, 0)
    limit = N * V * 4

    def fused():
        linear_cross_entropy(h, w, t, chunk_size=64).backward()

    def unfused():
        F.cross_entropy(F.linear(h, w).float(), t).backward()

    largest = _largest(fused)
    assert largest[0] < limit, f"the fused loss allocated {largest}, >= N x V fp32 ({limit} bytes)"
    assert largest[0] <= max(64 * V * 4, V * H * 4)  # a chunk's fp32 logits, or grad_weight's accumulator
    assert _largest(unfused)[0] >= limit
