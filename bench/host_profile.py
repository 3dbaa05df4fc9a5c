"""Where the host time of one router_topk forward+backward goes (the perf mode's host part, after its
families): ours and torch eager at the cases below, with the machine's floor beside them.

Per case, one text file profile_host_router_<case>.txt in the perf OUT directory:
  floors      host time (median over CALLS calls, each after a synchronisation, the clock stopped when the
              call returns: time_modes' host method) of the cheapest things a call is made of, on the same
              device: a Python call that does nothing, an aten op that launches nothing (torch.empty(0)),
              one aten op with its kernel launch (a 1-element add_), a bare kernel launch without the
              dispatcher (torch.cuda._sleep(0), GPU only) and torch.autograd.grad over a one-op graph
              (y = x * 2: graph building, the engine's thread handoff, one backward kernel).
  per impl    host us a call, then top-level aten ops and kernel launches per call (torch.profiler events
              over PROFILE_CALLS calls), then two tables: torch.profiler's key_averages by self CPU time
              (CPU activity, and CUDA on a GPU for the cudaLaunchKernel rows; profiling adds its own
              overhead to each op, so read the rows' shares, not their sums) and cProfile by tottime (the
              Python frames: our wrappers, torch.library's dispatch, autograd.Function).
  ours, stubbed  ours' host us with the extension's launching calls stubbed (testing.extension_calls), as
              measured on a development CPU (~30 us there): the same Python on this machine's CPU.
One `HOST` line per case on stdout gives the medians and counts, so the log alone answers "is it the
machine or our code": host us per call against (aten ops x the 1-element add_) + (autograd.grad's floor).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from moe_kernels.testing import extension_calls

from . import bench_router as br
from . import harness as h

# The headline case and the one where eager vs eager was worst on the H100 (2026-11-27: 0.58x).
PROFILE_CASES = ("deepseek-v3/T16384", "qwen3-235b/T16384")
CALLS = 200  # host-time medians
PROFILE_CALLS = 20  # calls under each profiler
ROW_LIMIT = 25


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn: Callable[..., Any], inputs: Sequence[tuple], device: torch.device, calls: int = CALLS) -> float:
    """Median host time of one call (time_modes' host method), after 3 warm-up calls."""
    for i in range(3):
        fn(*inputs[i % len(inputs)])
    times = []
    for i in range(calls):
        _sync(device)
        t0 = time.perf_counter()
        fn(*inputs[i % len(inputs)])
        times.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    return statistics.median(times)


def floors(device: torch.device) -> dict[str, float]:
    """The machine's host cost of a call, an aten op, a launch and an autograd call (module docstring)."""
    one = torch.ones(1, device=device)
    x = torch.ones(1, device=device, requires_grad=True)
    g = torch.ones(1, device=device)
    fns: dict[str, Callable[[], Any]] = {
        "Python call that does nothing": lambda: None,
        "aten op, no kernel (torch.empty(0))": lambda: torch.empty(0, device=device),
        "aten op + its kernel launch (1-element add_)": lambda: one.add_(1),
        "autograd.grad over a one-op graph (x * 2)": lambda: torch.autograd.grad(x * 2, x, g),
    }
    if device.type == "cuda":
        fns["bare kernel launch (torch.cuda._sleep(0))"] = lambda: torch.cuda._sleep(0)
    return {name: host_us(fn, [()], device) for name, fn in fns.items()}


def _counts(prof) -> tuple[float, float]:
    """(top-level aten ops, kernel launches) per call from a profile of PROFILE_CALLS calls."""
    events = prof.events()
    aten = sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                   "cuLaunchKernelEx"))
    return aten / PROFILE_CALLS, launches / PROFILE_CALLS


def breakdown(fn: Callable[..., Any], inputs: Sequence[tuple], device: torch.device) -> tuple[dict[str, float], str]:
    """({host_us, aten_ops, launches} per call, the two tables as text)."""
    from torch.profiler import ProfilerActivity, profile

    us = host_us(fn, inputs, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(PROFILE_CALLS):
            fn(*inputs[i % len(inputs)])
        _sync(device)
    aten, launches = _counts(prof)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ROW_LIMIT)
    cp = cProfile.Profile()
    cp.enable()
    for i in range(PROFILE_CALLS):
        fn(*inputs[i % len(inputs)])
    _sync(device)
    cp.disable()
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(ROW_LIMIT)
    text = (f"torch.profiler, {PROFILE_CALLS} calls, by self CPU time:\n{table}\n"
            f"cProfile, {PROFILE_CALLS} calls, by tottime:\n{buf.getvalue()}")
    return {"host_us": us, "aten_ops": aten, "launches": launches}, text


def fn_of(impl: br.Impl, c: br.Case, sets: list[dict]) -> tuple[Callable[..., Any], list[tuple]]:
    """router_topk fwd+bwd of `impl` and its inputs, as the router family times it."""
    return next((f, i) for op, f, i in br.timed_ops(c, impl, sets) if op == "router_topk_fwd_bwd")


def _stubbed_us(call: tuple[Callable[..., Any], list[tuple]], device: torch.device) -> str:
    """Host us of ours with no kernel launched (the extension's launching calls return at once): our Python
    and the aten ops around the launches, on this machine's CPU."""
    fn, inputs = call
    try:
        with extension_calls(stub=True) as ext:
            us = host_us(fn, inputs, device)
            calls = sum(ext.calls.values())
    except RuntimeError as e:  # no extension loaded (a CPU run without MOE_KERNELS_EMULATE)
        return f"n/a ({e})"
    return f"{us:.1f} us a call ({calls / (CALLS + 3):.0f} extension launches stubbed a call)"


def _cases(ctx: h.Context) -> list[br.Case]:
    every = br.cases(ctx)
    picked = [c for c in every if c.name in PROFILE_CASES]
    return picked or every[:1]  # the CPU's tiny shapes: the first one


def write_router_profiles(ctx: h.Context, out: Path) -> list[str]:
    """profile_host_router_<case>.txt per case of PROFILE_CASES (module docstring); returns the file names."""
    dev = ctx.device
    floor = floors(dev)
    floor_text = "\n".join(f"  {us:9.2f} us  {name}" for name, us in floor.items())
    impls = {"ours": br.OURS, "torch_eager": br.peer_impls(ctx)["torch_eager"]["topk_gather"]}
    files = []
    for c in _cases(ctx):
        sets = [br.make_inputs(ctx, c, ctx.seed + i) for i in range(ctx.n_input_sets)]
        parts, line = [], []
        for name, impl in impls.items():
            stats, text = breakdown(*fn_of(impl, c, sets), dev)
            parts.append(f"== {name}: router_topk fwd+bwd {c.name}: host {stats['host_us']:.1f} us a call (median of "
                         f"{CALLS}), {stats['aten_ops']:.1f} top-level aten ops and {stats['launches']:.1f} kernel "
                         f"launches a call\n{text}")
            line.append(f"{name} {stats['host_us']:.1f} us ({stats['aten_ops']:.0f} aten ops, "
                        f"{stats['launches']:.0f} launches)")
        stub = _stubbed_us(fn_of(br.OURS, c, sets), dev)
        parts.append(f"== ours with the extension's launches stubbed (testing.extension_calls(stub=True), the "
                     f"development CPU's method): {stub}")
        line.append(f"ours stubbed {stub}")
        name = c.name.replace("/", "_")
        path = out / f"profile_host_router_{name}.txt"
        path.write_text(f"router_topk fwd+bwd host time on {h.device_name(ctx)} ({dev.type}), case {c.name}\n"
                        f"floors on this machine (median host us of one call):\n{floor_text}\n\n"
                        + "\n\n".join(parts) + "\n")
        files.append(path.name)
        print(f"HOST router_topk_fwd_bwd {c.name} on {h.device_name(ctx)}: " + ", ".join(line) + "; floors: "
              + ", ".join(f"{n} {us:.1f} us" for n, us in floor.items()), flush=True)
    return files
