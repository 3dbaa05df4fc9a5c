"""The expert-parallel path's experts on the `experts` region (moe_kernels.nn.fused): the dispatched rows (grouped by
local expert, rows past the groups unspecified) through one extension call each way, with the registered ops' outputs
and gradients bit for bit, and the registered ops where the region does not apply (the squared ReLU, adapters, hooks,
a precision recipe). One rank's dispatcher (LocalDispatcher) stands in for the backends: the region sees only the rows
and their group sizes (tests/parallel/test_expert_parallel.py runs it on gloo ranks)."""

import contextlib

import pytest
import torch

from moe_kernels.dispatch import LocalDispatcher
from moe_kernels.nn import PRESETS, MoELayer
from moe_kernels.testing import assert_exact, extension_calls
from tests.nn.test_fused_regions_gpu import E, F, H, K, _inputs, _layer, _step, registered_ops  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu


def _dispatched(case, device, dtype=torch.float32, **replace):
    layer = _layer(case, device, dtype)
    if replace:
        layer.config = layer.config.replace(**replace)
    layer.dispatcher = LocalDispatcher(E)
    return layer


def _names(layer):
    return ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]


@pytest.mark.parametrize("case", ["qwen3-30b-a3b", "deepseek-v3", "weights-in-activation", "capacity-probs",
                                  "autocast", "align"])
def test_dispatched_experts_region_equals_registered_ops(cuda, case, registered_ops):
    """One experts_fwd / experts_bwd for the routed experts (the shared experts' `mlp` region adds one each way), no
    registered grouped_mm; outputs and every gradient identical to the registered ops'. `align`: padded groups (rows
    past each group's tokens); `capacity-probs`: dropped slots."""
    dtype = torch.bfloat16 if case == "deepseek-v3" else torch.float32
    layer = _dispatched("qwen3-30b-a3b" if case in ("autocast", "align") else case, cuda, dtype,
                        **(dict(align=16) if case == "align" else {}))
    x, g = _inputs(cuda, dtype)
    ctx = (lambda: torch.autocast(cuda.type, dtype=torch.bfloat16)) if case == "autocast" else contextlib.nullcontext

    def step():
        with ctx():
            return _step(layer, x, g)

    step()  # the first call of a shape also asks for its workspace size
    with extension_calls() as ext:
        thin = step()
    assert layer.expert_path == "dispatched"
    shared = layer.shared_experts is not None
    assert ext.calls.get("experts_fwd") == ext.calls.get("experts_bwd") == 1 + shared, ext.calls
    assert "grouped_mm" not in ext.calls and "swiglu_fwd" not in ext.calls, ext.calls
    registered_ops()
    with extension_calls() as ext:
        ops = step()
    assert "experts_fwd" not in ext.calls and ext.calls.get("grouped_mm") == 6 * (1 + shared), ext.calls
    for name, a, b in zip(_names(layer), thin, ops):
        assert_exact(a, b, f"{case}: {name}")
    if case == "autocast":
        assert thin[0].dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["x-without-grad", "experts-frozen", "no-tokens"])
def test_dispatched_experts_region_partial_gradients(cuda, case, registered_ops):
    """Only some inputs need a gradient, or a rank has no tokens (it still dispatches and combines): identical to the
    registered ops, the frozen experts without gradients, the weights' gradients zero without rows."""
    layer = _dispatched("qwen3-30b-a3b", cuda)
    if case == "experts-frozen":
        layer.experts.requires_grad_(False)
    x, g = _inputs(cuda, torch.float32)
    if case == "no-tokens":
        x, g = x[:, :0], g[:, :0]

    def step():
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(case != "x-without-grad")
        out, aux = layer(xx)
        ((out.float() * g).sum() + aux).backward()
        return [out.detach(), aux.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    step()
    thin = step()
    registered_ops()
    ops = step()
    for name, a, b in zip(_names(layer), thin, ops):
        assert (a is None) == (b is None), f"{case}: {name}"
        if a is not None:
            assert_exact(a, b, f"{case}: {name}")
    grads = dict(zip(_names(layer), thin))
    if case == "x-without-grad":
        assert grads["dx"] is None and grads["experts.w13"] is not None
    if case == "experts-frozen":
        assert grads["experts.w13"] is None and grads["experts.w2"] is None and grads["dx"] is not None
    if case == "no-tokens":
        assert not grads["experts.w13"].any() and not grads["experts.w2"].any()


@pytest.mark.parametrize("case", ["squared_relu", "hooked"])
def test_dispatched_experts_take_registered_ops_where_the_region_does_not_apply(cuda, case):
    """Experts without a gate (no `experts` region for them) and experts with a forward hook (which must see the
    call) run the registered grouped GEMMs on the dispatched rows."""
    if case == "squared_relu":
        torch.manual_seed(0)
        layer = MoELayer(PRESETS["qwen3-30b-a3b"](hidden_size=H, num_experts=E, ffn_size=F, k=K,
                                                  activation="squared_relu")).to(cuda)
        layer.dispatcher = LocalDispatcher(E)
    else:
        layer = _dispatched("qwen3-30b-a3b", cuda)
    seen = []
    if case == "hooked":
        layer.experts.register_forward_hook(lambda *a: seen.append(1))
    x, g = _inputs(cuda, torch.float32)
    with extension_calls() as ext:
        _step(layer, x, g)
    assert layer.expert_path == "dispatched"
    assert "experts_fwd" not in ext.calls and ext.calls.get("grouped_mm") == 6, ext.calls
    assert seen == ([1] if case == "hooked" else [])
