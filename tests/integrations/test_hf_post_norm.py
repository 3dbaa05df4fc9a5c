"""Experts with a post-expert norm (transformers' has_post_expert_norm: Muse Spark's) on moe_kernels' ops: the norm
applied to each expert's output before its routing weight, behind transformers' own router; against the model's own
forward and gradients. Ergo's norm with a weight row per expert: test_norm_per_expert_takes_each_rows_expert here, the
model in tests/integrations/test_hf.py's families."""

from __future__ import annotations

import copy

import pytest
import torch

import moe_kernels as mk
from moe_kernels.integrations import hf
from moe_kernels.nn.lora import unwrapped

transformers = pytest.importorskip("transformers")
muse = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")


def _model(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.MuseSparkTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_hidden_size=16, moe_intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8,
    )
    model = muse.MuseSparkTextModel(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)
            elif name.endswith(("post_expert_norm.weight", "gate.weight")):
                p.normal_(0.0, 0.5)  # the norm's scale (1 + w) not 1, routing decisive
    return model


def _ids(seed: int = 1):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def _experts(model):
    return [unwrapped(m.experts) for m in model.modules() if isinstance(m, muse.MuseSparkMoE)]


def test_post_expert_norm_matches_transformers():
    # patch_hf puts the experts (projected to moe_hidden_size by the block) on our ops: permute, grouped GEMMs, the
    # experts' own norm over the permuted outputs, unpermute with the routing weights; transformers' router stays.
    model = _model()
    ref = copy.deepcopy(model)
    ids = _ids()
    mk.patch_hf(model)
    assert hf.is_patched(model) and len(_experts(model)) == 2
    calls = []
    real = hf.experts._normed
    try:
        hf.experts._normed = lambda norm, y, gs: calls.append(y.shape) or real(norm, y, gs)
        out = model(ids).last_hidden_state
    finally:
        hf.experts._normed = real
    want = ref(ids).last_hidden_state
    assert len(calls) == 2  # one norm per MoE block, over its permuted rows
    _assert_same_model(model, ref, out, want)
    norm_grads = [e.post_expert_norm.weight.grad for e in _experts(model)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in norm_grads)


def _assert_same_model(model, ref, out, want):
    """Outputs and every parameter's gradient (of a fixed random projection of the output: the model ends in an RMS
    norm, so a loss like out.square().sum() is nearly constant and its gradient a cancellation) within fp32
    reassociation: the experts' sums run in another order (grouped GEMM vs transformers' loop), ~1e-7 relative per
    op; a 2-layer backward compounds a few dozen such ops: 1e-4 relative L2 allowed."""
    from moe_kernels.testing import relative_l2_error

    assert relative_l2_error(out.cpu(), want) < 1e-5
    r = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (out * r.to(out.device)).sum().backward()
    (want * r).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None and q.grad.abs().sum() > 0:
            assert relative_l2_error(p.grad.cpu(), q.grad) < 1e-4, name


def test_rows_past_the_groups_stay_out_of_the_norm():
    # With a recipe's alignment (rows per expert padded to 128) and NaN in the rows past the groups of the expert
    # output (unspecified there), the norm's weight gradient stays finite: those rows are zeroed before the norm.
    norm = muse.MuseSparkTextInputScaledRMSNorm(8)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    y = torch.randn(6, 8, requires_grad=True)
    sizes = torch.tensor([2, 0, 2], dtype=torch.int32)
    y_nan = torch.cat([y[:4], torch.full((2, 8), float("nan"))])
    out = hf.experts._normed(norm, y_nan, sizes)
    torch.testing.assert_close(out[:4], norm(y[:4]), rtol=0, atol=0)
    out[:4].sum().backward()
    assert torch.isfinite(norm.weight.grad).all() and torch.isfinite(y.grad).all()


@pytest.mark.parametrize("first", [0, 3])
def test_norm_per_expert_takes_each_rows_expert(first):
    # A norm with a weight row per expert (Ergo's ErgoExpertNorm) on the permuted rows: each row normed with its
    # group's expert (first + the group's index: an expert-parallel rank's experts start at `first`), found from the
    # group sizes on the device; NaN in the rows past the groups stays out of every gradient.
    ergo = pytest.importorskip("transformers.models.ergo.modeling_ergo")
    cfg = transformers.ErgoConfig(hidden_size=8, num_experts=6, rms_norm_eps=1e-6)
    norm = ergo.ErgoExpertNorm(cfg)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    y = torch.randn(5, 8, requires_grad=True)
    sizes = torch.tensor([2, 0, 3], dtype=torch.int32)  # experts first, first + 1 (empty), first + 2
    y_nan = torch.cat([y, torch.full((2, 8), float("nan"))])
    out = hf.experts._expert_normed(norm, y_nan, sizes, first)
    want = norm(y, torch.tensor([0, 0, 2, 2, 2]) + first)
    torch.testing.assert_close(out[:5], want, rtol=0, atol=0)
    out[:5].sum().backward()
    assert torch.isfinite(norm.weight.grad).all() and torch.isfinite(y.grad).all()
    used = {first, first + 2}
    assert all((norm.weight.grad[e].abs().sum() > 0) == (e in used) for e in range(6))


def test_post_expert_norm_on_the_fp8_recipe():
    # The FP8 recipe's GEMMs, the norm between the second GEMM and the unpermute (moe_hidden_size = 16 and F = 32:
    # no multiples of 128, the contractions zero-padded). The MoE block's output within FP8's error of the model's own:
    # the expert outputs carry the 4 E4M3 operands' error (x and gate_up_proj, the activation and down_proj); the norm
    # divides each by its RMS, which keeps a row's relative error (to first order, less its component along the row),
    # and the weighted sum and the projection back are linear: the 4-operand model, 2x allowed. Gradients reached.
    from moe_kernels.quant import Fp8BlockwiseRecipe
    from moe_kernels.testing import E4M3_REL_ERROR, QUANT_SLACK, quantized_product_error, relative_l2_error

    model = _model(layers=1)
    ids = _ids()
    block = next(m for m in model.modules() if isinstance(m, muse.MuseSparkMoE))
    outs = []
    block.register_forward_hook(lambda mod, args, out: outs.append(out))
    with torch.no_grad():
        model(ids)
    mk.patch_hf(model, recipe=Fp8BlockwiseRecipe())
    model(ids).last_hidden_state.square().sum().backward()
    err = relative_l2_error(outs[1].detach(), outs[0])
    assert 1e-3 < err < 2 * QUANT_SLACK * quantized_product_error(*[E4M3_REL_ERROR] * 4), err
    for experts in _experts(model):
        for p in (experts.gate_up_proj, experts.down_proj, experts.post_expert_norm.weight):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.gpu
def test_post_expert_norm_on_the_device(cuda):
    # The same on the device's kernels (the fused region steps aside for the norm), against the CPU model.
    model = _model()
    ref = copy.deepcopy(model)
    ids = _ids()
    mk.patch_hf(model.to(cuda))
    _assert_same_model(model, ref, model(ids.to(cuda)).last_hidden_state, ref(ids).last_hidden_state)


def _expert_parallel_worker(rank, P, backend):
    # Expert-parallel post-norm experts: each rank's output on its own tokens is the one-rank model's, its experts'
    # gradients the sum over the ranks of the one-rank model's slices. The norm's weight is shared by every expert,
    # so a rank's gradient of it holds its experts' rows (every rank's tokens): summed over the ranks, as the
    # data-parallel reduction does, it equals the one-rank model's sum over the ranks (as every other replicated
    # parameter's, whose rank gradient holds its own tokens).
    import torch.distributed as dist

    from moe_kernels.parallel import apply_expert_parallel, expert_parameters
    from moe_kernels.testing import relative_l2_error

    full = mk.patch_hf(_model())
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    assert all(e.gate_up_proj.shape[0] == 8 // P for e in _experts(ep))
    shards = {n for n, p in ep.named_parameters() if any(p is q for q in expert_parameters(ep))}
    assert len(shards) == 4  # two blocks' gate_up_proj and down_proj
    ids = torch.randint(0, 64, (2, 6 + 2 * rank), generator=torch.Generator().manual_seed(rank))
    r = torch.randn(*ids.shape, 32, generator=torch.Generator().manual_seed(10 + rank))
    outs = []
    for model in (full, ep):
        out = model(ids).last_hidden_state
        (out * r).sum().backward()
        outs.append(out)
    where = f"rank {rank}/{P} {backend}"
    assert relative_l2_error(outs[1], outs[0]) < 1e-5, where
    full_params = dict(full.named_parameters())
    for name, p in ep.named_parameters():
        got, want = p.grad.clone(), full_params[name].grad.clone()
        if name in shards:
            dist.all_reduce(want)
            want = want.chunk(P, 0)[rank]
        elif name.endswith("post_expert_norm.weight"):
            dist.all_reduce(got)
            dist.all_reduce(want)
        assert relative_l2_error(got, want) < 1e-4, f"{where}: {name}"


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["all_to_all", "all_gather"])
def test_expert_parallel_equals_one_rank(backend):
    from tests.distributed import run_world

    run_world(_expert_parallel_worker, 2, backend)


def test_fused_lora_on_post_norm_experts():
    # peft's LoRA on the experts' weights (target_parameters), fused by patch_hf into grouped rank-r GEMMs before the
    # norm: the output and every gradient (the adapters' included) against peft's own path on transformers' loop,
    # within 2x that path's fp32 error against its fp64 run (plus 8 ulps: assert_close_to_fp64).
    peft = pytest.importorskip("peft")
    from moe_kernels.testing import assert_close_to_fp64

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = peft.get_peft_model(_model(), config)
    fused = mk.patch_hf(copy.deepcopy(peft_model))
    assert sum(type(m).__qualname__ == "MoeKernelsParamWrapper" for m in fused.modules()) == 2 * 2
    peft_model.get_base_model().set_experts_implementation("eager")  # transformers' plain loop: fp64 too
    ref64 = copy.deepcopy(peft_model).double()
    ids = _ids()
    runs = []
    for model in (fused, peft_model, ref64):
        out = model(ids).last_hidden_state
        r = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        (out * r).sum().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (out, g), (out32, g32), (out64, g64) = runs
    assert_close_to_fp64(out, out32, out64, "out")
    assert set(g) == set(g64) and any("lora" in n for n in g)
    for name in g64:
        assert_close_to_fp64(g[name], g32[name], g64[name], f"d {name}")
