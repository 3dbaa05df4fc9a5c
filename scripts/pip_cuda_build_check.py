"""The pip-only CUDA build, checked without a GPU: hide the system toolkit, let the build backend choose
NVIDIA's compiler wheels, install exactly those into a scratch directory, and compile one translation unit
of ours with the wheels' nvcc (the flags of CMakeLists.txt's _C target, sm_90a).

    MOE_KERNELS_IGNORE_SYSTEM_CUDA=1 MOE_KERNELS_CUDA_FROM_PIP=1 python scripts/pip_cuda_build_check.py

There is no CUDA 12 pip-only build to check: NVIDIA's CUDA 12 compiler wheel (nvidia-cuda-nvcc-cu12 12.8, 12.9)
has no nvcc, and MOE_KERNELS_CUDA_WHEELS=12.8 stops here as it stops the build (the backend's CUDA12_NO_PIP_BUILD).

Fails when the backend would not add the wheels, when they do not install together, when setup.py's
compiler lookup does not find their nvcc, or when it cannot compile csrc/permute/permute.cu and link it
with the wheels' static runtime.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "csrc/permute/permute.cu"  # includes CUB (the cccl wheel) and our quantization headers


def main() -> int:
    os.environ["MOE_KERNELS_IGNORE_SYSTEM_CUDA"] = "1"
    os.environ["MOE_KERNELS_CUDA_FROM_PIP"] = "1"
    sys.path.insert(0, str(ROOT / "tools" / "packaging"))
    import moe_build_backend as backend

    assert backend.system_nvcc() is None, "MOE_KERNELS_IGNORE_SYSTEM_CUDA=1 must hide the system toolkit"
    extra = backend.get_requires_for_build_wheel()
    wheels = [r for r in extra if r.startswith("nvidia-")]
    minor = backend.cuda_wheels_minor()
    assert wheels == backend.cuda_wheels(), f"the backend asked for {extra}"
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "site"
        start = time.time()
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *wheels],
                       check=True)
        print(f"installed {' '.join(wheels)} in {time.time() - start:.0f} s")
        env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{ROOT / 'tools' / 'packaging'}"}
        nvcc = subprocess.run([sys.executable, "-c", "from moe_build_backend import find_nvcc; print(find_nvcc())"],
                              env=env, check=True, capture_output=True, text=True).stdout.strip()
        assert nvcc.startswith(str(target)), f"setup.py would use {nvcc}, not the wheels' nvcc"
        version = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
        assert f"release {minor}" in version, version
        start = time.time()
        obj = Path(tmp) / "permute.o"
        subprocess.run([nvcc, "-std=c++20", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC",
                        "-I", str(ROOT / "csrc"), "-c", str(ROOT / SOURCE), "-o", str(obj)], check=True, env=env)
        assert obj.stat().st_size > 0
        # Linked as a shared module with the static runtime, as _C is: nvcc must find the runtime wheel's libraries.
        lib = Path(tmp) / "libpermute.so"
        subprocess.run([nvcc, "-shared", "-arch=sm_90a", "--cudart=static", str(obj), "-o", str(lib)], check=True, env=env)
        assert lib.stat().st_size > 0
        print(f"compiled and linked {SOURCE} for sm_90a with {nvcc} (CUDA {minor}) in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
