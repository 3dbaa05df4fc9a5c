"""expert_mlp on the kernels (gathered rows and the SwiGLU epilogue in the grouped GEMM, one extension call each
way) against the composition it replaces and against fp64: fresh random inputs, 0 tokens, empty experts, one
hot expert, dropped slots, padding rows, odd sizes, no routing weights.

Error model: the op computes the composition's products (fp32 accumulation, each GEMM output rounded to the
input dtype once, SwiGLU in fp32 from the rounded h). Where both run the portable grouped GEMM (the CPU-executed
kernels), the summation orders are the same: bit for bit. Elsewhere the composition may run CUTLASS (another
order), and both are held to the fp64 rule: error at most 2x that of the composition on plain PyTorch at the
same precision, plus a floor of the dtype's rounding of the operands."""

import pytest
import torch

from moe_kernels._ext import reference_ops
from moe_kernels.ops.activation import swiglu
from moe_kernels.ops.expert_mlp import expert_mlp, expert_mlp_reference
from moe_kernels.ops.grouped_mm import grouped_mm
from moe_kernels.ops.permute import permute, permuted_row_values, permuted_rows, unpermute
from moe_kernels.testing import assert_close_to_fp64, assert_exact, extension_calls, random_routing

pytestmark = pytest.mark.gpu

CASES = {
    "uniform": dict(),
    "zero-tokens": dict(T=0),
    "one-hot-expert": dict(kind="hot", k=1),
    "empty-experts-dropped": dict(kind="empty", drop=0.25),
    "padding-rows": dict(align=16, E=6),
    "odd-sizes": dict(T=29, H=37, F=19, E=5, k=3, align=4),
    "unweighted": dict(weighted=False),
    # Padding rows without routing weights: nothing scales them to zero, so a padding row that read a token would
    # reach the weight gradients.
    "padding-rows-unweighted": dict(align=16, E=6, weighted=False),
    "wide": dict(T=70, H=136, F=72, E=3, k=2),
    # H = 1: the w2 weight gradient is a wgrad with one output row (N = 1) over gathered dout rows.
    "hidden-1": dict(T=40, H=1, F=3, E=3, k=2),
    # The sm_90a gather kernels' shapes (bf16, H and 2F multiples of 8, F a multiple of 64), several tiles a group.
    "tiles": dict(T=300, H=256, F=128, E=4, k=2),
    "tiles-padded-skewed": dict(T=260, H=136, F=192, E=5, k=3, align=16, kind="zipf", drop=0.1),
}


def _problem(device, dtype, T=33, H=48, F=40, E=8, k=2, align=1, kind="uniform", drop=0.0, weighted=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * F, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, generator=g) / F**0.5
    weights = torch.rand(T, k, generator=g) if weighted else None
    dout = torch.randn(T, H, generator=g)
    idx = random_routing(T, E, k, kind=kind, drop=drop, seed=seed)
    to = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
    return dict(x=to(x), w13=to(w13), w2=to(w2), weights=None if weights is None else weights.to(device),
                dout=to(dout), idx=idx.to(device), E=E, align=align)


def _shifted(t, offset: int):
    """A copy of t `offset` elements into a buffer (off 16-byte alignment for offset 1), as a tensor that
    gradients can be taken for; offset 0: a plain leaf copy."""
    if offset == 0:
        return t.detach().clone().requires_grad_()
    buf = torch.zeros(t.numel() + offset, dtype=t.dtype, device=t.device)
    buf[offset:].copy_(t.detach().flatten())
    return buf.requires_grad_()[offset:].view(t.shape)


def _run(p, fused: bool, offset: int = 0):
    """(out, dx, dw13, dw2, dweights) of the fused op or of the composition; offset > 0 puts x, w13, w2 and dout
    that many elements off their buffers' (16-byte aligned) start."""
    leaves = [_shifted(p[n], offset) if p[n] is not None else None for n in ("x", "w13", "w2", "weights")]
    x, w13, w2, weights = leaves
    E, align, idx = p["E"], p["align"], p["idx"]
    R = permuted_rows(x.shape[0], idx.shape[1], E, align)
    if fused:
        _, row_map, gs = permute(x[:, :0], idx, E, align=align)
        rw = None if weights is None else permuted_row_values(weights, row_map, R)
        out = expert_mlp(x, row_map, gs, w13, w2, rw, num_rows=R)
    else:
        x_perm, row_map, gs = permute(x, idx, E, align=align)
        rw = None if weights is None else permuted_row_values(weights, row_map, R)
        out = unpermute(grouped_mm(swiglu(grouped_mm(x_perm, w13, gs), rw), w2, gs), row_map, None)
    live = [t for t in leaves if t is not None]
    dout = p["dout"] if offset == 0 else _shifted(p["dout"], offset).detach()
    grads = torch.autograd.grad(out, live, dout, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(live, grads)]
    return [out.detach(), *grads]


def _reference64(p):
    q = {n: (p[n].double().cpu() if isinstance(p[n], torch.Tensor) and p[n].is_floating_point() else p[n])
         for n in p}
    q["idx"] = p["idx"].cpu()
    leaves = [q[n].clone().requires_grad_() if q[n] is not None else None for n in ("x", "w13", "w2", "weights")]
    x, w13, w2, weights = leaves
    R = permuted_rows(x.shape[0], q["idx"].shape[1], q["E"], q["align"])
    with reference_ops():
        _, row_map, gs = permute(x[:, :0].detach(), q["idx"], q["E"], align=q["align"])
    rw = None if weights is None else permuted_row_values(weights, row_map, R)
    out = expert_mlp_reference(x, row_map, gs, w13, w2, rw, R)
    live = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, live, q["dout"], allow_unused=True)
    return [out.detach(), *[torch.zeros_like(t) if gr is None else gr for t, gr in zip(live, grads)]]


NAMES = ["out", "dx", "dw13", "dw2", "dweights"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_matches_composition_and_fp64(cuda, case, dtype):
    p = _problem(cuda, dtype, **CASES[case])
    with extension_calls() as ext:
        fused = _run(p, fused=True)
    # The routing-only permute and one extension entry each way (the first call of a shape also asks for its
    # workspace size): no grouped_mm, swiglu or unpermute call of their own.
    assert set(ext.calls) <= {"permute_fwd", "expert_mlp_fwd", "expert_mlp_bwd"}, ext.calls
    composed = _run(p, fused=False)
    if cuda.type == "cpu":  # the CPU-executed kernels: both on the portable grouped GEMM
        for name, a, b in zip(NAMES, fused, composed):
            assert_exact(a, b, f"{case}: {name}")
    ref = _reference64(p)
    floor = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b, r in zip(NAMES, fused, composed, ref):
        assert_close_to_fp64(a.float(), b.float(), r, f"{case} {dtype}: {name}", floor=floor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_unaligned_operands(cuda, dtype):
    """x, w13, w2 and dout one element off 16-byte alignment (the kernels' element-wise loads in place of their
    vector loads): the same bits as from aligned copies, whichever kernel runs."""
    p = _problem(cuda, dtype, T=40, H=64, F=64, E=4, k=2, align=8)
    for name, a, b in zip(NAMES, _run(p, fused=True), _run(p, fused=True, offset=1)):
        assert_exact(b, a, f"unaligned {dtype}: {name}")


def test_padding_rows_read_no_token(cuda):
    """Rows no slot maps to (align padding) contribute nothing, whatever the memory behind them held: the
    output equals that of the same routing without padding."""
    p = _problem(cuda, torch.float32, T=20, E=4, align=16)
    q = dict(p, align=1)
    for name, a, b in zip(NAMES, _run(p, fused=True), _run(q, fused=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)  # another row order: fp32 sums regroup


def test_needs_only_what_is_asked(cuda):
    """Gradients for x alone (frozen experts, no routing weights): the same dx, no weight gradients."""
    p = _problem(cuda, torch.float32, weighted=False)
    full = _run(p, fused=True)
    x = p["x"].detach().clone().requires_grad_()
    R = permuted_rows(x.shape[0], p["idx"].shape[1], p["E"], p["align"])
    _, row_map, gs = permute(x[:, :0], p["idx"], p["E"], align=p["align"])
    out = expert_mlp(x, row_map, gs, p["w13"], p["w2"], None, num_rows=R)
    (dx,) = torch.autograd.grad(out, (x,), p["dout"])
    assert_exact(dx, full[1], "dx")


@pytest.mark.cuda_device
def test_sm90_gather_kernels(cuda):
    """The sm_90a gather kernels (MOE_KERNELS_GATHER_CUTLASS=1, read once per process): the tests above in a fresh
    process with them on, against the composition (CUTLASS there too) and fp64."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import moe_kernels

    C = moe_kernels._ext._C
    if torch.cuda.get_device_capability(cuda) != (9, 0) or not getattr(C, "grouped_mm_has_sm90", False):
        pytest.skip("needs a 9.0 GPU and the sm_90a build")
    env = dict(os.environ, MOE_KERNELS_GATHER_CUTLASS="1")
    root = Path(__file__).resolve().parents[2]
    check = subprocess.run([sys.executable, "-c", "import moe_kernels; assert moe_kernels._ext._C.grouped_mm_gather_enabled()"],
                           env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "not sm90_gather", "-x"], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
