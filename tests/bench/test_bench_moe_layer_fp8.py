"""bench_moe_layer_fp8: the CPU run checks the FP8 layer against the BF16 layer before timing, and reports the
byte model's counts beside the times."""

from pathlib import Path

import pytest
import torch

from bench import bench_moe_layer_fp8 as bl
from bench import bytes as byte_model
from bench import harness


def _ctx() -> harness.Context:
    return harness.Context(torch.device("cpu"), quick=True, out_dir=Path("."))


def test_cpu_case_times_both_layers_and_counts_bytes():
    ctx = _ctx()
    c = bl._Case("deepseek-v3-ep8", bl.CPU_TOKENS)
    (r,) = bl.run_case(ctx, c)
    assert r.op == "moe_layer_fp8_fwd_bwd" and r.case == "deepseek-v3-ep8/T32"
    assert set(r.speedup) == {"moe_kernels_bf16"} and r.speedup["moe_kernels_bf16"] > 0
    cfg, cfg8 = bl._configs(ctx, "deepseek-v3-ep8")
    assert r.bytes == byte_model.layer(cfg8, c.T).bytes
    assert r.extra["bf16_bytes"] == byte_model.layer(cfg, c.T).bytes
    assert r.flops == 3 * bl.flops(cfg8, c.T) and r.extra["later_mb_us"] > 0
    (line,) = bl.headline([r])
    assert "bar: >= 1.3x at deepseek-v3 EP-8 local" in line


def test_a_wrong_fp8_product_fails_the_case(monkeypatch):
    from moe_kernels.nn import fused_fp8
    from moe_kernels.quant import recipe

    monkeypatch.setattr(fused_fp8, "fits", lambda *a: False)  # the recipe's functions, also under emulation
    real = recipe.grouped_mm_fp8
    monkeypatch.setattr(recipe, "grouped_mm_fp8", lambda *a: real(*a) * 1.5)
    with pytest.raises(AssertionError, match="fp8 layer out"):
        bl.run_case(_ctx(), bl._Case("qwen3-30b-a3b", bl.CPU_TOKENS))


def test_gpt_oss_case_is_a_measurement_without_a_bar():
    # H and F off 128 (144 and 208 on the CPU, 2880 on a GPU): checked and timed as the others, no bar.
    ctx = _ctx()
    cfg, cfg8 = bl._configs(ctx, "gpt-oss-120b")
    assert cfg8.hidden_size % 128 and cfg8.ffn_size % 128 and cfg8.activation == "swiglu"
    (r,) = bl.run_case(ctx, bl._Case("gpt-oss-120b", bl.CPU_TOKENS))
    assert r.speedup["moe_kernels_bf16"] > 0 and r.bytes == byte_model.layer(cfg8, bl.CPU_TOKENS).bytes
    (line,) = bl.headline([r])
    assert line.endswith("(no bar)")


def test_nemotron_case_is_a_measurement_without_a_bar():
    # Squared-ReLU experts, F not a multiple of 128 (208 on the CPU, 1856 on a GPU): checked and timed as the others,
    # its headline says it has no bar.
    ctx = _ctx()
    cfg, cfg8 = bl._configs(ctx, "nemotron-3-nano")
    assert cfg8.activation == "squared_relu" and cfg8.ffn_size % 128 and cfg.recipe is None
    (r,) = bl.run_case(ctx, bl._Case("nemotron-3-nano", bl.CPU_TOKENS))
    assert r.speedup["moe_kernels_bf16"] > 0 and r.bytes == byte_model.layer(cfg8, bl.CPU_TOKENS).bytes
    (line,) = bl.headline([r])
    assert line.endswith("(no bar)")
