"""bench_router_losses: the CPU quick run works end to end; a wrong result is reported, not timed."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_router_losses as bl
from bench import harness, provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def losses_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_router_losses")
    cmd = [sys.executable, "-m", "bench", "router_losses", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_json_and_stdout(losses_run):
    out, stdout = losses_run
    data = json.loads((out / "bench_router_losses.json").read_text())
    assert data["suite"] == "router_losses" and data["failures"] == []
    results = data["results"]
    assert {r["op"] for r in results} == set(bl.OPS)
    for r in results:
        assert r["bytes"] == bl.nbytes(r["op"], bl.Case("tiny", 64, *bl.CPU_MODELS["tiny"]))
        assert set(r["speedup"]) == {"torch_eager"} and math.isfinite(r["speedup"]["torch_eager"])
        assert r["p20_us"] <= r["us"] <= r["p80_us"]
    assert (out / "bench_router_losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(line.startswith("HEADLINE ") for line in stdout.splitlines()) == len(bl.OPS)


def test_check_catches_a_wrong_capacity(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    c = bl.cases(ctx)[0]
    s = bl.make_inputs(ctx, c, seed=1)
    for op in bl.OPS:
        bl.check(c, op, s)  # ours agrees with the peer
    real = bl._ours

    def keeps_everything(op, case):
        if op == "capacity_probs":
            return lambda w, idx: (w, idx)
        return real(op, case)

    monkeypatch.setattr(bl, "_ours", keeps_everything)
    with pytest.raises(AssertionError, match="capacity_probs"):
        bl.check(c, "capacity_probs", s)


def test_check_catches_a_wrong_loss(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    c = bl.cases(ctx)[0]
    s = bl.make_inputs(ctx, c, seed=2)
    real = bl._ours

    def doubled(op, case):
        if op == "z_loss_fwd_bwd":
            return lambda x: tuple(2 * t for t in real(op, case)(x))
        return real(op, case)

    monkeypatch.setattr(bl, "_ours", doubled)
    with pytest.raises(AssertionError, match="z_loss"):
        bl.check(c, "z_loss_fwd_bwd", s)


def test_host_bound_modes_provenance_and_summary(losses_run):
    """Every case carries host issue / kernel / graph-replay times (the last two "n/a (CPU)" here, as
    stdout says), the run's provenance, its ceiling measurements and per-op summaries."""
    out, stdout = losses_run
    data = json.loads((out / "bench_router_losses.json").read_text())
    for r in data["results"]:
        assert r["modes"]["host_us"] > 0 and r["modes"]["kernel_us"] is None and r["modes"]["graph_us"] is None
        host = r["mode_speedup"]["torch_eager"]["host_us"]
        assert host == pytest.approx(r["peer_modes"]["torch_eager"]["host_us"] / r["modes"]["host_us"])
        assert r["ceiling"] == "copy" and r["ceiling_at"] in {c["label"] for c in data["ceilings_log"]}
        assert r["suspect"] is False
    assert "n/a (CPU)" in stdout and "host / kernel / graph us" in stdout
    meta = data["meta"]
    for key in provenance.PROVENANCE_KEYS:
        assert key in meta, key
    assert len(meta["commit"]) == 40 and isinstance(meta["dirty"], bool)
    assert (meta["diff_sha256"] is None) == (not meta["dirty"])
    assert meta["start"] <= meta["end"] and meta["gpu_start"] is None and meta["gpu_processes"] is None
    labels = [c["label"] for c in data["ceilings_log"]]
    assert labels[0] == "start#0" and labels[-1] == f"end:router_losses#{len(labels) - 1}"
    assert len(set(labels)) == len(labels)  # unique, so a result names the one it was judged against
    assert data["suspect"] is False and data["suspect_reasons"] == []
    assert set(data["summary"]) == set(bl.OPS)
    s = data["summary"]["tokens_per_expert"]
    assert s["cases"] == 1 and s["speedup"]["torch_eager"]["geomean"] > 0
    lines = stdout.splitlines()
    assert any(line.startswith("GEOMEAN tokens_per_expert vs torch_eager: ") and "; worst " in line for line in lines)
    assert any(line.startswith("SUMMARY tokens_per_expert over 1 cases: % of copy geomean") for line in lines)
