"""The experts' activations, forward and backward, at the routed rows of specs/perf.md's models.

Ops (h: the first expert GEMM's output, R = T k permuted rows, bf16):
  swiglu_fwd_bwd        silu(gate) * up on h [R, 2F] -> [R, F], and its backward (dh from dout and h)
  squared_relu_fwd_bwd  relu(h)^2 on h [R, F] (experts without a gate: Nemotron-H's), and its backward
Bytes, each tensor read or written once per pass (es = 2): swiglu 8 R F es (forward: h 2RF read, RF written;
backward: dout RF and h 2RF read, dh 2RF written); squared_relu 5 R F es (forward 2RF, backward 3RF).
Peer, timed in the same run on the same inputs:
  torch_eager  the same function composed of torch ops, forward and autograd backward: silu(h[:, :F]) * h[:, F:]
               (three kernels forward), torch.square(torch.relu(h)) (two forward, three backward, relu(h) kept).
Checked before timing, on the first input set: squared_relu's output and gradient bit-identical to torch's
composition (both round each product once); swiglu's within two bf16 roundings of it (torch rounds silu(gate)
before the product, the kernel rounds once), and bit-identical to its reference.
Models (GPU): (F, k) deepseek-v3 (2048, 8), qwen3-30b-a3b (768, 8), nemotron-3-nano (1856, 6; squared_relu's
model); T = 8192 tokens (--quick) and 16384.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_kernels.ops.activation import squared_relu, swiglu, swiglu_reference

from . import harness as h

MODELS = {"deepseek-v3": (2048, 8), "qwen3-30b-a3b": (768, 8), "nemotron-3-nano": (1856, 6)}
TOKENS = (8192, 16384)
CPU_MODELS = {"tiny": (64, 2)}


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    F: int
    k: int

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}"


def cases(ctx: h.Context) -> list[Case]:
    return [Case(*c) for c in h.model_sweep(ctx, MODELS, CPU_MODELS, TOKENS, (8192,))]


def _fwd_bwd(fn):
    def run(x, g):
        (dx,) = torch.autograd.grad(fn(x), x, g)
        return dx
    return run


def _torch_swiglu(x):
    f = x.shape[1] // 2
    return F.silu(x[:, :f]) * x[:, f:]


def _torch_squared_relu(x):
    return torch.square(torch.relu(x))


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    dev, dtype = ctx.device, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(ctx.seed)
    R = c.T * c.k
    results = []
    for op, width, ours_fn, peer_fn, passes in (("swiglu_fwd_bwd", 2, swiglu, _torch_swiglu, 8),
                                                ("squared_relu_fwd_bwd", 1, squared_relu, _torch_squared_relu, 5)):
        inputs = [(torch.randn(R, width * c.F, generator=gen, device=dev).to(dtype).requires_grad_(),
                   torch.randn(R, c.F, generator=gen, device=dev).to(dtype)) for _ in range(ctx.n_input_sets)]
        x, g = inputs[0]
        what = f"{c.name} {op}"
        if op == "swiglu_fwd_bwd":
            h.check_exact(f"{what} forward", swiglu(x), swiglu_reference(x.detach()))
            h.check_peer(f"{what} torch's forward", _torch_swiglu(x), swiglu(x))
            h.check_peer(f"{what} torch's backward", _fwd_bwd(_torch_swiglu)(x, g), _fwd_bwd(swiglu)(x, g))
        else:
            h.check_exact(f"{what} forward", squared_relu(x), _torch_squared_relu(x))
            h.check_exact(f"{what} backward", _fwd_bwd(squared_relu)(x, g), _fwd_bwd(_torch_squared_relu)(x, g))
        ours = ctx.time(_fwd_bwd(ours_fn), inputs)
        peer = ctx.time(_fwd_bwd(peer_fn), inputs)
        results.append(h.make_result(ctx, op=op, case=c.name, shape=dict(R=R, F=c.F), dtype=dtype, timing=ours,
                                     nbytes=passes * R * c.F * 2, flops=0, peers={"torch_eager": peer},
                                     peer_variant={"torch_eager": "torch ops, autograd"}))
    return results


def headline(ctx: h.Context, results: list[h.Result]) -> list[str]:
    return [f"{r.op} {r.case}: {r.pct_of_ceiling:.1f}% of copy bandwidth, {r.speedup['torch_eager']:.2f}x torch eager"
            for r in results]


def run(ctx: h.Context) -> h.Report:
    results, failures, skipped = h.run_cases(ctx, "activation", cases(ctx), run_case)
    return h.Report(results, headline(ctx, results) if results else [], failures, skipped)
