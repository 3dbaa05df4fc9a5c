"""What the MoE layer's fused regions keep for the backward (moe_kernels.nn.fused): the router region keeps x in its
own dtype, not the gating linear's fp32 copy, with the registered ops' outputs and gradients bit for bit; the experts'
regions keep h and write the activation again in their backward, the expert-parallel path's too; the routed experts'
region keeps no permuted copy of x."""

import pytest
import torch

from moe_kernels.dispatch import LocalDispatcher
from moe_kernels.nn import PRESETS, MoELayer
from tests.nn.test_fused_regions_gpu import E, F, H, K, registered_ops  # noqa: F401 (a fixture)
from tests.nn.test_router_module import check_gating_equals_linear_on_the_copy, check_gating_keeps_x

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_region_keeps_x_not_its_fp32_copy(cuda, dtype, frozen):
    check_gating_keeps_x(cuda, dtype, frozen, thin=True)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("losses", ["routing", "routing+logits", "logits", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_region_equals_autograd_linear_on_the_copy(cuda, dtype, losses, frozen):
    """The region's gating linear (x kept in its dtype, cast again in the backward) against autograd's linear on x's
    fp32 copy and the registered ops, bit for bit; a loss on the returned logits flows back through it, and a backward
    that hands the router no gradient at all gives zero gradients, as the registered ops do."""
    check_gating_equals_linear_on_the_copy(cuda, dtype, losses, thin=True, frozen=frozen)


def _kept_bytes(layer, x) -> int:
    """Bytes of the storages autograd keeps for the layer's backward, beyond the parameters and x, each once."""
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in own:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values())


@pytest.mark.parametrize("case", ["moe", "moe_squared_relu", "moe_weights_in_activation", "mlp", "dispatched",
                                  "dispatched_squared_relu"])
def test_regions_keep_h_not_the_activation(cuda, case, registered_ops):
    """The fused regions keep the first product h for the backward, which writes the activation again from it; the
    registered ops also keep the activation (the down projection's input), and the shared experts' region keeps no
    stacked copy of their gate and up weights. Measured as what the kept bytes grow by when the MLP widens from F to
    2F (each region's parts are 256-byte aligned, so the widths keep every part a multiple of that). `dispatched`: the
    expert-parallel path, whose `experts` region (`experts_squared_relu`) runs on the dispatched rows."""
    T, F1, c = 48, 64, 2  # bf16
    kw = dict(hidden_size=H, num_experts=E, k=K)
    if case == "mlp":  # the shared experts widen, the routed ones stay
        make = lambda F_: PRESETS["deepseek-v3"](**kw, num_groups=4, group_topk=2, ffn_size=F, shared_ffn_size=F_)
    else:
        extra = ({"weights_in_activation": True} if case == "moe_weights_in_activation"
                 else {"activation": "squared_relu"} if case.endswith("squared_relu") else {})
        make = lambda F_: PRESETS["qwen3-30b-a3b"](**kw, ffn_size=F_, **extra)
    x = torch.randn(1, T, H).to(cuda, torch.bfloat16).requires_grad_()
    growth = {}
    for path in ("fused", "registered"):
        kept = []
        for F_ in (F1, 2 * F1):
            torch.manual_seed(0)
            layer = MoELayer(make(F_)).to(cuda, torch.bfloat16)
            layer.router.float()
            if case.startswith("dispatched"):  # the expert-parallel path (one rank's dispatcher): the `experts` region
                layer.dispatcher = LocalDispatcher(E)
            kept.append(_kept_bytes(layer, x))
            if path == "fused" and case != "mlp":
                want = "dispatched" if case.startswith("dispatched") else "fused"
                assert layer.expert_path == want, layer.expert_path
        growth[path] = kept[1] - kept[0]
        if path == "fused":
            registered_ops()
    gated = not case.endswith("squared_relu")
    rows = T * K if case != "mlp" else T  # no padding (align 1)
    h = rows * F1 * (2 if gated else 1) * c  # h's growth: [rows, 2F] ([rows, F] without a gate)
    assert growth["fused"] == h, growth
    stacked = 2 * F1 * H * c if case == "mlp" else 0  # the stacked gate and up weights
    assert growth["registered"] == h + rows * F1 * c + stacked, growth


@pytest.mark.parametrize("case", ["moe", "moe_squared_relu", "moe-no-weight-grad", "moe_weights_in_activation"])
def test_moe_region_keeps_no_permuted_copy(cuda, case, registered_ops):
    """The routed experts' region keeps x (which the router's gating keeps as well) and permutes it again in its
    backward instead of keeping the permuted copy x_perm [R, H]; with the routing weights' gradient it keeps the
    expert outputs y [R, H] (not with the weights in the activation, whose gradient the activation's backward gives).
    Measured as what the kept bytes grow by when the hidden size widens from H to 2H: the region's y (nothing without
    the weights' gradient: x and the router frozen, the experts trained; nothing with the weights in the activation),
    the registered ops' x_perm and y (x_perm alone with the weights in the activation)."""
    T, H1, c = 48, 128, 2  # bf16
    extra = ({"activation": "squared_relu"} if case == "moe_squared_relu"
             else {"weights_in_activation": True} if case == "moe_weights_in_activation" else {})
    frozen = case == "moe-no-weight-grad"
    growth = {}
    for path in ("fused", "registered"):
        kept = []
        for H_ in (H1, 2 * H1):
            torch.manual_seed(0)
            layer = MoELayer(PRESETS["qwen3-30b-a3b"](hidden_size=H_, num_experts=E, k=K, ffn_size=64, **extra))
            layer = layer.to(cuda, torch.bfloat16)
            layer.router.float().requires_grad_(not frozen)
            x = torch.randn(1, T, H_).to(cuda, torch.bfloat16).requires_grad_(not frozen)
            kept.append(_kept_bytes(layer, x))
            if path == "fused":
                assert layer.expert_path == "fused", layer.expert_path
        growth[path] = kept[1] - kept[0]
        if path == "fused":
            registered_ops()
    rows_h = T * K * H1 * c  # R H elements' growth (no padding: align 1)
    y = 0 if frozen or case == "moe_weights_in_activation" else rows_h
    assert growth == {"fused": y, "registered": rows_h + y}, growth
