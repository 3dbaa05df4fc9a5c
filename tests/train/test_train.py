import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moe_kernels.train import checkpoint
from moe_kernels.train.cli import app
from moe_kernels.train.data import BYTE_VOCAB, TokenData, default_corpus, load_tokens
from moe_kernels.train.trainer import TrainConfig, Trainer, lr_factor

SMALL = dict(preset="tiny-qwen3-moe", num_layers=1, steps=6, batch_size=2, seq_len=32, log_every=2, eval_every=3,
             checkpoint_every=3, warmup_steps=2, eval_batches=1)


def test_corpus_and_batches_are_deterministic(tmp_path):
    text = default_corpus()
    assert len(text) > 500_000 and text.isascii()
    tokens, vocab = load_tokens(None)
    assert vocab == BYTE_VOCAB and tokens.dtype == torch.int64
    data = TokenData(tokens, vocab, seq_len=16, batch_size=4, seed=3)
    x, y = data.batch(7)
    x2, y2 = data.batch(7)
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, data.batch(8)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    np.save(tmp_path / "ids.npy", np.arange(1000) % 37)
    ids, v = load_tokens(tmp_path / "ids.npy")
    assert v == 37 and ids.shape == (1000,)
    with pytest.raises(FileNotFoundError):
        load_tokens(tmp_path / "missing.txt")


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0) and lr_factor(100, cfg) == pytest.approx(0.1)
    assert lr_factor(55, cfg) == pytest.approx(0.55)


def test_resume_is_bit_identical(tmp_path):
    straight = Trainer(TrainConfig(**SMALL, out_dir=str(tmp_path / "a")), echo=lambda *_: None)
    straight.train()
    first = Trainer(TrainConfig(**SMALL, out_dir=str(tmp_path / "b")), echo=lambda *_: None)
    for _ in range(3):
        first.train_step()
    first.save()
    resumed = Trainer(TrainConfig(**SMALL, out_dir=str(tmp_path / "b"), seed=123), echo=lambda *_: None)
    assert resumed.resume()
    assert resumed.step == 3
    resumed.train()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for key in sa:
        assert torch.equal(sa[key]["exp_avg"], sb[key]["exp_avg"])


def test_killed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    trainer = Trainer(TrainConfig(**SMALL, out_dir=str(tmp_path)), echo=lambda *_: None)
    trainer.train_step()
    good = trainer.save()

    def dying_save(obj, f):
        f.write(b"partial checkpoint bytes")
        raise KeyboardInterrupt  # the process is killed mid-write

    trainer.train_step()
    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path / "checkpoints") == good
    again = Trainer(TrainConfig(**SMALL, out_dir=str(tmp_path)), echo=lambda *_: None)
    assert again.resume() and again.step == 1


def test_cli_trains_and_loss_falls(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["--steps", "60", "--batch-size", "8", "--seq-len", "64", "--num-layers", "1",
                                      "--log-every", "10", "--eval-every", "60", "--checkpoint-every", "60",
                                      "--out", str(out), "--lr", "3e-3"])
    assert result.exit_code == 0, result.output
    assert "loss" in result.output and "eval_loss" in result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[0]["loss"] > 4.0  # about ln(256) at the start
    final_eval = [r for r in records if r["kind"] == "eval"][-1]["loss"]
    assert final_eval < train[0]["loss"] - 1.0, (train[0]["loss"], final_eval)
    assert (out / "checkpoints" / "latest").exists()
    for key in ("grad_norm", "tokens_per_s", "tflops", "memory_gib", "lr", "aux_loss"):
        assert key in train[-1]
    # The tokens a step and the optimizer's share of the logged window's time.
    assert all(r["tokens_per_step"] == 8 * 64 for r in train)
    assert all(0 < r["optimizer_share"] < 1 for r in train)
    assert "tok/step 512" in result.output and "optim " in result.output


def test_cli_rejects_bad_options(tmp_path):
    result = CliRunner().invoke(app, ["--preset", "nope", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "preset" in result.output
    result = CliRunner().invoke(app, ["--precision", "fp9", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "precision" in result.output
    # tiny: H = 64, no multiple of 128: the FP8 recipe pads its contractions (needs multiples of 16)
    result = CliRunner().invoke(app, ["--precision", "fp8-blockwise", "--steps", "2", "--batch-size", "2", "--seq-len",
                                      "16", "--num-layers", "1", "--out", str(tmp_path / "fp8")])
    assert result.exit_code == 0, result.output

    result = CliRunner().invoke(app, ["--ep-backend", "mpi", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "unknown ep_backend 'mpi'" in result.output
    result = CliRunner().invoke(app, ["--ep-backend", "nvlink", "--out", str(tmp_path)])  # one process
    assert result.exit_code != 0 and "needs expert_parallel > 1" in result.output


def test_nvlink_backend_refused_on_cpu(tmp_path):
    with pytest.raises(ValueError, match="needs CUDA devices; use ep_backend='all_to_all'"):
        Trainer(TrainConfig(steps=1, warmup_steps=0, expert_parallel=2, ep_backend="nvlink", device="cpu", out_dir=str(tmp_path)))
