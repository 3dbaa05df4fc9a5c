"""FSDP2's all-gather of expert weights in E4M3 (moe_kernels.quant.fsdp_fp8): the shard quantized once per
optimizer step, the forward's tiles gathered for the forward and dgrad's for the backward, half the bytes of
a bf16 gather, and training bit for bit the same as FSDP2 gathering bf16 weights for the recipe to quantize."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_kernels.nn.experts import GroupedExperts
from tests.emulation import EMULATED
from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_experts_dual
from moe_kernels.quant import Fp8BlockwiseRecipe
from moe_kernels.quant import fsdp_fp8
from moe_kernels.quant.fsdp_fp8 import (Fp8GatheredWeight, Fp8ShardWeight, enable_fp8_all_gather,
                                         fp8_all_gather_applies)

SIZES = (128, 0, 256, 128)  # rows per expert: multiples of 128 (the FP8 wgrad's token blocks)
E, H, F = len(SIZES), 128, 128


def _weight(seed=0, shape=(E, 2 * F, H)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_shard_ops_keep_the_shard_and_run_on_its_values():
    w = _weight()
    s = Fp8ShardWeight(w.clone())
    for t in (s.clone(), s.view(-1), s.detach(), s[1:3], torch.empty_like(s), s.new_zeros(3, 4),
              *torch.chunk(s, 2)):
        assert type(t) is Fp8ShardWeight
    torch.testing.assert_close(s.view(-1)._data, w.view(-1), rtol=0, atol=0)
    plain = s * 2  # arithmetic gives plain tensors (optimizer states stay plain)
    assert type(plain) is torch.Tensor
    torch.testing.assert_close(plain, w * 2, rtol=0, atol=0)
    before = s._version
    assert s.add_(1.0) is s  # in place: the wrapped values change, the shard's version moves
    assert s._version > before
    torch.testing.assert_close(s._data, w + 1.0, rtol=0, atol=0)


def test_shard_quantized_once_per_version_and_optimizer_step():
    s = Fp8ShardWeight(_weight())
    n = fsdp_fp8.stats["quantized"]
    a = s.quantized(torch.bfloat16)
    assert s.quantized(torch.bfloat16) is a and fsdp_fp8.stats["quantized"] == n + 1
    ref = quantize_fp8_experts_dual(s._data.to(torch.bfloat16))
    for got, want in zip(a, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    s.mul_(0.5)  # an in-place change outside a step
    b = s.quantized(torch.bfloat16)
    assert b is not a and fsdp_fp8.stats["quantized"] == n + 2
    torch.testing.assert_close(b[1], quantize_fp8_experts_dual(s._data.to(torch.bfloat16))[1], rtol=0, atol=0)
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    torch.optim.SGD([p], lr=0.1).step()  # any optimizer step
    assert s.quantized(torch.bfloat16) is not b and fsdp_fp8.stats["quantized"] == n + 3


class _Mp:
    param_dtype = torch.bfloat16


def test_forward_gathers_the_forward_tiles_and_the_backward_dgrad_tiles():
    s = Fp8ShardWeight(_weight())
    q, scale, q_t, scale_t = s.quantized(torch.bfloat16)
    inputs, meta = s.fsdp_pre_all_gather(None, s.shape, s.stride(), None, _Mp())
    assert inputs[0] is q and inputs[1] is scale and meta == (False, torch.bfloat16)
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen["inputs"], seen["meta"] = s.fsdp_pre_all_gather(None, s.shape, s.stride(), None, _Mp())
            return g

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen["inputs"][0] is q_t and seen["inputs"][1] is scale_t and seen["meta"][0] is True


def test_gathered_weight_reads_its_tiles_in_either_layout_and_dequantizes_elsewhere():
    s = Fp8ShardWeight(_weight(3))
    q, scale, q_t, scale_t = s.quantized(torch.bfloat16)
    fwd, _ = s.fsdp_post_all_gather((q, scale), (False, torch.bfloat16), torch.bfloat16)
    assert type(fwd) is Fp8GatheredWeight and fwd.shape == s.shape and fwd.dtype == torch.bfloat16
    bwd, _ = s.fsdp_post_all_gather((q_t, scale_t), (True, torch.bfloat16), torch.bfloat16)
    assert bwd.shape == s.shape
    for got, want in ((fwd.forward_tiles(), (q, scale)), (fwd.dgrad_tiles(), (q_t, scale_t)),
                      (bwd.forward_tiles(), (q, scale)), (bwd.dgrad_tiles(), (q_t, scale_t))):
        torch.testing.assert_close(got[0].view(torch.uint8), want[0].view(torch.uint8), rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    # Other ops see the dequantized values: the codes over their scales, tile by tile.
    deq = (q.float().view(E, 2, 128, 1, 128) / scale[:, :, None, :, None]).view(E, 2 * F, H).bfloat16()
    torch.testing.assert_close(fwd * 1, deq, rtol=0, atol=0)
    torch.testing.assert_close(bwd.to(torch.float32), deq.float(), rtol=0, atol=0)
    p = nn.Parameter(torch.as_strided(fwd, fwd.shape, fwd.stride()))
    assert type(p) is Fp8GatheredWeight and p.requires_grad
    s.fsdp_post_all_gather((q_t, scale_t), (True, torch.bfloat16), torch.bfloat16, out=p)  # FSDP2's refill
    assert p._transposed and p.dgrad_tiles()[0] is q_t
    with pytest.raises(RuntimeError, match="read-only"):
        with torch.no_grad():
            p.add_(1)


def test_gathered_tiles_off_128_are_the_padded_quantization():
    # w13 [E, 416, 144] (F = 208, H = 144): each layout's codes zero-padded along its rows, either layout made from
    # the other; the GEMM tiles the weight cache hands on are those codes; the dequantized values are the tiles'.
    from moe_kernels.ops.quant import dequantize_fp8
    from moe_kernels.quant import weight_cache

    s = Fp8ShardWeight(_weight(4, (E, 416, 144)))
    q, scale, q_t, scale_t = s.quantized(torch.bfloat16)
    assert q.shape == (E, 416, 256) and q_t.shape == (E, 144, 512) and scale.shape == (E, 4, 2)
    ref = quantize_fp8_experts_dual(s._data.to(torch.bfloat16), pad_to_block=True)
    for got, want in zip((q, scale, q_t, scale_t), ref):
        torch.testing.assert_close(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                                   want.view(torch.uint8) if want.dtype != torch.float32 else want, rtol=0, atol=0)
    for layout, outputs in ((False, (q, scale)), (True, (q_t, scale_t))):
        g, _ = s.fsdp_post_all_gather(outputs, (layout, torch.bfloat16), torch.bfloat16)
        assert g.shape == s.shape
        for got, want in ((g.forward_tiles(), (q, scale)), (g.dgrad_tiles(), (q_t, scale_t))):
            assert got[0].shape == want[0].shape
            torch.testing.assert_close(got[0].view(torch.uint8), want[0].view(torch.uint8), rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        w8 = weight_cache.fp8_expert_weights(g, pow2_scale=False, cache=False)
        for transposed, want in ((False, q), (True, q_t)):
            torch.testing.assert_close(w8.gemm_tiles(transposed)[0].view(torch.uint8), want.view(torch.uint8),
                                       rtol=0, atol=0)
        deq = torch.stack([dequantize_fp8(q[i, :, :144].contiguous(), scale[i], "tile", dtype=torch.float32)
                           for i in range(E)])
        torch.testing.assert_close(g.float(), deq.bfloat16().float(), rtol=0, atol=0)


def test_pow2_scale_must_agree():
    s = Fp8ShardWeight(_weight(), pow2_scale=True)
    g, _ = s.fsdp_post_all_gather(s.quantized(torch.bfloat16)[:2], (False, torch.bfloat16), torch.bfloat16)
    x = torch.randn(sum(SIZES), H)
    with pytest.raises(ValueError, match="pow2_scale"):
        Fp8BlockwiseRecipe().grouped_mm(x, g, torch.tensor(SIZES, dtype=torch.int32))


def test_where_it_applies():
    recipe = Fp8BlockwiseRecipe()
    assert fp8_all_gather_applies(GroupedExperts(4, 128, 128), recipe, 2) is None
    assert "not fp8-blockwise" in fp8_all_gather_applies(GroupedExperts(4, 128, 128), None, 2)
    assert "dgrad" in fp8_all_gather_applies(GroupedExperts(4, 128, 128), Fp8BlockwiseRecipe(fp8_dgrad=False), 2)
    assert "one FSDP rank" in fp8_all_gather_applies(GroupedExperts(4, 128, 128), recipe, 1)
    assert fp8_all_gather_applies(GroupedExperts(4, 144, 208), recipe, 2) is None  # zero-padded codes
    assert "multiples of 16" in fp8_all_gather_applies(GroupedExperts(4, 128, 100), recipe, 2)
    assert "divide evenly" in fp8_all_gather_applies(GroupedExperts(3, 128, 128), recipe, 2)


# Two gloo ranks: FSDP2 gathering bf16 weights for the recipe to quantize, against FSDP2 gathering E4M3.

class _Experts(nn.Module):
    def __init__(self, recipe, h=H, f=F):
        super().__init__()
        self.experts = GroupedExperts(E, h, f)
        with torch.no_grad():
            self.experts.w13.copy_(_weight(1, (E, 2 * f, h)))
            self.experts.w2.copy_(_weight(2, (E, h, f)))
        self.recipe = recipe

    def forward(self, x, gs):
        return self.experts(x, gs, mm=self.recipe.grouped_mm)


# FSDP2's all-gather (torch 2.13: all_gather_single; earlier: all_gather_into_tensor)
_ALL_GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"


def _gathered_bytes(log, original):
    def all_gather(out, inp, *args, **kwargs):
        log.append(inp.numel() * inp.element_size())
        return original(out, inp, *args, **kwargs)

    return all_gather


def _run(rank, fp8_gather: bool, reshard_after_forward: bool, steps: int, ckpt_dir: str | None,
         checkpointed: bool = False, hf=(H, F)):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    recipe = Fp8BlockwiseRecipe()
    model = _Experts(recipe, *hf)
    if fp8_gather:
        assert fp8_all_gather_applies(model.experts, recipe, 2) is None
        enable_fp8_all_gather(model.experts)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(model.experts, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    log: list[int] = []
    outs = []
    original = getattr(torch.distributed, _ALL_GATHER)
    setattr(torch.distributed, _ALL_GATHER, _gathered_bytes(log, original))
    n0 = fsdp_fp8.stats["quantized"]
    try:
        for _ in range(steps):
            x = torch.randn(sum(SIZES), hf[0], generator=gen).bfloat16()
            gs = torch.tensor(SIZES, dtype=torch.int32)
            # Checkpointed: the forward runs again inside the backward, where the gather sends dgrad's tiles.
            out = checkpoint(model, x, gs, use_reentrant=False) if checkpointed else model(x, gs)
            out.float().square().mean().backward()
            outs.append(out.detach())
            outs += [p.grad.to_local().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    finally:
        setattr(torch.distributed, _ALL_GATHER, original)
    params = [p.detach().to_local().clone() for p in model.parameters()]
    if ckpt_dir is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
        loaded = _Experts(recipe, *hf)
        if fp8_gather:
            enable_fp8_all_gather(loaded.experts)
        fully_shard(loaded.experts, mp_policy=mp)
        state = loaded.state_dict()
        dcp.load(state, checkpoint_id=ckpt_dir)
        for a, b in zip(model.parameters(), loaded.parameters()):
            torch.testing.assert_close(b.to_local()._data if fp8_gather else b.to_local(),
                                       a.to_local()._data if fp8_gather else a.to_local(), rtol=0, atol=0)
    return outs, params, sum(log), fsdp_fp8.stats["quantized"] - n0


def _gather_bytes(e: int, N: int, K: int, transposed: bool) -> int:
    """Bytes of one rank's FP8 all-gather input for its e experts of an [E, N, K] weight: the codes, zero-padded
    along their rows to a multiple of 128, and one fp32 scale per 128x128 tile (partial tiles included)."""
    blocks = -(-N // 128) * -(-K // 128)
    rows, cols = (K, N) if transposed else (N, K)
    return e * (rows * -(-cols // 128) * 128 + 4 * blocks)


def _fsdp_body(rank, world_size, reshard_after_forward, ckpt_root, checkpointed=False, hf=(H, F)):
    steps = 3
    ref_outs, ref_params, ref_bytes, _ = _run(rank, False, reshard_after_forward, steps, None, checkpointed, hf)
    outs, params, nbytes, quantized = _run(rank, True, reshard_after_forward, steps, os.path.join(ckpt_root, "c"),
                                           checkpointed, hf)
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"output/gradient {i}")
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a._data, b, rtol=0, atol=0)
    # Each shard quantized once per step, however many times it is gathered (forward, backward).
    assert quantized == 2 * steps, quantized
    # Codes (1 byte, zero-padded past a K or N off 128) and one fp32 scale per 128x128 tile, against bf16's 2
    # bytes an element.
    h, f = hf
    e = E // world_size
    elements = e * (2 * f * h + h * f)
    # The forward's, and the backward's when resharded after the forward (checkpointed: the recomputed forward
    # runs on the backward's gather, in dgrad's layout, its own tiles transposed from them).
    gathers = steps * (2 if reshard_after_forward else 1)
    assert ref_bytes == gathers * elements * 2, (ref_bytes, nbytes, gathers, elements)
    # The backward's gather sends dgrad's layout where its codes are as large as the forward's (N and K multiples
    # of 128), else the forward's again (FSDP2 sizes a parameter's all-gather buffers once).
    backward = [_gather_bytes(e, n, k, _gather_bytes(e, n, k, True) == _gather_bytes(e, n, k, False))
                for n, k in ((2 * f, h), (h, f))]
    per_step = [sum(_gather_bytes(e, n, k, False) for n, k in ((2 * f, h), (h, f))), sum(backward)]
    expected = steps * (per_step[0] + (per_step[1] if reshard_after_forward else 0))
    if hf == (128, 128):
        assert expected == gathers * (elements + elements // (128 * 128) * 4)
    assert nbytes == expected, (nbytes, expected)


@pytest.mark.parametrize("reshard_after_forward,checkpointed,hf", [
    (True, False, (H, F)), (False, False, (H, F)), (True, True, (H, F)),
    # H and F off 128 (GPT-OSS's 2880): the gathered codes zero-padded along their rows, the two layouts of
    # different sizes (the backward gathers the forward's and transposes them); resharded or not, checkpointed.
    (True, False, (144, 208)), (False, False, (144, 208)), (True, True, (144, 208)),
])
def test_fsdp2_fp8_all_gather_trains_as_the_bf16_gather(reshard_after_forward, checkpointed, hf):
    from tests.distributed import run_world

    with tempfile.TemporaryDirectory() as tmp:
        run_world(_fsdp_body, 2, reshard_after_forward, tmp, checkpointed, hf)


# A whole model through parallelize(): FSDP2 over 2 gloo ranks, the experts gathered in E4M3 or in bf16.

def _model_body(rank, world_size, layout):
    import copy

    from moe_kernels.models import build_model
    from moe_kernels.models.presets import tiny_qwen3_moe
    from moe_kernels.parallel.layout import ParallelConfig
    from moe_kernels.parallel.full_state import full_state
    from moe_kernels.parallel.parallelize import parallelize
    from tests.parallel.test_data_parallel import _batch

    torch.manual_seed(0)
    ref = build_model(tiny_qwen3_moe(hidden_size=128, ffn_size=128, num_experts=2 * world_size,
                                     recipe=Fp8BlockwiseRecipe()))
    runs = []
    for fp8 in (False, True):
        par = parallelize(copy.deepcopy(ref), ParallelConfig(**layout), mixed_precision=True, fp8_all_gather=fp8)
        experts = [layer.experts for layer in par.model.moe_layers()]
        assert all(isinstance(e.w13.to_local(), Fp8ShardWeight) == fp8 for e in experts)
        assert par.fp8_all_gather_reasons == []
        opt = torch.optim.SGD(par.model.parameters(), lr=0.5)
        losses = []
        for step in range(2):
            ids = _batch(step, rank, ref.config.vocab_size)
            ce, aux = par.forward_backward(ids[:, :-1], ids[:, 1:])
            losses.append(ce + aux)
            opt.step()
            opt.zero_grad()
        params = {n: p.detach().to_local() for n, p in par.model.named_parameters()}
        full = full_state(par, opt)  # what --save-full and --export-hf write (rank 0)
        runs.append((torch.stack(losses), {n: getattr(p, "_data", p) for n, p in params.items()}, full))
    (l0, p0, f0), (l1, p1, f1) = runs
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=0, atol=0, msg=name)
    if rank == 0:
        assert f0[0].keys() == f1[0].keys()
        for name, t in f1[0].items():
            assert type(t) is torch.Tensor, (name, type(t))
            torch.testing.assert_close(t, f0[0][name], rtol=0, atol=0, msg=name)
    # Where it does not apply, the layer keeps the bf16 gather and says why.
    bf16_dgrad = parallelize(build_model(tiny_qwen3_moe(hidden_size=128, ffn_size=128, num_experts=2 * world_size,
                                                        recipe=Fp8BlockwiseRecipe(fp8_dgrad=False))),
                             ParallelConfig(**layout))
    reasons = bf16_dgrad.fp8_all_gather_reasons
    assert len(reasons) == 2 and all("dgrad" in r for r in reasons), reasons


@pytest.mark.parametrize("world,layout", [
    (2, dict(dp_shard=2)),  # the experts in their block's FSDP unit, over both ranks
    pytest.param(4, dict(ep=2), marks=pytest.mark.extended),  # EP 2 x FSDP 2: the experts' own unit over edp
])
def test_parallelize_gathers_the_experts_in_fp8_and_trains_as_the_bf16_gather(world, layout):
    from tests.distributed import run_world

    run_world(_model_body, world, layout)


@pytest.mark.gpu
@pytest.mark.skipif(not EMULATED, reason="two FSDP2 ranks on the CPU-executed kernels (one GPU holds one NCCL rank)")
@pytest.mark.parametrize("hf", [(H, F), (144, 208)])
def test_fsdp2_fp8_all_gather_on_the_kernels(hf):
    """The same two ranks with the quantization and the FP8 GEMMs on the CUDA implementations (the spawned
    ranks inherit the emulation): the shard's dual-layout kernel and the GEMMs on gathered codes (off 128: the
    padded layouts, dgrad's transposed from the gathered forward tiles)."""
    from tests.distributed import run_world

    with tempfile.TemporaryDirectory() as tmp:
        run_world(_fsdp_body, 2, True, tmp, False, hf)
