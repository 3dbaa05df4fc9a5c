"""Sharded checkpoints are written atomically (a temporary directory renamed into place once every rank has
written), and the run directory rotates, points at and clears them as it does full-state files."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel import checkpoint as sharded
from moe_kernels.train import checkpoint


def _model(seed: int):
    return build_model(PRESETS["tiny-qwen3-moe"](num_layers=1), seed=seed)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "step_0000002"
    sharded.save_sharded(_model(1), None, path, extra={"step": 2})
    assert sharded.load_extra(path) == {"step": 2} and not (tmp_path / "step_0000002.tmp").exists()

    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def crash(state, checkpoint_id):  # some shards written, then the process dies
        real({"model": {k: v for k, v in list(state["model"].items())[:2]}}, checkpoint_id=checkpoint_id)
        raise RuntimeError("killed")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed"):
        sharded.save_sharded(_model(2), None, path, extra={"step": 2})
    monkeypatch.setattr(dcp, "save", real)
    assert (tmp_path / "step_0000002.tmp").is_dir()  # the interrupted write, beside the intact checkpoint
    loaded = _model(3)
    sharded.load_sharded(loaded, None, path)
    for (name, a), b in zip(_model(1).state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name  # the first save's values, none of the second's
    # A re-save replaces the directory whole and clears what the interrupted one left.
    sharded.save_sharded(_model(2), None, path, extra={"step": 2, "again": True})
    assert sharded.load_extra(path)["again"] and not (tmp_path / "step_0000002.tmp").exists()
    sharded.load_sharded(loaded, None, path)
    assert torch.equal(loaded.layers[0].mlp.experts.w13, _model(2).layers[0].mlp.experts.w13)


def test_run_directory_rotates_sharded_checkpoints(tmp_path):
    for step in (2, 4, 6):
        sharded.save_sharded(_model(step), None, tmp_path / f"step_{step:07d}")
        checkpoint.point_latest(tmp_path, tmp_path / f"step_{step:07d}", keep=2)
    (tmp_path / "step_0000008.tmp").mkdir()  # an interrupted save
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_0000004", "step_0000006"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_0000006"
    assert checkpoint.is_sharded(checkpoint.latest(tmp_path)) and checkpoint.step_of("step_0000006") == 6
    checkpoint.clear(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_one_process_run_resumes_from_a_sharded_checkpoint(tmp_path):
    """A run's sharded checkpoint (what moe-train writes under torchrun) resumes a one-process trainer."""
    from moe_kernels.train.trainer import TrainConfig, Trainer

    cfg = dict(preset="tiny-qwen3-moe", num_layers=1, steps=2, batch_size=2, seq_len=16, log_every=1, eval_every=4,
               checkpoint_every=2, warmup_steps=1, eval_batches=1, device="cpu")
    first = Trainer(TrainConfig(**cfg, out_dir=str(tmp_path / "a")), echo=lambda *a: None)
    first.train()
    path = tmp_path / "a" / "checkpoints" / "step_0000002"
    sharded.save_sharded(first.model, first.optimizer, path, extra=first._run_state())
    checkpoint.point_latest(path.parent, path)
    again = Trainer(TrainConfig(**{**cfg, "steps": 3}, out_dir=str(tmp_path / "a")), echo=lambda *a: None)
    assert again.resume() and again.step == 2
    for (name, a), b in zip(first.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), name
    p0 = next(first.model.parameters())
    p1 = next(again.model.parameters())
    assert torch.equal(first.optimizer.state[p0]["exp_avg"], again.optimizer.state[p1]["exp_avg"])
