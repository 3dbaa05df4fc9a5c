"""The NVLink backend where a physical GPU is needed: real CUDA IPC handles exchanged between two
processes on one device, and a CUDA graph capturing an expert-parallel MoE layer's forward and backward
on virtual ranks. (The kernels themselves run on every build: tests/dispatch/test_nvlink.py.)"""

from __future__ import annotations

import pytest
import torch

from moe_kernels.dispatch import LocalDispatcher, VirtualNvlinkWorld, make_dispatcher
from moe_kernels.nn import GroupedExperts
from tests.cuda_graphs import capture_and_replay
from tests.dispatch.test_dispatch import _expert_fn, _routing
from tests.distributed import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_device]


def _worker_ipc(rank, P):
    # P processes share cuda:0: the peer buffers are real IPC mappings, the barrier real signal words.
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    E, k, H, M = 4 * P, 3, 64, 32
    disp = make_dispatcher("nvlink", E, max_tokens_per_rank=M)
    scale = torch.linspace(0.5, 2.0, E, device=dev)
    shift = torch.linspace(-1.0, 1.0, E, device=dev)
    for step, (case, T) in enumerate((("uniform", 17 + 5 * rank), ("hot", 3), ("uniform", 0 if rank else 9),
                                      ("one_rank", M))):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        w = torch.rand(T, k, generator=gen).to(dev).requires_grad_()
        idx = _routing(case, T, k, E, P, gen).to(dev)
        gout = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
        results = []
        for d_ in (disp, LocalDispatcher(E)):
            d = d_.dispatch(x, w, idx, align=8)
            y = _expert_fn(d.x, d.local_indices, d_.first_expert, scale, shift)
            out = d_.combine(y, d.handle)
            results.append((out, *torch.autograd.grad((out.float() * gout.float()).sum(), (x, w))))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} step {step} {case}")
    assert disp.dropped_tokens() == 0
    with pytest.raises(ValueError, match="more than max_tokens_per_rank=32"):
        disp.dispatch(torch.zeros(M + 1, H, device=dev), torch.zeros(M + 1, k, device=dev),
                      torch.zeros(M + 1, k, dtype=torch.int32, device=dev))


@pytest.mark.gpu_memory
def test_nvlink_ipc_two_processes_one_device():
    run_world(_worker_ipc, 2)


def _worker_ipc_teardown(rank, P):
    # Wider rows grow the dispatch and combine regions (every rank unmaps the old ones, a barrier, then each
    # frees its own) with a rank lagging behind; results stay exact across the growth. release_buffers frees
    # everything in the same order (collective), the next dispatch maps new regions, and the ranks then exit
    # holding them (the driver frees them with the process; no rank frees memory a peer maps).
    import time

    from moe_kernels.dispatch import NvlinkDispatcher

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    E, k, M = 2 * P, 2, 16
    disp = make_dispatcher("nvlink", E, max_tokens_per_rank=M)
    sizes = []

    def step(H, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(M - rank, H, generator=gen).to(dev).requires_grad_()
        w = torch.rand(M - rank, k, generator=gen).to(dev).requires_grad_()
        idx = _routing("uniform", M - rank, k, E, P, gen).to(dev)
        results = []
        for d_ in (disp, LocalDispatcher(E)):
            d = d_.dispatch(x, w, idx, align=4)
            out = d_.combine(d.x * 2, d.handle)
            results.append((out, *torch.autograd.grad(out.square().sum(), (x, w))))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} H={H}")
        t = disp._engine.t
        sizes.append((t.region("dispatch", rank).numel(), t.region("combine", rank).numel()))

    for i, H in enumerate((64, 1024, 4096)):
        if rank == 1:
            time.sleep(0.2)  # the other rank reaches the growth first
        step(H, 10 * i + rank)
    assert all(a < b for pair in zip(sizes, sizes[1:]) for a, b in zip(*pair)), sizes  # both regions grew twice
    transport = disp._engine.t
    NvlinkDispatcher.release_buffers()
    assert not transport._mine and not transport._opened and not transport.regions
    step(256, 99 + rank)  # new regions, mapped again
    assert transport._mine.keys() == {"header", "dispatch", "combine"}
    if rank == 0:
        time.sleep(0.2)  # rank 1 exits first, holding its regions


@pytest.mark.gpu_memory
def test_nvlink_ipc_regions_grow_release_and_exit_two_processes_one_device():
    run_world(_worker_ipc_teardown, 2)


def _worker_ep_layer(rank, P):
    # apply_expert_parallel(backend="nvlink") on a MoE layer: outputs and input gradients equal the full
    # layer's on this rank's tokens (fp32: within the grouped GEMMs' rounding).
    import copy

    from moe_kernels.nn.moe import MoELayer, qwen3_30b_a3b
    from moe_kernels.parallel import apply_expert_parallel

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    full = MoELayer(qwen3_30b_a3b(hidden_size=64, num_experts=4 * P, ffn_size=32, k=4), device="cuda")
    ep = apply_expert_parallel(copy.deepcopy(full), backend="nvlink", max_tokens_per_rank=64)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 5 + 3 * rank, 64, generator=gen).cuda()
    g = torch.randn(x.shape, generator=gen).cuda()
    outs = []
    for model in (full, ep):
        xi = x.clone().requires_grad_()
        out, aux = model(xi)
        ((out * g).sum() + aux).backward()
        outs.append((out, xi.grad))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")


@pytest.mark.gpu_memory
def test_nvlink_expert_parallel_model_two_processes_one_device():
    run_world(_worker_ep_layer, 2)


def test_nvlink_cuda_graph_virtual_ranks():
    # dispatch -> grouped GEMM experts -> combine, forward and backward, on 4 virtual ranks, captured once
    # and replayed on new inputs: equal to the same step run eagerly.
    P, E, k, H, F, M = 4, 16, 4, 128, 64, 64
    dev = torch.device("cuda", torch.cuda.current_device())
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=M, device=dev)
    torch.manual_seed(0)
    experts = [GroupedExperts(E // P, H, F, device=dev, dtype=torch.bfloat16) for _ in range(P)]
    xs = [torch.randn(M - 7 * r, H, device=dev, dtype=torch.bfloat16, requires_grad=True) for r in range(P)]
    ws = [torch.rand(x.shape[0], k, device=dev, requires_grad=True) for x in xs]
    idx = [torch.rand(x.shape[0], E, device=dev).argsort(1)[:, :k].int() for x in xs]
    params = [p for e in experts for p in e.parameters()]

    def step():
        ds = world.dispatch(xs, ws, idx, align=8)
        ys = [e(d.x, d.group_sizes) for e, d in zip(experts, ds)]
        outs = world.combine(ys, [d.handle for d in ds])
        loss = sum(o.float().square().sum() for o in outs)
        return [o.detach() for o in outs] + list(torch.autograd.grad(loss, [*xs, *ws, *params]))

    def refresh():
        for x in xs:
            x.copy_(torch.randn_like(x))
        for w in ws:
            w.copy_(torch.rand_like(w))
        for i in idx:
            i.copy_(torch.rand(i.shape[0], E, device=dev).argsort(1)[:, :k].int())

    captured, eager = capture_and_replay(step, refresh)
    for i, (a, b) in enumerate(zip(captured, eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"graph replay tensor {i}")
