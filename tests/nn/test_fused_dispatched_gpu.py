"""The expert-parallel path's experts on the `experts` region (moe_kernels.nn.fused; `experts_squared_relu` for experts
without a gate): the dispatched rows (grouped by local expert, rows past the groups unspecified) through one extension
call each way, with the registered ops' outputs and gradients bit for bit, and the registered ops where the region does
not apply (hooks on the experts, adapters, a precision recipe). One rank's dispatcher (LocalDispatcher) stands in for
the backends: the region sees only the rows and their group sizes (tests/parallel/test_expert_parallel.py runs it on
gloo ranks)."""

import contextlib

import pytest
import torch

from moe_kernels.dispatch import LocalDispatcher
from moe_kernels.nn import PRESETS, MoELayer, fused
from moe_kernels.testing import assert_exact, extension_calls
from tests.nn.test_fused_regions_gpu import E, F, H, K, _inputs, _layer, _step, registered_ops  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu


def _dispatched(case, device, dtype=torch.float32, **replace):
    if case == "squared-relu":  # Nemotron-H's experts without a gate
        torch.manual_seed(0)
        layer = MoELayer(PRESETS["qwen3-30b-a3b"](hidden_size=H, num_experts=E, ffn_size=F, k=K,
                                                  activation="squared_relu")).to(device, dtype)
        layer.router.float()
    else:
        layer = _layer(case, device, dtype)
    if replace:
        layer.config = layer.config.replace(**replace)
    layer.dispatcher = LocalDispatcher(E)
    return layer


def _names(layer):
    return ["out", "aux_loss", "dx"] + [n for n, _ in layer.named_parameters()]


@pytest.mark.parametrize("case", ["qwen3-30b-a3b", "deepseek-v3", "weights-in-activation", "capacity-probs",
                                  "autocast", "align", "squared-relu"])
def test_dispatched_experts_region_equals_registered_ops(cuda, case, registered_ops):
    """One experts_fwd / experts_bwd for the routed experts (the shared experts' `mlp` region adds one each way), no
    registered grouped_mm; outputs and every gradient identical to the registered ops'. `align`: padded groups (rows
    past each group's tokens); `capacity-probs`: dropped slots; `squared-relu`: experts without a gate."""
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
    # (where torch._grouped_mm serves this GPU and dtype, grouped_mm_backend, the region composes the registered ops:
    # only the comparison below applies)
    fits = fused.experts_fit(thin[0])
    if fits:
        assert ext.calls.get("experts_fwd") == ext.calls.get("experts_bwd") == 1 + shared, ext.calls
        assert not {"grouped_mm", "swiglu_fwd", "squared_relu_fwd"} & set(ext.calls), ext.calls
    registered_ops()
    with extension_calls() as ext:
        ops = step()
    assert "experts_fwd" not in ext.calls and (ext.calls.get("grouped_mm") == 6 * (1 + shared) or not fits), ext.calls
    for name, a, b in zip(_names(layer), thin, ops):
        assert_exact(a, b, f"{case}: {name}")
    if case == "autocast":
        assert thin[0].dtype == torch.bfloat16


@pytest.mark.parametrize("activation", ["swiglu", "squared-relu"])
@pytest.mark.parametrize("case", ["x-without-grad", "experts-frozen", "no-tokens"])
def test_dispatched_experts_region_partial_gradients(cuda, case, activation, registered_ops):
    """Only some inputs need a gradient, or a rank has no tokens (it still dispatches and combines): identical to the
    registered ops, the frozen experts without gradients, the weights' gradients zero without rows."""
    layer = _dispatched("qwen3-30b-a3b" if activation == "swiglu" else activation, cuda)
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


@pytest.mark.parametrize("activation", ["swiglu", "squared-relu"])
def test_dispatched_experts_with_a_hook_take_the_registered_ops(cuda, activation):
    """Experts with a forward hook (which must see the call) run as a module, on the registered grouped GEMMs."""
    layer = _dispatched("qwen3-30b-a3b" if activation == "swiglu" else activation, cuda)
    seen = []
    layer.experts.register_forward_hook(lambda *a: seen.append(1))
    x, g = _inputs(cuda, torch.float32)
    with extension_calls() as ext:
        _step(layer, x, g)
    assert layer.expert_path == "dispatched" and seen == [1]
    assert "experts_fwd" not in ext.calls and ext.calls.get("grouped_mm") == 6, ext.calls


@pytest.mark.parametrize("sizes", ["uniform", "hot", "empty", "past-the-groups", "no-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_squared_relu_region_equals_registered_ops(cuda, sizes, dtype):
    """The `experts_squared_relu` region on its own against its composition of the registered ops (grouped_mm,
    squared_relu, grouped_mm): y, dx and both weights' gradients bit for bit over group sizes with one hot expert,
    empty experts, rows past the groups (unspecified on both paths: compared up to the groups' end) and no rows."""
    R = 0 if sizes == "no-rows" else 37
    counts = {"uniform": [5, 5, 5, 5, 5, 4, 4, 4], "hot": [R] + [0] * 7, "empty": [0, 9, 0, 0, 14, 14, 0, 0],
              "past-the-groups": [3, 0, 7, 2, 0, 5, 1, 4], "no-rows": [0] * 8}[sizes]
    used = sum(counts)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(R, H, generator=gen).to(cuda, dtype)
    w_up = (torch.randn(E, F, H, generator=gen) / H**0.5).to(cuda, dtype)
    w2 = (torch.randn(E, H, F, generator=gen) / F**0.5).to(cuda, dtype)
    dy = torch.randn(R, H, generator=gen).to(cuda, dtype)
    group_sizes = torch.tensor(counts, dtype=torch.int32, device=cuda)
    results = []
    for thin in (True, False):
        xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in (w_up, w2)]
        with extension_calls() as ext:
            launch = fused.launch_for(x) if thin else None  # (resolved inside: the counting extension)
            y = fused.run("experts_squared_relu", launch, xs, group_sizes, *ws)
            y.backward(dy)
        if launch is not None and R and fused.experts_fit(x):
            assert ext.calls.get("experts_fwd") and ext.calls.get("experts_bwd") and "grouped_mm" not in ext.calls
        results.append((y.detach()[:used], xs.grad[:used], ws[0].grad, ws[1].grad))
    for name, a, b in zip(("y", "dx", "dw_up", "dw2"), *results):
        assert_exact(a, b, f"{sizes}: {name}")
    if sizes == "no-rows":
        assert not results[0][2].any() and not results[0][3].any()


def test_experts_bindings_refuse_a_bad_activation(cuda):
    """experts_fwd / experts_bwd name a bad activation code, and the squared ReLU given row weights, before any
    launch (the regions never pass them; a direct caller of the extension gets a clear error)."""
    from moe_kernels import _ext

    x = torch.randn(4, H, device=cuda)
    L = fused.launch_for(x)
    rw = torch.ones(4, device=cuda)
    one = 1 << 12  # any non-null address: the checks come before any pointer is read
    with pytest.raises(ValueError, match="activation code must be 0 \\(swiglu\\) or 1 \\(squared_relu\\), got 2"):
        L.C.experts_fwd(one, one, one, 0, 0, one, one, one, 4, H, F, 1, 2, 0, 0, 0, L.device, L.stream)
    with pytest.raises(ValueError, match="squared ReLU takes no row weights"):
        L.C.experts_fwd(one, one, one, 0, _ext.ptr(rw), one, one, one, 4, H, F, 1, 1, 0, 0, 0, L.device, L.stream)
    with pytest.raises(ValueError, match="activation code must be"):
        L.C.experts_bwd(*[one] * 7, 0, one, one, one, one, one, 0, 4, H, F, 1, 3, 0, 0, 0, L.device, L.stream)
    with pytest.raises(ValueError, match="squared ReLU takes no row weights"):
        L.C.experts_bwd(*[one] * 7, 0, one, one, one, one, one, one, 4, H, F, 1, 1, 0, 0, 0, L.device, L.stream)
