"""moe-train's trainer on two gloo ranks: expert-parallel equals data-parallel, checkpoints hold the full
model (loadable by one process), and a killed expert-parallel run resumes bit-identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_kernels.train.trainer import TrainConfig, Trainer
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
        trainer = Trainer(TrainConfig(**COMMON, out_dir=str(tmp / f"ep{ep}"), expert_parallel=ep), echo=lambda *a: None)
        results[ep] = trainer.train()
        assert trainer.num_parameters() == sum(p.numel() for p in Trainer(TrainConfig(**COMMON, out_dir=str(tmp / "x")),
                                                                           echo=lambda *a: None).model.parameters())

    # Global-batch load balancing: every router counts over both ranks, and training runs.
    glb = Trainer(TrainConfig(**{**COMMON, "steps": 2}, out_dir=str(tmp / "glb"), expert_parallel=2,
                              global_load_balancing=True), echo=lambda *a: None)
    assert all(layer.router.balance_group is not None for layer in glb.model.moe_layers())
    assert glb.train()[-1]["loss"] > 0

    # Killed after step 4 (the step-3 checkpoint is on disk), resumed by new trainers: the same run.
    cfg = TrainConfig(**COMMON, out_dir=str(tmp / "killed"), expert_parallel=2)
    trainer = Trainer(cfg, echo=lambda *a: None)

    def kill(step):
        if step == 4:
            raise _Killed

    with pytest.raises(_Killed):
        trainer.train(progress=kill)
    resumed = Trainer(cfg, echo=lambda *a: None)
    assert resumed.resume() and resumed.step == 3
    results["resumed"] = resumed.train()
    if rank == 0:
        (tmp / "records.json").write_text(json.dumps({str(k): v for k, v in results.items()}))


def _worker_groups(rank, world, tmp: str):
    # Four ranks, experts split over two groups of two (replicas: ranks {0, 2} and {1, 3}).
    tmp = Path(tmp)
    results = {}
    for ep in (1, 2):
        trainer = Trainer(TrainConfig(**COMMON, out_dir=str(tmp / f"ep{ep}"), expert_parallel=ep), echo=lambda *a: None)
        results[ep] = trainer.train()
    if rank == 0:
        (tmp / "records.json").write_text(json.dumps({str(k): v for k, v in results.items()}))


def test_expert_parallel_groups_smaller_than_the_world(tmp_path):
    run_world(_worker_groups, 4, str(tmp_path))
    records = json.loads((tmp_path / "records.json").read_text())
    for a, b in zip(records["2"], records["1"]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    final = [torch.load(tmp_path / f"ep{ep}" / "checkpoints" / "step_0000006.pt", weights_only=False) for ep in (1, 2)]
    for name, t in final[0]["model"].items():
        torch.testing.assert_close(final[1]["model"][name], t, rtol=1e-4, atol=1e-5, msg=name)


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
    again = torch.load(tmp_path / "killed" / "checkpoints" / "step_0000006.pt", weights_only=False)
    for name, t in final["model"].items():
        assert torch.equal(t, again["model"][name]), name

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
