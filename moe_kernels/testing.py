"""Test and benchmark helpers: the tolerance policy and routing generators.

Tolerance policy (one place, every test uses it):
- Index outputs (row maps, counts, selected experts) and pure data movement compare bit-exactly.
- Reductions the kernels define to match the reference's rounding order (unpermute's fp32 sum in
  ascending slot order) compare bit-exactly.
- Reductions whose order differs from the reference (dot products, GEMMs) are accepted within fp32
  rounding: |a - b| <= 64 * eps_fp32 * sum(|terms|), where sum(|terms|) is the magnitude of the sum.
- Low-precision results against an fp64 reference: the kernel's error is at most twice the error of
  plain PyTorch at the same precision (the flash-attention rule), plus a tiny absolute floor.
- Training curves: a low-precision recipe may move the loss curve less than a change of the
  initialisation seed does (same batches, same machine, measured in the same run). Training amplifies
  any rounding difference chaotically (matmul kernels round differently on Intel and AMD CPUs), so a
  fixed "within N%" measured on one machine is no bound; the seed spread is measured beside the curve.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP32_EPS = torch.finfo(torch.float32).eps


def assert_exact(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.cpu(), expected.cpu()
    if not torch.equal(a, e):
        diff = (a != e) & ~(torch.isnan(a) & torch.isnan(e)) if a.is_floating_point() else a != e
        n = int(diff.sum())
        if n:
            first = tuple(int(i) for i in torch.nonzero(diff)[0])
            raise AssertionError(
                f"{what}: {n} of {a.numel()} elements differ; first at {first}: {a[first].item()} vs {e[first].item()}"
            )


def assert_within_fp32_rounding(actual: Tensor, expected: Tensor, magnitude: Tensor, what: str) -> None:
    """`magnitude` = sum of |terms| of each reduced element (same shape as expected)."""
    a, e, m = actual.detach().double().cpu(), expected.detach().double().cpu(), magnitude.detach().double().cpu()
    tol = 64 * FP32_EPS * m + 1e-30
    err = (a - e).abs()
    bad = err > tol
    if bool(bad.any()):
        i = tuple(int(v) for v in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements beyond fp32 rounding; first at {i}: {a[i].item()} vs {e[i].item()} "
            f"(tolerance {tol[i].item():.3g})"
        )


def assert_close_to_fp64(actual: Tensor, baseline: Tensor, reference64: Tensor, what: str, *, floor: float = 1e-6) -> None:
    """Kernel error vs an fp64 reference is at most 2x plain PyTorch's error at the same precision."""
    ref = reference64.detach().double().cpu()
    assert actual.shape == ref.shape == baseline.shape, f"{what}: shapes {actual.shape}, {baseline.shape}, {ref.shape}"
    if ref.numel() == 0:
        return
    ours = (actual.detach().double().cpu() - ref).abs().max().item()
    theirs = (baseline.detach().double().cpu() - ref).abs().max().item()
    assert ours <= 2 * theirs + floor, f"{what}: max error {ours:.3g} > 2 x torch's {theirs:.3g} (+{floor:g})"


def loss_curve_deviation(curve: Tensor, reference: Tensor) -> float:
    """Mean over steps of |curve - reference| / reference."""
    curve, reference = curve.double(), reference.double()
    assert curve.shape == reference.shape, f"curves of {curve.shape} and {reference.shape} steps"
    return float(((curve - reference).abs() / reference.abs()).mean())


def assert_tracks_loss_curve(curve: Tensor, reference: Tensor, seed_curves: list[Tensor], what: str) -> None:
    """`curve` (a low-precision run) stays closer to `reference` (the high-precision run with the same
    initialisation and batches) than any of `seed_curves` (high-precision runs, same batches, other
    initialisation seeds) does."""
    assert seed_curves, "the error model needs at least one seed curve"
    ours = loss_curve_deviation(curve, reference)
    spread = min(loss_curve_deviation(c, reference) for c in seed_curves)
    assert ours < spread, (
        f"{what}: loss curve departs from the high-precision one by {ours:.3%} per step on average, "
        f"more than changing the initialisation seed does ({spread:.3%})"
    )


# ---------------------------------------------------------------------------------------------------
# Routing generators (seeded; used by tests and benchmarks)

ROUTING_KINDS = ("uniform", "zipf", "hot", "empty")


def random_routing(
    num_tokens: int,
    num_experts: int,
    k: int,
    *,
    kind: str = "uniform",
    drop: float = 0.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Tensor:
    """[T, k] int32 expert indices.

    uniform: k distinct experts per token (when k <= E), uniformly. zipf: distinct experts drawn with
    probability ~ 1/rank^1.2, so a few experts are hot. hot: every slot picks expert 0 (repeats allowed
    when k > 1). empty: only even-numbered experts are chosen, odd ones stay empty. `drop` sets that
    fraction of slots to -1.
    """
    g = torch.Generator().manual_seed(seed)
    T, E = num_tokens, num_experts
    if kind == "hot":
        idx = torch.zeros((T, k), dtype=torch.int64)
    elif kind in ("uniform", "zipf", "empty"):
        probs = torch.ones(E, dtype=torch.float64)
        if kind == "zipf":
            probs = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        if kind == "empty":
            probs[1::2] = 0.0
        candidates = int((probs > 0).sum())
        if T == 0:
            idx = torch.zeros((0, k), dtype=torch.int64)
        elif k <= candidates:
            idx = torch.multinomial(probs.expand(T, E), k, replacement=False, generator=g)
        else:
            idx = torch.multinomial(probs.expand(T, E), k, replacement=True, generator=g)
    else:
        raise ValueError(f"kind must be one of {ROUTING_KINDS}, got {kind!r}")
    if drop > 0 and T > 0:
        idx[torch.rand((T, k), generator=g) < drop] = -1
    return idx.to(torch.int32).to(device)
