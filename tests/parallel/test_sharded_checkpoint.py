"""Sharded (DCP) checkpoints of parallelize()d models on 4 gloo ranks: a run resumed under the same
layout continues bit-identically; under another layout the loaded parameters are bit-identical and the
next steps equal within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.parallel.test_data_parallel import _batch, _loss

pytestmark = pytest.mark.distributed


def _train(layout, steps, first=0, path=None, load=None):
    from moe_kernels.models import PRESETS, build_model
    from moe_kernels.parallel import ParallelConfig, parallelize
    from moe_kernels.parallel.checkpoint import load_sharded, save_sharded

    import torch.distributed as dist

    torch.manual_seed(0 if load is None else 1)  # a resumed run starts from other weights: the load must win
    par = parallelize(build_model(PRESETS["tiny-qwen3-moe"]()), ParallelConfig(**layout))
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-2)
    if load is not None:
        load_sharded(par, opt, load)
    losses = []
    for step in range(first, first + steps):
        loss = _loss(par.model, _batch(step, dist.get_rank(), 256))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if path is not None:
        save_sharded(par, opt, path)
    return par, losses


def _params(par):
    return {n: p.full_tensor() for n, p in par.model.named_parameters()}


def _worker(rank, P, tmp):
    straight, straight_losses = _train(dict(dp_shard=4), 4)
    _train(dict(dp_shard=4), 2, path=f"{tmp}/a")
    same, same_losses = _train(dict(dp_shard=4), 2, first=2, load=f"{tmp}/a")
    for n, p in _params(same).items():
        assert torch.equal(p, _params(straight)[n]), f"rank {rank}: {n} after resuming under the same layout"
    assert all(torch.equal(a, b) for a, b in zip(same_losses, straight_losses[2:]))

    other, other_losses = _train(dict(dp_replicate=2, dp_shard=2), 2, first=2, load=f"{tmp}/a")
    for a, b in zip(other_losses, straight_losses[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: loss after resharding")
    for n, p in _params(other).items():
        torch.testing.assert_close(p, _params(straight)[n], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {n}")

    ep, _ = _train(dict(ep=2), 0)
    from moe_kernels.parallel.checkpoint import save_sharded

    with pytest.raises(NotImplementedError, match="expert-parallel layouts \\(ep=2\\)"):
        save_sharded(ep, None, f"{tmp}/b")
    etp, _ = _train(dict(etp=2), 0)
    with pytest.raises(NotImplementedError, match="expert-tensor-parallel layouts \\(etp=2\\)"):
        save_sharded(etp, None, f"{tmp}/c")


def test_sharded_checkpoint_resumes_and_reshards(tmp_path):
    run_world(_worker, 4, str(tmp_path))
