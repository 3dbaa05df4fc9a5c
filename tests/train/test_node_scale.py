"""moe-train's trainer on a 200 MB (fp32) model under 4 gloo ranks (experts EP 2 x FSDP 2, the rest FSDP 4):
no rank ever holds the model. Each rank's peak resident memory grows, while the trainer builds, shards and
initialises the model, by less than half the model's fp32 bytes (the full model was built on every rank
before), and while it trains, saves a sharded checkpoint and resumes from it, by less than half of one
process's training footprint (fp32 parameters, gradients and AdamW's two states: 16 bytes a parameter).

The ranks run with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so a large block freed
goes back to the system and resident memory follows what the tensors hold (with the default, growing
threshold, freed all-gather buffers stay in the heap and count as resident)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

from moe_kernels.models import PRESETS
from tests.distributed import run_world

pytestmark = pytest.mark.distributed

PRESET = "scale-test-qwen3-moe"
# 4 layers of 32 experts of ffn 512 over hidden 256: 50.6 M parameters, 202 MB in fp32.
SIZE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=32, ffn_size=512, num_layers=4)
PRESETS.setdefault(PRESET, lambda **overrides: PRESETS["tiny-qwen3-moe"](**{**SIZE, **overrides}))

COMMON = dict(preset=PRESET, steps=2, batch_size=2, seq_len=32, log_every=1, eval_every=100, eval_batches=1,
              checkpoint_every=2, warmup_steps=1, device="cpu", expert_parallel=2, dp_shard=4)


def _rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0). Where the kernel refuses, the peak stays the process's own since it
    started: a fresh rank's imports only grow it, so it is then within a little of the current size."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _worker(rank, world, tmp: str):
    from moe_kernels.train.trainer import TrainConfig, Trainer

    tmp = Path(tmp)
    growth = {}
    _reset_peak()
    start = _rss()[0]
    trainer = Trainer(TrainConfig(**COMMON, out_dir=str(tmp / "run")), echo=lambda *a: None)
    growth["build"] = _rss()[1] - start
    records = trainer.train()
    growth["train"] = _rss()[1] - start
    params = trainer.num_parameters()
    local = sum(p.to_local().numel() for p in trainer.model.parameters())
    del trainer
    gc.collect()
    resumed = Trainer(TrainConfig(**{**COMMON, "steps": 3}, out_dir=str(tmp / "run")), echo=lambda *a: None)
    assert resumed.resume() and resumed.step == 2
    again = resumed.train()
    growth["resume"] = _rss()[1] - start
    (tmp / f"rank{rank}.json").write_text(json.dumps({
        "growth": growth, "params": params, "local": local,
        "loss": [r["loss"] for r in records if r["kind"] == "train"],
        "again": [r["loss"] for r in again if r["kind"] == "train"],
    }))


def test_a_200mb_model_never_whole_on_a_rank(tmp_path):
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by each spawned rank's C library at start
    try:
        run_world(_worker, 4, str(tmp_path), fresh=True)
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        model_bytes = 4 * r["params"]
        assert 180e6 < model_bytes < 300e6
        assert r["local"] <= r["params"] / 4 + 1e5  # a quarter of every parameter (FSDP rounds shards up)
        g = r["growth"]
        assert g["build"] < model_bytes / 2, (rank, g, model_bytes)
        assert max(g["train"], g["resume"]) < 16 * r["params"] / 2, (rank, g, 16 * r["params"])
        assert len(r["loss"]) == 2 and len(r["again"]) == 1 and r["again"][0] > 0
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()
    assert (tmp_path / "run" / "checkpoints" / "step_0000003").is_dir()
