"""python -m bench [OPS...] [--quick] [--out DIR] [--device cpu|cuda]"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

import typer

# op family -> module with run(ctx: harness.Context) -> harness.Report; imported only when selected.
BENCHES = {
    "permute": "bench.bench_permute",
    "router": "bench.bench_router",
    "router_losses": "bench.bench_router_losses",
    "quant": "bench.bench_quant",
    "grouped_mm": "bench.bench_grouped_mm",
    "grouped_mm_fp8": "bench.bench_grouped_mm_fp8",
    "moe_layer": "bench.bench_moe_layer",
    "lora": "bench.bench_lora",
    "dispatch": "bench.bench_dispatch",
    "train": "bench.bench_train",
}

app = typer.Typer(add_completion=False)


@app.command()
def main(
    ops: Optional[list[str]] = typer.Argument(None, help=f"op families to run (default: all of {', '.join(BENCHES)})"),
    quick: bool = typer.Option(False, "--quick", help="fewer shapes and repetitions"),
    out: Path = typer.Option(Path(__file__).parent / "results" / "latest", "--out",
                             help="directory for bench_<op>.json and bench_<op>.png"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
) -> None:
    """Microbenchmarks of moe_kernels against their peers; method in bench/harness.py."""
    import torch

    from . import harness

    unknown = [op for op in ops or [] if op not in BENCHES]
    if unknown:
        raise typer.BadParameter(f"unknown {unknown}; known: {', '.join(BENCHES)}", param_hint="OPS")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"expected cpu or cuda, got {device!r}", param_hint="--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("cuda requested but torch sees no CUDA device", param_hint="--device")
    if device == "cpu":
        # The CPU shapes are tiny: waking intra-op threads costs more than the work and makes the
        # numbers swing 10x from run to run.
        torch.set_num_threads(1)
    ctx = harness.Context(device=torch.device(device), quick=quick, out_dir=out)
    failed = False
    for op in ops or list(BENCHES):
        rep = importlib.import_module(BENCHES[op]).run(ctx)
        harness.report(ctx, op, rep)
        failed |= bool(rep.failures)
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
