"""bench/bars.py holds specs/perf.md's bars with the same numbers: every figure of each spec row is one of
its bar's numbers, and every threshold is a figure of the row, so neither can drift from the other."""

import re
from pathlib import Path

import pytest

from bench import bars

PERF_MD = Path(__file__).resolve().parents[3] / "shared" / "specs" / "perf.md"
# A figure: a number followed by %, a ratio's x (not 1x128 or 8xH200), a rate, or a count of tokens/rows;
# a fraction "1/3 of".
FIGURE = re.compile(r"(\d+(?:\.\d+)?)(?=%|x(?![0-9A-Za-z])| TFLOP/s| GB/s| forward| tokens| rows)")
FRACTION = re.compile(r"(\d+)/(\d+) of")


def figures(text: str) -> set[float]:
    out = {float(m) for m in FIGURE.findall(text)}
    return out | {int(a) / int(b) for a, b in FRACTION.findall(text)}


def spec_rows() -> dict[str, str]:
    if not PERF_MD.exists():
        pytest.skip(f"{PERF_MD} not present (shared/ sits beside the repository in CI)")
    section = PERF_MD.read_text().split("## The bar on one H100 or H200", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| op |")]
    return {cells[0]: cells[1] for cells in ([c.strip() for c in r.strip().strip("|").split(" | ")] for r in rows)}


def test_every_spec_row_is_a_bar_verbatim():
    rows = spec_rows()
    spec_bars = {b.op: b for b in bars.SPEC_BARS}
    assert set(rows) == set(spec_bars), (set(rows) ^ set(spec_bars))
    for op, text in rows.items():
        assert spec_bars[op].text == text, op


@pytest.mark.parametrize("bar", bars.SPEC_BARS, ids=lambda b: b.key)
def test_same_numbers_as_the_spec(bar):
    found = figures(bar.text)
    assert found, bar.key  # every row states at least one figure
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b))  # noqa: E731
    for f in found:
        assert any(close(f, n) for n in bar.numbers()), f"{bar.key}: the spec's {f:g} is not one of the bar's numbers"
    for t in bar.thresholds:
        if t.words:  # a value the spec states in words
            assert t.words in bar.text, (bar.key, t.words)
        else:
            assert any(close(t.value, f) for f in found), f"{bar.key}: threshold {t.value:g} is not in the spec row"


def test_figure_parser_reads_what_it_should():
    assert figures(">= 85% of copy at 8192 tokens; >= 1.3x eager; 1x128 blocks on 8xH200; 1/3 of it") == {
        85.0, 8192.0, 1.3, 1 / 3}


def test_issue_bars_name_their_source_and_lookups_work():
    for b in bars.ISSUE_BARS:
        assert b.source.startswith("issue "), b.key
    assert {b.key for b in bars.SPEC_BARS}.isdisjoint(b.key for b in bars.ISSUE_BARS)
    gm = bars.bar("grouped_mm")
    assert gm.threshold("tflops", "mixtral-8x7b").value == 650
    assert gm.threshold("speedup:torch_grouped_mm", "every case").met(0.95)
    assert not gm.threshold("speedup:torch_grouped_mm", "every case").met(0.94)
    assert bars.bar("host_overhead").threshold("host_fraction").met(0.2)  # an upper bound
    assert not bars.bar("host_overhead").threshold("host_fraction").met(0.5)
    with pytest.raises(KeyError, match="no threshold"):
        gm.threshold("mfu_pct")
    assert bars.quote("router_topk").startswith("bar: >= 5x torch eager")


def test_benches_quote_the_table():
    from bench import bench_grouped_mm, bench_grouped_mm_fp8, bench_router

    assert bench_router.BAR == bars.quote("router_topk")
    assert "1300 TFLOP/s" in bench_grouped_mm_fp8.BAR
    assert (bench_grouped_mm.BAR_TORCH_GEOMEAN, bench_grouped_mm.BAR_TORCH_MIN, bench_grouped_mm.BAR_DENSE_PCT) == (
        1.1, 0.95, 80)
