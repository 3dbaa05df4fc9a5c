"""moe-train's trainer on a parallelize() layout, 4 gloo ranks: attention TP 2 x FSDP 2 with experts EP 2 x
ETP 2. Its first loss equals the data-parallel run's on the same global batch, a run resumed from its
sharded checkpoint continues bit-identically, and one process loads that checkpoint (resharded) and
evaluates to the loss the layout logged. With pipeline stages, full-state checkpoints (save_full): the
same checks, and the file holds the unsplit model and optimizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_kernels.train.trainer import TrainConfig, Trainer
from tests.distributed import run_world

pytestmark = pytest.mark.distributed

COMMON = dict(preset="tiny-qwen3-moe", num_layers=1, steps=4, seq_len=32, log_every=1, eval_every=2, eval_batches=2,
              checkpoint_every=2, warmup_steps=1, device="cpu")
LAYOUT = dict(tp=2, expert_parallel=2, etp=2)  # dp_shard: the 2 the world leaves


def _quiet(*args, **kwargs):
    pass


def _worker(rank, world, tmp: str):
    tmp = Path(tmp)
    # The same 8 sequences a step: 2 on each of 4 data-parallel ranks, or 4 on each of the layout's 2 batches.
    dp = Trainer(TrainConfig(**{**COMMON, "steps": 1}, batch_size=2, out_dir=str(tmp / "dp")), echo=_quiet).train()
    cfg = TrainConfig(**COMMON, **LAYOUT, batch_size=4, out_dir=str(tmp / "layout"))
    trainer = Trainer(cfg, echo=_quiet)
    assert trainer.data.world == 2 and trainer.data.rank == rank // 2
    assert trainer.num_parameters() == Trainer(TrainConfig(**{**COMMON, "steps": 1}, batch_size=2,
                                                           out_dir=str(tmp / "x")), echo=_quiet).num_parameters()
    straight = trainer.train()
    # A full state dict of another shape is refused on every rank before anything is loaded.
    from moe_kernels.models import build_model

    full = build_model(trainer.model_config).state_dict()
    full["layers.0.mlp.experts.w2"] = full["layers.0.mlp.experts.w2"][..., :-1]
    before = trainer.model.state_dict()["layers.0.input_layernorm.weight"].full_tensor().clone()
    with pytest.raises(ValueError, match="layers.0.mlp.experts.w2 has shape .* this layout's model needs"):
        trainer.parallelized.load_full_state(full)
    after = trainer.model.state_dict()["layers.0.input_layernorm.weight"].full_tensor()
    assert after.equal(before)
    resumed = Trainer(cfg, echo=_quiet)
    assert (tmp / "layout" / "checkpoints" / "step_0000002").is_dir()  # sharded: every rank wrote its shards
    assert resumed.resume(tmp / "layout" / "checkpoints" / "step_0000002") and resumed.step == 2
    again = resumed.train()
    # The command line on the same layout (the group exists already, as under torchrun).
    from typer.testing import CliRunner

    from moe_kernels.train.cli import app

    r = CliRunner().invoke(app, ["--tp", "2", "--ep", "2", "--etp", "2", "--steps", "2", "--batch-size", "4",
                                 "--seq-len", "32", "--num-layers", "1", "--device", "cpu", "--log-every", "1",
                                 "--out", str(tmp / "cli"), "--export-hf", str(tmp / "cli_hf"), "--save-full",
                                 "--pg-timeout", "5"])
    assert r.exit_code == 0, r.output
    if rank == 0:
        assert "dp_shard 2 x cp 1 x tp 2; experts pp 1 x edp 1 x ep 2 x etp 2" in r.output and "done: eval loss" in r.output
        assert f"wrote a transformers checkpoint to {tmp / 'cli_hf'}" in r.output
        (tmp / "records.json").write_text(json.dumps({"dp": dp, "straight": straight, "resumed": again}))


def _check_run(tmp_path: Path, run: str, common: dict, last: str) -> Trainer:
    """The records a worker left: step 1's cross-entropy equals the data-parallel run's (the same weights and
    8 sequences, to fp32 rounding), the loss falls, the run resumed from its step-2 checkpoint continues
    bit-identically, and one process loading the last checkpoint (the unsplit model's names and shapes, and
    the optimizer's) evaluates the same validation windows (batch 8) to the loss the run logged. Returns that
    one-process trainer."""
    records = json.loads((tmp_path / "records.json").read_text())
    train = [r for r in records["straight"] if r["kind"] == "train"]
    assert train[0]["loss"] == pytest.approx(records["dp"][0]["loss"], rel=1e-5)
    assert train[-1]["loss"] < train[0]["loss"]
    after = [r for r in records["straight"] if r["step"] > 2]
    assert [(r["kind"], r["step"], r["loss"]) for r in records["resumed"]] == \
        [(r["kind"], r["step"], r["loss"]) for r in after]
    one = Trainer(TrainConfig(**common, batch_size=8, out_dir=str(tmp_path / "one")), echo=_quiet)
    assert one.resume(tmp_path / run / "checkpoints" / last) and one.step == 4
    final_eval = [r for r in records["straight"] if r["kind"] == "eval"][-1]
    assert one.evaluate() == pytest.approx(final_eval["loss"], rel=1e-5)
    return one


def test_trainer_on_a_folded_layout(tmp_path):
    run_world(_worker, 4, str(tmp_path))
    # (The aux losses differ from the data-parallel run's: each rank's routers count its own batch's tokens.)
    _check_run(tmp_path, "layout", COMMON, "step_0000004")  # one process reads the sharded checkpoint
    # The command line's --export-hf: the layout's final model as a transformers checkpoint.
    _same_as_hf(tmp_path / "cli" / "checkpoints" / "step_0000002.pt", tmp_path / "cli_hf")


def _same_as_hf(checkpoint_path, hf_dir):
    from moe_kernels.models import load_hf_checkpoint
    from moe_kernels.train import checkpoint

    want = checkpoint.load(checkpoint_path)["model"]
    got = load_hf_checkpoint(hf_dir).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# Pipeline stages: 2 stages of 1 layer, each TP 2 with experts EP 2; the step's 8 sequences in 2 micro-batches.
PP_COMMON = {**COMMON, "num_layers": 2}
PP_LAYOUT = dict(pp=2, tp=2, expert_parallel=2, microbatches=2)


def _pp_worker(rank, world, tmp: str):
    tmp = Path(tmp)
    dp = Trainer(TrainConfig(**{**PP_COMMON, "steps": 1}, batch_size=2, out_dir=str(tmp / "dp")), echo=_quiet).train()
    cfg = TrainConfig(**PP_COMMON, **PP_LAYOUT, batch_size=8, out_dir=str(tmp / "pp"), save_full=True)
    trainer = Trainer(cfg, echo=_quiet)
    assert trainer.data.world == 1 and trainer.data.rank == 0
    straight = trainer.train()
    trainer.export_hf(tmp / "pp_hf")  # gathered from the stages
    resumed = Trainer(cfg, echo=_quiet)
    assert resumed.resume(tmp / "pp" / "checkpoints" / "step_0000002.pt") and resumed.step == 2
    again = resumed.train()
    if rank == 0:
        (tmp / "records.json").write_text(json.dumps({"dp": dp, "straight": straight, "resumed": again}))


def test_trainer_with_pipeline_stages(tmp_path):
    run_world(_pp_worker, 4, str(tmp_path))
    # (The aux losses are the micro-batches' mean. The checkpoints: each stage's first rank gathers its part,
    # rank 0 merges them; resuming, every stage cuts its pieces back out, optimizer entries found by name.)
    one = _check_run(tmp_path, "pp", PP_COMMON, "step_0000004.pt")
    # The merged optimizer state is indexed as the one-process optimizer indexes its parameters.
    from moe_kernels.parallel.full_state import optimizer_names
    from moe_kernels.train import checkpoint

    saved = checkpoint.load(tmp_path / "pp" / "checkpoints" / "step_0000004.pt")["optimizer"]
    assert saved["param_names"] == optimizer_names(one.model, one.optimizer)
    params = [p for g in one.optimizer.param_groups for p in g["params"]]
    assert [len(g["params"]) for g in saved["param_groups"]] == [len(g["params"]) for g in one.optimizer.param_groups]
    assert sorted(saved["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        assert saved["state"][i]["exp_avg"].shape == p.shape
    _same_as_hf(tmp_path / "pp" / "checkpoints" / "step_0000004.pt", tmp_path / "pp_hf")
