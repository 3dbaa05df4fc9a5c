"""bench_dispatch: the CPU quick run works end to end on the CPU-executed kernels, and skips cleanly
without them; a combine that computes something else is reported instead of timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_dispatch as bd
from bench import harness

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, emulate: str):
    cmd = [sys.executable, "-m", "bench", "dispatch", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    env = dict(os.environ, MOE_KERNELS_EMULATE=emulate)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_cpu_run_writes_results(tmp_path):
    pytest.importorskip("moe_kernels._C_emu", reason="the CPU-executed build is not built")
    proc = _run(tmp_path, "1")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_dispatch.json").read_text())
    assert data["failures"] == []
    assert [(r["op"], r["case"]) for r in data["results"]] == [
        (op, f"tiny/EP8/T16/{p}") for p in ("bf16", "fp8") for op in ("dispatch", "combine")]
    for r in data["results"]:
        assert set(r["speedup"]) == {"all_to_all_virtual"} and r["bytes"] > 0 and r["shape"]["P"] == 8
    assert sum(line.startswith("HEADLINE ") for line in proc.stdout.splitlines()) == 4


def test_without_kernels_the_cpu_run_skips(tmp_path):
    proc = _run(tmp_path, "0")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "dispatch: skipped, the nvlink kernels need a GPU, or MOE_KERNELS_EMULATE=1" in proc.stdout


@pytest.mark.gpu
def test_a_wrong_combine_fails_the_case(cuda, monkeypatch):
    from moe_kernels import _ext

    if cuda.type == "cpu" and _ext.emulation() is None:
        pytest.skip("needs the kernels")
    ctx = harness.Context(cuda, quick=True, out_dir=Path("."))
    real = bd.VirtualNvlinkWorld.combine
    monkeypatch.setattr(bd.VirtualNvlinkWorld, "combine", lambda self, ys, hs: [o * 1.5 for o in real(self, ys, hs)])
    with pytest.raises(AssertionError, match="combine"):
        bd.run_case(ctx, bd.Case("tiny", 16, *bd.CPU_MODELS["tiny"], "bf16"))
