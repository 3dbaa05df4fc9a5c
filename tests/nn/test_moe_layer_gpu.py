"""MoELayer on the GPU: kernels against the references, and CUDA-graph capture of forward + backward."""

import pytest
import torch

from moe_kernels.nn import PRESETS, MoELayer
from moe_kernels.testing import assert_close_to_fp64, assert_exact
from tests.cuda_graphs import capture_and_replay

pytestmark = pytest.mark.gpu


def _layer(name, dev, dtype, **kw):
    base = dict(hidden_size=256, num_experts=16, ffn_size=128, k=4)
    if name == "deepseek-v3":
        base.update(num_groups=4, group_topk=2, shared_ffn_size=128)
    torch.manual_seed(0)
    layer = MoELayer(PRESETS[name](**{**base, **kw}))
    return layer.to(dev, dtype), layer


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
def test_kernels_match_fp64_reference(cuda, name):
    fast, _ = _layer(name, cuda, torch.bfloat16)
    fast.router.float()  # the router stays fp32
    ref64, _ = _layer(name, "cpu", torch.float64, backend="reference")
    ref64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in fast.state_dict().items()})
    x = torch.randn(2, 300, 256)
    out, _ = fast(x.to(cuda, torch.bfloat16))
    base = MoELayer(fast.config.replace(backend="reference")).to(cuda, torch.bfloat16)
    base.router.float()
    base.load_state_dict(fast.state_dict())
    base_out, _ = base(x.to(cuda, torch.bfloat16))
    # fp64 run with the routing the bf16 layer chose is not guaranteed (near-ties), so compare tokens
    # whose routing agrees between the fp64 and bf16 routers.
    ref_out, _ = ref64(x.to(torch.bfloat16).double())
    r32 = fast.router(x.to(cuda, torch.bfloat16).reshape(-1, 256), seq_len=300)
    r64 = ref64.router(x.to(torch.bfloat16).double().reshape(-1, 256), seq_len=300, reference=True)
    same = (r32.indices.cpu() == r64.indices).all(-1)
    assert same.float().mean() > 0.95
    assert_close_to_fp64(out.reshape(-1, 256)[same.to(cuda)], base_out.reshape(-1, 256)[same.to(cuda)],
                         ref_out.reshape(-1, 256)[same], f"{name} layer output", floor=1e-2)


# Every perf.md routing preset, the options they leave out (losses, capacity, expert bias, weights in the
# activation) and the FP8 recipe: the fused regions (the default eager path) and the registered ops.
GRAPH_CASES = {
    **{name: {} for name in PRESETS},
    "losses": dict(aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-3, z_loss_coeff=1e-3),
    "capacity": dict(capacity_factor=0.75, z_loss_coeff=1e-3),
    "weights-in-activation": dict(weights_in_activation=True),
    "fp8-recipe": dict(recipe="fp8"),
}


@pytest.mark.cuda_device
@pytest.mark.parametrize("path", ["fused", "registered"])
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_capture_forward_backward(cuda, case, path, monkeypatch):
    from moe_kernels.nn import fused
    from moe_kernels.quant import Fp8BlockwiseRecipe

    kw = dict(GRAPH_CASES[case])
    if kw.pop("recipe", None):
        kw["recipe"] = Fp8BlockwiseRecipe()
    name = case if case in PRESETS else ("deepseek-v3" if case == "fp8-recipe" else "qwen3-30b-a3b")
    layer, _ = _layer(name, cuda, torch.bfloat16, **kw)
    layer.router.float()
    if path == "registered":
        monkeypatch.setattr(fused, "launch_for", lambda x: None)
    x = torch.randn(4, 256, 256, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    params = [p for p in layer.parameters()]

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        out, aux = layer(x)
        (out.float() * g.float()).sum().add(aux).backward()
        return [out.detach(), x.grad] + [p.grad for p in params]

    captured, eager = capture_and_replay(step, lambda: x.copy_(torch.randn_like(x)))
    for i, (a, b) in enumerate(zip(captured, eager)):
        assert_exact(a.cpu(), b.cpu(), f"{case} ({path}): graph replay tensor {i}")
