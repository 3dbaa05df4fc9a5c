"""The `moe_weights_in_activation` region (moe_kernels.nn.fused) on its own: the routing weights moved to their rows
(slot_values_to_rows) and applied in the SwiGLU inside moe_fwd, their gradient moved back to the slots
(rows_to_slot_values) in moe_bwd, against the region's composition of the registered ops (permute,
permuted_row_values, grouped_mm, swiglu, grouped_mm, a plain unpermute): outputs and the gradients of x, the routing
weights and both expert weights bit for bit, over routings with dropped slots (-1: their weights' gradient zero),
padded groups, a hot expert, empty experts, one token and no tokens."""

import pytest
import torch

from moe_kernels.nn import fused
from moe_kernels.testing import assert_exact, extension_calls

pytestmark = pytest.mark.gpu

H, F, E, K = 32, 16, 8, 3


def _routing(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int32 distinct experts a token: "hot" every token's first slot on expert 5; "empty" experts 0, 2 and 6
    chosen by none; "dropped" about a third of the slots -1, token 1's all."""
    pool = {"hot": torch.tensor([e for e in range(E) if e != 5]), "empty": torch.tensor([1, 3, 4, 5, 7])}.get(
        kind, torch.arange(E))
    rows = [pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)]
    idx = torch.stack(rows).to(torch.int32) if T else torch.empty((0, K), dtype=torch.int32)
    if kind == "hot":
        idx[:, 0] = 5
    if kind == "dropped":
        idx[torch.rand(T, K, generator=gen) < 0.35] = -1
        idx[1] = -1
    return idx


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("routing", ["uniform", "dropped", "hot", "empty", "one-token", "no-tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_region_equals_registered_ops(cuda, routing, align, dtype):
    T = {"one-token": 1, "no-tokens": 0}.get(routing, 29)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=gen).to(cuda, dtype)
    indices = _routing("uniform" if T < 2 else routing, T, gen).to(cuda)
    weights = torch.rand(T, K, generator=gen).to(cuda)
    w13 = (torch.randn(E, 2 * F, H, generator=gen) / H**0.5).to(cuda, dtype)
    w2 = (torch.randn(E, H, F, generator=gen) / F**0.5).to(cuda, dtype)
    dout = torch.randn(T, H, generator=gen).to(cuda, dtype)
    results = []
    for thin in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
        with extension_calls() as ext:
            launch = fused.launch_for(x) if thin else None  # (resolved inside: the counting extension)
            out = fused.run("moe_weights_in_activation", launch, leaves[0], indices, leaves[1], leaves[2], leaves[3],
                            E, align)
            out.backward(dout)
        if thin and fused.experts_fit(x):  # (a shape's first call also asks for its workspace size: 2 calls)
            assert "moe_fwd" in ext.calls and ("moe_bwd" in ext.calls) == bool(T), ext.calls
            assert "grouped_mm" not in ext.calls, ext.calls
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "dx", "dweights", "dw13", "dw2"), *results):
        assert_exact(a, b, f"{routing}, align {align}: {name}")
    dweights = results[0][2]
    if routing == "dropped":
        assert not dweights[indices < 0].any() and dweights[indices >= 0].abs().sum() > 0
    if T:
        assert results[0][3].abs().sum() > 0  # the experts' weights received a gradient


def test_region_without_the_weights_gradient(cuda):
    """Routing weights that need no gradient (a frozen router): the same outputs and other gradients, none for
    the weights."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(21, H, generator=gen).to(cuda)
    indices = _routing("dropped", 21, gen).to(cuda)
    weights = torch.rand(21, K, generator=gen).to(cuda)
    w13 = (torch.randn(E, 2 * F, H, generator=gen) / H**0.5).to(cuda)
    w2 = (torch.randn(E, H, F, generator=gen) / F**0.5).to(cuda)
    dout = torch.randn(21, H, generator=gen).to(cuda)
    results = []
    for launch in (fused.launch_for(x), None):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        out = fused.run("moe_weights_in_activation", launch, leaves[0], indices, weights, leaves[1], leaves[2], E, 4)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "dx", "dw13", "dw2"), *results):
        assert_exact(a, b, name)
