"""The byte model (bench/bytes.py): each kernel's reads and writes counted on meta tensors, checked against
hand counts, and the FP8 path's weight reads per optimizer step."""

from __future__ import annotations

import torch

from bench import bytes as B
from bench import bench_bytes
from moe_kernels.nn import PRESETS
from moe_kernels.quant.recipe import Fp8BlockwiseRecipe


def test_expert_gemm_bf16_counts_every_operand_once():
    E, N, K, M = 4, 96, 64, 200
    c = B.expert_gemm(E, N, K, M)
    ops = [k.op for k in c.kernels]
    assert ops == ["moe_kernels.grouped_mm", "moe_kernels.grouped_mm_dgrad", "moe_kernels.grouped_mm_wgrad"]
    x, w, out, sizes = M * K * 2, E * N * K * 2, M * N * 2, E * 4
    fwd, dgrad, wgrad = c.kernels
    assert (fwd.read, fwd.written) == (x + w + sizes, out)
    assert (dgrad.read, dgrad.written) == (out + w + sizes, x)
    assert (wgrad.read, wgrad.written) == (out + x + sizes, w)
    assert c.bytes == 3 * (x + w + out) + 3 * sizes
    assert c.weight_reads == {"w": 2} and all(k.kind == "gemm" for k in c.kernels)


def test_views_launch_nothing_and_data_only_kernels_are_named():
    with torch.device("meta"):
        a = torch.empty(8, 16, dtype=torch.bfloat16)
    counter = B.ByteCounter({"a": a})
    with counter:
        v = a.view(16, 8).t().expand(8, 16)  # views: no rows
        z = torch.zeros(8, 16, device="meta")  # fill: writes only
        c = v.contiguous()  # a transposed view made contiguous: a transpose
        f = a.float()  # a cast
        z.add_(f)  # in place: reads both, writes z
        z.copy_(c)  # a cast (bf16 -> fp32): reads c, writes z
        torch._foreach_copy_([a, c], [z, f])  # a cast of each pair: reads the sources, writes the list
    kinds = [(k.op, k.kind, k.read, k.written) for k in counter.kernels]
    assert kinds == [
        ("aten.zeros", "fill", 0, 512),
        ("aten.clone", "transpose", 256, 256),
        ("aten._to_copy", "cast", 256, 512),
        ("aten.add_", "kernel", 1024, 512),
        ("aten.copy_", "cast", 256, 512),
        ("aten._foreach_copy_", "cast", 1024, 512),
    ]
    assert [k.weights for k in counter.kernels] == [(), ("a",), ("a",), (), (), ()]


def test_layer_weight_reads_per_step():
    """BF16 reads each expert weight twice a micro-batch (forward and dgrad); the FP8 recipe with the weight
    cache reads each bf16 weight once a step (its quantization), however many micro-batches."""
    cfg = PRESETS["qwen3-30b-a3b"](hidden_size=256, ffn_size=128, num_experts=16)
    bf16 = B.layer(cfg, 64, micro_batches=2)
    fp8 = B.layer(cfg.replace(recipe=Fp8BlockwiseRecipe()), 64, micro_batches=2)
    assert bf16.weight_reads == {"w13": 4, "w2": 4}
    assert fp8.weight_reads == {"w13": 1, "w2": 1}
    # The first GEMM's E4M3 input (both layouts) comes from the gather that permutes the tokens.
    assert {k.op for k in fp8.kernels} >= {"moe_kernels.grouped_mm_fp8", "moe_kernels.unpermute_bwd_quantize_fp8"}
    assert "moe_kernels.permute_quantize_fp8" not in {k.op for k in fp8.kernels}
    # The second micro-batch's weight gradients accumulate into .grad: an add over each weight's gradient.
    adds = [k for k in bf16.kernels if k.phase.startswith("mb1") and k.op in ("aten.add_", "aten.add")
            and k.written == cfg.num_experts * 2 * cfg.ffn_size * cfg.hidden_size * 2]
    assert adds


def test_fp8_layer_off_multiples_of_128_takes_the_producers():
    """H and F off 128 (GPT-OSS's 2880; here 144 and 208): every FP8 operand still comes from its producer, the codes
    zero-padded in the same pass, so no quantization of a bf16 tensor is on the path."""
    cfg = PRESETS["gpt-oss-120b"](hidden_size=144, ffn_size=208, num_experts=8)
    ops = [k.op for k in B.layer(cfg.replace(recipe=Fp8BlockwiseRecipe()), 64, micro_batches=1).kernels]
    for producer in ("unpermute_bwd_quantize_fp8", "swiglu_quantize_fp8", "swiglu_bwd_quantize_fp8"):
        assert "moe_kernels." + producer in ops, producer
    assert ops.count("moe_kernels.unpermute_bwd_quantize_fp8") == 2  # the forward's gather, the backward's
    for composed in ("quantize_fp8", "quantize_fp8_dual", "quantize_fp8_tokens", "swiglu", "swiglu_bwd"):
        assert "moe_kernels." + composed not in ops, composed


def test_bench_case_reports_ratios_from_the_counts():
    row = bench_bytes.case("qwen3-30b-a3b", 512)
    b, f = row["bf16"], row["fp8"]
    # A later micro-batch: the second one's kernels alone (phase "mb1"), counted here from the layer itself.
    two = B.layer(PRESETS["qwen3-30b-a3b"](), 512, micro_batches=2)
    assert b["later_mb_bytes"] == sum(k.bytes for k in two.kernels if k.phase.startswith("mb1 "))
    assert b["step_x1"]["bytes"] == sum(k.bytes for k in two.kernels if k.phase.startswith("mb0 "))
    assert b["weight_reads_x2"] == {"w13": 4, "w2": 4}
    assert f["weight_reads_x2"] == {"w13": 1, "w2": 1}
    assert all(set(k) >= {"case", "bytes", "by_kind", "kernels"} for k in (b["step_x1"], f["gemm_w13"]))


def test_master_weights_fp8_wgrad_writes_the_main_gradient_itself():
    """With master weights (moe-train on CUDA without FSDP): BF16's weight gradients are written in bf16 and
    folded into the fp32 main gradients by a hook (a copy in the first micro-batch, an add after); the FP8
    wgrad writes the main gradient from its epilogue (written in the first, read and written after), so no
    [E, N, K] bf16 gradient exists. BF16's step writes the bf16 copies with one foreach cast; FP8's writes each
    expert weight's copy with its tiles in both layouts from one read of the master (weight_cache.refresh), so
    no kernel of the step or the micro-batches reads a bf16 expert weight, and none quantizes one."""
    cfg = PRESETS["qwen3-30b-a3b"](hidden_size=256, ffn_size=128, num_experts=16)
    E, N13, H, F = 16, 256, 256, 128
    w13 = E * N13 * H
    bf16 = B.layer(cfg, 64, micro_batches=2, master_weights=True)
    fp8 = B.layer(cfg.replace(recipe=Fp8BlockwiseRecipe()), 64, micro_batches=2, master_weights=True)
    assert bf16.weight_reads == {"w13": 4, "w2": 4} and fp8.weight_reads == {"w13": 0, "w2": 0}
    into = [k for k in fp8.kernels if k.op == "moe_kernels.grouped_mm_fp8_wgrad_into"]
    assert len(into) == 4  # w13 and w2, two micro-batches
    first = next(k for k in into if k.phase == "mb0 bwd" and k.written == 4 * w13)
    later = next(k for k in into if k.phase == "mb1 bwd" and k.written == 4 * w13)
    assert later.read - first.read == 4 * w13  # the main gradient read only when accumulating
    grads = {f"bf16[{E},{N13},{H}]", f"bf16[{E},{H},{F}]"}  # no bf16 weight gradient written
    assert not any(k.shapes.split("->")[1].strip() in grads for k in fp8.kernels)
    assert any(k.shapes.split("->")[1].strip() in grads for k in bf16.kernels)
    folds = [k for k in bf16.kernels if k.phase.endswith("bwd") and k.written == 4 * w13
             and k.op in ("aten.copy_", "aten.add_")]
    assert [k.op for k in folds] == ["aten.copy_", "aten.add_"]
    (cast,) = [k for k in bf16.kernels if k.phase == "step"]
    assert cast.kind == "cast" and (cast.read, cast.written) == (4 * (w13 + E * H * F), 2 * (w13 + E * H * F))
    steps = [k for k in fp8.kernels if k.phase == "step"]
    assert [k.op for k in steps] == ["moe_kernels.quantize_fp8_experts_dual_copy"] * 2
    tiles13 = E * (N13 // 128) * (H // 128) * 4  # fp32 scales of one layout
    assert (steps[0].read, steps[0].written) == (4 * w13, 2 * w13 + 2 * w13 + 2 * tiles13)
    assert not any("quantize_fp8_experts_dual" in k.op for k in fp8.kernels if k.phase != "step")
