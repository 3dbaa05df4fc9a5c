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

    # Split layouts: attention TP 2 x FSDP 2 with experts EP 2 x ETP 2, CP 2 x FSDP 2 with experts EP 4, and
    # pipeline stages (PP 2, each FSDP 2 with experts EP 2).
    _split_layouts(rank, tmp, dict(tp=2, ep=2, etp=2), dict(cp=2, ep=4), dict(pp=2, ep=2))


MODEL = dict(num_experts=8, num_layers=2)


def _split_par(layout, seed, model=MODEL):
    from moe_kernels.models import PRESETS, build_model
    from moe_kernels.parallel import ParallelConfig, parallelize

    torch.manual_seed(seed)
    # With pp: one micro-batch a step, the objective of the layouts without pipeline stages.
    pipeline = dict(num_microbatches=1, schedule="gpipe") if layout.get("pp", 1) > 1 else {}
    par = parallelize(build_model(PRESETS["tiny-qwen3-moe"](**model)), ParallelConfig(**layout), **pipeline)
    return par, torch.optim.AdamW(par.model.parameters(), lr=1e-2)


def _split_steps(par, opt, first, steps):
    import torch.distributed as dist

    losses = []
    for step in range(first, first + steps):
        stage_rank = dist.get_rank() % (dist.get_world_size() // par.layout.pp)
        ids = _batch(step, stage_rank // (par.layout.cp * par.layout.tp), par.model.config.vocab_size)
        ce, aux = par.forward_backward(ids[:, :-1], ids[:, 1:])
        opt.step()
        opt.zero_grad()
        losses.append(ce + aux)
    return losses


def _step_mean(loss):
    """The step's loss: the mean over the ranks of their batches' losses (the layouts map ranks to batches
    differently)."""
    import torch.distributed as dist

    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


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


def _split_layouts(rank, tmp, A, B, C=None, model=MODEL):
    """Saved under layout A, loaded under A and under B (both train on 2 batches a step, so B's first step
    after loading A's checkpoint equals A's); then under C, which saves it again for A."""
    from moe_kernels.parallel.checkpoint import load_sharded, save_sharded

    par, opt = _split_par(A, 0, model)
    _split_steps(par, opt, 0, 2)
    save_sharded(par, opt, f"{tmp}/split")
    saved = par.full_state(opt)
    straight = _split_steps(par, opt, 2, 2)
    final = par.full_state(opt)
    if rank == 0:
        torch.save(saved[0], f"{tmp}/split_model.pt")

    # The same layout, from other weights: the loaded state is the saved one and the run continues bit for bit.
    same, same_opt = _split_par(A, 1, model)
    load_sharded(same, same_opt, f"{tmp}/split")
    _same(same.full_state(same_opt), saved, f"rank {rank}: loaded under {A}")
    assert all(torch.equal(a, b) for a, b in zip(_split_steps(same, same_opt, 2, 2), straight)), f"rank {rank}"
    _same(same.full_state(same_opt), final, f"rank {rank}: resumed under {A}")

    # Another layout: e.g. the experts resharded from 2 ep x 2 etp pieces to 4 ep ranks, the tp slices joined.
    other, other_opt = _split_par(B, 1, model)
    load_sharded(other, other_opt, f"{tmp}/split")
    _same(other.full_state(other_opt), saved, f"rank {rank}: loaded under {B}")
    torch.testing.assert_close(_step_mean(_split_steps(other, other_opt, 2, 1)[0]), _step_mean(straight[0]),
                               rtol=1e-5, atol=1e-6, msg=f"rank {rank}: the first loss after resharding to {B}")
    if C is None:
        return
    # C loads A's checkpoint and saves its own, which A loads back: both bit for bit.
    third, third_opt = _split_par(C, 1, model)
    load_sharded(third, third_opt, f"{tmp}/split")
    _same(third.full_state(third_opt), saved, f"rank {rank}: loaded under {C}")
    torch.testing.assert_close(_step_mean(_split_steps(third, third_opt, 2, 1)[0]), _step_mean(straight[0]),
                               rtol=1e-5, atol=1e-6, msg=f"rank {rank}: the first loss after resharding to {C}")
    third, third_opt = _split_par(C, 1, model)
    load_sharded(third, third_opt, f"{tmp}/split")
    save_sharded(third, third_opt, f"{tmp}/split_c")
    back, back_opt = _split_par(A, 2, model)
    load_sharded(back, back_opt, f"{tmp}/split_c")
    _same(back.full_state(back_opt), saved, f"rank {rank}: saved under {C}, loaded under {A}")
    # And under C itself: the optimizer's settings survive (each stage keeps its own parameter lists).
    again, again_opt = _split_par(C, 3, model)
    load_sharded(again, again_opt, f"{tmp}/split_c")
    _same(again.full_state(again_opt), saved, f"rank {rank}: saved and loaded under {C}")
    assert again_opt.param_groups[0]["betas"] == (0.9, 0.999) and again_opt.param_groups[0]["lr"] == 1e-2
    torch.testing.assert_close(_step_mean(_split_steps(again, again_opt, 2, 1)[0]), _step_mean(straight[0]),
                               rtol=1e-5, atol=1e-6, msg=f"rank {rank}: the first loss after loading under {C}")


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


def _worker_squared_relu_etp(rank, P, tmp):
    # Experts without a gate split by etp (each rank the rows of its slice of w13, the columns of w2), saved and
    # resharded to experts split over 4 ep ranks: the full state bit for bit, the run continuing.
    _split_layouts(rank, tmp, dict(tp=2, ep=2, etp=2), dict(cp=2, ep=4), model=dict(MODEL, activation="squared_relu"))


def test_sharded_checkpoint_of_squared_relu_experts_split_by_etp(tmp_path):
    run_world(_worker_squared_relu_etp, 4, str(tmp_path))
