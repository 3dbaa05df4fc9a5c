import contextlib

import pytest
import torch

import moe_kernels as mk
from moe_kernels.nn import Router, RouterConfig, fused
from moe_kernels.testing import assert_exact, extension_calls


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


# The gating linear keeps x, not its fp32 copy (moe_kernels.nn.gating and the router region).

def _saved_by(fn):
    """fn()'s result and the tensors its autograd nodes keep for the backward."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved


def _gating_case(device, dtype, T=12, H=40, E=16):
    torch.manual_seed(0)
    cfg = _deepseek(hidden_size=H, num_experts=E, aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-3, z_loss_coeff=1e-3)
    router = Router(cfg).to(device)
    router.expert_bias.copy_(torch.linspace(-0.1, 0.1, E))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    g_w, g_logits = torch.randn(T, cfg.k, generator=gen).to(device), torch.randn(T, E, generator=gen).to(device)
    return router, x, g_w, g_logits


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward hands back no gradient (None)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return None


def _gating_step(router, x, g_w, g_logits, route, forward_in=contextlib.nullcontext):
    """(logits, weights, loss, dx, dW) of one forward (in forward_in()) and backward: the loss of the routing weights
    (g_w) and the router's losses, and one of the logits when g_logits is given (g_w None: that one alone; both None:
    the weights pass a node that hands back no gradient, and x has a gradient of its own, 2 x)."""
    router.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with forward_in():
        weights, _, _, loss, logits = route(x)
    if g_w is None and g_logits is None:
        total = _NoGradient.apply(weights).sum() + (x.float() ** 2).sum()
    else:
        total = 0 if g_w is None else (weights * g_w).sum() + loss
    if g_logits is not None:
        total = total + (logits * g_logits).sum()
    total.backward()
    return [logits.detach(), weights.detach(), loss.detach(), x.grad, router.weight.grad]


def _router_outputs(router):
    def route(x):
        out = router(x, seq_len=x.shape[0] // 2)
        return out.weights, out.indices, out.tokens_per_expert, out.aux_loss, out.logits
    return route


def _linear_on_the_copy(router):
    """The composition the gating replaced: autograd's linear on x's fp32 copy, then the registered ops."""
    def route(x):
        logits = torch.nn.functional.linear(x.float(), router.weight)
        return (*router.route_with_ops(logits, x.shape[0] // 2), logits)
    return route


def _takes_the_region(router, x, thin: bool | None) -> None:
    """thin True: the router region's autograd node must run here (its kernels called straight), False: the
    registered ops, None: whichever this device takes. Checked on a call after the first (which also asks for the
    kernel's workspace size)."""
    launch = fused.launch_for(x)
    assert thin is None or thin == (launch is not None), (thin, launch)
    logits = _router_outputs(router)(x.detach().requires_grad_())[4]
    region = type(logits.grad_fn).__name__ == "_RouterBackward"  # (the registered ops' logits: the gating's node)
    assert region == (launch is not None), type(logits.grad_fn).__name__
    if launch is None:
        return
    with extension_calls() as ext:
        _router_outputs(router)(x)
    assert ext.calls.get("router_fused_fwd") == 1, ext.calls


def check_gating_keeps_x(device, dtype, frozen=False, thin=None):
    """frozen: the router weight needs no gradient, so nothing keeps x for it."""
    router, x, _, _ = _gating_case(device, dtype)
    router.weight.requires_grad_(not frozen)
    x.requires_grad_()
    _takes_the_region(router, x, thin)
    _, saved = _saved_by(lambda: router(x, seq_len=x.shape[0] // 2))
    big = [t for t in saved if t is not None and t.shape == x.shape]
    if frozen:  # as autograd's linear keeps it: the weight, for x's gradient, and no x
        assert not big, [(t.dtype, tuple(t.shape)) for t in big]
        return
    assert big, [(t.dtype, tuple(t.shape)) for t in saved]
    for t in big:  # x itself: no [T, H] copy in fp32 (4 bytes an element where x has 2)
        assert t.dtype == dtype and t.data_ptr() == x.data_ptr(), (t.dtype, tuple(t.shape))
    # The composition it replaced kept the copy (so the check above can fail).
    _, saved = _saved_by(lambda: _linear_on_the_copy(router)(x))
    assert any(t.shape == x.shape and t.dtype == torch.float32 for t in saved)


def check_gating_equals_linear_on_the_copy(device, dtype, losses, thin=None, frozen=False):
    """losses: "routing" (the weights and the router's losses), "routing+logits", "logits" (only the logits reach the
    router), "none" (no gradient reaches it). thin: _takes_the_region's."""
    router, x, g_w, g_logits = _gating_case(device, dtype)
    router.weight.requires_grad_(not frozen)
    _takes_the_region(router, x, thin)
    g_w = None if losses in ("logits", "none") else g_w
    g_logits = g_logits if "logits" in losses else None
    got = _gating_step(router, x, g_w, g_logits, _router_outputs(router))
    want = _gating_step(router, x, g_w, g_logits, _linear_on_the_copy(router))
    for name, a, b in zip(("logits", "weights", "loss", "dx", "dW"), got, want):
        if b is None:  # (a frozen weight)
            assert a is None, f"{dtype}: {name}"
        else:
            assert_exact(a, b, f"{dtype}: {name}")


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gating_keeps_x_not_its_fp32_copy(dtype, frozen):
    check_gating_keeps_x(torch.device("cpu"), dtype, frozen)


@pytest.mark.parametrize("losses", ["routing", "routing+logits", "logits", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gating_equals_autograd_linear_on_the_copy(dtype, losses):
    check_gating_equals_linear_on_the_copy(torch.device("cpu"), dtype, losses)


def test_frozen_gating_equals_autograd_linear_on_the_copy():
    check_gating_equals_linear_on_the_copy(torch.device("cpu"), torch.bfloat16, "routing", frozen=True)


def test_gating_under_autocast_equals_without():
    router, x, g_w, _ = _gating_case(torch.device("cpu"), torch.bfloat16)
    want = _gating_step(router, x, g_w, None, _router_outputs(router))
    got = _gating_step(router, x, g_w, None, _router_outputs(router),
                       forward_in=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for name, a, b in zip(("logits", "weights", "loss", "dx", "dW"), got, want):
        assert_exact(a, b, f"autocast: {name}")


def test_gating_without_grad_keeps_nothing():
    router, x, _, _ = _gating_case(torch.device("cpu"), torch.bfloat16)
    with torch.no_grad():
        out, saved = _saved_by(lambda: router(x, seq_len=x.shape[0] // 2))
    assert not saved and out.logits.dtype == torch.float32
