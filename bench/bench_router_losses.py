"""Load-balancing losses, capacity and the expert-bias update, at the specs/perf.md routing shapes.

Bytes, each input read once and each output written once (scores and logits fp32 [T, E], indices
int32 and weights fp32 [T, k], counts int32 [E]):
  aux_loss_fwd_bwd      scores + counts -> loss; backward: grad, one [E] row broadcast over the T rows (as
                        sum's backward returns it, the peer's too: no [T, E] write)
  seq_aux_loss_fwd_bwd  scores + indices -> loss (+ per-sequence counts [B, E]); backward: grad [T, E]
  z_loss_fwd_bwd        logits -> loss (+ lse [T]); backward: logits + lse -> grad [T, E]
  capacity_probs        weights + indices -> weights + indices (keep the C largest weights per expert)
  capacity_position     the same bytes (keep the C earliest pairs per expert)
  expert_bias_update    bias + counts -> bias
  tokens_per_expert     indices -> counts [E]
Every op is host-bound at these sizes, so each case also reports host issue time, kernel time and CUDA-graph
replay time per call (harness.time_modes), ours and the peer's, with the ratio in each mode.
Peer, timed in the same run on the same inputs:
  torch_eager  moe_kernels' PyTorch references called directly, backward through torch.autograd: the
               vectorised compositions (sum over tokens, scatter_add counts, logsumexp, two stable
               sorts + bincount + cumsum for capacity), which run on any device without a host sync.
Checked before timing, on the first input set: losses within 1e-5 relative of the reference, their
gradients within torch.testing's fp32 tolerance, capacity and the bias update exactly equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

import moe_kernels
from moe_kernels.ops.permute import tokens_per_expert_reference
from moe_kernels.ops.router_losses import (
    apply_capacity_reference,
    aux_loss_reference,
    seq_aux_loss_reference,
    update_expert_bias_reference,
    z_loss_reference,
)
from moe_kernels.testing import random_routing

from . import harness as h

# name: (E, k, seq_len)
MODELS = {
    "deepseek-v3": (256, 8, 4096),
    "qwen3-30b-a3b": (128, 8, 4096),
    "mixtral-8x7b": (8, 2, 4096),
}
TOKENS = (4096, 16384)
CPU_MODELS = {"tiny": (16, 4, 16)}
HEADLINE_CASE = "deepseek-v3/T16384"
CAPACITY_FACTOR = 1.0
COEFF = 1e-2


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    E: int
    k: int
    seq_len: int

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}"

    @property
    def shape(self) -> dict[str, int]:
        return dict(T=self.T, E=self.E, k=self.k, seq_len=self.seq_len)


def cases(ctx: h.Context) -> list[Case]:
    return [Case(*c) for c in h.model_sweep(ctx, MODELS, CPU_MODELS, TOKENS, (16384,))]


def make_inputs(ctx: h.Context, c: Case, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    dev = ctx.device
    logits = torch.randn(c.T, c.E, generator=g, device=dev)
    scores = torch.softmax(logits, -1)
    idx = random_routing(c.T, c.E, c.k, kind="zipf", seed=seed).to(dev)
    weights = torch.rand(c.T, c.k, generator=g, device=dev)
    return {
        "logits": logits,
        "scores": scores,
        "indices": idx,
        "counts": moe_kernels.tokens_per_expert(idx, c.E),
        "weights": weights,
        "bias": torch.zeros(c.E, device=dev),
    }


# ---------------------------------------------------------------------------------------------------
# Implementations: (ours, peer) per op; each returns what the check compares


def _ours(op: str, c: Case) -> Callable:
    mk = moe_kernels
    return {
        "aux_loss_fwd_bwd": lambda s, counts: _fwd_bwd(mk.aux_loss(s, counts, c.k, COEFF), s),
        "seq_aux_loss_fwd_bwd": lambda s, idx: _fwd_bwd(mk.seq_aux_loss(s, idx, COEFF, seq_len=c.seq_len), s),
        "z_loss_fwd_bwd": lambda x: _fwd_bwd(mk.z_loss(x, COEFF), x),
        "capacity_probs": lambda w, idx: mk.apply_capacity(w, idx, c.E, CAPACITY_FACTOR, "probs"),
        "capacity_position": lambda w, idx: mk.apply_capacity(w, idx, c.E, CAPACITY_FACTOR, "position"),
        "expert_bias_update": lambda b, counts: _bias(mk.update_expert_bias, b, counts),
        "tokens_per_expert": lambda idx: (mk.tokens_per_expert(idx, c.E),),
    }[op]


def _eager(op: str, c: Case) -> Callable:
    return {
        "aux_loss_fwd_bwd": lambda s, counts: _fwd_bwd(aux_loss_reference(s, counts, c.k, COEFF), s),
        "seq_aux_loss_fwd_bwd": lambda s, idx: _fwd_bwd(seq_aux_loss_reference(s, idx, COEFF, c.seq_len)[0], s),
        "z_loss_fwd_bwd": lambda x: _fwd_bwd(z_loss_reference(x, COEFF)[0], x),
        "capacity_probs": lambda w, idx: apply_capacity_reference(w, idx, c.E, CAPACITY_FACTOR, "probs"),
        "capacity_position": lambda w, idx: apply_capacity_reference(w, idx, c.E, CAPACITY_FACTOR, "position"),
        "expert_bias_update": lambda b, counts: _bias(update_expert_bias_reference, b, counts),
        "tokens_per_expert": lambda idx: (tokens_per_expert_reference(idx, c.E),),
    }[op]


def _fwd_bwd(loss: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


def _bias(fn, bias: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor]:
    fn(bias, counts, 1e-3)
    return (bias,)


OPS = ("aux_loss_fwd_bwd", "seq_aux_loss_fwd_bwd", "z_loss_fwd_bwd", "capacity_probs", "capacity_position",
       "expert_bias_update", "tokens_per_expert")


def op_inputs(op: str, s: dict[str, torch.Tensor]) -> tuple:
    if op == "aux_loss_fwd_bwd":
        return (s["scores"].detach().requires_grad_(), s["counts"])
    if op == "seq_aux_loss_fwd_bwd":
        return (s["scores"].detach().requires_grad_(), s["indices"])
    if op == "z_loss_fwd_bwd":
        return (s["logits"].detach().requires_grad_(),)
    if op == "expert_bias_update":
        return (s["bias"].clone(), s["counts"])
    if op == "tokens_per_expert":
        return (s["indices"],)
    return (s["weights"], s["indices"])


def nbytes(op: str, c: Case) -> int:
    T, E, k = c.T, c.E, c.k
    B = T // c.seq_len
    return {
        "aux_loss_fwd_bwd": T * E * 4 + E * 4 + 4 + E * 4,
        "seq_aux_loss_fwd_bwd": T * E * 4 + T * k * 4 + 4 + B * E * 4 + T * E * 4,
        "z_loss_fwd_bwd": T * E * 4 + 4 + T * 4 + (T * E * 4 + T * 4 + T * E * 4),
        "capacity_probs": 4 * T * k * 4,
        "capacity_position": 4 * T * k * 4,
        "expert_bias_update": 3 * E * 4,
        "tokens_per_expert": T * k * 4 + E * 4,
    }[op]


def check(c: Case, op: str, s: dict[str, torch.Tensor]) -> None:
    what = f"{c.name} {op}"
    ours = _ours(op, c)(*op_inputs(op, s))
    ref = _eager(op, c)(*op_inputs(op, s))
    for i, (a, b) in enumerate(zip(ours, ref)):
        if op.startswith("capacity") or op in ("expert_bias_update", "tokens_per_expert"):
            h.check_exact(f"{what} output {i}", a, b)
        elif i == 0:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9, msg=lambda m: f"{what} loss: {m}")
        else:
            torch.testing.assert_close(a, b, msg=lambda m: f"{what} grad: {m}")


def timed(c: Case, sets: list[dict]) -> Iterator[tuple[str, Callable, Callable, list[tuple]]]:
    for op in OPS:
        yield op, _ours(op, c), _eager(op, c), [op_inputs(op, s) for s in sets]


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    sets = [make_inputs(ctx, c, ctx.seed + i) for i in range(ctx.n_input_sets)]
    for op in OPS:
        check(c, op, sets[0])
    # Every event-timed call first, then the modes (time_modes profiles; nothing eager is timed after it).
    timed_all = [(op, ours, eager, inputs, ctx.time(ours, inputs), ctx.time(eager, inputs))
                 for op, ours, eager, inputs in timed(c, sets)]
    return [h.make_result(ctx, op=op, case=c.name, shape=c.shape, dtype=torch.float32, timing=t,
                          nbytes=nbytes(op, c), flops=0, peers={"torch_eager": peer},
                          peer_variant={"torch_eager": "reference"}, modes=ctx.time_modes(ours, inputs),
                          peer_modes={"torch_eager": ctx.time_modes(eager, inputs)})
            for op, ours, eager, inputs, t, peer in timed_all]


def headline(results: list[h.Result]) -> list[str]:
    case = HEADLINE_CASE if any(r.case == HEADLINE_CASE for r in results) else results[0].case
    return [f"{r.op} {case}: {r.us:.1f} us, {r.speedup['torch_eager']:.2f}x torch eager"
            for r in results if r.case == case]


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "router_losses", cases(ctx), run_case)
    return h.Report(results, headline(results) if results else [], failures, skipped)
