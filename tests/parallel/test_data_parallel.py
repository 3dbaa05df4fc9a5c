"""Training steps with expert parallelism + data parallelism on P gloo ranks equal one process that
accumulates the same P batches (the step's loss is the mean of the ranks' losses), expert bias included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel import all_reduce_expert_counts, all_reduce_gradients, apply_expert_parallel, expert_parameters
from tests.distributed import run_world

pytestmark = pytest.mark.distributed


def _batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, ids):
    logits, aux = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + aux


def _bias_layers(model):
    return [layer for layer in model.moe_layers() if layer.router.expert_bias is not None]


def _worker(rank, P, family, backend, steps):
    torch.manual_seed(0)
    ref = build_model(PRESETS[family](num_experts=4 * P))
    ep = apply_expert_parallel(copy.deepcopy(ref), backend=backend)
    # SGD: an update linear in the gradient (Adam would turn rounding-level gradients into +-lr steps).
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ep)]
    vocab = ref.config.vocab_size
    for step in range(steps):
        # One process: the P ranks' batches, gradients accumulated with weight 1/P.
        ref_losses = []
        for r in range(P):
            loss = _loss(ref, _batch(step, r, vocab))
            (loss / P).backward()
            ref_losses.append(loss.detach())
        for layer in _bias_layers(ref):
            layer.router.update_expert_bias()
        # P ranks: each its own batch.
        loss = _loss(ep, _batch(step, rank, vocab))
        loss.backward()
        all_reduce_gradients(ep)
        all_reduce_expert_counts(ep)
        for layer in _bias_layers(ep):
            layer.router.update_expert_bias()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_losses[rank], rtol=1e-5, atol=1e-6)

    where = f"rank {rank}/{P} {family} {backend}"
    sharded = {id(p) for p in expert_parameters(ep)}
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        want = ref_params[name]
        if id(p) in sharded:
            El = p.shape[0]
            want = want[rank * El : (rank + 1) * El]
        torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")
    for a, b in zip(_bias_layers(ep), _bias_layers(ref)):
        assert torch.equal(a.router.expert_bias, b.router.expert_bias), where
    assert any(bool(layer.router.expert_bias.abs().sum()) for layer in _bias_layers(ref)) or not _bias_layers(ref)


@pytest.mark.parametrize("family,backend", [("tiny-qwen3-moe", "all_to_all"), ("tiny-deepseek-v3", "all_gather")])
def test_training_steps_equal_one_process(family, backend):
    run_world(_worker, 2, family, backend, 3)


def _worker_global_balance(rank, P):
    from moe_kernels.nn import Router, RouterConfig
    from moe_kernels.parallel import apply_global_load_balancing

    torch.manual_seed(0)
    cfg = RouterConfig(hidden_size=16, num_experts=8, k=2, score="softmax", aux_loss_coeff=1e-2)
    ref, router = Router(cfg), Router(cfg)
    router.load_state_dict(ref.state_dict())
    apply_global_load_balancing(router)
    xs = [torch.randn(12, 16, generator=torch.Generator().manual_seed(r)) for r in range(P)]
    for reference in (False, True):
        aux = router(xs[rank], reference=reference).aux_loss
        (g,) = torch.autograd.grad(aux / P, router.weight)  # each rank's share of the mean loss
        mean_aux = aux.detach().clone()
        torch.distributed.all_reduce(mean_aux)
        torch.distributed.all_reduce(g)
        want = ref(torch.cat(xs), reference=reference).aux_loss  # one process, the global batch
        (want_g,) = torch.autograd.grad(want, ref.weight)
        torch.testing.assert_close(mean_aux / P, want.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g, want_g, rtol=1e-4, atol=1e-7)
        local = ref(xs[rank], reference=reference).aux_loss.detach()
        assert not torch.allclose(aux.detach(), local)  # the per-rank loss is another function


def test_global_load_balancing_is_the_global_batch_aux_loss():
    run_world(_worker_global_balance, 2)


def _worker_mesh(rank, P):
    from moe_kernels.parallel import expert_parallel_mesh
    from moe_kernels.train.distributed import setup

    created = []
    new_group = torch.distributed.new_group

    def counting(ranks=None, *args, **kwargs):
        created.append(ranks)
        return new_group(ranks, *args, **kwargs)

    torch.distributed.new_group = counting
    try:
        # Communicators only for dimensions larger than one; an edp dimension spanning the world is the default
        # group, an ep one its own communicator (the dispatch never shares one with the gradient reduction).
        for ep, groups in ((1, []), (2, [[0, 1], [2, 3], [0, 2], [1, 3]]), (4, [[0, 1, 2, 3]])):
            created.clear()
            par = setup(ep, torch.device("cpu"))
            assert created == groups and (par.ep_group is None) == (ep == 1), (ep, created)
            if ep == 1:
                assert par.edp_group is torch.distributed.group.WORLD
            elif ep == P:
                assert par.edp_group is None and par.ep_group is not torch.distributed.group.WORLD
            else:
                assert torch.distributed.get_process_group_ranks(par.edp_group) == [rank % ep, rank % ep + ep]
    finally:
        torch.distributed.new_group = new_group
    for ep in (1, 2, 4):
        mesh = expert_parallel_mesh(ep, "cpu")
        group = torch.distributed.get_process_group_ranks(mesh.ep_group)
        first = rank // ep * ep
        assert group == list(range(first, first + ep)) and mesh.ep_rank == rank % ep and mesh.expert_parallel == ep
        if ep == P:
            assert mesh.edp_group is None
        else:
            assert torch.distributed.get_process_group_ranks(mesh.edp_group) == list(range(rank % ep, P, ep))
    with pytest.raises(ValueError, match="must divide"):
        expert_parallel_mesh(3, "cpu")


def test_expert_parallel_mesh_layout():
    run_world(_worker_mesh, 4)
