"""permute / unpermute, forward and backward, at the specs/perf.md shapes.

Bytes, each input read once and each output written once (n = routed (token, slot) pairs, P = rows
permute writes including zero padding = sum(group_sizes), R = rows of x_perm; index tensors 4 B):
  permute fwd     x T*H + indices T*k       -> x_perm P*H + row_map T*k + group_sizes E
  unpermute fwd   y n*H + row_map + weights  -> out T*H
  permute bwd     d x_perm n*H + row_map     -> dx T*H
  unpermute bwd   dout T*H + y n*H + row_map + weights -> dy R*H (unmapped rows are zeroed) + dweights
Peers, timed in the same run on the same inputs. A peer's time for an op is its fastest variant's, the
result's peer_variant names that variant, and its extra holds every variant's time ("peer[variant]_us"):
  torch_eager  what a capable PyTorch user writes, vectorised, no Python loop over experts or tokens:
    argsort_index_select  permute: stable argsort + bincount + index_select; its backward is
                          torch.autograd's, the index_select's index_add_ of d x_perm into dx in bf16
                          (atomic adds on a GPU).
    gather_bwd_fp32       permute backward without atomics (permute's map is injective, so its backward
                          is a gather): the same forward, and dx = d_x_perm[row_map] viewed [T, k, H]
                          (dropped slots masked to zero), summed over k in fp32, then bf16.
    gather_bwd_bmm        the same gather, summed by torch.bmm(slot mask [T, 1, k], gathered [T, k, H]) in
                          bf16: the 0/1 mask is exact in bf16 and the GEMM accumulates in fp32, one rounding.
                          The gather_bwd variants are timed for the backward only (their forward is
                          argsort_index_select's, through a torch.autograd.Function).
    index_add_fp32        unpermute: fp32 y[row_map] * weights index_add_ into [T, H] fp32 (Megatron's
                          torch path).
    gather_sum_fp32       unpermute: y[row_map] viewed [T, k, H], times the weights and summed over k,
                          products and sum in fp32 (materialises [T, k, H] fp32 products).
    gather_bmm_fp32       unpermute: y[row_map] viewed [T, k, H], upcast, then one batched GEMV
                          torch.bmm(weights [T, 1, k], gathered [T, k, H]) accumulating in fp32 (fp32
                          weights: a bf16 bmm would round the weights to bf16 and miss the reference by
                          more than bf16 precision where the k terms cancel).
    The unpermute variants' backward is torch.autograd's through their fp32 ops.
  reference    moe_kernels' PyTorch reference called directly, forward only, on the CPU.
Checked before timing, on the first input set, against moe_kernels' references: our permute
outputs (x_perm on its first P rows), unpermute, dx and dy bit-exact, dweights within fp32 rounding
(moe_kernels.testing's policy); each peer variant's forward, and the gather_bwd variants' dx, within
its dtype's precision (harness.check_peer). The other peer gradients come from torch.autograd and are
not checked (argsort_index_select's dx accumulates in bf16).

A fifth op per case, permute_quantize_fp8: the fused permute + FP8 1x128 quantization as the FP8 recipe
calls it (keep_rows: E4M3 codes, scales and the bf16 rows, from one read of x), against its peer
  moe_kernels_unfused  permute, then quantize_fp8(x_perm, "block") (the same outputs, one more pass).
Bytes: x T*H*2 + indices -> x_perm P*H*2 + codes P*H + scales P*ceil(H/128)*4 + row_map + group_sizes.
Checked first: codes and scales bit-exact against permute_quantize_fp8's reference on the first P rows.

Every case is a result of every op (geometric mean and worst case per op and peer in the summaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

import moe_kernels
from moe_kernels.ops.permute import (
    permute_quantize_fp8_reference,
    permute_reference,
    unpermute_bwd_reference,
    unpermute_reference,
)
from moe_kernels.testing import assert_within_fp32_rounding, random_routing

from . import bars
from . import harness as h

# name: (H, E, k). Permute runs over all E experts, before any expert-parallel dispatch.
MODELS = {
    "deepseek-v3": (7168, 256, 8),
    "qwen3-235b": (4096, 128, 8),
    "qwen3-30b-a3b": (2048, 128, 8),
    "mixtral-8x7b": (4096, 8, 2),
    "gpt-oss-120b": (2880, 128, 4),
}
TOKENS = (4096, 8192, 16384)
# Tiny shapes keep the CPU run (CI) to seconds; H=96 is not a power of two on purpose.
CPU_MODELS = {"tiny-h64": (64, 8, 2), "tiny-h96": (96, 8, 2)}
HEADLINE_CASE = "deepseek-v3/T8192/uniform"
BAR = bars.quote("permute")


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    H: int
    E: int
    k: int
    routing: str  # a moe_kernels.testing.random_routing kind
    align: int = 1

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}/{self.routing}" + (f"/align{self.align}" if self.align > 1 else "")

    @property
    def shape(self) -> dict[str, int]:
        return dict(T=self.T, H=self.H, E=self.E, k=self.k, align=self.align)


def cases(ctx: h.Context) -> list[Case]:
    """Every model x tokens x {uniform, zipf}, plus empty experts and align 128 at one shape."""
    if ctx.is_cuda:
        models, tokens = ctx.pick(MODELS, (8192,) if ctx.quick else TOKENS)
        extra = ("deepseek-v3", 8192) if "deepseek-v3" in models else None
    else:
        models, tokens, extra = CPU_MODELS, ((64,) if ctx.quick else (64, 256)), ("tiny-h64", 64)
    routings = ("uniform",) if ctx.quick else ("uniform", "zipf")
    out = [Case(m, T, *models[m], r) for m in models for T in tokens for r in routings]
    if extra is not None:
        model, T = extra
        out += [Case(model, T, *models[model], "zipf"), Case(model, T, *models[model], "empty"),
                Case(model, T, *models[model], "uniform", align=128)]
    return list(dict.fromkeys(out))


def eager_permute(x, indices, num_experts, align=1):
    T, k = indices.shape
    E = num_experts
    flat = indices.reshape(-1).long()  # [T*k]
    key = torch.where(flat < 0, E, flat)  # dropped slots sort last, past every expert's rows
    order = torch.argsort(key, stable=True)  # [T*k] by expert, then token, then slot
    counts = torch.bincount(key, minlength=E + 1)  # [E+1]
    arange = torch.arange(T * k, device=x.device)
    if align == 1:
        group_sizes = counts[:E]
        dest = arange  # [T*k] row of each sorted copy
        x_perm = x.index_select(0, order // k)
    else:
        group_sizes = (counts[:E] + align - 1) // align * align
        pad_before = torch.nn.functional.pad(torch.cumsum(group_sizes - counts[:E], 0), (1, 0))  # [E+1]
        dest = arange + pad_before[key[order]]
        src = torch.full((T * k + min(E, T * k) * (align - 1),), T, device=x.device)  # [R]; T: zero row
        src[dest] = order // k
        x_perm = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, src)
    row_map = torch.empty_like(flat)
    row_map[order] = dest
    row_map = torch.where(flat < 0, -1, row_map).view(T, k).to(torch.int32)
    return x_perm, row_map, group_sizes.to(torch.int32)


def _rows_and_weights(row_map, weights):
    # Dropped slots read row 0 with weight 0, so neither variant needs a data-dependent shape.
    return row_map.reshape(-1).clamp(min=0).long(), torch.where(row_map >= 0, weights, 0.0)


def eager_unpermute_index_add(y, row_map, weights):
    T, k = row_map.shape
    rows, w = _rows_and_weights(row_map, weights)
    tokens = torch.arange(T, device=y.device).repeat_interleave(k)  # [T*k]
    src = y.index_select(0, rows) * w.reshape(-1, 1)  # [T*k, H] fp32, as weights are fp32
    out = torch.zeros(T, y.shape[1], dtype=src.dtype, device=y.device).index_add_(0, tokens, src)
    return out.to(y.dtype)


def eager_unpermute_gather_sum(y, row_map, weights):
    T, k = row_map.shape
    rows, w = _rows_and_weights(row_map, weights)
    gathered = y.index_select(0, rows).view(T, k, -1)  # [T, k, H]
    return (gathered * w.unsqueeze(-1)).sum(1).to(y.dtype)  # fp32 products and sum


def eager_unpermute_gather_bmm(y, row_map, weights):
    T, k = row_map.shape
    rows, w = _rows_and_weights(row_map, weights)
    gathered = y.index_select(0, rows).view(T, k, -1)  # [T, k, H]
    # fp32 operands: bf16 ones would round the fp32 routing weights before the sum.
    return torch.bmm(w.view(T, 1, k), gathered.float()).view(T, -1).to(y.dtype)  # [T, H]


def eager_permute_bwd_gather_sum(d_x_perm, row_map):
    """dx [T, H] = sum over k of d_x_perm[row_map] (dropped slots: zero), in fp32: permute's map is
    injective, so its backward is a gather, no atomics."""
    T, k = row_map.shape
    gathered = d_x_perm.index_select(0, row_map.reshape(-1).clamp(min=0).long()).view(T, k, -1)  # [T, k, H]
    kept = torch.where((row_map >= 0).unsqueeze(-1), gathered, 0)
    return kept.sum(1, dtype=torch.float32).to(d_x_perm.dtype)


def eager_permute_bwd_gather_bmm(d_x_perm, row_map):
    """The same sum as one bf16 batched GEMV by the 0/1 slot mask [T, 1, k]: the mask is exact in bf16,
    the GEMM accumulates in fp32 and rounds once, and the mask costs no pass of its own."""
    T, k = row_map.shape
    gathered = d_x_perm.index_select(0, row_map.reshape(-1).clamp(min=0).long()).view(T, k, -1)  # [T, k, H]
    kept = (row_map >= 0).to(d_x_perm.dtype).view(T, 1, k)
    return torch.bmm(kept, gathered).view(T, -1)


class _EagerPermute(torch.autograd.Function):
    """eager_permute's forward with a given gather backward (`bwd(d_x_perm, row_map) -> dx`)."""

    @staticmethod
    def forward(ctx, x, indices, num_experts, align, bwd):
        x_perm, row_map, group_sizes = eager_permute(x, indices, num_experts, align)
        ctx.save_for_backward(row_map)
        ctx.bwd = bwd
        ctx.mark_non_differentiable(row_map, group_sizes)
        return x_perm, row_map, group_sizes

    @staticmethod
    def backward(ctx, d_x_perm, _d_row_map, _d_group_sizes):
        (row_map,) = ctx.saved_tensors
        return ctx.bwd(d_x_perm, row_map), None, None, None, None


def eager_permute_with_backward(bwd: Callable) -> Callable:
    def permute(x, indices, num_experts, align=1):
        return _EagerPermute.apply(x, indices, num_experts, align, bwd)

    return permute


@dataclass(frozen=True)
class Impl:
    permute: Callable | None
    unpermute: Callable | None
    backward: bool  # also time the backward, through torch.autograd
    forward: bool = True  # time the forward (False: a variant that differs from another in its backward only)
    check_backward: bool = False  # a peer whose gradients are checked like its forward (module docstring)


OURS = Impl(moe_kernels.permute, moe_kernels.unpermute, backward=True)


def peer_impls(ctx: h.Context) -> dict[str, dict[str, Impl]]:
    """peer -> variant -> implementation; a peer's time for an op is its fastest variant's."""
    peers = {"torch_eager": {
        "argsort_index_select": Impl(eager_permute, None, backward=True),
        "gather_bwd_fp32": Impl(eager_permute_with_backward(eager_permute_bwd_gather_sum), None, backward=True,
                                forward=False, check_backward=True),
        "gather_bwd_bmm": Impl(eager_permute_with_backward(eager_permute_bwd_gather_bmm), None, backward=True,
                               forward=False, check_backward=True),
        "index_add_fp32": Impl(None, eager_unpermute_index_add, backward=True),
        "gather_sum_fp32": Impl(None, eager_unpermute_gather_sum, backward=True),
        "gather_bmm_fp32": Impl(None, eager_unpermute_gather_bmm, backward=True),
    }}
    if not ctx.is_cuda:
        peers["reference"] = {"reference": Impl(permute_reference, unpermute_reference, backward=False)}
    return peers


def make_inputs(ctx: h.Context, c: Case, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    dev, bf16 = ctx.device, torch.bfloat16
    x = torch.randn(c.T, c.H, generator=g, device=dev, dtype=bf16)  # [T, H]; also unpermute's dout
    indices = random_routing(c.T, c.E, c.k, kind=c.routing, seed=seed, device=dev)  # [T, k]
    x_perm, row_map, group_sizes = permute_reference(x, indices, c.E, c.align)
    return {
        "x": x,
        "indices": indices,
        "row_map": row_map,  # [T, k]
        "group_sizes": group_sizes,  # [E]
        "weights": torch.randn(c.T, c.k, generator=g, device=dev).softmax(-1),  # [T, k] fp32
        # [R, H] random rows: unpermute's input and the incoming gradient of permute's backward.
        "y": torch.randn(x_perm.shape, generator=g, device=dev, dtype=bf16),
    }


def check(c: Case, s: dict[str, torch.Tensor], name: str, impl: Impl) -> None:
    """Raises AssertionError where `impl` disagrees with the references (module docstring)."""
    ours = impl is OURS
    if impl.permute is not None:
        ref_perm, ref_map, ref_sizes = permute_reference(s["x"], s["indices"], c.E, c.align)
        x_perm, row_map, group_sizes = impl.permute(s["x"], s["indices"], c.E, align=c.align)
        defined = int(ref_sizes.sum())  # rows past sum(group_sizes) are unspecified
        h.check_exact(f"{c.name} {name} permute row_map", row_map, ref_map)
        h.check_exact(f"{c.name} {name} permute group_sizes", group_sizes, ref_sizes)
        h.check_exact(f"{c.name} {name} permute x_perm", x_perm[:defined], ref_perm[:defined])
    if impl.unpermute is not None:
        out = impl.unpermute(s["y"], s["row_map"], s["weights"])
        (h.check_exact if ours else h.check_peer)(
            f"{c.name} {name} unpermute", out, unpermute_reference(s["y"], s["row_map"], s["weights"]))
    if ours or (impl.check_backward and impl.permute is not None):
        x = s["x"].clone().requires_grad_()
        (dx,) = torch.autograd.grad(impl.permute(x, s["indices"], c.E, align=c.align)[0], x, s["y"])
        # Permute's backward is an unweighted unpermute of the incoming gradient.
        (h.check_exact if ours else h.check_peer)(
            f"{c.name} {name} permute dx", dx, unpermute_reference(s["y"], s["row_map"]))
    if ours:
        y, w = s["y"].clone().requires_grad_(), s["weights"].clone().requires_grad_()
        dy, dw = torch.autograd.grad(impl.unpermute(y, s["row_map"], w), (y, w), s["x"])
        R = y.shape[0]
        ref_dy, ref_dw = unpermute_bwd_reference(s["x"], s["row_map"], s["weights"], s["y"], R)
        _, magnitude = unpermute_bwd_reference(s["x"].abs(), s["row_map"], s["weights"], s["y"].abs(), R)
        h.check_exact(f"{c.name} {name} unpermute dy", dy, ref_dy)
        assert_within_fp32_rounding(dw, ref_dw, magnitude, f"{c.name} {name} unpermute dweights")


MODE_OPS = ("permute_bwd", "unpermute_bwd")  # timed with host / kernel / graph modes when ctx.modes


def capturable(c: Case, impl: Impl, s: dict, op: str) -> tuple[Callable, tuple, Callable]:
    """For time_modes' graph time of a backward: (forward + backward in one call, its inputs, the forward
    alone). The backward of a forward recorded outside a capture runs on the forward's stream, outside the
    graph; captured together, replay(whole) - replay(forward) is the backward's time."""
    if op == "permute_bwd":
        def fwd(x, indices, grad_out):
            return impl.permute(x, indices, c.E, align=c.align)[0]

        def whole(x, indices, grad_out):
            return torch.autograd.grad(fwd(x, indices, grad_out), x, grad_out)

        return whole, (s["x"].detach().requires_grad_(), s["indices"], s["y"]), fwd

    def fwd(y, w, row_map, grad_out):
        return impl.unpermute(y, row_map, w)

    def whole(y, w, row_map, grad_out):
        return torch.autograd.grad(fwd(y, w, row_map, grad_out), (y, w), grad_out)

    return whole, (s["y"].detach().requires_grad_(), s["weights"].detach().requires_grad_(), s["row_map"], s["x"]), fwd


def timed_ops(c: Case, impl: Impl, sets: list[dict]) -> Iterator[tuple[str, Callable, list[tuple]]]:
    """Yields (op, fn, inputs per set). A backward's inputs hold one forward graph per set, built
    only when reached, so one op's graphs at most are alive."""
    def grad(out, inputs, grad_out):
        return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

    if impl.forward and impl.permute is not None:
        yield ("permute_fwd", lambda x, i: impl.permute(x, i, c.E, align=c.align),
               [(s["x"], s["indices"]) for s in sets])
    if impl.forward and impl.unpermute is not None:
        yield "unpermute_fwd", impl.unpermute, [(s["y"], s["row_map"], s["weights"]) for s in sets]
    if impl.backward and impl.permute is not None:
        inputs = []
        for s in sets:
            x = s["x"].detach().requires_grad_()
            inputs.append((impl.permute(x, s["indices"], c.E, align=c.align)[0], x, s["y"]))
        yield "permute_bwd", grad, inputs
    if impl.backward and impl.unpermute is not None:
        inputs = []
        for s in sets:
            y, w = s["y"].detach().requires_grad_(), s["weights"].detach().requires_grad_()
            inputs.append((impl.unpermute(y, s["row_map"], w), (y, w), s["x"]))
        yield "unpermute_bwd", grad, inputs


def fused_permute_quantize(x, indices, E, align):
    return moe_kernels.permute_quantize_fp8(x, indices, E, align=align, keep_rows=True)


def unfused_permute_quantize(x, indices, E, align):
    x_perm, row_map, group_sizes = moe_kernels.permute(x, indices, E, align=align)
    q, scale = moe_kernels.quantize_fp8(x_perm, "block")
    return q, scale, row_map, group_sizes, x_perm


def check_fused(c: Case, s: dict[str, torch.Tensor]) -> None:
    rq, rs, rmap, rgs, rperm = permute_quantize_fp8_reference(s["x"], s["indices"], c.E, c.align)
    q, scale, row_map, group_sizes, x_perm = fused_permute_quantize(s["x"], s["indices"], c.E, c.align)
    P = int(rgs.sum())
    h.check_exact(f"{c.name} permute_quantize_fp8 codes", q[:P].view(torch.uint8), rq[:P].view(torch.uint8))
    h.check_exact(f"{c.name} permute_quantize_fp8 scales", scale[:P], rs[:P])
    h.check_exact(f"{c.name} permute_quantize_fp8 x_perm", x_perm[:P], rperm[:P])
    h.check_exact(f"{c.name} permute_quantize_fp8 row_map", row_map, rmap)


def nbytes(op: str, c: Case, s: dict[str, torch.Tensor]) -> int:
    T, k, H, E = c.T, c.k, c.H, c.E
    es = s["x"].element_size()
    n = int((s["row_map"] >= 0).sum())
    P, R = int(s["group_sizes"].sum()), s["y"].shape[0]
    idx = T * k * 4
    return {
        "permute_fwd": T * H * es + idx + P * H * es + idx + E * 4,
        "unpermute_fwd": n * H * es + 2 * idx + T * H * es,
        "permute_bwd": n * H * es + idx + T * H * es,
        "unpermute_bwd": T * H * es + n * H * es + 2 * idx + R * H * es + idx,
        "permute_quantize_fp8": T * H * es + idx + P * H * (es + 1) + P * -(-H // 128) * 4 + idx + E * 4,
    }[op]


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    sets = [make_inputs(ctx, c, ctx.seed + i) for i in range(ctx.n_input_sets)]
    peers = peer_impls(ctx)
    check(c, sets[0], "ours", OURS)
    for peer, variants in peers.items():
        for variant, impl in variants.items():
            check(c, sets[0], f"{peer}[{variant}]", impl)

    ours = {op: ctx.time(fn, inputs) for op, fn, inputs in timed_ops(c, OURS, sets)}
    best: dict[str, dict[str, tuple[h.Timing, str]]] = {}  # op -> peer -> (fastest timing, variant)
    every: dict[str, dict[str, float]] = {}  # op -> "peer[variant]_us" -> us: each variant, in extra
    for peer, variants in peers.items():
        for variant, impl in variants.items():
            for op, fn, inputs in timed_ops(c, impl, sets):
                t = ctx.time(fn, inputs)
                every.setdefault(op, {})[f"{peer}[{variant}]_us"] = t.us
                if peer not in best.setdefault(op, {}) or t.us < best[op][peer][0].us:
                    best[op][peer] = (t, variant)

    # Small-H backward passes can be host-bound: with ctx.modes each backward also gets host issue,
    # kernel and graph-replay time, ours and the fastest variant of each peer.
    modes: dict[str, h.Modes] = {}
    peer_modes: dict[str, dict[str, h.Modes]] = {}
    if ctx.modes:
        for op, fn, inputs in timed_ops(c, OURS, sets):
            if op in MODE_OPS:
                modes[op] = ctx.time_modes(fn, inputs, capture=lambda op=op: capturable(c, OURS, sets[0], op))
        for op in MODE_OPS:
            for peer, (_, variant) in best.get(op, {}).items():
                impl = peers[peer][variant]
                fn, inputs = next((f, i) for o, f, i in timed_ops(c, impl, sets) if o == op)
                peer_modes.setdefault(op, {})[peer] = ctx.time_modes(
                    fn, inputs, capture=lambda op=op, impl=impl: capturable(c, impl, sets[0], op))

    check_fused(c, sets[0])
    inputs = [(s["x"], s["indices"], c.E, c.align) for s in sets]
    ours["permute_quantize_fp8"] = ctx.time(fused_permute_quantize, inputs)
    best["permute_quantize_fp8"] = {"moe_kernels_unfused": (ctx.time(unfused_permute_quantize, inputs),
                                                            "permute + quantize_fp8")}
    results = []
    for op, t in ours.items():
        r = h.make_result(ctx, op=op, case=c.name, shape=c.shape, dtype=torch.bfloat16, timing=t,
                          nbytes=sum(nbytes(op, c, s) for s in sets) // len(sets), flops=0,
                          peers={p: tv[0] for p, tv in best.get(op, {}).items()},
                          peer_variant={p: tv[1] for p, tv in best.get(op, {}).items()},
                          modes=modes.get(op), peer_modes=peer_modes.get(op))
        r.extra.update(every.get(op, {}))
        results.append(r)
    return results


def headline(ctx: h.Context, results: list[h.Result]) -> list[str]:
    case = HEADLINE_CASE if any(r.case == HEADLINE_CASE for r in results) else results[0].case
    lines = []
    for r in results:
        if r.case != case:
            continue
        copy = ctx.ceiling_of(r).copy_gbps
        peer, name = next(((p, n) for p, n in (("torch_eager", "torch eager"), ("moe_kernels_unfused",
                          "permute + quantize_fp8")) if p in r.speedup))
        bar = f" ({BAR})" if peer == "torch_eager" else ""
        lines.append(f"{r.op} {case}: {r.pct_of_ceiling:.1f}% of copy bandwidth ({r.gbps:.0f} of {copy:.0f} GB/s), "
                     f"{r.speedup[peer]:.2f}x {name} ({r.peer_variant[peer]}){bar}")
    return lines


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "permute", cases(ctx), run_case)
    return h.Report(results, headline(ctx, results) if results else [], failures, skipped)
