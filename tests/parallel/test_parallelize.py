"""parallelize(): FSDP2 folded with expert parallelism on 4 gloo ranks equals one process training on
the same four batches (the step's loss is the mean of the ranks' losses), within fp32 rounding: the
losses of every step, the global gradient norm, and every parameter after the optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.layout import ParallelConfig
from tests.distributed import run_world
from tests.parallel.test_data_parallel import _batch, _loss

pytestmark = pytest.mark.distributed


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank, P, family, layout_kw, steps, lora=False):
    from moe_kernels.parallel.parallelize import parallelize

    torch.manual_seed(0)
    ref = build_model(PRESETS[family](num_experts=8))
    if lora:  # peft LoRA on the routed experts, only the adapters trained: replicated, whole on every rank
        import peft

        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                                 target_parameters=["experts.w13", "experts.w2"])
        ref = peft.inject_adapter_in_model(config, ref)
        for name, p in ref.named_parameters():
            p.requires_grad_("lora_" in name)
    par = parallelize(copy.deepcopy(ref), ParallelConfig(**layout_kw))
    model, pc = par.model, par.layout
    # SGD: an update linear in the gradient (Adam turns rounding-level differences into +-lr steps).
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (ref, model)]
    vocab = ref.config.vocab_size
    where = f"rank {rank}/{P} {family} {pc.describe()}"
    for step in range(steps):
        ref_losses = []
        for r in range(P):
            loss = _loss(ref, _batch(step, r, vocab))
            (loss / P).backward()
            ref_losses.append(loss.detach())
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ids = _batch(step, rank, vocab)
        ce, aux = par.forward_backward(ids[:, :-1], ids[:, 1:])
        norm = par.clip_grad_norm_(1.0)
        torch.testing.assert_close(ce + aux, ref_losses[rank], rtol=1e-5, atol=1e-6, msg=where)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6, msg=where)
        for opt in opts:
            opt.step()
            opt.zero_grad()

    El = 8 // pc.ep
    ep_rank = rank % pc.ep
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got, want = _full(p.detach()), ref_params[name].detach()
        if ".experts." in name and "lora_" not in name and pc.ep > 1:
            want = want[ep_rank * El : (ep_rank + 1) * El]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")
    if lora:  # the full state (rank 0): every expert's weights gathered under their names inside the wrappers
        from moe_kernels.parallel.full_state import full_state

        state = full_state(par, None)
        if rank == 0:
            want = ref.state_dict()
            assert set(state[0]) == set(want)
            for name, _ in ref.named_parameters():  # (buffers such as the routers' token counts are rank-local)
                torch.testing.assert_close(state[0][name], want[name], rtol=1e-4, atol=1e-5,
                                           msg=f"{where}: full state {name}")


@pytest.mark.parametrize("family,layout", [
    ("tiny-qwen3-moe", dict(dp_shard=4)),  # FSDP over every rank
    ("tiny-deepseek-v3", dict(ep=2)),  # dp_shard 4, experts EP 2 x FSDP 2 (folded)
    ("tiny-mixtral", dict(dp_replicate=2, ep=2)),  # HSDP 2 x 2, experts EP 2, replicated over the replicas
    ("tiny-deepseek-v3", dict(ep=4)),  # experts EP over every rank: FSDP over a one-rank edp
])
def test_sharded_training_equals_one_process(family, layout):
    run_world(_worker, 4, family, layout, 3)


def test_sharded_lora_training_equals_one_process():
    # peft adapters on expert-parallel experts under FSDP2 (EP 2 x FSDP 2): the factors shard with their block over
    # every rank, not with the experts over the expert group, so their gradients hold every rank's tokens.
    pytest.importorskip("peft")
    run_world(_worker, 4, "tiny-deepseek-v3", dict(ep=2), 2, True)


def _worker_refuses(rank, P):
    from moe_kernels.parallel.parallelize import parallelize

    model = build_model(PRESETS["tiny-qwen3-moe"]())
    with pytest.raises(ValueError, match="pp=2 needs num_microbatches"):
        parallelize(model, ParallelConfig(pp=2))
    with pytest.raises(ValueError, match="num_microbatches and stages_per_rank are for pp > 1"):
        parallelize(model, ParallelConfig(), num_microbatches=2)
    with pytest.raises(NotImplementedError, match="tied embeddings"):
        parallelize(build_model(PRESETS["tiny-qwen3-moe"](tie_embeddings=True)), ParallelConfig(pp=2),
                    num_microbatches=2)
    with pytest.raises(ValueError, match="ep\\*etp = 4\\*1 = 4 must divide dp_shard\\*cp\\*tp = 2\\*1\\*1 = 2"):
        parallelize(model, ParallelConfig(ep=4))
    with pytest.raises(ValueError, match="ep=2 must divide the 3 experts"):
        parallelize(build_model(PRESETS["tiny-qwen3-moe"](num_experts=3)), ParallelConfig(ep=2))
    with pytest.raises(ValueError, match="etp=2 must divide the expert ffn size 33"):
        parallelize(build_model(PRESETS["tiny-qwen3-moe"](ffn_size=33)), ParallelConfig(etp=2))


def test_parallelize_refuses_what_it_cannot_do():
    run_world(_worker_refuses, 2)
