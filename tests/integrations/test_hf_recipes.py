"""patch_hf(model, recipe=...) on tiny random transformers models: the routed experts' GEMMs on the FP8 and NVFP4
recipes within their error models (experts stored [E, N, K] and [E, K, N], with and without a gate), the fused FP8
producers taken, refusals at patch time; and transformers' own tensor and expert parallelism refused."""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import hf  # noqa: E402
from moe_kernels.testing import NVFP4_EPS_CAP, relative_l2_error  # noqa: E402
from tests.integrations.hf_models import H, build, inputs, moe_blocks, run  # noqa: E402


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_gpt_oss_on_a_recipe(recipe, monkeypatch):
    # GPT-OSS's biased experts (stored [E, H, 2F] with gate/up interleaved, and [E, F, H]; a clamped SwiGLU) on a
    # precision recipe: both GEMMs through its grouped_mm_kn, each bias added into the output. H = 144 and F = 48
    # are no multiples of 128, as GPT-OSS's 2880 (FP8 pads the contractions). Logits within the recipe's error of the
    # model's own; weights' and biases' gradients reached.
    _gpt_oss_recipe_case(recipe, "cpu", monkeypatch)


@pytest.mark.gpu
def test_gpu_gpt_oss_on_the_fp8_recipe(cuda, monkeypatch):
    _gpt_oss_recipe_case("fp8", cuda, monkeypatch)


def _gpt_oss_recipe_case(recipe, device, monkeypatch):
    model = build("gpt_oss", layers=1, hidden_size=144, intermediate_size=48).to(device)
    experts = moe_blocks(model)[0].experts
    with torch.no_grad():  # biases large enough to matter
        experts.gate_up_proj_bias.normal_(0.0, 0.3)
        experts.down_proj_bias.normal_(0.0, 0.3)
    _check_kn_recipe(model, recipe, device, monkeypatch, (experts.gate_up_proj, experts.down_proj,
                                                           experts.gate_up_proj_bias, experts.down_proj_bias))


def test_group_bias_adds_and_sums_per_group():
    # The recipe path's bias: out[rows of e] += bias[e] in place; its gradient each group's rows of g summed (an
    # empty group: zeros; rows past the groups: no part of any sum).
    from moe_kernels.integrations.hf.experts import _GroupBias

    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 0, 5], dtype=torch.int32)
    base = torch.randn(10, 6, generator=g, requires_grad=True)
    bias = torch.randn(3, 6, generator=g, requires_grad=True)
    out = _GroupBias.apply(base * 1.0, bias, sizes)
    rows = torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 2, 2])
    torch.testing.assert_close(out, base.detach() + bias.detach()[rows], rtol=0, atol=0)
    dout = torch.randn(10, 6, generator=g)
    dbase, dbias = torch.autograd.grad(out, (base, bias), dout)
    torch.testing.assert_close(dbase, dout, rtol=0, atol=0)
    want = torch.stack([dout[:3].sum(0), torch.zeros(6), dout[3:8].sum(0)])
    torch.testing.assert_close(dbias, want, rtol=1e-6, atol=1e-6)


def _nvfp4_swiglu_error(calls, first: float = 2.0) -> float:
    """The quantization error model (moe_kernels.testing) of NVFP4 SwiGLU experts, from the operands of each
    block's two forward GEMMs (`calls`: (x, w, group_sizes) in call order, gate/up then down), quantized as
    the recipe does: sqrt(sum of eps^2), the first GEMM's operands counted twice (their error reaches the
    activation through both the gate and the up half; silu's log-derivative is ~1). `first`: that weight of the
    first GEMM's squared errors (4 for a squared ReLU, whose log-derivative is 2)."""
    from moe_kernels.ops.grouped_mm_nvfp4 import quantize_nvfp4_experts
    from moe_kernels.ops.quant import dequantize_nvfp4, quantize_nvfp4

    total = 0.0
    for i, (x, w, group_sizes) in enumerate(calls):
        x = x[: int(group_sizes.sum())].float()  # rows past the groups are zeroed before quantizing
        q, s, g = quantize_nvfp4_experts(w.float())
        w_deq = dequantize_nvfp4(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1]), g, dtype=torch.float32)
        eps_x = relative_l2_error(dequantize_nvfp4(*quantize_nvfp4(x), dtype=torch.float32), x)
        eps_w = relative_l2_error(w_deq.view(w.shape), w)
        assert eps_x < NVFP4_EPS_CAP and eps_w < NVFP4_EPS_CAP, (eps_x, eps_w)  # the quantizer itself is sound
        total += (first if i % 2 == 0 else 1) * (eps_x**2 + eps_w**2)
    return total**0.5


def _run_on_recipe(model, ids, cls, method, monkeypatch):
    """patch_hf(model, recipe=cls()), then one forward with the labels: (its output, the operands (x, w, group
    sizes) of every call of the recipe's `method`, the experts' forward GEMMs)."""
    mk.patch_hf(model, recipe=cls())
    calls = []
    real = getattr(cls, method)
    monkeypatch.setattr(cls, method,
                        lambda self, x, w, gs: calls.append((x.detach(), w.detach(), gs)) or real(self, x, w, gs))
    out = run(model, ids, labels=ids)
    monkeypatch.undo()
    return out, calls


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_precision_recipe(family, monkeypatch):
    # The routed experts' GEMMs on the NVFP4 recipe: close to the model's own outputs, not equal, training
    # reaches the original weights; unpatching drops the recipe.
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe

    model = build(family, layers=1)
    ids = inputs()
    with torch.no_grad():
        ref = run(model, ids).logits
    out, calls = _run_on_recipe(model, ids, Nvfp4Recipe, "grouped_mm", monkeypatch)
    # Error model: NVFP4 keeps about 2 significant bits, ~10% relative error per operand, measured on these
    # operands (_nvfp4_swiglu_error, ~0.25 for one layer); these tiny models put most of their logits through
    # the experts, and the rest of the network (attention, norm, lm_head) passes that error on with a gain
    # around 1: 2x the model allowed. Above 1%: the recipe is applied at all.
    assert len(calls) == 2 * len(moe_blocks(model))
    err = relative_l2_error(out.logits, ref)
    assert 0.01 < err < 2 * _nvfp4_swiglu_error(calls), err
    out.loss.backward()
    experts = moe_blocks(model)[0].experts
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
    mk.unpatch_hf(model)
    assert not any(hf.common._RECIPE_ATTR in m.__dict__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(run(model, ids).logits, ref, rtol=0, atol=0)
    assert not hf.is_patched(model)
    odd = build(family, layers=1, moe_intermediate_size=24)
    with pytest.raises(ValueError, match="does not fit the recipe.*multiples of 16"):
        mk.patch_hf(odd, recipe=Fp8BlockwiseRecipe())  # F = 24
    assert not hf.is_patched(odd)
    with pytest.raises(TypeError, match="`recipe`"):
        mk.patch_hf(model, recipe=Nvfp4Recipe)  # the class, not an instance
    with pytest.raises(ValueError, match="float64"):
        mk.patch_hf(copy.deepcopy(model).double(), recipe=Nvfp4Recipe())
    # A deep copy of a model patched with a recipe keeps it, bound to the copy.
    mk.patch_hf(model, recipe=Nvfp4Recipe())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(run(twin, ids).logits, run(model, ids).logits, rtol=0, atol=0)
    assert moe_blocks(twin)[0].experts.__dict__[hf.common._RECIPE_ATTR] == Nvfp4Recipe()


def test_fp8_recipe_runs_fused_permute_and_fp8_wgrad(monkeypatch):
    # The FP8 recipe on a patched model: the first expert GEMM takes its rows in E4M3 from the pass that
    # permutes them, the weight gradients come from grouped_mm_fp8_wgrad; logits within FP8's error of the
    # model's own.
    from moe_kernels.quant import Fp8BlockwiseRecipe, recipe as recipe_mod
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error

    model = build("qwen3_moe", layers=1, hidden_size=128, moe_intermediate_size=128, head_dim=32)
    ids = inputs()
    with torch.no_grad():
        ref = run(model, ids).logits
    mk.patch_hf(model, recipe=Fp8BlockwiseRecipe())
    seen = {"fused": 0, "wgrad": 0}
    gather, fused, wgrad = (recipe_mod.unpermute_bwd_quantize_fp8, recipe_mod.permute_quantize_fp8,
                            recipe_mod.grouped_mm_fp8_wgrad)
    # The first GEMM's input: the gather writing both layouts (16-bit rows) or permute_quantize_fp8 (fp32 rows).
    monkeypatch.setattr(recipe_mod, "unpermute_bwd_quantize_fp8",
                        lambda *a, **kw: seen.__setitem__("fused", seen["fused"] + (a[2] is None)) or gather(*a, **kw))
    monkeypatch.setattr(recipe_mod, "permute_quantize_fp8",
                        lambda *a, **kw: seen.__setitem__("fused", seen["fused"] + 1) or fused(*a, **kw))
    monkeypatch.setattr(recipe_mod, "grouped_mm_fp8_wgrad",
                        lambda *a, **kw: seen.__setitem__("wgrad", seen["wgrad"] + 1) or wgrad(*a, **kw))
    out = run(model, ids, labels=ids)
    out.loss.backward()
    assert seen == {"fused": 1, "wgrad": 2}  # one block: the fused first GEMM, both weights' FP8 wgrad
    # Error model: the SwiGLU experts quantize four E4M3 operands; the rest of the network passes that error
    # on with a gain around 1 (2x allowed, as the NVFP4 test); above 0.1%: the recipe is applied at all.
    err = relative_l2_error(out.logits, ref)
    assert 1e-3 < err < 2 * QUANT_SLACK * quantized_product_error(*[E4M3_REL_ERROR] * 4), err
    experts = moe_blocks(model)[0].experts
    for p in (experts.gate_up_proj, experts.down_proj):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("family, ffn, fused_permute", [("qwen3_moe", 128, True), ("nemotron_h", 128, True),
                                                        ("nemotron_h", 208, True), ("qwen3_moe", 128, False),
                                                        ("nemotron_h", 128, False)])
def test_fp8_recipe_takes_the_fused_activation_producers(family, ffn, fused_permute, monkeypatch):
    # A patched model's experts on the FP8 recipe as MoELayer's: the SwiGLU (transformers' default SiLU gate) or the
    # squared ReLU writes the down projection's E4M3 input, and backward the up projection's E4M3 gradient; the
    # unpermute backward writes the down projection's. No bf16 activation or gradient is quantized by a pass of its
    # own, and logits and gradients are bit for bit those of the unfused recipe (fused_swiglu=False). The same with
    # the permute apart from the first GEMM's input quantization (fused_permute=False).
    from moe_kernels.quant import Fp8BlockwiseRecipe, recipe as recipe_mod

    sizes = dict(hidden_size=128, head_dim=32, moe_intermediate_size=ffn)
    model = build(family, layers=1, **sizes).to(torch.bfloat16)  # (fp32 rows: permute_quantize_fp8 and a token pass)
    plain = copy.deepcopy(model)
    mk.patch_hf(model, recipe=Fp8BlockwiseRecipe(fused_permute=fused_permute))
    mk.patch_hf(plain, recipe=Fp8BlockwiseRecipe(fused_permute=fused_permute, fused_swiglu=False))
    calls = dict.fromkeys(("quantize_fp8", "quantize_fp8_tokens", "swiglu_bwd_quantize_fp8",
                           "squared_relu_bwd_quantize_fp8"), 0)

    def counted(name, fn):
        return lambda *a, **kw: calls.__setitem__(name, calls[name] + 1) or fn(*a, **kw)

    ids = inputs()
    grads = []
    for m in (model, plain):
        with monkeypatch.context() as mp:
            if m is model:
                for name in calls:
                    mp.setattr(recipe_mod, name, counted(name, getattr(recipe_mod, name)))
            out = run(m, ids, labels=ids)
            out.loss.backward()
        grads.append((out.logits, *(p.grad for p in m.parameters() if p.grad is not None)))
    gated = family == "qwen3_moe"
    assert calls == {"quantize_fp8": 0, "quantize_fp8_tokens": 0, "swiglu_bwd_quantize_fp8": int(gated),
                     "squared_relu_bwd_quantize_fp8": int(not gated)}
    assert len(grads[0]) == len(grads[1]) > 3
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama4", "aria"])
@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_kn_experts_precision_recipe(family, recipe, monkeypatch):
    # Experts stored [E, K, N] (Llama 4's patched block, Aria's) on a precision recipe: every expert GEMM through
    # its grouped_mm_kn (rows padded to the recipe's alignment), logits within the recipe's error of the model's own,
    # the weights' gradients reached.
    _kn_recipe_case(family, recipe, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama4", "aria"])
def test_gpu_kn_experts_fp8_recipe(cuda, family, monkeypatch):
    # The same on the device: the FP8 kernels (the sm_90a CUTLASS ones on Hopper) on the weights as stored.
    _kn_recipe_case(family, "fp8", cuda, monkeypatch)


def _kn_recipe_case(family, recipe, device, monkeypatch):
    sizes = dict(hidden_size=128, head_dim=32, intermediate_size=128)
    model = build(family, layers=1, **sizes).to(device)
    experts = hf.common._experts_of(moe_blocks(model)[0])
    _check_kn_recipe(model, recipe, device, monkeypatch, (experts.gate_up_proj, experts.down_proj))


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_ergo_experts_on_a_recipe(recipe, monkeypatch):
    # Ergo's experts (no gate, stored [E, K, N], a norm per expert after them) on a precision recipe: both GEMMs
    # through its grouped_mm_kn on the weights as stored, the norm on the permuted rows (those past the groups, the
    # recipe's padding, zeroed first), logits within the recipe's error of the model's own (the squared ReLU doubles
    # the first GEMM's relative error; the norm divides each row by its RMS, which keeps a row's relative error to
    # first order), every expert parameter's gradient reached and finite.
    model = build("ergo", layers=1, hidden_size=128, moe_intermediate_size=128)
    experts = hf.common._experts_of(moe_blocks(model)[0])
    _check_kn_recipe(model, recipe, "cpu", monkeypatch,
                     (experts.up_proj, experts.down_proj, experts.post_expert_norm.weight), squared=True)


def _check_kn_recipe(model, recipe, device, monkeypatch, params, squared=False):
    """Every expert GEMM of `model` through the recipe's grouped_mm_kn (rows padded to its alignment), logits within
    the recipe's error of the model's own, `params`' gradients reached. squared: a squared ReLU between the GEMMs
    (its log-derivative 2 doubles the first GEMM's relative error), else a gated activation."""
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error

    ids = inputs().to(device)
    with torch.no_grad():
        ref = run(model, ids).logits
    cls = Fp8BlockwiseRecipe if recipe == "fp8" else Nvfp4Recipe
    out, calls = _run_on_recipe(model, ids, cls, "grouped_mm_kn", monkeypatch)
    assert len(calls) == 2 * len(moe_blocks(model))
    assert all(int(gs.sum()) % cls().align == 0 for _, _, gs in calls)
    err = relative_l2_error(out.logits.cpu(), ref.cpu())
    # Error models as test_fp8_recipe_runs_fused_permute_and_fp8_wgrad's (four E4M3 operands) and
    # test_precision_recipe's (NVFP4's, measured on these operands); 2x allowed; above 0.1%: applied at all.
    e = E4M3_REL_ERROR
    bound = (QUANT_SLACK * quantized_product_error(*((2 * e, 2 * e, e, e) if squared else [e] * 4))
             if recipe == "fp8" else _nvfp4_swiglu_error([(x.cpu(), w.transpose(1, 2).contiguous().cpu(), gs.cpu())
                                                         for x, w, gs in calls], first=4.0 if squared else 2.0))
    assert 1e-3 < err < 2 * bound, (err, bound)
    out.loss.backward()
    for p in params:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


# F = 208: no multiple of 128, as Nemotron 3 Nano's 1856 (the FP8 recipe zero-pads the down projection's forward
# contraction and the up projection's dgrad contraction to 256).
FFN_SIZES = pytest.mark.parametrize("ffn", [128, 208], ids=["F128", "F208"])


@FFN_SIZES
@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_experts_without_a_gate_on_a_recipe(recipe, ffn, monkeypatch):
    # Nemotron-H's experts (up_proj, squared ReLU, down_proj) on a precision recipe: both expert GEMMs on it, logits
    # within the recipe's error of the model's own, both weights' gradients reached.
    _ungated_recipe_case(recipe, "cpu", monkeypatch, ffn)


@pytest.mark.gpu
@FFN_SIZES
def test_gpu_experts_without_a_gate_on_the_fp8_recipe(cuda, ffn, monkeypatch):
    _ungated_recipe_case("fp8", cuda, monkeypatch, ffn)


def _ungated_recipe_case(recipe, device, monkeypatch, ffn=128):
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error

    model = build("nemotron_h", layers=1, hidden_size=128, head_dim=32, moe_intermediate_size=ffn).to(device)
    ids = inputs().to(device)
    with torch.no_grad():
        ref = run(model, ids).logits
    cls = Fp8BlockwiseRecipe if recipe == "fp8" else Nvfp4Recipe
    first, second = [], []  # FP8: the first GEMM fused with the permute, the second with the squared ReLU
    if recipe == "fp8":
        real_first, real_second = cls.permute_grouped_mm, cls.squared_relu_grouped_mm
        monkeypatch.setattr(cls, "permute_grouped_mm", lambda self, x, idx, E, align, w, **kw: first.append(
            (x.detach(), w.detach())) or real_first(self, x, idx, E, align, w, **kw))
        monkeypatch.setattr(cls, "squared_relu_grouped_mm", lambda self, h, w, gs, **kw: second.append(
            (h.detach(), w.detach())) or real_second(self, h, w, gs, **kw))
    out, calls = _run_on_recipe(model, ids, cls, "grouped_mm", monkeypatch)
    assert len(first) + len(second) + len(calls) == 2 * len(moe_blocks(model))
    assert len(first) == len(second) == (recipe == "fp8")
    err = relative_l2_error(out.logits.cpu(), ref.cpu())
    # Error models as test_fp8_recipe_runs_fused_permute_and_fp8_wgrad's and test_precision_recipe's, with the first
    # GEMM's relative error doubled by the squared ReLU (x^2's log-derivative is 2); 2x allowed; above 0.1%: applied.
    e = E4M3_REL_ERROR
    bound = (QUANT_SLACK * quantized_product_error(2 * e, 2 * e, e, e) if recipe == "fp8"
             else _nvfp4_swiglu_error([(x.cpu(), w.cpu(), gs.cpu()) for x, w, gs in calls], first=4.0))
    assert 1e-3 < err < 2 * bound, (err, bound)
    out.loss.backward()
    experts = moe_blocks(model)[0].experts
    for p in (experts.up_proj, experts.down_proj):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_transformers_expert_parallelism_is_refused_at_patch_time():
    # transformers' expert parallelism leaves each rank its own experts; patch_hf refuses such a model up
    # front and says why (it used to report "unexpected weight shapes").
    model = build("qwen3_moe")
    for block in moe_blocks(model):
        block.experts._is_expert_parallel = True
        block.experts.gate_up_proj = nn.Parameter(block.experts.gate_up_proj.detach()[:4].clone())
        block.experts.down_proj = nn.Parameter(block.experts.down_proj.detach()[:4].clone())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp holds one rank's experts \(transformers' expert "
                                         r"parallelism was applied\)"):
        mk.patch_hf(model)
    assert not hf.is_patched(model)


def _tensor_parallel_refused(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = build("qwen3_moe")
    experts = moe_blocks(model)[0].experts
    ref = copy.deepcopy(experts)
    # transformers' tensor plan: gate_up_proj packed column-wise, down_proj row-wise (sharded DTensors).
    experts.gate_up_proj = nn.Parameter(distribute_tensor(experts.gate_up_proj.detach(), mesh, [Shard(1)]))
    experts.down_proj = nn.Parameter(distribute_tensor(experts.down_proj.detach(), mesh, [Shard(2)]))
    with pytest.raises(ValueError, match=r"mlp holds sharded \(DTensor\) weights: transformers' tensor or expert "
                                         r"parallelism was applied"):
        mk.patch_hf(model)
    assert not hf.is_patched(model)
    # The experts backend called on such weights says the same instead of "mixed torch.Tensor and DTensor".
    x, idx, w = torch.randn(5, H), torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
    with pytest.raises(NotImplementedError, match="sharded \\(DTensor\\) weights"):
        hf.moe_kernels_experts_forward(experts, x, idx, w)
    assert hf.moe_kernels_experts_forward(ref, x, idx, w).shape == (5, H)  # the same call on plain weights runs


@pytest.mark.distributed
def test_transformers_tensor_parallelism_is_refused_at_patch_time():
    from tests.distributed import run_world

    run_world(_tensor_parallel_refused, 2)


def test_model_without_moe_blocks_warns():
    with pytest.warns(UserWarning, match="found no MoE blocks"):
        mk.patch_hf(nn.Sequential(nn.Linear(4, 4)))
