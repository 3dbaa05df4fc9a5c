"""moe-train's trainer on two gloo ranks: expert-parallel equals data-parallel, full-state checkpoints
(save_full) hold the full model (loadable by one process), a killed expert-parallel run resumes
bit-identically from its sharded checkpoints, and one process resumes from those."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_kernels.parallel import expert_parameters
from moe_kernels.testing import FP32_EPS, assert_norm_close_to_fp64
from moe_kernels.train.trainer import TrainConfig, Trainer, lr_factor
from tests.distributed import run_world

pytestmark = pytest.mark.distributed

COMMON = dict(preset="tiny-qwen3-moe", num_layers=1, steps=6, batch_size=4, seq_len=32, log_every=2, eval_every=3,
              eval_batches=2, checkpoint_every=3, warmup_steps=1, device="cpu")


class _Killed(Exception):
    pass


def _worker(rank, world, tmp: str):
    tmp = Path(tmp)
    results = {}
    for ep in (1, 2):  # data parallel over both ranks; experts split over both ranks
        trainer = Trainer(TrainConfig(**COMMON, out_dir=str(tmp / f"ep{ep}"), expert_parallel=ep, save_full=True),
                          echo=lambda *a: None)
        results[ep] = trainer.train()
        assert trainer.num_parameters() == sum(p.numel() for p in Trainer(TrainConfig(**COMMON, out_dir=str(tmp / "x")),
                                                                           echo=lambda *a: None).model.parameters())

    # Global-batch load balancing: every router counts over both ranks, and training runs.
    glb = Trainer(TrainConfig(**{**COMMON, "steps": 2}, out_dir=str(tmp / "glb"), expert_parallel=2,
                              global_load_balancing=True), echo=lambda *a: None)
    assert all(layer.router.balance_group is not None for layer in glb.model.moe_layers())
    assert glb.train()[-1]["loss"] > 0

    # Killed after step 4 (the step-3 checkpoint is on disk, sharded), resumed by new trainers: the same run.
    cfg = TrainConfig(**COMMON, out_dir=str(tmp / "killed"), expert_parallel=2)
    trainer = Trainer(cfg, echo=lambda *a: None)

    def kill(step):
        if step == 4:
            raise _Killed

    with pytest.raises(_Killed):
        trainer.train(progress=kill)
    assert (tmp / "killed" / "checkpoints" / "step_0000003").is_dir()
    resumed = Trainer(cfg, echo=lambda *a: None)
    assert resumed.resume() and resumed.step == 3
    results["resumed"] = resumed.train()
    if rank == 0:
        (tmp / "records.json").write_text(json.dumps({str(k): v for k, v in results.items()}))


def _first_step_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Filled, by name, with the gradients the trainer's first optimizer step applies (reduced over the
    ranks and clipped)."""
    grads: dict[str, torch.Tensor] = {}

    def hook(optimizer, args, kwargs):
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(hook)
    return grads


def _first_step_gradients64(trainer: Trainer, world: int) -> dict[str, torch.Tensor]:
    """The same in fp64, from a copy of the (data-parallel, untrained) model: each rank's loss on its first
    batch as the trainer computes it, the gradients averaged over the ranks and clipped as the trainer does."""
    model = copy.deepcopy(trainer.model).double()
    inputs, targets = trainer.data.batch(0)
    logits, aux = model(inputs)
    (F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
        g.div_(world)
    norm = float(torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt())
    scale = min(1.0, trainer.cfg.grad_clip / (norm + 1e-6))
    return {n: g * scale for n, g in grads.items()}


def _worker_groups(rank, world, tmp: str):
    # Four ranks, experts split over two groups of two (replicas: ranks {0, 2} and {1, 3}).
    tmp = Path(tmp)
    results, first = {}, {}
    for ep in (1, 2):  # full-state checkpoints without experts split, sharded ones (expert replicas) with
        trainer = Trainer(TrainConfig(**COMMON, out_dir=str(tmp / f"ep{ep}"), expert_parallel=ep, save_full=ep == 1),
                          echo=lambda *a: None)
        if ep == 1:
            exact = _first_step_gradients64(trainer, world)
        first[ep] = _first_step_gradients(trainer)
        results[ep] = trainer.train()
    # Step 1 starts both runs from the same parameters on the same batches: the expert-parallel gradients
    # differ from the data-parallel ones by fp32 summation order alone. Error model: both are fp32 roundings
    # of the same exact (fp64) gradient, so each tensor's L2 error is within 2x the data-parallel one's plus
    # 64 eps_fp32 of its size (moe_kernels.testing.assert_norm_close_to_fp64). A gradient reduced over the
    # wrong ranks, an expert shard's gradient on another's experts or a lost token is off by O(1) instead.
    sharded = {id(p) for p in expert_parameters(trainer.model)}
    for name, p in trainer.model.named_parameters():
        want, base = exact[name], first[1][name]
        if id(p) in sharded:  # this rank's experts of the full tensor
            E = p.shape[0]
            want, base = (t[trainer.par.ep_rank * E : (trainer.par.ep_rank + 1) * E] for t in (want, base))
        assert_norm_close_to_fp64(first[2][name], base, want, f"rank {rank}: step-1 gradient of {name}",
                                  floor=64 * FP32_EPS)
    if rank == 0:
        (tmp / "records.json").write_text(json.dumps({str(k): v for k, v in results.items()}))


def _adamw_drift_bound(cfg: TrainConfig) -> float:
    """How far apart two AdamW runs' parameters can be after cfg.steps steps from the same start, whatever
    their gradients: sum over steps t of 2 lr_t U_t, U_t = max |m_hat_t| / sqrt(v_hat_t) = sqrt(sum_s a_s^2 /
    b_s) by Cauchy-Schwarz (a_s, b_s: the bias-corrected weights of step s's gradient in m_hat_t, v_hat_t).
    Decoupled weight decay only shrinks a difference, Adam's eps only an update."""
    b1, b2, total = cfg.beta1, cfg.beta2, 0.0
    for t in range(1, cfg.steps + 1):
        a = [(1 - b1) * b1 ** (t - s) / (1 - b1**t) for s in range(1, t + 1)]
        b = [(1 - b2) * b2 ** (t - s) / (1 - b2**t) for s in range(1, t + 1)]
        total += 2 * cfg.lr * lr_factor(t - 1, cfg) * math.sqrt(sum(x * x / y for x, y in zip(a, b)))
    return total


def test_expert_parallel_groups_smaller_than_the_world(tmp_path):
    run_world(_worker_groups, 4, str(tmp_path))  # asserts the first step's gradients on every rank
    records = json.loads((tmp_path / "records.json").read_text())
    # After step 1 AdamW amplifies those rounding differences: a parameter whose gradient is rounding noise
    # steps by +-lr with the noise's sign. Such a parameter moves the loss by its gradient (noise-sized) times
    # at most AdamW's drift bound (2 x sum of lr ~ 0.025): n ~ 1e5 parameters x ~1e-9 of gradient noise each
    # x 0.025 is ~3e-6 of a loss of ~5, 5e-7 relative, 200x inside 1e-4 (a parameter whose gradient is not
    # noise moves by lr x noise / gradient, less). The parameters themselves: only AdamW's bound holds for
    # every one of them (a sound bound, not a tight one; the first step's gradients above are the tight check).
    for a, b in zip(records["2"], records["1"]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    # The expert-parallel run's sharded checkpoint (each expert slice held by two replicas) read by one process.
    one = Trainer(TrainConfig(**{**COMMON, "batch_size": 16}, out_dir=str(tmp_path / "ep2")), echo=lambda *a: None)
    assert one.resume() and one.step == 6
    final = [torch.load(tmp_path / "ep1" / "checkpoints" / "step_0000006.pt", weights_only=False)["model"],
             one.model.state_dict()]
    drift = _adamw_drift_bound(TrainConfig(**COMMON))
    for name, t in final[0].items():
        got = final[1][name]
        assert got.shape == t.shape, name
        assert float((got - t).abs().max()) <= drift, f"{name}: {float((got - t).abs().max()):.3g} > {drift:.3g}"


def test_expert_parallel_training(tmp_path):
    run_world(_worker, 2, str(tmp_path))
    records = {k: v for k, v in json.loads((tmp_path / "records.json").read_text()).items()}
    train = {k: [r for r in v if r["kind"] == "train"] for k, v in records.items()}
    evals = {k: [r["loss"] for r in v if r["kind"] == "eval"] for k, v in records.items()}
    # Expert parallelism changes where the experts run, not the math: the same curve as data parallelism.
    assert [r["step"] for r in train["2"]] == [2, 4, 6]
    for a, b in zip(train["2"], train["1"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    assert evals["2"] == pytest.approx(evals["1"], rel=1e-4) and evals["2"][-1] < evals["2"][0]

    # The resumed run logs steps 4 and 6 exactly as the uninterrupted one did.
    assert [r["loss"] for r in train["resumed"]] == [r["loss"] for r in train["2"][1:]]
    assert evals["resumed"][-1] == evals["2"][-1]
    final = torch.load(tmp_path / "ep2" / "checkpoints" / "step_0000006.pt", weights_only=False)
    # The resumed run's last sharded checkpoint, read by one process (batch 8 = 4 x 2 ranks): the same model
    # and optimizer state.
    again = Trainer(TrainConfig(**{**COMMON, "batch_size": 8}, out_dir=str(tmp_path / "killed")), echo=lambda *a: None)
    assert again.resume() and again.step == 6
    for name, t in again.model.state_dict().items():
        assert torch.equal(t, final["model"][name]), name
    saved, names = final["optimizer"]["state"], final["optimizer"]["param_names"]
    for name, p in again.model.named_parameters():
        assert torch.equal(again.optimizer.state[p]["exp_avg_sq"], saved[names.index(name)]["exp_avg_sq"]), name

    # The checkpoint holds the full model: one process loads it and evaluates the same windows (two
    # ranks' eval batches of 4 are one process's batches of 8).
    assert final["model"]["layers.0.mlp.experts.w13"].shape[0] == 8
    single = Trainer(TrainConfig(**{**COMMON, "batch_size": 8}, out_dir=str(tmp_path / "single")), echo=lambda *a: None)
    single.model.load_state_dict(final["model"])
    assert single.evaluate() == pytest.approx(evals["2"][-1], rel=1e-5)
    # Resuming on one process keeps the global batch (8 = 4 x 2 ranks) or says what changed.
    resumed = Trainer(TrainConfig(**{**COMMON, "batch_size": 8}, out_dir=str(tmp_path / "ep2")), echo=lambda *a: None)
    assert resumed.resume() and resumed.step == 6
    with pytest.raises(ValueError, match="global batch"):
        Trainer(TrainConfig(**COMMON, out_dir=str(tmp_path / "ep2")), echo=lambda *a: None).resume()
