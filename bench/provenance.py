"""Where a bench figure came from, recorded in every JSON: the commit and any difference from it, the
command and settings, the timing-related environment, versions, and the GPU's state at both ends of the
run (nvidia-smi) with the processes sharing it."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .harness import Context

REPO_ROOT = Path(__file__).resolve().parent.parent


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# Every key provenance() returns; a JSON without one of them is not a result to quote.
PROVENANCE_KEYS = ("commit", "dirty", "diff_sha256", "untracked", "command", "settings", "env", "versions", "host",
                   "start", "end", "gpu_start", "gpu_end", "gpu_processes")
# Environment variables that change what or how fast things run.
TIMING_ENV = ("CUDA_LAUNCH_BLOCKING", "CUDA_VISIBLE_DEVICES", "MOE_KERNELS_CHECK", "MOE_KERNELS_EMULATE",
              "MOE_KERNELS_CUDA_ARCHS", "PYTORCH_CUDA_ALLOC_CONF", "TEARDOWN_CUPTI", "LIGER_FUSED_MOE_AUTOTUNE")


def _version(module: str) -> str | None:
    import importlib.metadata

    for dist in (module, module.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.applications.graphics", "pstate",
                    "temperature.gpu", "power.draw", "power.limit", "uuid", "clocks_event_reasons.active")


def provenance(ctx: Context) -> dict[str, Any]:
    """Where a figure came from: the commit, whether the tree differed from it (and a hash of the
    difference, so two runs of one dirty tree can be told apart), when, and the GPU's clocks,
    temperature and throttle reasons at the start and end, with the processes sharing the GPU."""
    commit = run_cmd(["git", "rev-parse", "HEAD"])
    dirty = diff = None
    untracked: list[str] = []
    if commit:
        status = run_cmd(["git", "status", "--porcelain", "--untracked-files=no"])
        # Untracked files git does not ignore count too: an untracked module can be what gets imported.
        untracked = (run_cmd(["git", "ls-files", "--others", "--exclude-standard"]) or "").split()
        dirty = bool(status) or bool(untracked)
        digest = hashlib.sha256((run_cmd(["git", "diff", "HEAD", "--binary"], strip=False) or "").encode())
        for path in untracked:
            digest.update(path.encode())
            try:
                digest.update((REPO_ROOT / path).read_bytes())
            except OSError:
                pass
        diff = digest.hexdigest() if dirty else None
    return {
        "commit": commit,
        "dirty": dirty,
        "diff_sha256": diff,
        "untracked": untracked,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "settings": {"models": ctx.models, "tokens": ctx.tokens, "modes": ctx.modes, "profile": ctx.profile,
                     "flush": ctx.flush_mode},
        "env": {k: os.environ[k] for k in TIMING_ENV if k in os.environ},
        "versions": {m: _version(m) for m in ("transformers", "liger_kernel", "triton")},
        "host": platform.node(),
        "start": ctx.started_utc,
        "end": utc_now(),
        "gpu_start": ctx.gpu_state_start,
        "gpu_end": gpu_state(ctx),
        "gpu_processes": gpu_processes(ctx),
    }


def gpu_state(ctx: Context) -> dict[str, Any] | None:
    """nvidia-smi's clocks (MHz), temperature (C), power (W) and active clock-event (throttle) reasons;
    None on the CPU, or where nvidia-smi does not answer."""
    if not ctx.is_cuda:
        return None
    idx = f"--id={ctx.device.index or 0}"
    for fields in (GPU_STATE_FIELDS, GPU_STATE_FIELDS[:-1] + ("clocks_throttle_reasons.active",)):
        out = run_cmd(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", idx])
        if out:
            return dict(zip((f.replace("clocks_throttle", "clocks_event") for f in fields),
                            (v.strip() for v in out.split(","))))
    return None


def gpu_processes(ctx: Context) -> list[str] | None:
    """The compute processes on the GPUs (pid, name, memory): anything but this one makes the run suspect."""
    if not ctx.is_cuda:
        return None
    out = run_cmd(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader",
                f"--id={ctx.device.index or 0}"])
    return None if out is None else [line.strip() for line in out.splitlines() if line.strip()]


def run_cmd(argv: list[str], strip: bool = True) -> str | None:
    try:
        p = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return p.stdout.strip() if strip else p.stdout
