"""Build script: drives CMake + ninja to compile `moe_kernels._C`.

Environment knobs:
  MOE_KERNELS_CUDA_ARCHS   CUDA architectures as CMake names them, ';'-separated (default
                           "80-real;90a-real;100-real;120": sm_80, sm_90a, sm_100, sm_120 and PTX of 120;
                           the CUTLASS kernels build when 90a is listed).
  MOE_KERNELS_SKIP_CUDA=1  do not build `_C` (the GPU kernels); the ops run their references.
  MOE_KERNELS_SKIP_EMU=1   do not build `_C_emu`, the CPU-executed kernels (tools/cuda_on_cpu) that the
                           tests run under MOE_KERNELS_EMULATE=1; built by default when a C++ compiler
                           and the CUDA headers are found.
  MOE_KERNELS_EMU_SANITIZE=1  also build `_C_emu_asan` (AddressSanitizer + UBSan; MOE_KERNELS_EMULATE=asan
                           with libasan preloaded).
  MOE_KERNELS_EMU_DEBUG_INFO  the CPU-executed builds' debug-information flag (default "-g1": symbols and line
                           tables; "-g" adds variables and types, for a debugger).
  CUTLASS_DIR              CUTLASS checkout (its include/ is used) instead of the nvidia-cutlass wheel.
  MAX_JOBS                 parallel compile jobs (default: cores, capped by memory at ~7 GB per job).
  CUDA_HOME / CUDA_PATH    where nvcc lives when it is not on PATH.
  MOE_KERNELS_CUDA_FROM_PIP=1       build with NVIDIA's CUDA compiler wheels (added to the build requirements
                           by tools/packaging/moe_build_backend.py; automatic on a GPU machine without a toolkit).
  MOE_KERNELS_IGNORE_SYSTEM_CUDA=1  ignore any installed toolkit (use the wheels' nvcc).
  MOE_KERNELS_PREBUILT=1   package the `_C` built in place (moe_kernels/_C*.so) instead of compiling again;
                           refused unless its sources and build configuration are the ones recorded beside it
                           at its build (tools/packaging/moe_build_backend.py). A wheel never holds `_C_emu`.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "80-real;90a-real;100-real;120"  # CMakeLists.txt's default: keep the two the same


def _say(msg: str) -> None:
    print(f"moe_kernels: {msg}", file=sys.stderr, flush=True)


sys.path.insert(0, str(ROOT / "tools" / "packaging"))
from moe_build_backend import (  # noqa: E402  (one rule for the backend and this file)
    PREBUILT,
    build_config,
    find_nvcc,
    prebuilt_problems,
    source_hashes,
    wheel_toolkits,
    write_record,
)


def find_cuda_include() -> str | None:
    """The CUDA headers (the directory holding cuda_runtime.h and cuda_fp8.h): the toolkit of `find_nvcc`,
    CUDA_HOME/CUDA_PATH, /usr/local/cuda (unless MOE_KERNELS_IGNORE_SYSTEM_CUDA=1), or a pip wheel's include
    directory."""
    candidates = []
    nvcc = find_nvcc()
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    if not _flag("MOE_KERNELS_IGNORE_SYSTEM_CUDA"):
        for env in ("CUDA_HOME", "CUDA_PATH"):
            if os.environ.get(env):
                candidates.append(Path(os.environ[env]) / "include")
        candidates.append(Path("/usr/local/cuda/include"))
    candidates += [root / "include" for root in wheel_toolkits()]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(root).glob("*/include"))
    for cand in candidates:
        if (cand / "cuda_runtime.h").exists() and (cand / "cuda_fp8.h").exists():
            return str(cand)
    return None


def find_cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def find_cutlass_root() -> str | None:
    """A CUTLASS source tree: the directory holding include/cutlass/cutlass.h and tools/util/include."""
    candidates = []
    if os.environ.get("CUTLASS_DIR"):
        root = Path(os.environ["CUTLASS_DIR"])
        candidates += [root, root.parent]  # the root, or its include/ directory
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.origin:
        candidates.append(Path(spec.origin).parent / "source")
    for cand in candidates:
        if (cand / "include" / "cutlass" / "cutlass.h").exists():
            return str(cand)
    return None


def default_jobs() -> int:
    if os.environ.get("MAX_JOBS"):
        return max(1, int(os.environ["MAX_JOBS"]))
    cores = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 7.0 * cores
    # A CUTLASS translation unit (several instances) peaks near 7 GB of host memory in nvcc/cicc (6.9 GB measured:
    # csrc/gemm/sm90/instances_fp8_blockwise.cu, nvcc 13.0).
    return max(1, min(cores, int(mem_gb // 7)))


def _wheel_toolkit_args(nvcc: str) -> list[str]:
    """CMake arguments for a toolkit assembled by NVIDIA's pip wheels: its runtime wheel ships only the
    versioned libcudart.so.N, which FindCUDAToolkit does not look for (we link cudart_static, found as is)."""
    root = Path(nvcc).resolve().parent.parent
    if not any(root == t.resolve() for t in wheel_toolkits()):
        return []
    shared = sorted((root / "lib").glob("libcudart.so*"))
    return [f"-DCUDA_CUDART={shared[0]}"] if shared else []


class CMakeExtension(Extension):
    def __init__(self, name: str, sanitize: bool = False):
        super().__init__(name, sources=[])
        self.sanitize = sanitize


class CMakeBuild(build_ext):
    def initialize_options(self) -> None:
        super().initialize_options()
        # (module name, source hashes taken before the compile, build configuration) of each `_C` compiled
        # here: recorded beside the in-place copy, for MOE_KERNELS_PREBUILT.
        self.compiled: list[tuple[str, dict, dict]] = []

    def build_extension(self, ext: Extension) -> None:
        if ext.name.startswith("moe_kernels._C_emu"):
            return self.build_emulated(ext)
        import pybind11

        nvcc = find_nvcc()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        archs = os.environ.get("MOE_KERNELS_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
        cutlass = find_cutlass_root()
        sources = source_hashes(ROOT)
        config = build_config(archs, nvcc, cutlass, pybind11.__version__)
        if _flag(PREBUILT):
            return self.package_prebuilt(ext, sources, config)
        args = [
            f"-S{ROOT}",
            f"-B{build_dir}",
            "-GNinja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DMOE_KERNELS_CUDA_ARCHS={archs}",
            f"-DMOE_KERNELS_OUTPUT_DIR={out_dir}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        if cutlass:
            args.append(f"-DMOE_KERNELS_CUTLASS_DIR={cutlass}")
        args += _wheel_toolkit_args(nvcc)
        if shutil.which("ccache"):
            args += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        jobs = default_jobs()
        _say(f"building _C for {archs} with {jobs} job(s); CUTLASS: {cutlass or 'not found'}")
        subprocess.run(["cmake", *args], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", str(jobs)], check=True)
        self.compiled.append((ext.name, sources, config))

    def package_prebuilt(self, ext: Extension, sources: dict, config: dict) -> None:
        """MOE_KERNELS_PREBUILT=1: the in-place `_C` goes into the build as is, if it is up to date."""
        module = ROOT / self.get_ext_filename(ext.name)
        problems = prebuilt_problems(module, sources, config)
        if problems:
            raise SystemExit(f"moe_kernels: {PREBUILT}=1, but {module.relative_to(ROOT)} cannot be packaged:\n  "
                             + "\n  ".join(problems)
                             + f"\nBuild it again in place (pip install -e .), or unset {PREBUILT} to compile.")
        target = Path(self.get_ext_fullpath(ext.name))
        _say(f"{PREBUILT}=1: packaging {module.relative_to(ROOT)} as built ({config['cuda_archs']}), no compile")
        if module.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(module, target)

    def copy_extensions_to_source(self) -> None:
        """In-place builds (pip install -e .): beside each compiled `_C`, the record MOE_KERNELS_PREBUILT checks."""
        super().copy_extensions_to_source()
        for name, sources, config in self.compiled:
            write_record(ROOT / self.get_ext_filename(name), sources, config)

    def build_emulated(self, ext: CMakeExtension) -> None:
        """`_C_emu` / `_C_emu_asan`: the CUDA kernels compiled by the host compiler (tools/cuda_on_cpu)."""
        import pybind11

        name = ext.name.rsplit(".", 1)[-1]
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-S{ROOT / 'tools' / 'cuda_on_cpu'}",
            f"-B{build_dir}",
            "-GNinja",
            f"-DMOE_KERNELS_ROOT={ROOT}",
            f"-DCUDA_ON_CPU_INCLUDE={find_cuda_include()}",
            f"-DCUDA_ON_CPU_MODULE={name}",
            f"-DCUDA_ON_CPU_OUTPUT_DIR={out_dir}",
            f"-DCUDA_ON_CPU_SANITIZE={'ON' if ext.sanitize else 'OFF'}",
            f"-DCUDA_ON_CPU_DEBUG_INFO={os.environ.get('MOE_KERNELS_EMU_DEBUG_INFO', '-g1')}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        if find_cxx():
            args.append(f"-DCMAKE_CXX_COMPILER={find_cxx()}")
        if shutil.which("ccache"):
            args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        jobs = max(1, int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))
        _say(f"building {name} (the CUDA kernels executed on the CPU, for the tests) with {jobs} job(s)")
        subprocess.run(["cmake", *args], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", str(jobs)], check=True)


def extensions() -> list[Extension]:
    exts = []
    if _flag("MOE_KERNELS_SKIP_CUDA"):
        _say("MOE_KERNELS_SKIP_CUDA is set: no GPU kernels (every op runs its PyTorch reference).")
    elif find_nvcc() is None and not _flag(PREBUILT):
        _say("no CUDA compiler (nvcc) found: no GPU kernels (every op runs its PyTorch reference).")
    else:
        exts.append(CMakeExtension("moe_kernels._C"))
    if _flag("MOE_KERNELS_SKIP_EMU"):
        pass
    elif find_cuda_include() is None or find_cxx() is None:
        _say("no CUDA headers or no C++ compiler: the CPU-executed kernels (_C_emu, for tests) are not built.")
    else:
        exts.append(CMakeExtension("moe_kernels._C_emu"))
        if _flag("MOE_KERNELS_EMU_SANITIZE"):
            exts.append(CMakeExtension("moe_kernels._C_emu_asan", sanitize=True))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": CMakeBuild})
