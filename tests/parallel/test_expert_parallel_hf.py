"""Expert parallelism for transformers models on P gloo ranks equals one rank: apply_expert_parallel on a
model whose experts run moe_kernels (patch_hf, or the "moe_kernels" experts implementation alone).

As for our own models: every rank builds the same model and feeds its own tokens; the EP model gives each
rank the full model's logits, loss and gradients on that rank's tokens, each rank's expert weights the sum
over ranks of the full model's gradients for its experts (tests/parallel/test_expert_parallel.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import moe_kernels as mk  # noqa: E402
from moe_kernels.integrations import hf  # noqa: E402
from moe_kernels.parallel import apply_expert_parallel, expert_parameters  # noqa: E402
from tests.distributed import run_world  # noqa: E402
from moe_kernels.testing import assert_close_to_fp64  # noqa: E402

pytestmark = pytest.mark.distributed


def _grads(model, shards, rank, P):
    """Each parameter's gradient; for the experts the full model shards, the sum over ranks of this rank's
    slice (what the EP model's local experts receive). A norm with a weight row per expert after the experts (Ergo's,
    replicated): the sum over ranks, every model's. The EP model's rank applies it to its experts' rows of every rank's
    tokens, so its gradient holds those experts' rows; summed over the ranks, as the data-parallel reduction does, it
    is the one-rank model's sum (as every other replicated parameter's, whose rank gradient holds its own tokens)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if name in shards:
            dist.all_reduce(g)
            El = g.shape[0] // P
            g = g[rank * El : (rank + 1) * El]
        elif name.endswith("experts.post_expert_norm.weight"):
            dist.all_reduce(g)
        grads[name] = g
    return grads


def _assert_runs_close(runs, where):
    """runs: (logits, loss, gradients by name) of the EP model, the fp32 one-rank model and the fp64 one. Error
    policy: the EP model's fp32 error against the fp64 one-rank model at most twice the fp32 one-rank model's (the
    row layouts differ, so the grouped products sum in other orders), plus 8 fp32 ulps."""
    (logits, loss, grads), (logits32, loss32, grads32), (logits64, loss64, grads64) = runs
    assert_close_to_fp64(logits, logits32, logits64, f"{where}: logits")
    assert_close_to_fp64(loss, loss32, loss64, f"{where}: loss")
    for name, g in grads.items():
        assert_close_to_fp64(g, grads32[name], grads64[name], f"{where}: d {name}")


def _case(rank, P, family, backend, how, **overrides):
    from tests.integrations.hf_models import build, moe_blocks

    full = build(family, **overrides)
    if how == "patch_hf":
        mk.patch_hf(full)
    else:  # transformers' router, our experts
        full.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    full64 = copy.deepcopy(full).double()
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    E = moe_blocks(full)[0].experts.num_experts
    for block in moe_blocks(ep):
        up = getattr(block.experts, hf.common._up_name(block.experts))  # gate_up_proj; up_proj without a gate
        assert up.shape[0] == E // P and block.experts.down_proj.shape[0] == E // P
    shards = {n for n, p in ep.named_parameters() if any(p is q for q in expert_parameters(ep))}
    per_block = 4 if family == "gpt_oss" else 2  # the weights, and GPT-OSS's biases
    assert len(shards) == per_block * len(moe_blocks(ep))
    ids = torch.randint(0, full.config.vocab_size, (2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank))
    runs = []
    for model in (ep, full, full64):
        out = model(ids, labels=ids, output_router_logits=True)
        aux = getattr(out, "aux_loss", None)  # transformers 5.17's DeepSeek-V3 output has no aux_loss field
        loss = out.loss if aux is None else out.loss + aux
        loss.backward()
        runs.append((out.logits, loss, _grads(model, set() if model is ep else shards, rank, P)))
    _assert_runs_close(runs, f"rank {rank}/{P} {family} {backend} {how}")
    with pytest.raises(ValueError, match="already expert-parallel"):
        apply_expert_parallel(ep)
    with pytest.raises(ValueError, match="expert-parallel"):
        mk.unpatch_hf(ep)


def _dbrx_case(rank, P, backend):
    # DBRX: transformers' router and block, our experts on its GLU's w1, v1 and w2 ([E * F, H] each): each rank keeps
    # its experts' E / P blocks of F rows
    from tests.integrations.test_hf_dbrx import blocks, build

    full = mk.patch_hf(build())
    full64 = copy.deepcopy(full).double()
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    mlp = blocks(full)[0].experts.mlp
    for block in blocks(ep):
        for name in ("w1", "v1", "w2"):
            w, w_full = getattr(block.experts.mlp, name), getattr(mlp, name)
            assert w.shape[0] == w_full.shape[0] // P and block.experts.num_experts == 8
    rows = (8 // P) * 16  # the rank's experts, F 16 rows each
    assert torch.equal(blocks(ep)[0].experts.mlp.w1, mlp.w1[rank * rows : (rank + 1) * rows])
    shards = {n for n, p in ep.named_parameters() if any(p is q for q in expert_parameters(ep))}
    assert len(shards) == 3 * len(blocks(ep))
    _check_block_family(ep, full, full64, shards, rank, P, f"dbrx {backend}")


def _check_block_family(ep, full, full64, shards, rank, P, where):
    """A family patch_hf runs with its own experts forward (DBRX's, JetMoE's): the expert-parallel model `ep` against
    the patched model `full` on one rank (and its fp64 copy), with the aux loss; then patched again without a warning
    (the rank's experts still fit the family's checks), and apply_expert_parallel and unpatch_hf refused."""
    ids = torch.randint(0, full.config.vocab_size, (2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank))
    runs = []
    for model in (ep, full, full64):
        out = model(ids, labels=ids, output_router_logits=True)
        loss = out.loss + out.aux_loss
        loss.backward()
        runs.append((out.logits, loss, _grads(model, set() if model is ep else shards, rank, P)))
    _assert_runs_close(runs, f"rank {rank}/{P} {where}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mk.patch_hf(ep)
    with pytest.raises(ValueError, match="already expert-parallel"):
        apply_expert_parallel(ep)
    with pytest.raises(ValueError, match="expert-parallel"):
        mk.unpatch_hf(ep)


def _jetmoe_case(rank, P, backend):
    # JetMoE: the MoE block's and the MoA's projections held by the blocks ([E, N, K] each): each rank keeps its
    # experts' E / P of every projection; the MoA's slots dispatched one expert each
    from tests.integrations.test_hf_jetmoe import blocks, build

    full = mk.patch_hf(build())
    full64 = copy.deepcopy(full).double()
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    El = 8 // P
    for block, block_full in zip(blocks(ep), blocks(full), strict=True):
        for name in ("input_linear", "output_linear"):
            w, w_full = getattr(block, name).weight, getattr(block_full, name).weight
            assert torch.equal(w, w_full[rank * El : (rank + 1) * El])
    shards = {n for n, p in ep.named_parameters() if any(p is q for q in expert_parameters(ep))}
    assert len(shards) == 2 * len(blocks(ep)) == 8
    _check_block_family(ep, full, full64, shards, rank, P, f"jetmoe {backend}")


def _worker(rank, P, backend):
    # GPT-OSS: biased experts stored [E, K, N] (Aria: bias-free); Llama 4: the block's forward patched, tokens
    # scaled on the experts' rank; Nemotron-H: experts without a gate; Ergo: experts without a gate stored
    # [E, K, N], a norm per expert after them (its weight replicated, each rank reading its experts' rows)
    for family in ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss", "aria", "llama4", "nemotron_h", "ergo"):
        _case(rank, P, family, backend, "patch_hf")
    _case(rank, P, "nemotron_h", backend, "patch_hf", moe_latent_size=24, n_group=1, topk_group=1)  # latent experts
    _case(rank, P, "qwen3_moe", backend, "experts_implementation")
    _case(rank, P, "ergo", backend, "experts_implementation")  # transformers' norm after our projections
    _dbrx_case(rank, P, backend)
    _jetmoe_case(rank, P, backend)


@pytest.mark.parametrize("backend", ["all_to_all", "all_gather"])
def test_transformers_expert_parallel_equals_one_rank(backend):
    run_world(_worker, 2, backend)


def test_unpatched_transformers_model_is_refused():
    from tests.integrations.hf_models import build

    with pytest.raises(ValueError, match="no MoELayer .*patch_hf"):
        apply_expert_parallel(build("qwen3_moe"))


def _lora_case(rank, P, family, backend):
    # peft LoRA on the experts, then patch_hf, then expert parallelism: the adapters stay whole on every rank and
    # each rank applies its experts' slices. A rank's adapter gradients hold its experts' slices (every rank's tokens
    # routed to them) and zeros elsewhere, so their sum over the ranks equals the one-rank model's sum over the ranks.
    import peft

    from tests.integrations.hf_models import build, moe_blocks

    torch.manual_seed(0)
    mlp = {"llama4": "feed_forward", "nemotron_h": "mixer"}.get(family, "mlp")
    up = "up_proj" if family == "nemotron_h" else "gate_up_proj"
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                             target_parameters=[f"{mlp}.experts.{up}", f"{mlp}.experts.down_proj"])
    full = mk.patch_hf(peft.get_peft_model(build(family), config))
    E = hf.common._experts_of(moe_blocks(full.get_base_model())[0]).num_experts
    _check_lora_expert_parallel(full, E, rank, P, backend, f"{family} {backend} LoRA")


def _jetmoe_lora_case(rank, P, backend):
    # JetMoE: peft's LoRA on the MoE block's and the MoA's projections, as for the other families
    import peft

    from tests.integrations.test_hf_jetmoe import LORA_TARGETS, build

    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                             target_parameters=LORA_TARGETS)
    full = mk.patch_hf(peft.get_peft_model(build(), config))
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in full.modules()) == 8
    _check_lora_expert_parallel(full, 8, rank, P, backend, f"jetmoe {backend} LoRA")


def _check_lora_expert_parallel(full, E, rank, P, backend, where):
    """The patched peft model `full` (E experts a layer) made expert-parallel against itself on one rank (fp32 and
    fp64): logits, loss, the adapters' gradients summed over the ranks, each rank's gradients on its experts' slices
    only, merging, and unfuse_lora refused."""
    from moe_kernels.integrations import peft as mk_peft

    full64 = copy.deepcopy(full).double()
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    lora = [n for n, p in ep.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    assert all(p.shape == dict(full.named_parameters())[n].shape for n, p in ep.named_parameters() if n in lora)
    ids = torch.randint(0, full.config.vocab_size, (2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank))
    runs = []
    for model in (ep, full, full64):
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n in lora}
        for g in grads.values():
            dist.all_reduce(g)
        runs.append((out.logits, out.loss, grads))
    _assert_runs_close(runs, f"rank {rank}/{P} {where}")
    # This rank's backward touches only its experts' slices of lora_A ([E r, K] rows) and lora_B ([N, E r] columns).
    lo, hi = rank * (E // P), (rank + 1) * (E // P)
    for name, p in ep.named_parameters():
        if "lora_A" in name:
            g = p.grad.view(E, -1, p.shape[-1])
        elif "lora_B" in name:
            g = p.grad.view(p.shape[0], -1, E).permute(2, 0, 1)
        else:
            continue
        assert g[lo:hi].abs().sum() > 0 and g[:lo].abs().sum() == 0 and g[hi:].abs().sum() == 0, name
    # Merging adds each rank's slices of the delta to its experts: the same logits as the adapters applied, up to
    # the fp32 rounding of W + s B A (relative 2^-24 an element; the logits of these tiny models are O(1), K <= 64:
    # a few 1e-7), 1e-5 allowed.
    with torch.no_grad():
        before = ep(ids).logits
        merged = ep.merge_and_unload()
        torch.testing.assert_close(merged(ids).logits, before, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expert-parallel"):
        mk_peft.unfuse_lora(apply_expert_parallel(copy.deepcopy(full), backend=backend))


def _late_adapter_case(rank, P):
    # Adapters created after apply_expert_parallel would hold this rank's experts under names every rank shares.
    import peft

    from tests.integrations.hf_models import build, inputs

    config = peft.LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    fused = mk.patch_hf(peft.get_peft_model(apply_expert_parallel(mk.patch_hf(build("qwen3_moe"))), config))
    with pytest.raises(ValueError, match="created after apply_expert_parallel"):
        fused(inputs())
    plain = peft.get_peft_model(apply_expert_parallel(mk.patch_hf(build("qwen3_moe"))), config)  # peft's own path
    with pytest.raises(ValueError, match="parametrized .* before apply_expert_parallel"):
        plain(inputs())


def _kn_recipe_worker(rank, P):
    # Experts stored [E, K, N] on the FP8 recipe, expert-parallel: the recipe given before apply_expert_parallel or
    # to the expert-parallel model afterwards. The same codes on every rank (each token's 1x128 blocks, each
    # expert's tiles), so the EP logits are the one-rank model's up to the fp32 summation order of the products
    # (relative ~1e-7 at K = 128; 1e-5 allowed); every expert GEMM on the recipe, its groups padded to 128 rows.
    from moe_kernels.quant import Fp8BlockwiseRecipe
    from tests.integrations.hf_models import build

    # GPT-OSS: biases, and H = 144, F = 48 zero-padded to 256 and 128 along the contractions.
    sizes = {"llama4": (128, 128), "aria": (128, 128), "gpt_oss": (144, 48)}
    for family, (H, F) in sizes.items():
        for order in ("recipe, then EP", "EP, then recipe"):
            full = mk.patch_hf(build(family, layers=1, hidden_size=H, head_dim=32, intermediate_size=F))
            if order == "recipe, then EP":
                mk.patch_hf(full, recipe=Fp8BlockwiseRecipe())
                ep = apply_expert_parallel(copy.deepcopy(full))
            else:
                ep = apply_expert_parallel(copy.deepcopy(full))
                for model in (full, ep):
                    mk.patch_hf(model, recipe=Fp8BlockwiseRecipe())
            calls, real = [], Fp8BlockwiseRecipe.grouped_mm_kn
            Fp8BlockwiseRecipe.grouped_mm_kn = lambda self, x, w, gs: calls.append(gs) or real(self, x, w, gs)
            try:
                ids = torch.randint(0, 64, (2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank))
                with torch.no_grad():
                    got, want = ep(ids).logits, full(ids).logits
            finally:
                Fp8BlockwiseRecipe.grouped_mm_kn = real
            assert len(calls) == 4 and all(int(gs.sum()) % 128 == 0 for gs in calls), (family, order)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {family} {order}")


def test_kn_experts_recipe_expert_parallel():
    run_world(_kn_recipe_worker, 2)


def _fused_activation_recipe_worker(rank, P):
    # [E, N, K] experts (transformers' default SiLU gate, Nemotron-H's squared ReLU) on the FP8 recipe, expert-parallel:
    # the activation's producers write the down projection's E4M3 input and the up projection's E4M3 gradient on
    # the dispatched rows, bit for bit the unfused recipe (fused_swiglu=False) on the same ranks, logits and every
    # gradient.
    from moe_kernels.quant import Fp8BlockwiseRecipe, recipe as recipe_mod
    from tests.integrations.hf_models import build

    calls = {"swiglu_bwd_quantize_fp8": 0, "squared_relu_bwd_quantize_fp8": 0}
    for name in calls:
        real = getattr(recipe_mod, name)
        setattr(recipe_mod, name, lambda *a, _n=name, _f=real, **kw: calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **kw))
    for family, ffn in (("qwen3_moe", 128), ("nemotron_h", 208)):
        base = build(family, layers=1, hidden_size=128, head_dim=32, moe_intermediate_size=ffn).to(torch.bfloat16)
        runs = []
        before = dict(calls)
        for recipe in (Fp8BlockwiseRecipe(), Fp8BlockwiseRecipe(fused_swiglu=False)):
            model = apply_expert_parallel(mk.patch_hf(copy.deepcopy(base), recipe=recipe))
            ids = torch.randint(0, 64, (2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank))
            out = model(ids, labels=ids)
            out.loss.backward()
            runs.append((out.logits, *(p.grad for p in model.parameters() if p.grad is not None)))
        gated = family == "qwen3_moe"
        assert calls["swiglu_bwd_quantize_fp8"] - before["swiglu_bwd_quantize_fp8"] == int(gated), family
        assert calls["squared_relu_bwd_quantize_fp8"] - before["squared_relu_bwd_quantize_fp8"] == int(not gated)
        assert len(runs[0]) == len(runs[1]) > 3
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {rank} {family}")


def test_fused_activation_recipe_expert_parallel():
    run_world(_fused_activation_recipe_worker, 2)


def _lora_worker(rank, P, backend):
    for family in ("qwen3_moe", "gpt_oss", "llama4", "nemotron_h"):
        _lora_case(rank, P, family, backend)
    _jetmoe_lora_case(rank, P, backend)
    _late_adapter_case(rank, P)


@pytest.mark.parametrize("backend", ["all_to_all", "all_gather"])
def test_lora_on_expert_parallel_transformers_experts(backend):
    pytest.importorskip("peft")
    run_world(_lora_worker, 2, backend)
