"""Pipeline parallelism on 2 gloo ranks equals one process running the same micro-batches: each step's
cross-entropy and aux loss, every stage's gradients (clipped by the global norm) and its parameters after
two steps. Schedules 1F1B (DeepSeek-V3: a dense first layer, expert bias, sequence-wise aux loss), interleaved
1F1B (two stages a rank) and GPipe over an uneven split (3 layers on 2 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.pipeline import apply_pipeline_parallel, stage_bounds
from tests.distributed import run_world

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-5, atol=1e-6)
CASES = [("tiny-deepseek-v3", 4, "1f1b", 1), ("tiny-qwen3-moe", 4, "interleaved-1f1b", 2),
         ("tiny-mixtral", 3, "gpipe", 1)]


def _ref_step(ref, x, y, n):
    """The objective: the mean over micro-batches of each one's cross-entropy plus its aux loss."""
    ce_sum = aux_sum = 0.0
    for xb, yb in zip(x.chunk(n), y.chunk(n)):
        logits, aux = ref(xb)
        ce = F.cross_entropy(logits.flatten(0, 1), yb.flatten())
        ((ce + aux) / n).backward()
        ce_sum, aux_sum = ce_sum + ce.detach(), aux_sum + aux.detach()
    return ce_sum / n, aux_sum / n


def _worker(rank, P):
    for family, layers, schedule, v in CASES:
        where = f"rank {rank}/{P} {family} {schedule}"
        torch.manual_seed(0)
        ref = build_model(PRESETS[family](num_layers=layers))
        pipe = apply_pipeline_parallel(copy.deepcopy(ref), num_microbatches=4, schedule=schedule, stages_per_rank=v)
        opts = [torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(pipe.parameters(), lr=0.5)]
        for step in range(2):
            ids = torch.randint(0, ref.config.vocab_size, (8, 17), generator=torch.Generator().manual_seed(step))
            ce, aux = pipe.step(ids[:, :-1], ids[:, 1:])
            ref_ce, ref_aux = _ref_step(ref, ids[:, :-1], ids[:, 1:], 4)
            torch.testing.assert_close(ce, ref_ce, **TOL, msg=where)
            torch.testing.assert_close(aux, ref_aux, **TOL, msg=where)
            assert aux > 0, where
            torch.testing.assert_close(pipe.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0),
                                       **TOL, msg=where)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            for model in (ref, pipe):
                for layer in model.moe_layers():
                    if layer.router.expert_bias is not None:
                        layer.router.update_expert_bias()
        ref_params = dict(ref.named_parameters())
        names = [n for n, _ in pipe.named_parameters()]
        assert names and all(n in ref_params for n in names), where  # the full model's names
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p, ref_params[name], **TOL, msg=f"{where}: {name}")
        ref_bufs = dict(ref.named_buffers())
        for m in pipe.modules:
            for name, b in m.named_buffers():
                torch.testing.assert_close(b, ref_bufs[name], **TOL, msg=f"{where}: {name}")

    model = build_model(PRESETS["tiny-qwen3-moe"](num_layers=2))
    with pytest.raises(ValueError, match="schedule must be one of"):
        apply_pipeline_parallel(model, num_microbatches=2, schedule="zb")
    with pytest.raises(ValueError, match="2 layers do not fill 4 stages"):
        apply_pipeline_parallel(model, num_microbatches=2, schedule="interleaved-1f1b", stages_per_rank=2)
    with pytest.raises(NotImplementedError, match="tied embeddings"):
        apply_pipeline_parallel(build_model(PRESETS["tiny-qwen3-moe"](tie_embeddings=True)), num_microbatches=2)
    pipe = apply_pipeline_parallel(model, num_microbatches=3)
    with pytest.raises(ValueError, match="does not split into num_microbatches=3"):
        pipe.step(torch.zeros(4, 8, dtype=torch.int64), torch.zeros(4, 8, dtype=torch.int64))


def test_pipeline_equals_one_process():
    run_world(_worker, 2)


def test_stage_bounds():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
