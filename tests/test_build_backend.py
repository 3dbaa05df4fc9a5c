"""The build backend's choice of CUDA compiler (tools/packaging/moe_build_backend.py): NVIDIA's pip wheels only
on a GPU machine without a toolkit (or when asked), pinned to one CUDA minor version; a CPU-only machine
downloads nothing. The wheels themselves are installed and used by scripts/pip_cuda_build_check.py (CI)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "packaging"))
import moe_build_backend as backend  # noqa: E402

ENV = ("MOE_KERNELS_CUDA_FROM_PIP", "MOE_KERNELS_IGNORE_SYSTEM_CUDA", "MOE_KERNELS_SKIP_CUDA", "CUDA_HOME", "CUDA_PATH",
       "MOE_KERNELS_CUDA_WHEELS")


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


def test_cuda_wheels_version_choice(machine, monkeypatch):
    machine["driver"] = True
    monkeypatch.setenv("MOE_KERNELS_CUDA_WHEELS", backend.CUDA_MINOR)  # the pinned version, named
    assert _extra() == backend.cuda_wheels() == backend.CUDA_WHEELS
    # CUDA 12: NVIDIA's cu12 wheels hold no nvcc, so the build stops and says to use a system toolkit.
    for version in ("12.8", "12.9"):
        monkeypatch.setenv("MOE_KERNELS_CUDA_WHEELS", version)
        with pytest.raises(ValueError, match=r"nvidia-cuda-nvcc-cu12 .* no nvcc.*CUDA_HOME=/usr/local/cuda-12\.8"):
            backend.get_requires_for_build_wheel()
    # A CUDA 13 minor whose wheels are not the checked set, and a value that is no version.
    for version, reason in (("13.1", "lib64"), ("13.5", "nvidia-cuda-cccl has no 13.4 or 13.5"), ("cu12", "expected")):
        monkeypatch.setenv("MOE_KERNELS_CUDA_WHEELS", version)
        with pytest.raises(ValueError, match=reason):
            backend.get_requires_for_build_editable()


def test_cuda_wheels_version_is_not_read_without_the_wheels(machine, monkeypatch):
    # A system toolkit (CUDA_HOME=/usr/local/cuda-12.8, the CUDA 12 build) or a CPU-only machine: no wheels,
    # so the version asked of them does not matter.
    monkeypatch.setenv("MOE_KERNELS_CUDA_WHEELS", "12.8")
    assert _extra() == []
    machine["driver"], machine["system"] = True, "/usr/local/cuda-12.8/bin/nvcc"
    assert _extra() == []


def test_wheel_toolkit_is_found(machine, monkeypatch, tmp_path):
    # site-packages/nvidia/cu13/bin/nvcc, as the wheels lay it out.
    nvidia = tmp_path / "nvidia"
    (nvidia / "cu13" / "bin").mkdir(parents=True)
    (nvidia / "cu13" / "bin" / "nvcc").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    assert backend.find_nvcc() == str(nvidia / "cu13" / "bin" / "nvcc")


# ---- the wheel: tagging requirements, no CPU-executed modules, reuse of the in-place build ----

def test_wheel_build_gets_the_tagger_only_with_the_extension(machine, monkeypatch):
    monkeypatch.setattr(backend.sys, "platform", "linux")
    tagging = set(backend.TAGGING_WHEELS)
    assert not tagging & set(backend.get_requires_for_build_wheel())  # CPU-only: a pure-Python wheel
    machine["system"] = "/opt/cuda/bin/nvcc"
    assert tagging <= set(backend.get_requires_for_build_wheel())
    assert not tagging & set(backend.get_requires_for_build_editable())
    monkeypatch.setenv("MOE_KERNELS_SKIP_CUDA", "1")
    assert not tagging & set(backend.get_requires_for_build_wheel())


def test_prebuilt_needs_no_compiler_wheels(machine, monkeypatch):
    monkeypatch.setattr(backend.sys, "platform", "linux")
    machine["driver"] = True  # would otherwise fetch NVIDIA's compiler wheels
    monkeypatch.setenv(backend.PREBUILT, "1")
    assert _extra() == []
    assert set(backend.TAGGING_WHEELS) <= set(backend.get_requires_for_build_wheel())


def test_wheel_build_skips_the_cpu_executed_modules(monkeypatch, tmp_path):
    seen = {}

    def fake_build_wheel(directory, config_settings=None, metadata_directory=None):
        seen["skip_emu"] = backend.os.environ.get("MOE_KERNELS_SKIP_EMU")
        return "moe_kernels-0.1.0-py3-none-any.whl"

    monkeypatch.delenv("MOE_KERNELS_SKIP_EMU", raising=False)
    monkeypatch.setattr(backend._setuptools, "build_wheel", fake_build_wheel)
    # A pure-Python wheel is not retagged.
    assert backend.build_wheel(str(tmp_path)) == "moe_kernels-0.1.0-py3-none-any.whl"
    assert seen["skip_emu"] == "1" and "MOE_KERNELS_SKIP_EMU" not in backend.os.environ


def test_no_tagger_keeps_the_linux_tag(monkeypatch, tmp_path):
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: None)
    name = "moe_kernels-0.1.0-cp311-cp311-linux_x86_64.whl"
    (tmp_path / name).write_bytes(b"")
    assert backend.tag_manylinux(tmp_path, name) == name and (tmp_path / name).exists()


def _project(root):
    """A project tree with the files `_C` is compiled from, and a built module with its record."""
    (root / "csrc" / "permute").mkdir(parents=True)
    (root / "python_api").mkdir()
    (root / "csrc" / "permute" / "permute.cu").write_text("kernel v1")
    (root / "python_api" / "module.cpp").write_text("binding v1")
    (root / "CMakeLists.txt").write_text("cmake v1")
    (root / "moe_kernels").mkdir()
    module = root / "moe_kernels" / "_C.cpython-311-x86_64-linux-gnu.so"
    module.write_bytes(b"\x7fELF built")
    config = {"cuda_archs": "80-real;90a-real;100-real;120", "nvcc": "Build cuda_13.0", "cutlass": "4.2.0",
              "pybind11": "3.1.0"}
    backend.write_record(module, backend.source_hashes(root), config)
    return module, config


def test_prebuilt_up_to_date(tmp_path):
    module, config = _project(tmp_path)
    assert backend.record_path(module).name == "_C.cpython-311-x86_64-linux-gnu.build.json"
    (tmp_path / "csrc" / "__pycache__").mkdir()
    (tmp_path / "csrc" / "__pycache__" / "x.pyc").write_bytes(b"")  # not a source
    assert set(backend.source_hashes(tmp_path)) == {"CMakeLists.txt", "csrc/permute/permute.cu",
                                                   "python_api/module.cpp"}
    assert backend.prebuilt_problems(module, backend.source_hashes(tmp_path), config) == []


def test_prebuilt_refused_after_a_source_changes(tmp_path):
    module, config = _project(tmp_path)
    (tmp_path / "csrc" / "permute" / "permute.cu").write_text("kernel v2")
    (tmp_path / "csrc" / "router.cu").write_text("new kernel")
    (tmp_path / "python_api" / "module.cpp").unlink()
    (tmp_path / "CMakeLists.txt").write_text("cmake v2")
    assert backend.prebuilt_problems(module, backend.source_hashes(tmp_path), config) == [
        "CMakeLists.txt changed since the build",
        "csrc/permute/permute.cu changed since the build",
        "csrc/router.cu was added since the build",
        "python_api/module.cpp was removed since the build",
    ]


def test_prebuilt_refused_for_another_configuration(tmp_path):
    module, config = _project(tmp_path)
    sources = backend.source_hashes(tmp_path)
    narrowed = {**config, "cuda_archs": "90a"}
    assert backend.prebuilt_problems(module, sources, narrowed) == [
        "cuda_archs: built with '80-real;90a-real;100-real;120', this build would use '90a'"]
    assert backend.prebuilt_problems(module, sources, {**config, "nvcc": None}) == [
        "nvcc: built with 'Build cuda_13.0', this build would use None"]


def test_prebuilt_refused_for_a_module_without_its_record(tmp_path):
    module, config = _project(tmp_path)
    sources = backend.source_hashes(tmp_path)
    module.write_bytes(b"\x7fELF built again, by another build")
    assert backend.prebuilt_problems(module, sources, config) == [
        f"{module.name} is not the module {backend.record_path(module).name} describes (built again since?)"]
    backend.record_path(module).unlink()
    assert "was not built by this setup.py in place" in backend.prebuilt_problems(module, sources, config)[0]
    module.unlink()
    assert "does not exist" in backend.prebuilt_problems(module, sources, config)[0]


def test_build_configuration_reads_the_cutlass_version(tmp_path):
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    config = backend.build_config("90a", None, str(tmp_path), "3.1.0")
    assert config == {"cuda_archs": "90a", "nvcc": None, "cutlass": "4.2.0", "pybind11": "3.1.0"}
    assert backend.cutlass_version(None) is None
