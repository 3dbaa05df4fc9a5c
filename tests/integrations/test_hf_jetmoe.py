"""patch_hf on JetMoE: its MoE block (JetMoeMoE) and its attention experts (JetMoeMoA's map and reduce), the experts'
projections held by the blocks themselves, on router_topk, permute, our grouped GEMMs and unpermute. Against
transformers' own code: outputs, router logits, aux loss and one SGD step in fp32 (the CPU references, and the
CPU-executed kernels with MOE_KERNELS_EMULATE=1), bf16 against fp64 on the GPU tier, no host sync where transformers
syncs in every layer, the precision recipes within their error models; the patch's mechanics (unpatch, pickle,
compile) and the blocks it leaves alone."""

import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import hf  # noqa: E402
from tests.integrations.hf_models import (  # noqa: E402
    V,
    _decisive_ids,
    assert_compiled_matches,
    assert_same_outputs,
    assert_same_sgd_step,
    inputs,
    run,
)
from tests.integrations.hf_models import patched_copy as patched  # noqa: E402

jetmoe = pytest.importorskip("transformers.models.jetmoe.modeling_jetmoe")
H = 32


def build(seed: int = 0, layers: int = 2, hidden: int = H, ffn: int = 16, kv_channels: int = 8, **overrides):
    """A tiny random JetMoE: 8 experts, top-2 by default, 2 key/value heads of kv_channels (the MoA's width D =
    2 kv_channels, k x 2 query heads). Router and projection weights scaled up, as hf_models.build does (decisive
    routing, experts a visible part of the logits), and the blocks' biases nonzero (transformers initialises them
    to zero). Every block routes its tokens to most of its experts (inputs())."""
    torch.manual_seed(seed)
    config = transformers.JetMoeConfig(**{
        "vocab_size": V, "hidden_size": hidden, "num_hidden_layers": layers, "num_key_value_heads": 2,
        "kv_channels": kv_channels, "intermediate_size": ffn, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 64, **overrides})
    model = transformers.JetMoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("input_linear.weight", "output_linear.weight")):
                p.normal_(0.0, 0.3)
            elif name.endswith("router.layer.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith((".mlp.bias", ".experts.bias")):  # (shared by every token: larger, and the next
                p.normal_(0.0, 0.02)  # block would route every token to the same experts)
    return model


def blocks(model):
    """The MoE blocks and the MoAs."""
    return [m for m in model.modules() if isinstance(m, (jetmoe.JetMoeMoE, jetmoe.JetMoeMoA))]


def assert_same(out, ref):
    """Logits, every layer's router logits (the first's exactly: the same input) and aux loss (assert_same_outputs),
    and the loss."""
    assert_same_outputs(out, ref)
    torch.testing.assert_close(out.router_logits[0], ref.router_logits[0], rtol=0, atol=0)
    if ref.loss is not None:
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)


CASES = [{}, {"num_experts_per_tok": 1}, {"num_experts_per_tok": 3}, {"activation_function": "gelu"}]
IDS = ["top2-silu", "top1", "top3", "gelu"]


@pytest.mark.parametrize("overrides", CASES, ids=IDS)
def test_forward_and_sgd_step_match_transformers(overrides):
    ref_model = build(**overrides)
    model = patched(ref_model)
    names = {type(m).__name__ for m in model.modules()}
    assert {"MoeKernelsJetMoeMoE", "MoeKernelsJetMoeMoA", "MoeKernelsJetMoeTopKGating"} <= names
    ids = inputs()
    with torch.no_grad():
        assert_same(run(model.eval(), ids), run(ref_model.eval(), ids))
    assert_same_sgd_step(model, ref_model, ids, run)
    for b in blocks(model):  # gradients reached the router, both projections and the bias
        for p in (b.router.layer.weight, b.input_linear.weight, b.output_linear.weight, b.bias):
            assert p.grad is not None and p.grad.abs().sum() > 0


def test_greedy_generation_matches_transformers():
    """generate() with the KV cache (each step one token a sequence: most experts empty): the patched model picks
    transformers' tokens."""
    ref_model = build().eval()
    model = patched(ref_model)
    ids = inputs()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), ref_model.generate(ids, **kw))


def test_hooks_on_the_projections_run():
    """A forward pre-hook on a projection (accelerate's offloading, FSDP2's unsharding install such hooks): the
    patched MoE block calls the projections as modules, once each (the hook sees the rows and the group sizes), with
    transformers' outputs."""
    ref_model = build(layers=1).eval()
    model = patched(ref_model)
    mlp = model.model.layers[0].mlp
    seen = []
    for name in ("input_linear", "output_linear"):
        getattr(mlp, name).register_forward_pre_hook(lambda m, args, _n=name: seen.append((_n, type(args[1]))))
    ids = inputs()
    with torch.no_grad():
        assert_same(run(model, ids), run(ref_model, ids))
    assert seen == [("input_linear", torch.Tensor), ("output_linear", torch.Tensor)]


def test_the_blocks_run_our_ops(monkeypatch):
    """Each layer: the MoA's map (one permute, the grouped GEMM on input_linear's [E, D, H], one unpermute gathering
    each slot's row) and reduce (one permute of the T k slots, the grouped GEMM on output_linear's [E, H, D], one
    weighted unpermute of the k slots), and the MoE block's experts (permute, the [E, 2F, H] and [E, H, F] grouped
    GEMMs, swiglu, unpermute; where the kernels run, CPU-executed ones included, MoELayer's fused "moe" region, one
    extension call each way); transformers' per-expert loop never runs."""
    from moe_kernels.nn import fused
    from moe_kernels.integrations.hf import experts as hf_experts
    from moe_kernels.integrations.hf import jetmoe as hf_jetmoe

    model = patched(build())
    calls = []

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls.append((name, *(tuple(a.shape) for a in args[:2])))
            return fn(*args, **kw)
        return wrapper

    for module in (hf_experts, hf_jetmoe):
        for name in ("permute", "grouped_mm", "unpermute", "swiglu"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    real_run = fused.run
    monkeypatch.setattr(fused, "run", lambda name, *args: calls.append(("fused", name)) or real_run(name, *args))
    monkeypatch.setattr(jetmoe.JetMoeParallelExperts, "forward", lambda *a: pytest.fail("transformers' loop ran"))
    ids = inputs()
    run(model, ids, labels=ids).loss.backward()
    T, k, E, F, D = ids.numel(), 2, 8, 16, 16
    R = T * k  # (align 1: no padding rows)
    want = [("permute", (T, H), (T, k)), ("grouped_mm", (R, H), (E, D, H)), ("unpermute", (R, D), (R, 1)),
            ("permute", (R, D), (R, 1)), ("grouped_mm", (R, D), (E, H, D)), ("unpermute", (R, H), (T, k)),
            ("permute", (T, H), (T, k)), ("grouped_mm", (R, H), (E, 2 * F, H)), ("swiglu", (R, 2 * F)),
            ("grouped_mm", (R, F), (E, H, F)), ("unpermute", (R, H), (T, k))]
    if fused.launch_for(torch.zeros(1, H)) is not None:
        want[6:] = [("fused", "moe")]
    assert calls == want * 2


def test_unpatch_pickle_and_a_fresh_process_class():
    ref_model = build().eval()
    model = patched(ref_model)
    ids = inputs()
    with torch.no_grad():
        ref = run(ref_model, ids)
        loaded = pickle.loads(pickle.dumps(model))
        assert hf.is_patched(loaded)
        assert {type(b).__name__ for b in blocks(loaded)} == {"MoeKernelsJetMoeMoE", "MoeKernelsJetMoeMoA"}
        assert_same(run(loaded, ids), ref)
        mk.unpatch_hf(loaded)
        assert not hf.is_patched(loaded)
        assert {type(b) for b in blocks(loaded)} == {jetmoe.JetMoeMoE, jetmoe.JetMoeMoA}
        assert {type(b.router) for b in blocks(loaded)} == {jetmoe.JetMoeTopKGating}
        assert {type(b.input_linear) for b in blocks(loaded)} == {jetmoe.JetMoeParallelExperts}
        assert_same(run(loaded, ids), ref)
    # unpickling in this process finds the patched classes by name
    for name, base in (("MoeKernelsJetMoeMoE", jetmoe.JetMoeMoE), ("MoeKernelsJetMoeMoA", jetmoe.JetMoeMoA),
                       ("MoeKernelsJetMoeTopKGating", jetmoe.JetMoeTopKGating),
                       ("MoeKernelsJetMoeParallelExperts", jetmoe.JetMoeParallelExperts)):
        cls = hf.patching._unpickled_class(name)
        assert cls.__bases__ == (base,) and cls in {type(m) for m in model.modules()}


def test_a_pickle_loads_in_a_fresh_process(tmp_path):
    """A pickled patched model loads in a new interpreter, which defines the patched classes by name (the package's
    module __getattr__): the same classes, and the logits of this process's model."""
    import subprocess
    import sys
    from pathlib import Path

    model = patched(build()).eval()
    ids = inputs()
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    script = f"""
import pickle, torch
import moe_kernels
model = pickle.loads(open({str(tmp_path / "model.pkl")!r}, "rb").read())
names = sorted({{type(m).__name__ for m in model.modules() if type(m).__name__.startswith("MoeKernels")}})
with torch.no_grad():
    torch.save((names, model(torch.load({str(tmp_path / "ids.pt")!r})).logits), {str(tmp_path / "out.pt")!r})
"""
    torch.save(ids, tmp_path / "ids.pt")
    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names, logits = torch.load(tmp_path / "out.pt")
    assert names == ["MoeKernelsJetMoeMoA", "MoeKernelsJetMoeMoE", "MoeKernelsJetMoeParallelExperts",
                     "MoeKernelsJetMoeTopKGating"]
    with torch.no_grad():  # (the other process's intra-op threads may split fp32 sums otherwise: 1e-5)
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def _mutated(what):
    """A one-layer model whose MoE block (or MoA) has one structure patch_hf refuses."""
    model = build(layers=1)
    mlp, moa = model.model.layers[0].mlp, model.model.layers[0].self_attention.experts
    with torch.no_grad():
        if what == "output shape":
            mlp.output_linear.weight = torch.nn.Parameter(torch.zeros(8, H, 15))
        elif what == "odd gate and up":
            mlp.input_linear.weight = torch.nn.Parameter(torch.zeros(8, 31, H))
        elif what == "router shape":
            mlp.router.layer = torch.nn.Linear(H, 7, bias=False)
        elif what == "top_k":
            mlp.router.top_k = 9
        elif what == "bias shape":
            mlp.bias = torch.nn.Parameter(torch.zeros(H + 1))
        elif what == "MoA top_k":
            moa.top_k = 3
        elif what == "expert count":
            mlp.input_linear.weight = torch.nn.Parameter(torch.zeros(7, 32, H))
    return model


@pytest.mark.parametrize(("what", "message"), [
    ("output shape", "unexpected weight shapes"), ("odd gate and up", "unexpected weight shapes"),
    ("router shape", "unexpected weight shapes"), ("top_k", "no valid top_k"),
    ("bias shape", "unexpected weight shapes"),
    ("MoA top_k", "top_k is not the attention's"), ("expert count", r"not \[E, N, K\] for its 8 experts")])
def test_a_block_of_another_structure_is_left_alone(what, message):
    # each refused with its reason in patch_hf's warning, before anything of it is patched; the rest of the model is
    model = _mutated(what)
    with pytest.warns(UserWarning, match=message):
        mk.patch_hf(model)
    names = [type(b).__name__ for b in blocks(model)]
    assert names.count("JetMoeMoE") + names.count("JetMoeMoA") == 1 and len(names) == 2


def test_a_moe_like_module_with_other_experts_stays_unsupported():
    # A module named like an MoE block whose `experts` is no supported block is reported as it is, even where another
    # of its children is one (JetMoE's attention is patched because its `experts` is its MoA).
    class WrapperMoE(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.experts = torch.nn.Linear(4, 4)
            self.inner = inner

    model = WrapperMoE(build(layers=1).model.layers[0].mlp)
    found = [(path, fam, problem) for path, _, fam, problem in hf.patching._scan(model)]
    assert len(found) == 1 and found[0][:2] == ("", None) and "not a supported family" in found[0][2]


def test_expert_parallel_sizes_the_attention_dispatch_for_k_slots(monkeypatch):
    """apply_expert_parallel on one rank with the dispatchers recorded (a LocalDispatcher each, every expert local):
    the MoA's nvlink buffers are sized for k rows a token (each slot dispatched as a token of one expert), the MoE
    block's for one; the expert-parallel paths (the MoA's slots dispatched, combined unsummed, weighed in fp32)
    give the one-rank model's logits and gradients."""
    from moe_kernels.dispatch import LocalDispatcher
    from moe_kernels.parallel import apply_expert_parallel, expert_parallel

    made = []

    def make(backend, E, group, **options):
        made.append((backend, options["max_tokens_per_rank"]))
        return LocalDispatcher(E)

    monkeypatch.setattr(expert_parallel, "make_dispatcher", make)
    full = patched(build(**{"num_experts_per_tok": 3}))
    ep = apply_expert_parallel(copy.deepcopy(full), backend="nvlink", max_tokens_per_rank=64)
    assert sorted(made) == [("nvlink", 64)] * 2 + [("nvlink", 192)] * 2  # 2 layers: the MoE block, the MoA (k = 3)
    ids = inputs()
    outs = []
    for model in (ep, full):
        out = run(model, ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for name, g in outs[1][1].items():
        torch.testing.assert_close(outs[0][1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_blocks_it_cannot_run_stay_transformers():
    # A projection that is no JetMoeParallelExperts (inside any peft wrappers) and quantised weights: warned about,
    # left as they are; a projection replaced after patch_hf: a clear error before any kernel runs.
    found = [(path, fam.name if fam else None, problem) for path, _, fam, problem in hf.patching._scan(build(layers=1))]
    assert sorted(found) == [("model.layers.0.mlp", "JetMoE", None),
                             ("model.layers.0.self_attention.experts", "JetMoE", None)]
    model = build(layers=1)
    mlp = model.model.layers[0].mlp
    mlp.input_linear = torch.nn.Sequential(mlp.input_linear)
    with pytest.warns(UserWarning, match="its input_linear is a Sequential, not transformers' JetMoeParallelExperts"):
        mk.patch_hf(model)
    assert [type(b).__name__ for b in blocks(model)] == ["JetMoeMoE", "MoeKernelsJetMoeMoA"]  # the MoA was patched
    model = patched(build(layers=1))
    mlp = model.model.layers[0].mlp
    mlp.output_linear = torch.nn.Sequential(mlp.output_linear)
    with pytest.raises(NotImplementedError, match="JetMoeMoE: its output_linear is a Sequential"):
        run(model, inputs())
    model = build(layers=1)
    mlp = model.model.layers[0].mlp
    mlp.input_linear.weight = torch.nn.Parameter(mlp.input_linear.weight.detach().to(torch.float8_e4m3fn),
                                                 requires_grad=False)
    with pytest.warns(UserWarning, match="quantised"):
        mk.patch_hf(model)
    assert type(mlp) is jetmoe.JetMoeMoE and type(model.model.layers[0].self_attention.experts) is not jetmoe.JetMoeMoA


LORA_TARGETS = [f"{block}.{proj}.weight" for block in ("mlp", "experts") for proj in ("input_linear", "output_linear")]


@pytest.mark.parametrize("when", ["before patch_hf", "after patch_hf"])
def test_fused_lora_equals_peft_within_the_policy(when, monkeypatch):
    """peft's LoRA on the four projections of each layer (the MoE block's and the MoA's): patched, the adapters run
    as rank-r grouped GEMMs beside ours (moe_kernels.integrations.peft's fused wrapper), never forming W + s B A; the
    logits and every adapter gradient within the fp64 policy of peft's own path on transformers' code (at most twice
    its fp32 error against the fp64 model, plus 8 ulps). Adapters added to a patched model run peft's own path
    (W + s B A in the weight, our grouped GEMMs) until patch_hf fuses them."""
    from torch.nn.utils import parametrize

    from moe_kernels.testing import assert_close_to_fp64
    from tests.integrations.test_peft import _logits_and_grads, _lora  # (peft imported there, or skipped)

    torch.manual_seed(0)
    base = build(layers=1)
    peft_model = _lora(copy.deepcopy(base), LORA_TARGETS)
    ids = inputs()
    if when == "before patch_hf":
        fused = mk.patch_hf(copy.deepcopy(peft_model))
    else:
        late = _lora(mk.patch_hf(copy.deepcopy(base)), LORA_TARGETS)
        late.load_state_dict(peft_model.state_dict())
        torch.testing.assert_close(_logits_and_grads(late, ids)[0], _logits_and_grads(peft_model, ids)[0],
                                   rtol=1e-5, atol=1e-5)  # peft's own path on our ops
        fused = mk.patch_hf(late)
    ref64_model = copy.deepcopy(peft_model).double()
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in fused.modules()) == 4
    registered = []
    real = parametrize.register_parametrization
    monkeypatch.setattr(parametrize, "register_parametrization", lambda *a, **k: registered.append(1) or real(*a, **k))
    out, grads = _logits_and_grads(fused, ids)
    assert registered == [], "the fused path never forms W + BA"
    theirs, their_grads = _logits_and_grads(peft_model, ids)
    ref, ref_grads = _logits_and_grads(ref64_model, ids)
    assert_close_to_fp64(out, theirs, ref, "logits")
    lora_names = [n for n in their_grads if "lora_" in n]
    assert len(lora_names) == 8 and set(lora_names) <= set(grads)
    for name in lora_names:
        assert_close_to_fp64(grads[name], their_grads[name], ref_grads[name], f"d{name}")


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_precision_recipe(recipe, monkeypatch):
    """patch_hf(recipe=...) on H = F = D = 128: each block's output against transformers' fp32 block on the same
    input within the recipe's error model (moe_kernels.testing; 2x allowed; above 0.1%: the recipe applied at all):
    the MoE block's SwiGLU experts (FP8: four E4M3 operands; NVFP4: measured on the operands its grouped_mm gets, the
    first product's errors counted twice, as in test_hf_recipes), the MoA's map and reduce (one product each: two
    operands); every projection's gradient reached."""
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error, relative_l2_error
    from tests.integrations.test_hf_recipes import _nvfp4_swiglu_error

    cls = Fp8BlockwiseRecipe if recipe == "fp8" else Nvfp4Recipe
    model = build(layers=1, hidden=128, ffn=128, kv_channels=64)
    mlp, moa = model.model.layers[0].mlp, model.model.layers[0].self_attention.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, 128, generator=g)
    a = torch.randn(2, 12, 2, 128, generator=g)
    with torch.no_grad():
        ref_mlp = mlp(x) - mlp.bias
        ref_q, _, topo = moa.map(x)
        ref_reduced = moa.reduce(a, topo) - moa.bias
    mk.patch_hf(model, recipe=cls())
    calls = []
    if recipe == "nvfp4":
        real = cls.grouped_mm
        monkeypatch.setattr(cls, "grouped_mm", lambda self, x, w, gs, *args, **kw: calls.append(
            (x.detach(), w.detach(), gs)) or real(self, x, w, gs, *args, **kw))
    x.requires_grad_(True)
    out_mlp = mlp(x)
    q, _, topo = moa.map(x)
    reduced = moa.reduce(a, topo)
    if recipe == "fp8":
        ffn_bound = QUANT_SLACK * quantized_product_error(*[E4M3_REL_ERROR] * 4)
        map_bound = reduce_bound = QUANT_SLACK * quantized_product_error(*[E4M3_REL_ERROR] * 2)
    else:  # call order: the MoE block's two products, then map's, then reduce's
        assert len(calls) == 4
        ffn_bound = _nvfp4_swiglu_error(calls[:2])
        map_bound, reduce_bound = (_nvfp4_swiglu_error([c], first=1.0) for c in calls[2:])
    for got, ref, bound, what in ((out_mlp - mlp.bias, ref_mlp, ffn_bound, "MoE block"), (q, ref_q, map_bound, "map"),
                                  (reduced - moa.bias, ref_reduced, reduce_bound, "reduce")):
        err = relative_l2_error(got, ref)
        assert 1e-3 < err < 2 * bound, (what, err, bound)
    (out_mlp.sum() + q.sum() + reduced.sum()).backward()
    for p in (mlp.input_linear.weight, mlp.output_linear.weight, moa.input_linear.weight, moa.output_linear.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_a_recipe_refused_at_patch_time():
    from moe_kernels.quant import Fp8BlockwiseRecipe

    model = build(layers=1, ffn=12)
    with pytest.raises(ValueError, match="does not fit the recipe"):
        mk.patch_hf(model, recipe=Fp8BlockwiseRecipe())
    assert not hf.is_patched(model)


def test_compiles_as_one_graph():
    """torch.compile(fullgraph=True) on the patched model (transformers' JetMoE does not compile whole: its router
    reads the expert sizes on the host): the registered ops, no graph break; the logits and every gradient as
    transformers' eager model by the SGD-step test's fp64 rule."""
    ref_model = build().train()
    assert_compiled_matches(patched(ref_model).train(), ref_model, inputs())


def test_patched_model_exports_and_runs_in_onnxruntime():
    """torch.onnx.export of the patched model as it is (transformers' own JetMoE does not export whole: its router
    reads the expert sizes on the host): the ops' ONNX formulations, no moe_kernels op left in the graph,
    onnxruntime's logits within assert_close_to_fp64's bound of ours against transformers' model in fp64."""
    pytest.importorskip("onnxscript")
    from tests.integrations.test_onnx import assert_exports_and_runs

    base = build(layers=1, use_cache=False).eval()
    ref64 = copy.deepcopy(base).double()
    model = mk.patch_hf(base)
    assert_exports_and_runs(model, ref64, _decisive_ids(model, ref64, 2, "cpu"))  # fp32 routes as fp64 does


@pytest.mark.gpu
def test_gpu_patched_model_has_no_host_sync(cuda):
    """The patched model's forward and backward on the CUDA code path read nothing on the host (transformers' own
    reads the expert sizes in every block and attention layer, which the check catches: it can fail)."""
    from moe_kernels.testing import HostSyncError, no_host_sync

    ref_model = build().to(cuda).train()
    model = patched(ref_model)
    ids = inputs(device=cuda)
    with no_host_sync():
        run(model, ids, labels=ids).loss.backward()
    with pytest.raises(HostSyncError), no_host_sync():
        run(ref_model, ids, labels=ids)


@pytest.mark.gpu
def test_gpu_bf16_matches_transformers(cuda):
    """The patched bf16 model and transformers' own bf16 model against the unpatched model in fp64 on the same
    weights and inputs (test_hf.test_gpu_bf16_matches_transformers' method): logits, aux loss, loss, every gradient
    and the parameters after one SGD step within assert_close_to_fp64's bound of transformers' own bf16 error."""
    from tests.integrations.test_hf import assert_bf16_step_close_to_fp64

    base = build(layers=1)
    base.set_attn_implementation("eager")
    base = base.to(device=cuda, dtype=torch.bfloat16).train()
    ref64 = copy.deepcopy(base).to(torch.float64)
    model = patched(base)
    assert_bf16_step_close_to_fp64(ref64, base, model, _decisive_ids(base, ref64, 2, cuda), run)
