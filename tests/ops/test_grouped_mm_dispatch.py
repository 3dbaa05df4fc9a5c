"""grouped_mm: which implementation runs on each GPU, decided on the host (CPU tier, capabilities faked), and
the torch._grouped_mm path keeping our op's contract (run on CPU tensors, where torch._grouped_mm runs too)."""

import importlib
import os
import types
import warnings

import pytest
import torch

from moe_kernels import _ext
from moe_kernels.nn import fused
from moe_kernels.testing import HostSyncError, assert_close_to_fp64, no_host_sync

gm = importlib.import_module("moe_kernels.ops.grouped_mm")  # the module (moe_kernels.ops.grouped_mm is the op)
fp8 = importlib.import_module("moe_kernels.ops.grouped_mm_fp8")

BF16, FP16, FP32, E4M3 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
CUTLASS, TORCH, PORTABLE, REFERENCE = gm.CUTLASS_SM90, gm.TORCH_GROUPED_MM, gm.PORTABLE, gm.REFERENCE
DEFAULT_BUILD = "80-real,90a-real,100-real,120"  # CMakeLists.txt's default architectures
TORCH_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_103", "sm_120", "compute_120"]

# capability, our sm_90a CUTLASS built, torch's arch list -> bf16, fp16, fp32, E4M3
TABLE = [
    ((8, 0), True, TORCH_ARCHS, (PORTABLE, PORTABLE, PORTABLE, PORTABLE)),  # A100: torch's fallback syncs
    ((8, 6), True, TORCH_ARCHS, (PORTABLE, PORTABLE, PORTABLE, PORTABLE)),  # A10, RTX 30
    ((8, 9), True, TORCH_ARCHS, (PORTABLE, PORTABLE, PORTABLE, PORTABLE)),  # L4, L40S, RTX 40
    ((9, 0), True, TORCH_ARCHS, (CUTLASS, CUTLASS, PORTABLE, CUTLASS)),  # H100 / H200 with our CUTLASS build
    ((9, 0), False, TORCH_ARCHS, (TORCH, PORTABLE, PORTABLE, PORTABLE)),  # built without the sm_90a kernels
    ((10, 0), True, TORCH_ARCHS, (TORCH, PORTABLE, PORTABLE, PORTABLE)),  # B200
    ((10, 3), True, TORCH_ARCHS, (TORCH, PORTABLE, PORTABLE, PORTABLE)),  # B300, torch built for sm_103
    ((10, 3), True, ["sm_90", "sm_100", "sm_120"], (PORTABLE,) * 4),  # torch's sm_100a cubins skip 10.3
    ((12, 0), True, TORCH_ARCHS, (PORTABLE, PORTABLE, PORTABLE, PORTABLE)),  # RTX 50: torch's fallback syncs
    ((12, 1), True, TORCH_ARCHS, (PORTABLE, PORTABLE, PORTABLE, PORTABLE)),  # DGX Spark
    ((13, 0), True, TORCH_ARCHS, (PORTABLE, PORTABLE, PORTABLE, PORTABLE)),  # a future GPU: PTX of sm_120
]


def fp8_mma_path(**problem) -> int:
    """The fake extension's grouped_mm_path, for the FP8 tensor-core probe (asked only on 8.9 and later): the
    tensor-core portable kernel takes it."""
    assert problem.get("portable") == 1 and problem["dtype"] == _ext.dtype_code(E4M3)
    return 8


def fake_gpu(monkeypatch, capability, *, sm90=True, archs=DEFAULT_BUILD, torch_archs=TORCH_ARCHS, driver_ok=True,
             sm100=True):
    """A GPU of `capability` and an extension built for `archs` (with or without its sm_90a and sm_100f CUTLASS
    kernels), as far as the host-side choice can tell."""
    extension = types.SimpleNamespace(cuda_archs=archs, grouped_mm_has_sm90=sm90, grouped_mm_has_sm100=sm100,
                                      grouped_mm_sm100_enabled=lambda: sm100 and os.environ.get(gm.SM100_OPT_IN) == "1",
                                      grouped_mm_portable_mma_enabled=lambda: os.environ.get(gm.PORTABLE_MMA_OPT_IN) == "1",
                                      grouped_mm_max_groups=1024, grouped_mm_path=fp8_mma_path)
    monkeypatch.setattr(_ext, "_C", extension)
    monkeypatch.setattr(_ext, "_driver", [None if driver_ok else "no driver"])
    monkeypatch.setattr(_ext, "_device_ok", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(torch_archs))
    monkeypatch.setattr(gm, "_device_facts", {})
    monkeypatch.setattr(gm, "_backends", {})


@pytest.mark.parametrize("capability, sm90, torch_archs, expected", TABLE)
def test_choice_for_every_architecture(monkeypatch, capability, sm90, torch_archs, expected):
    fake_gpu(monkeypatch, capability, sm90=sm90, torch_archs=torch_archs)
    cuda0 = torch.device("cuda", 0)
    got = tuple(gm.grouped_mm_backend(cuda0, dtype) for dtype in (BF16, FP16, FP32, E4M3))
    assert got == expected
    assert got == tuple(gm.choose_backend(capability, dtype, extension_runs=True, cutlass_sm90=sm90,
                                          torch_archs=torch_archs) for dtype in (BF16, FP16, FP32, E4M3))
    # The experts region runs its composite (our grouped GEMM) unless torch's is preferred.
    assert fused.experts_fit(types.SimpleNamespace(device=cuda0, dtype=BF16)) is (expected[0] != TORCH)
    described = gm.describe_backend(0)
    assert ("torch._grouped_mm (" in described) is (TORCH in got)
    assert ("CUTLASS sm_90a" in described) is (CUTLASS in got)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0), (9, 0)])
def test_tensor_core_portable_kernel_is_opt_in(monkeypatch, capability):
    """MOE_KERNELS_PORTABLE_MMA=1: where the portable kernel runs bf16 or fp16 (sm_80 and later), `python -m
    moe_kernels` says it runs on tensor cores; fp32 stays on CUDA cores, and the CUTLASS choices do not move."""
    fake_gpu(monkeypatch, capability)
    monkeypatch.delenv(gm.PORTABLE_MMA_OPT_IN, raising=False)
    assert "tensor cores" not in gm.describe_backend(0)
    monkeypatch.setenv(gm.PORTABLE_MMA_OPT_IN, "1")
    fake_gpu(monkeypatch, capability)
    described = gm.describe_backend(0)
    if capability == (9, 0):  # bf16 and fp16 take the sm_90a kernels
        assert "tensor cores" not in described and "bf16, fp16: CUTLASS sm_90a" in described
    else:
        assert described.startswith("bf16, fp16: portable kernel on tensor cores (MOE_KERNELS_PORTABLE_MMA=1")
    assert "fp32: portable CUDA kernel" in described


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
def test_blackwell_cutlass_kernels_are_opt_in(monkeypatch, capability):
    """A 10.x GPU takes torch._grouped_mm for bf16 unless MOE_KERNELS_SM100_CUTLASS=1 and the build holds the
    sm_100f instances; then bf16 and E4M3 (blockwise) run ours (fp16, fp32 stay portable). No other
    GPU is affected."""
    fake_gpu(monkeypatch, capability)
    monkeypatch.delenv(gm.SM100_OPT_IN, raising=False)
    cuda0 = torch.device("cuda", 0)
    assert gm.grouped_mm_backend(cuda0, BF16) == TORCH
    assert "opt-in" in gm.describe_backend(0)
    monkeypatch.setenv(gm.SM100_OPT_IN, "1")
    fake_gpu(monkeypatch, capability)
    got = tuple(gm.grouped_mm_backend(cuda0, dtype) for dtype in (BF16, FP16, FP32, E4M3))
    assert got == (gm.CUTLASS_SM100, PORTABLE, PORTABLE, gm.CUTLASS_SM100)
    assert "CUTLASS sm_100f FP8" in fp8.describe_backend(0)
    assert "CUTLASS sm_100f" in gm.describe_backend(0)
    assert fused.experts_fit(types.SimpleNamespace(device=cuda0, dtype=BF16))  # the experts region runs ours
    fake_gpu(monkeypatch, capability, sm100=False)  # a build without them: torch's, as before
    assert gm.grouped_mm_backend(cuda0, BF16) == TORCH
    for other in ((9, 0), (10, 1), (12, 0)):  # (10.1: not a GPU the sm_100f cubins load on)
        fake_gpu(monkeypatch, other)
        assert gm.grouped_mm_backend(cuda0, BF16) != gm.CUTLASS_SM100


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
def test_without_a_usable_extension(monkeypatch, capability):
    # Built for sm_90a only, or a driver that cannot run it: torch's fast path where it exists, else the
    # references (after _ext.kernels' one warning).
    for archs, driver_ok in (("90a", True), (DEFAULT_BUILD, False)):
        fake_gpu(monkeypatch, capability, archs=archs, driver_ok=driver_ok)
        runs = capability == (9, 0) and driver_ok
        got = [gm.grouped_mm_backend(torch.device("cuda", 0), dtype) for dtype in (BF16, FP16, FP32)]
        if runs:
            assert got == [CUTLASS, CUTLASS, PORTABLE]
        else:
            assert got == [TORCH if capability[0] in (9, 10) else REFERENCE, REFERENCE, REFERENCE]


def test_choice_is_cached_per_device(monkeypatch):
    fake_gpu(monkeypatch, (10, 0))
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: calls.append(index) or (10, 0))
    for dtype in (BF16, FP16):
        gm.grouped_mm_backend(torch.device("cuda", 0), dtype)
    first = len(calls)  # the device's facts, read once (the extension's arch check reads the capability too)
    for _ in range(3):
        for dtype in (BF16, FP16, FP32):
            gm.grouped_mm_backend(torch.device("cuda", 0), dtype)
    assert len(calls) == first


def test_cpu_tensors_run_the_references_or_the_emulated_kernels():
    expected = PORTABLE if _ext.emulation() else REFERENCE
    assert gm.grouped_mm_backend(torch.device("cpu"), BF16) == expected
    assert gm.grouped_mm_backend("meta", BF16) == REFERENCE


# ---------------------------------------------------------------------------------------------------
# The torch._grouped_mm path keeps our contract


CASES = {
    "empty groups": [5, 0, 8, 0, 3],
    "sum below M": [4, 4],
    "one hot group": [0, 0, 24, 0],
    "odd sizes": [1, 7, 3, 9, 5],
    "all empty": [0, 0, 0],
}


def problem(sizes, M, N=16, K=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(BF16)
    w = torch.randn(len(sizes), N, K, generator=g).to(BF16)
    dout = torch.randn(M, N, generator=g).to(BF16)
    return x, w, dout, torch.tensor(sizes, dtype=torch.int32)


@pytest.fixture
def torch_path(monkeypatch):
    """The CUDA implementations, run on CPU tensors with the chooser saying torch._grouped_mm; counts calls."""
    calls = []
    monkeypatch.setattr(gm, "grouped_mm_backend", lambda device, dtype: TORCH)
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_torch_path_matches_the_reference(torch_path, case):
    sizes = CASES[case]
    n = sum(sizes)
    M = n + 5  # rows past the groups
    x, w, dout, gs = problem(sizes, M)
    x64, w64, d64 = x.double(), w.double(), dout.double()

    out = gm._grouped_mm_cuda(x, w, gs)
    dx = gm._grouped_mm_dgrad_cuda(dout, w, gs)
    dw = gm._grouped_mm_wgrad_cuda(dout, x, gs)
    assert len(torch_path) == 3
    assert out.shape == (M, 16) and out.is_contiguous() and out.dtype == BF16
    # bf16 results against fp64, within twice the error of PyTorch's own bf16 per-expert loop
    assert_close_to_fp64(out[:n], gm.grouped_mm_reference(x, w, gs)[:n], gm.grouped_mm_reference(x64, w64, gs)[:n],
                         f"fwd, {case}")
    assert_close_to_fp64(dx, gm.grouped_mm_dgrad_reference(dout, w, gs), gm.grouped_mm_dgrad_reference(d64, w64, gs),
                         f"dgrad, {case}")
    assert_close_to_fp64(dw, gm.grouped_mm_wgrad_reference(dout, x, gs), gm.grouped_mm_wgrad_reference(d64, x64, gs),
                         f"wgrad, {case}")
    assert bool((dx[n:] == 0).all()), "dgrad rows past the groups are zero"
    for e, size in enumerate(sizes):
        if size == 0:
            assert bool((dw[e] == 0).all()), f"wgrad of empty group {e} is zero"


def test_torch_path_makes_no_host_sync(torch_path):
    x, w, dout, gs = problem([3, 0, 9, 4], 20)
    with no_host_sync():
        gm._grouped_mm_cuda(x, w, gs)
        gm._grouped_mm_dgrad_cuda(dout, w, gs)
        gm._grouped_mm_wgrad_cuda(dout, x, gs)
    assert len(torch_path) == 3
    # On meta tensors any read of a value on the host raises: the wrappers compute only on the device.
    meta = [t.to("meta") for t in (x, w, dout, gs)]
    xm, wm, dm, gsm = meta
    assert gm.grouped_mm_torch(xm, wm, gsm).shape == (20, 16)
    assert gm.grouped_mm_dgrad_torch(dm, wm, gsm).shape == (20, 24)
    assert gm.grouped_mm_wgrad_torch(dm, xm, gsm).shape == (4, 16, 24)
    # and the guard does catch a sync
    with pytest.raises(HostSyncError), no_host_sync():
        gs.sum().item()


def test_offsets_never_pass_the_rows():
    # A sum past M (an error the checking mode reports) or a negative size never sends torch outside x and out.
    gs = torch.tensor([4, 9, -3, 2], dtype=torch.int32)
    offs = gm._torch_offsets(gs, 8)
    assert offs.dtype == torch.int32 and offs.tolist() == [4, 8, 8, 8]
    assert gm._torch_offsets(torch.tensor([2, 0, 3], dtype=torch.int32), 10).tolist() == [2, 2, 5]


@pytest.mark.parametrize("what, shape", [
    ("N not a multiple of 8", dict(N=12)),
    ("K not a multiple of 8", dict(K=20)),
    ("no groups", dict(E=0)),
    ("no rows", dict(M=0)),
])
def test_shapes_torch_does_not_take_run_ours(torch_path, what, shape):
    M, N, K, E = shape.get("M", 12), shape.get("N", 16), shape.get("K", 24), shape.get("E", 2)
    x, w, dout = torch.randn(M, K).to(BF16), torch.randn(E, N, K).to(BF16), torch.randn(M, N).to(BF16)
    gs = torch.tensor([M // 2, M - M // 2][:E], dtype=torch.int32)
    out = gm._grouped_mm_cuda(x, w, gs)
    dx = gm._grouped_mm_dgrad_cuda(dout, w, gs)
    dw = gm._grouped_mm_wgrad_cuda(dout, x, gs)
    assert not torch_path, what
    assert out.shape == (M, N) and dx.shape == (M, K) and dw.shape == (E, N, K)


def test_too_many_groups_or_misaligned_pointers_run_ours(torch_path):
    M, N, K = 8, 16, 24
    x, dout = torch.randn(M, K).to(BF16), torch.randn(M, N).to(BF16)
    gs = torch.zeros(1024, dtype=torch.int32)
    gs[0] = M
    w = torch.randn(1024, N, K).to(BF16)
    gm._grouped_mm_cuda(x, w, gs)
    # x starting 2 bytes into its storage: not 16-byte aligned
    x_off = torch.randn(M * K + 1).to(BF16)[1:].view(M, K)
    gm._grouped_mm_cuda(x_off, w[:2].contiguous(), torch.tensor([4, 4], dtype=torch.int32))
    assert not torch_path


def test_fp16_and_fp32_never_take_torch(monkeypatch):
    fake_gpu(monkeypatch, (10, 0))
    seen = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: seen.append(a))
    for dtype in (FP16, FP32):
        t = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, element_size=lambda: 2)
        assert not gm._takes_torch("grouped_mm", t, (), torch.ones(2, dtype=torch.int32), 8, 16, 16)
    assert not seen


# ---------------------------------------------------------------------------------------------------
# The fused experts region and FP8


def test_experts_region_composes_the_ops_where_torch_is_preferred(monkeypatch):
    torch.manual_seed(0)
    R, H, F, E = 12, 16, 8, 3
    x = torch.randn(R, H)
    w13, w2 = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    gs = torch.tensor([5, 0, 4], dtype=torch.int32)

    class Unusable:
        def __getattr__(self, name):
            raise AssertionError(f"the composite ran ({name})")

    launch = _ext.Launch(Unusable(), 0, 0)
    monkeypatch.setattr(fused, "grouped_mm_backend", lambda device, dtype: TORCH)
    assert not fused.experts_fit(x)
    y = fused.run("experts", launch, x, gs, w13, w2, None)
    torch.testing.assert_close(y[:9], fused._experts_ops(x, gs, w13, w2, None)[:9])  # rows past the groups: unspecified
    for other in (CUTLASS, PORTABLE, REFERENCE):
        monkeypatch.setattr(fused, "grouped_mm_backend", lambda device, dtype, b=other: b)
        assert fused.experts_fit(x)


@pytest.mark.parametrize("capability, says", [
    ((8, 0), "no FP8 tensor cores"),
    ((8, 6), "no FP8 tensor cores"),
    ((8, 9), "torch._scaled_grouped_mm takes no 1x128 / 128x128 block scales"),
    ((10, 0), "no FP8 blockwise kernel for sm_100"),
    ((12, 0), "no FP8 blockwise kernel for sm_120"),
    ((9, 0), "built without its sm_90a CUTLASS kernels"),
])
def test_fp8_without_the_sm90_kernel_warns_once(monkeypatch, capability, says):
    fake_gpu(monkeypatch, capability, sm90=False)
    monkeypatch.setattr(fp8, "_warned_no_fp8_kernel", False)
    t = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert gm.grouped_mm_backend(t.device, E4M3) == PORTABLE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8._warn_without_fp8_kernel(t)
        fp8._warn_without_fp8_kernel(t)
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    message = str(caught[0].message)
    assert says in message and "dequantize to fp32" in message and "portable" in message
    assert says in fp8.describe_backend(0)


@pytest.mark.parametrize("capability", [(8, 9), (10, 0), (12, 0), (12, 1)])
def test_fp8_tensor_core_kernel_is_opt_in(monkeypatch, capability):
    """On 8.9 and later without a CUTLASS FP8 kernel, the FP8 ops dequantize unless MOE_KERNELS_PORTABLE_MMA=1,
    which runs the tensor-core portable kernel: `python -m moe_kernels` and the one warning say which, and why
    not where the extension refuses it."""
    monkeypatch.delenv(gm.PORTABLE_MMA_OPT_IN, raising=False)
    monkeypatch.delenv(gm.SM100_OPT_IN, raising=False)
    fake_gpu(monkeypatch, capability)
    t = types.SimpleNamespace(device=torch.device("cuda", 0))
    described = fp8.describe_backend(0)
    assert described.startswith("dequantized to fp32")
    assert "tensor-core kernel is opt-in: MOE_KERNELS_PORTABLE_MMA=1" in described
    monkeypatch.setattr(fp8, "_warned_no_fp8_kernel", False)
    with pytest.warns(RuntimeWarning, match="MOE_KERNELS_PORTABLE_MMA=1 runs them on this GPU's FP8 tensor cores"):
        fp8._warn_without_fp8_kernel(t)
    monkeypatch.setenv(gm.PORTABLE_MMA_OPT_IN, "1")
    fake_gpu(monkeypatch, capability)
    assert fp8.describe_backend(0).startswith("portable FP8 kernel on tensor cores (E4M3 mma.sync")

    def refused(**problem):
        raise ValueError("grouped_mm: the tensor-core portable kernel was requested, but the extension holds no FP8 "
                         "tensor-core code for this GPU (build for sm_89 or later: MOE_KERNELS_CUDA_ARCHS)")

    monkeypatch.setattr(_ext._C, "grouped_mm_path", refused)
    described = fp8.describe_backend(0)
    assert described.startswith("dequantized to fp32")
    assert "tensor-core kernel cannot run: the extension holds no FP8 tensor-core code for this GPU" in described
    monkeypatch.setattr(fp8, "_warned_no_fp8_kernel", False)
    with pytest.warns(RuntimeWarning, match="the tensor-core portable kernel cannot run: the extension holds no FP8"):
        fp8._warn_without_fp8_kernel(t)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_fp8_below_8_9_has_no_tensor_core_kernel(monkeypatch, capability):
    monkeypatch.setenv(gm.PORTABLE_MMA_OPT_IN, "1")
    fake_gpu(monkeypatch, capability)
    assert fp8.tensor_core_refusal(0) == "FP8 needs compute capability 8.9 or later (E4M3 tensor cores)"
    described = fp8.describe_backend(0)
    arch = f"sm_{capability[0]}{capability[1]}"
    assert described == f"dequantized to fp32, portable CUDA kernel (this GPU ({arch}) has no FP8 tensor cores)"


def test_fp8_on_hopper_with_the_kernel_does_not_warn(monkeypatch):
    fake_gpu(monkeypatch, (9, 0), sm90=True)
    monkeypatch.setattr(fp8, "_warned_no_fp8_kernel", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8._warn_without_fp8_kernel(types.SimpleNamespace(device=torch.device("cuda", 0)))
    assert not caught
    assert fp8.describe_backend(0) == "CUTLASS sm_90a FP8 blockwise kernel"
