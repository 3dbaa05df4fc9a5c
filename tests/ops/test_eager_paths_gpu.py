"""The public ops called eagerly take their kernels directly (moe_kernels._ext.eager): outputs and gradients
equal the registered custom ops' bit for bit, no registered op is dispatched, and the registered op takes over
under torch.compile and in the checking mode."""

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_kernels as mk
from moe_kernels import _ext
from moe_kernels.testing import assert_exact

pytestmark = pytest.mark.gpu


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _both(monkeypatch, fn, *inputs):
    """fn on the eager path and on the registered ops: (outputs and input grads) twice, and the ops dispatched."""
    results, dispatched = [], []
    for eager in (True, False):
        if not eager:
            monkeypatch.setattr(_ext, "eager", lambda t: None)
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        with _Ops() as ops:
            outs = fn(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            diff = [o for o in outs if o.requires_grad]
            if diff:
                gen = torch.Generator().manual_seed(3)
                grads = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in diff]
                torch.autograd.backward(diff, grads)
        results.append([o.detach() for o in outs] + [x.grad for x in xs if x.grad is not None])
        dispatched.append({n for n in ops.names if n.startswith("moe_kernels.")})
        monkeypatch.undo()
    return results, dispatched


ROUTER = {
    "softmax": dict(),
    "pre-softmax": dict(pre_softmax=True),
    "deepseek": dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True),
    "sqrtsoftplus": dict(score="sqrtsoftplus", normalize=False),
}


@pytest.mark.parametrize("name", list(ROUTER))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_topk_eager_equals_registered(cuda, monkeypatch, name, dtype):
    kw = dict(ROUTER[name])
    bias = torch.randn(32, device=cuda) * 0.1 if kw.pop("bias", False) else None
    logits = torch.randn(70, 32).to(cuda, dtype)
    (eager, registered), (d_eager, d_registered) = _both(
        monkeypatch, lambda x: mk.router_topk(x, 4, expert_bias=bias, **kw), logits)
    assert not d_eager and "moe_kernels.router_topk" in d_registered, (d_eager, d_registered)
    for i, (a, b) in enumerate(zip(eager, registered)):
        assert_exact(a, b, f"router_topk {name}: output {i}")


@pytest.mark.parametrize("T", [0, 1, 200])
def test_losses_and_counts_eager_equal_registered(cuda, monkeypatch, T):
    E, k, S = 16, 4, (T if T else 1)
    scores = torch.softmax(torch.randn(T, E), -1).to(cuda)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(cuda, torch.int32) if T else \
        torch.zeros(0, k, dtype=torch.int32, device=cuda)
    counts = mk.tokens_per_expert(idx, E)
    cases = {
        "aux_loss": (lambda s: mk.aux_loss(s, counts, k, 1e-2), scores),
        "aux_loss int64 counts": (lambda s: mk.aux_loss(s, counts.long(), k, 1e-2), scores),
        "seq_aux_loss": (lambda s: mk.seq_aux_loss(s, idx, 1e-3, seq_len=S), scores),
        "z_loss": (lambda x: mk.z_loss(x, 1e-3), torch.randn(T, E).to(cuda)),
        "tokens_per_expert": (lambda i: mk.tokens_per_expert(i, E), idx),
    }
    for name, (fn, x) in cases.items():
        (eager, registered), (d_eager, d_registered) = _both(monkeypatch, fn, x)
        assert not d_eager and d_registered, (name, d_eager, d_registered)
        for i, (a, b) in enumerate(zip(eager, registered)):
            assert_exact(a, b, f"{name} (T={T}): output {i}")


def test_loss_double_backward_still_works_eagerly(cuda):
    # create_graph: the eager backward switches to the same differentiable composition as the registered op.
    x = torch.randn(8, 6, device=cuda, requires_grad=True)
    (g,) = torch.autograd.grad(mk.z_loss(x, 0.1), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.square().sum(), x)
    with _ext.reference_ops():
        xr = x.detach().cpu().requires_grad_()
        (gr,) = torch.autograd.grad(mk.z_loss(xr, 0.1), xr, create_graph=True)
        (ggr,) = torch.autograd.grad(gr.square().sum(), xr)
    torch.testing.assert_close(gg.cpu(), ggr, rtol=1e-4, atol=1e-7)


def test_checking_mode_and_compile_take_the_registered_ops(cuda, checks_on):
    logits = torch.randn(9, 8, device=cuda)
    assert _ext.eager(logits) is None  # the checking mode validates values in the registered ops
    mk.set_checks(False)
    f = torch.compile(lambda x: mk.router_topk(x, 2)[0] * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(logits), mk.router_topk(logits, 2)[0] * 2)


# The FP8 recipe's autograd functions call the ops' implementations straight (_ext.direct: grad mode is off inside
# them); replaced by the registered ops, every output and gradient must be the same bit for bit. A dispatch mode
# would itself send direct to the registered ops, so the direct calls are counted by wrapping the implementations.
def _count_direct(monkeypatch) -> collections.Counter:
    """Counts, per op name, the implementations _ext.direct calls (the dispatcher calls the registered kernels,
    not these wrappers)."""
    calls = collections.Counter()
    depth = [0]  # only the outermost calls: an implementation's own calls of other ops are not the caller's
    for op, fn in list(_ext._IMPLS.items()):
        def counted(*args, _fn=fn, _name=f"moe_kernels.{op._name}"):
            if not depth[0]:
                calls[_name] += 1
            depth[0] += 1
            try:
                return _fn(*args)
            finally:
                depth[0] -= 1

        monkeypatch.setitem(_ext._IMPLS, op, counted)
    return calls


_DIRECT = {"moe_kernels.grouped_mm_fp8", "moe_kernels.grouped_mm_fp8_wgrad", "moe_kernels.swiglu_quantize_fp8",
           "moe_kernels.swiglu_bwd_quantize_fp8", "moe_kernels.squared_relu_quantize_fp8",
           "moe_kernels.squared_relu_bwd_quantize_fp8", "moe_kernels.unpermute_bwd_quantize_fp8",
           "moe_kernels.quantize_fp8_dual", "moe_kernels.quantize_fp8_experts_dual", "moe_kernels.quantize_fp8",
           "moe_kernels.quantize_fp8_tokens", "moe_kernels.permute_quantize_fp8"}


class _Dispatched(TorchDispatchMode):
    """How often each of the FP8 ops above is dispatched as a registered op (the CPU-executed build's dequantizing
    fallback for the FP8 GEMMs dispatches others inside them; permute and unpermute also serve the layer with grad
    mode on, through their autograd: test_direct_takes_the_registered_op_where_it_must covers them)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _DIRECT:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation,ffn_size", [("swiglu", 128), ("squared_relu", 208), ("swiglu", 80)])
def test_fp8_recipe_layer_direct_calls_equal_registered(cuda, monkeypatch, request, activation, ffn_size):
    # SwiGLU at F = 128 (every fused producer), the squared ReLU at F = 208 (padded codes), SwiGLU at F = 80 (the
    # composition with quantize_fp8_dual); bf16 under autocast, an empty expert likely at 8 experts and 37 tokens.
    # The direct run calls each FP8 op's implementation as often as the registered run dispatches the op. The
    # recipe's functions run (the layer's fused FP8 region stands aside: tests/nn/test_fused_fp8_gpu.py compares it
    # with them).
    from moe_kernels.nn import MoELayer, fused_fp8
    from moe_kernels.nn.moe import qwen3_30b_a3b
    from moe_kernels.quant import Fp8BlockwiseRecipe

    region_off = pytest.MonkeyPatch()
    region_off.setattr(fused_fp8, "fits", lambda *args: False)
    request.addfinalizer(region_off.undo)
    torch.manual_seed(4)
    cfg = qwen3_30b_a3b(hidden_size=128, ffn_size=ffn_size, num_experts=8, k=2, activation=activation,
                        recipe=Fp8BlockwiseRecipe())
    layer = MoELayer(cfg).to(cuda)
    x = torch.randn(1, 37, 128, device=cuda)

    def run():
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast(cuda.type, dtype=torch.bfloat16):
            out, aux = layer(xi)
        (out.float().square().sum() + aux).backward()
        return (out, xi.grad, *(p.grad for p in layer.parameters()))

    direct_calls = _count_direct(monkeypatch)
    direct = run()
    direct_calls = collections.Counter({k: v for k, v in direct_calls.items() if k in _DIRECT})
    monkeypatch.undo()
    monkeypatch.setattr(_ext, "direct", lambda op, t, *args: op(*args))
    registered = run()
    with _Dispatched() as seen:
        run()
    monkeypatch.undo()
    assert {"moe_kernels.grouped_mm_fp8", "moe_kernels.grouped_mm_fp8_wgrad"} <= set(seen.calls), seen.calls
    assert direct_calls == seen.calls, (direct_calls, seen.calls)
    for i, (a, b) in enumerate(zip(direct, registered)):
        assert_exact(a, b, f"FP8 recipe layer ({activation}, F={ffn_size}): output/gradient {i}")


def test_direct_takes_the_registered_op_where_it_must(cuda, monkeypatch, checks_on):
    # Grad mode on: the registered op (its autograd); the checking mode (it validates values first), a dispatch
    # mode (it observes the registered op) and torch.func transforms (their wrapped tensors hold no data the kernel
    # could read): the registered op; grad mode off, none of these: the implementation.
    calls = _count_direct(monkeypatch)
    x = torch.randn(10, 16, device=cuda, requires_grad=True)
    idx = torch.randint(0, 4, (10, 2), device=cuda, dtype=torch.int32)
    want = mk.permute(x.detach(), idx, 4)[0]
    cases = {
        "grad mode on": (True, False, contextlib.nullcontext, lambda: mk.permute(x, idx, 4)[0]),
        "checking mode": (False, True, contextlib.nullcontext, lambda: mk.permute(x, idx, 4)[0]),
        "dispatch mode": (False, False, _Ops, lambda: mk.permute(x, idx, 4)[0]),
        "vmap": (False, False, contextlib.nullcontext,
                 lambda: torch.vmap(lambda t: mk.permute(t, idx, 4)[0])(x.detach()[None])[0]),
        "direct": (False, False, contextlib.nullcontext, lambda: mk.permute(x, idx, 4)[0]),
    }
    for name, (grad, checks, mode, fn) in cases.items():
        mk.set_checks(checks)
        calls.clear()
        with torch.set_grad_enabled(grad), mode() as observer:
            y = fn()
        assert (calls["moe_kernels.permute"] == 0) == (name != "direct"), (name, calls)
        if observer is not None:  # the dispatch mode saw our op
            assert "moe_kernels.permute" in observer.names, observer.names
        assert y.requires_grad == grad, name
        assert_exact(y.detach(), want, name)
