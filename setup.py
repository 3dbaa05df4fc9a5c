"""Build script: drives CMake + ninja to compile `moe_kernels._C`.

Environment knobs:
  MOE_KERNELS_CUDA_ARCHS   CUDA architectures, ';'-separated (default "90a").
  MOE_KERNELS_SKIP_CUDA=1  install the pure-Python package (CPU references only).
  CUTLASS_DIR              CUTLASS checkout (its include/ is used) instead of the nvidia-cutlass wheel.
  MAX_JOBS                 parallel compile jobs (default: cores, capped by memory at ~4 GB per job).
  CUDA_HOME / CUDA_PATH    where nvcc lives when it is not on PATH.
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


def _say(msg: str) -> None:
    print(f"moe_kernels: {msg}", file=sys.stderr, flush=True)


def find_nvcc() -> str | None:
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cand = Path(os.environ[env]) / "bin" / "nvcc"
            if cand.exists():
                return str(cand)
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path("/usr/local/cuda/bin/nvcc")
    return str(cand) if cand.exists() else None


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
        mem_gb = 4.0 * cores
    # A CUTLASS translation unit peaks near 4 GB of host memory in nvcc/cicc.
    return max(1, min(cores, int(mem_gb // 4)))


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        nvcc = find_nvcc()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        archs = os.environ.get("MOE_KERNELS_CUDA_ARCHS", "90a")
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
        cutlass = find_cutlass_root()
        if cutlass:
            args.append(f"-DMOE_KERNELS_CUTLASS_DIR={cutlass}")
        if shutil.which("ccache"):
            args += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        jobs = default_jobs()
        _say(f"building _C for sm_{archs} with {jobs} job(s); CUTLASS: {cutlass or 'not found'}")
        subprocess.run(["cmake", *args], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", str(jobs)], check=True)


def extensions() -> list[Extension]:
    if os.environ.get("MOE_KERNELS_SKIP_CUDA", "0") not in ("", "0"):
        _say("MOE_KERNELS_SKIP_CUDA is set: installing the pure-Python package (CPU references only).")
        return []
    if find_nvcc() is None:
        _say("no CUDA compiler (nvcc) found: installing the pure-Python package (CPU references only).")
        return []
    return [CMakeExtension("moe_kernels._C")]


setup(ext_modules=extensions(), cmdclass={"build_ext": CMakeBuild})
