"""The captured training step (moe_kernels.train.graphs, TrainConfig.cuda_graphs) on the CPU, without capture:
the flag's plumbing and refusals, the device learning-rate schedule against the host's, the step the graph
captures run eagerly against the trainer's normal step, and no host sync in its update. The capture itself:
tests/train/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from moe_kernels.testing import no_host_sync
from moe_kernels.train import graphs
from moe_kernels.train.cli import app
from moe_kernels.train.trainer import TrainConfig, Trainer, lr_factor

# A dense block and an MoE block with aux-loss-free balancing (an expert bias).
COMMON = dict(preset="tiny-deepseek-v3", num_layers=2, steps=8, batch_size=2, seq_len=16, warmup_steps=1,
              log_every=1, eval_every=100, eval_batches=1, checkpoint_every=100, device="cpu")
EPS32 = 2.0**-23


def _quiet(*_, **__):
    pass


@pytest.fixture
def static_step_on_cpu(monkeypatch):
    """Lets the trainer build its captured step on the CPU, where the StepGraph runs it eagerly every step."""
    monkeypatch.setattr(graphs, "check_device", lambda device, world: None)


def _trainer(tmp, name, **kw) -> Trainer:
    return Trainer(TrainConfig(**{**COMMON, **kw}, out_dir=f"{tmp}/{name}"), echo=_quiet)


def _assert_same_state(a: Trainer, b: Trainer, what: str) -> None:
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), f"{what}: parameter {name}"
    for (name, ba), bb in zip(a.model.named_buffers(), b.model.buffers()):
        assert torch.equal(ba, bb), f"{what}: buffer {name}"


@pytest.mark.parametrize("kw, words", [
    (dict(dp_shard=2), "parallelize() layout"),
    (dict(tp=2), "parallelize() layout"),
    (dict(expert_parallel=2), "expert parallelism"),
    (dict(global_load_balancing=True), "all-reduces"),
    (dict(activation_checkpointing=True), "RNG state"),
    (dict(precision="nvfp4"), "weight cache"),
])
def test_config_refuses_what_cannot_be_captured(kw, words):
    with pytest.raises(ValueError, match="--cuda-graphs") as info:
        TrainConfig(**{**COMMON, "device": None, **kw}, cuda_graphs=True)
    assert words in str(info.value)
    TrainConfig(**{**COMMON, "device": None, **kw})  # the same settings without graphs are fine


def test_trainer_refuses_a_cpu_device(tmp_path):
    with pytest.raises(ValueError, match="--cuda-graphs.*not a CUDA device"):
        _trainer(tmp_path, "cpu", cuda_graphs=True)


def test_trainer_refuses_more_than_one_process():
    with pytest.raises(ValueError, match="--cuda-graphs.*2 processes"):
        graphs.check_device(torch.device("cuda", 0), 2)


def test_cli_flag_reaches_the_config(tmp_path):
    result = CliRunner().invoke(app, ["--cuda-graphs", "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "not a CUDA device" in result.output, result.output
    result = CliRunner().invoke(app, ["--cuda-graphs", "--activation-checkpointing", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "--cuda-graphs" in result.output, result.output
    assert "--cuda-graphs" in CliRunner().invoke(app, ["--help"], terminal_width=200).output


@pytest.mark.parametrize("warmup, steps, min_lr_ratio", [(0, 40, 0.1), (5, 60, 0.0), (7, 7, 0.25), (3, 1000, 0.1)])
def test_device_lr_schedule_equals_the_host_schedule(warmup, steps, min_lr_ratio):
    """At every step: the fp64 values within 4 fp64 ulp (only the cosine may round differently: glibc's cos
    within 1 ulp, the device's within 2; the rest are the same correctly rounded operations), and the fp32
    learning rate AdamW reads equal to the host value rounded to fp32 (the tested schedules straddle no fp32
    rounding boundary)."""
    cfg = TrainConfig(**{**COMMON, "warmup_steps": warmup, "steps": steps, "min_lr_ratio": min_lr_ratio})
    schedule = graphs.DeviceLRSchedule(cfg, torch.device("cpu"))
    host = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr), lambda s: lr_factor(s, cfg))
    for step in range(steps + 2):  # past the end: the floor holds
        want = host.get_last_lr()[0]
        got = float(schedule.value())
        assert abs(got - want) <= 4 * math.ulp(want), (step, got, want)
        assert schedule.lr.dtype == torch.float32 and schedule.lr.item() == torch.tensor(want).item(), step
        assert int(schedule.step) == step
        with no_host_sync():
            schedule.advance()
        host.optimizer.step()  # (no gradient: only the order LambdaLR expects)
        host.step()
    schedule.reset(3)
    assert float(schedule.value()) == pytest.approx(cfg.lr * lr_factor(3, cfg), rel=1e-15)


@pytest.mark.parametrize("master_weights, grad_accum", [(False, 1), (True, 1), (True, 2)])
def test_static_step_equals_the_normal_step_bit_for_bit(tmp_path, monkeypatch, static_step_on_cpu, master_weights,
                                                        grad_accum):
    """The same math: both trainers on torch's fused AdamW (the kernel the captured step uses, and the eager
    trainer's on CUDA), and a schedule whose learning rates are exact in fp32 (lr 2^-8, warmup factors k/4), so
    the device tensor and the host float are the same number. Clipping, the master weights' bf16 copy, the
    accumulation and the expert-bias update must then agree bit for bit."""
    monkeypatch.setattr(graphs, "optimizer_flags", lambda device, cuda_graphs: {"fused": True, "capturable": False})
    kw = dict(lr=2.0**-8, warmup_steps=4, master_weights=master_weights, grad_accum=grad_accum, grad_clip=0.05)
    static = _trainer(tmp_path, "static", cuda_graphs=True, **kw)
    normal = _trainer(tmp_path, "normal", **kw)
    assert static.step_graph is not None and not static.step_graph.capture
    for step in range(3):
        a, b = static.train_step(), normal.train_step()
        for key in ("loss", "aux_loss", "grad_norm"):
            assert torch.equal(a[key], b[key]), (step, key)
        _assert_same_state(static, normal, f"step {step}")
        assert static.scheduler.get_last_lr() == normal.scheduler.get_last_lr()
    assert float(b["grad_norm"]) > 0.05  # clipping took part
    assert int(static.lr_schedule.step) == static.step == 3


def test_static_step_tracks_the_normal_step(tmp_path, static_step_on_cpu):
    """fp32 parameters, the default schedule (cosine after one warmup step), the normal step's own AdamW (on the
    CPU torch's per-parameter loop with a float lr): the two AdamW implementations order the same fp32 update
    differently and the learning rate differs by its fp32 rounding, a few fp32 ulp of a parameter a step. Bound:
    4 ulp of the largest parameter a step (measured: under 2 after 4 steps)."""
    static = _trainer(tmp_path, "static", cuda_graphs=True, master_weights=False)
    normal = _trainer(tmp_path, "normal", master_weights=False)
    start = [p.detach().clone() for p in normal.model.parameters()]
    for step in range(1, 4):
        static.train_step(), normal.train_step()
        largest = max(p.abs().max().item() for p in normal.model.parameters())
        for (name, pa), pb in zip(static.model.named_parameters(), normal.model.parameters()):
            err = (pa - pb).abs().max().item()
            assert err <= step * 4 * EPS32 * largest, (step, name, err)
    moved = min((p - p0).abs().max().item() for p, p0 in zip(normal.model.parameters(), start))
    assert moved > 1000 * 3 * 4 * EPS32  # the bound is far below what the steps change


def test_static_update_has_no_host_sync(tmp_path, static_step_on_cpu):
    """Clipping, AdamW with the device learning rate, the bf16 copies, the schedule and the expert-bias update
    read nothing on the host. (The model's forward and backward run the CPU references here, which check index
    values on the host; on a GPU the kernels do not, which tests/nn/test_fused_regions_gpu.py and the captured
    step's GPU test check.)"""
    t = _trainer(tmp_path, "t", cuda_graphs=True, master_weights=True)
    inputs, targets = t.data.batch(0)
    bias = next(t.model.moe_layers()).router.expert_bias.clone()
    loss, aux = t._static_forward_backward(inputs[None], targets[None])
    with no_host_sync():
        out = t._static_update(loss, aux)
    assert not torch.equal(next(t.model.moe_layers()).router.expert_bias, bias)
    assert int(t.lr_schedule.step) == 1 and float(out["grad_norm"]) > 0


def test_resume_continues_the_static_step_bit_for_bit(tmp_path, static_step_on_cpu):
    """A checkpoint of the captured step's trainer resumes with the device schedule at its step (and, on a GPU,
    a fresh capture over the loaded optimizer state)."""
    whole = _trainer(tmp_path, "whole", cuda_graphs=True, steps=4)
    whole.train()
    first = _trainer(tmp_path, "cut", cuda_graphs=True, steps=2)
    first.train()
    resumed = _trainer(tmp_path, "cut", cuda_graphs=True, steps=4)
    assert resumed.resume()
    assert int(resumed.lr_schedule.step) == 2 and resumed.step_graph.eager_calls == 0
    assert all(g["fused"] and isinstance(g["lr"], float) for g in resumed.optimizer.param_groups)
    resumed.train()
    _assert_same_state(whole, resumed, "resumed")


def test_an_eager_checkpoint_resumes_into_the_static_step(tmp_path, static_step_on_cpu):
    """A checkpoint written without graphs (torch's per-parameter AdamW on the CPU, its step counts on the host)
    resumes into the captured step's fused AdamW, and the other way round."""
    _trainer(tmp_path, "run", steps=2).train()
    resumed = _trainer(tmp_path, "run", cuda_graphs=True, steps=3)
    assert resumed.resume()
    assert all(g["fused"] and not g["capturable"] for g in resumed.optimizer.param_groups)
    resumed.train()
    back = _trainer(tmp_path, "run", steps=4)
    assert back.resume() and back.step == 3
    assert not any(g["fused"] for g in back.optimizer.param_groups)
    back.train()
