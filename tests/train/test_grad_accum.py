"""Gradient accumulation (TrainConfig.grad_accum, --grad-accum): a step of N batches of B sequences has the
LM loss and gradient of one batch of N * B (the same windows), each aux loss the mean of the batches' values
(Megatron-Core's convention); under FSDP no reduce-scatter runs before the last batch; refused with pp."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.train.trainer import TrainConfig, Trainer
from tests.distributed import run_world

COMMON = dict(preset="tiny-qwen3-moe", num_layers=1, steps=2, seq_len=16, log_every=1, eval_every=100,
              eval_batches=1, checkpoint_every=100, warmup_steps=1, device="cpu", grad_clip=1e9)


def _quiet(*_):
    pass


def _step_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    grads = {}

    def hook(opt, args, kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    handle = trainer.optimizer.register_step_pre_hook(hook)
    out = trainer.train_step()
    handle.remove()
    return grads, out


def test_accumulated_step_equals_one_batch_of_n_times_the_size(tmp_path):
    acc = Trainer(TrainConfig(**COMMON, batch_size=2, grad_accum=2, out_dir=str(tmp_path / "a")), echo=_quiet)
    ref = copy.deepcopy(acc.model)
    micro = [acc.data.batch(0, j, 2) for j in range(2)]
    big = Trainer(TrainConfig(**COMMON, batch_size=4, out_dir=str(tmp_path / "b")), echo=_quiet).data.batch(0)
    for got, want in zip((torch.cat(t) for t in zip(*micro)), big):
        assert torch.equal(got, want)  # the two batches are the 4-sequence batch's windows
    grads, out = _step_grads(acc)
    # The reference objective: the 4-sequence batch's cross-entropy plus the mean of the batches' aux losses.
    logits, _ = ref(big[0])
    ce = F.cross_entropy(logits.float().flatten(0, 1), big[1].flatten())
    aux = torch.stack([ref(x)[1] for x, _ in micro]).mean()
    (ce + aux).backward()
    # Error model: both are fp32 sums of the same per-token terms in another order (two halves of 32 tokens
    # vs all 64): each element within a few fp32 ulps of its terms' magnitude; 1e-5 of each tensor's norm
    # (~80 eps) is a margin, a lost or doubled batch is off by ~50%.
    for name, p in ref.named_parameters():
        err = float((grads[name] - p.grad).norm())
        assert err <= 1e-5 * float(p.grad.norm()) + 1e-9, f"{name}: {err:.3g} vs {float(p.grad.norm()):.3g}"
    assert float(out["loss"]) == pytest.approx(float(ce.detach()), rel=1e-6)
    assert float(out["aux_loss"]) == pytest.approx(float(aux.detach()), rel=1e-6)
    # The config refuses accumulation with pipelines, and a count below one.
    with pytest.raises(ValueError, match="a pipeline step already accumulates"):
        TrainConfig(**{**COMMON, "num_layers": 2}, batch_size=2, grad_accum=2, pp=2, out_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        TrainConfig(**COMMON, batch_size=2, grad_accum=0, out_dir=str(tmp_path / "c"))


def _worker(rank, world, tmp: str, layout: dict):
    losses = {}
    for name, kw in (("acc", dict(batch_size=2, grad_accum=2)), ("big", dict(batch_size=4))):
        trainer = Trainer(TrainConfig(**COMMON, **layout, **kw, out_dir=f"{tmp}/{name}"), echo=_quiet)
        seen = []
        if trainer.parallelized is not None:  # the sharded gradients after each batch's backward
            inner = trainer.parallelized.forward_backward

            def forward_backward(*args, **kwargs):
                out = inner(*args, **kwargs)
                seen.append(any(p.grad is not None for p in trainer.model.parameters()))
                return out

            trainer.parallelized.forward_backward = forward_backward
        losses[name] = [float(trainer.train_step()["loss"]) for _ in range(2)]
        if trainer.parallelized is not None and name == "acc":
            # FSDP reduce-scatters (and so sets sharded gradients) after each step's last batch only.
            assert seen == [False, True, False, True], seen
    # The same 8 windows a step over both ranks: the same loss (the steps' updates differ by the aux losses'
    # convention only, at rounding level for the second step's loss).
    assert losses["acc"][0] == pytest.approx(losses["big"][0], rel=1e-6), losses
    assert losses["acc"][1] == pytest.approx(losses["big"][1], rel=1e-3), losses


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [dict(dp_shard=2), dict(expert_parallel=2)])
def test_accumulation_on_two_ranks(tmp_path, layout):
    run_world(_worker, 2, str(tmp_path), layout)
