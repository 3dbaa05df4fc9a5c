"""peft LoRA on fused expert weights run as grouped low-rank GEMMs (moe_kernels.integrations.peft,
moe_kernels.nn.lora): equal to peft's materialised W + BA within the tolerance policy, never forming it,
training only the adapters, merging, and peft's save/load format."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils import parametrize

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import peft as mk_peft  # noqa: E402
from moe_kernels.nn import MoELayer  # noqa: E402
from moe_kernels.nn.moe import qwen3_30b_a3b  # noqa: E402
from moe_kernels.testing import assert_close_to_fp64  # noqa: E402
from tests.integrations.hf_models import build, inputs, moe_blocks  # noqa: E402

HF_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _targets(family):
    """peft's targets for the family's experts: Llama 4's under feed_forward; Nemotron-H's (no gate) under mixer;
    Ergo's (no gate) up_proj."""
    if family == "llama4":
        return [t.replace("mlp.", "feed_forward.") for t in HF_TARGETS]
    if family == "nemotron_h":
        return ["mixer.experts.up_proj", "mixer.experts.down_proj"]
    if family == "ergo":
        return ["mlp.experts.up_proj", "mlp.experts.down_proj"]
    return HF_TARGETS


def _lora(model, targets=HF_TARGETS, r=4):
    # init_lora_weights=False: B is random too, so the adapter changes the output from the first step.
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=[], target_parameters=targets,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.square().mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


# GPT-OSS (biased), Aria and Ergo (no gate, a norm per expert after them): experts stored [E, K, N]; Llama 4: its
# patched block calls the experts through peft's wrappers
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "aria", "llama4", "nemotron_h", "ergo"])
def test_fused_lora_equals_peft_within_the_policy(family, monkeypatch):
    torch.manual_seed(0)
    targets = _targets(family)
    peft_model = _lora(build(family, layers=1), targets)
    ids = inputs()
    fused = mk.patch_hf(copy.deepcopy(peft_model))
    peft_model.get_base_model().set_experts_implementation("eager")  # transformers' plain loop: fp64 too
    ref64_model = copy.deepcopy(peft_model).double()
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in fused.modules()) == 2
    registered = []
    real = parametrize.register_parametrization
    monkeypatch.setattr(parametrize, "register_parametrization", lambda *a, **k: registered.append(1) or real(*a, **k))
    out, grads = _logits_and_grads(fused, ids)
    assert registered == [], "the fused path never forms W + BA"
    base, base_grads = _logits_and_grads(peft_model, ids)
    assert registered, "peft's own path parametrizes the weight"
    ref, ref_grads = _logits_and_grads(ref64_model, ids)
    # Error policy: our fp32 result at most 2x peft's fp32 error against the fp64 run (plus 8 ulps).
    assert_close_to_fp64(out, base, ref, f"{family} logits")
    lora_names = [n for n in base_grads if "lora_" in n]
    assert lora_names and set(lora_names) <= set(grads)
    for name in lora_names:
        assert_close_to_fp64(grads[name], base_grads[name], ref_grads[name], f"{family} d{name}")


def test_lora_on_nemotron_h_latent_projections_and_experts():
    # Nemotron-H with latent experts (moe_latent_size): peft's LoRA on the latent projections (`all-linear` takes
    # them) wraps fc1_latent_proj, whose width tells the router's [E, H] weight from the experts' latent H; the block
    # is patched, both expert adapters fused, and the logits are peft's own within the fp32 bound of the forward tests.
    torch.manual_seed(0)
    model = build("nemotron_h", layers=1, moe_latent_size=24, n_group=1, topk_group=1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1_latent_proj", "fc2_latent_proj"],
                             target_parameters=_targets("nemotron_h"), init_lora_weights=False)
    peft_model = peft.get_peft_model(model, config)
    ids = inputs()
    with torch.no_grad():
        ref = peft_model(ids).logits
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # patched without a warning: no block left on transformers' code
        fused = mk.patch_hf(peft_model)
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in fused.modules()) == 2
    assert mk.integrations.hf.is_patched(fused)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt_oss", "aria"])
def test_fused_lora_while_exporting_keeps_the_adapter(family, monkeypatch):
    # While torch.onnx exports, experts stored [E, K, N] run transformers' forward, which reads the weight: the
    # fused wrapper then takes peft's own path (W + s B A in the weight) rather than terms nobody reads. (The export
    # itself: tests/integrations/test_onnx.py, for Llama 4; transformers' forward of these experts does not export.)
    import moe_kernels.onnx

    torch.manual_seed(0)
    model = mk.patch_hf(_lora(build(family, layers=1)))
    ids = inputs()
    with torch.no_grad():
        eager = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
        monkeypatch.setattr(moe_kernels.onnx, "exporting", lambda: True)
        exporting = model(ids).logits
    assert (eager - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(exporting, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4", "nemotron_h"])
def test_gpu_fused_lora_equals_peft_within_the_policy(cuda, family):
    # The fused adapters on the CUDA path (our grouped GEMMs: the [E, N, K] products for Qwen3-MoE, the [E, K, N]
    # ones for GPT-OSS and Llama 4) against peft's W + s B A on the same patched model, and both against fp64 on
    # the CPU: ours at most 2x peft's fp32 error (plus 8 ulps), the error policy of the CPU test above.
    torch.manual_seed(0)
    targets = _targets(family)
    cpu_model = _lora(build(family, layers=1), targets)
    ref64_model = copy.deepcopy(cpu_model).double()  # transformers' own code, unpatched (the plain loop: fp64 too)
    ref64_model.get_base_model().set_experts_implementation("eager")
    peft_model = mk.patch_hf(copy.deepcopy(cpu_model).to(cuda))
    fused = copy.deepcopy(peft_model)
    assert mk_peft.unfuse_lora(peft_model) == 2 and mk_peft.fuse_lora(fused) == 0  # fused by patch_hf already
    ids = inputs()
    out, grads = _logits_and_grads(fused, ids.to(cuda))
    base, base_grads = _logits_and_grads(peft_model, ids.to(cuda))
    ref, ref_grads = _logits_and_grads(ref64_model, ids)
    assert_close_to_fp64(out.cpu(), base.cpu(), ref, f"{family} logits")
    lora_names = [n for n in base_grads if "lora_" in n]
    assert lora_names and set(lora_names) <= set(grads)
    for name in lora_names:
        assert_close_to_fp64(grads[name].cpu(), base_grads[name].cpu(), ref_grads[name], f"{family} d{name}")


def test_fine_tune_changes_only_the_adapters():
    torch.manual_seed(0)
    model = build("qwen3_moe")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = mk.patch_hf(_lora(model))
    ids = inputs(batch=4, seq=16)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=5e-2)
    losses = []
    for _ in range(12):
        loss = peft_model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses  # the adapters learn
    base = peft_model.get_base_model()
    for name, p in base.named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            torch.testing.assert_close(p, frozen[key], rtol=0, atol=0, msg=f"{name} changed")


def test_merge_and_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    base = build("qwen3_moe")
    peft_model = mk.patch_hf(_lora(copy.deepcopy(base)))
    ids = inputs()
    with torch.no_grad():
        want = peft_model(ids).logits
    # peft's format: saved from the fused model, loaded by PeftModel.from_pretrained onto a fresh base.
    peft_model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    assert mk_peft.fuse_lora(loaded) == 0  # its experts run transformers' code until patched
    mk.patch_hf(loaded)
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in loaded.modules()) == 2 * len(moe_blocks(loaded))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=0)
        # Merged into the base weights: W + s B A formed once; the same function up to fp32 rounding.
        merged = loaded.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        ref64 = _lora_reference64(base, tmp_path / "adapter", ids)
        assert_close_to_fp64(merged(ids).logits, want, ref64, "merged logits")


def _lora_reference64(base, adapter_dir, ids):
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).double()
    model.get_base_model().set_experts_implementation("eager")
    with torch.no_grad():
        return model(ids).logits


def test_unfuse_returns_to_peft():
    peft_model = mk.patch_hf(_lora(build("qwen3_moe", layers=1)))
    other = mk.patch_hf(_lora(build("qwen3_moe", layers=1)))  # a second fuse: still the one wrapper class
    assert mk_peft.fuse_lora(peft_model) == 0
    assert mk_peft.unfuse_lora(other) == 2 and mk_peft.unfuse_lora(peft_model) == 2
    assert not any(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in peft_model.modules())
    assert mk_peft.fuse_lora(peft_model) == 2


def test_grouped_experts_of_our_moe_layer():
    # peft targets GroupedExperts' w13 / w2 directly; fuse_lora runs the adapters as grouped GEMMs.
    torch.manual_seed(0)
    layer = MoELayer(qwen3_30b_a3b(hidden_size=32, ffn_size=16, num_experts=8, k=2))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.w13", "experts.w2"],
                             init_lora_weights=False)
    plain = peft.get_peft_model(layer, config)
    fused = copy.deepcopy(plain)
    assert mk_peft.fuse_lora(fused) == 2
    ref64 = copy.deepcopy(plain).double()
    x = torch.randn(3, 11, 32)
    outs = []
    for model, inp in ((fused, x), (plain, x), (ref64, x.double())):
        inp = inp.clone().requires_grad_()
        out, aux = model(inp)
        (out.square().sum() + aux).backward()
        grad_a = next(p.grad for n, p in model.named_parameters() if "lora_A" in n)
        outs.append((out.detach(), inp.grad, grad_a))
    for i, what in enumerate(("out", "dx", "dlora_A")):
        assert_close_to_fp64(outs[0][i], outs[1][i], outs[2][i], f"GroupedExperts LoRA {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, "fp8"])
def test_gpu_grouped_experts_of_our_moe_layer(cuda, recipe):
    # On the CUDA path the layer would otherwise take its fused regions (or the FP8 recipe's fused permute), which
    # read the weights: with an adapter wrapper around the experts it calls them through it. Without a recipe: fused
    # adapters against peft's W + s B A on the same layer and both against fp64 on the CPU, ours at most 2x peft's
    # error (plus 8 ulps). FP8: our output against the fp64 layer without the recipe, above the SQNR floor of four
    # quantized operands (moe_kernels.testing's model, as tests/quant/test_recipe.py bounds the recipe's layer).
    from moe_kernels.quant import Fp8BlockwiseRecipe
    from moe_kernels.testing import quantized_sqnr_floor_db, sqnr_db

    torch.manual_seed(0)
    extra = {} if recipe is None else dict(recipe=Fp8BlockwiseRecipe(), hidden_size=128, ffn_size=128)
    cfg = qwen3_30b_a3b(**{"hidden_size": 32, "ffn_size": 16, "num_experts": 8, "k": 2, **extra})
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.w13", "experts.w2"],
                             init_lora_weights=False)
    cpu = peft.get_peft_model(MoELayer(cfg), config)
    plain = copy.deepcopy(cpu).to(cuda)
    fused = copy.deepcopy(plain)
    assert mk_peft.fuse_lora(fused) == 2
    ref64 = copy.deepcopy(cpu).double()
    ref64.get_base_model().config = cfg.replace(backend="reference", recipe=None)  # the references, in fp64
    x = torch.randn(3, 11, cfg.hidden_size)
    outs = []
    for model, inp in ((fused, x.to(cuda)), (plain, x.to(cuda)), (ref64, x.double())):
        inp = inp.clone().requires_grad_()
        out, aux = model(inp)
        (out.square().sum() + aux).backward()
        grad_a = next(p.grad for n, p in model.named_parameters() if "lora_A" in n)
        outs.append((out.detach().cpu(), inp.grad.cpu(), grad_a.cpu()))
    assert fused.get_base_model().expert_path == "ops"
    with torch.no_grad(), fused.disable_adapter():
        bare = fused(x.to(cuda))[0].cpu()
    # adapters off: the layer's own fast path again
    assert fused.get_base_model().expert_path == ("fused" if recipe is None else "recipe")
    assert (bare - outs[0][0]).abs().max() > 1e-2, "the adapter reaches the output"
    if recipe is None:
        for i, what in enumerate(("out", "dx", "dlora_A")):
            assert_close_to_fp64(outs[0][i], outs[1][i], outs[2][i], f"GroupedExperts LoRA {what}")
    else:
        floor = quantized_sqnr_floor_db(4)
        for got, what in ((outs[0][0], "ours"), (outs[1][0], "peft's")):
            assert sqnr_db(got.double(), outs[2][0]) > floor, f"FP8 LoRA output, {what}"


def test_torch_native_layer_refuses_adapters():
    # The torch-native backend reads the expert weights itself: it would drop the adapter.
    layer = MoELayer(qwen3_30b_a3b(hidden_size=32, ffn_size=16, num_experts=8, k=2, backend="torch"))
    config = peft.LoraConfig(r=4, target_modules=[], target_parameters=["experts.w13"])
    model = peft.get_peft_model(layer, config)
    with pytest.raises(ValueError, match="torch-native backend runs no adapters"):
        model(torch.randn(5, 32))


def test_a_second_adapter_on_fused_wrappers():
    # peft finds its wrappers by class name to add a further adapter to them (add_adapter, load_adapter): the fused
    # wrappers take it too. Both active: peft's own path (W + both deltas); one: the fused path. Against the same
    # model on peft's own wrappers, within fp32 rounding of W + s B A (outputs O(1): a few 1e-7; 1e-5 allowed).
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=HF_TARGETS,
                             init_lora_weights=False)
    plain = _lora(build("qwen3_moe", layers=1))
    plain.add_adapter("second", config)
    fused = mk.patch_hf(copy.deepcopy(plain))  # both adapters there when fused
    again = mk.patch_hf(_lora(build("qwen3_moe", layers=1)))  # fused first, the second adapter added afterwards
    again.add_adapter("second", config)
    again.load_state_dict(plain.state_dict())
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in again.modules()) == 2
    ids = inputs()
    for active in (["default", "second"], "second"):
        for model in (plain, fused, again):
            model.base_model.set_adapter(active)
        with torch.no_grad():
            want = plain(ids).logits
            for model in (fused, again):
                torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5, msg=str(active))


@pytest.mark.gpu
def test_gpu_merged_and_disabled_adapters_on_our_moe_layer(cuda):
    # The layer reads the experts' weights on its fast path only where they hold what the wrapper would compute:
    # adapters merged (the delta in the weights), or disabled and unmerged; merged and then disabled, peft's forward
    # unmerges first, so the layer calls it. Each state against the layer it stands for, within fp32 rounding of
    # W + s B A (outputs O(1), K <= 32: a few 1e-7; 1e-5 allowed).
    torch.manual_seed(0)
    cfg = qwen3_30b_a3b(hidden_size=32, ffn_size=16, num_experts=8, k=2)
    base = MoELayer(cfg).to(cuda)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.w13", "experts.w2"],
                             init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    mk_peft.fuse_lora(model)
    x = torch.randn(3, 11, 32, device=cuda)
    layer = model.get_base_model()
    with torch.no_grad():
        bare, adapted = base(x)[0], model(x)[0]
        assert layer.expert_path == "ops" and (adapted - bare).abs().max() > 1e-2
        with model.disable_adapter():
            torch.testing.assert_close(model(x)[0], bare, rtol=1e-5, atol=1e-5)
            assert layer.expert_path == "fused"
        model.merge_adapter()
        torch.testing.assert_close(model(x)[0], adapted, rtol=1e-5, atol=1e-5)
        assert layer.expert_path == "fused"
        with model.disable_adapter():
            torch.testing.assert_close(model(x)[0], bare, rtol=1e-5, atol=1e-5)
            assert layer.expert_path == "ops"
