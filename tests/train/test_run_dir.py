"""The run directory: checkpoint rotation, starting over vs resuming, metrics files, resume settings."""

import json
import re

import pytest
from typer.testing import CliRunner

from moe_kernels.train import checkpoint
from moe_kernels.train.cli import app
from moe_kernels.train.data import default_corpus
from moe_kernels.train.trainer import ResumeMismatchError, TrainConfig, Trainer

TINY = dict(preset="tiny-qwen3-moe", num_layers=1, steps=4, batch_size=2, seq_len=16, log_every=1, eval_every=4,
            checkpoint_every=2, warmup_steps=1, eval_batches=1)
CLI = ["--preset", "tiny-qwen3-moe", "--num-layers", "1", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
       "--warmup-steps", "1", "--log-every", "1", "--eval-every", "4", "--checkpoint-every", "2", "--device", "cpu"]


def quiet(*_):
    pass


def trainer(out, **overrides) -> Trainer:
    return Trainer(TrainConfig(**{**TINY, "device": "cpu", **overrides}, out_dir=str(out)), echo=quiet)


def cli(out, *extra):
    return CliRunner().invoke(app, [*CLI, "--out", str(out), *extra])


def flat(text: str) -> str:
    """The CLI's output without whitespace and panel borders, so that a wrapped path reads whole."""
    return re.sub(r"[\s│╭╮╰╯─]", "", text)


def names(directory):
    return [p.name for p in checkpoint.checkpoints(directory)]


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- rotation ---------------------------------------------------------------------------------------


def test_rotation_keeps_a_new_runs_checkpoint_beside_a_longer_runs(tmp_path):
    long_run = trainer(tmp_path, steps=6, checkpoint_every=3)
    long_run.train()
    assert names(tmp_path / "checkpoints") == ["step_0000003.pt", "step_0000006.pt"]
    new_run = trainer(tmp_path, steps=2, checkpoint_every=2)
    new_run.train()
    written = tmp_path / "checkpoints" / "step_0000002.pt"
    assert written.exists()
    assert checkpoint.latest(tmp_path / "checkpoints") == written
    resumed = trainer(tmp_path, steps=2, checkpoint_every=2)
    assert resumed.resume() and resumed.step == 2


def test_rotation_orders_by_step_number_not_name(tmp_path):
    checkpoint.save(tmp_path, 9_999_999, {}, keep=1)
    path = checkpoint.save(tmp_path, 10_000_000, {}, keep=1)  # "step_10000000.pt" sorts before "step_9999999.pt"
    assert path.exists() and checkpoint.latest(tmp_path) == path
    assert names(tmp_path) == ["step_10000000.pt"]
    assert checkpoint.step_of(path) == 10_000_000 and checkpoint.step_of(tmp_path / "latest") is None


def test_rotation_removes_only_older_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, {"step": step}, keep=2)
    assert names(tmp_path) == ["step_0000003.pt", "step_0000004.pt"]
    checkpoint.save(tmp_path, 9, {}, keep=2)  # a later step, e.g. left by another run
    path = checkpoint.save(tmp_path, 5, {}, keep=2)
    assert names(tmp_path) == ["step_0000004.pt", "step_0000005.pt", "step_0000009.pt"]
    assert checkpoint.latest(tmp_path) == path
    path = checkpoint.save(tmp_path, 6, {}, keep=1)
    assert names(tmp_path) == ["step_0000006.pt", "step_0000009.pt"]


# -- starting over vs resuming ------------------------------------------------------------------------


def test_cli_refuses_to_start_over_in_a_run_directory(tmp_path):
    out = tmp_path / "run"
    assert cli(out).exit_code == 0
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    metrics_before = (out / "metrics.jsonl").read_text()
    result = cli(out, "--steps", "2")
    assert result.exit_code != 0
    message = flat(result.output)
    assert str(out) in message and "--resume" in message and "--overwrite" in message and "--out" in message
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before
    assert (out / "metrics.jsonl").read_text() == metrics_before


def test_cli_overwrite_starts_over(tmp_path):
    out = tmp_path / "run"
    assert cli(out, "--steps", "6", "--checkpoint-every", "3").exit_code == 0
    assert names(out / "checkpoints") == ["step_0000003.pt", "step_0000006.pt"]
    result = cli(out, "--steps", "2", "--overwrite")
    assert result.exit_code == 0, result.output
    assert names(out / "checkpoints") == ["step_0000002.pt"]
    assert checkpoint.latest(out / "checkpoints") == out / "checkpoints" / "step_0000002.pt"
    assert [(r["kind"], r["step"]) for r in records(out)] == [("train", 1), ("train", 2), ("eval", 2)]
    result = cli(out, "--resume")
    assert result.exit_code == 0, result.output
    assert "at step 2" in result.output
    assert [(r["kind"], r["step"]) for r in records(out) if r["kind"] == "train"] == [("train", s) for s in (1, 2, 3, 4)]


def test_cli_overwrite_and_resume_exclude_each_other(tmp_path):
    result = cli(tmp_path / "run", "--resume", "--overwrite")
    assert result.exit_code != 0 and "--overwrite" in result.output and "--resume" in result.output


def test_resume_with_a_broken_latest_pointer_is_an_error(tmp_path):
    out = tmp_path / "run"
    trainer(out).train()
    (out / "checkpoints" / "latest").write_text("step_0000001.pt")  # names a file that is not there
    with pytest.raises(FileNotFoundError, match="step_0000004.pt"):
        trainer(out).resume()
    result = cli(out, "--resume")
    assert result.exit_code != 0 and "latest" in result.output


# -- metrics ------------------------------------------------------------------------------------------


def test_a_new_run_starts_a_new_metrics_file(tmp_path):
    trainer(tmp_path, steps=3).train()
    trainer(tmp_path, steps=2, seed=1).train()
    steps = [(r["kind"], r["step"]) for r in records(tmp_path)]
    assert steps == [("train", 1), ("train", 2), ("eval", 2)]


def test_a_resumed_run_continues_the_metrics_without_repeating_steps(tmp_path):
    straight = tmp_path / "straight"
    trainer(straight).train()
    out = tmp_path / "crashed"
    trainer(out).train()
    # A crash after step 4 was logged but before its checkpoint was written: the run resumes at step 2.
    (out / "checkpoints" / "step_0000004.pt").unlink()
    (out / "checkpoints" / "latest").write_text("step_0000002.pt")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a torn last line
    resumed = trainer(out)
    assert resumed.resume() and resumed.step == 2
    resumed.train()
    key = [(r["kind"], r["step"], r["loss"]) for r in records(out)]
    assert key == [(r["kind"], r["step"], r["loss"]) for r in records(straight)]  # resume is bit-identical


# -- resume settings ----------------------------------------------------------------------------------


def test_cli_resume_with_other_settings_is_an_error(tmp_path):
    out = tmp_path / "run"
    assert cli(out).exit_code == 0
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    result = cli(out, "--resume", "--batch-size", "3", "--seq-len", "8", "--steps", "8", "--log-every", "2")
    assert result.exit_code != 0
    message = flat(result.output)
    assert "globalbatch" in message and "seq_len" in message
    assert "steps:" not in message and "log_every" not in message
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before
    # The run's length, logging and the like may change.
    result = cli(out, "--resume", "--steps", "6", "--log-every", "2", "--eval-every", "3")
    assert result.exit_code == 0, result.output
    assert "at step 4" in result.output and checkpoint.step_of(checkpoint.latest(out / "checkpoints")) == 6


def test_resume_compares_model_and_data_settings(tmp_path):
    text = default_corpus()[:4000]
    (tmp_path / "a.txt").write_bytes(text)
    (tmp_path / "moved.txt").write_bytes(text)
    (tmp_path / "other.txt").write_bytes(text[::-1])
    out = tmp_path / "run"
    first = trainer(out, data=str(tmp_path / "a.txt"))
    first.train_step()
    first.save()
    with pytest.raises(ResumeMismatchError) as info:
        trainer(out, data=str(tmp_path / "other.txt"), num_layers=2, lr=1e-3, steps=9, log_every=3).resume()
    assert set(info.value.differences) == {"data", "num_layers", "lr"}
    assert "other.txt" in str(info.value) and "num_layers" in str(info.value)
    with pytest.raises(ResumeMismatchError, match="preset"):
        trainer(out, data=str(tmp_path / "a.txt"), preset="tiny-mixtral").resume()
    with pytest.raises(ResumeMismatchError, match="data"):
        trainer(out).resume()  # the embedded corpus
    moved = trainer(out, data=str(tmp_path / "moved.txt"))  # the same tokens under another path
    assert moved.resume() and moved.step == 1


def test_dropped_tokens_are_logged(tmp_path):
    """A dispatcher with a capacity (the nvlink backend's) reports its dropped token copies: the trainer sums
    them over the layers into the log record and its line; without one the record has no such field."""
    from moe_kernels.train.metrics import format_line

    t = trainer(tmp_path)
    assert t.dropped_tokens() is None

    class Counting:  # what the trainer reads of an NvlinkDispatcher
        def __init__(self, n):
            self.n = n

        def dropped_tokens(self):
            n, self.n = self.n, 0
            return n

    layers = list(t.model.moe_layers())
    for i, layer in enumerate(layers):
        layer.dispatcher = Counting(3 + i)
    assert t.dropped_tokens() == sum(3 + i for i in range(len(layers))) and t.dropped_tokens() == 0
    line = format_line({"step": 1, "loss": 1.0, "aux_loss": 0.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0,
                        "tflops": 0.0, "mfu": None, "memory_gib": 0.0, "dropped_tokens": 1234})
    assert line.endswith("dropped 1,234")
