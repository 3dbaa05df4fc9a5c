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
    assert list(perf.PARTS) == ["env", "host", "gemm", "layer", "fp8", "permute", "dispatch", "step"]
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
