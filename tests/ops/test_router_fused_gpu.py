"""router_fused on the GPU: the kernel each way against the CPU reference (fp32) and fp64, on fresh random
logits: weights and the loss within 2x torch's fp32 error of fp64, indices and counts exact (near-ties of the
selection allowed as in router_topk), the gradient of the logits likewise; edge cases (no tokens, one token,
one hot expert, odd sizes, the largest E), determinism, the ticket counter left at zero, and bad input."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels import _ext
from moe_kernels._ext import reference_ops
from moe_kernels.ops.router_fused import FUSED_MAX_EXPERTS, router_fused_reference
from moe_kernels.testing import assert_close_to_fp64, assert_exact
from tests.emulation import skip_if_too_large
from tests.ops.test_router_gpu import assert_grad_close, assert_same_choice

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**19  # logits per case: two passes and a top-k per token, twice with a balancing loss

CONFIGS = {
    "softmax-aux": dict(score="softmax", aux_coeff=1e-2),
    "softmax-all": dict(score="softmax", aux_coeff=1e-2, seq_coeff=1e-3, z_coeff=1e-3),
    "pre-softmax-z": dict(score="softmax", pre_softmax=True, z_coeff=1e-2),
    "deepseek": dict(score="sigmoid", num_groups=4, group_topk=2, group_score_topk=2, scaling_factor=2.5,
                     bias=True, seq_coeff=1e-4),
    "sqrtsoftplus-all": dict(score="sqrtsoftplus", bias=True, aux_coeff=1e-2, seq_coeff=1e-3, z_coeff=1e-3),
    "no-losses": dict(score="sigmoid", normalize=False),
    "softmax-bias-aux": dict(score="softmax", pre_softmax=True, normalize=True, bias=True, aux_coeff=1e-2),
}
# (T, E, k, seq_len): no tokens, one token, rows not a multiple of the 64-row chunk, several chunks per
# sequence, E not a multiple of 32 (nor of 4: the last block's single-float sums), the largest E, a deepseek-v3
# shape (GPU only), and more chunks (one-token sequences) than the capped grid has blocks, so a block zeroes
# its shared sums for a second chunk after reading the first's (every loss on: softmax-all only).
SHAPES = [(0, 8, 2, 4), (1, 8, 1, 1), (130, 16, 4, 65), (300, 40, 3, 100), (200, 6, 2, 50), (2048, 128, 8, 512),
          (64, 1024, 32, 32), (16384, 256, 8, 4096), (4160, 8, 2, 1)]


def _cases():
    for name, cfg in CONFIGS.items():
        for T, E, k, S in SHAPES:
            if "num_groups" in cfg and (E % cfg["num_groups"] or E // cfg["num_groups"] < cfg["group_score_topk"]):
                continue
            if T // S > 4096 and name != "softmax-all":
                continue
            yield name, T, E, k, S


def _args(cfg, E, k, S, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    kw = {key: v for key, v in cfg.items() if key != "bias"}
    kw["expert_bias"] = torch.randn(E, generator=gen) * 0.05 if cfg.get("bias") else None
    kw["seq_len"] = S
    return kw


def _run(logits, k, kw, gw, gl):
    x = logits.detach().clone().requires_grad_()
    out = mk.router_fused(x, k, **kw)
    (out[0] * gw).sum().add(out[5] * gl).backward()
    return [o.detach() for o in out], x.grad


@pytest.mark.parametrize("name,T,E,k,S", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_fused_matches_reference(cuda, name, T, E, k, S, dtype):
    skip_if_too_large(T * E, EMULATION_BUDGET, "logits")
    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(T * 7 + E)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    gw = torch.randn(T, k, generator=gen)
    gl = 3.0
    kw = _args(cfg, E, k, S, T)
    out, grad = _run(logits.to(cuda), k, {**kw, "expert_bias": None if kw["expert_bias"] is None else kw["expert_bias"].to(cuda)},
                     gw.to(cuda), gl)
    with reference_ops():
        ref, ref_grad = _run(logits, k, kw, gw, gl)
        kw64 = {**kw, "expert_bias": None if kw["expert_bias"] is None else kw["expert_bias"].double()}
        ref64, ref64_grad = _run(logits.double(), k, kw64, gw.double(), gl)
    w, idx, counts, aux_counts, seq_counts, loss = (o.cpu() for o in out)
    from moe_kernels.ops.router import router_selection_scores

    sel = router_selection_scores(logits, cfg["score"], cfg.get("pre_softmax", False), kw["expert_bias"])
    assert_same_choice(idx, ref[1], sel, cfg, f"{name} indices")
    same = (idx == ref[1]).all(1)
    if bool(same.all()):
        assert_exact(counts, ref[2], f"{name} counts")
        assert_exact(aux_counts, ref[3], f"{name} aux counts")
        assert_exact(seq_counts, ref[4], f"{name} sequence counts")
    else:
        assert int(counts.sum()) == T * k
    assert_close_to_fp64(w[same], ref[0][same], ref64[0][same], f"{name} weights")
    if bool(same.all()):
        assert_close_to_fp64(loss, ref[5], ref64[5], f"{name} loss", floor=1e-7)
        assert_grad_close(grad.cpu()[same].to(dtype), ref_grad[same].to(dtype), ref64_grad[same], dtype,
                          f"{name} grad logits")


def test_router_fused_edge_cases(cuda):
    # One hot expert: every token's logits favour expert 3 (softmax, aux + z losses on); no tokens.
    T, E, k = 200, 16, 2
    logits = torch.randn(T, E)
    logits[:, 3] += 20
    kw = dict(aux_coeff=1e-2, z_coeff=1e-3)
    out = mk.router_fused(logits.to(cuda), k, **kw)
    with reference_ops():
        ref = mk.router_fused(logits, k, **kw)
    assert int(out[2][3]) == T and int(out[3][3]) == T
    assert_exact(out[2].cpu(), ref[2], "hot expert counts")
    torch.testing.assert_close(out[5].cpu(), ref[5], rtol=1e-5, atol=0)
    empty = mk.router_fused(torch.zeros(0, E, device=cuda), k, aux_coeff=1e-2, seq_coeff=1e-3, seq_len=8, z_coeff=1e-3)
    assert empty[0].shape == (0, k) and empty[4].shape == (0, E)
    assert int(empty[2].abs().sum()) == 0 and int(empty[3].abs().sum()) == 0 and float(empty[5]) == 0.0


def test_router_fused_is_deterministic_and_leaves_the_counter_at_zero(cuda):
    logits = torch.randn(4099, 64, device=cuda) if not _ext.emulation() else torch.randn(333, 64, device=cuda)
    kw = dict(aux_coeff=1e-2, seq_coeff=1e-3, seq_len=logits.shape[0], z_coeff=1e-3)
    a = mk.router_fused(logits, 4, **kw)
    b = mk.router_fused(logits, 4, **kw)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_exact(x.cpu(), y.cpu(), f"output {i} of two calls")
    assert all(int(c.sum()) == 0 for c in _ext._counters.values())


def test_router_fused_bad_input(cuda):
    logits = torch.randn(12, 8, device=cuda)
    with pytest.raises(ValueError, match="not whole sequences of `seq_len`=5"):
        mk.router_fused(logits, 2, seq_coeff=1e-3, seq_len=5)
    with pytest.raises(ValueError, match="`z_coeff` must be >= 0"):
        mk.router_fused(logits, 2, z_coeff=-1.0)
    with pytest.raises(ValueError, match="`k`"):
        mk.router_fused(logits, 9)
    # The backward op reads the counts the forward wrote: missing or mis-shaped counts are refused before the kernel.
    T, E, k = 10, 8, 2
    args = (torch.randn(T, k, device=cuda), torch.ones((), device=cuda), torch.randn(T, E, device=cuda),
            torch.zeros(T, k, dtype=torch.int32, device=cuda))
    i32 = dict(dtype=torch.int32, device=cuda)
    bwd = torch.ops.moe_kernels.router_fused_bwd
    with pytest.raises(ValueError, match="`aux_counts` must be \\[8\\] with aux_coeff > 0"):
        bwd(*args, torch.zeros(0, **i32), torch.zeros(0, E, **i32), k, "softmax", False, True, 1.0, 1e-2, 0.0, 1, 0.0)
    with pytest.raises(ValueError, match="not whole sequences of `seq_len`=4"):
        bwd(*args, torch.zeros(0, **i32), torch.zeros(2, E, **i32), k, "softmax", False, True, 1.0, 0.0, 1e-2, 4, 0.0)
    with pytest.raises(ValueError, match="below fp32's range"):
        mk.router_fused(logits, 2, aux_coeff=1e-45)
    if _ext.kernels("router_fused", logits) is not None:
        with pytest.raises(ValueError, match=f"at most {FUSED_MAX_EXPERTS} experts"):
            mk.router_fused(torch.randn(4, FUSED_MAX_EXPERTS + 32, device=cuda), 2)


def test_kernel_limit_matches_the_extension(cuda):
    C = _ext.kernels("router_fused", torch.empty(0, device=cuda))
    if C is None:
        pytest.skip("no extension for this device")
    assert C.router_fused_max_experts == FUSED_MAX_EXPERTS


@pytest.mark.slow
def test_router_fused_past_2_31_logits(cuda):
    # 2^21 + 3 tokens x 1024 experts: 2^31 + 3072 bf16 logits. Rows far apart checked against the reference,
    # the counts against the indices, the loss against torch on the device.
    skip_if_too_large(2**31, EMULATION_BUDGET, "logits")
    T, E, k = 2**21 + 3, 1024, 2
    logits = torch.randn(T, E, device=cuda, dtype=torch.bfloat16)
    w, idx, counts, aux_counts, _, loss = mk.router_fused(logits, k, aux_coeff=1e-2)
    rows = torch.tensor([0, 1, T // 2, T - 2, T - 1], device=cuda)
    with reference_ops():
        ref = router_fused_reference(logits[rows].cpu(), None, k, "softmax", False, 1, 1, 1, 1.0, True, 0.0, 0.0, 1, 0.0)
    assert_exact(idx[rows].cpu(), ref[1], "indices of far rows")
    assert int(counts.sum()) == T * k and int(aux_counts.sum()) == T * k
    scores = torch.softmax(logits.float(), -1).sum(0)
    want = (scores.double() * aux_counts.double()).sum() * 1e-2 * E / (k * T * T)
    torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=0)
