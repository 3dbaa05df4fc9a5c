"""The NVLink backend's kernels on virtual ranks: P ranks' buffers in one process on one device, the
barrier replaced by stream order (on a GPU, and on the CPU-executed kernels in CI).

Every rank's output and gradients must equal the one-rank layer on that rank's tokens bit for bit: the
rows arrive in the same order and combine sums the same products in the same order (fp32, ascending
slot). The stress cases of specs/dispatch.md: every token to one rank, ranks without tokens, -1 slots,
T = 0 and 1, odd H, repeated and interleaved calls, FP8 and byte payloads with their scales, capacity
overflow, T past max_tokens_per_rank. Also: what the autograd keeps goes through save_for_backward (saved-
tensor hooks see it); the ranks agree on the buffers' layout once per layout (errors name the rank); and
expert tensor parallelism gathers tokens padded to the dispatcher's max_tokens_per_rank without a host sync.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_kernels import _ext
from moe_kernels.dispatch import LocalDispatcher
from moe_kernels.dispatch.nvlink import VirtualNvlinkWorld
from moe_kernels.ops.permute import tokens_per_expert
from tests.dispatch.test_dispatch import _expert_fn, _routing

pytestmark = pytest.mark.gpu


@pytest.fixture
def device(cuda):
    if cuda.type == "cpu" and _ext.emulation() is None:
        pytest.skip("the nvlink backend has no reference path: it needs the kernels (a GPU or MOE_KERNELS_EMULATE=1)")
    return cuda


def _inputs(P, Ts, H, k, E, case, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    xs, ws, idx, gouts = [], [], [], []
    for r, T in enumerate(Ts):
        xs.append(torch.randn(T, H, generator=gen).to(dtype).to(device).requires_grad_())
        idx.append(_routing(case, T, k, E, P, gen).to(device))
        ws.append(torch.rand(T, k, generator=gen).to(device).requires_grad_())
        gouts.append(torch.randn(T, H, generator=gen).to(dtype).to(device))
    return xs, ws, idx, gouts


def _layer(world_or_disp, ds, El, scale, shift, weighted):
    return [_expert_fn(d.x, d.local_indices, r * El, scale, shift, None if weighted else d.weights)
            for r, d in enumerate(ds)]


def _reference(x, w, idx, E, gout, scale, shift, weighted, align):
    """The one-rank layer on one rank's tokens."""
    disp = LocalDispatcher(E)
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    d = disp.dispatch(x, w, idx, align=align)
    y = _expert_fn(d.x, d.local_indices, 0, scale, shift, None if weighted else d.weights)
    out = disp.combine(y, d.handle, weighted=weighted)
    dx, dw = torch.autograd.grad((out.float() * gout.float()).sum(), (x, w), allow_unused=True)
    return out, dx, torch.zeros_like(w) if dw is None else dw


def _check_world(P, Ts, H, k, E, case, dtype, align, weighted, device, *, seed=0, capacity=None, M=None, world=None):
    xs, ws, idx, gouts = _inputs(P, Ts, H, k, E, case, dtype, device, seed)
    El = E // P
    world = world or VirtualNvlinkWorld(E, P, max_tokens_per_rank=M or max(max(Ts), 1), capacity=capacity,
                                        device=device)
    scale = torch.linspace(0.5, 2.0, E, device=device)
    shift = torch.linspace(-1.0, 1.0, E, device=device)
    ds = world.dispatch(xs, ws, idx, align=align)
    outs = world.combine(_layer(world, ds, El, scale, shift, weighted), [d.handle for d in ds], weighted=weighted)
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, gouts))
    grads = torch.autograd.grad(loss, [*xs, *ws], allow_unused=True)
    where = f"P={P} T={Ts} H={H} k={k} E={E} {case} {dtype} align={align} weighted={weighted}"
    counts = tokens_per_expert(torch.cat([i.reshape(-1, 1) for i in idx]).cpu(), E)
    for r in range(P):
        ref, rdx, rdw = _reference(xs[r], ws[r], idx[r], E, gouts[r], scale, shift, weighted, align)
        dx = grads[r] if grads[r] is not None else torch.zeros_like(xs[r])
        dw = grads[P + r] if grads[P + r] is not None else torch.zeros_like(ws[r])
        assert outs[r].dtype == dtype and outs[r].shape == (Ts[r], H), where
        for name, got, want in (("out", outs[r], ref), ("dx", dx, rdx), ("dweights", dw, rdw)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {r} {name}: {where}")
        # This rank's grouped rows: every rank's pairs for its experts, padded; padding rows carry -1, 0.
        d = ds[r]
        mine = counts[r * El : (r + 1) * El].to(device)
        assert torch.equal(d.group_sizes, ((mine + align - 1) // align * align).int()), where
        starts = torch.cumsum(d.group_sizes, 0) - d.group_sizes
        for e in range(El):
            rows = slice(int(starts[e]), int(starts[e]) + int(d.group_sizes[e]))
            n = int(mine[e])
            assert torch.all(d.local_indices[rows][:n] == e) and torch.all(d.local_indices[rows][n:] == -1), where
            assert torch.all(d.weights[rows][n:] == 0) and torch.all(d.x[rows][n:] == 0), where
        assert torch.all(d.local_indices[int(d.group_sizes.sum()) :] == -1), where
    return world, outs, grads


@pytest.mark.parametrize("P", [2, 4, 8])
def test_nvlink_virtual_ranks_equal_one_rank(P, device):
    Ts = [[3, 0], [0, 1, 7, 5], [4, 0, 1, 6, 2, 3, 0, 5]][[2, 4, 8].index(P)]
    E = 2 * P
    for case in ("uniform", "hot", "one_rank", "dropped"):
        _check_world(P, Ts, 13, 3, E, case, torch.float32, 1, True, device)  # odd H, 4-byte vectors
    _check_world(P, Ts, 16, 4, E, "uniform", torch.bfloat16, 8, True, device, seed=1)  # 16-byte vectors, align
    _check_world(P, Ts, 5, 2, E, "uniform", torch.bfloat16, 1, False, device, seed=2)  # 2-byte vectors, row weights


def test_nvlink_one_token_and_k_past_local_experts(device):
    # T = 1 on every rank; k = 8 of E = 8 over 2 ranks: more slots per token than local experts (k > El).
    _check_world(2, [1, 1], 8, 8, 8, "uniform", torch.float32, 2, True, device)
    _check_world(2, [1, 0], 8, 1, 4, "hot", torch.float16, 1, True, device)


def test_nvlink_repeated_and_interleaved_calls(device):
    # The buffers are shared by every call: results are bit-identical run to run, and two dispatches in
    # flight (two MoE layers: dispatch A, dispatch B, combine B, combine A) keep their own state.
    P, E, H, k = 4, 8, 12, 2
    world, outs, grads = _check_world(P, [5, 3, 0, 6], H, k, E, "uniform", torch.float32, 4, True, device)
    _, outs2, grads2 = _check_world(P, [5, 3, 0, 6], H, k, E, "uniform", torch.float32, 4, True, device, world=world)
    for a, b in zip([*outs, *grads], [*outs2, *grads2]):
        assert (a is None and b is None) or torch.equal(a, b)

    xs_a, ws_a, idx_a, _ = _inputs(P, [5, 3, 0, 6], H, k, E, "uniform", torch.float32, device, 7)
    xs_b, ws_b, idx_b, _ = _inputs(P, [2, 6, 1, 0], H, k, E, "hot", torch.float32, device, 8)
    da = world.dispatch(xs_a, ws_a, idx_a)
    db = world.dispatch(xs_b, ws_b, idx_b, align=2)
    ob = world.combine([d.x * 2 for d in db], [d.handle for d in db])
    oa = world.combine([d.x * 3 for d in da], [d.handle for d in da])
    for r in range(P):
        for xs, ws, idx, o, f, al in ((xs_a, ws_a, idx_a, oa, 3, 1), (xs_b, ws_b, idx_b, ob, 2, 2)):
            disp = LocalDispatcher(E)
            d = disp.dispatch(xs[r], ws[r], idx[r], align=al)
            assert torch.equal(o[r], disp.combine(d.x * f, d.handle)), f"rank {r}"


def test_nvlink_payloads_with_scales(device):
    # FP8 codes with their 1x128 block scales, and a byte payload of odd width with byte scales (NVFP4's
    # packing): the received rows and scales are exactly the one-rank dispatch's; padding scales are 1.
    from moe_kernels.ops.quant import quantize_fp8

    P, E = 4, 8
    Ts = [6, 0, 3, 5]
    gen = torch.Generator().manual_seed(3)
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=6, device=device)
    for kind in ("fp8", "bytes"):
        xs, ss, ws, idx = [], [], [], []
        for T in Ts:
            if kind == "fp8":
                q, s = quantize_fp8(torch.randn(T, 200, generator=gen), "block")
            else:
                q = torch.randint(0, 256, (T, 7), generator=gen, dtype=torch.uint8)
                s = torch.randint(0, 256, (T, 3), generator=gen, dtype=torch.uint8)
            xs.append(q.to(device))
            ss.append(s.to(device))
            ws.append(torch.rand(T, 3, generator=gen).to(device))
            idx.append(_routing("uniform", T, 3, E, P, gen).to(device))
        ds = world.dispatch(xs, ws, idx, align=4, scales=ss)
        # The one-rank dispatch of all ranks' tokens (source-rank order) restricted to rank r's experts.
        x_all, s_all, w_all, i_all = (torch.cat(t) for t in (xs, ss, ws, idx))
        El = E // P
        for r, d in enumerate(ds):
            local = torch.where((i_all >= r * El) & (i_all < (r + 1) * El), i_all - r * El, -1).int()
            want = LocalDispatcher(El).dispatch(x_all, w_all, local, align=4, scales=s_all)
            rows = int(want.group_sizes.sum())
            assert torch.equal(d.group_sizes, want.group_sizes), kind
            assert torch.equal(d.x[:rows].view(torch.uint8), want.x[:rows].view(torch.uint8)), kind
            assert torch.equal(d.scales[:rows], want.scales[:rows]), kind
            assert torch.equal(d.weights[:rows], want.weights[:rows]), kind
            assert torch.equal(d.local_indices[:rows], want.local_indices[:rows]), kind


def _capacity_drops(idx_list, P, El, cap):
    """The documented rule: per destination, (source rank, token) order, a token whose expert rows end past
    `cap` is dropped there (its slots on that rank count as routed nowhere). Also counts the dropped tokens
    whose rows straddle the capacity (start inside it, end past it)."""
    used = [0] * P
    dropped = straddled = 0
    out = []
    for idx in idx_list:
        idx = idx.cpu().clone()
        for t in range(idx.shape[0]):
            for d in range(P):
                mine = (idx[t] >= d * El) & (idx[t] < (d + 1) * El)
                m = int(mine.sum())
                if not m:
                    continue
                if used[d] + m > cap:
                    idx[t][mine] = -1
                    dropped += 1
                    straddled += used[d] < cap
                used[d] += m
        out.append(idx)
    return out, dropped, straddled


def _check_capacity(P, E, k, H, Ts, cap, align, seed, device):
    """Dispatch and combine past `cap`: the drops follow `_capacity_drops`, are counted once, and each rank's
    rows and output equal a local dispatch of the tokens it kept. Returns the number of straddling drops."""
    xs, ws, idx, _ = _inputs(P, Ts, H, k, E, "uniform", torch.float32, device, seed)
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=max(Ts), capacity=cap, device=device)
    ds = world.dispatch(xs, ws, idx, align=align)
    outs = world.combine([d.x * 2 for d in ds], [d.handle for d in ds])
    kept, n_dropped, n_straddled = _capacity_drops(idx, P, E // P, cap)
    assert n_dropped > 0
    counts = tokens_per_expert(torch.cat([i.reshape(-1, 1) for i in kept]), E).to(device)
    El = E // P
    for r in range(P):
        assert int(ds[r].group_sizes.sum()) <= cap + El * (align - 1)
        mine = counts[r * El : (r + 1) * El]
        assert torch.equal(ds[r].group_sizes, ((mine + align - 1) // align * align).int()), f"cap {cap} rank {r}"
        disp = LocalDispatcher(E)
        d = disp.dispatch(xs[r], ws[r], kept[r].to(device), align=align)
        assert torch.equal(outs[r], disp.combine(d.x * 2, d.handle)), f"cap {cap} rank {r}"
    with pytest.warns(RuntimeWarning, match=f"{n_dropped} token copies went past capacity={cap}"):
        assert world.dropped_tokens() == n_dropped
    assert world.dropped_tokens() == 0  # counted once
    return n_straddled


def test_nvlink_capacity_drops_are_counted_never_written_out_of_bounds(device):
    straddled = 0
    for cap, align, seed in ((7, 2, 11), (5, 1, 12), (6, 1, 13), (9, 1, 14), (8, 4, 15)):
        straddled += _check_capacity(4, 8, 3, 16, [6, 5, 0, 6], cap, align, seed, device)
    assert straddled > 0  # the cases include tokens whose rows start inside the capacity and end past it


def test_nvlink_capacity_reached_past_the_first_scan_pass(device):
    # A rank with more tokens than the send kernel's block has threads (256): the scan of the rows each token
    # sends runs in passes that reuse its shared storage, and the capacity is reached in the second pass.
    for cap, align, seed in ((290, 1, 11), (270, 2, 12)):
        _check_capacity(2, 4, 2, 8, [300, 40], cap, align, seed, device)


def test_nvlink_bad_input(device):
    world = VirtualNvlinkWorld(8, 2, max_tokens_per_rank=4, device=device)
    x = [torch.randn(5, 8, device=device), torch.randn(2, 8, device=device)]
    w = [torch.rand(5, 2, device=device), torch.rand(2, 2, device=device)]
    i = [torch.zeros(5, 2, dtype=torch.int32, device=device), torch.zeros(2, 2, dtype=torch.int32, device=device)]
    with pytest.raises(ValueError, match="5 tokens on rank 0, more than max_tokens_per_rank=4"):
        world.dispatch(x, w, i)
    with pytest.raises(ValueError, match="one tensor per rank"):
        world.dispatch(x[:1], w[:1], i[:1])
    x[0], w[0], i[0] = x[0][:3], w[0][:3], i[0][:3]
    # What sets the peer buffers' layout differs between ranks: the error names the rank and its value.
    with pytest.raises(ValueError, match="rank 1 passes `x` with hidden size 4, rank 0 with 8: every rank must "
                                         "pass the same k, hidden size, dtype and scales"):
        world.dispatch([x[0], torch.randn(2, 4, device=device)], w, i)
    with pytest.raises(ValueError, match="rank 1 passes `x` with k 3, rank 0 with 2"):
        world.dispatch(x, [w[0], torch.rand(2, 3, device=device)], [i[0], torch.zeros(2, 3, dtype=torch.int32,
                                                                                     device=device)])
    with pytest.raises(ValueError, match="rank 1 passes `x` with dtype torch.bfloat16, rank 0 with torch.float32"):
        world.dispatch([x[0], x[1].bfloat16()], w, i)
    s = [torch.ones(3, 2, device=device), torch.ones(2, 2, device=device)]
    with pytest.raises(ValueError, match="rank 1 passes `x` with scale width 1, rank 0 with 2"):
        world.dispatch(x, w, i, scales=[s[0], torch.ones(2, 1, device=device)])
    with pytest.raises(ValueError, match="rank 1 passes `x` with scale dtype torch.uint8, rank 0 with torch.float32"):
        world.dispatch(x, w, i, scales=[s[0], s[1].to(torch.uint8)])
    with pytest.raises(ValueError, match="`weights` and `indices`"):
        world.dispatch(x, [torch.rand(3, 1, device=device), w[1]], i)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        VirtualNvlinkWorld(8, 2, max_tokens_per_rank=0, device=device)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        VirtualNvlinkWorld(8, 3, max_tokens_per_rank=4, device=device)


def test_nvlink_grouped_experts_equal_one_rank(device):
    # Real experts (grouped GEMMs, SwiGLU) on the dispatched rows, forward and backward, with memory the
    # kernels should not read filled with NaN under emulation: every rank's output and input gradients
    # equal the full layer's on its tokens, and each rank's expert gradients the full experts' gradients
    # summed over every rank's tokens (fp32: within the GEMMs' rounding).
    from moe_kernels.nn import GroupedExperts

    P, E, k, H, F = 2, 8, 2, 32, 16
    El = E // P
    torch.manual_seed(0)
    full = GroupedExperts(E, H, F, device=device)
    shards = [GroupedExperts(El, H, F, device=device) for _ in range(P)]
    with torch.no_grad():
        for r, s in enumerate(shards):
            s.w13.copy_(full.w13[r * El : (r + 1) * El])
            s.w2.copy_(full.w2[r * El : (r + 1) * El])
    xs, ws, idx, gouts = _inputs(P, [9, 6], H, k, E, "uniform", torch.float32, device, 5)
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=9, device=device)
    ds = world.dispatch(xs, ws, idx, align=4)
    outs = world.combine([s(d.x, d.group_sizes) for s, d in zip(shards, ds)], [d.handle for d in ds])
    loss = sum((o * g).sum() for o, g in zip(outs, gouts))
    grads = torch.autograd.grad(loss, [*xs, *ws, *[p for s in shards for p in (s.w13, s.w2)]])
    ref_loss = 0
    for r in range(P):
        disp = LocalDispatcher(E)
        d = disp.dispatch(xs[r], ws[r], idx[r], align=4)
        out = disp.combine(full(d.x, d.group_sizes), d.handle)
        torch.testing.assert_close(outs[r], out, rtol=1e-5, atol=1e-6)
        ref_loss = ref_loss + (out * gouts[r]).sum()
    ref = torch.autograd.grad(ref_loss, [*xs, *ws, full.w13, full.w2])
    for r in range(P):
        torch.testing.assert_close(grads[r], ref[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads[P + r], ref[P + r], rtol=1e-5, atol=1e-6)
        for j, w in enumerate((ref[2 * P], ref[2 * P + 1])):
            torch.testing.assert_close(grads[2 * P + 2 * r + j], w[r * El : (r + 1) * El], rtol=1e-5, atol=1e-6)


def test_nvlink_fp8_payload_row_weight_gradients(device):
    # Experts that dequantize the FP8 rows and apply the row weights themselves (weighted=False): the
    # weights' gradient travels back beside the (empty) payload gradient, bit-exact.
    from moe_kernels.ops.quant import quantize_fp8

    P, E, k = 2, 4, 2
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=5, device=device)
    gen = torch.Generator().manual_seed(0)
    qs, ss, ws, idx = [], [], [], []
    for T in (5, 3):
        q, s = quantize_fp8(torch.randn(T, 128, generator=gen), "block")
        qs.append(q.to(device))
        ss.append(s.to(device))
        ws.append(torch.rand(T, k, generator=gen).to(device).requires_grad_())
        idx.append(torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32).to(device))

    def expert(d):
        return d.x.float() * d.scales[:, :1] * d.weights[:, None]

    ds = world.dispatch(qs, ws, idx, scales=ss)
    outs = world.combine([expert(d) for d in ds], [d.handle for d in ds], weighted=False)
    gw = torch.autograd.grad(sum(o.sum() for o in outs), ws)
    for r in range(P):
        disp = LocalDispatcher(E)
        w = ws[r].detach().requires_grad_()
        d = disp.dispatch(qs[r], w, idx[r], scales=ss[r])
        out = disp.combine(expert(d), d.handle, weighted=False)
        assert torch.equal(out, outs[r]) and torch.equal(torch.autograd.grad(out.sum(), w)[0], gw[r]), f"rank {r}"


def test_nvlink_repeated_experts_fill_the_default_capacity_without_drops(device):
    # Every slot of every token to one expert (k = 3 > El = 2 local experts): the default capacity is the
    # true worst case, P*M*k rows, so nothing is dropped even with T = max_tokens_per_rank everywhere.
    world, _, _ = _check_world(2, [3, 3], 8, 3, 4, "hot", torch.float32, 1, True, device)
    assert world.dropped_tokens() == 0


def _kept_by_ctx(node) -> list[str]:
    """Names of the tensors (or handles) an autograd node keeps as ctx attributes, outside save_for_backward."""
    from moe_kernels.dispatch.nvlink import NvlinkHandle

    def holds(v):
        if isinstance(v, (list, tuple)):
            return any(holds(e) for e in v)
        return isinstance(v, (torch.Tensor, NvlinkHandle))

    return [name for name, v in vars(node).items() if holds(v)]


def test_nvlink_autograd_keeps_tensors_through_save_for_backward(device):
    # What dispatch and combine keep for the backward goes through save_for_backward, so saved-tensor hooks
    # (activation checkpointing, offload) see all of it: per rank, the handle's tensors (slot map, received
    # rows' sources and grouped rows, layout workspace, group sizes) for each of the two nodes, and combine's
    # fp32 weights and [T*k, H] slot rows. The nodes keep no tensor as an attribute, and hooks that replace
    # every saved tensor with a copy (what an offload does) leave outputs and gradients bit-identical.
    P, E, k, H, M = 2, 8, 2, 32, 9
    Ts = [9, 6]
    world = VirtualNvlinkWorld(E, P, max_tokens_per_rank=M, device=device)
    xs, ws, idx, gouts = _inputs(P, Ts, H, k, E, "uniform", torch.float32, device, 4)

    def step(hooked):
        packed = []

        def pack(t):
            packed.append(t.numel() * t.element_size())
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooked else contextlib.nullcontext():
            ds = world.dispatch(xs, ws, idx, align=4)
            outs = world.combine([d.x * 2 for d in ds], [d.handle for d in ds])  # (the product saves nothing)
        kept = _kept_by_ctx(ds[0].x.grad_fn) + _kept_by_ctx(outs[0].grad_fn)
        grads = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, gouts)), [*xs, *ws])
        return ds, outs, grads, packed, kept

    _, outs, grads, _, _ = step(False)
    ds, h_outs, h_grads, packed, kept = step(True)
    assert kept == [], kept
    X = P * M  # received rows (the default capacity)
    want = 0
    for r, T in enumerate(Ts):
        handle = 4 * (T * k + 1 + X * 2 + X * k + E // P) + ds[r].handle.workspace.numel()
        want += 2 * handle + 4 * T * k + 4 * T * k * H  # both nodes' handles, combine's weights and slot rows
    assert sum(packed) == want, (packed, want)
    for a, b in zip([*outs, *grads], [*h_outs, *h_grads]):
        assert torch.equal(a, b)


def test_nvlink_combine_and_payload_checks(device):
    world = VirtualNvlinkWorld(4, 2, max_tokens_per_rank=4, device=device)
    xs = [torch.randn(3, 8, device=device), torch.randn(2, 8, device=device)]
    ws = [torch.rand(3, 2, device=device), torch.rand(2, 2, device=device)]
    idx = [torch.zeros(3, 2, dtype=torch.int32, device=device), torch.ones(2, 2, dtype=torch.int32, device=device)]
    with pytest.raises(TypeError, match="float32, float16, bfloat16, FP8 or uint8 rows, got `x` in torch.float64"):
        world.dispatch([x.double() for x in xs], ws, idx)
    ds = world.dispatch(xs, ws, idx)
    handles = [d.handle for d in ds]
    with pytest.raises(ValueError, match=f"`y` must be \\[R, H\\] with R = {ds[0].x.shape[0]}"):
        world.combine([ds[0].x[:1], ds[1].x], handles)
    with pytest.raises(TypeError, match="`y` must be float32, float16 or bfloat16 on rank 0"):
        world.combine([ds[0].x.double(), ds[1].x.double()], handles)
    with pytest.raises(ValueError, match="rank 1 passes `y` with dtype torch.float16, rank 0 with torch.float32: "
                                         "every rank must pass the same hidden size and dtype"):
        world.combine([ds[0].x, ds[1].x.half()], handles)
    with pytest.raises(ValueError, match="rank 1 passes `y` with dtype torch.float64, rank 0 with torch.float32"):
        world.combine([ds[0].x, ds[1].x.double()], handles)
    with pytest.raises(TypeError, match="`handle` must be the handle of this backend's dispatch"):
        world.combine([d.x for d in ds], [None, None])
    outs = world.combine([d.x for d in ds], handles)  # the checks leave the call working
    assert [tuple(o.shape) for o in outs] == [(3, 8), (2, 8)]


def _worker_front_end(rank, P, device_type):
    # NvlinkDispatcher's own dispatch/combine (the per-rank front end that the IPC path uses) over a
    # one-rank virtual transport: the same autograd functions and engine as the IPC ranks, only the
    # buffers differ. Output, dx and dweights equal the one-rank layer bit for bit.
    from moe_kernels.dispatch import make_dispatcher
    from moe_kernels.dispatch.nvlink import _VirtualTransport

    dev = torch.device(device_type)
    E, k, H, M = 6, 3, 24, 40
    disp = make_dispatcher("nvlink", E, max_tokens_per_rank=M)
    disp._transport = lambda x, C: _VirtualTransport(1, x.device)
    gathered = []  # the layouts the dispatcher agreed over its group
    gather = disp._all_gather_ints
    disp._all_gather_ints = lambda values, device: gathered.append(values) or gather(values, device)
    scale = torch.linspace(0.5, 2.0, E, device=dev)
    shift = torch.linspace(-1.0, 1.0, E, device=dev)
    for step, (case, T, weighted) in enumerate((("uniform", 17, True), ("hot", 3, True), ("uniform", 0, True),
                                                ("uniform", M, False))):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        w = torch.rand(T, k, generator=gen).to(dev).requires_grad_()
        idx = _routing(case, T, k, E, P, gen).to(dev)
        gout = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
        d = disp.dispatch(x, w, idx, align=8)
        y = _expert_fn(d.x, d.local_indices, 0, scale, shift, None if weighted else d.weights)
        out = disp.combine(y, d.handle, weighted=weighted)
        assert isinstance(out, torch.Tensor) and out.shape == (T, H) and out.dtype == torch.bfloat16, type(out)
        dx, dw = torch.autograd.grad((out.float() * gout.float()).sum(), (x, w), allow_unused=True)
        dw = torch.zeros_like(w) if dw is None else dw
        ref, rdx, rdw = _reference(x, w, idx, E, gout, scale, shift, weighted, 8)
        for name, got, want in (("out", out, ref), ("dx", dx, rdx), ("dweights", dw, rdw)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} step {step} {case}")
    assert disp.dropped_tokens() == 0
    # The layout was agreed once for dispatch and once for combine (the token count is no part of it); the
    # steady state does no collective.
    assert gathered == [[k, H, 2, -1, -1, 17], [k, H, 2, -1, -1, 0]], gathered
    w, idx = torch.rand(4, k, device=dev), torch.zeros(4, k, dtype=torch.int32, device=dev)
    for _ in range(2):
        d = disp.dispatch(torch.randn(4, 8, device=dev), w, idx)  # a new layout: fp32 rows of 8
        disp.combine(d.x, d.handle)
    assert gathered[2:] == [[k, 8, 0, -1, -1, 4], [k, 8, 0, -1, -1, 0]], gathered
    big = M + 1  # an agreed layout: this rank's token count checked on the host, no collective
    with pytest.raises(ValueError, match=f"`x` has {big} tokens, more than max_tokens_per_rank={M}"):
        disp.dispatch(torch.randn(big, 8, device=dev), torch.rand(big, k, device=dev),
                      torch.zeros(big, k, dtype=torch.int32, device=dev))
    assert len(gathered) == 4
    # A peer with another layout (a stub gather standing in for the group): ValueError naming the peer, nothing
    # cached, and the next call asks the group again.
    disp._all_gather_ints = lambda values, device: [values, [values[0], values[1] * 2, *values[2:]]]
    for _ in range(2):
        with pytest.raises(ValueError, match="rank 1 passes `x` with hidden size 32, rank 0 with 16"):
            disp.dispatch(torch.randn(4, 16, device=dev), w, idx)


def test_nvlink_dispatcher_front_end_equals_one_rank(device):
    from tests.distributed import run_world

    run_world(_worker_front_end, 1, device.type)


def _worker_two_ranks(rank, P, device_type):
    # Two gloo ranks. (1) The dispatcher agrees its layout over the group: a rank passing another k, hidden
    # size, dtype, scale width or too many tokens makes every rank raise the same ValueError naming it, before
    # any buffer or kernel. (2) Expert tensor parallelism over the two ranks, each dispatching the pair's
    # gathered tokens through an nvlink dispatcher of its own (a one-rank virtual transport) and computing half
    # of every expert output: each rank's output and gradients equal the one-rank layer's; the gather padded to
    # the nvlink dispatcher's share of max_tokens_per_rank equals the plain gather with padding tokens that
    # route nowhere, and the whole step then runs without a host sync.
    import torch.distributed as dist

    import moe_kernels.parallel.expert_parallel as ep
    from moe_kernels.dispatch import NvlinkDispatcher
    from moe_kernels.dispatch.all_gather import gather_tokens
    from moe_kernels.dispatch.nvlink import _VirtualTransport
    from moe_kernels.testing import HostSyncError, no_host_sync

    dev = torch.device(device_type)
    E, k, H, M = 4, 2, 8, 6
    disp = NvlinkDispatcher(E, max_tokens_per_rank=M)
    one = rank == 1

    def call(T=5, H=8, k=2, dtype=torch.float32, scale_width=None):
        scales = None if scale_width is None else torch.ones(T, scale_width, device=dev)
        disp.dispatch(torch.randn(T, H, device=dev).to(dtype), torch.rand(T, k, device=dev),
                      torch.zeros(T, k, dtype=torch.int32, device=dev), scales=scales)

    for kwargs, msg in (({"k": 2 + one}, "rank 1 passes `x` with k 3, rank 0 with 2"),
                        ({"H": 8 + 8 * one}, "rank 1 passes `x` with hidden size 16, rank 0 with 8"),
                        ({"dtype": torch.bfloat16 if one else torch.float32}, "with dtype torch.bfloat16, rank 0 with "
                                                                               "torch.float32"),
                        ({"scale_width": 1 + one}, "rank 1 passes `x` with scale width 2, rank 0 with 1"),
                        ({"scale_width": 1 if one else None}, "rank 1 passes `x` with scale width 1, rank 0 with none"),
                        ({"T": M + one}, f"`x` has {M + 1} tokens on rank 1, more than max_tokens_per_rank={M}")):
        with pytest.raises(ValueError, match=msg):
            call(**kwargs)
    assert not disp._agreed and disp._engine is None  # nothing agreed, no buffer allocated

    ones = [dist.new_group([r]) for r in range(P)]
    inner = NvlinkDispatcher(E, ones[rank], max_tokens_per_rank=P * M)  # the pair's gathered tokens
    inner._transport = lambda x, C: _VirtualTransport(1, x.device)
    etp = ep.ExpertTensorParallelDispatcher(inner, None)
    scale, shift = torch.linspace(0.5, 2.0, E, device=dev), torch.linspace(-1.0, 1.0, E, device=dev)
    Ts = (5, 2)
    T = Ts[rank]

    def step(x, w, idx):
        d = etp.dispatch(x, w, idx, align=4)
        y = _expert_fn(d.x, d.local_indices, 0, scale, shift) * 0.5  # this rank's half of each expert output
        out = etp.combine(y, d.handle)
        return (out, *torch.autograd.grad((out * gout).sum(), (x, w)))

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen).to(dev).requires_grad_()
    w = torch.rand(T, k, generator=gen).to(dev).requires_grad_()
    idx = _routing("uniform", T, k, E, 1, gen).to(dev)
    gout = torch.randn(T, H, generator=gen).to(dev)
    ref = _reference(x, w, idx, E, gout, scale, shift, True, 4)
    for got, want in zip(step(x, w, idx), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank}: etp over nvlink")

    with pytest.raises(HostSyncError), no_host_sync():
        gather_tokens(x, w, idx, None, None)  # without pad_to: the exchange of T reads the sizes on the host
    plain = gather_tokens(x, w, idx, None, None)  # rank r's tokens at [r*5, r*5 + Ts[r])
    with no_host_sync():
        padded = gather_tokens(x, w, idx, None, None, pad_to=M)  # at [r*M, r*M + Ts[r])
    for r, n in enumerate(Ts):
        for got, want, fill in zip(padded[:3], plain[:3], (0, 0, -1)):
            assert torch.equal(got[r * M : r * M + n], want[r * max(Ts) : r * max(Ts) + n]), f"rank {rank}"
            assert torch.all(got[r * M + n : (r + 1) * M] == fill), f"rank {rank}"
    with pytest.raises(ValueError, match=f"`x` has {T} tokens, more than pad_to=1"):
        gather_tokens(x, w, idx, None, None, pad_to=1)
    # The gather as ExpertTensorParallelDispatcher takes it over an nvlink dispatcher (pad_to: its share of
    # the dispatcher's max_tokens_per_rank): equal results, and no host sync once the layout is agreed.
    assert etp.pad_to == M  # its share of the nvlink dispatcher's max_tokens_per_rank
    with no_host_sync():
        got = step(x, w, idx)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {rank}: etp over nvlink, padded gather")


def test_nvlink_layout_agreed_over_ranks_and_expert_tensor_parallel_gather(device):
    from tests.distributed import run_world

    run_world(_worker_two_ranks, 2, device.type)
