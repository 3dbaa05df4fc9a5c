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
        assert all(a.startswith("sm_") for a in info["extension_archs"])


def test_arch_runs_on():
    from moe_kernels._ext import arch_runs_on

    assert arch_runs_on(["90a"], (9, 0)) and arch_runs_on(["80", "90a"], (8, 0)) and arch_runs_on(["100f"], (10, 0))
    assert not arch_runs_on(["90a"], (8, 0)) and not arch_runs_on(["90a"], (10, 0)) and not arch_runs_on([], (9, 0))


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
    info = env.collect()
    assert info["gpus"][0]["kernels_run_here"] is not falls_back
    assert set(info["ops"].values()) == {"PyTorch reference" if falls_back else "CUDA kernel"}
    assert any("R580" in n for n in info["notes"]) is falls_back


def test_extension_errors_are_python_exceptions():
    # Without a usable GPU a direct call into the extension raises a Python exception, not a crash.
    if not moe_kernels.has_cuda_kernels() or torch.cuda.is_available():
        pytest.skip("needs the built extension on a machine without a GPU")
    from moe_kernels import _ext

    with pytest.raises(RuntimeError):
        _ext._C.tokens_per_expert(indices=0, num_slots=1, num_experts=1, counts=0, device=0, stream=0)
