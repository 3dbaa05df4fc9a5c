"""Per-step work that does not grow with the parameter count, on two gloo ranks: the routers' expert counts
in one collective, bucketed (and overlapped) gradient averaging equal bit for bit to one flat buffer's, the
foreach gradient norm and clipping equal to the one-process ones, the single-tensor sequence collectives
equal to the list ones, and communicators only for the dimensions larger than one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel import (all_reduce_expert_counts, all_reduce_gradients, apply_expert_parallel,
                                   expert_parameters)
from moe_kernels.parallel.data_parallel import GradientReducer
from moe_kernels.parallel.tensor_parallel import _NO_TENSOR_REDUCE_SCATTER, _gather_chunks, _reduce_scatter_chunks
from tests.distributed import run_world

pytestmark = pytest.mark.distributed


class _Calls:
    """Counts (and sizes) the calls of torch.distributed.<name> while installed."""

    def __init__(self, monkeypatch, name: str):
        self.sizes: list[int] = []
        real = getattr(dist, name)

        def wrapper(tensor, *args, **kwargs):
            self.sizes.append(tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0)
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, name, wrapper)


def _backward(model, rank: int, step: int = 0) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
    logits, aux = model(ids[:, :-1])
    (F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + aux).backward()


def _flat_reference(model, world: int, expert_dp_group) -> dict[str, torch.Tensor]:
    """The averaged gradients as one flat buffer per kind and dtype gives them (the previous implementation)."""
    experts = {id(p) for p in expert_parameters(model)}
    out = {}
    for sharded, group in ((False, None), (True, expert_dp_group)):
        named = [(n, p.grad.clone()) for n, p in model.named_parameters()
                 if p.grad is not None and (id(p) in experts) == sharded]
        if named and (group is not None or not sharded):
            flat = torch.cat([g.reshape(-1) for _, g in named])
            dist.all_reduce(flat, group=group)
            offset = 0
            for _, g in named:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        out.update({n: g.div_(world) for n, g in named})
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for n in want:
        assert torch.equal(got[n], want[n]), f"{where}: {n}"


def _worker(rank: int, world: int) -> None:
    from moe_kernels.train.distributed import Parallel, clip_grad_norm

    mp = pytest.MonkeyPatch()
    torch.manual_seed(0)
    ref = build_model(PRESETS["tiny-deepseek-v3"](num_experts=8, num_layers=4))
    model = apply_expert_parallel(copy.deepcopy(ref))
    edp = dist.group.WORLD  # expert gradients summed over a group too (here: both ranks), to exercise that path
    bucket = 16 * 1024  # many buckets from a small model
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    # Bucketed, synchronous: equal bit for bit to one flat buffer, no collective past a bucket (+ one parameter).
    _backward(model, rank)
    want = _flat_reference(model, world, edp)
    calls = _Calls(mp, "all_reduce")
    all_reduce_gradients(model, None, expert_dp_group=edp, bucket_bytes=bucket)
    mp.undo()
    _assert_equal(_grads(model), want, "bucketed")
    assert len(calls.sizes) > 4 and max(calls.sizes) <= bucket + largest, calls.sizes

    # Overlapped with the backward: the collectives leave from the hooks, the result is the same.
    model.zero_grad(set_to_none=True)
    reducer = GradientReducer(model, None, expert_dp_group=edp, bucket_bytes=bucket, overlap=True, max_in_flight=1)
    in_flight = []
    launch = reducer._launch
    mp.setattr(reducer, "_launch", lambda b, copy: (launch(b, copy), in_flight.append(len(reducer._in_flight))))
    calls = _Calls(mp, "all_reduce")
    _backward(model, rank)
    during_backward = len(calls.sizes)
    reducer.reduce()
    mp.undo()
    # Every parameter gets a gradient: every bucket leaves during the backward, at most two at a time.
    assert all(p.grad is not None for p in model.parameters())
    assert during_backward == len(calls.sizes) == len(reducer.buckets) > 4 and max(in_flight) <= 2, (
        during_backward, len(calls.sizes), len(reducer.buckets), in_flight)
    _assert_equal(_grads(model), want, "overlapped")

    # Accumulation over two backward passes, the first under no_sync.
    model.zero_grad(set_to_none=True)
    with reducer.no_sync():
        _backward(model, rank, step=1)
        _backward(model, rank, step=2)
    want = _flat_reference(model, world, edp)
    model.zero_grad(set_to_none=True)
    with reducer.no_sync():
        _backward(model, rank, step=1)
    _backward(model, rank, step=2)
    reducer.reduce()
    _assert_equal(_grads(model), want, "accumulated under no_sync")
    model.zero_grad(set_to_none=True)
    _backward(model, rank, step=3)
    with pytest.raises(RuntimeError, match="no_sync"):
        _backward(model, rank, step=4)
    reducer.remove_hooks()
    reducer.reduce()  # drains what the first backward launched

    # The routers' counts: one all_reduce for all of them.
    routers = [layer.router for layer in model.moe_layers()]
    assert len(routers) == 3 and all(r.tokens_seen is not None for r in routers)
    counts = [r.tokens_seen.clone() for r in routers]
    calls = _Calls(mp, "all_reduce")
    all_reduce_expert_counts(model)
    mp.undo()
    assert len(calls.sizes) == 1
    for r, mine in zip(routers, counts):
        total = mine.clone()
        dist.all_reduce(total)
        assert torch.equal(r.tokens_seen, total)

    # The foreach norm and clipping of the expert-parallel path equal the one-process ones.
    model.zero_grad(set_to_none=True)
    _backward(model, rank)
    all_reduce_gradients(model)
    full = {}
    experts = {id(p) for p in expert_parameters(model)}
    for n, p in model.named_parameters():
        g = p.grad
        if id(p) in experts:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            g = torch.cat(parts)
        full[n] = g.clone()
    want_norm = torch.nn.utils.get_total_norm(list(full.values()))
    par = Parallel(rank, world, world, dist.group.WORLD, None, False)
    max_norm = float(want_norm) / 4
    norm = clip_grad_norm(model, max_norm, par)
    torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
    coef = (max_norm / (want_norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grads_with_norm_'s
    for n, p in model.named_parameters():
        want_g = full[n] * coef
        if id(p) in experts:
            want_g = want_g.chunk(world)[rank]
        torch.testing.assert_close(p.grad, want_g, rtol=1e-6, atol=0, msg=lambda m: f"{n}: {m}")

    # Single-tensor sequence collectives equal the list ones (and the all_reduce fallback of an older gloo).
    gathers = _Calls(mp, "all_gather")
    for shape, dim in (((6, 4), 0), ((1, 6, 4), 1), ((3, 6, 4), 1), ((2, 3, 6, 4), 2), ((2, 3, 6), -1)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        got = _gather_chunks(x, None, dim)
        assert got.is_contiguous() and torch.equal(got, torch.cat(parts, dim=dim)), (shape, dim)
        total = got.clone()
        dist.all_reduce(total)
        want_chunk = total.chunk(world, dim=dim)[rank]
        got = _reduce_scatter_chunks(got, None, dim)
        assert got.is_contiguous() and torch.equal(got, want_chunk), (shape, dim)
        _NO_TENSOR_REDUCE_SCATTER.add("gloo")
        try:
            assert torch.equal(_reduce_scatter_chunks(torch.cat(parts, dim=dim), None, dim), want_chunk)
        finally:
            _NO_TENSOR_REDUCE_SCATTER.discard("gloo")
    mp.undo()
    assert len(gathers.sizes) == 5  # the reference's, none from the collectives under test


def test_step_overhead():
    run_world(_worker, 2)
