import pytest
import torch

import moe_kernels as mk
from moe_kernels.nn import Router, RouterConfig


def _deepseek(**kw):
    base = dict(hidden_size=32, num_experts=16, k=4, score="sigmoid", num_groups=4, group_topk=2,
                scaling_factor=2.5, expert_bias=True)
    return RouterConfig(**{**base, **kw})


def test_outputs_match_ops():
    torch.manual_seed(0)
    router = Router(_deepseek())
    x = torch.randn(10, 32)
    out = router(x)
    logits = x @ router.weight.t()
    torch.testing.assert_close(out.logits, logits)
    w, idx = mk.router_topk(logits, 4, score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
                            expert_bias=router.expert_bias)
    assert torch.equal(out.indices, idx) and torch.equal(out.weights, w)
    assert out.aux_loss.item() == 0.0
    assert torch.equal(out.tokens_per_expert, mk.tokens_per_expert(idx, 16))


def test_router_runs_in_fp32_under_autocast():
    router = Router(RouterConfig(hidden_size=16, num_experts=8, k=2))
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    assert out.logits.dtype == torch.float32 and out.weights.dtype == torch.float32


def test_losses_sum_and_gradient():
    torch.manual_seed(1)
    cfg = RouterConfig(hidden_size=16, num_experts=8, k=2, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.001,
                       z_loss_coeff=1e-3)
    router = Router(cfg)
    x = torch.randn(12, 16)
    out = router(x, seq_len=4)
    scores, aux_idx = mk.router_aux_scores(out.logits, 2)
    expected = (mk.aux_loss(scores, mk.tokens_per_expert(aux_idx, 8), 2, 0.01)
                + mk.seq_aux_loss(scores, aux_idx, 0.001, seq_len=4) + mk.z_loss(out.logits, 1e-3))
    torch.testing.assert_close(out.aux_loss, expected)
    (out.weights.sum() + out.aux_loss).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="seq_len"):
        router(x)


def test_capacity_drops():
    torch.manual_seed(2)
    router = Router(RouterConfig(hidden_size=8, num_experts=4, k=2, capacity_factor=0.5))
    out = router(torch.randn(32, 8) * 4)
    assert int(out.tokens_per_expert.max()) <= mk.ops.capacity(32, 2, 4, 0.5)
    assert bool(((out.indices == -1) == (out.weights == 0)).all())


def test_expert_bias_update_hook_balances():
    torch.manual_seed(3)
    router = Router(_deepseek(bias_update_rate=0.05))
    with torch.no_grad():
        router.weight[0] += 2.0  # expert 0 hot for positive inputs
    opt = torch.optim.SGD(router.parameters(), lr=0.0)
    router.register_bias_update_hook(opt)
    x = torch.randn(256, 32).abs()
    first = router(x).tokens_per_expert.clone()
    opt.step()
    assert router.expert_bias[int(first.argmax())] < 0 and router.tokens_seen.sum() == 0
    for _ in range(40):
        router(x)
        opt.step()
    assert router(x).tokens_per_expert.max() < first.max()


def test_softmax_expert_bias_balances():
    # aux-loss-free balancing on a softmax router (ERNIE-4.5's routing): the bias is added to the probabilities
    torch.manual_seed(3)
    router = Router(RouterConfig(hidden_size=32, num_experts=8, k=2, pre_softmax=True, normalize=True,
                                 expert_bias=True, bias_update_rate=0.02))
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 chosen by every positive input
    opt = torch.optim.SGD(router.parameters(), lr=0.0)
    router.register_bias_update_hook(opt)
    x = torch.randn(256, 32).abs()
    first = router(x)
    torch.testing.assert_close(first.weights.sum(-1), torch.ones(256))  # renormalised over the k
    assert int(first.tokens_per_expert[0]) == 256
    opt.step()
    assert router.expert_bias[0] < 0 and bool((router.expert_bias[first.tokens_per_expert < 64] > 0).all())
    peak = []
    for _ in range(60):
        peak.append(int(router(x).tokens_per_expert.max()))
        opt.step()
    # the bias moves tokens off the hot expert (sign steps of a fixed size then oscillate around the balance)
    assert peak[0] == 256 and min(peak) < 200


def test_config_validation():
    with pytest.raises(ValueError, match="expert_bias"):
        RouterConfig(hidden_size=8, num_experts=8, k=2, expert_bias=True)  # softmax by logits: no bias
    with pytest.raises(ValueError, match="k must"):
        RouterConfig(hidden_size=8, num_experts=8, k=9)
    with pytest.raises(ValueError, match="go together"):
        RouterConfig(hidden_size=8, num_experts=8, k=2, num_groups=2)
    with pytest.raises(TypeError):
        RouterConfig(8, 8, 2)  # keyword-only
