import pytest
import torch
import torch.nn.functional as F

from moe_kernels.nn import PRESETS, MoEConfig, MoELayer, RouterConfig


def tiny(name="qwen3-30b-a3b", **kw):
    base = dict(hidden_size=24, num_experts=8, ffn_size=12, k=2)
    if name == "deepseek-v3":
        base.update(num_groups=4, group_topk=2, shared_ffn_size=12)
    return PRESETS[name](**{**base, **kw})


def test_one_expert_equals_dense_mlp():
    cfg = MoEConfig(router=RouterConfig(hidden_size=16, num_experts=1, k=1), ffn_size=8)
    layer = MoELayer(cfg)
    x = torch.randn(3, 4, 16)
    out, aux = layer(x)
    w13, w2 = layer.experts.w13[0], layer.experts.w2[0]
    dense = F.linear(F.silu(F.linear(x, w13[:8])) * F.linear(x, w13[8:]), w2)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)
    assert aux.item() == 0.0


@pytest.mark.parametrize("name", list(PRESETS))
def test_equals_per_expert_loop(name):
    torch.manual_seed(0)
    layer = MoELayer(tiny(name))
    x = torch.randn(2, 7, 24)
    out, _ = layer(x)
    x2 = x.reshape(-1, 24)
    r = layer.router(x2, seq_len=7)
    expected = torch.zeros_like(x2)
    for t in range(x2.shape[0]):
        for j in range(r.indices.shape[1]):
            e = int(r.indices[t, j])
            w13, w2 = layer.experts.w13[e], layer.experts.w2[e]
            F_ = layer.experts.ffn_size
            h = F.silu(x2[t] @ w13[:F_].t()) * (x2[t] @ w13[F_:].t())
            expected[t] += r.weights[t, j] * (h @ w2.t())
    if layer.shared_experts is not None:
        expected += layer.shared_experts(x2)
    torch.testing.assert_close(out.reshape(-1, 24), expected, rtol=1e-4, atol=1e-5)


def test_backends_and_weight_placement_agree():
    torch.manual_seed(1)
    cfg = tiny("deepseek-v3", shared_gate=True)
    layer = MoELayer(cfg)
    variants = [cfg.replace(backend="reference"), cfg.replace(weights_in_activation=True), cfg.replace(align=4)]
    x = torch.randn(2, 5, 24, requires_grad=True)
    out, aux = layer(x)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for v in variants:
        other = MoELayer(v)
        other.load_state_dict(layer.state_dict())
        o, a = other(x)
        torch.testing.assert_close(o, out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, aux)
        o.sum().backward()
        for n, p in other.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=f"{v}: grad of {n}")


def test_presets_at_full_size_on_meta():
    for name, preset in PRESETS.items():
        layer = MoELayer(preset(), device="meta")
        assert layer.experts.w13.shape[0] == preset().num_experts
        out, aux = layer(torch.empty(1, 4, preset().hidden_size, device="meta"))
        assert out.shape == (1, 4, preset().hidden_size)


def test_config_validation():
    with pytest.raises(ValueError, match="backend"):
        tiny(backend="triton")
    with pytest.raises(ValueError, match="shared_gate"):
        tiny(shared_gate=True)


@pytest.mark.parametrize("name", list(PRESETS))
def test_torch_native_backend_agrees(name):
    torch.manual_seed(5)
    cfg = tiny(name, hidden_size=32, ffn_size=16)
    layer = MoELayer(cfg)
    native = MoELayer(cfg.replace(backend="torch"))
    native.load_state_dict(layer.state_dict())
    x = torch.randn(2, 6, 32)
    out, aux = layer(x)
    out_n, aux_n = native(x)
    torch.testing.assert_close(out_n, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(aux_n, aux, rtol=1e-5, atol=1e-7)


def test_backends_under_autocast():
    torch.manual_seed(6)
    cfg = tiny("qwen3-30b-a3b", hidden_size=32, ffn_size=16)
    layer = MoELayer(cfg)
    native = MoELayer(cfg.replace(backend="torch"))
    native.load_state_dict(layer.state_dict())
    x = torch.randn(2, 6, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x)
        out_n, _ = native(x)
    assert out.dtype == out_n.dtype == torch.bfloat16
    torch.testing.assert_close(out_n.float(), out.float(), rtol=2e-2, atol=2e-2)
    (out.float().sum() + out_n.float().sum()).backward()
    assert layer.experts.w13.grad.dtype == torch.float32 and native.experts.w13.grad.dtype == torch.float32


@pytest.mark.parametrize("backend", ["kernels", "reference", "torch"])
def test_sequence_aux_loss_input_layouts(backend):
    # [B, S, H] is B sequences; [T, H] one sequence; [B*S, H] with seq_len=S the same as [B, S, H].
    torch.manual_seed(0)
    layer = MoELayer(PRESETS["deepseek-v3"](hidden_size=16, num_experts=8, k=2, num_groups=4, group_topk=2,
                                            ffn_size=8, shared_ffn_size=8, backend=backend))
    x = torch.randn(3, 5, 16)
    out3, aux3 = layer(x)
    out_flat, aux_flat = layer(x.reshape(15, 16), seq_len=5)
    torch.testing.assert_close(out_flat.view(3, 5, 16), out3, rtol=0, atol=0)
    torch.testing.assert_close(aux_flat, aux3, rtol=0, atol=0)
    out1, aux1 = layer(x[0])  # one sequence
    _, aux1b = layer(x[:1])
    torch.testing.assert_close(out1, out3[0])  # matmuls of other row counts round differently
    torch.testing.assert_close(aux1, aux1b, rtol=0, atol=0)
    assert aux3 > 0 and not torch.equal(aux3, layer(x.reshape(1, 15, 16))[1])  # the grouping matters
    for empty in (x[:, :0], x[0, :0]):  # no tokens: an empty output and zero losses
        out0, aux0 = layer(empty)
        assert out0.shape == empty.shape and float(aux0) == 0
    with pytest.raises(ValueError, match="x must be"):
        layer(x[0, 0])
