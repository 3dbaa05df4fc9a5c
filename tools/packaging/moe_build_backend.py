"""PEP 517 build backend: setuptools', plus the CUDA compiler from NVIDIA's pip wheels when the machine has
a GPU driver but no CUDA toolkit (a bare GPU machine: `pip install .` still builds the kernels).

The wheels (nvcc, nvvm, crt, cccl with CUB, the runtime) are pinned to one CUDA minor version, CUDA_WHEELS;
unpinned, pip would mix minor versions whose headers and compiler disagree. They are added to the build
requirements only when
  - no system nvcc is found (CUDA_HOME / CUDA_PATH, PATH, /usr/local/cuda), and a GPU driver is present
    (libcuda loads), or
  - MOE_KERNELS_CUDA_FROM_PIP=1 (e.g. a build machine without a GPU);
never with MOE_KERNELS_SKIP_CUDA=1. A CPU-only machine therefore downloads nothing and gets the pure-Python
package (every op runs its PyTorch reference). MOE_KERNELS_IGNORE_SYSTEM_CUDA=1 hides the system toolkit,
so the wheels' compiler is used even where one is installed (CI checks that build this way).
setup.py finds the compiler with the same functions (`find_nvcc`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook is setuptools')

# 13.2: the first CUDA 13 minor whose nvcc wheel looks for libraries in the runtime wheel's lib/ (13.0 and 13.1
# look in lib64/, which no wheel provides, and fail to link).
CUDA_MINOR = "13.2"
CUDA_WHEELS = [
    f"nvidia-cuda-nvcc=={CUDA_MINOR}.*",
    f"nvidia-nvvm=={CUDA_MINOR}.*",
    f"nvidia-cuda-crt=={CUDA_MINOR}.*",
    f"nvidia-cuda-cccl=={CUDA_MINOR}.*",
    f"nvidia-cuda-runtime=={CUDA_MINOR}.*",
]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def system_nvcc() -> str | None:
    """nvcc of an installed CUDA toolkit, unless MOE_KERNELS_IGNORE_SYSTEM_CUDA=1 hides it."""
    if _flag("MOE_KERNELS_IGNORE_SYSTEM_CUDA"):
        return None
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


def wheel_toolkits() -> list[Path]:
    """Roots of CUDA toolkits assembled by NVIDIA's pip wheels (site-packages/nvidia/cuXX), newest first."""
    spec = importlib.util.find_spec("nvidia")
    roots = []
    for base in (spec.submodule_search_locations or []) if spec else []:
        roots += [p for p in Path(base).glob("cu*") if (p / "bin" / "nvcc").exists()]
    return sorted(roots, key=lambda p: p.name, reverse=True)


def wheel_nvcc() -> str | None:
    roots = wheel_toolkits()
    return str(roots[0] / "bin" / "nvcc") if roots else None


def find_nvcc() -> str | None:
    """The system toolkit's nvcc, else the pip wheels' (see the module docstring)."""
    return system_nvcc() or wheel_nvcc()


def driver_present() -> bool:
    """Whether an NVIDIA GPU driver is installed (its user-space library loads)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def cuda_from_pip() -> bool:
    if _flag("MOE_KERNELS_SKIP_CUDA"):
        return False
    if _flag("MOE_KERNELS_CUDA_FROM_PIP"):
        return True
    return system_nvcc() is None and driver_present()


def _cuda_requires() -> list[str]:
    return list(CUDA_WHEELS) if cuda_from_pip() else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _cuda_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _cuda_requires()
