"""The speed tables of README.md and docs/benchmarks.md, generated from the committed bench JSON:
`python -m bench.readme [--check]`.

Reads bench/results/<gpu>-<date>/bench_<family>.json (not `latest/`) and judges every result again
against the right ceiling of its own JSON (specs/perf.md):
- results with TFLOP/s against the matmul ceiling of their operand dtype (fp8 for the FP8 GEMMs, whose
  results the benches mark with an fp8 dtype, as the harness reads them; bf16 otherwise) where that
  binds, else copy bandwidth: the roofline that binds, as the harness judges;
- results without TFLOP/s against copy bandwidth (bytes read + written);
- dispatch / combine, which count bytes received, against copy / 2.
JSON written by the newer harness name their ceiling kind and the measurement (`ceilings_log` label) they
were judged against; those are used as they are.

A run (one JSON) is suspect when a case is above 100% of its ceiling, when a ceiling it is judged against
is more than 10% below the best measurement of that ceiling in the same lease (the JSON of one results
directory written by one build within an hour of each other: one GPU), or when the bench itself marked it
suspect. Suspect runs also get their figures against the lease's best ceilings.

Writes the full table between the bench-table markers of docs/benchmarks.md (and the host-overhead table
between its overhead-table markers); the last column, "latest figure", of the ops table between the
ops-table markers of README.md (each row's op, its first `name`, looked up in OPS_FIGURES: the newest run of
that bench op, its geomean % of ceiling and speedup with GPU, date, tokens and commit); and a list of the
figures that the re-judging changes between the rejudged markers of each results directory's README that
has them.
`--check` writes nothing and fails when a block differs from what would be written.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
README = REPO_ROOT / "README.md"
BENCHMARKS_DOC = "docs/benchmarks.md"  # beside README.md: the full tables
TABLE_MARKERS = ("<!-- bench-table:start -->", "<!-- bench-table:end -->")
REJUDGED_MARKERS = ("<!-- rejudged:start -->", "<!-- rejudged:end -->")
OVERHEAD_MARKERS = ("<!-- overhead-table:start -->", "<!-- overhead-table:end -->")
OPS_MARKERS = ("<!-- ops-table:start -->", "<!-- ops-table:end -->")

# README's ops table: the bench op whose newest figure each row quotes (None: no bench measures it alone).
OPS_FIGURES = {
    "permute": "permute_fwd", "unpermute": "unpermute_fwd", "tokens_per_expert": "tokens_per_expert",
    "permute_quantize_fp8": "permute_quantize_fp8", "router_topk": "router_topk_fwd", "router_fused": None,
    "router_aux_scores": None, "aux_loss": "aux_loss_fwd_bwd", "apply_capacity": "capacity_probs",
    "update_expert_bias": "expert_bias_update", "grouped_mm": "grouped_mm_fwd",
    "grouped_mm_fp8": "grouped_mm_fp8_fwd", "grouped_mm_fp8_wgrad": "grouped_mm_fp8_wgrad",
    "grouped_mm_nvfp4": None, "swiglu": "swiglu_fwd_bwd", "squared_relu": "squared_relu_fwd_bwd",
    "quantize_fp8": "quantize_fp8_block",
    "quantize_nvfp4": "quantize_nvfp4_1d", "NvlinkDispatcher": "dispatch", "MoELayer": "moe_layer_fwd_bwd",
    "expert_mlp": "expert_mlp_fwd_bwd",
}

CEILING_DROP = 0.10  # a ceiling this far below the lease's best means the GPU was not itself when measured
LEASE_GAP = timedelta(hours=1)  # one lease holds a GPU for at most 30 minutes

CEILING_NAMES = {"copy": "copy", "copy_received": "copy/2", "matmul_bf16": "bf16 mm", "matmul_fp8": "fp8 mm"}
CEILING_UNITS = {"copy": "GB/s", "copy_received": "GB/s", "matmul_bf16": "TFLOP/s", "matmul_fp8": "TFLOP/s"}
# The measurement behind each kind: copy/2 is derived from copy, so they drop together.
MEASURED_AS = {"copy": "copy", "copy_received": "copy", "matmul_bf16": "matmul_bf16", "matmul_fp8": "matmul_fp8"}
RECEIVED_BYTES_SUITES = {"dispatch"}  # results count bytes received, not read + written
MAIN_PEER = {"permute": "torch_eager", "router": "torch_eager", "router_losses": "torch_eager",
             "quant": "torch_eager", "grouped_mm": "torch_grouped_mm", "grouped_mm_fp8": "moe_kernels_bf16",
             "moe_layer": "hf_grouped_mm", "dispatch": "all_to_all_virtual", "lora": "peft_materialised",
             "train": "torch_native", "expert_mlp": "permuted", "activation": "torch_eager"}
# Ops whose bar names another peer than their suite's: the FP8 step against our bf16 step, the captured step
# against the same step run eagerly.
MAIN_PEER_BY_OP = {"train_step_fp8": "moe_kernels_bf16", "train_step_graphed": "eager_step"}


def ceiling_values(entry: dict[str, Any]) -> dict[str, float | None]:
    copy = entry["copy_gbps"]
    return {"copy": copy, "copy_received": entry.get("copy_received_gbps") or copy / 2,
            "matmul_bf16": entry["matmul_bf16_tflops"], "matmul_fp8": entry.get("matmul_fp8_tflops")}


@dataclass(frozen=True)
class Judged:
    op: str
    case: str
    tokens: int | None
    kind: str  # CEILING_NAMES key
    label: str  # which ceiling measurement of the run
    ceiling: float
    rate: float  # GB/s or TFLOP/s, in the ceiling's unit
    pct: float
    speedup: dict[str, float]
    gemm: bool  # has TFLOP/s: its absolute figure is TFLOP/s
    best_figure: float  # TFLOP/s for GEMMs, GB/s otherwise
    recorded_kind: str
    recorded_pct: float


@dataclass
class Run:
    path: Path
    suite: str
    meta: dict[str, Any]
    ceilings_log: list[dict[str, Any]]
    judged: list[Judged]
    bench_reasons: list[str]  # reasons the bench itself gave, beyond cases over 100%
    suspect_reasons: list[str] = field(default_factory=list)
    best_ceilings: dict[str, float] = field(default_factory=dict)  # of the lease, by kind
    best_sources: dict[str, str] = field(default_factory=dict)

    @property
    def suspect(self) -> bool:
        return bool(self.suspect_reasons)

    @property
    def started(self) -> datetime | None:
        date = self.meta.get("date")
        return datetime.fromisoformat(date) if date else None

    @property
    def build(self) -> tuple:
        return self.meta.get("commit"), self.meta.get("dirty")

    def ceiling_entry(self, label: str) -> dict[str, Any]:
        return next(e for e in self.ceilings_log if e.get("label", "start") == label)


def tokens_of(result: dict[str, Any]) -> int | None:
    shape = result.get("shape") or {}
    if "T" in shape:
        return int(shape["T"])
    m = re.search(r"(?:^|/)T(\d+)(?:/|$)", result["case"])
    if m:
        return int(m.group(1))
    if "batch" in shape and "seq" in shape:  # training steps: tokens a step
        return int(shape["batch"]) * int(shape["seq"])
    return None


def judge_kind(result: dict[str, Any], suite: str, values: dict[str, float | None]) -> str:
    """The right ceiling for a result of a JSON that does not name it (module docstring)."""
    if suite in RECEIVED_BYTES_SUITES:
        return "copy_received"
    tflops = result.get("tflops")
    if tflops is None:
        return "copy"
    fp8 = str(result.get("dtype", "")).startswith("float8")
    mm = "matmul_fp8" if fp8 and values["matmul_fp8"] else "matmul_bf16"
    return mm if tflops / values[mm] >= result["gbps"] / values["copy"] else "copy"


def load_run(path: Path) -> Run:
    data = json.loads(path.read_text())
    suite = data["suite"]
    log = data.get("ceilings_log") or [dict(data["ceilings"], label=data["ceilings"].get("label", "start"))]
    by_label: dict[str, dict[str, Any]] = {}
    for entry in log:
        by_label.setdefault(entry.get("label", "start"), entry)
    judged = []
    for r in data["results"]:
        if "ceiling_at" in r and "ceilings_log" in data:  # the harness chose kind and measurement
            if r["ceiling_at"] not in by_label:
                raise ValueError(f"{path}: {r['op']} {r['case']} is judged at {r['ceiling_at']!r}, "
                                 f"which its ceilings_log lacks")
            label, kind = r["ceiling_at"], r["ceiling"]
        else:
            label = log[0].get("label", "start")
            kind = judge_kind(r, suite, ceiling_values(log[0]))
        ceiling = ceiling_values(by_label[label])[kind]
        rate = r["gbps"] if kind.startswith("copy") else r["tflops"]
        gemm = r.get("tflops") is not None
        judged.append(Judged(
            op=r["op"], case=r["case"], tokens=tokens_of(r), kind=kind, label=label, ceiling=ceiling,
            rate=rate or 0.0, pct=100 * (rate or 0.0) / ceiling if ceiling else 0.0, speedup=r.get("speedup", {}),
            gemm=gemm, best_figure=r["tflops"] if gemm else r["gbps"],
            recorded_kind=r.get("ceiling", ""), recorded_pct=r.get("pct_of_ceiling", 0.0)))
    # The bench's own case-over-100% reasons are recomputed here; keep the others (e.g. other processes).
    case_prefixes = tuple(f"{r['op']} {r['case']}:" for r in data["results"])
    reasons = [w for w in data.get("suspect_reasons") or [] if not w.startswith(case_prefixes)]
    if data.get("suspect") and not reasons and not any(j.pct > 100 for j in judged):
        reasons = ["the bench marked it suspect"]
    return Run(path=path, suite=suite, meta=data.get("meta", {}), ceilings_log=log, judged=judged,
               bench_reasons=reasons)


def leases(runs: Sequence[Run]) -> list[list[Run]]:
    """Groups one directory's runs by build, split where more than LEASE_GAP separates two runs."""
    groups: list[list[Run]] = []
    for run in sorted(runs, key=lambda r: (str(r.build), r.meta.get("date") or "", r.path.name)):
        prev = groups[-1][-1] if groups else None
        if (prev is not None and prev.build == run.build
                and (prev.started is None or run.started is None or run.started - prev.started <= LEASE_GAP)):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def assess(runs: Sequence[Run]) -> None:
    """Sets each run's lease-best ceilings and suspect reasons (module docstring)."""
    for lease in leases(runs):
        for run in lease:
            run.best_ceilings, run.best_sources = {}, {}
            for kind in CEILING_NAMES:
                for other in lease:
                    for entry in other.ceilings_log:
                        v = ceiling_values(entry)[kind]
                        if v and v > run.best_ceilings.get(kind, 0.0):
                            run.best_ceilings[kind] = v
                            run.best_sources[kind] = other.path.name
        for run in lease:
            reasons = []
            used = sorted({(MEASURED_AS[j.kind], j.label) for j in run.judged})
            for kind, label in used:
                v, best = ceiling_values(run.ceiling_entry(label))[kind], run.best_ceilings[kind]
                if v < (1 - CEILING_DROP) * best:
                    at = f" ({label})" if len(run.ceilings_log) > 1 else ""
                    reasons.append(
                        f"its {CEILING_NAMES[kind]} ceiling{at} measured {v:.0f} {CEILING_UNITS[kind]}, "
                        f"{100 * (1 - v / best):.1f}% below the best of the same lease "
                        f"({best:.0f} in {run.best_sources[kind]})")
            over = [j for j in run.judged if j.pct > 100]
            if over:
                top = max(over, key=lambda j: j.pct)
                reasons.append(f"{len(over)} of {len(run.judged)} cases above 100% of their ceiling "
                               f"(up to {top.pct:.1f}%, {top.op} {top.case})")
            run.suspect_reasons = reasons + run.bench_reasons


def load_dir(results_dir: Path) -> list[Run]:
    runs = [load_run(p) for p in sorted(results_dir.glob("bench_*.json"))]
    assess(runs)
    return runs


def load_all(results_root: Path) -> dict[str, list[Run]]:
    dirs = sorted(p for p in results_root.iterdir() if p.is_dir() and p.name != "latest")
    loaded = {d.name: load_dir(d) for d in dirs}
    return {name: runs for name, runs in loaded.items() if runs}


# --- summaries --------------------------------------------------------------------------------------------

def geomean(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def ops_of(run: Run) -> list[str]:
    return list(dict.fromkeys(j.op for j in run.judged))  # the bench's order: fwd before bwd


def cases_of(run: Run, op: str) -> list[Judged]:
    return [j for j in run.judged if j.op == op]


def against_best(run: Run, j: Judged) -> float:
    return 100 * j.rate / run.best_ceilings[j.kind]


def main_peer(run: Run, op: str) -> str | None:
    peers = list(dict.fromkeys(p for j in cases_of(run, op) for p in j.speedup))
    want = MAIN_PEER_BY_OP.get(op) or MAIN_PEER.get(run.suite)
    return want if want in peers else (peers[0] if peers else None)


def pct(x: float | None) -> str:
    if x is None:
        return "-"
    if 0 < x < 0.01:
        return "<0.01"
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"  # host-bound ops sit far below 1%


def times(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def figure(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def gpu_name(run: Run) -> str:
    return str(run.meta.get("device_name") or "?").removeprefix("NVIDIA ")


def run_label(run: Run) -> str:
    return f"{gpu_name(run)} {str(run.meta.get('date', ''))[:10]}".strip()


def flags(run: Run) -> str:
    out = ["suspect"] if run.suspect else []
    if run.meta.get("dirty"):
        out.append("dirty tree")
    if run.meta.get("quick"):
        out.append("--quick")
    return ", ".join(out)


def short_commit(run: Run) -> str:
    return str(run.meta.get("commit") or "?")[:7]


def tokens_cell(cases: Sequence[Judged]) -> str:
    ts = sorted({j.tokens for j in cases if j.tokens is not None})
    return ", ".join(map(str, ts)) or "-"


def pct_cell(run: Run, cases: Sequence[Judged]) -> str:
    kinds = " + ".join(CEILING_NAMES[k] for k in dict.fromkeys(sorted(j.kind for j in cases)))
    ps = [j.pct for j in cases if j.pct > 0]
    cell = f"{pct(geomean(ps))} / {pct(min(ps) if ps else None)} of {kinds}"
    if run.suspect:
        best = [against_best(run, j) for j in cases if j.pct > 0]
        cell += f" (lease-best ceilings: {pct(geomean(best))} / {pct(min(best) if best else None)})"
    return cell


def speedup_cell(run: Run, op: str, cases: Sequence[Judged]) -> str:
    peer = main_peer(run, op)
    if peer is None:
        return "-"
    s = [j.speedup[peer] for j in cases if peer in j.speedup]
    partial = f", {len(s)} of {len(cases)} cases" if len(s) < len(cases) else ""
    return f"{times(geomean(s))} / {times(min(s))} vs {peer}{partial}"


def best_cell(cases: Sequence[Judged]) -> str:
    top = max(cases, key=lambda j: j.best_figure)
    unit = "TFLOP/s" if top.gemm else "GB/s"
    at = top.case if re.search(r"(?:^|/)T\d+(?:/|$)", top.case) or top.tokens is None else f"{top.case}, T{top.tokens}"
    return f"{figure(top.best_figure)} {unit} ({at})"


def table_rows(runs_by_dir: dict[str, list[Run]]) -> list[list[str]]:
    rows = []
    for dir_name in sorted(runs_by_dir):
        for run in sorted(runs_by_dir[dir_name], key=lambda r: r.suite):
            for op in ops_of(run):
                cases = cases_of(run, op)
                rows.append([run_label(run), run.suite, op, tokens_cell(cases), str(len(cases)),
                             pct_cell(run, cases), speedup_cell(run, op, cases), best_cell(cases),
                             short_commit(run), flags(run)])
    return rows


HEADER = ["GPU, date", "family", "op", "tokens", "cases", "% of ceiling: geomean / worst",
          "speedup: geomean / worst", "best", "commit", "flags"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def suspect_paragraph(dir_name: str, run: Run) -> str:
    best = ", ".join(f"{CEILING_NAMES[k]} {run.best_ceilings[k]:.0f} {CEILING_UNITS[k]}"
                     for k in sorted({j.kind for j in run.judged}))
    return (f"**{run_label(run)}, {run.suite}** (`{dir_name}/{run.path.name}`) is suspect: "
            f"{'; '.join(run.suspect_reasons)}. Its figures in brackets are against the best ceilings "
            f"measured in the same lease ({best}).")


def render_table(runs_by_dir: dict[str, list[Run]]) -> str:
    lines = markdown_table(HEADER, table_rows(runs_by_dir))
    lines += ["", "Ceilings are measured in the same run: copy = device-to-device copy bandwidth (bytes read + "
              "written); copy/2 = its received-bytes twin, for dispatch and combine, which count bytes "
              "received; bf16 mm and fp8 mm = a dense 8192^3 matmul through torch. Speedup = peer time / ours. "
              "Best = the highest TFLOP/s (GEMMs) or GB/s (the rest) over the cases."]
    for dir_name in sorted(runs_by_dir):
        for run in sorted(runs_by_dir[dir_name], key=lambda r: r.suite):
            if run.suspect:
                lines += ["", suspect_paragraph(dir_name, run)]
    return "\n".join(lines)


def render_rejudged(runs: Sequence[Run]) -> str:
    """The figures of one results directory that re-judging changes, as a markdown list."""
    lines = []
    for run in sorted(runs, key=lambda r: r.suite):
        for op in ops_of(run):
            cases = cases_of(run, op)
            kinds = {j.kind for j in cases}
            old_kinds = {j.recorded_kind for j in cases}
            old, new = geomean(j.recorded_pct for j in cases), geomean(j.pct for j in cases)
            if kinds == old_kinds and (old is None or new is None or abs(new - old) <= 0.05 * old):
                continue
            top = max(cases, key=lambda j: j.best_figure)
            ceiling = " + ".join(f"{CEILING_NAMES[k]}, {next(j.ceiling for j in cases if j.kind == k):.0f} "
                                 f"{CEILING_UNITS[k]}" for k in sorted(kinds))
            lines.append(
                f"- `{op}` ({run.path.name}): against {ceiling}: geomean {pct(new)}%, worst "
                f"{pct(min(j.pct for j in cases))}%; best {figure(top.best_figure)} "
                f"{'TFLOP/s' if top.gemm else 'GB/s'} ({top.case}), {pct(top.pct)}% of {CEILING_NAMES[top.kind]}. "
                f"Recorded: geomean {pct(old)}% of "
                f"{' + '.join(CEILING_NAMES.get(k, k) for k in sorted(old_kinds))}.")
    for run in sorted(runs, key=lambda r: r.suite):
        if not run.suspect:
            continue
        figures = []
        for op in ops_of(run):
            cases = [j for j in cases_of(run, op) if j.pct > 0]
            if not cases:
                continue
            best = [against_best(run, j) for j in cases]
            figures.append(f"`{op}` geomean {pct(geomean(j.pct for j in cases))}% -> {pct(geomean(best))}%, "
                           f"worst {pct(min(j.pct for j in cases))}% -> {pct(min(best))}%")
        lines.append(f"- {run.path.name} is suspect: {'; '.join(run.suspect_reasons)}. Against the best "
                     f"ceilings of its lease: {'; '.join(figures)}.")
    return "\n".join(lines) if lines else "Nothing changes."


def render_overhead(results_root: Path) -> str:
    """bench overhead's tables (overhead_table.json in the results directories), newest directory first."""
    from bench.bench_overhead import MARKDOWN_HEADER, markdown_rows

    rows = []
    for path in sorted(results_root.glob("*/overhead_table.json"), key=lambda p: p.parent.name, reverse=True):
        rows += markdown_rows(json.loads(path.read_text()), path.parent.name)
    if not rows:
        return "No overhead run is committed yet."
    return "\n".join(markdown_table(MARKDOWN_HEADER, rows))


def latest_cases(runs_by_dir: dict[str, list[Run]], op: str) -> tuple[Run, list[Judged]] | None:
    """The newest run of bench op `op` (by day; then the most cases, then the family's name)."""
    found = [(run, cases_of(run, op)) for runs in runs_by_dir.values() for run in runs if cases_of(run, op)]
    if not found:
        return None
    return max(found, key=lambda rc: (str(rc[0].meta.get("date", ""))[:10], len(rc[1]), rc[0].suite))


def op_figure(runs_by_dir: dict[str, list[Run]], op: str | None) -> str:
    """README's "latest figure" cell for bench op `op`."""
    latest = latest_cases(runs_by_dir, op) if op else None
    if latest is None:
        return "not measured"
    run, cases = latest
    kinds = " + ".join(CEILING_NAMES[k] for k in dict.fromkeys(sorted(j.kind for j in cases)))
    figures = [f"{pct(geomean(j.pct for j in cases if j.pct > 0))}% of {kinds}"]
    peer = main_peer(run, op)
    if peer is not None:
        figures.append(f"{times(geomean(j.speedup[peer] for j in cases if peer in j.speedup))} vs {peer}")
    where = [f"{gpu_name(run).split()[0]} {str(run.meta.get('date', ''))[:10]}", f"{tokens_cell(cases)} tokens", short_commit(run)] + (["suspect"] if run.suspect else [])
    return f"{', '.join(figures)} ({', '.join(where)})"


def row_key(first_cell: str) -> str:
    m = re.search(r"`([A-Za-z_][A-Za-z0-9_]*)", first_cell)
    if m is None:
        raise ValueError(f"ops table: no `name` in the first cell {first_cell!r}")
    return m.group(1)


def render_ops_table(block: str, runs_by_dir: dict[str, list[Run]], where: str) -> str:
    """The README's ops table with its last column regenerated; the other cells are kept as written."""
    lines = block.strip("\n").split("\n")
    if len(lines) < 2 or not lines[1].startswith("|---"):
        raise ValueError(f"{where}: the ops-table block holds no markdown table")
    out = lines[:2]
    for line in lines[2:]:
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        key = row_key(cells[0])
        if key not in OPS_FIGURES:
            raise ValueError(f"{where}: ops-table row {key!r} has no entry in bench.readme.OPS_FIGURES")
        cells[-1] = " " + op_figure(runs_by_dir, OPS_FIGURES[key]).replace("|", "\\|") + " "
        out.append("|" + "|".join(cells) + "|")
    return "\n".join(out)


# --- README blocks ----------------------------------------------------------------------------------------

def replace_block(text: str, markers: tuple[str, str], block: str, where: str) -> str:
    start, end = markers
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{where}: no {start} ... {end} block")
    return text[: i + len(start)] + "\n" + block + "\n" + text[j:]


def block_of(text: str, markers: tuple[str, str]) -> str:
    start, end = markers
    return text[text.index(start) + len(start): text.index(end)]


def benchmarks_doc(readme: Path) -> Path:
    return readme.parent / BENCHMARKS_DOC


def planned_writes(readme: Path, results_root: Path, benchmarks: Path | None = None) -> dict[Path, str]:
    """Every file the generator owns a block of, with the text it should have."""
    benchmarks = benchmarks or benchmarks_doc(readme)
    runs_by_dir = load_all(results_root)
    text = readme.read_text()
    if OPS_MARKERS[0] not in text:
        raise ValueError(f"{readme}: no {OPS_MARKERS[0]} ... {OPS_MARKERS[1]} block")
    text = replace_block(text, OPS_MARKERS, render_ops_table(block_of(text, OPS_MARKERS), runs_by_dir, str(readme)),
                         str(readme))
    doc = replace_block(benchmarks.read_text(), TABLE_MARKERS, render_table(runs_by_dir), str(benchmarks))
    doc = replace_block(doc, OVERHEAD_MARKERS, render_overhead(results_root), str(benchmarks))
    out = {readme: text, benchmarks: doc}
    for dir_name, runs in runs_by_dir.items():
        path = results_root / dir_name / "README.md"
        if path.exists() and REJUDGED_MARKERS[0] in (text := path.read_text()):
            out[path] = replace_block(text, REJUDGED_MARKERS, render_rejudged(runs), str(path))
    return out


def stale(readme: Path = README, results_root: Path = RESULTS_DIR, benchmarks: Path | None = None) -> list[Path]:
    return [p for p, text in planned_writes(readme, results_root, benchmarks).items() if p.read_text() != text]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.readme", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; fail if a generated block is stale")
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--benchmarks", type=Path, default=None, help=f"default: {BENCHMARKS_DOC} beside --readme")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    writes = planned_writes(args.readme, args.results, args.benchmarks)
    changed = [p for p, text in writes.items() if p.read_text() != text]
    if args.check:
        for p in changed:
            print(f"{p}: generated block differs from `python -m bench.readme` (run it to update)")
        return 1 if changed else 0
    for p in changed:
        p.write_text(writes[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
