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
    with pytest.raises(ValueError, match="1F1B needs num_microbatches=1 >= the 2 pipeline stages"):
        apply_pipeline_parallel(model, num_microbatches=1)
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


# parallelize() with pp: each stage's ranks shard its blocks as they would the whole model.
COMPOSED = [
    # 1F1B; each stage TP 2 (sequence-parallel hidden states between stages) with experts EP 2 (MLA, a dense
    # layer, shared experts, the sequence-wise aux loss)
    ("tiny-deepseek-v3", 4, dict(pp=2, tp=2, ep=2), "1f1b", 1),
    # interleaved 1F1B, two stages a rank; each stage FSDP 2 with experts EP 2
    ("tiny-qwen3-moe", 4, dict(pp=2, ep=2), "interleaved-1f1b", 2),
]
EXTENDED = [
    ("tiny-mixtral", 3, dict(pp=2, cp=2), "gpipe", 1),  # CP 2 in each stage, an uneven split
    ("tiny-qwen3-moe", 2, dict(pp=2, dp_replicate=2), "1f1b", 1),  # replicas of the pipeline (HSDP 2 x 1)
    ("tiny-qwen3-moe", 2, dict(pp=2, etp=2), "1f1b", 1),  # FSDP 2 with experts ETP 2
]


def _composed_ref_step(ref, batches, n):
    """The objective: the mean over the batches of the mean over each batch's micro-batches of their
    cross-entropy plus aux loss; each batch's (cross-entropy, aux loss)."""
    out = []
    for x, y in batches:
        ce, aux = _ref_step_scaled(ref, x, y, n, len(batches))
        out.append((ce, aux))
    return out


def _ref_step_scaled(ref, x, y, n, scale):
    ce_sum = aux_sum = 0.0
    for xb, yb in zip(x.chunk(n), y.chunk(n)):
        logits, aux = ref(xb)
        ce = F.cross_entropy(logits.flatten(0, 1), yb.flatten())
        ((ce + aux) / (n * scale)).backward()
        ce_sum, aux_sum = ce_sum + ce.detach(), aux_sum + aux.detach()
    return ce_sum / n, aux_sum / n


def _composed_worker(rank, P, cases):
    from moe_kernels.parallel import ParallelConfig, parallelize
    from tests.parallel.test_tensor_parallel import check_slices

    for family, layers, layout, schedule, v in cases:
        torch.manual_seed(0)
        ref = build_model(PRESETS[family](num_layers=layers, num_experts=8))
        par = parallelize(copy.deepcopy(ref), ParallelConfig(**layout), num_microbatches=2, schedule=schedule,
                          stages_per_rank=v)
        pc = par.layout
        where = f"rank {rank}/{P} {family} {pc.describe()} {schedule}"
        stage_rank = rank % (P // pc.pp)
        batch, tp_rank = stage_rank // (pc.cp * pc.tp), stage_rank % pc.tp
        etp_rank, ep_rank = stage_rank % pc.etp, (stage_rank // pc.etp) % pc.ep
        nb = pc.dp_replicate * pc.dp_shard
        opts = [torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(par.model.parameters(), lr=0.5)]
        for step in range(2):
            data = [torch.randint(0, ref.config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(10 * step + b))
                    for b in range(nb)]
            ref_losses = _composed_ref_step(ref, [(d[:, :-1], d[:, 1:]) for d in data], 2)
            ce, aux = par.forward_backward(data[batch][:, :-1], data[batch][:, 1:])
            torch.testing.assert_close(ce, ref_losses[batch][0], **TOL, msg=where)
            torch.testing.assert_close(aux, ref_losses[batch][1], **TOL, msg=where)
            torch.testing.assert_close(par.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0),
                                       **TOL, msg=where)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            par.reduce_expert_counts()
            for model in (ref, par.model):
                for layer in model.moe_layers():
                    if layer.router.expert_bias is not None:
                        layer.router.update_expert_bias()
        ref_params = dict(ref.named_parameters())
        names = [n for n, _ in par.model.named_parameters()]
        assert names and set(names) < set(ref_params), where  # a part of the full model, under its names
        check_slices(par.model, ref, pc, tp_rank, ep_rank, etp_rank, where)
        ref_bufs = dict(ref.named_buffers())
        for name, b in par.model.named_buffers():
            torch.testing.assert_close(b, ref_bufs[name], **TOL, msg=f"{where}: {name}")


def test_parallelize_with_pipeline_equals_one_process():
    run_world(_composed_worker, 4, COMPOSED)


@pytest.mark.extended
def test_parallelize_with_pipeline_extended_layouts():
    run_world(_composed_worker, 4, EXTENDED)
