"""patch_hf on DBRX (transformers' DbrxFFN): its router and routing stay transformers', its experts (w1, v1 and w2
stored [E * F, H] each) run permute, our grouped GEMMs on views of the stored weights and unpermute. Against
transformers' own code: outputs, router logits, aux loss and one SGD step in fp32 (the CPU references, and the
CPU-executed kernels with MOE_KERNELS_EMULATE=1), bf16 against fp64 on the GPU tier, the FP8 recipe within its error
model; the patch's mechanics (unpatch, pickle) and the blocks it leaves alone."""

import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import hf  # noqa: E402
from tests.integrations.hf_models import V, assert_compiled_matches, assert_same_sgd_step, inputs  # noqa: E402

dbrx = pytest.importorskip("transformers.models.dbrx.modeling_dbrx")
H = 32


def build(seed: int = 0, layers: int = 2, d_model: int = H, use_cache: bool = True, **ffn) -> torch.nn.Module:
    """A tiny random DBRX: 8 experts of F 16, top-2 by default. transformers' DbrxAttention reads
    attn_config.rope_theta and clamps by clip_qkv, so the config names both (DBRX's checkpoints do). Router and
    expert weights scaled up, as hf_models.build does: decisive routing, experts a visible part of the logits."""
    torch.manual_seed(seed)
    config = transformers.DbrxConfig(
        d_model=d_model, n_heads=4, n_layers=layers, max_seq_len=64, vocab_size=V, use_cache=use_cache,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2, **ffn})
    model = transformers.DbrxForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.w1", "mlp.v1", "mlp.w2")):
                p.normal_(0.0, 0.3)
            elif name.endswith("router.layer.weight"):
                p.normal_(0.0, 1.0)
    return model


def blocks(model):
    return [m for m in model.modules() if isinstance(m, dbrx.DbrxFFN)]


def patched(model):
    other = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported block patches without a warning
        mk.patch_hf(other)
    return other


def run(model, ids, **kw):
    return model(ids, output_router_logits=True, **kw)


def assert_same(out, ref, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(out.logits, ref.logits, rtol=rtol, atol=atol)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    torch.testing.assert_close(out.router_logits[0], ref.router_logits[0], rtol=0, atol=0)  # the same input
    for a, b in zip(out.router_logits, ref.router_logits, strict=True):  # later layers': fp32 sums in another order
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    if ref.loss is not None:
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=rtol, atol=atol)
        torch.testing.assert_close(out.loss, ref.loss, rtol=rtol, atol=atol)


CASES = [
    {},  # DBRX's top-4 of 16 in miniature: top-2, the weights over their 1-norm
    {"moe_top_k": 1},
    {"moe_normalize_expert_weights": None},  # the softmax weights as they are
    {"moe_normalize_expert_weights": 2.0},
    {"moe_jitter_eps": 0.1},  # the router's input jittered in training (the same draws: the same seed)
]
IDS = ["default", "k1", "unnormalised", "2-norm", "jitter"]


@pytest.mark.parametrize("ffn", CASES, ids=IDS)
def test_forward_and_sgd_step_match_transformers(ffn):
    ref_model = build(**ffn)
    model = patched(ref_model)
    assert all(type(b.experts).__name__ == "MoeKernelsDbrxExperts" for b in blocks(model))
    assert all(type(b.router) is dbrx.DbrxRouter and type(b) is dbrx.DbrxFFN for b in blocks(model))
    ids = inputs()
    with torch.no_grad():
        assert_same(run(model.eval(), ids), run(ref_model.eval(), ids))
    assert_same_sgd_step(model, ref_model, ids, run)  # (the jitter's draws the same)
    for b in blocks(model):  # gradients reached the router and the three expert weights
        for p in (b.router.layer.weight, b.experts.mlp.w1, b.experts.mlp.v1, b.experts.mlp.w2):
            assert p.grad is not None and p.grad.abs().sum() > 0


def test_the_experts_run_our_ops(monkeypatch):
    """Each layer's experts: one permute, the gate and up products on [E, F, H] views of w1 and v1, the down
    product on w2's view as stored ([E, K, N]), one unpermute; transformers' per-expert loop never runs."""
    from moe_kernels.integrations.hf import experts as hf_experts

    model = patched(build())
    calls = []

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls.append((name, *(tuple(a.shape) for a in args[:2])))
            return fn(*args, **kw)
        return wrapper

    for name in ("permute", "grouped_mm", "unpermute", "_kn_mm"):
        monkeypatch.setattr(hf_experts, name, counted(name, getattr(hf_experts, name)))
    monkeypatch.setattr(dbrx.DbrxExpertGLU, "forward", lambda *a: pytest.fail("transformers' expert loop ran"))
    ids = inputs()
    run(model, ids, labels=ids).loss.backward()
    T, k, E, F = ids.numel(), 2, 8, 16
    R = T * k  # (align 1: no padding rows)
    want = [("permute", (T, H), (T, k)), ("grouped_mm", (R, H), (E, F, H)), ("grouped_mm", (R, H), (E, F, H)),
            ("_kn_mm", (R, F), (E, F, H)), ("unpermute", (R, H), (T, k))]
    assert calls == want * 2


def test_unpatch_pickle_and_a_fresh_process_class():
    ref_model = build().eval()
    model = patched(ref_model)
    ids = inputs()
    with torch.no_grad():
        ref = run(ref_model, ids)
        loaded = pickle.loads(pickle.dumps(model))
        assert hf.is_patched(loaded) and type(blocks(loaded)[0].experts).__name__ == "MoeKernelsDbrxExperts"
        assert_same(run(loaded, ids), ref)
        mk.unpatch_hf(loaded)
        assert not hf.is_patched(loaded) and type(blocks(loaded)[0].experts) is dbrx.DbrxExperts
        assert_same(run(loaded, ids), ref)
    # unpickling in a fresh process defines the patched class by name
    cls = hf.patching._unpickled_class("MoeKernelsDbrxExperts")
    assert cls is type(blocks(model)[0].experts) and cls.__bases__ == (dbrx.DbrxExperts,)


def test_blocks_it_cannot_run_stay_transformers():
    # An adapter wrapper around the GLU (peft's ParamWrapper; its LoRA on the stacked [E * F, H] weights is not per
    # expert), and quantised weights: warned about, left as they are. A wrapper added after patch_hf: a clear error.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=[], target_parameters=["mlp.w1"])
    model = peft.get_peft_model(build(layers=1), config)
    experts = blocks(model)[0].experts
    with pytest.warns(UserWarning, match="its experts' mlp is a ParamWrapper, not transformers' DbrxExpertGLU"):
        mk.patch_hf(model)
    assert type(experts) is dbrx.DbrxExperts and not hf.is_patched(model)
    model = patched(build(layers=1))
    blocks(model)[0].experts.mlp = torch.nn.Sequential(blocks(model)[0].experts.mlp)
    with pytest.raises(NotImplementedError, match="DBRX's experts' mlp is a Sequential"):
        run(model, inputs())
    model = build(layers=1)
    mlp = blocks(model)[0].experts.mlp
    mlp.w2 = torch.nn.Parameter(mlp.w2.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.warns(UserWarning, match="quantised"):
        mk.patch_hf(model)
    assert not hf.is_patched(model)
    found = [(fam.name if fam else None, problem) for _, _, fam, problem in hf.patching._scan(build(layers=1))]
    assert found == [("DBRX", None)]


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_precision_recipe(recipe, monkeypatch):
    """patch_hf(recipe=...): the gate and up products through the recipe's grouped_mm, the down product through its
    grouped_mm_kn (rows padded to its alignment), logits within the recipe's error model (test_hf_recipes': FP8's
    four E4M3 operands; NVFP4's measured on these operands, the first product's errors counted twice, as gate and
    up share its input; 2x allowed; above 0.1%: the recipe applied at all), every expert weight's gradient reached
    (H = F = 128)."""
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error, relative_l2_error
    from tests.integrations.test_hf_recipes import _nvfp4_swiglu_error

    cls = Fp8BlockwiseRecipe if recipe == "fp8" else Nvfp4Recipe
    model = build(layers=1, d_model=128, ffn_hidden_size=128)
    ids = inputs()
    with torch.no_grad():
        ref = run(model, ids).logits
    mk.patch_hf(model, recipe=cls())
    calls = []
    for method in ("grouped_mm", "grouped_mm_kn"):
        real = getattr(cls, method)

        def spy(self, x, w, gs, *a, _method=method, _real=real, **kw):
            calls.append((_method, x.detach(), w.detach(), gs))
            return _real(self, x, w, gs, *a, **kw)
        monkeypatch.setattr(cls, method, spy)
    out = run(model, ids, labels=ids)
    assert [c[0] for c in calls] == ["grouped_mm", "grouped_mm", "grouped_mm_kn"]
    assert all(int(gs.sum()) % cls().align == 0 for *_, gs in calls)
    err = relative_l2_error(out.logits, ref)
    if recipe == "fp8":
        bound = QUANT_SLACK * quantized_product_error(*[E4M3_REL_ERROR] * 4)
    else:  # (gate's operands for both halves, the down product's weight in grouped_mm's [E, N, K])
        (_, x, w1, gs), (_, act, w2, _) = calls[0], calls[2]
        bound = _nvfp4_swiglu_error([(x, w1, gs), (act, w2.transpose(1, 2).contiguous(), gs)])
    assert 1e-3 < err < 2 * bound, (err, bound)
    out.loss.backward()
    mlp = blocks(model)[0].experts.mlp
    for p in (mlp.w1, mlp.v1, mlp.w2):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_a_recipe_refused_at_patch_time():
    from moe_kernels.quant import Fp8BlockwiseRecipe

    model = build(layers=1, ffn_hidden_size=12)
    with pytest.raises(ValueError, match="does not fit the recipe"):
        mk.patch_hf(model, recipe=Fp8BlockwiseRecipe())
    assert not hf.is_patched(model)


def _decisive_ids(model, ref64, k, device):
    """Inputs whose top-k is decided alike in the bf16 model and the fp64 one (no tie at the bf16 boundary)."""
    def picks(m, ids):
        with torch.no_grad():
            logits = run(m, ids).router_logits[0].float()
        return logits.sort(-1, descending=True).values[:, k - 1 : k + 1], logits.topk(k).indices.sort(-1).values

    for seed in range(50):
        ids = inputs(seed, device=device)
        (boundary, p16), (_, p64) = picks(model, ids), picks(ref64, ids)
        if (boundary[:, 0] != boundary[:, 1]).all() and torch.equal(p16, p64):
            return ids
    raise AssertionError("no input found whose routing is decided the same way in bf16 and fp64")


@pytest.mark.gpu
def test_gpu_bf16_matches_transformers(cuda):
    """The patched bf16 model and transformers' own bf16 model against the unpatched model in fp64 on the same
    weights and inputs (test_hf.test_gpu_bf16_matches_transformers' method): logits, router logits, aux loss, loss,
    every gradient and the parameters after one SGD step within assert_close_to_fp64's bound of transformers' own
    bf16 error."""
    from tests.integrations.test_hf import assert_bf16_step_close_to_fp64

    base = build(layers=1)
    base.set_attn_implementation("eager")
    base = base.to(device=cuda, dtype=torch.bfloat16).train()
    ref64 = copy.deepcopy(base).to(torch.float64)
    model = patched(base)
    assert_bf16_step_close_to_fp64(ref64, base, model, _decisive_ids(base, ref64, 2, cuda), run)


def test_patched_model_exports_and_runs_in_onnxruntime():
    """torch.onnx.export of the patched model as it is (transformers' own DBRX experts do not export: their loop
    runs over the experts hit, a data-dependent list): the ops' ONNX formulations, no moe_kernels op left in the
    graph, onnxruntime's logits within assert_close_to_fp64's bound of ours against transformers' model in fp64."""
    pytest.importorskip("onnxscript")
    from tests.integrations.test_onnx import assert_exports_and_runs

    base = build(layers=1, use_cache=False).eval()
    ref64 = copy.deepcopy(base).double()
    model = mk.patch_hf(base)
    assert_exports_and_runs(model, ref64, _decisive_ids(model, ref64, 2, "cpu"))  # fp32 routes as fp64 does


def test_compiles_as_one_graph():
    """torch.compile(fullgraph=True) on the patched model: the registered ops, no graph break; the logits and every
    gradient as transformers' eager model by the SGD-step test's fp64 rule."""
    ref_model = build().train()
    assert_compiled_matches(patched(ref_model).train(), ref_model, inputs())
