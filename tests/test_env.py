import subprocess
import sys

import pytest
import torch

import moe_kernels
from moe_kernels.env import CUDA_OPS, collect


def test_report_runs_and_names_everything():
    out = subprocess.run([sys.executable, "-m", "moe_kernels"], capture_output=True, text=True, check=True).stdout
    for field in ("torch", "extension_built", "gpu", "distributed_backends", "ops:"):
        assert field in out
    for op in CUDA_OPS:
        assert op in out


def test_collect_is_consistent():
    info = collect()
    assert info["torch"] == torch.__version__
    assert info["extension_built"] == moe_kernels.has_cuda_kernels()
    assert set(info["ops"]) == set(CUDA_OPS)
    assert set(info["distributed_backends"]) <= {"nccl", "gloo"}
    if torch.distributed.is_available() and torch.distributed.is_gloo_available():
        assert "gloo" in info["distributed_backends"]
    if not torch.cuda.is_available():
        assert all(v == "PyTorch reference" for v in info["ops"].values())
    if moe_kernels.has_cuda_kernels():
        assert all(a.startswith(("sm_", "PTX compute_")) for a in info["extension_archs"])


A100, A10, L4, H100, B200, B300, RTX_5090, DGX_SPARK, NEXT = (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1), (13, 0)


@pytest.mark.parametrize("archs, runs, does_not_run", [
    # Machine code for sm_XY: X.Y and the later minors of major X, nothing else.
    (["80-real"], [A100, A10, L4], [(7, 5), H100, B200, NEXT]),
    (["86-real"], [A10, L4], [A100, H100]),
    (["100-real"], [B200, B300], [H100, RTX_5090, (11, 0)]),
    (["120-real"], [RTX_5090, DGX_SPARK], [B200, NEXT]),
    # Arch-specific (a): exactly X.Y, machine code or PTX.
    (["90a-real"], [H100], [A100, B200, (9, 1)]),
    (["90a"], [H100], [A100, B200, NEXT]),
    (["100a"], [B200], [B300, RTX_5090]),
    # Family-specific (f): X.Y and the later minors of its major.
    (["100f-real"], [B200, B300], [H100, RTX_5090]),
    (["103f-real"], [B300], [B200]),
    # PTX (plain `XY` has machine code and PTX; `-virtual` only PTX): X.Y and every later GPU, by JIT.
    (["80"], [A100, A10, H100, B200, RTX_5090, NEXT], [(7, 5)]),
    (["120-virtual"], [RTX_5090, DGX_SPARK, NEXT], [B200, H100]),
    (["sm_90a", "compute_120"], [H100, RTX_5090, NEXT], [A100, B200]),
    # The default build: every GPU from the A100 on.
    (["80-real", "90a-real", "100-real", "120"], [A100, A10, L4, H100, B200, B300, RTX_5090, DGX_SPARK, NEXT],
     [(7, 5), (7, 0)]),
    ([], [], [H100]),
])
def test_arch_runs_on(archs, runs, does_not_run):
    from moe_kernels._ext import arch_runs_on

    for cc in runs:
        assert arch_runs_on(archs, cc), (archs, cc)
    for cc in does_not_run:
        assert not arch_runs_on(archs, cc), (archs, cc)


def test_arch_names_are_parsed_or_refused():
    from moe_kernels._ext import describe_arch, parse_arch

    assert parse_arch("90a") == (9, 0, "a", True, True)
    assert parse_arch("100f-real") == (10, 0, "f", True, False)
    assert parse_arch("120-virtual") == (12, 0, "", False, True)
    assert [describe_arch(a) for a in ("80-real", "120", "120-virtual")] == ["sm_80", "sm_120 + PTX", "PTX compute_120"]
    with pytest.raises(ValueError, match="sm90"):
        parse_arch("sm90")


def test_gpu_outside_the_build_falls_back_with_one_warning(monkeypatch):
    # A build for sm_90a on an sm_80 GPU: the references run (after one warning), never the kernels.
    import types
    import warnings

    from moe_kernels import _ext

    extension = types.SimpleNamespace(cuda_archs="90a", cuda_runtime_version=lambda: 13000,
                                      cuda_driver_version=lambda: 13000, runtime_probe=lambda: 0)
    monkeypatch.setattr(_ext, "_C", extension)
    monkeypatch.setattr(_ext, "_driver", [])
    monkeypatch.setattr(_ext, "_device_ok", {})
    monkeypatch.setattr(_ext, "_warned_fallback", False)
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    t = types.SimpleNamespace(device=torch.device("cuda", 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _ext.kernels("permute", t) is None
        assert _ext.kernels("unpermute", t) is None
    assert len(caught) == 1 and "sm_80" in str(caught[0].message) and "MOE_KERNELS_CUDA_ARCHS" in str(caught[0].message)
    monkeypatch.setattr(_ext, "_device_ok", {})
    capability["value"] = (9, 0)
    assert _ext.kernels("permute", t) is extension


@pytest.mark.parametrize(
    "runtime,driver,probe,falls_back",
    [
        (13000, 12080, 0, True),    # R570 driver, CUDA 13 runtime: a major version apart
        (13000, 0, 0, True),        # no driver at all
        (13020, 13000, 0, False),   # minor-version compatibility: 13.2 runtime on a 13.0 driver
        (13000, 13010, 0, False),
        (12080, 12040, 0, False),
        (13000, 13000, 35, True),   # the first runtime call says cudaErrorInsufficientDriver
    ],
)
def test_old_driver_falls_back_with_one_warning(monkeypatch, runtime, driver, probe, falls_back):
    import types
    import warnings

    from moe_kernels import _ext, env

    extension = types.SimpleNamespace(cuda_archs="90a", cuda_runtime_version=lambda: runtime,
                                      cuda_driver_version=lambda: driver, runtime_probe=lambda: probe,
                                      **{f: None for fns in env.CUDA_OPS.values() for f in fns})
    monkeypatch.setattr(_ext, "_C", extension)
    monkeypatch.setattr(_ext, "_driver", [])
    monkeypatch.setattr(_ext, "_device_ok", {})
    monkeypatch.setattr(_ext, "_warned_fallback", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    t = types.SimpleNamespace(device=torch.device("cuda", 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_ext.kernels("permute", t), _ext.kernels("router_topk", t)]
    if falls_back:
        assert got == [None, None]
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "R580" in message and "reference" in message
        if driver:
            assert _ext.version_str(driver) in message and _ext.version_str(runtime) in message
    else:
        assert got == [extension, extension] and not caught
    # The environment report applies the same rule.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [])
    _fresh_grouped_mm_choice(monkeypatch)
    info = env.collect()
    assert info["gpus"][0]["kernels_run_here"] is not falls_back
    grouped = {op: info["ops"].pop(op) for op in ("grouped_mm", "grouped_mm_fp8")}
    assert set(info["ops"].values()) == {"PyTorch reference" if falls_back else "CUDA kernel"}
    if falls_back:
        assert grouped == {"grouped_mm": "bf16, fp16, fp32: PyTorch reference", "grouped_mm_fp8": "PyTorch reference"}
    else:  # this fake extension has no sm_90a CUTLASS kernels, this torch no sm_90 grouped GEMM
        assert grouped["grouped_mm"] == ("bf16: portable CUDA kernel (this torch has no sm_90 grouped GEMM); fp16, "
                                         "fp32: portable CUDA kernel (torch._grouped_mm's fast path is bf16 only)")
        assert grouped["grouped_mm_fp8"].startswith("dequantized to fp32, portable CUDA kernel")
    assert any("R580" in n for n in info["notes"]) is falls_back


def _fresh_grouped_mm_choice(monkeypatch):
    import importlib

    grouped_mm = importlib.import_module("moe_kernels.ops.grouped_mm")
    monkeypatch.setattr(grouped_mm, "_device_facts", {})
    monkeypatch.setattr(grouped_mm, "_backends", {})


TORCH_ARCHS = ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.mark.parametrize("name, capability, grouped_mm, grouped_mm_fp8", [
    ("NVIDIA A100-SXM4-80GB", (8, 0),
     "bf16, fp16, fp32: portable CUDA kernel (torch._grouped_mm syncs the host on sm_80)",
     "dequantized to fp32, portable CUDA kernel (this GPU (sm_80) has no FP8 tensor cores)"),
    ("NVIDIA H100 80GB HBM3", (9, 0),
     "bf16, fp16: CUTLASS sm_90a kernel; fp32: portable CUDA kernel (torch._grouped_mm's fast path is bf16 only)",
     "CUTLASS sm_90a FP8 blockwise kernel"),
    ("NVIDIA B200", (10, 0),
     "bf16: torch._grouped_mm (no sm_100 CUTLASS build); "
     "fp16, fp32: portable CUDA kernel (torch._grouped_mm's fast path is bf16 only)",
     "dequantized to fp32, portable CUDA kernel (moe_kernels has no FP8 blockwise kernel for sm_100"),
    ("NVIDIA B300", (10, 3),  # a torch wheel without sm_103: its sm_100a grouped GEMM does not load there
     "bf16: portable CUDA kernel (this torch has no sm_103 grouped GEMM); "
     "fp16, fp32: portable CUDA kernel (torch._grouped_mm's fast path is bf16 only)",
     "dequantized to fp32, portable CUDA kernel (moe_kernels has no FP8 blockwise kernel for sm_103"),
    ("NVIDIA GeForce RTX 5090", (12, 0),
     "bf16, fp16, fp32: portable CUDA kernel (torch._grouped_mm syncs the host on sm_120)",
     "dequantized to fp32, portable CUDA kernel (moe_kernels has no FP8 blockwise kernel for sm_120"),
])
def test_report_names_the_grouped_gemm_each_gpu_runs(monkeypatch, name, capability, grouped_mm, grouped_mm_fp8):
    import types

    from moe_kernels import _ext, env

    extension = types.SimpleNamespace(cuda_archs="80-real,90a-real,100-real,120", grouped_mm_has_sm90=True,
                                      cuda_runtime_version=lambda: 13000, cuda_driver_version=lambda: 13000,
                                      runtime_probe=lambda: 0, **{f: None for fns in env.CUDA_OPS.values() for f in fns})
    monkeypatch.setattr(_ext, "_C", extension)
    monkeypatch.setattr(_ext, "_driver", [])
    monkeypatch.setattr(_ext, "_device_ok", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: TORCH_ARCHS)
    _fresh_grouped_mm_choice(monkeypatch)
    info = env.collect()
    assert info["ops"]["grouped_mm"] == grouped_mm
    assert info["ops"]["grouped_mm_fp8"].startswith(grouped_mm_fp8)
    assert info["ops"]["permute"] == "CUDA kernel"
    monkeypatch.setattr(env, "collect", lambda: info)
    assert f"grouped_mm            {grouped_mm}" in env.report()


def test_extension_errors_are_python_exceptions():
    # Without a usable GPU a direct call into the extension raises a Python exception, not a crash.
    if not moe_kernels.has_cuda_kernels() or torch.cuda.is_available():
        pytest.skip("needs the built extension on a machine without a GPU")
    from moe_kernels import _ext

    with pytest.raises(RuntimeError):
        _ext._C.tokens_per_expert(indices=0, num_slots=1, num_experts=1, counts=0, device=0, stream=0)
