"""Expert parallelism on P gloo ranks equals one rank (the equivalence ladder's "EP N equals EP 1").

Every rank builds the same model, then feeds its own tokens. The EP model must give each rank the
outputs and input gradients the full model gives on that rank's tokens; each rank's expert weights
must receive the sum over ranks of the full model's gradients for those experts; replicated
parameters the local gradient.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_kernels.models import PRESETS, build_model
from moe_kernels.nn.moe import MoELayer, deepseek_v3, qwen3_30b_a3b
from moe_kernels.parallel import apply_expert_parallel, expert_parameters
from tests.distributed import run_world

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-5, atol=1e-6)


def _check_grads(rank, P, full: nn.Module, ep: nn.Module, where: str) -> None:
    sharded = {id(p) for p in expert_parameters(ep)}
    full_params = dict(full.named_parameters())
    for name, p in ep.named_parameters():
        ref = full_params[name].grad
        if id(p) in sharded:  # [El, ...] slice of the full [E, ...]; every rank's tokens contribute
            ref = ref.clone()
            dist.all_reduce(ref)
            El = p.shape[0]
            ref = ref[rank * El : (rank + 1) * El]
        assert p.grad is not None and p.grad.shape == ref.shape, f"{where}: {name}"
        torch.testing.assert_close(p.grad, ref, **TOL, msg=f"{where}: {name}")


def _compare_layers(rank, full: nn.Module, par: nn.Module, hidden: int, empty_rank, where: str,
                    region: bool = False) -> None:
    """Both layers on this rank's tokens (uneven counts per rank; none on empty_rank, which still takes part in
    every collective): outputs, aux losses and input gradients equal. region: the EP layer's experts run the fused
    `experts` region (no registered grouped_mm, which the registered ops call for any rows; the CUDA code path)."""
    from moe_kernels.testing import extension_calls

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 3 + 2 * rank, hidden, generator=gen)
    if rank == empty_rank:
        x = x[:, :0]
    g = torch.randn(x.shape, generator=gen)
    outs = []
    for model in (full, par):
        xi = x.clone().requires_grad_()
        with extension_calls() if region and model is par else contextlib.nullcontext() as ext:
            out, aux = model(xi)
            ((out * g).sum() + aux).backward()
        if region and model is par:  # (a rank may receive no rows: then no call at all)
            assert "grouped_mm" not in ext.calls, (where, ext.calls)
        outs.append((out, aux, xi.grad))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, **TOL, msg=where)


def _layer_case(rank, P, backend, cfg, name, empty_rank=None, region=False):
    torch.manual_seed(0)
    full = MoELayer(cfg)
    if full.router.expert_bias is not None:  # a non-trivial bias, the same on every rank
        full.router.expert_bias.copy_(torch.linspace(-0.1, 0.1, cfg.num_experts))
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    assert ep.experts.w13.shape[0] == cfg.num_experts // P and len(list(expert_parameters(ep))) == 2
    where = f"rank {rank}/{P} {backend} {name}"
    _compare_layers(rank, full, ep, cfg.hidden_size, empty_rank, where, region)
    _check_grads(rank, P, full, ep, where)


def _worker_layer(rank, P, backend, region=False):
    small = dict(hidden_size=24, ffn_size=16, num_experts=4 * P)
    case = lambda cfg, name, **kw: _layer_case(rank, P, backend, cfg, name, region=region, **kw)  # noqa: E731
    case(qwen3_30b_a3b(**small, k=3), "softmax top-3")
    case(qwen3_30b_a3b(**small, k=2, weights_in_activation=True, align=16), "weights in the activation, align 16")
    case(deepseek_v3(**small, k=4, num_groups=4, group_topk=2, shared_ffn_size=8),
         "sigmoid + bias + groups + shared expert")
    case(qwen3_30b_a3b(**small, k=2, capacity_factor=1.0), "capacity (dropped slots)")
    case(deepseek_v3(**small, k=4, num_groups=4, group_topk=2), "rank 1 without tokens", empty_rank=1)
    case(deepseek_v3(**small, k=4, num_groups=4, group_topk=2, shared_ffn_size=8, activation="squared_relu"),
         "squared-ReLU experts + shared expert")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", ["all_gather", "all_to_all"])
def test_moe_layer_expert_parallel_equals_one_rank(backend, world_size):
    run_world(_worker_layer, world_size, backend)


def _worker_fp8(rank, P, backend):
    # The FP8 recipe on the dispatched path: the dispatched rows and the combine's gradient quantized in both layouts
    # by one pass each, the activation's producers writing the second GEMM's input and the first GEMM's gradient in
    # E4M3. Bit for bit the unfused recipe (fused_swiglu=False: the activation in bf16, quantized by its own passes)
    # on the same ranks, outputs and every gradient; both within the FP8 error model of the full layer in fp32.
    from moe_kernels.quant import Fp8BlockwiseRecipe, recipe as recipe_mod
    from moe_kernels.testing import quantized_sqnr_floor_db, sqnr_db

    calls = {"swiglu_bwd_quantize_fp8": 0, "squared_relu_bwd_quantize_fp8": 0}
    for name in calls:
        real = getattr(recipe_mod, name)
        setattr(recipe_mod, name, lambda *a, _n=name, _f=real, **kw: calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **kw))
    for activation, ffn in (("swiglu", 128), ("squared_relu", 208)):
        torch.manual_seed(0)
        cfg = qwen3_30b_a3b(hidden_size=128, ffn_size=ffn, num_experts=4 * P, k=2, activation=activation)
        full = MoELayer(cfg)
        layers = []
        for recipe in (Fp8BlockwiseRecipe(), Fp8BlockwiseRecipe(fused_swiglu=False)):
            layer = MoELayer(cfg.replace(recipe=recipe))
            layer.load_state_dict(full.state_dict())
            layer = apply_expert_parallel(layer.to(torch.bfloat16), backend=backend)
            layer.router.float()
            layers.append(layer)
        x = torch.randn(2, 40 + 8 * rank, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + rank))
        results = []
        before = dict(calls)
        for model in (full, *layers):
            xi = x.clone().to(next(model.experts.parameters()).dtype).requires_grad_()
            out, aux = model(xi)
            ((out.float() * g).sum() + aux).backward()
            results.append((out.float(), xi.grad.float(), model.experts.w13.grad.float(), model.experts.w2.grad.float()))
        where = f"rank {rank}/{P} {backend} FP8 {activation}"
        assert layers[0].expert_path == layers[1].expert_path == "dispatched", where
        gated = activation == "swiglu"
        assert calls["swiglu_bwd_quantize_fp8"] - before["swiglu_bwd_quantize_fp8"] == int(gated), where
        assert calls["squared_relu_bwd_quantize_fp8"] - before["squared_relu_bwd_quantize_fp8"] == int(not gated), where
        for got, want in zip(results[1], results[2]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
        # Against the fp32 layer: four E4M3 operands in the output (x and w13, the activation and w2).
        assert sqnr_db(results[1][0], results[0][0]) > quantized_sqnr_floor_db(4), where


@pytest.mark.parametrize("backend", ["all_gather", "all_to_all"])
def test_moe_layer_fp8_expert_parallel(backend):
    run_world(_worker_fp8, 2, backend)


def _worker_lora(rank, P, backend):
    # peft LoRA on the layer's experts, then expert parallelism: the adapters stay whole (replicated) and each rank
    # applies its experts' slices. The EP layer's outputs and input gradients equal the full layer's on this rank's
    # tokens; a rank's adapter gradients, summed over the ranks, equal the full layer's summed (each rank fills only
    # its experts' slices, with every rank's tokens routed to them).
    import peft

    from moe_kernels.integrations import peft as mk_peft

    torch.manual_seed(0)
    cfg = qwen3_30b_a3b(hidden_size=24, ffn_size=16, num_experts=4 * P, k=3)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=["experts.w13", "experts.w2"],
                             init_lora_weights=False)
    full = peft.get_peft_model(MoELayer(cfg), config)
    mk_peft.fuse_lora(full)
    ep = apply_expert_parallel(copy.deepcopy(full), backend=backend)
    layer = ep.get_base_model()
    assert layer.expert_path is None and len(list(expert_parameters(ep))) == 2
    assert all("lora_" not in n for n, p in ep.named_parameters() if any(p is q for q in expert_parameters(ep)))
    E, El = cfg.num_experts, cfg.num_experts // P
    for empty_rank in (None, 1):  # rank 1 without tokens: zero adapter gradients there, not None
        where = f"rank {rank}/{P} {backend} LoRA, empty rank {empty_rank}"
        full.zero_grad(set_to_none=True)
        ep.zero_grad(set_to_none=True)
        _compare_layers(rank, full, ep, cfg.hidden_size, empty_rank, where)
        assert layer.expert_path == "dispatched"
        lora = [n for n, p in ep.named_parameters() if "lora_" in n]
        assert len(lora) == 4
        full_params = dict(full.named_parameters())
        for name in lora:
            got, want = dict(ep.named_parameters())[name].grad.clone(), full_params[name].grad.clone()
            # this rank's backward touches only its experts' slices: lora_A's [E r, K] rows, lora_B's [N, E r] columns
            per_expert = (got.view(E, -1, got.shape[-1]) if "lora_A" in name
                          else got.view(got.shape[0], -1, E).permute(2, 0, 1))
            lo, hi = rank * El, (rank + 1) * El
            assert per_expert[:lo].abs().sum() == 0 and per_expert[hi:].abs().sum() == 0, f"{where}: {name}"
            dist.all_reduce(got)
            dist.all_reduce(want)
            torch.testing.assert_close(got, want, **TOL, msg=f"{where}: {name}")
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        # Two adapters active at once: peft's own path (W + the deltas), with this rank's slices of each delta.
        two, two_ep = copy.deepcopy(full), None
        two.add_adapter("second", config)
        two_ep = apply_expert_parallel(copy.deepcopy(two), backend=backend)
        for model in (two, two_ep):
            model.base_model.set_adapter(["default", "second"])
        torch.testing.assert_close(two_ep(x)[0], two(x)[0], **TOL)
        # Adapters made after apply_expert_parallel hold this rank's experts alone: refused.
        late = peft.get_peft_model(apply_expert_parallel(MoELayer(cfg), backend=backend), config)
        with pytest.raises(ValueError, match="parametrized .* before apply_expert_parallel"):
            late(x)
        with_adapters = ep(x)[0]
        # The wrapper kept, its adapters off: the layer without them.
        torch.testing.assert_close(_without_adapters(ep, x), _without_adapters(full, x), **TOL)
        # Merged (each rank its experts' slices of the delta): the adapters' output, up to the fp32 rounding of
        # W + s B A (2^-24 of an element; outputs O(1), K <= 24: a few 1e-7), 1e-5 allowed.
        torch.testing.assert_close(ep.merge_and_unload()(x)[0], with_adapters, rtol=1e-5, atol=1e-5)


def _without_adapters(model, x):
    with model.disable_adapter():
        return model(x)[0]


@pytest.mark.parametrize("backend", ["all_gather", "all_to_all"])
def test_moe_layer_lora_expert_parallel_equals_one_rank(backend):
    pytest.importorskip("peft")
    run_world(_worker_lora, 2, backend)


def _worker_model(rank, P, family):
    torch.manual_seed(0)
    full = build_model(PRESETS[family](num_experts=4 * P))
    ep = apply_expert_parallel(copy.deepcopy(full))
    ep.set_activation_checkpointing(True)  # the recomputed forward dispatches again, on every rank alike
    ids = torch.randint(0, full.config.vocab_size, (2, 6 + rank), generator=torch.Generator().manual_seed(rank))
    results = []
    for model in (full, ep):
        logits, aux = model(ids)
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + aux).backward()
        results.append((logits, aux))
    where = f"rank {rank}/{P} {family}"
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **TOL, msg=where)
    _check_grads(rank, P, full, ep, where)
    with pytest.raises(ValueError, match="already expert-parallel"):
        apply_expert_parallel(ep)


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_model_expert_parallel_equals_one_rank(family):
    run_world(_worker_model, 2, family)


def test_apply_expert_parallel_needs_moe_layers():
    with pytest.raises(ValueError, match="no MoELayer"):
        apply_expert_parallel(nn.Linear(2, 2))


def _worker_etp(rank, P, backend):
    """EP 2 x ETP 2 on 4 ranks (rank = ep_rank * 2 + etp_rank): each rank's outputs, input gradients and
    replicated gradients equal the full layer's on its own tokens; each expert slice's gradient is the slice of
    the full gradient summed over all ranks (the etp pair gathers its tokens, the ep pair dispatches them)."""
    from tests.parallel.test_tensor_parallel import _expert_slice

    ep, etp = 2, 2
    etp_groups = [dist.new_group([e * etp + t for t in range(etp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * etp + t for e in range(ep)]) for t in range(etp)]
    e_rank, t_rank = rank // etp, rank % etp
    small = dict(hidden_size=24, ffn_size=16, num_experts=8)
    cases = [
        (qwen3_30b_a3b(**small, k=3), "softmax top-3", None),
        (qwen3_30b_a3b(**small, k=2, weights_in_activation=True, align=16), "weights in the activation", None),
        (deepseek_v3(**small, k=4, num_groups=4, group_topk=2, shared_ffn_size=8), "sigmoid + groups + shared", None),
        (qwen3_30b_a3b(**small, k=2, capacity_factor=1.0), "capacity (dropped slots)", None),
        (qwen3_30b_a3b(**small, k=2), "rank 1 without tokens", 1),
        (deepseek_v3(**small, k=4, num_groups=4, group_topk=2, shared_ffn_size=8, activation="squared_relu"),
         "squared-ReLU experts + shared expert", None),
    ]
    for cfg, name, empty_rank in cases:
        torch.manual_seed(0)
        full = MoELayer(cfg)
        par = apply_expert_parallel(copy.deepcopy(full), ep_groups[t_rank], etp_group=etp_groups[e_rank],
                                    backend=backend)
        gated = cfg.activation == "swiglu"
        up_rows = (2 if gated else 1) * cfg.ffn_size // etp
        assert par.experts.w13.shape == (cfg.num_experts // ep, up_rows, cfg.hidden_size)
        where = f"rank {rank}/{P} {backend} ep 2 x etp 2 {name}"
        _compare_layers(rank, full, par, cfg.hidden_size, empty_rank, where)
        sharded = {id(p) for p in expert_parameters(par)}
        full_params = dict(full.named_parameters())
        for pname, p in par.named_parameters():
            ref = full_params[pname].grad
            if id(p) in sharded:
                ref = ref.clone()
                dist.all_reduce(ref)
                ref = _expert_slice(ref, pname, e_rank, ep, t_rank, etp, gated)
            torch.testing.assert_close(p.grad, ref, **TOL, msg=f"{where}: {pname}")


def _worker_etp_lora(rank, P):
    # peft LoRA on the experts, then EP 2 x ETP 2: each rank applies its experts' slices of the factors and, of
    # those, its ffn slice (w13's B rows: the gate and up rows of its slice, or its rows without a gate; w2's A
    # columns). Outputs and input gradients equal the full layer's on each rank's tokens; the adapter gradients
    # summed over the 4 ranks equal the full layer's summed (each rank holds its slice's part of every token routed
    # to its experts). Fused grouped LoRA terms and peft's own path (two adapters at once).
    import peft

    from moe_kernels.integrations import peft as mk_peft

    ep, etp = 2, 2
    etp_groups = [dist.new_group([e * etp + t for t in range(etp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * etp + t for e in range(ep)]) for t in range(etp)]
    e_rank, t_rank = rank // etp, rank % etp
    for activation in ("swiglu", "squared_relu"):
        torch.manual_seed(0)
        cfg = qwen3_30b_a3b(hidden_size=24, ffn_size=16, num_experts=8, k=3, activation=activation)
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=["experts.w13", "experts.w2"],
                                 init_lora_weights=False)
        full = peft.get_peft_model(MoELayer(cfg), config)
        mk_peft.fuse_lora(full)
        par = apply_expert_parallel(copy.deepcopy(full), ep_groups[t_rank], etp_group=etp_groups[e_rank])
        where = f"rank {rank}/{P} ep 2 x etp 2 LoRA {activation}"
        _compare_layers(rank, full, par, cfg.hidden_size, None, where)
        lora = [n for n, _ in par.named_parameters() if "lora_" in n]
        assert len(lora) == 4, where
        full_params, par_params = dict(full.named_parameters()), dict(par.named_parameters())
        for name in lora:
            got, want = par_params[name].grad.clone(), full_params[name].grad.clone()
            dist.all_reduce(got)
            dist.all_reduce(want)
            torch.testing.assert_close(got, want, **TOL, msg=f"{where}: {name}")
        # Two adapters at once: peft's own path (W + the deltas), with this rank's slices of each delta.
        x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            two = copy.deepcopy(full)
            two.add_adapter("second", config)
            two_par = apply_expert_parallel(copy.deepcopy(two), ep_groups[t_rank], etp_group=etp_groups[e_rank])
            for model in (two, two_par):
                model.base_model.set_adapter(["default", "second"])
            torch.testing.assert_close(two_par(x)[0], two(x)[0], **TOL, msg=where)


@pytest.mark.distributed
def test_moe_layer_lora_expert_tensor_parallel_equals_one_rank():
    pytest.importorskip("peft")
    run_world(_worker_etp_lora, 4)


@pytest.mark.parametrize("backend", [pytest.param("all_gather", marks=pytest.mark.extended), "all_to_all"])
def test_moe_layer_expert_tensor_parallel_equals_one_rank(backend):
    run_world(_worker_etp, 4, backend)


def _worker_etp_only(rank, P):
    # ETP 2 without EP (an ep group of one rank): every rank holds every expert's half.
    group = dist.new_group([0, 1])
    ones = [dist.new_group([r]) for r in range(P)]
    torch.manual_seed(0)
    full = MoELayer(qwen3_30b_a3b(hidden_size=24, ffn_size=16, num_experts=4, k=2))
    par = apply_expert_parallel(copy.deepcopy(full), ones[rank], etp_group=group)
    assert par.experts.w2.shape == (4, 24, 8)
    x = torch.randn(5 + rank, 24, generator=torch.Generator().manual_seed(rank))
    torch.testing.assert_close(par(x)[0], full(x)[0], **TOL, msg=f"rank {rank}")
    with pytest.raises(ValueError, match="pass the expert-parallel group"):
        apply_expert_parallel(copy.deepcopy(full), etp_group=group)
    with pytest.raises(ValueError, match="must share this rank only"):
        apply_expert_parallel(copy.deepcopy(full), group, etp_group=group)
    with pytest.raises(ValueError, match="must divide the expert ffn size 15"):
        apply_expert_parallel(MoELayer(qwen3_30b_a3b(hidden_size=24, ffn_size=15, num_experts=4, k=2)), ones[rank],
                              etp_group=group)


def test_expert_tensor_parallel_without_expert_parallel():
    run_world(_worker_etp_only, 2)


@pytest.mark.gpu
def test_expert_parallel_on_the_kernels():
    # The same equivalences on the CUDA code path: the EP layer's dispatched experts on the kernels (the `experts`
    # region) against the one-rank layer's fused regions, LoRA included (the registered ops). gloo's ranks exchange
    # CPU tensors, so this runs where the CUDA kernels run on the CPU (the emulated tier); on a GPU the NVLink tests
    # cover the device path.
    from tests.emulation import EMULATED

    if not EMULATED:
        pytest.skip("gloo carries CPU tensors: the CUDA code path on them runs under MOE_KERNELS_EMULATE only")
    run_world(_worker_layer, 2, "all_to_all", True)  # the experts on the fused `experts` region
    run_world(_worker_layer, 2, "all_gather", True)
    pytest.importorskip("peft")
    run_world(_worker_lora, 2, "all_gather")
