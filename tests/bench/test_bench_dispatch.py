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
    # Ours twice per case: on every SM (like for like with the peer) and on our default 20.
    sms = {"sms_all": bd.CPU_ALL_SMS, "sms20": 20}
    assert [(r["op"], r["case"]) for r in data["results"]] == [
        (op, f"tiny/EP8/T16/{p}/{suffix}") for p in ("bf16", "fp8") for suffix in sms for op in ("dispatch", "combine")]
    ceilings = {c["label"]: c for c in data["ceilings_log"]}
    peer_us = {}
    for r in data["results"]:
        assert set(r["speedup"]) == {"all_to_all_virtual"} and r["bytes"] > 0 and r["shape"]["P"] == 8
        assert r["shape"]["sms"] == sms[r["case"].rsplit("/", 1)[1]]
        # bytes received against the received-bytes ceiling: copy bandwidth / 2
        assert r["ceiling"] == "copy_received"
        received_gbps = ceilings[r["ceiling_at"]]["copy_gbps"] / 2
        assert r["pct_of_ceiling"] == pytest.approx(100 * r["gbps"] / received_gbps)
        assert r["extra"]["received_mib"] * 2**20 == pytest.approx(r["bytes"])
        # the peer takes no SM count: one timing per case and op, compared with both of ours
        peer_us.setdefault((r["op"], r["case"].rsplit("/", 1)[0]), set()).add(r["peer_us"]["all_to_all_virtual"])
    assert all(len(us) == 1 for us in peer_us.values()), peer_us
    by = {(r["op"], r["case"]): r for r in data["results"]}
    for p in ("bf16", "fp8"):  # the same traffic at either SM count
        for op in ("dispatch", "combine"):
            assert by[(op, f"tiny/EP8/T16/{p}/sms_all")]["bytes"] == by[(op, f"tiny/EP8/T16/{p}/sms20")]["bytes"]
    headlines = [line for line in proc.stdout.splitlines() if line.startswith("HEADLINE ")]
    assert len(headlines) == 8 and all("received-bytes ceiling (copy bandwidth / 2)" in line for line in headlines)
    judged = [line for line in headlines if "/sms_all:" in line]
    assert len(judged) == 4 and all("like for like with the peer (bar: >= 80% of the measured copy bandwidth "
                                    "counted like for like" in line for line in judged)
    assert all(line.endswith(("[meets bar]", "[below bar]")) for line in judged)
    assert all(line.endswith("(no bar)") for line in headlines if "/sms20:" in line)


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
