"""A model built on the meta device, parallelized, then materialised: each rank draws only its pieces, and
every layout holds the pieces of the one-process model of the same seed, bit for bit (moe_kernels.models.init).
The routers stay fp32 and the routing weights keep their dtype under the bf16 mixed-precision policy."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.models import PRESETS, build_model
from moe_kernels.models.init import BLOCK_ELEMENTS, draw_block, fill, rows_per_block
from moe_kernels.parallel.layout import ParallelConfig
from tests.distributed import run_world

SEED = 1234
MODEL = dict(num_experts=8, num_layers=2)


def test_blocks_are_independent_of_the_slice():
    """Any slice of a parameter (rows across block boundaries, columns, gate/up halves) gets the values the
    whole parameter gets at those positions."""
    shape = (3 * rows_per_block((1, 4096)) + 6, 4096)  # rows past three blocks (even splits: 3 divides them)
    assert rows_per_block(shape) == BLOCK_ELEMENTS // 4096
    whole = torch.empty(shape)
    fill(whole, "w", ("normal", 0.02), 7)
    assert abs(float(whole.std()) - 0.02) < 1e-3
    n = rows_per_block(shape)
    torch.testing.assert_close(whole[:n], draw_block(7, "w", 0, shape, 0.02, "cpu"), rtol=0, atol=0)
    # A column slice (tensor-parallel rank 1 of 4), the last of 3 row chunks (across a block boundary), an etp
    # slice of gate and up rows; groups given as (size, rank) pairs.
    for splits, want in [
        ([("dim", (4, 1), 1)], whole[:, 1024:2048]),
        ([("dim", (3, 2), 0)], whole.chunk(3)[2]),
        ([("gate_up", (2, 1), 1)], torch.cat([whole[:, 1024:2048], whole[:, 3072:]], 1)),
    ]:
        got = torch.empty(want.shape)
        fill(got, "w", ("normal", 0.02), 7, splits)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    other = torch.empty(shape)
    fill(other, "w", ("normal", 0.02), 8)
    assert not torch.equal(other, whole)  # the seed matters
    fill(other, "v", ("normal", 0.02), 7)
    assert not torch.equal(other, whole)  # so does the name


def test_build_model_is_seeded():
    cfg = PRESETS["tiny-deepseek-v3"](**MODEL)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    torch.manual_seed(0)
    c = build_model(cfg)
    torch.manual_seed(0)
    d = build_model(cfg)
    assert torch.equal(c.layers[1].mlp.experts.w13, d.layers[1].mlp.experts.w13)  # manual_seed fixes the model
    assert not torch.equal(a.layers[1].mlp.experts.w13, c.layers[1].mlp.experts.w13)
    w2 = a.layers[1].mlp.experts.w2
    std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    assert abs(float(w2.detach().std()) / std - 1) < 0.05 and float(a.norm.weight.detach().min()) == 1.0


def _meta_worker(rank, P, family, layouts):
    from moe_kernels.parallel.parallelize import parallelize

    cfg = PRESETS[family](**MODEL)
    want = build_model(cfg, seed=SEED).state_dict() if rank == 0 else None
    for layout in layouts:
        pipeline = dict(num_microbatches=2) if layout.get("pp", 1) > 1 else {}
        model = build_model(cfg, device="meta")
        par = parallelize(model, ParallelConfig(**layout), "cpu", seed=SEED, **pipeline)
        local = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in par.model.parameters())
        total = sum(t.numel() for t in want.values()) if rank == 0 else None
        full = par.full_state(None)
        if rank == 0:
            assert local < total / 2, (layout, local, total)  # this rank holds its pieces only
            got = full[0]
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(got[name], t), f"{family} {layout}: {name}"


@pytest.mark.distributed
@pytest.mark.parametrize("family,layouts", [
    ("tiny-qwen3-moe", [dict(dp_shard=4), dict(tp=2, ep=2, etp=2), dict(pp=2, ep=2)]),
    # (two layers: pp 2 leaves the first stage one dense layer, no experts to split)
    ("tiny-deepseek-v3", [dict(dp_replicate=2, ep=2), dict(cp=2, ep=4), dict(pp=2, ep=2)]),
])
def test_meta_model_equals_one_process(family, layouts):
    run_world(_meta_worker, 4, family, layouts)


def _precision_worker(rank, P):
    from moe_kernels.parallel.parallelize import parallelize

    cfg = PRESETS["tiny-qwen3-moe"](**MODEL)
    cfg = cfg.replace(moe=cfg.moe.replace(weights_in_activation=True))
    par = parallelize(build_model(cfg, device="meta"), ParallelConfig(ep=2), "cpu", seed=SEED,
                      mixed_precision=True)
    seen = {}

    def router_hook(module, args):
        seen.setdefault("router", module.weight.dtype)

    def experts_hook(module, args):
        seen.setdefault("rows", args[2].dtype)
        seen.setdefault("w13", module.w13.dtype)

    layer = next(par.model.moe_layers())
    layer.router.register_forward_pre_hook(router_hook)
    layer.experts.register_forward_pre_hook(experts_hook)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
    par.forward_backward(ids[:, :-1], ids[:, 1:])
    assert seen == {"router": torch.float32, "rows": torch.float32, "w13": torch.bfloat16}, seen
    router = par.model.layers[0].mlp.router.weight
    assert router.dtype == torch.float32 and router.grad.dtype == torch.float32


@pytest.mark.distributed
def test_bf16_policy_keeps_routers_fp32():
    run_world(_precision_worker, 2)


def _refuses_worker(rank, P):
    from moe_kernels.parallel.parallelize import parallelize

    cfg = PRESETS["tiny-qwen3-moe"](**MODEL)
    with pytest.raises(ValueError, match="needs `device=`"):
        parallelize(build_model(cfg, device="meta"), ParallelConfig(), seed=1)
    with pytest.raises(ValueError, match="initialised from `seed=`"):
        parallelize(build_model(cfg, device="meta"), ParallelConfig(), "cpu")
    with pytest.raises(ValueError, match="already holds its weights"):
        parallelize(build_model(cfg, seed=1), ParallelConfig(), seed=1)
    with pytest.raises(ValueError, match="no expert parallelism"):
        parallelize(build_model(cfg, seed=1), ParallelConfig(), capacity=2.0)
    with pytest.raises(ValueError, match="nvlink backend's"):
        parallelize(build_model(cfg, seed=1), ParallelConfig(ep=2), capacity=2.0)


@pytest.mark.distributed
def test_parallelize_checks_meta_arguments():
    run_world(_refuses_worker, 2)
