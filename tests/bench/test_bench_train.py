import json
import subprocess
import sys

from bench.harness import REPO_ROOT


def test_train_bench_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "train", "--quick", "--device", "cpu", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "bench_train.json").read_text())
    assert data["failures"] == []
    res, res8, acc = data["results"]
    assert res["op"] == "train_step" and res["us"] > 0 and res["flops"] > 0
    assert res["speedup"]["torch_native"] > 0
    # The step split at the last backward: its parts add up to it (medians of sums: within the spread).
    extra = res["extra"]
    assert extra["fwd_bwd_us"] > 0 and extra["optim_us"] > 0
    assert 0.5 * res["us"] < extra["fwd_bwd_us"] + extra["optim_us"] < 2 * res["us"]
    assert extra["tokens_per_step"] == 4 * 64
    # Two micro-batches a step: twice the tokens and FLOPs of one.
    assert acc["op"] == "train_step" and acc["shape"]["micro_batches"] == 2
    assert acc["flops"] == 2 * res["flops"] and acc["extra"]["tokens_per_step"] == 2 * 4 * 64
    assert res8["op"] == "train_step_fp8" and res8["flops"] == res["flops"]
    assert set(res8["speedup"]) == {"moe_kernels_bf16", "torch_native"}
    assert any("torch-native" in line for line in data["headline"])
    assert "HEADLINE train_step_fp8" in proc.stdout
    assert (tmp_path / "bench_train.png").exists()
    assert "HEADLINE train_step" in proc.stdout
