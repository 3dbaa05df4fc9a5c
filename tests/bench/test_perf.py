"""bench.perf (the GPU perf mode) on a CPU: parts are checked, the budget skips what does not fit and says
so, and the env part writes its flush comparison. CI also runs every part (scripts/gpu_check.sh perf with
PERF_DRY_RUN=1); these check the script's own rules."""

import json
import subprocess
import sys
from pathlib import Path

from bench import BENCHES
from bench import perf

ROOT = Path(__file__).resolve().parents[2]


def run_perf(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.perf", str(out), "--dry-run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_parts_name_real_families_in_priority_order():
    assert list(perf.PARTS) == ["env", "host", "gemm", "layer", "fp8", "permute", "dispatch", "step", "hf"]
    for part in perf.PARTS.values():
        assert part.min_s > 0
        for run in part.runs:
            assert run.family in BENCHES, run
    # The 32768-token bars are in the sweep: the layer and the grouped GEMM forward.
    assert any(32768 in (r.tokens or ()) for r in perf.PARTS["layer"].runs)
    assert any(32768 in (r.tokens or ()) for r in perf.PARTS["gemm"].runs)


def test_unknown_part_is_refused(tmp_path):
    p = run_perf(tmp_path, "--parts", "env,warp")
    assert p.returncode != 0 and "unknown ['warp']" in p.stdout + p.stderr


def test_budget_skips_and_records(tmp_path):
    p = run_perf(tmp_path, "--parts", "host,step", "--budget", "0")
    summary = json.loads((tmp_path / "perf_summary.json").read_text())
    assert set(summary["parts"]) == {"host", "step"}
    assert all(v["status"].startswith("skipped: ") for v in summary["parts"].values())
    assert p.returncode == 1  # a dry run that skipped a part has not checked it


def test_env_part_compares_flush_modes(tmp_path):
    p = run_perf(tmp_path, "--parts", "env", "--budget", "120")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "perf_summary.json").read_text())
    assert summary["parts"]["env"]["status"] == "ok" and summary["dry_run"] is True
    data = json.loads((tmp_path / "bench_perf_env_flush.json").read_text())
    assert {r["op"] for r in data["results"]} == {"flush_read", "flush_write", "flush_none"}
    assert {r["case"] for r in data["results"]} == {"copy_16MiB", "router_topk_fwd_T4096"}
    assert all(r["extra"]["us_vs_read_flush"] > 0 for r in data["results"])
    assert (tmp_path / "env.txt").read_text().strip()


def test_layer_part_writes_each_token_count_first_and_pins_liger():
    runs = perf.PARTS["layer"].runs
    assert [r.family for r in runs] == ["moe_layer", "moe_layer", "expert_mlp"]  # the gather-fused experts last
    runs = runs[:2]
    assert [r.tokens for r in runs] == [(8192,), (32768,)]  # one JSON per count, 8192's first
    assert all(r.modes and dict(r.env).get("LIGER_FUSED_MOE_AUTOTUNE") == "0" for r in runs)
    # The estimate in perf.py (~50 s at 8192, ~60 s at 32768) sets these: the part starts with room for
    # 8192's figures, and 32768 starts only where its own run fits.
    assert perf.PARTS["layer"].min_s >= 50 and runs[1].min_s >= 50


def test_host_part_profiles_router_host_time(tmp_path):
    p = run_perf(tmp_path, "--parts", "host", "--budget", "300")
    summary = json.loads((tmp_path / "perf_summary.json").read_text())
    # Without MOE_KERNELS_EMULATE the overhead family reports a failure (it needs the CUDA code path); the
    # part still runs to its end and its profiles.
    assert summary["parts"]["host"]["status"] in ("ok", "failures"), p.stdout[-3000:] + p.stderr[-3000:]
    files = summary["parts"]["host"]["files"]
    profiles = [f for f in files if f.startswith("profile_host_router_")]
    assert len(profiles) == 1  # the CPU's tiny shapes: one case (a GPU: perf's PROFILE_CASES, a handful)
    text = (tmp_path / profiles[0]).read_text()
    for needle in ("aten op + its kernel launch", "autograd.grad over a one-op graph", "== ours:", "== torch_eager:",
                   "by self CPU time", "by tottime"):
        assert needle in text, needle
    host = [line for line in p.stdout.splitlines() if line.startswith("HOST router_topk_fwd_bwd ")]
    assert len(host) == 1 and "ours " in host[0] and "torch_eager " in host[0] and "floors:" in host[0]
