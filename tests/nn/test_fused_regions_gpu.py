"""The MoE layer's fused regions (moe_kernels.nn.fused) against the registered custom ops: identical outputs
and gradients, one extension call per region (the router: one per kernel it runs), no host sync on
either path, and torch.compile(fullgraph=True) taking the registered ops."""

import contextlib

import pytest
import torch

from moe_kernels.nn import PRESETS, MoELayer, fused
from moe_kernels.testing import HostSyncError, assert_exact, extension_calls, no_host_sync, random_routing

pytestmark = pytest.mark.gpu

H, E, F, K = 32, 8, 16, 2

# The perf.md routing presets at a small size, and the options they do not cover.
CASES = {
    **{name: {} for name in PRESETS},
    "losses": dict(aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-3, z_loss_coeff=1e-3),
    "sigmoid-losses": dict(score="sigmoid", expert_bias=True, aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-3,
                           z_loss_coeff=1e-3),
    "pre-softmax-z": dict(pre_softmax=True, aux_loss_coeff=0.0, z_loss_coeff=1e-2),
    "softmax-bias": dict(pre_softmax=True, normalize=True, expert_bias=True, aux_loss_coeff=1e-2),
    "capacity-probs": dict(capacity_factor=0.75),
    "capacity-position": dict(capacity_factor=1.0, capacity_policy="position", z_loss_coeff=1e-3),
    "weights-in-activation": dict(weights_in_activation=True),
    "weights-in-activation-dropped": dict(weights_in_activation=True, capacity_factor=0.75, align=8),
    "no-losses": dict(aux_loss_coeff=0.0),
}


def _layer(case, device, dtype=torch.float32):
    name = case if case in PRESETS else "qwen3-30b-a3b"
    kw = dict(hidden_size=H, num_experts=E, ffn_size=F, k=K, **CASES[case])
    if name == "deepseek-v3":
        kw.update(num_groups=4, group_topk=2, shared_ffn_size=F)
    torch.manual_seed(0)
    layer = MoELayer(PRESETS[name](**kw)).to(device, dtype)
    layer.router.float()
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.1, 0.1, E))
    return layer


def _step(layer, x, g):
    """Forward + backward: (out, aux, dx, every parameter's grad)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, aux = layer(x)
    ((out.float() * g).sum() + aux).backward()
    return [out.detach(), aux.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.fixture
def registered_ops(monkeypatch):
    """Makes every MoE layer and router take the registered custom ops."""

    def use_ops():
        monkeypatch.setattr(fused, "launch_for", lambda x: None)

    return use_ops


def _inputs(device, dtype, T=24, B=2):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, generator=gen).to(device, dtype)
    g = torch.randn(B, T, H, generator=gen).to(device)
    return x, g


@pytest.mark.parametrize("case", list(CASES))
def test_fused_regions_equal_registered_ops(cuda, case, registered_ops):
    dtype = torch.bfloat16 if case in ("deepseek-v3", "mixtral-8x7b") else torch.float32
    layer = _layer(case, cuda, dtype)
    x, g = _inputs(cuda, dtype)
    _step(layer, x, g)  # the first call of a shape also asks for its workspace size
    with extension_calls() as ext:
        thin = _step(layer, x, g)
    assert ext.calls.get("moe_fwd") == ext.calls.get("moe_bwd") == 1, ext.calls
    shared = layer.shared_experts is not None  # the `mlp` region: experts_fwd / experts_bwd over one group
    if shared:
        assert ext.calls.get("experts_fwd") == ext.calls.get("experts_bwd") == 1, ext.calls
    registered_ops()
    with extension_calls() as ext:
        ops = _step(layer, x, g)
    assert "experts_fwd" not in ext.calls and ext.calls.get("grouped_mm") == 6 * (1 + shared), ext.calls
    names = ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, thin, ops):
        assert_exact(a, b, f"{case}: {name}")
    assert thin[1].item() > 0 or case in ("no-losses", "capacity-probs", "weights-in-activation")


def _expected_calls(cfg) -> int:
    """Extension launches of one layer fwd + bwd on the fused regions: the router (router_fused_fwd / _bwd,
    whatever losses are on; capacity adds apply_capacity and tokens_per_expert), then the routed experts as one
    region (moe_fwd / moe_bwd, the weights applied in the unpermute or in the activation); shared experts add the
    `mlp` region (experts_fwd / experts_bwd over one group)."""
    return 2 + (2 if cfg.router.capacity_factor is not None else 0) + 2 + (2 if cfg.shared_ffn_size else 0)


@pytest.mark.parametrize("case", list(CASES))
def test_one_extension_call_per_region(cuda, case):
    layer = _layer(case, cuda)
    x, g = _inputs(cuda, torch.float32)
    _step(layer, x, g)  # the first call of a shape also asks for its workspace size
    with extension_calls() as ext:
        _step(layer, x, g)
    calls = ext.calls
    once = ("moe_fwd", "moe_bwd")
    if layer.shared_experts is not None:
        assert calls["experts_fwd"] == calls["experts_bwd"] == 1, calls
    for name in ("router_fused_fwd", "router_fused_bwd", *once):
        assert calls[name] == 1, (name, calls)
    assert sum(calls.values()) == _expected_calls(layer.config), calls


@pytest.mark.parametrize("case", ["deepseek-v3", "losses", "capacity-probs", "weights-in-activation"])
@pytest.mark.parametrize("path", ["fused", "registered"])
def test_layer_has_no_host_sync(cuda, case, path, registered_ops):
    layer = _layer(case, cuda)
    x, g = _inputs(cuda, torch.float32)
    if path == "registered":
        registered_ops()
    with no_host_sync():
        _step(layer, x, g)


def test_no_host_sync_catches_a_sync(cuda):
    t = torch.ones(3, device=cuda)
    for read in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.nonzero(), lambda: t.tolist(),
                 lambda: int(t[0]), lambda: torch.equal(t, t)):
        with pytest.raises(HostSyncError), no_host_sync():
            read()
    assert t.sum().item() == 3.0  # restored on exit


def test_nvlink_virtual_ranks_have_no_host_sync(cuda):
    from moe_kernels.dispatch.nvlink import VirtualNvlinkWorld
    from moe_kernels.nn import GroupedExperts

    P, El = 2, E // 2
    torch.manual_seed(0)
    shards = [GroupedExperts(El, H, F, device=cuda) for _ in range(P)]
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=9, device=cuda)
    xs = [torch.randn(T, H, device=cuda, requires_grad=True) for T in (9, 6)]
    ws = [torch.rand(T, K, device=cuda, requires_grad=True) for T in (9, 6)]
    idx = [torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(cuda, torch.int32) for T in (9, 6)]
    with no_host_sync():
        ds = world.dispatch(xs, ws, idx, align=4)
        outs = world.combine([s(d.x, d.group_sizes) for s, d in zip(shards, ds)], [d.handle for d in ds])
        sum((o * o).sum() for o in outs).backward()
    assert all(x.grad is not None for x in xs)


def _compiled_equals_eager(layer, x, g) -> dict:
    """The layer under torch.compile(fullgraph=True) gives the eager layer's outputs and gradients bit for bit;
    returns the extension calls of the compiled step."""
    eager = _step(layer, x, g)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    layer.zero_grad(set_to_none=True)
    xc = x.detach().requires_grad_()
    with extension_calls() as ext:
        out, aux = compiled(xc)
        ((out.float() * g).sum() + aux).backward()
    got = [out.detach(), aux.detach(), xc.grad] + [p.grad for p in layer.parameters()]
    names = ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got, eager):
        assert_exact(a, b, f"compiled: {name}")
    return ext.calls


def test_compile_fullgraph_takes_registered_ops(cuda, registered_ops):
    x, g = _inputs(cuda, torch.float32)
    calls = _compiled_equals_eager(_layer("losses", cuda), x, g)
    assert "experts_fwd" not in calls and "grouped_mm" in calls, calls


# ---------------------------------------------------------------------------------------------------
# The gather-fused experts (MoEConfig.gather_experts, ops/expert_mlp.py)

GATHERED = ["qwen3-30b-a3b", "deepseek-v3", "capacity-probs", "losses"]


def _gathered_layer(case, device, dtype=torch.float32, gather=True):
    layer = _layer(case, device, dtype)
    layer.config = layer.config.replace(weights_in_activation=True, gather_experts=gather)
    return layer


@pytest.mark.parametrize("case", GATHERED)
def test_gathered_region_equals_registered_ops(cuda, case, registered_ops):
    layer = _gathered_layer(case, cuda)
    x, g = _inputs(cuda, torch.float32)
    _step(layer, x, g)
    assert layer.expert_path == "gathered"
    with extension_calls() as ext:
        thin = _step(layer, x, g)
    calls = ext.calls
    # router (its kernel each way; capacity adds two), the routing-only permute, the expert MLP each way: no
    # copy of the tokens, no unpermute launch of its own (deepseek-v3's shared experts: the `mlp` region each way).
    shared = 2 if layer.shared_experts is not None else 0
    assert calls.get("expert_mlp_fwd") == 1 and calls.get("expert_mlp_bwd") == 1 and calls.get("permute_fwd") == 1
    assert calls.get("experts_fwd", 0) == calls.get("experts_bwd", 0) == shared // 2, calls
    assert "unpermute_fwd" not in calls and "unpermute_bwd" not in calls, calls
    assert sum(calls.values()) == 2 + (2 if layer.config.router.capacity_factor is not None else 0) + 3 + shared, calls
    registered_ops()
    with extension_calls() as ext:
        ops = _step(layer, x, g)
    assert ext.calls.get("expert_mlp_fwd") == 1 and ext.calls.get("expert_mlp_bwd") == 1, ext.calls
    names = ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, thin, ops):
        assert_exact(a, b, f"{case}: {name}")


@pytest.mark.parametrize("case", GATHERED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_equals_the_permuted_path(cuda, case, dtype):
    """Same values as the layer over a permuted copy with the weights in the activation: bit for bit where both
    run the portable grouped GEMM (the CPU-executed kernels), within the grouped GEMMs' rounding on sm_90a
    (there the permuted path runs CUTLASS: another summation order)."""
    x, g = _inputs(cuda, dtype)
    gathered = _step(_gathered_layer(case, cuda, dtype), x, g)
    permuted_layer = _gathered_layer(case, cuda, dtype, gather=False)
    permuted = _step(permuted_layer, x, g)
    assert permuted_layer.expert_path == "fused"
    names = ["out", "aux_loss", "dx"] + [n for n, _ in permuted_layer.named_parameters()]
    for name, a, b in zip(names, gathered, permuted):
        if cuda.type == "cpu":
            assert_exact(a, b, f"{case}: {name}")
        else:  # bf16 outputs: a few roundings of bf16 apart; fp32: fp32 sums in another order
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=f"{case}: {name}")


@pytest.mark.parametrize("path", ["fused", "registered"])
def test_gathered_has_no_host_sync(cuda, path, registered_ops):
    layer = _gathered_layer("deepseek-v3", cuda)
    x, g = _inputs(cuda, torch.float32)
    if path == "registered":
        registered_ops()
    with no_host_sync():
        _step(layer, x, g)


def test_gathered_compile_fullgraph(cuda, registered_ops):
    x, g = _inputs(cuda, torch.float32)
    calls = _compiled_equals_eager(_gathered_layer("losses", cuda), x, g)
    assert calls.get("expert_mlp_fwd") == 1 and calls.get("expert_mlp_bwd") == 1, calls


@pytest.mark.parametrize("weights", ["unpermute", "activation"])
@pytest.mark.parametrize("batch", ["empty", "one-token", "hot-expert"])
def test_moe_region_edge_batches(cuda, batch, weights, registered_ops):
    """The routed experts' region (moe_fwd / moe_bwd; the routing weights in the unpermute or in the activation) on
    no tokens, one token, and every token on one expert (the other groups empty): identical to the registered ops."""
    layer = _layer("qwen3-30b-a3b" if weights == "unpermute" else "weights-in-activation", cuda)
    T = {"empty": 0, "one-token": 1, "hot-expert": 37}[batch]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, T, H, generator=gen).to(cuda)
    g = torch.randn(1, T, H, generator=gen).to(cuda)
    if batch == "hot-expert":
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[3] += 1.0  # positive inputs route to expert 3 first
        x = x.abs() + 0.1
    _step(layer, x, g)
    with extension_calls() as ext:
        thin = _step(layer, x, g)
    assert ext.calls.get("moe_fwd") == 1 and ext.calls.get("moe_bwd", 0) == (1 if T else 0), ext.calls
    registered_ops()
    ops = _step(layer, x, g)
    names = ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, thin, ops):
        assert_exact(a, b, f"{batch}: {name}")
    if T:
        assert thin[2].abs().sum() > 0 and thin[names.index("experts.w13")].abs().sum() > 0


@pytest.mark.parametrize("weights", ["unpermute", "activation"])
@pytest.mark.parametrize("how", ["checkpoint", "offload", "offload-unaligned"])
def test_moe_region_saved_tensors_move(cuda, how, weights):
    """The routed experts' region keeps its saved tensors as parts of one allocation: the backward finds them
    where the forward put them in a recomputed forward's allocation (non-reentrant activation checkpointing)
    and in the copy saved_tensors_hooks hand back (offloading), also at an address off the alignment the parts
    need (the region realigns it). The original allocation is overwritten once copied, so a backward that read
    it instead of the copy would differ: the same outputs and gradients as without checkpointing or hooks."""
    layer = _layer("deepseek-v3", cuda)
    if weights == "activation":
        layer.config = layer.config.replace(weights_in_activation=True)
    x, g = _inputs(cuda, torch.float32)
    _step(layer, x, g)
    plain = _step(layer, x, g)
    shift = {"offload": 256, "offload-unaligned": 4}.get(how, 0)

    originals = []

    def pack(t):
        if t.dtype != torch.uint8 or not t.numel():  # the inputs and parameters: as they are
            return t
        originals.append(t)
        buf = torch.empty(t.numel() + shift, dtype=torch.uint8, device=t.device)
        return buf[shift:].copy_(t)

    def run():
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        if how == "checkpoint":
            out, aux = torch.utils.checkpoint.checkpoint(layer, xx, use_reentrant=False)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out, aux = layer(xx)
            assert len(originals) == 1
            with torch.no_grad():
                originals.pop().fill_(0xFF)  # the region's own allocation, read by nothing else now: poisoned
        ((out.float() * g).sum() + aux).backward()
        return [out.detach(), aux.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    with extension_calls() as ext:
        moved = run()
    assert ext.calls.get("moe_bwd") == 1, ext.calls
    names = ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, moved, plain):
        assert_exact(a, b, f"{how}: {name}")


@pytest.mark.parametrize("weights", ["unpermute", "activation"])
@pytest.mark.parametrize("case", ["x-without-grad", "router-frozen", "experts-frozen", "autocast"])
def test_moe_region_partial_gradients(cuda, case, weights, registered_ops):
    """The routed experts' region (the routing weights in the unpermute or in the activation) when only some inputs
    need a gradient (no dx, no routing-weight gradient and so no saved expert output, no expert weight gradients)
    and under autocast (fp32 layer, bf16 kernels): identical to the registered ops."""
    layer = _layer("qwen3-30b-a3b" if weights == "unpermute" else "weights-in-activation", cuda)
    if case == "router-frozen":
        layer.router.requires_grad_(False)
    if case == "experts-frozen":
        layer.experts.requires_grad_(False)
    x, g = _inputs(cuda, torch.float32)

    def step():
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(case != "x-without-grad")
        ctx = torch.autocast(cuda.type, dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()
        with ctx:
            out, aux = layer(xx)
        loss = (out.float() * g).sum() + aux
        if loss.requires_grad:
            loss.backward()
        return [out.detach(), aux.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    step()
    with extension_calls() as ext:
        thin = step()
    assert ext.calls.get("moe_fwd") == 1, ext.calls
    registered_ops()
    ops = step()
    names = ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, thin, ops):
        assert (a is None) == (b is None), f"{case}: {name}"
        if a is not None:
            assert_exact(a, b, f"{case}: {name}")
    if case == "autocast":
        assert thin[0].dtype == torch.bfloat16
    if case == "x-without-grad":
        assert thin[2] is None and thin[names.index("experts.w13")] is not None


# ---------------------------------------------------------------------------------------------------
# The routed experts without a gate (Nemotron-H's) as the `moe_squared_relu` region


@pytest.mark.parametrize("routing", ["uniform", "hot", "empty", "dropped", "no-tokens", "one-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grads", ["all", "weights-none", "x-frozen"])
def test_moe_squared_relu_region_equals_registered_ops(cuda, routing, dtype, grads):
    """moe_fwd / moe_bwd with the squared ReLU (one extension call each way) against the region's composition of
    the registered ops (permute, grouped_mm, squared_relu, grouped_mm, unpermute): identical outputs and gradients
    of x, the routing weights and both expert weights, over routings with hot, empty and dropped experts, no
    tokens and one token, with the routing weights absent (a plain sum) and x without a gradient."""
    T = {"no-tokens": 0, "one-token": 1}.get(routing, 37)
    kind = {"dropped": "uniform", "no-tokens": "uniform", "one-token": "uniform"}.get(routing, routing)
    idx = random_routing(T, E, K, kind=kind, drop=0.25 if routing == "dropped" else 0.0, seed=4).to(cuda)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen).to(cuda, dtype)
    w = torch.rand(T, K, generator=gen).to(cuda)
    w_up = (0.3 * torch.randn(E, F, H, generator=gen)).to(cuda, dtype)
    w2 = (0.3 * torch.randn(E, H, F, generator=gen)).to(cuda, dtype)
    g = torch.randn(T, H, generator=gen).to(cuda, dtype)

    def step(thin):
        launch = fused.launch_for(x) if thin else None  # (resolved inside extension_calls: the counting module)
        assert launch is not None or not thin
        xx = x.detach().requires_grad_(grads != "x-frozen")
        ww = None if grads == "weights-none" else w.detach().requires_grad_()
        up, down = w_up.detach().requires_grad_(), w2.detach().requires_grad_()
        out = fused.run("moe_squared_relu", launch, xx, idx, ww, up, down, E, 1)
        (out.float() * g.float()).sum().backward()
        return [out.detach(), xx.grad, None if ww is None else ww.grad, up.grad, down.grad]

    step(True)
    with extension_calls() as ext:
        thin = step(True)
    assert ext.calls.get("moe_fwd") == 1 and ext.calls.get("moe_bwd", 0) == (1 if T else 0), ext.calls
    ops = step(False)
    for name, a, b in zip(["out", "dx", "dweights", "dw_up", "dw2"], thin, ops):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_exact(a, b, f"{routing} {dtype} {grads}: {name}")
    if T and routing != "hot":
        assert thin[0].abs().sum() > 0 and thin[3].abs().sum() > 0 and thin[4].abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# The shared experts as the `mlp` region (experts_fwd / experts_bwd over one group of every row)


def _shared(device, dtype=torch.float32, gate=False, seed=3):
    from moe_kernels.nn import SharedExperts

    torch.manual_seed(seed)
    return SharedExperts(H, 2 * F, gate=gate).to(device, dtype)


def _mlp_step(mlp, x, g, kernels, launch=None, grad_x=True, ctx=contextlib.nullcontext):
    mlp.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_(grad_x)
    with ctx():
        out = mlp(xx, kernels=kernels, launch=launch)
    loss = (out.float() * g).sum()
    if loss.requires_grad:
        loss.backward()
    return [out.detach(), xx.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("case", ["fp32", "bf16", "empty", "one-token", "odd", "x-without-grad", "gate-frozen",
                                  "down-frozen", "autocast", "shared-gate"])
def test_mlp_region_equals_registered_ops(cuda, case):
    """The dense SwiGLU MLP region on its thin path against its registered-op composition (grouped_mm over one
    group of every row, swiglu): identical outputs and gradients, one extension call each way, over batch
    edges (no token, one, an odd count), partial gradients, autocast and Qwen2-MoE's sigmoid gate."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    mlp = _shared(cuda, dtype, gate=case == "shared-gate")
    T = {"empty": 0, "one-token": 1, "odd": 37}.get(case, 24)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=gen).to(cuda, dtype)
    g = torch.randn(T, H, generator=gen).to(cuda)
    if case == "gate-frozen":
        mlp.gate_proj.requires_grad_(False)
    if case == "down-frozen":
        mlp.down_proj.requires_grad_(False)
    autocast = (lambda: torch.autocast(cuda.type, dtype=torch.bfloat16)) if case == "autocast" else (
        contextlib.nullcontext)
    kw = dict(grad_x=case != "x-without-grad", ctx=autocast)
    launch = fused.launch_for(x)
    assert launch is not None
    _mlp_step(mlp, x, g, True, launch, **kw)
    with extension_calls() as ext:
        thin = _mlp_step(mlp, x, g, True, fused.launch_for(x), **kw)
    assert ext.calls.get("experts_fwd", 0) == (1 if T else 0) and ext.calls.get("experts_bwd", 0) == (1 if T else 0)
    assert sum(ext.calls.values()) == (2 if T else 0), ext.calls
    with extension_calls() as ext:
        ops = _mlp_step(mlp, x, g, True, None, **kw)
    products = 6 - (case == "x-without-grad") - (case == "down-frozen")  # the products the gradients need
    assert "experts_fwd" not in ext.calls and ext.calls.get("grouped_mm", 0) == (products if T else 0), ext.calls
    names = ["out", "dx"] + [n for n, _ in mlp.named_parameters()]
    for name, a, b in zip(names, thin, ops):
        assert (a is None) == (b is None), f"{case}: {name}"
        if a is not None:
            assert_exact(a, b, f"{case}: {name}")
    frozen = {"gate-frozen": "gate_proj.weight", "down-frozen": "down_proj.weight"}.get(case)
    for name, grad in zip(names, thin):
        assert (grad is None) == (name == frozen or (name == "dx" and case == "x-without-grad")), name
        if grad is not None and T and name != "out":
            assert grad.abs().sum() > 0, f"{case}: {name} is zero"
        if grad is not None and not T and name != "out":
            assert not grad.abs().sum(), f"{case}: {name} is not zero without tokens"


def test_mlp_region_computes_the_modules_mlp(cuda):
    """The region is the nn.Linear modules' MLP (gate rows first, then up, as SwiGLU reads them), not just equal
    to its own composition: fp32 against the modules' forward and backward in float64. Error model: each fp32
    product of K <= 2F = 64 terms (inputs of order 1) rounds to within about K * 2^-24 * sum|terms| ~ 4e-6 per
    GEMM, three GEMMs and the SwiGLU chained, fwd or bwd; bound 1e-4 (over 20x margin)."""
    mlp = _shared(cuda)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(29, H, generator=gen).to(cuda)
    g = torch.randn(29, H, generator=gen).to(cuda)
    thin = _mlp_step(mlp, x, g, True, fused.launch_for(x))
    ref = _mlp_step(mlp.double(), x.double(), g.double(), False)
    names = ["out", "dx"] + [n for n, _ in mlp.named_parameters()]
    for name, a, b in zip(names, thin, ref):
        err = (a.double() - b).abs().max().item()
        assert err < 1e-4, f"{name}: {err}"
        assert b.abs().max() > 0.05, name  # the comparison is not between two near-zero tensors


def test_mlp_region_falls_back_to_the_modules(cuda):
    """Where the region would skip what the modules do, the modules run: a forward hook on a projection, a
    global forward hook, a bias, a replaced projection (as peft's LoRA makes)."""
    x = torch.randn(8, H, device=cuda)
    for change in ("hook", "global-hook", "bias", "replaced"):
        mlp = _shared(cuda)
        seen = []
        handle = None
        if change == "hook":
            mlp.up_proj.register_forward_hook(lambda m, args, out: seen.append(1))
        elif change == "global-hook":
            handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(1))
        elif change == "bias":
            mlp.down_proj.bias = torch.nn.Parameter(torch.ones(H, device=cuda))
        else:
            mlp.gate_proj = torch.nn.Sequential(mlp.gate_proj)
        try:
            with extension_calls() as ext:
                out = mlp(x, kernels=True, launch=fused.launch_for(x))
        finally:
            if handle is not None:
                handle.remove()
        assert "experts_fwd" not in ext.calls, (change, ext.calls)
        assert_exact(out, mlp(x), change)
        if change in ("hook", "global-hook"):
            assert seen, change


def _routed_layer(cuda, shared=0):
    from moe_kernels.nn import MoEConfig, MoELayer, RouterConfig

    torch.manual_seed(0)
    return MoELayer(MoEConfig(router=RouterConfig(hidden_size=32, num_experts=4, k=2), ffn_size=16,
                              shared_ffn_size=shared)).to(cuda)


def test_routed_experts_fall_back_to_the_module(cuda):
    """The fused regions read the routed experts' weights instead of calling the experts module; where the module
    would do more they call it: hooks on it (and global ones), a subclass in its place, pruning's parametrizing
    pre-hook (its weight recomputed every forward), and no fused launch for the experts."""
    from torch.nn.utils import prune

    from moe_kernels.nn import GroupedExperts

    class Doubled(GroupedExperts):
        def forward(self, *args, **kwargs):
            return 2 * super().forward(*args, **kwargs)

    x = torch.randn(16, 32, device=cuda)
    for change in ("hook", "global-hook", "subclass", "prune"):
        layer = _routed_layer(cuda)
        with torch.no_grad():
            base = layer(x)[0]
        seen, handle = [], None
        if change == "hook":
            layer.experts.register_forward_pre_hook(lambda m, args: seen.append(1))
        elif change == "global-hook":
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda m, args, out: seen.append(1) if isinstance(m, GroupedExperts) else None)
        elif change == "subclass":
            doubled = Doubled(4, 32, 16).to(cuda)
            doubled.load_state_dict(layer.experts.state_dict())
            layer.experts = doubled
        else:
            prune.random_unstructured(layer.experts, "w13", amount=0.5)
        try:
            with extension_calls() as ext:
                out, aux = layer(x)
            out.square().mean().backward()  # (pruning: a stale w13 would be backed through twice)
        finally:
            if handle is not None:
                handle.remove()
        assert layer.expert_path == "ops" and "moe_fwd" not in ext.calls, (change, ext.calls)
        if change in ("hook", "global-hook"):
            assert seen, change
        if change == "subclass":
            torch.testing.assert_close(out, 2 * base, rtol=1e-5, atol=1e-6)
        if change == "prune":
            with torch.no_grad():
                want = layer.experts.w13_orig * layer.experts.w13_mask
            assert torch.equal(layer.experts.w13, want)
    layer = _routed_layer(cuda)
    layer(x)
    assert layer.expert_path == "fused"  # and as it is, the fused region


@pytest.mark.parametrize("offload", ["model", "experts", "shared"])
def test_accelerate_offloading(cuda, offload):
    """accelerate's offloading keeps the weights on the meta device and loads them around each module's forward
    (replacing `forward` on the instance): the layer calls the modules, with the model's own outputs."""
    accelerate = pytest.importorskip("accelerate")
    layer = _routed_layer(cuda, shared=16).eval()
    x = torch.randn(16, 32, device=cuda)
    with torch.no_grad():
        want = layer(x)[0]
    target = {"model": layer, "experts": layer.experts, "shared": layer.shared_experts}[offload]
    accelerate.cpu_offload(target, execution_device=cuda)
    assert any(p.device.type == "meta" for p in target.parameters())
    with torch.no_grad():
        got = layer(x)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
