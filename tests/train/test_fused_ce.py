"""The trainer with the fused linear cross-entropy (the default) against F.cross_entropy over the logits
(--no-fused-ce): the same loss curve, and no [tokens, V] fp32 logits in the model's forward and backward."""

import importlib

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moe_kernels.models import PRESETS, build_model
from moe_kernels.testing import assert_tracks_loss_curve
from moe_kernels.train.trainer import TrainConfig, Trainer

COMMON = dict(preset="tiny-qwen3-moe", num_layers=1, steps=4, batch_size=2, seq_len=32, warmup_steps=1,
              log_every=1, eval_every=100, checkpoint_every=100, device="cpu")


def _curve(tmp, name, **kw):
    trainer = Trainer(TrainConfig(**COMMON, **kw, out_dir=f"{tmp}/{name}"), echo=lambda *a, **k: None)
    losses = [float(trainer.train_step()["loss"]) for _ in range(COMMON["steps"])]
    return torch.tensor(losses, dtype=torch.float64), float(trainer.evaluate())


def test_fused_loss_curve_equals_unfused(tmp_path):
    fused, fused_eval = _curve(tmp_path, "fused")
    unfused, unfused_eval = _curve(tmp_path, "unfused", fused_ce=False)
    # The first step's loss is one forward of the same weights: within fp32 rounding of the logits' dot
    # products (the test of linear_cross_entropy bounds it), here a relative 1e-5.
    torch.testing.assert_close(fused[0], unfused[0], rtol=1e-5, atol=0)
    seeds = [_curve(tmp_path, "seed", fused_ce=False, seed=1)[0]]
    assert_tracks_loss_curve(fused, unfused, seeds, "fused cross-entropy")
    assert abs(fused_eval - unfused_eval) <= 1e-3 * abs(unfused_eval)


class _Outputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [(t.dtype, tuple(t.shape)) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def test_model_loss_never_allocates_the_logits(monkeypatch):
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny-qwen3-moe"](num_layers=1))
    V = model.config.vocab_size
    ids = torch.randint(0, V, (4, 48))
    N = ids.numel()
    # The tiny vocabulary's logits fit one chunk of the real bound: chunks of 64 rows here.
    # (The module by import_module: moe_kernels.nn's attribute of that name is the function.)
    monkeypatch.setattr(importlib.import_module("moe_kernels.nn.linear_cross_entropy"), "CHUNK_BYTES", 64 * 4 * V)

    def logits_like(mode):
        return [s for dtype, s in mode.shapes if dtype == torch.float32 and s and s[-1] == V
                and torch.Size(s).numel() >= N * V]

    with _Outputs() as fused:
        loss, aux = model(ids, ids)
        (loss + aux).backward()
    assert not logits_like(fused), logits_like(fused)
    with _Outputs() as unfused:
        logits, aux = model(ids)
        (F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()) + aux).backward()
    assert logits_like(unfused)  # the check can fail
    torch.testing.assert_close(loss, F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()), rtol=1e-5, atol=0)
    hidden, _ = model(ids, return_hidden=True)
    assert hidden.shape == (4, 48, model.config.hidden_size)
