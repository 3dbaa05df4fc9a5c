"""Sharded (DCP) checkpoints of parallelize()d models on 4 gloo ranks: a run resumed under the same
layout continues bit-identically; under another layout the loaded parameters and optimizer states are
bit-identical and the next steps equal within fp32 rounding. FSDP 4 -> HSDP 2 x 2, and TP 2 x FSDP 2 with
experts EP 2 x ETP 2 -> CP 2 x FSDP 2 with experts EP 4 -> one process."""

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

    # Split layouts: attention TP 2 x FSDP 2 with experts EP 2 x ETP 2, and CP 2 x FSDP 2 with experts EP 4.
    _split_layouts(rank, tmp, dict(tp=2, ep=2, etp=2), dict(cp=2, ep=4))


MODEL = dict(num_experts=8, num_layers=1)


def _split_par(layout, seed):
    from moe_kernels.models import PRESETS, build_model
    from moe_kernels.parallel import ParallelConfig, parallelize

    torch.manual_seed(seed)
    par = parallelize(build_model(PRESETS["tiny-qwen3-moe"](**MODEL)), ParallelConfig(**layout))
    return par, torch.optim.AdamW(par.model.parameters(), lr=1e-2)


def _split_steps(par, opt, first, steps):
    import torch.distributed as dist

    losses = []
    for step in range(first, first + steps):
        ids = _batch(step, dist.get_rank() // (par.layout.cp * par.layout.tp), par.model.config.vocab_size)
        logits, aux = par.model(ids[:, :-1])
        share = par.cross_entropy(logits, ids[:, 1:]) + aux
        share.backward()
        opt.step()
        opt.zero_grad()
        losses.append(par.batch_loss(share))
    return losses


def _same(got, want, what):
    """Full (one-process) state dicts, bit for bit (None on ranks other than 0)."""
    if want is None:
        return
    (gm, go), (wm, wo) = got, want
    assert gm.keys() == wm.keys(), what
    for k in wm:
        assert torch.equal(gm[k], wm[k]), f"{what}: {k}"
    if wo is not None:
        assert go["state"].keys() == wo["state"].keys(), what
        for i, entry in wo["state"].items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(go["state"][i][k]), torch.as_tensor(v)), f"{what}: state {i} {k}"


def _split_layouts(rank, tmp, A, B):
    """Saved under layout A, loaded under A and under B (both train on 2 batches a step, so B's first step
    after loading A's checkpoint equals A's)."""
    from moe_kernels.parallel.checkpoint import load_sharded, save_sharded

    par, opt = _split_par(A, 0)
    _split_steps(par, opt, 0, 2)
    save_sharded(par, opt, f"{tmp}/split")
    saved = par.full_state(opt)
    straight = _split_steps(par, opt, 2, 2)
    final = par.full_state(opt)
    if rank == 0:
        torch.save(saved[0], f"{tmp}/split_model.pt")

    # The same layout, from other weights: the loaded state is the saved one and the run continues bit for bit.
    same, same_opt = _split_par(A, 1)
    load_sharded(same, same_opt, f"{tmp}/split")
    _same(same.full_state(same_opt), saved, f"rank {rank}: loaded under {A}")
    assert all(torch.equal(a, b) for a, b in zip(_split_steps(same, same_opt, 2, 2), straight)), f"rank {rank}"
    _same(same.full_state(same_opt), final, f"rank {rank}: resumed under {A}")

    # Another layout: e.g. the experts resharded from 2 ep x 2 etp pieces to 4 ep ranks, the tp slices joined.
    other, other_opt = _split_par(B, 1)
    load_sharded(other, other_opt, f"{tmp}/split")
    _same(other.full_state(other_opt), saved, f"rank {rank}: loaded under {B}")
    torch.testing.assert_close(_split_steps(other, other_opt, 2, 1)[0], straight[0], rtol=1e-5, atol=1e-6,
                               msg=f"rank {rank}: the first loss after resharding to {B}")


def test_sharded_checkpoint_resumes_and_reshards(tmp_path):
    run_world(_worker, 4, str(tmp_path))
    # One process, no process group: the full model, as the layout saved it.
    from moe_kernels.models import PRESETS, build_model
    from moe_kernels.parallel.checkpoint import load_sharded

    model = build_model(PRESETS["tiny-qwen3-moe"](**MODEL))
    load_sharded(model, None, tmp_path / "split")
    want = torch.load(tmp_path / "split_model.pt")
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _worker_hsdp_tp(rank, P, tmp):
    # The tp slices HSDP-sharded (replicated over dp_replicate), loaded as experts split by etp under TP 2 x FSDP 2.
    _split_layouts(rank, tmp, dict(dp_replicate=2, tp=2), dict(tp=2, etp=2))


@pytest.mark.extended
def test_sharded_checkpoint_of_hsdp_tensor_parallel(tmp_path):
    run_world(_worker_hsdp_tp, 4, str(tmp_path))
