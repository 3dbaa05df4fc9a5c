"""The FP8 blockwise recipe on the GPU: forward and FP8 dgrad (the CUTLASS kernel on transposed weight
tiles) against the same recipe on the CPU references, and an MoE layer under bf16 autocast."""

import pytest
import torch

from moe_kernels.nn import MoELayer
from moe_kernels.nn.moe import deepseek_v3
from moe_kernels.quant import Fp8BlockwiseRecipe
from moe_kernels.testing import random_routing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("M,N,K,E", [(300, 256, 384, 8), (2048, 1536, 1024, 16), (129, 128, 128, 1)])
def test_recipe_matches_the_cpu_references(cuda, M, N, K, E):
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(E, N, K, generator=g) * 0.05).float()
    idx = random_routing(M, E, 1, kind="zipf", seed=M)
    gs = torch.bincount(idx.view(-1).long(), minlength=E).to(torch.int32)
    dout = torch.randn(M, N, generator=g).bfloat16()
    recipe = Fp8BlockwiseRecipe()
    grads = []
    for device in ("cpu", cuda):
        xi, wi = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        out = recipe.grouped_mm(xi, wi, gs.to(device))
        dx, dw = torch.autograd.grad(out, (xi, wi), dout.to(device))
        grads.append([t.float().cpu() for t in (out, dx, dw)])
    rows = int(gs.sum())
    for (name, got), want in zip(zip(("out", "dx", "dw"), grads[1]), grads[0]):
        if name != "dw":
            got, want = got[:rows], want[:rows]
        # The same FP8 operands; only the fp32 accumulation order and the final bf16 rounding differ.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)


def test_moe_layer_under_autocast(cuda):
    torch.manual_seed(0)
    cfg = deepseek_v3(hidden_size=256, ffn_size=128, shared_ffn_size=128, num_experts=16, k=4, num_groups=4,
                      group_topk=2, recipe=Fp8BlockwiseRecipe())
    layer = MoELayer(cfg).to(cuda)
    ref = MoELayer(cfg.replace(recipe=None)).to(cuda)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(4, 64, 256, device=cuda)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = layer(x)
        want, _ = ref(x)
    err = (out.float() - want.float()).norm() / want.float().norm()
    assert err < 0.1, err
    out.float().square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_nvfp4_recipe_matches_the_cpu_references(cuda):
    from moe_kernels.quant import Nvfp4Recipe

    g = torch.Generator().manual_seed(7)
    N, K, E = 256, 192, 8
    gs = torch.bincount(random_routing(300, E, 1, kind="zipf", seed=3).view(-1).long(), minlength=E).to(torch.int32)
    gs = (gs + 15) // 16 * 16  # the recipe's NVFP4 wgrad needs groups padded to 16, as permute(align=16) gives
    M = int(gs.sum()) + 16  # and rows past the groups
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, N, K, generator=g) * 0.05
    dout = torch.randn(M, N, generator=g)
    rows = int(gs.sum())

    def grads(recipe, device):
        xi, wi = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        out = recipe.grouped_mm(xi, wi, gs.to(device))
        return [t.cpu() for t in (out, *torch.autograd.grad(out, (xi, wi), dout.to(device)))]

    # Round-to-nearest everywhere: the same quantized operands on both sides (bit-exact quantization);
    # only the fp32 accumulation order differs.
    exact_recipe = Nvfp4Recipe(stochastic_dgrad=False, nvfp4_wgrad=False)
    for name, got, want in zip(("out", "dx", "dw"), grads(exact_recipe, cuda), grads(exact_recipe, "cpu")):
        if name != "dw":
            got, want = got[:rows], want[:rows]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    # The full recipe (stochastic dgrad, Hadamard NVFP4 wgrad; seeds from the CUDA generator): reproducible
    # under torch.manual_seed, and within NVFP4's precision of the exact gradients.
    torch.manual_seed(11)
    first = grads(Nvfp4Recipe(), cuda)
    torch.manual_seed(11)
    again = grads(Nvfp4Recipe(), cuda)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    exact_dw = torch.ops.moe_kernels.grouped_mm_wgrad(dout.double(), x.double(), gs)
    assert float((first[2].double() - exact_dw).norm() / exact_dw.norm()) < 0.2
