"""bench_quant: the CPU quick run works end to end; a wrong code is reported, not timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_quant as bq
from bench import harness

ROOT = Path(__file__).resolve().parents[2]
OPS = {"quantize_fp8_tensor", "quantize_fp8_row", "quantize_fp8_block", "quantize_fp8_tile", "dequantize_fp8_block",
       "quantize_nvfp4_given_amax", "quantize_nvfp4_1d", "quantize_nvfp4_stochastic", "quantize_nvfp4_tile_2d",
       "dequantize_nvfp4", "quantize_fp8_experts_dual", "quantize_fp8_experts_dual_copy"}
EXPERTS = {"quantize_fp8_experts_dual": (2, 0, "torch_eager"), "quantize_fp8_experts_dual_copy": (4, 2, "copy_then_quantize")}


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_quant")
    cmd = [sys.executable, "-m", "bench", "quant", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_json_and_stdout(quant_run):
    out, stdout = quant_run
    data = json.loads((out / "bench_quant.json").read_text())
    assert data["suite"] == "quant" and data["failures"] == []
    assert {r["op"] for r in data["results"]} == OPS
    T, (H, F) = 64, bq.CPU_MODELS["tiny"]
    for r in data["results"]:
        if r["op"] in EXPERTS:  # the stacked experts [8, 2F, H], from bf16 weights or fp32 masters (with the copy)
            es_in, es_copy, peer = EXPERTS[r["op"]]
            assert r["shape"] == {"E": 8, "N": 2 * F, "K": H} and set(r["speedup"]) == {peer}
            assert r["bytes"] == 8 * 2 * F * H * (es_in + es_copy + 2) + 2 * 4 * 8 * (2 * F // 128) * (H // 128)
            continue
        M, K = (8 * 2 * F, H) if r["op"] in ("quantize_fp8_tile", "quantize_nvfp4_tile_2d") else (T, H)
        assert r["shape"] == {"M": M, "K": K}
        if "nvfp4" in r["op"]:
            assert r["bytes"] == bq._nbytes_nvfp4(M, K, 2)
        else:
            assert r["bytes"] == bq._nbytes_quant(r["op"].rsplit("_", 1)[1], M, K, 2)
        assert set(r["speedup"]) == {"torch_eager"}
    assert sum(line.startswith("HEADLINE ") for line in stdout.splitlines()) == len(OPS)


def test_a_wrong_code_fails_the_case(monkeypatch):
    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = bq.moe_kernels.quantize_fp8

    def off_by_one(x, gran):
        q, s = real(x, gran)
        codes = q.view(torch.uint8).clone()
        codes.view(-1)[0] ^= 1
        return codes.view(q.dtype), s

    monkeypatch.setattr(bq.moe_kernels, "quantize_fp8", off_by_one)
    with pytest.raises(AssertionError, match="codes"):
        bq.run_case(ctx, bq.cases(ctx)[0])
