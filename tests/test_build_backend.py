"""The build backend's choice of CUDA compiler (tools/packaging/moe_build_backend.py): NVIDIA's pip wheels only
on a GPU machine without a toolkit (or when asked), pinned to one CUDA minor version; a CPU-only machine
downloads nothing. The wheels themselves are installed and used by scripts/pip_cuda_build_check.py (CI)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "packaging"))
import moe_build_backend as backend  # noqa: E402

ENV = ("MOE_KERNELS_CUDA_FROM_PIP", "MOE_KERNELS_IGNORE_SYSTEM_CUDA", "MOE_KERNELS_SKIP_CUDA", "CUDA_HOME", "CUDA_PATH")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine whose toolkit and driver the test chooses."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    state = {"system": None, "driver": False}
    monkeypatch.setattr(backend.shutil, "which", lambda name: state["system"] if name == "nvcc" else None)
    monkeypatch.setattr(backend, "driver_present", lambda: state["driver"])
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: False if str(p) == "/usr/local/cuda/bin/nvcc" else real_exists(p))
    return state


def _extra():
    return [r for r in backend.get_requires_for_build_wheel() if r.startswith("nvidia-")]


def test_gpu_machine_without_toolkit_gets_the_pinned_wheels(machine):
    machine["driver"] = True
    assert _extra() == backend.CUDA_WHEELS
    assert backend.get_requires_for_build_editable()[-len(backend.CUDA_WHEELS):] == backend.CUDA_WHEELS
    # One CUDA minor version for every wheel: mixed minors disagree between headers and compiler.
    assert {r.split("==")[1] for r in backend.CUDA_WHEELS} == {backend.CUDA_MINOR + ".*"}
    assert {r.split("==")[0] for r in backend.CUDA_WHEELS} == {
        "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-runtime"}


def test_cpu_only_machine_downloads_nothing(machine):
    assert _extra() == []


def test_system_toolkit_wins_unless_hidden(machine, monkeypatch):
    machine["driver"], machine["system"] = True, "/opt/cuda/bin/nvcc"
    assert _extra() == [] and backend.find_nvcc() == "/opt/cuda/bin/nvcc"
    monkeypatch.setenv("MOE_KERNELS_IGNORE_SYSTEM_CUDA", "1")
    assert backend.system_nvcc() is None
    assert _extra() == backend.CUDA_WHEELS


def test_cuda_home_is_a_system_toolkit(machine, monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    machine["driver"] = True
    assert backend.find_nvcc() == str(tmp_path / "bin" / "nvcc") and _extra() == []


def test_flags(machine, monkeypatch):
    monkeypatch.setenv("MOE_KERNELS_CUDA_FROM_PIP", "1")
    assert _extra() == backend.CUDA_WHEELS  # a build machine without a GPU
    monkeypatch.setenv("MOE_KERNELS_SKIP_CUDA", "1")
    assert _extra() == []  # no kernels asked for: nothing to compile with


def test_wheel_toolkit_is_found(machine, monkeypatch, tmp_path):
    # site-packages/nvidia/cu13/bin/nvcc, as the wheels lay it out.
    nvidia = tmp_path / "nvidia"
    (nvidia / "cu13" / "bin").mkdir(parents=True)
    (nvidia / "cu13" / "bin" / "nvcc").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    assert backend.find_nvcc() == str(nvidia / "cu13" / "bin" / "nvcc")
