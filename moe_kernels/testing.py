"""Test and benchmark helpers: the tolerance policy and routing generators.

Tolerance policy (one place, every test uses it):
- Index outputs (row maps, counts, selected experts) and pure data movement compare bit-exactly.
- Reductions the kernels define to match the reference's rounding order (unpermute's fp32 sum in
  ascending slot order) compare bit-exactly.
- Reductions whose order differs from the reference (dot products, GEMMs) are accepted within fp32
  rounding: |a - b| <= 64 * eps_fp32 * sum(|terms|), where sum(|terms|) is the magnitude of the sum.
- Low-precision results against an fp64 reference: the kernel's error is at most twice the error of
  plain PyTorch at the same precision (the flash-attention rule), plus a floor of 8 fp32 ulps of the
  reference's magnitude (ULP_FLOOR; the caller's floor on top for results below fp32 precision). For whole
  tensors whose elements' errors are independent rounding noise, the same rule in the L2 norm
  (assert_norm_close_to_fp64): the max of one draw is not a stable statistic, the norm is.
- Results rounded to bf16/fp16 after an fp32 accumulation, against the exact result rounded likewise: one
  ulp plus fp32 rounding (assert_within_rounding_to); "rtol = one ulp" sits at the bound.
- Quantized (FP8, NVFP4) results against high precision: the quantization error model (below): the relative
  L2 error of a product is sqrt(sum of the operands' eps^2), eps from the format (E4M3_REL_ERROR) or
  measured on the operands themselves; QUANT_SLACK = 1.5x allowed.
- Training curves: a low-precision recipe may move the loss curve less than a change of the
  initialisation seed does (same batches, same machine, measured in the same run). Training amplifies
  any rounding difference chaotically (matmul kernels round differently on Intel and AMD CPUs), so a
  fixed "within N%" measured on one machine is no bound; the seed spread is measured beside the curve.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.utils._python_dispatch
from torch import Tensor

FP32_EPS = torch.finfo(torch.float32).eps
U_BF16 = 2.0**-8  # bf16's unit roundoff: rounding to nearest moves a value by at most this much of itself


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


# Large tensors are compared a block of leading-dim rows at a time: each fp64 temporary of a check is at
# most this many elements (256 MiB), whatever the tensor's size, so a check of a multi-GB result fits
# beside the result itself. The verdict is the whole tensor's (counts, maxima and the first bad element
# are gathered over the blocks).
CHECK_CHUNK_ELEMENTS = 1 << 25


def _row_blocks(*ts: Tensor, chunk_elements: int):
    """(first row, [t[r0:r1] for t in ts]) over blocks of leading-dim rows of at most `chunk_elements`
    elements (at least one row); one block for 0-d tensors or tensors of different shapes (broadcasting)."""
    shape = ts[0].shape
    if len(shape) == 0 or shape[0] == 0 or any(t.shape != shape for t in ts):
        yield 0, list(ts)
        return
    row = max(1, ts[0].numel() // shape[0])
    step = max(1, chunk_elements // row)
    for r0 in range(0, shape[0], step):
        yield r0, [t[r0 : r0 + step] for t in ts]


def assert_within_fp32_rounding(actual: Tensor, expected: Tensor, magnitude: Tensor, what: str, *,
                                chunk_elements: int = CHECK_CHUNK_ELEMENTS) -> None:
    """`magnitude` = sum of |terms| of each reduced element (same shape as expected). Compared where the
    reference lives, in blocks of rows (CHECK_CHUNK_ELEMENTS)."""
    e_all = expected.detach()
    a_all, m_all = actual.detach().to(e_all.device), magnitude.detach().to(e_all.device)
    n_bad, first = 0, None
    for r0, (a, e, m) in _row_blocks(a_all, e_all, m_all, chunk_elements=chunk_elements):
        a, e = a.double(), e.double()
        tol = 64 * FP32_EPS * m.double() + 1e-30
        # NaN passes only where the reference is NaN too (a NaN beside a number is never within rounding).
        bad = ~((a - e).abs() <= tol) & ~(torch.isnan(a) & torch.isnan(e))
        nb = int(bad.sum())
        if nb and first is None:
            i = tuple(int(v) for v in torch.nonzero(bad)[0])
            at = (r0 + i[0], *i[1:]) if i else i
            first = (at, a[i].item(), e[i].item(), tol.expand_as(bad)[i].item())
        n_bad += nb
    if n_bad:
        at, av, ev, tv = first
        raise AssertionError(
            f"{what}: {n_bad} elements beyond fp32 rounding; first at {at}: {av} vs {ev} (tolerance {tv:.3g})"
        )


# Hopper's FP8 tensor cores keep about 14 bits of the running sum (the DeepSeek-V3 report: "around 14 bits")
# until the kernel promotes it to fp32 after each 128-wide K block. Model: each of a block's four k=32 wgmma
# steps truncates toward zero, at most 2^-13 of the block's sum of |terms|; truncations share their sign, so
# the four add up: 4 x 2^-13 of the terms, which is this many times the 64 eps_fp32 per unit of magnitude that
# assert_within_fp32_rounding and assert_within_rounding_to allow. (On an H200 the failures a 2^-13 bound,
# one step's worth, reported were errors of about 1.0 to 1.2 x 2^-13 of the terms.)
FP8_MMA_MAGNITUDE = 4 * 2**-13 / (64 * FP32_EPS)


# The floor every assert_close_to_fp64 adds, relative to the reference's largest magnitude: 8 fp32 ulps. Any
# fp32 result carries its own rounding (half an ulp) and a reduction's few more, so the baseline's error is
# one draw of rounding noise, which on a scalar or a few elements can fall to 0 by chance; below a few ulps of
# the magnitude "twice the baseline's error" says nothing. (Results below fp32 precision pass their own,
# larger, floor as well.)
ULP_FLOOR = 8 * FP32_EPS


def assert_close_to_fp64(actual: Tensor, baseline: Tensor, reference64: Tensor, what: str, *, floor: float = 1e-6,
                         chunk_elements: int = CHECK_CHUNK_ELEMENTS) -> None:
    """Kernel error vs an fp64 reference is at most 2x plain PyTorch's error at the same precision, plus
    `floor` and ULP_FLOOR x max|reference64|. The maxima are taken in blocks of rows (CHECK_CHUNK_ELEMENTS)."""
    ref = reference64.detach()  # compared where the reference lives (no host copy of large tensors)
    assert actual.shape == ref.shape == baseline.shape, f"{what}: shapes {actual.shape}, {baseline.shape}, {ref.shape}"
    if ref.numel() == 0:
        return
    ours = theirs = ref_max = 0.0
    a_all, b_all = actual.detach().to(ref.device), baseline.detach().to(ref.device)
    for _, (a, b, r) in _row_blocks(a_all, b_all, ref, chunk_elements=chunk_elements):
        if r.numel():
            r = r.double()
            ours = _nan_max(ours, (a.double() - r).abs().max().item())
            theirs = _nan_max(theirs, (b.double() - r).abs().max().item())
            ref_max = _nan_max(ref_max, r.abs().max().item())
    assert_errors_within_fp64_rule(ours, theirs, ref_max, what, floor=floor)


def _nan_max(a: float, b: float) -> float:
    """max that keeps a NaN, as a tensor's max() does (Python's max() drops it depending on the order)."""
    return b if b != b or b > a else a


def assert_errors_within_fp64_rule(ours: float, theirs: float, ref_max: float, what: str, *,
                                   floor: float = 1e-6) -> None:
    """assert_close_to_fp64's rule on errors already measured (for checks that build their reference a
    piece at a time): max|ours - ref| <= 2 max|baseline - ref| + floor + ULP_FLOOR x max|ref|. NaN fails."""
    ulps = ULP_FLOOR * ref_max
    assert ours <= 2 * theirs + floor + ulps, (
        f"{what}: max error {ours:.3g} > 2 x torch's {theirs:.3g} (+{floor:g} +{ulps:.3g} = 8 fp32 ulps of max|ref|)")


def assert_norm_close_to_fp64(actual: Tensor, baseline: Tensor, reference64: Tensor, what: str, *,
                              floor: float) -> None:
    """The flash-attention rule in the L2 norm: ||actual - ref|| <= 2 ||baseline - ref|| + floor x ||ref||.
    For whole tensors whose elements' errors are independent draws of rounding noise: the norm averages
    them, so the ratio of two implementations' errors is stable where the max of one draw is not. `floor`
    is relative to ||ref|| (e.g. 64 eps_fp32 for fp32 results: moe_kernels' fp32-rounding bound with |ref| in
    place of sum(|terms|), which it never exceeds)."""
    ref = reference64.detach().double()
    assert actual.shape == ref.shape == baseline.shape, f"{what}: shapes {actual.shape}, {baseline.shape}, {ref.shape}"
    ours = float((actual.detach().double().to(ref.device) - ref).norm())
    theirs = float((baseline.detach().double().to(ref.device) - ref).norm())
    size = float(ref.norm())
    assert ours <= 2 * theirs + floor * size, (
        f"{what}: L2 error {ours:.3g} > 2 x the baseline's {theirs:.3g} + {floor:g} x ||ref|| {size:.3g}")


def ulp(t: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of `dtype`'s numbers at |t| (fp64; its smallest subnormal spacing at 0)."""
    fi = torch.finfo(dtype)
    m, e = torch.frexp(t.detach().double().abs())  # |t| = m 2^e, m in [0.5, 1): spacing eps 2^(e - 1)
    spacing = torch.ldexp(torch.full_like(m, fi.eps / 2), e).clamp_min(fi.tiny * fi.eps)
    return torch.where(m == 0, fi.tiny * fi.eps, spacing)


def assert_within_rounding_to(actual: Tensor, expected: Tensor, magnitude: Tensor, dtype: torch.dtype,
                              what: str) -> None:
    """`actual`: an fp32-accumulated result rounded to `dtype` (bf16, fp16); `expected`: the exact result
    rounded to `dtype`. Before their roundings they differ by fp32 rounding, 64 eps_fp32 x sum(|terms|)
    (`magnitude`); each rounding moves a value by at most half the spacing there, and neither spacing
    exceeds the one at the larger of the rounded values: |a - e| <= ulp(max(|a|, |e|)) + 64 eps_fp32 x
    magnitude. (A bound of "rtol = one ulp" sits at the bound wherever the two roundings go opposite ways.)"""
    a, e, m = (t.detach().double().cpu() for t in (actual, expected, magnitude))
    tol = ulp(torch.maximum(a.abs(), e.abs()), dtype) + 64 * FP32_EPS * m
    bad = (a - e).abs() > tol
    bad |= torch.isnan(a) != torch.isnan(e)
    if bool(bad.any()):
        i = tuple(int(v) for v in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements beyond one {dtype} ulp + fp32 rounding; first at {i}: "
            f"{a[i].item()} vs {e[i].item()} (tolerance {tol[i].item():.3g})")


# ---------------------------------------------------------------------------------------------------
# Quantization error model (FP8 / NVFP4 recipes)
#
# Rounding to nearest with p fraction bits moves a value with significand m in [1, 2) by an error uniform
# within +-half its spacing 2^-p: a relative error of RMS 2^-p sqrt(E[m^-2] / 12). Data spread over many
# binades (Gaussian, or anything scaled into a format's range block by block) has a log-uniform
# significand (density 1 / (m ln 2)), E[m^-2] = 3 / (8 ln 2). A product of quantized operands whose
# errors are independent of the other operands (round-to-nearest errors are uncorrelated with independent
# data; stochastic rounding's with anything) has the relative L2 error sqrt(sum of the operands' eps^2), to
# first order: the errors add in RMS. The bounds allow QUANT_SLACK over that (a statistical bound: the
# relative L2 error of a product of >= 1e4 elements scatters by ~1% around the model, so 1.5x is far outside
# the scatter, and a format with one mantissa bit fewer, or truncation instead of rounding, doubles it).


def rtn_relative_error(mantissa_bits: int) -> float:
    """RMS relative error of round-to-nearest with `mantissa_bits` fraction bits (the model above)."""
    return 2.0**-mantissa_bits * math.sqrt(3 / (8 * math.log(2)) / 12)


E4M3_REL_ERROR = rtn_relative_error(3)  # 0.0265
# A cap on an NVFP4 operand's measured eps, for bounds built from measured eps (they would otherwise grow
# with a quantizer that lost precision): twice E2M1's round-to-nearest error. Round-to-nearest measures
# ~0.095 and stochastic rounding ~0.137 on Gaussian blocks; one mantissa bit fewer doubles either.
NVFP4_EPS_CAP = 2 * rtn_relative_error(1)  # 0.177
QUANT_SLACK = 1.5


def relative_l2_error(x: Tensor, ref: Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


def sqnr_db(x: Tensor, ref: Tensor) -> float:
    return -20 * math.log10(relative_l2_error(x, ref))


def quantized_product_error(*eps: float) -> float:
    """The model's relative L2 error of a product of operands quantized with relative errors eps (RMS)."""
    return math.sqrt(sum(e * e for e in eps))


def quantized_sqnr_floor_db(n_operands: int, eps: float = E4M3_REL_ERROR, slack: float = QUANT_SLACK) -> float:
    """SQNR bound of a result whose error is n_operands quantizations of relative error eps: -20 log10(slack
    x sqrt(n) x eps) (25.0 dB for one E4M3 GEMM, 22.0 dB for an E4M3 SwiGLU MLP's four operands)."""
    return -20 * math.log10(slack * quantized_product_error(*[eps] * n_operands))


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


# ---------------------------------------------------------------------------------------------------
# Host work: extension calls counted (or stubbed), host syncs refused

# Extension functions that only compute sizes or read attributes: they launch nothing.
_QUERY_SUFFIXES = ("_bytes", "_chunks", "_warps", "_blocks", "_passes", "_path", "_version", "_probe", "_offset")


def is_launch(name: str) -> bool:
    """Whether the extension function `name` launches kernels (the rest size workspaces or grids)."""
    return not name.endswith(_QUERY_SUFFIXES) and not name.startswith(("ipc_", "pci_", "device_by_", "can_access"))


class CountingExtension:
    """Stands in for the extension module: counts each launching call by name in `calls`; with `stub`,
    launches nothing (returns 0, which a region reads as "the workspace was enough")."""

    def __init__(self, module, *, stub: bool = False):
        self._module, self._stub = module, stub
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        if not callable(value) or not is_launch(name):
            return value
        calls, stub = self.calls, self._stub

        def launch(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return 0 if stub else value(*args, **kwargs)

        setattr(self, name, launch)  # later lookups skip __getattr__
        return launch


@contextlib.contextmanager
def extension_calls(*, stub: bool = False):
    """Inside, the extension (`_C` for CUDA tensors, the emulated `_C_emu` for CPU tensors under
    MOE_KERNELS_EMULATE) is a CountingExtension; yields it (its `calls` dict fills as ops run)."""
    from moe_kernels import _ext

    name = "_EMU" if _ext._EMU is not None else "_C"
    real = getattr(_ext, name)
    if real is None:
        raise RuntimeError("extension_calls: no extension module is loaded (build moe_kernels._C or set "
                           "MOE_KERNELS_EMULATE=1)")
    counting = CountingExtension(real, stub=stub)
    setattr(_ext, name, counting)
    try:
        yield counting
    finally:
        setattr(_ext, name, real)


def kernel_name(signature: str) -> str:
    """A kernel's bare name from its launch name or a profiler's demangled signature: "void moe::permute::(anonymous
    namespace)::unpermute_fwd_kernel<__nv_bfloat16, 8>(moe::permute::UnpermuteParams)" -> "unpermute_fwd_kernel"."""
    s = signature.replace("(anonymous namespace)::", "")
    for stop in "<(":
        s = s.split(stop, 1)[0]
    return s.rsplit("::", 1)[-1].rsplit(" ", 1)[-1]


@contextlib.contextmanager
def kernel_launches():
    """Inside, the kernels launched are counted by bare name (kernel_name): on the CPU-executed build from its own
    count (one extension call may launch several kernels), on a GPU from the profiler's kernel events. Yields a
    dict, filled on exit."""
    from moe_kernels import _ext

    counts: dict[str, int] = {}
    emu = getattr(_ext._EMU, "_module", _ext._EMU)  # (the real module under extension_calls)
    if emu is not None:
        before = emu.emu_kernel_launches()
        yield counts
        for name, n in emu.emu_kernel_launches().items():
            if n != before.get(name, 0):
                bare = kernel_name(name)
                counts[bare] = counts.get(bare, 0) + n - before.get(name, 0)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        yield counts
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = kernel_name(event.name)
            counts[name] = counts.get(name, 0) + 1


class HostSyncError(AssertionError):
    """An op read device data on the host."""


_SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "allclose")
_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _RefuseSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _SYNC_OPS:
            raise HostSyncError(f"{func} reads device data on the host (a host sync)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    """Inside, any op that would read device data on the host raises HostSyncError: `aten._local_scalar_dense`
    (.item(), bool(t), int(t)), size-less `nonzero` (and `torch.equal`, `is_nonzero`, `allclose`), and the
    Tensor methods .item/.tolist/.cpu/.numpy/__bool__/__int__/__float__/__index__, also on CPU tensors (the
    CUDA code path under emulation runs on them)."""
    saved = {name: getattr(torch.Tensor, name) for name in _SYNC_METHODS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSyncError(f"Tensor.{name} reads device data on the host (a host sync)")

        return method

    for name in _SYNC_METHODS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        with _RefuseSyncs():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
