"""Parallel layouts (ParallelConfig) and the per-GPU memory plan of `moe-train --plan`."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.layout import ParallelConfig
from moe_kernels.parallel.plan import RESERVE, plan_memory
from moe_kernels.train.cli import app


def test_layout_resolution_and_folding():
    pc = ParallelConfig(tp=2, ep=8).resolve()  # the fewest ranks: ep * etp must divide dp_shard * cp * tp
    assert (pc.world_size, pc.dp_shard, pc.edp, pc.expert_shard) == (8, 4, 1, 1)
    pc = ParallelConfig(tp=2, cp=2, ep=2, etp=2, dp_replicate=2).resolve(32)
    assert (pc.dp_shard, pc.edp, pc.expert_shard) == (4, 8, 4)
    assert ParallelConfig(pp=2, ep=4).smallest_world() == 8
    with pytest.raises(ValueError, match=r"ep\*etp = 8\*1 = 8 must divide dp_shard\*cp\*tp = 2\*1\*2 = 4"):
        ParallelConfig(tp=2, ep=8).resolve(4)
    with pytest.raises(ValueError, match="world size 6 is not a multiple of pp\\*dp_replicate\\*cp\\*tp = 1\\*1\\*1\\*4 = 4"):
        ParallelConfig(tp=4).resolve(6)
    with pytest.raises(ValueError, match="= 8 ranks, but the world has 16"):
        ParallelConfig(dp_shard=4, tp=2).resolve(16)
    with pytest.raises(ValueError, match="tp must be an int >= 1, got 0"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="ep=3 must divide the 8 experts"):
        ParallelConfig(ep=3).resolve(3).check_model(PRESETS["tiny-qwen3-moe"](), 128)
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
        ParallelConfig(cp=2).resolve(2).check_model(PRESETS["tiny-qwen3-moe"](), 126)


def _param_count(cfg, pred=lambda name: True) -> int:
    with torch.device("meta"):
        m = build_model(cfg)
    return sum(p.numel() for n, p in m.named_parameters() if pred(n))


def test_plan_shards_parameters_as_the_layout_says():
    cfg = PRESETS["tiny-qwen3-moe"]()
    n = _param_count(cfg)
    experts = _param_count(cfg, lambda name: ".experts." in name)
    one = plan_memory(cfg, ParallelConfig().resolve(1), batch_size=2, seq_len=64)
    assert one.params == 4 * n and one.grads == 4 * n and one.optimizer == 8 * n  # fp32 + fp32 + AdamW
    # dp_shard 2 with ep 2: experts split by ep (no FSDP left for them), the rest by FSDP: half of everything.
    two = plan_memory(cfg, ParallelConfig(ep=2).resolve(2), batch_size=2, seq_len=64)
    assert two.params == pytest.approx(4 * n / 2)
    # ep 1 on 2 FSDP ranks: the same half; ep 2 x etp 2 on 4 ranks: experts / 4 as well
    assert plan_memory(cfg, ParallelConfig().resolve(2), batch_size=2, seq_len=64).params == pytest.approx(4 * n / 2)
    four = plan_memory(cfg, ParallelConfig(ep=2, etp=2).resolve(4), batch_size=2, seq_len=64)
    assert four.params == pytest.approx(4 * n / 4)
    # tp 2 on 2 ranks: experts FSDP-sharded over the 2 (ep 1), 2-D non-expert weights split by tp, the
    # routers and norms (replicated over tp) not sharded
    tp = plan_memory(cfg, ParallelConfig(tp=2).resolve(2), batch_size=2, seq_len=64)
    replicated = _param_count(cfg, lambda name: ".router." in name or "norm" in name)
    assert tp.params == pytest.approx(4 * (experts / 2 + (n - experts - replicated) / 2 + replicated))
    assert one.total == pytest.approx(one.params + one.grads + one.optimizer + one.gathered + one.activations + RESERVE)


def test_plan_activations_follow_the_layout():
    cfg = PRESETS["qwen3-30b-a3b"]()
    base = plan_memory(cfg, ParallelConfig(ep=8).resolve(8), batch_size=1, seq_len=4096)
    ckpt = plan_memory(cfg, ParallelConfig(ep=8).resolve(8), batch_size=1, seq_len=4096, activation_checkpointing=True)
    cp2 = plan_memory(cfg, ParallelConfig(ep=8, cp=2).resolve(8), batch_size=1, seq_len=4096)
    dbl = plan_memory(cfg, ParallelConfig(ep=8).resolve(8), batch_size=2, seq_len=4096)
    assert ckpt.activations < base.activations / 5
    assert cp2.activations == pytest.approx(base.activations / 2)
    assert dbl.activations == pytest.approx(2 * base.activations)
    assert base.fits == (base.total <= 80e9) and ("fits" if base.fits else "does not fit") in base.verdict()


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
def test_cli_plan_prints_the_table_and_a_verdict(preset):
    result = CliRunner().invoke(app, ["--plan", "--preset", preset, "--tp", "2", "--ep", "8", "--seq-len", "4096",
                                      "--batch-size", "1"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "8 ranks: attention pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2; experts pp 1 x edp 1 x ep 8" in out
    for row in ("parameters (fp32, sharded)", "gradients", "optimizer state", "activations", "total"):
        assert row in out and "GiB" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("fits: ") or verdict.startswith("does not fit: ")
    if preset == "deepseek-v3":  # 671B parameters x 16 bytes over 8 GPUs
        assert verdict.startswith("does not fit") and "parameters + gradients + optimizer state" in verdict


def test_cli_plan_impossible_layouts_exit_nonzero_with_the_reason(tmp_path):
    r = CliRunner().invoke(app, ["--plan", "--preset", "qwen3-30b-a3b", "--ep", "7", "--world-size", "14"])
    assert r.exit_code == 1 and "ep=7 must divide the 128 experts" in r.output
    r = CliRunner().invoke(app, ["--plan", "--preset", "deepseek-v3", "--tp", "2", "--ep", "8", "--world-size", "4"])
    assert r.exit_code == 1 and "must divide dp_shard*cp*tp = 2*1*2 = 4" in r.output
    def said(r) -> str:  # the error box's text on one line (rich wraps it to the terminal's width)
        return " ".join(r.output.replace("│", " ").split())

    r = CliRunner().invoke(app, ["--world-size", "4", "--out", str(tmp_path / "a")])  # training: torchrun's world
    assert r.exit_code != 0 and "--world-size is for --plan only" in said(r)
    r = CliRunner().invoke(app, ["--pp", "2", "--steps", "1", "--out", str(tmp_path / "a")])  # one process, pp 2
    assert r.exit_code != 0 and "is not a multiple of pp*dp_replicate*cp*tp = 2*1*1*1 = 2" in said(r)
    r = CliRunner().invoke(app, ["--microbatches", "2", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "microbatches and pp_schedule are for pipeline parallelism" in said(r)
    r = CliRunner().invoke(app, ["--pp", "2", "--batch-size", "3", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "batch_size 3 must split into 2 micro-batches" in said(r)
    r = CliRunner().invoke(app, ["--pp", "4", "--microbatches", "2", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "moe-train: 1F1B needs num_microbatches=2 >= the 4 pipeline stages" in said(r)
    r = CliRunner().invoke(app, ["--pp", "2", "--microbatches", "0", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "moe-train: num_microbatches must be >= 1, got 0" in said(r)
    r = CliRunner().invoke(app, ["--tp", "2", "--steps", "1", "--out", str(tmp_path / "b")])  # one process, tp 2
    assert r.exit_code != 0 and "is not a multiple of pp*dp_replicate*cp*tp = 1*1*1*2 = 2" in said(r)
