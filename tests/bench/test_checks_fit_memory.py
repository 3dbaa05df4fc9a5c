"""The checks that run on multi-GB results fit beside them: moe_kernels.testing's fp64 comparisons in blocks
of rows give the whole tensor's verdict, and the harness records a case that runs out of GPU memory as
skipped and goes on with the next one."""

import json

import pytest
import torch

from bench import bench_grouped_mm_fp8 as b8
from bench import harness as h
from moe_kernels import testing as mt


def _fp32_case(seed=0, shape=(37, 5, 3)):
    g = torch.Generator().manual_seed(seed)
    terms = torch.randn(*shape, 16, generator=g, dtype=torch.float64)
    exact = terms.sum(-1)
    magnitude = terms.abs().sum(-1)
    return exact.float(), exact, magnitude  # fp32 rounding of the exact sum: within the bound


@pytest.mark.parametrize("chunk", [1, 7, 15, 10**9])
def test_chunked_fp32_rounding_check_gives_the_whole_tensor_verdict(chunk):
    actual, exact, magnitude = _fp32_case()
    mt.assert_within_fp32_rounding(actual, exact, magnitude, "ok", chunk_elements=chunk)
    # Two planted errors in different row blocks: the count and the first element are the whole tensor's.
    bad = actual.clone()
    bad[20, 1, 2] += 1e-3
    bad[3, 4, 0] -= 1e-3
    with pytest.raises(AssertionError) as whole:
        mt.assert_within_fp32_rounding(bad, exact, magnitude, "planted", chunk_elements=10**9)
    with pytest.raises(AssertionError) as chunked:
        mt.assert_within_fp32_rounding(bad, exact, magnitude, "planted", chunk_elements=chunk)
    assert str(chunked.value) == str(whole.value)
    assert "2 elements beyond fp32 rounding; first at (3, 4, 0)" in str(chunked.value)


def test_chunked_fp32_rounding_check_keeps_broadcasting_and_scalars():
    actual, exact, magnitude = _fp32_case(shape=(6,))
    mt.assert_within_fp32_rounding(actual, exact, magnitude.max(), "broadcast magnitude", chunk_elements=2)
    mt.assert_within_fp32_rounding(actual.sum(), exact.sum(), magnitude.sum(), "0-d", chunk_elements=1)
    with pytest.raises(AssertionError, match="first at \\(\\)"):
        mt.assert_within_fp32_rounding(actual.sum() + 1, exact.sum(), magnitude.sum(), "0-d", chunk_elements=1)


@pytest.mark.parametrize("chunk", [1, 9, 10**9])
def test_chunked_fp64_rule_gives_the_whole_tensor_verdict(chunk):
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(40, 9, generator=g, dtype=torch.float64)
    baseline = ref.to(torch.bfloat16)
    ours = ref.float()  # far closer than twice bf16's error
    mt.assert_close_to_fp64(ours, baseline, ref, "ok", chunk_elements=chunk)
    planted = ours.clone()
    planted[33, 4] += 0.5  # beyond 2x bf16's rounding
    with pytest.raises(AssertionError) as whole:
        mt.assert_close_to_fp64(planted, baseline, ref, "planted", chunk_elements=10**9)
    with pytest.raises(AssertionError) as chunked:
        mt.assert_close_to_fp64(planted, baseline, ref, "planted", chunk_elements=chunk)
    assert str(chunked.value) == str(whole.value)
    nan = ours.clone()
    nan[0, 0] = float("nan")  # a NaN in the first block must not be dropped by a later block's max
    with pytest.raises(AssertionError):
        mt.assert_close_to_fp64(nan, baseline, ref, "nan", chunk_elements=chunk)


def test_fp8_checks_one_expert_at_a_time_catch_one_wrong_element(monkeypatch):
    ctx = h.Context(torch.device("cpu"), quick=True, out_dir=None)
    c = b8.cases(ctx)[0]
    s = b8._inputs(ctx, c, 0)
    b8._check_fwd(c, s["fp8"])
    b8._check_wgrad(c, s["wgrad"])
    last = len(c.sizes(0)) - 1
    real_fwd, real_wgrad = b8.moe_kernels.grouped_mm_fp8, b8.moe_kernels.grouped_mm_fp8_wgrad

    def fwd_off_by_one_element(*a):
        out = real_fwd(*a).clone()
        out[int(a[4].sum()) - 1, 0] += 1.0  # the last expert's last row
        return out

    def wgrad_off_by_one_element(*a):
        out = real_wgrad(*a).clone()
        out[last, 1, 2] += 1.0  # far beyond FP8_MMA_MAGNITUDE x fp32 rounding of the tiny case's terms
        return out

    monkeypatch.setattr(b8.moe_kernels, "grouped_mm_fp8", fwd_off_by_one_element)
    with pytest.raises(AssertionError, match="grouped_mm_fp8: max error"):
        b8._check_fwd(c, s["fp8"])
    monkeypatch.setattr(b8.moe_kernels, "grouped_mm_fp8_wgrad", wgrad_off_by_one_element)
    with pytest.raises(AssertionError, match=f"grouped_mm_fp8_wgrad expert {last}: 1 elements beyond"):
        b8._check_wgrad(c, s["wgrad"])


class _Case:
    def __init__(self, name):
        self.name = name


def test_a_case_out_of_memory_is_skipped_and_reported(tmp_path, capsys):
    ctx = h.Context(torch.device("cpu"), quick=True, out_dir=tmp_path)
    ran = []

    def run_case(ctx, c):
        ran.append(c.name)
        if c.name == "big":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 4.78 GiB is free. Including non-PyTorch "
                                         "memory, this process has 74.39 GiB memory in use.")
        return [h.make_result(ctx, op="op", case=c.name, shape={}, dtype=torch.float32, timing=h.Timing(1, 1, 1),
                              nbytes=1000, flops=0, peers={})]

    results, failures, skipped = h.run_cases(ctx, "fam", [_Case("small"), _Case("big"), _Case("after")], run_case)
    assert ran == ["small", "big", "after"]
    assert [r.case for r in results] == ["small", "after"] and failures == []
    assert skipped == ["big: out of memory: CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has a total "
                       "capacity of 79.18 GiB of which 4.78 GiB is free."]
    json_path, _ = h.report(ctx, "fam", h.Report(results, ["fam headline"], failures, skipped))
    out = capsys.readouterr().out
    assert "SKIPPED fam big: out of memory" in out  # said at once, while the family runs
    assert "SUMMARY 1 case(s) skipped, not measured: big" in out
    assert "HEADLINE 1 case(s) not measured (skipped): big: out of memory" in out
    assert json.loads(json_path.read_text())["skipped"] == skipped


def test_other_errors_still_stop_the_family():
    ctx = h.Context(torch.device("cpu"), quick=True, out_dir=None)

    def run_case(ctx, c):
        raise RuntimeError("a bug, not a size")

    with pytest.raises(RuntimeError, match="a bug"):
        h.run_cases(ctx, "fam", [_Case("a")], run_case)
