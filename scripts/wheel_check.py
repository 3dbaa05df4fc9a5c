"""The binary wheel, from the compile `pip install -e .` already made: no second nvcc build.

    python scripts/wheel_check.py SCRATCH_DIR

1. `MOE_KERNELS_PREBUILT=1 pip wheel .`: the build backend packages the in-place moe_kernels/_C*.so, refusing
   if a source or the build configuration changed since it was compiled, and auditwheel tags it manylinux.
2. The wheel: a manylinux tag, `_C` byte for byte the in-place module, no CPU-executed test modules
   (`_C_emu*`); its size is printed.
3. A fresh virtual environment (no system site-packages) gets torch (pip's cache or find-links, as CI's
   `pip install torch==2.13.0`), the wheel and pytest. With no CUDA compiler on PATH and the working directory
   outside the checkout, `python -m moe_kernels` must report the kernels built, and a few CPU tests of the
   checkout run against the installed package (pytest's append import mode keeps the checkout behind
   site-packages on sys.path; the copy imported is checked).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # .ci/run's
# The env report, and the permute ops through the installed package (torch.compile's test left to the main run).
TESTS = ["tests/test_env.py", "tests/ops/test_permute.py", "-k", "not compile"]

# Runs inside the fresh environment: the tests, then which moe_kernels they imported.
RUN_TESTS = """
import sys, sysconfig, pytest
from pathlib import Path
rc = pytest.main(sys.argv[2:])
import moe_kernels, moe_kernels._C
site, checkout = Path(sysconfig.get_path("platlib")).resolve(), Path(sys.argv[1]).resolve()
for mod in (moe_kernels, moe_kernels._C):
    path = Path(mod.__file__).resolve()
    print("imported", mod.__name__, "from", path)
    if not path.is_relative_to(site) or path.is_relative_to(checkout):
        sys.exit(f"{mod.__name__} was imported from {path}, not the installed wheel in {site}")
sys.exit(rc)
"""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join("<script>" if "\n" in str(c) else str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def _without_cuda_compiler(env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in env.items() if k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not (Path(d) / "nvcc").exists())
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    wheelhouse = work / "wheelhouse"

    start = time.monotonic()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheelhouse), str(ROOT)],
         env={**os.environ, "MOE_KERNELS_PREBUILT": "1"})
    wheels = sorted(wheelhouse.glob("moe_kernels-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {wheelhouse}, found {[w.name for w in wheels]}"
    wheel = wheels[0]
    print(f"built {wheel.name} in {time.monotonic() - start:.0f} s")

    assert re.search(r"-manylinux_\d+_\d+_[a-z0-9_]+(\.manylinux\w+)*\.whl$", wheel.name), \
        f"{wheel.name} is not tagged manylinux"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        emu = [n for n in names if re.match(r"moe_kernels/_C_emu", n)]
        assert not emu, f"the wheel holds the CPU-executed test modules: {emu}"
        ext = [n for n in names if re.match(r"moe_kernels/_C\.[^/]*\.so$", n)]
        assert len(ext) == 1, f"expected one moe_kernels/_C*.so in the wheel, found {ext}"
        built = ROOT / ext[0]
        assert _sha256(zf.read(ext[0])) == _sha256(built.read_bytes()), \
            f"the wheel's {ext[0]} differs from the in-place {built}"
        ext_size = zf.getinfo(ext[0]).file_size
    print(f"wheel size: {wheel.stat().st_size / 2**20:.1f} MiB ({wheel.name}; {ext[0]} "
          f"{ext_size / 2**20:.1f} MiB unpacked, byte for byte the in-place build)")

    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    env = _without_cuda_compiler(os.environ)
    start = time.monotonic()
    # --no-compile: torch's thousands of modules are not byte-compiled ahead (only what runs is, on import).
    _run([python, "-m", "pip", "install", "-q", "--no-compile", TORCH, str(wheel), "pytest"], env=env, cwd=work)
    print(f"fresh environment with torch and the wheel in {time.monotonic() - start:.0f} s")
    assert subprocess.run(["bash", "-c", "command -v nvcc"], env=env, capture_output=True).returncode != 0

    report = _run([python, "-m", "moe_kernels"], env=env, cwd=work, capture_output=True, text=True).stdout
    print(report)
    assert re.search(r"^\s*extension_built\s+True\s*$", report, re.M), "the installed wheel's _C does not import"

    tests = [str(ROOT / t) if t.startswith("tests/") else t for t in TESTS]
    _run([python, "-c", RUN_TESTS, str(ROOT), "-q", "-p", "no:cacheprovider", "--import-mode=append",
          "--rootdir", str(work), *tests], env=env, cwd=work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
