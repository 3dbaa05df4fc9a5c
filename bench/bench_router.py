"""router_topk, forward and forward+backward, at the specs/perf.md routing configurations.

Bytes, each input read once and each output written once (es = element size of the logits; weights
fp32 and indices int32, 4 B each):
  router_topk_fwd      logits T*E*es (+ expert_bias E*4) -> weights T*k + indices T*k
  router_topk_fwd_bwd  the forward's bytes, plus the backward's: grad weights T*k + logits T*E*es
                       + indices T*k -> grad logits T*E*es (the gradient comes back in the logits' dtype)
Peers, timed in the same run on the same inputs:
  torch_eager  the vectorised composition: activation (+ bias), group scores as the sum of each
               group's top group_score_topk through topk, top group_topk groups, masked_fill of the
               other groups, topk, gather, renormalisation, scaling; softmax renormalised top-k is
               topk of the logits then softmax of the k values. Indices stay int64 as topk returns
               them (no cast to int32 is charged to the peer). Backward through torch.autograd.
  reference    moe_kernels' PyTorch reference called directly (forward, and backward through
               autograd), on the CPU.
Checked before timing, on the first input set, against moe_kernels' references (logits drawn with
torch.randn in fp32, so ties are vanishingly rare):
  ours   indices equal; where the kernel's rounding of exp picks differently at a near-tie (allowed by
         specs/ops.md within 4 ulp), at most IDX_TOKEN_TOL of the tokens may differ, and the run says
         so in its JSON (a `note:` line after the headline). Weights within rtol 1e-5, atol 1e-6 and
         the gradient of the logits within rtol 1e-4, atol 1e-6 (against the reference rounded to the
         logits' dtype, with torch.testing's tolerance for that dtype, when the logits are not fp32),
         on the tokens whose indices agree.
  peers  indices equal except where the peer breaks an exact tie of selection scores differently;
         weights and gradients within their dtype's precision (torch.testing's defaults) on the
         tokens whose indices agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

import moe_kernels
from moe_kernels.ops.router import (GROUP_EPS, router_selection_scores, router_topk_bwd_reference,
                                    router_topk_reference)

from . import bars
from . import harness as h


@dataclass(frozen=True)
class Routing:
    """A router_topk configuration, defaults resolved (num_groups 1 = no group limit)."""

    score: str
    pre_softmax: bool = False
    num_groups: int = 1
    group_topk: int = 1
    group_score_topk: int = 1
    scaling_factor: float = 1.0
    normalize: bool = True  # sigmoid / sqrtsoftplus (softmax: no effect without pre_softmax)
    bias: bool = False  # an fp32 expert_bias [E] (selection only)


DEEPSEEK = Routing("sigmoid", num_groups=8, group_topk=4, group_score_topk=2, scaling_factor=2.5,
                   normalize=True, bias=True)
SOFTMAX_TOPK = Routing("softmax")  # selection by raw logits, softmax over the k chosen
# name: (E, k, routing)
MODELS = {
    "deepseek-v3": (256, 8, DEEPSEEK),
    "qwen3-235b": (128, 8, SOFTMAX_TOPK),
    "qwen3-30b-a3b": (128, 8, SOFTMAX_TOPK),
    "mixtral-8x7b": (8, 2, SOFTMAX_TOPK),
    "gpt-oss-120b": (128, 4, SOFTMAX_TOPK),
}
TOKENS = (4096, 8192, 16384)
# Tiny shapes keep the CPU run (CI) to seconds; both code paths of the peer are covered.
CPU_MODELS = {
    "tiny-groups": (16, 4, Routing("sigmoid", num_groups=4, group_topk=2, group_score_topk=2,
                                   scaling_factor=2.5, normalize=True, bias=True)),
    "tiny-softmax": (16, 4, SOFTMAX_TOPK),
}
HEADLINE_CASE = "deepseek-v3/T16384"
HEADLINE_OP = "router_topk_fwd_bwd"
BAR = bars.quote("router_topk")
IDX_TOKEN_TOL = 1e-4  # fraction of tokens whose indices may differ from the reference (near-ties)


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    E: int
    k: int
    routing: Routing
    dtype: torch.dtype = torch.float32  # of the logits

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}" + ("" if self.dtype == torch.float32 else f"/{str(self.dtype)[6:]}")

    @property
    def shape(self) -> dict[str, int]:
        r = self.routing
        return dict(T=self.T, E=self.E, k=self.k, groups=r.num_groups, group_topk=r.group_topk)


def cases(ctx: h.Context) -> list[Case]:
    """Every model x tokens in fp32 logits, plus bf16 logits for deepseek-v3 (the headline's routing)."""
    if ctx.is_cuda:
        models, tokens = ctx.pick(MODELS, (16384,) if ctx.quick else TOKENS)
        extra = ("deepseek-v3", 16384) if "deepseek-v3" in models else None
    else:
        models, tokens, extra = CPU_MODELS, ((64,) if ctx.quick else (64, 256)), ("tiny-groups", 64)
    out = [Case(m, T, *models[m]) for m in models for T in tokens]
    if extra is not None:
        model, T = extra
        out.append(Case(model, T, *models[model], dtype=torch.bfloat16))
    return out


# ---------------------------------------------------------------------------------------------------
# Implementations: fn(logits, expert_bias or None, k, routing) -> (weights [T, k], indices [T, k])


def ours_router_topk(logits, expert_bias, k: int, r: Routing):
    grouped = r.num_groups > 1
    return moe_kernels.router_topk(
        logits, k, score=r.score, pre_softmax=r.pre_softmax,
        num_groups=r.num_groups if grouped else None, group_topk=r.group_topk if grouped else None,
        group_score_topk=r.group_score_topk if grouped else None, scaling_factor=r.scaling_factor,
        expert_bias=expert_bias, normalize=r.normalize,
    )


def reference_router_topk(logits, expert_bias, k: int, r: Routing):
    return router_topk_reference(logits, k, r.score, r.pre_softmax, r.num_groups, r.group_topk,
                                 r.group_score_topk, r.scaling_factor, expert_bias, r.normalize)


def eager_router_topk(logits, expert_bias, k: int, r: Routing):
    x = logits.float()  # router math in fp32; a no-op for fp32 logits
    T, E = x.shape
    if r.score == "softmax":
        s = x.softmax(-1) if r.pre_softmax else x
        sel = s if expert_bias is None else s + expert_bias  # (pre_softmax only: router_topk refuses it otherwise)
    else:
        s = x.sigmoid() if r.score == "sigmoid" else F.softplus(x).sqrt()
        sel = s if expert_bias is None else s + expert_bias
    if r.num_groups > 1:
        G = r.num_groups
        grouped = sel.view(T, G, E // G)
        group_scores = grouped.topk(r.group_score_topk, dim=-1).values.sum(-1)  # [T, G]
        keep = group_scores.topk(r.group_topk, dim=-1).indices  # [T, g]
        mask = torch.zeros(T, G, dtype=torch.bool, device=x.device).scatter_(1, keep, True)
        sel = grouped.masked_fill(~mask.unsqueeze(-1), -math.inf).view(T, E)
    if r.score == "softmax" and not r.pre_softmax:
        vals, idx = sel.topk(k, dim=-1)
        w = vals.softmax(-1)
    elif r.score == "softmax" and r.normalize:  # the chosen probabilities over their sum
        idx = sel.topk(k, dim=-1).indices
        w = x.gather(1, idx).softmax(-1)
    else:
        idx = sel.topk(k, dim=-1).indices
        w = s.gather(1, idx)
        if r.score != "softmax" and r.normalize:
            w = w / (w.sum(-1, keepdim=True) + GROUP_EPS)
    if r.scaling_factor != 1.0:
        w = w * r.scaling_factor
    return w, idx


@dataclass(frozen=True)
class Impl:
    fn: Callable
    backward: bool  # also time forward+backward, through torch.autograd


OURS = Impl(ours_router_topk, backward=True)


def peer_impls(ctx: h.Context) -> dict[str, dict[str, Impl]]:
    """peer -> variant -> implementation; a peer's time for an op is its fastest variant's."""
    peers = {"torch_eager": {"topk_gather": Impl(eager_router_topk, backward=True)}}
    if not ctx.is_cuda:
        peers["reference"] = {"reference": Impl(reference_router_topk, backward=True)}
    return peers


def make_inputs(ctx: h.Context, c: Case, seed: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    dev = ctx.device
    # fp32 draws: ties (which the kernel and torch.topk may break differently) are vanishingly rare.
    logits = torch.randn(c.T, c.E, generator=g, device=dev).to(c.dtype)  # [T, E]
    bias = 0.1 * torch.randn(c.E, generator=g, device=dev) if c.routing.bias else None  # [E] fp32
    return {
        "logits": logits,
        "expert_bias": bias,
        "grad_weights": torch.randn(c.T, c.k, generator=g, device=dev),  # [T, k] fp32, backward's input
    }


def _tokens_differing(idx: torch.Tensor, ref_idx: torch.Tensor) -> torch.Tensor:
    """[T] bool: tokens whose k indices (in order) differ from the reference's."""
    assert idx.shape == ref_idx.shape, f"indices: shape {tuple(idx.shape)} != {tuple(ref_idx.shape)}"
    return (idx.long() != ref_idx.long()).any(-1)


def check(c: Case, s: dict, name: str, impl: Impl) -> int:
    """Raises AssertionError where `impl` disagrees with the references (module docstring); returns
    the number of tokens whose indices differ from the reference's (within what is allowed)."""
    ours, r, what = impl is OURS, c.routing, f"{c.name} {name}"
    logits, bias, gw = s["logits"], s["expert_bias"], s["grad_weights"]
    ref_w, ref_idx = reference_router_topk(logits, bias, c.k, r)
    x = logits.detach().clone().requires_grad_()
    w, idx = impl.fn(x, bias, c.k, r)

    bad = _tokens_differing(idx, ref_idx)
    n_bad = int(bad.sum())
    if ours:
        h.check_exact(f"{what} indices dtype", idx[:0], ref_idx[:0])  # int32, [*, k]
        allowed = int(IDX_TOKEN_TOL * c.T)
        if n_bad > allowed:
            t = int(torch.nonzero(bad)[0])
            raise AssertionError(f"{what} indices: {n_bad} of {c.T} tokens differ from the reference (at most "
                                 f"{allowed} allowed); first token {t}: {idx[t].tolist()} vs {ref_idx[t].tolist()}")
    elif n_bad:
        # A peer may only break exact ties differently: the same selection scores, in the same order.
        key = router_selection_scores(logits, r.score, r.pre_softmax, bias)[bad]  # before the group limit
        same = key.gather(1, idx[bad].long()) == key.gather(1, ref_idx[bad].long())
        if not bool(same.all()):
            t = int(torch.nonzero(bad)[int(torch.nonzero(~same.all(-1))[0])])
            raise AssertionError(f"{what} indices: token {t} picks {idx[t].tolist()}, the reference "
                                 f"{ref_idx[t].tolist()}, and their selection scores are not tied")
    ok = ~bad

    def close(kind, actual, expected, **tol):
        torch.testing.assert_close(actual[ok], expected[ok], msg=lambda m: f"{what} {kind}: {m}", **tol)

    close("weights", w, ref_w, **(dict(rtol=1e-5, atol=1e-6) if ours else {}))
    (grad,) = torch.autograd.grad(w, x, gw)
    ref_grad = router_topk_bwd_reference(gw, logits, ref_idx, r.score, r.pre_softmax, r.normalize,
                                         r.scaling_factor).to(grad.dtype)
    close("grad logits", grad, ref_grad, **(dict(rtol=1e-4, atol=1e-6) if ours and grad.dtype == torch.float32 else {}))
    return n_bad


def timed_ops(c: Case, impl: Impl, sets: list[dict]) -> Iterator[tuple[str, Callable, list[tuple]]]:
    """Yields (op, fn, inputs per set). forward+backward builds its graph inside the timed call."""
    k, r = c.k, c.routing

    def fwd(logits, bias):
        return impl.fn(logits, bias, k, r)

    def fwd_bwd(x, bias, grad_weights):
        w, _ = impl.fn(x, bias, k, r)
        return torch.autograd.grad(w, x, grad_weights)

    yield "router_topk_fwd", fwd, [(s["logits"], s["expert_bias"]) for s in sets]
    if impl.backward:
        yield ("router_topk_fwd_bwd", fwd_bwd,
               [(s["logits"].detach().requires_grad_(), s["expert_bias"], s["grad_weights"]) for s in sets])


def nbytes(op: str, c: Case) -> int:
    T, E, k = c.T, c.E, c.k
    es = torch.empty((), dtype=c.dtype).element_size()
    fwd = T * E * es + (E * 4 if c.routing.bias else 0) + 2 * T * k * 4
    bwd = T * k * 4 + T * E * es + T * k * 4 + T * E * es
    return {"router_topk_fwd": fwd, "router_topk_fwd_bwd": fwd + bwd}[op]


def run_case(ctx: h.Context, c: Case) -> tuple[list[h.Result], list[str]]:
    sets = [make_inputs(ctx, c, ctx.seed + i) for i in range(ctx.n_input_sets)]
    peers = peer_impls(ctx)
    notes = []
    n = check(c, sets[0], "ours", OURS)
    if n:
        notes.append(f"{c.name}: ours' indices differ from the reference on {n} of {c.T} tokens (allowed: "
                     f"{IDX_TOKEN_TOL:g} of the tokens); weights and gradients checked on the others")
    for peer, variants in peers.items():
        for variant, impl in variants.items():
            n = check(c, sets[0], f"{peer}[{variant}]", impl)
            if n:
                notes.append(f"{c.name}: {peer}[{variant}] breaks exact ties differently on {n} of {c.T} tokens")

    # Every event-timed call first, then the host-bound modes (time_modes profiles: nothing eager is
    # timed after a profile, so no figure carries what profiling leaves behind).
    ours = {op: (ctx.time(fn, inputs), fn, inputs) for op, fn, inputs in timed_ops(c, OURS, sets)}
    best: dict[str, dict[str, tuple[h.Timing, str, Callable, list]]] = {}  # op -> peer -> fastest variant
    for peer, variants in peers.items():
        for variant, impl in variants.items():
            for op, fn, inputs in timed_ops(c, impl, sets):
                t = ctx.time(fn, inputs)
                if peer not in best.setdefault(op, {}) or t.us < best[op][peer][0].us:
                    best[op][peer] = (t, variant, fn, inputs)
    modes = {op: ctx.time_modes(fn, inputs) for op, (_, fn, inputs) in ours.items()}
    peer_modes = {op: {p: ctx.time_modes(v[2], v[3]) for p, v in per.items()} for op, per in best.items()}

    results = [h.make_result(ctx, op=op, case=c.name, shape=c.shape, dtype=c.dtype, timing=t,
                             nbytes=nbytes(op, c), flops=0,
                             peers={p: v[0] for p, v in best.get(op, {}).items()},
                             peer_variant={p: v[1] for p, v in best.get(op, {}).items()},
                             modes=modes[op], peer_modes=peer_modes.get(op))
               for op, (t, _, _) in ours.items()]
    return results, notes


def headline(ctx: h.Context, results: list[h.Result]) -> list[str]:
    case = HEADLINE_CASE if any(r.case == HEADLINE_CASE for r in results) else results[0].case
    lines = []
    for r in results:
        if r.case != case or r.op != HEADLINE_OP:
            continue
        ms, m, copy = r.mode_speedup.get("torch_eager", {}), r.modes, ctx.ceiling_of(r).copy_gbps
        lines.append(
            f"{r.op} {case}: {r.pct_of_ceiling:.1f}% of copy bandwidth ({r.gbps:.0f} of {copy:.0f} GB/s), "
            f"{r.speedup['torch_eager']:.2f}x torch eager (eager vs eager), "
            f"{h.mode_cell(ms.get('graph_us'), ctx, '.2f', 'x')} (replayed vs replayed); host "
            f"{h.mode_cell(m.get('host_us'), ctx)} us a call beside {h.mode_cell(m.get('kernel_us'), ctx)} us "
            f"of kernels ({BAR})")
    return lines


def run(ctx: h.Context) -> h.Report:
    print(f"router on {ctx.device}: ours runs {'the CUDA kernels' if ctx.ours_runs_kernels else 'the reference'}")
    results, failures, notes, skipped = [], [], [], []
    all_cases = cases(ctx)
    for i, c in enumerate(all_cases):
        try:
            rs, ns = run_case(ctx, c)
        except AssertionError as e:  # a wrong result is not timed; the other cases still are
            failures.append(f"{c.name}: {e}")
        except torch.OutOfMemoryError as e:
            h.skip_case("router", c.name, e, skipped)
        else:
            results += rs
            notes += ns
        h.release(ctx)
        ctx.case_done("router", i, len(all_cases))
    ctx.finish("router", results)
    # Index mismatches within the tolerance go after the headline, so they reach stdout and the JSON.
    return h.Report(results, (headline(ctx, results) if results else []) + [f"note: {n}" for n in notes], failures,
                    skipped)
