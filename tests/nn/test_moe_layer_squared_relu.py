"""MoELayer with squared-ReLU experts (MoEConfig(activation="squared_relu"): Nemotron-H's experts, up_proj and
down_proj without a gate, relu(x W_up^T)^2 W_down^T; the shared experts the same): each backend against the layer's
definition in fp64, the precision recipes within their error models, and what the option refuses."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from moe_kernels._ext import reference_ops
from moe_kernels.nn import MoELayer
from moe_kernels.nn.experts import GroupedExperts
from moe_kernels.nn.moe import deepseek_v3, qwen3_30b_a3b
from moe_kernels.testing import assert_close_to_fp64


def _config(**overrides):
    kw = dict(hidden_size=64, ffn_size=48, shared_ffn_size=32, num_experts=8, k=2, num_groups=4, group_topk=2,
              activation="squared_relu")
    return deepseek_v3(**{**kw, **overrides})


def _definition(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer by its definition, token by token: sum over the chosen experts of w * relu(x W_up^T)^2 W_down^T,
    plus the shared experts' down(relu(up(x))^2), in the layer's dtype (the router's choice taken from the layer)."""
    x2 = x.reshape(-1, x.shape[-1])
    routed = layer.router(x2.float(), seq_len=x.shape[-2], reference=True)
    out = torch.zeros_like(x2)
    w13, w2 = layer.experts.w13, layer.experts.w2
    for j in range(routed.indices.shape[1]):
        e = routed.indices[:, j].long()
        h = torch.einsum("th,tfh->tf", x2, w13[e])
        out = out + routed.weights[:, j, None].to(x2.dtype) * torch.einsum("tf,thf->th", torch.relu(h).square(), w2[e])
    se = layer.shared_experts
    return (out + se.down_proj(torch.relu(se.up_proj(x2)).square())).view(x.shape)


@pytest.mark.parametrize("backend", ["kernels", "reference", "torch"])
def test_layer_is_its_definition(backend):
    # Output and every gradient of the fp32 layer within 2x the fp32 definition's error against the fp64 definition.
    torch.manual_seed(0)
    layer = MoELayer(_config(backend=backend))
    assert tuple(layer.experts.w13.shape) == (8, 48, 64) and layer.shared_experts.gate_proj is None
    layer64 = copy.deepcopy(layer).double()
    x = torch.randn(2, 10, 64)
    runs = []
    for model, xi, fn in ((layer, x, None), (layer, x, _definition), (layer64, x.double(), _definition)):
        model.zero_grad()
        xi = xi.clone().requires_grad_()
        out = model(xi)[0] if fn is None else fn(model, xi)
        r = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * r).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((out.detach(), xi.grad, grads))
    (out, dx, grads), (out32, dx32, grads32), (out64, dx64, grads64) = runs
    assert_close_to_fp64(out, out32, out64, f"{backend} out")
    assert_close_to_fp64(dx, dx32, dx64, f"{backend} dx")
    for name in ("experts.w13", "experts.w2", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"):
        assert_close_to_fp64(grads[name], grads32[name], grads64[name], f"{backend} d{name}")
    if backend != "torch":
        assert layer.expert_path == "ops"


def test_recipes_within_their_error_models():
    # FP8 (F = 48: no multiple of 128, zero-padded) and NVFP4: the routed experts' GEMMs on the recipe (the recipe's
    # permute + first GEMM, our squared ReLU, the second GEMM), close to the fp32 layer; gradients reached.
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error, relative_l2_error

    torch.manual_seed(0)
    cfg = _config(shared_ffn_size=0, hidden_size=128)
    ref = MoELayer(cfg)
    x = torch.randn(64, 128)
    want = ref(x)[0].detach()
    for recipe in (Fp8BlockwiseRecipe(), Nvfp4Recipe()):
        layer = MoELayer(cfg.replace(recipe=recipe))
        layer.load_state_dict(ref.state_dict())
        out, _ = layer(x)
        # FP8 fuses the permute with its first GEMM's quantization; NVFP4 runs the ops with its GEMMs
        assert layer.expert_path == ("recipe" if isinstance(recipe, Fp8BlockwiseRecipe) else "ops")
        err = relative_l2_error(out.detach(), want)
        # Four quantized operands (x and w13, the activation and w2), the first GEMM's relative error doubled by the
        # square (x^2's log-derivative is 2): E4M3's 0.0265 each; NVFP4's about 0.1 each (2 significant bits and a
        # 3-bit scale, as test_hf_recipes' model states); QUANT_SLACK over the model.
        e = E4M3_REL_ERROR if isinstance(recipe, Fp8BlockwiseRecipe) else 0.1
        assert 1e-3 < err < QUANT_SLACK * quantized_product_error(2 * e, 2 * e, e, e), err
        out.square().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.experts.parameters())


def test_refusals():
    with pytest.raises(ValueError, match="weights_in_activation"):
        _config(weights_in_activation=True)
    with pytest.raises(ValueError, match="activation must be one of"):
        qwen3_30b_a3b(hidden_size=64, ffn_size=32, num_experts=4, k=2, activation="gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        GroupedExperts(4, 8, 8, activation="relu")
    with pytest.raises(ValueError, match="row weights"):
        GroupedExperts(4, 8, 8, activation="squared_relu")(torch.randn(4, 8), torch.tensor([1, 1, 1, 1], dtype=torch.int32),
                                                           torch.ones(4))


def test_transformers_checkpoints_refuse_squared_relu():
    from moe_kernels.models import PRESETS
    from moe_kernels.models.hf import config_to_hf

    cfg = PRESETS["tiny-qwen3-moe"]()
    cfg = cfg.replace(moe=cfg.moe.replace(activation="squared_relu"))
    with pytest.raises(ValueError, match="activation='squared_relu'"):
        config_to_hf(cfg)


@pytest.mark.gpu
def test_fused_region_on_the_device(cuda):
    # On the device the plain layer's routed experts run as the "moe_squared_relu" fused region: against the layer on
    # the CPU (the references), fp32, output and gradients within 2x the CPU layer's error against fp64.
    torch.manual_seed(0)
    layer = MoELayer(_config())
    ref, ref64 = copy.deepcopy(layer), copy.deepcopy(layer).double()
    layer.to(cuda)
    x = torch.randn(2, 10, 64)
    runs = []
    for model, xi in ((layer, x.to(cuda)), (ref, x), (ref64, x.double())):
        xi = xi.clone().requires_grad_()
        # (the CPU models on the references, also where the device's kernels run on the CPU: emulation)
        with contextlib.nullcontext() if model is layer else reference_ops():
            out = model(xi)[0]
            r = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype).to(out.device)
            (out * r).sum().backward()
        runs.append((out.detach().cpu(), xi.grad.cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()
                                                        if p.grad is not None}))
    assert layer.expert_path == "fused"
    (out, dx, g), (out32, dx32, g32), (out64, dx64, g64) = runs
    assert_close_to_fp64(out, out32, out64, "out")
    assert_close_to_fp64(dx, dx32, dx64, "dx")
    for name in g64:
        assert_close_to_fp64(g[name], g32[name], g64[name], f"d{name}")


def test_layouts_take_etp_with_squared_relu():
    # Expert tensor parallelism splits the up rows of experts without a gate (tests/parallel: EP x ETP against one
    # rank); the layout check takes it, and still names a width etp does not divide.
    from moe_kernels.models import PRESETS
    from moe_kernels.nn.moe import SharedExperts
    from moe_kernels.parallel.layout import ParallelConfig

    cfg = PRESETS["tiny-qwen3-moe"]()
    cfg = cfg.replace(moe=cfg.moe.replace(activation="squared_relu"))
    ParallelConfig(dp_shard=2, ep=1, etp=2).check_model(cfg, seq_len=16)
    odd = cfg.replace(moe=cfg.moe.replace(ffn_size=cfg.moe.ffn_size + 1))
    with pytest.raises(ValueError, match="etp"):
        ParallelConfig(dp_shard=2, ep=1, etp=2).check_model(odd, seq_len=16)
    with pytest.raises(ValueError, match="activation must be one of"):
        SharedExperts(8, 8, activation="gelu")
