"""python -m bench [OPS...] [--quick] [--out DIR] [--device cpu|cuda] [--models M,...] [--tokens T,...]
[--flush read|write|none]; `python -m bench.perf` runs the GPU perf mode's parts, `python -m bench.readme`
regenerates the README's ops figures and docs/benchmarks.md's tables from the committed results."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

import typer

from . import BENCHES

app = typer.Typer(add_completion=False)


@app.command()
def main(
    ops: Optional[list[str]] = typer.Argument(None, help=f"op families to run (default: all of {', '.join(BENCHES)})"),
    quick: bool = typer.Option(False, "--quick", help="fewer shapes and repetitions"),
    out: Path = typer.Option(Path(__file__).parent / "results" / "latest", "--out",
                             help="directory for bench_<op>.json and bench_<op>.png"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    models: Optional[str] = typer.Option(None, "--models", help="comma-separated perf.md models (GPU sweep only)"),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="comma-separated token counts (GPU sweep only)"),
    flush: str = typer.Option("read", "--flush", help="L2 flush between timed calls: read, write or none"),
    profile: bool = typer.Option(False, "--profile", help="families that can also write a profiler table"),
    modes: bool = typer.Option(False, "--modes", help="also host / kernel / graph-replay time where optional"),
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
    try:
        token_counts = tuple(int(t) for t in tokens.split(",")) if tokens else None
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {tokens!r}", param_hint="--tokens")
    if flush not in ("read", "write", "none"):
        raise typer.BadParameter(f"expected read, write or none, got {flush!r}", param_hint="--flush")
    ctx = harness.Context(device=torch.device(device), quick=quick, out_dir=out, flush_mode=flush,
                          models=tuple(models.split(",")) if models else None, tokens=token_counts,
                          profile=profile, modes=modes)
    ctx.measure_ceilings("start")
    failed = False
    for op in ops or list(BENCHES):
        rep = importlib.import_module(BENCHES[op]).run(ctx)
        harness.report(ctx, op, rep)
        failed |= bool(rep.failures)
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
