"""bench_hf_blocks: the CPU run works end to end over its families, and a patched block that computes something
else is reported instead of timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from bench import bench_hf_blocks as bh  # noqa: E402
from bench import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "bench", "hf_blocks", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_hf_blocks.json").read_text())
    assert data["failures"] == []
    lora = [m + "+lora" for m in bh.LORA_MODELS]
    assert [r["case"] for r in data["results"]] == [f"{m}/T{bh.CPU_TOKENS}" for m in (*bh.TINY, *lora)]
    for r in data["results"]:
        op = "hf_lora_fwd_bwd" if "+lora" in r["case"] else "hf_block_fwd_bwd"
        assert r["op"] == op and set(r["speedup"]) == {"transformers"}
    variants = {r["case"].split("/")[0]: r["peer_variant"]["transformers"] for r in data["results"]}
    assert "Llama4TextMoe, dense experts" in variants["llama4-scout"]
    assert "GptOssMLP" in variants["gpt-oss-120b+lora"] and "LoRA (W + s B A formed)" in variants["gpt-oss-120b+lora"]
    assert 'Qwen3MoeSparseMoeBlock, experts_implementation="eager"' in variants["qwen3-30b-a3b"]  # the CPU's
    assert "DbrxFFN, its experts' loop over the experts hit" in variants["dbrx"]
    dbrx = next(r for r in data["results"] if r["case"].startswith("dbrx"))
    assert dbrx["shape"] == dict(T=bh.CPU_TOKENS, H=64, F=32, E=8, k=2, Fs=0)
    llama = next(r for r in data["results"] if r["case"].startswith("llama4"))
    s = llama["shape"]  # the routed work and the shared expert's, fwd + bwd
    assert llama["flops"] == 3 * 2 * s["T"] * 3 * s["H"] * (s["k"] * s["F"] + s["Fs"]) and s["Fs"] == s["F"]
    nemotron = next(r for r in data["results"] if r["case"].startswith("nemotron"))
    s = nemotron["shape"]  # experts without a gate: two weight matrices each, routed and shared
    assert s["m"] == 2 and s["Fs"] > 0
    assert nemotron["flops"] == 3 * 2 * s["T"] * 2 * s["H"] * (s["k"] * s["F"] + s["Fs"])


@pytest.mark.parametrize("model", ["llama4-scout", "qwen3-30b-a3b", "nemotron-3-nano", "dbrx"])
def test_a_wrong_patched_block_fails_the_case(monkeypatch, model):
    from moe_kernels.integrations import hf

    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = hf.experts.unpermute
    monkeypatch.setattr(hf.experts, "unpermute", lambda y, row_map, *a: real(1.01 * y, row_map, *a))
    with pytest.raises(AssertionError, match="hf block: output"):
        bh.run_case(ctx, bh.Case(model, bh.CPU_TOKENS))


@pytest.mark.parametrize("model", ["gpt-oss-120b+lora", "qwen3-30b-a3b+lora"])
def test_a_wrong_fused_adapter_fails_the_case(monkeypatch, model):
    # the adapters' terms scaled twice on our side ([E, K, N] and [E, N, K] experts alike): reported, not timed
    from moe_kernels.integrations import hf

    ctx = harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))
    real = hf.experts.lora_terms
    monkeypatch.setattr(hf.experts, "lora_terms", lambda m, n: [(lhs, rhs, 2 * s) for lhs, rhs, s in real(m, n)])
    with pytest.raises(AssertionError, match="hf block: output"):
        bh.run_case(ctx, bh.Case(model, bh.CPU_TOKENS))
