"""The captured training step (moe-train --cuda-graphs) on a GPU: a run that captures its step after the warm-up
and replays it equals the same step run eagerly every step, bit for bit, with and without master weights and
with grad_accum 2; it equals the normal eager trainer bit for bit where the learning rates are exact in fp32;
the step syncs nothing with the host (also checked on the CPU-executed kernels, MOE_KERNELS_EMULATE); train()
logs, evaluates, checkpoints and resumes through the graph.

Small shapes on purpose: one block of keys per attention row (seq_len 32), so the attention backward is
deterministic and "bit for bit" is a property of the capture, not of luck."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.testing import no_host_sync
from moe_kernels.train import graphs
from moe_kernels.train.trainer import TrainConfig, Trainer, lr_factor

pytestmark = pytest.mark.gpu  # the captures also need the physical device (cuda_device)

# A dense block and an MoE block with aux-loss-free balancing (an expert bias).
COMMON = dict(preset="tiny-deepseek-v3", num_layers=2, steps=8, batch_size=2, seq_len=32, warmup_steps=2,
              log_every=1, eval_every=100, eval_batches=1, checkpoint_every=100, device="cuda")
STEPS = 6  # 2 eager warm-up steps, the capture (replayed at once), 3 replays


def _quiet(*_, **__):
    pass


def _trainer(tmp, name, **kw) -> Trainer:
    return Trainer(TrainConfig(**{**COMMON, **kw}, out_dir=f"{tmp}/{name}"), echo=_quiet)


def _assert_same_state(a: Trainer, b: Trainer, what: str) -> None:
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), f"{what}: parameter {name}"
    for (name, ba), bb in zip(a.model.named_buffers(), b.model.buffers()):
        assert torch.equal(ba, bb), f"{what}: buffer {name}"
    if a.master is not None:
        for i, (ca, cb) in enumerate(zip(a.master.copies, b.master.copies)):
            assert torch.equal(ca, cb), f"{what}: bf16 copy {i}"
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[key], sb[key]), f"{what}: AdamW {key}"


@pytest.mark.cuda_device
@pytest.mark.parametrize("master_weights, grad_accum", [(True, 1), (False, 1), (True, 2)])
def test_captured_run_equals_eager_run(tmp_path, master_weights, grad_accum):
    kw = dict(cuda_graphs=True, master_weights=master_weights, grad_accum=grad_accum)
    captured = _trainer(tmp_path, "captured", **kw)
    eager = _trainer(tmp_path, "eager", **kw)
    eager.step_graph.capture = False
    start = [p.detach().clone() for p in eager.model.parameters()]
    for step in range(STEPS):
        a, b = captured.train_step(), eager.train_step()
        for key in ("loss", "aux_loss", "grad_norm"):
            assert torch.equal(a[key], b[key]), (step, key, a[key], b[key])
        assert torch.equal(captured.lr_schedule.lr, eager.lr_schedule.lr), step
        _assert_same_state(captured, eager, f"step {step}")
    assert captured.step_graph.graph is not None and eager.step_graph.graph is None
    assert captured.step_graph.eager_calls == 2
    assert all(not torch.equal(p, p0) for p, p0 in zip(eager.model.parameters(), start))
    bias = next(captured.model.moe_layers()).router.expert_bias
    assert bias.abs().sum() > 0  # the in-graph balancing moved it


@pytest.mark.cuda_device
def test_captured_run_equals_the_normal_trainer(tmp_path):
    """Learning rates exact in fp32 (lr 2^-8, warmup factors k/8): the device tensor and the eager trainer's float
    are the same number, and both trainers run fused AdamW, so the captured step equals the normal one."""
    kw = dict(lr=2.0**-8, warmup_steps=8, master_weights=True)
    captured = _trainer(tmp_path, "captured", cuda_graphs=True, **kw)
    normal = _trainer(tmp_path, "normal", **kw)
    for step in range(STEPS):
        a, b = captured.train_step(), normal.train_step()
        for key in ("loss", "aux_loss", "grad_norm"):
            assert torch.equal(a[key], b[key]), (step, key, a[key], b[key])
        _assert_same_state(captured, normal, f"step {step}")


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_static_step_syncs_nothing(tmp_path, cuda, monkeypatch, grad_accum):
    """The whole step the graph captures (forward, backward, clipping, AdamW, bf16 copies, schedule, expert
    bias) reads nothing on the host: no_host_sync everywhere, and torch's sync debug mode on a GPU."""
    if cuda.type != "cuda":  # the CPU-executed kernels: the step runs eagerly, as on a GPU before its capture
        monkeypatch.setattr(graphs, "check_device", lambda device, world: None)
    t = _trainer(tmp_path, "t", cuda_graphs=True, device=str(cuda), master_weights=True, grad_accum=grad_accum)
    t.step_graph.capture = False
    t.train_step()  # the optimizer state and the workspaces exist, as at capture
    batches = [t.data.batch(1, j, grad_accum) for j in range(grad_accum)]
    inputs = torch.stack([x for x, _ in batches]).to(cuda)
    targets = torch.stack([y for _, y in batches]).to(cuda)
    debug = cuda.type == "cuda"
    if debug:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with no_host_sync():
            t._static_step(inputs, targets)
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda_device
def test_train_logs_checkpoints_and_resumes_through_the_graph(tmp_path):
    whole = _trainer(tmp_path, "whole", cuda_graphs=True, steps=8, eval_every=3)
    records = whole.train()
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(r["optimizer_share"] is None and r["loss"] > 0 and r["grad_norm"] > 0 for r in train)
    assert [r["lr"] for r in train] == [whole.cfg.lr * lr_factor(r["step"], whole.cfg) for r in train]
    assert whole.lr_schedule.lr.item() == torch.tensor(whole.scheduler.get_last_lr()[0]).item()
    assert len([r for r in records if r["kind"] == "eval"]) == 3
    cut = _trainer(tmp_path, "cut", cuda_graphs=True, steps=3, eval_every=3)
    cut.train()
    resumed = _trainer(tmp_path, "cut", cuda_graphs=True, steps=8, eval_every=3)
    assert resumed.resume() and int(resumed.lr_schedule.step) == 3
    resumed.train()  # steps 3 and 4 warm up, 5 captures again over the loaded optimizer state, 6 and 7 replay
    assert resumed.step_graph.graph is not None
    _assert_same_state(whole, resumed, "resumed")
