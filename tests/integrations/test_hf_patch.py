"""moe_kernels.patch_hf's mechanics on tiny random transformers models: patching and unpatching, the forward chosen
at call time (later choices, copies, pickles, replicas, wrappers such as accelerate's offloading, FSDP2), blocks left
alone, Llama 4's and GPT-OSS's own paths. Precision recipes and transformers' parallelism: test_hf_recipes.py."""

import copy
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import hf  # noqa: E402
from moe_kernels.testing import assert_close_to_fp64  # noqa: E402
from tests.integrations.hf_models import (  # noqa: E402
    H, V, _recorded_routing, assert_same_outputs, build, inputs, moe_blocks, patched_copy, run,
)


# ---------------------------------------------------------------------------------------------------
# Patch lifecycle


def test_patch_unpatch_patch_is_a_noop_on_outputs():
    model = build("qwen2_moe").eval()
    ids = inputs()
    with torch.no_grad():
        ref = run(model, ids)
        assert mk.patch_hf(model) is model
        first = run(model, ids)
        mk.patch_hf(model)  # again: nothing changes, nothing wraps twice
        blocks = moe_blocks(model)
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

        assert all(type(m.gate).__bases__ == (Qwen2MoeTopKRouter,) for m in blocks)  # one subclass deep, not two
        assert model.config._experts_implementation == hf.EXPERTS_IMPLEMENTATION
        assert_same_outputs(run(model, ids), first, rtol=0, atol=0)
        assert mk.unpatch_hf(model) is model
        assert not hf.is_patched(model)
        assert all(type(m.gate).__name__ == "Qwen2MoeTopKRouter" for m in blocks)
        assert model.config._experts_implementation != hf.EXPERTS_IMPLEMENTATION
        assert all("forward" not in m.gate.__dict__ and "forward" not in m.experts.__dict__ for m in blocks)
        assert_same_outputs(run(model, ids), ref, rtol=0, atol=0)
        mk.patch_hf(model)
        assert_same_outputs(run(model, ids), first, rtol=0, atol=0)


def test_no_copies_of_weights():
    model = build("deepseek_v3")
    before = {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()}
    n_params = len(list(model.parameters()))
    mk.patch_hf(model)
    assert {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()} == before
    assert len(list(model.parameters())) == n_params
    for block in moe_blocks(model):  # the patched modules hold no tensors of their own beyond transformers'
        for m in (block.gate, block.experts):
            assert not any(isinstance(v, torch.Tensor) for v in vars(m).values())


def test_deepcopy_of_a_patched_model_is_patched_independently():
    model = build("mixtral").eval()
    mk.patch_hf(model)
    clone = copy.deepcopy(model)
    for a, b in zip(moe_blocks(model), moe_blocks(clone)):
        assert b.experts.forward.__self__ is b.experts and b.gate.forward.__self__ is b.gate
    mk.unpatch_hf(clone)
    assert hf.is_patched(model) and not hf.is_patched(clone)
    ids = inputs()
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(clone, ids))


def test_after_from_pretrained(tmp_path):
    ref_model = build("qwen3_moe", norm_topk_prob=True).eval()
    ref_model.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mk.patch_hf(model)
    ids = inputs()
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(ref_model, ids))


@pytest.mark.parametrize(("family", "overrides"), [("olmoe", {"norm_topk_prob": True}), ("nemotron_h", {}),
                                                   ("ergo", {})])
def test_experts_interface_registration(family, overrides, monkeypatch):
    """The experts forward alone, behind transformers' own router, via set_experts_implementation (Nemotron-H's:
    experts without a gate; Ergo's projections: without a gate, stored [E, K, N], each route a row of its own, with
    transformers' norm per expert after them)."""
    ref_model = build(family, **overrides).eval()
    model = copy.deepcopy(ref_model)
    assert hf.register_experts_implementation()
    model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    assert model.config._experts_implementation == "moe_kernels"
    calls = _count_grouped_mm(monkeypatch, "_kn_mm" if family == "ergo" else "grouped_mm")
    ids = inputs()
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(ref_model, ids))
    assert len(calls) == 2 * len(moe_blocks(model))  # both expert GEMMs of every block on our grouped GEMMs


def test_ergo_experts_while_exporting(monkeypatch):
    # While torch.onnx exports, experts stored [E, K, N] on the experts implementation run transformers' forward of the
    # decorated class (Ergo's ErgoExpertProjections, which ErgoExperts' own forward calls: the same outputs), and the
    # experts patch_hf replaced (the norm per expert on the permuted rows) run transformers' ErgoExperts forward.
    import moe_kernels.onnx

    ref = build("ergo").eval()
    model = copy.deepcopy(ref)
    model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    patched = patched_copy(ref)
    ids = inputs()
    monkeypatch.setattr(moe_kernels.onnx, "exporting", lambda: True)
    calls = _count_grouped_mm(monkeypatch, "_kn_mm")
    with torch.no_grad():
        want = run(ref, ids)
        assert_same_outputs(run(model, ids), want)
        assert_same_outputs(run(patched, ids), want)
    assert calls == []  # transformers' loop, not our GEMMs


@pytest.mark.parametrize("act", ["relu2", "gelu"])
def test_experts_without_a_gate_take_the_fused_squared_relu(act, monkeypatch):
    # Nemotron-H's experts (no gate): transformers' squared ReLU runs as our squared_relu (bit for bit its relu then
    # square), another activation as the experts' own act_fn; the same logits and gradients as transformers' either way.
    calls, real = [], hf.experts.squared_relu
    monkeypatch.setattr(hf.experts, "squared_relu", lambda h: calls.append(h.shape) or real(h))
    ref = build("nemotron_h", layers=1, mlp_hidden_act=act).train()
    model = patched_copy(ref)
    ids = inputs()
    for m in (ref, model):
        run(m, ids, labels=ids).loss.backward()
    assert len(calls) == (1 if act == "relu2" else 0)  # one call per MoE block
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():  # (test_hf.py's SGD-step bounds)
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        assert_same_outputs(run(model.eval(), ids), run(ref.eval(), ids))


@pytest.mark.parametrize(("change", "why"), [
    ("no act_fn", "has_gate=False and no act_fn"),
    ("stored [E, K, N]", "is_transposed=True"),
    ("router width", r"unexpected weight shapes up_proj \(8, 16, 32\), down_proj \(8, 32, 16\), router \(8, 33\)"),
])
def test_experts_without_a_gate_of_another_structure_are_left_alone(change, why):
    model = build("nemotron_h", layers=1)
    block = moe_blocks(model)[0]
    if change == "no act_fn":
        del block.experts.act_fn
    elif change == "stored [E, K, N]":
        block.experts.is_transposed = True
    else:
        block.gate.weight = nn.Parameter(torch.zeros(8, H + 1))
    with pytest.warns(UserWarning, match=rf"NemotronHMoE at model\.layers\.1\.mixer: .*{why}"):
        mk.patch_hf(model)
    assert not hf.is_patched(model)


# ---------------------------------------------------------------------------------------------------
# The patch chosen at call time: later choices, copies, pickles, replicas and wrappers


def _count_grouped_mm(monkeypatch, name: str = "grouped_mm") -> list:
    """Calls of moe_kernels' grouped_mm (or another of hf.experts' GEMM functions, `_kn_mm`: the [E, K, N] product)
    from the patched experts."""
    calls, real = [], getattr(hf.experts, name)
    monkeypatch.setattr(hf.experts, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_set_experts_implementation_after_patch_is_honoured(impl, monkeypatch):
    ref = build("qwen3_moe", norm_topk_prob=True).eval()
    model = patched_copy(ref)
    calls = _count_grouped_mm(monkeypatch)
    ids = inputs()
    with torch.no_grad():
        run(model, ids)
        assert calls, "patched experts run moe_kernels' grouped_mm"
        calls.clear()
        model.set_experts_implementation(impl)
        out = run(model, ids)
        assert not calls, f"after set_experts_implementation({impl!r}) the experts run transformers' code"
        ref.set_experts_implementation(impl)
        assert_same_outputs(out, run(ref, ids))
        model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
        run(model, ids)
        assert calls
    mk.unpatch_hf(model)  # the user's later choice stays
    model.set_experts_implementation(impl)
    mk.patch_hf(model)
    mk.unpatch_hf(model)
    assert model.config._experts_implementation == impl


def test_deepseek_v3_with_k_past_the_kept_groups():
    # transformers' own DeepSeek-V3 test config: 8 routed experts in 2 groups, 1 kept, k = 8 = E. Every
    # expert is chosen, the remaining slots from the dropped group, so the patched model equals transformers.
    ref = build("deepseek_v3", n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=8,
                first_k_dense_replace=0).eval()
    model = patched_copy(ref)
    ids = inputs()
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(ref, ids))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_pickled_patched_model_stays_patched(tmp_path, monkeypatch, family):
    model = patched_copy(build(family, norm_topk_prob=True).eval())
    ids = inputs()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert hf.is_patched(loaded)
    calls = _count_grouped_mm(monkeypatch)
    with torch.no_grad():
        assert_same_outputs(run(loaded, ids), run(model, ids), rtol=0, atol=0)
    assert calls
    # In a fresh process, which has run neither patch_hf nor the registration. It also defines the patched class
    # of a router whose transformers module it has not imported (found by its source file).
    load = ("from moe_kernels.integrations import hf as h\n"
            "assert 'transformers.models.dots1.modeling_dots1' not in sys.modules\n"
            "assert h.MoeKernelsDots1TopkRouter.__mro__[1].__module__ == 'transformers.models.dots1.modeling_dots1'\n"
            f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n")
    out = _logits_in_fresh_process(tmp_path, load, ids, "assert calls and hf.is_patched(m), 'runs our ops'\n")
    with torch.no_grad():
        torch.testing.assert_close(out, run(model, ids).logits, rtol=0, atol=0)


def _logits_in_fresh_process(tmp_path, load: str, ids, check: str) -> torch.Tensor:
    """Runs `load` (lines that define the model `m`) in a fresh interpreter, counts the experts' grouped_mm
    calls in `calls` (for `check` to assert on) and returns m's logits on `ids`. The interpreter takes this
    process's intra-op thread count: a CPU matmul's sums depend on it, and the callers compare bit for bit."""
    script = (
        f"import sys, torch\ntorch.set_num_threads({torch.get_num_threads()})\n" + load +
        "from moe_kernels.integrations import hf\n"
        "calls = []\nreal = hf.experts.grouped_mm\n"
        "hf.experts.grouped_mm = lambda *a, **k: (calls.append(1), real(*a, **k))[1]\n"
        f"ids = torch.tensor({ids.tolist()})\n"
        "with torch.no_grad():\n    out = m(ids).logits\n" + check +
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    return torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize("first", ["moe_kernels", "transformers"])
def test_experts_backend_registered_on_import(tmp_path, first):
    # from_pretrained(..., experts_implementation="moe_kernels") in a fresh process that imported both, in
    # either order, and never called patch_hf or the registration; importing moe_kernels alone does not
    # import transformers.
    model = build("qwen3_moe").eval()
    model.save_pretrained(tmp_path / "model")
    ids = inputs()
    imports = ("import moe_kernels\nassert 'transformers' not in sys.modules, 'moe_kernels imported transformers'\n"
               "import transformers\n") if first == "moe_kernels" else "import transformers.integrations.moe\nimport moe_kernels\n"
    load = imports + (f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'model')!r}, "
                      "experts_implementation='moe_kernels').eval()\n")
    out = _logits_in_fresh_process(tmp_path, load, ids, "assert calls, 'the experts ran our grouped_mm'\n")
    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")  # transformers' default experts take no fp64
    with torch.no_grad():
        ref, ref64 = run(model, ids).logits, run(model64, ids).logits
    # Our experts against transformers' own (fp32, its default experts): within the error policy of fp64.
    assert_close_to_fp64(out, ref, ref64, "experts backend from a fresh process")


def test_unpatch_keeps_wrappers_installed_after_patch(monkeypatch):
    # accelerate's offloading hooks (add_hook_to_module) and tensor-parallel forwards wrap `forward` on the
    # instance after patching: unpatching must keep them running, and the modules run transformers' code.
    ref = build("mixtral").eval()
    model = patched_copy(ref)
    wrapped = []
    for block in moe_blocks(model):
        for m in (block.gate, block.experts):
            inner = m.forward

            def forward(*args, _inner=inner, **kwargs):
                wrapped.append(1)
                return _inner(*args, **kwargs)

            m.forward = forward
    calls = _count_grouped_mm(monkeypatch)
    mk.unpatch_hf(model)
    ids = inputs()
    with torch.no_grad():
        out = run(model, ids)
        assert wrapped and not calls, "the wrappers run, our ops do not"
        assert_same_outputs(out, run(ref, ids), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "ernie4_5_moe", "llama4"])
def test_accelerate_offloading_hooks_survive_patch_and_unpatch(monkeypatch, family):
    # accelerate's cpu_offload (weights on the meta device, loaded by a hook around each module's forward)
    # installed after patch_hf: the offloaded model runs our ops and equals the original (ERNIE-4.5's router bias
    # and Llama 4's experts are read through their modules' calls); after unpatch_hf the hooks still run (no
    # meta-weight crash) and transformers' code computes the same outputs.
    accelerate = pytest.importorskip("accelerate")
    ref = build(family).eval()
    model = patched_copy(ref)
    # (transformers' Llama 4 moves its input ids to the embedding's device, meta when the whole model is
    # offloaded, patched or not: its MoE blocks are offloaded here)
    for target in moe_blocks(model) if family == "llama4" else [model]:
        accelerate.cpu_offload(target, execution_device=torch.device("cpu"))
    assert any(p.device.type == "meta" for p in model.parameters())
    ids = inputs()
    calls = _count_kn_rows(monkeypatch) if family == "llama4" else _count_grouped_mm(monkeypatch)
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(ref, ids))
        assert calls, "the offloaded patched model runs our ops"
        calls.clear()
        mk.unpatch_hf(model)
        assert_same_outputs(run(model, ids), run(ref, ids), rtol=0, atol=0)
        assert not calls


def _fsdp2_worker(rank: int, world_size: int, family: str) -> None:
    from torch.distributed.fsdp import fully_shard

    ref = build(family).train()  # the same seed on every rank: the same model
    model = patched_copy(ref).train()
    for block in moe_blocks(model):  # the modules whose parameters the patched code reads, sharded apart
        fully_shard(block.experts)
        if family == "ernie4_5_moe":
            fully_shard(block.gate.moe_statics)
    fully_shard(model)
    ids = inputs(seed=1 + rank)
    outs = [m(ids, labels=ids) for m in (ref, model)]
    for out in outs:
        out.loss.backward()
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
            continue
        expected = grads[name].grad.clone()
        torch.distributed.all_reduce(expected)  # FSDP2 reduce-scatters the ranks' gradients, averaged
        torch.testing.assert_close(p.grad.full_tensor(), expected / world_size, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama4", "ernie4_5_moe"])
def test_fsdp2_sharded_submodules(family):
    # FSDP2 on the experts (and ERNIE's moe_statics): their parameters are gathered by the module's own call,
    # which the patched code makes, so the sharded patched model computes the unsharded transformers model's
    # logits and (rank-averaged) gradients.
    from tests.distributed import run_world

    run_world(_fsdp2_worker, 2, family)


def test_data_parallel_replicas_use_their_own_weights():
    # nn.DataParallel copies each module with _replicate_for_data_parallel (a new instance sharing __dict__'s
    # entries): a replica's router and experts must read the replica's parameters, not the original's.
    model = patched_copy(build("qwen3_moe", norm_topk_prob=True).eval())
    block = moe_blocks(model)[0]
    gate = block.gate._replicate_for_data_parallel()
    gate._parameters = {"weight": nn.Parameter(torch.zeros_like(block.gate.weight))}  # as replicate() rebinds
    x = torch.randn(5, H)
    logits, weights, _ = gate(x)
    assert bool((logits == 0).all()) and torch.allclose(weights, torch.full_like(weights, 0.5))
    experts = block.experts._replicate_for_data_parallel()
    experts._parameters = {k: nn.Parameter(torch.zeros_like(v)) for k, v in block.experts._parameters.items()}
    idx = torch.zeros(5, 2, dtype=torch.int64)
    assert bool((experts(x, idx, torch.ones(5, 2)) == 0).all())
    assert not bool((block.experts(x, idx, torch.ones(5, 2)) == 0).all())


# ---------------------------------------------------------------------------------------------------
# Unsupported blocks


class DummySparseMoeBlock(nn.Module):
    """An MoE block of no supported family (per-expert Linears, like transformers 4.x)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x):
        w = F.softmax(self.router(x), dim=-1)
        return sum(w[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


def test_unsupported_blocks_are_left_alone_and_listed_in_one_warning():
    model = build("mixtral", layers=3).eval()
    model.model.layers[1].mlp = DummySparseMoeBlock()
    model.model.layers[2].mlp = DummySparseMoeBlock()
    ref_model = copy.deepcopy(model)
    with pytest.warns(UserWarning) as record:
        mk.patch_hf(model)
    assert len(record) == 1
    msg = str(record[0].message)
    assert "DummySparseMoeBlock" in msg and "model.layers.1.mlp" in msg and "model.layers.2.mlp" in msg
    assert "model.layers.0" not in msg
    assert hf.is_patched(model.model.layers[0]) and not hf.is_patched(model.model.layers[1])
    ids = inputs()
    with torch.no_grad():
        out, ref = model(ids), ref_model(ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_deepseek_v4_hash_layers_keep_transformers_router_and_run_our_experts(monkeypatch):
    # DeepSeek-V4's hash-routed layers pick experts by token id (tid2eid[input_ids]): transformers' router stays,
    # its experts run ours (the clamped SwiGLU is the experts' own _apply_gate); learned layers run router_topk.
    ref_model = build("deepseek_v4").eval()
    with torch.no_grad():
        for b in moe_blocks(ref_model):
            if hasattr(b.gate, "tid2eid"):  # a fixed table of distinct experts per token id
                b.gate.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(V)]))
    model = patched_copy(ref_model)
    learned, hashed = moe_blocks(model)
    assert type(learned.gate).__name__ == "MoeKernelsDeepseekV4TopKRouter"
    assert type(hashed.gate).__name__ == "DeepseekV4HashRouter" and hf.is_patched(hashed)
    calls = _count_grouped_mm(monkeypatch)
    ids = inputs()
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(ref_model, ids))
    assert len(calls) == 4  # two GEMMs in each of the two layers
    mk.unpatch_hf(model)
    assert not hf.is_patched(model) and type(learned.gate).__name__ == "DeepseekV4TopKRouter"


def test_ernie_vl_text_and_vision_blocks_are_patched():
    # ERNIE-4.5-VL's MoE block holds a text and a vision MoE block (ERNIE-4.5's router code): both run our ops,
    # on text-only input and on text and image tokens together.
    ev = pytest.importorskip("transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe")
    cfg = transformers.Ernie4_5_VLMoeTextConfig(hidden_size=H, intermediate_size=48, moe_intermediate_size=[16, 8],
                                                moe_k=2, moe_num_experts=8, moe_num_shared_experts=1)
    torch.manual_seed(0)
    ref = ev.Ernie4_5_VLMoeMoeBlock(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(0.0, 1.0 if name.endswith("gate.weight") else 0.3)
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
    model = patched_copy(nn.Sequential(ref))
    block = model[0]
    assert hf.is_patched(block.text_moe) and hf.is_patched(block.vision_moe)
    x = torch.randn(2, 12, H, generator=torch.Generator().manual_seed(1))
    image = torch.zeros(2, 12, dtype=torch.long)
    image[:, 6:] = 1
    for token_types in (None, image):
        torch.testing.assert_close(block(x, token_types)[0], ref(x, token_types)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [(4, 2), (1, 1)])
def test_mistral_large4_block_matches_transformers(groups):
    # Mistral Large 4's text MoE block (its model is multimodal: the block alone here), fp32 routing always
    # renormalised: patched against transformers' own on the same weights, output and every gradient.
    ml = pytest.importorskip("transformers.models.mistral_large4.modeling_mistral_large4")
    cfg = transformers.MistralLarge4TextConfig(hidden_size=H, moe_intermediate_size=16, n_routed_experts=8,
                                               num_experts_per_tok=2, n_group=groups[0], topk_group=groups[1],
                                               n_shared_experts=1, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    ref = ml.MistralLarge4TextMoE(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(0.0, 1.0 if name == "gate.weight" else 0.3)
    block = patched_copy(ref)
    assert type(block.gate).__name__ == "MoeKernelsMistralLarge4TextTopkRouter" and hf.is_patched(block)
    x = torch.randn(2, 12, H, generator=torch.Generator().manual_seed(1))
    with _recorded_routing(ref) as (ref_picks, _), _recorded_routing(block) as (picks, _):
        outs = [m(x) for m in (ref, block)]
    assert torch.equal(picks[0], ref_picks[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for m, out in zip((ref, block), outs):
        out.square().mean().backward()
    grads = dict(block.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------
# Llama 4: the block's forward is ours (transformers runs every expert on every token)


def _count_kn_rows(monkeypatch) -> list[int]:
    rows = []
    real = hf.experts._GroupedMmKN.apply
    monkeypatch.setattr(hf.experts._GroupedMmKN, "apply", lambda x, *a: (rows.append(x.shape[0]), real(x, *a))[1])
    return rows


@pytest.mark.parametrize("k", [1, 2])
def test_llama4_experts_run_the_chosen_tokens_only(monkeypatch, k):
    # transformers' Llama4TextExperts multiplies all E experts by every token (T E rows); patched, each of the two
    # MoE layers' two GEMMs takes the T k rows routed to their experts, with the same logits and router logits
    ref_model = build("llama4", num_experts_per_tok=k).eval()
    model = patched_copy(ref_model)
    ids = inputs()
    rows = _count_kn_rows(monkeypatch)
    fused = []
    real = hf.experts.swiglu
    monkeypatch.setattr(hf.experts, "swiglu", lambda h: (fused.append(h.shape[0]), real(h))[1])
    with torch.no_grad():
        assert_same_outputs(run(model, ids), run(ref_model, ids))
    assert rows == [ids.numel() * k] * 4 and fused == [ids.numel() * k] * 2  # SiLU experts: our fused swiglu


def test_llama4_pickle_unpatch_and_recipe(tmp_path, monkeypatch):
    model = patched_copy(build("llama4").eval())
    ids = inputs()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert hf.is_patched(loaded) and type(moe_blocks(loaded)[0]).__name__ == "MoeKernelsLlama4TextMoe"
    rows = _count_kn_rows(monkeypatch)
    with torch.no_grad():
        assert_same_outputs(run(loaded, ids), run(model, ids), rtol=0, atol=0)
    assert rows
    out = _logits_in_fresh_process(tmp_path, f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n",
                                   ids, "assert hf.is_patched(m), 'the block class is ours'\n")
    with torch.no_grad():
        torch.testing.assert_close(out, run(model, ids).logits, rtol=0, atol=0)
    mk.unpatch_hf(loaded)
    llama4 = transformers.models.llama4.modeling_llama4
    assert not hf.is_patched(loaded) and type(moe_blocks(loaded)[0]) is llama4.Llama4TextMoe
    rows.clear()
    with torch.no_grad():
        run(loaded, ids)
    assert rows == []
    # the FP8 recipe's multiples of 16 (F = 24 here), checked on the stored [E, H, 2F] / [E, F, H] layout (refused
    # before anything changes; the recipes themselves: test_kn_experts_precision_recipe)
    fresh = build("llama4", intermediate_size=24)
    with pytest.raises(ValueError, match=r"does not fit the recipe.*hidden_size \(32\) and ffn_size \(24\)"):
        mk.patch_hf(fresh, recipe=mk.quant.Fp8BlockwiseRecipe())
    assert not hf.is_patched(fresh)


def test_llama4_with_peft_adapters_runs_the_routed_rows(monkeypatch):
    # peft wraps the experts; the patched block calls them through the wrappers, on the T k routed rows (the
    # adapters' terms as rank-r products: its equality with peft's W + s B A is in tests/integrations/test_peft.py).
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, init_lora_weights=False,
                          target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    ref_model = peft.get_peft_model(build("llama4"), cfg).eval()
    model = copy.deepcopy(ref_model)
    mk.patch_hf(model)
    rows = _count_kn_rows(monkeypatch)
    ids = inputs()
    with torch.no_grad():
        # fp32, the same products in another order (rank-r terms beside W, where peft forms W + s B A): the bound of
        # test_forward_matches
        torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, rtol=1e-5, atol=1e-5)
    T, k = ids.numel(), model.config.num_experts_per_tok
    assert rows and set(rows) == {T * k}, rows  # every [E, K, N] product on the routed rows (and the rank-r ones)


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_expert_parallel_experts_refuse_an_onnx_export(family, monkeypatch):
    # An expert-parallel rank holds E / P experts: transformers' forward (which an ONNX export takes) would be wrong
    # there, so it raises (expert parallelism itself, and LoRA on it: tests/parallel/test_expert_parallel_hf.py).
    model = patched_copy(build(family))
    experts = hf.common._experts_of(moe_blocks(model)[0])
    experts.__dict__[hf.DISPATCHER_ATTR] = object()  # as apply_expert_parallel leaves it (never reached here)
    monkeypatch.setattr(hf.experts, "_onnx", types.SimpleNamespace(exporting=lambda: True))
    with pytest.raises(NotImplementedError, match="expert-parallel .* run on moe_kernels' ops only"):
        model(inputs())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])  # [E, N, K]; [E, K, N]; Llama 4's experts
def test_lora_terms_must_cover_the_experts_held(family, monkeypatch):
    # A LoRA term whose expert count is not the weights' (an adapter over every expert handed to a rank's slice)
    # raises before any kernel runs.
    model = patched_copy(build(family))
    experts = hf.common._experts_of(moe_blocks(model)[0])
    E, A, B = experts.gate_up_proj.shape
    term = (torch.zeros(E + 1, A, 2), torch.zeros(E + 1, 2, B), 1.0)
    real = hf.experts.lora_terms
    monkeypatch.setattr(hf.experts, "lora_terms",
                        lambda m, name: [term] if m is experts and name == "gate_up_proj" else real(m, name))
    with pytest.raises(ValueError, match=f"holds {E} experts and a LoRA term {E + 1}"):
        model(inputs())


def test_biased_grouped_gemm_matches_per_expert_products():
    # GPT-OSS's [E, K, N] products with their biases (rows past the groups aside), fwd and bwd, in fp64.
    E, K, N = 5, 12, 10
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 0, 7, 1, 4], dtype=torch.int32)
    R = int(sizes.sum()) + 2
    x = torch.randn(R, K, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, K, N, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(E, N, generator=gen, dtype=torch.float64, requires_grad=True)
    out = hf.experts._GroupedMmKN.apply(x, w, b, sizes)
    ends = torch.cumsum(sizes, 0).tolist()
    ref = torch.cat([x[s:e] @ w[i] + b[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])
    used = ends[-1]
    torch.testing.assert_close(out[:used], ref, rtol=1e-12, atol=1e-12)
    g = torch.randn(R, N, generator=gen, dtype=torch.float64)
    g[used:] = 0  # nothing reads the rows past the groups
    grads = torch.autograd.grad(out, (x, w, b), g)
    ref_grads = torch.autograd.grad(ref, (x, w, b), g[:used], allow_unused=True)
    for a, r in zip(grads, ref_grads):  # x's rows past the groups: zero
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("family", "act", "fused"), [
    ("qwen3_moe", "silu", True), ("qwen3_moe", "swish", True), ("qwen3_moe", "gelu", False),
    ("lfm2_moe", None, True),  # its experts' act_fn is the function F.silu
])
def test_default_silu_gate_runs_the_fused_swiglu(family, act, fused, monkeypatch):
    # transformers' default gate with a SiLU activation runs our swiglu op (fwd and bwd); any other activation
    # runs the experts' own gate. Both equal transformers' forward and gradients.
    calls = []
    real = hf.experts.swiglu
    monkeypatch.setattr(hf.experts, "swiglu", lambda h: (calls.append(h.shape), real(h))[1])
    ref_model = build(family, **({} if act is None else {"hidden_act": act})).train()
    model = patched_copy(ref_model).train()
    ids = inputs()
    outs = [run(m, ids, labels=ids) for m in (ref_model, model)]
    for out in outs:
        out.loss.backward()
    assert_same_outputs(outs[1], outs[0])
    assert (len(calls) == 2) == fused and (len(calls) == 0) == (not fused)  # one per MoE layer
    params = dict(model.named_parameters())
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
