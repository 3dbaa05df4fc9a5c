"""The harness every bench file uses: timing, ceilings, correctness checks, results and reports.

Timing method (specs/perf.md):
- CUDA: `warmup` untimed calls (10; 5 with --quick), then `reps` timed calls (100; 30 with --quick),
  each between its own pair of CUDA events on the current stream. Before each timed call a buffer
  of twice the L2 size is read (summed into one scalar) outside the event pair, so nothing is still
  in L2 from the previous call and no dirty line is left whose write-back would land inside the next
  timed call (`flush_l2`); the calls rotate over 3 pre-built input sets (random data, never zeros).
  There is one synchronisation after all reps, none between them: host launch latency overlaps the
  flush instead of being timed. Reported: the median, with p20 and p80.
- CPU: time.perf_counter around each call after one warm-up call, 5 reps (3 with --quick), one
  thread. The CPU run checks that the suite works; its numbers mean little.
- Ceilings: device copy bandwidth (a 512 MiB bf16 `copy_`, bytes read + written; its received-bytes
  twin, half of it, for transfers counted by bytes received) and dense matmul TFLOP/s (bf16 8192^3
  through torch.mm; fp8 through torch._scaled_mm with tensorwise scales and fast accumulation, where
  the GPU has fp8). Measured at the start of the process, half-way through each family's cases and
  at the end of each family; each result is judged against the measurement nearest in time, FP8
  GEMMs against the FP8 ceiling. A result above 100% of its ceiling marks the run suspect.
- Host-bound ops (`Context.time_modes`) report three numbers per call: host issue time (wall time of
  back-to-back calls before the synchronisation), GPU kernel time (profiler device events) and
  CUDA-graph replay time (CUDA events around replays, L2 flushed between them); on a CPU only the
  first exists (the call's wall time, all of it host work).
- Correctness is checked before timing with moe_kernels.testing's tolerance policy.
- A case that runs out of GPU memory (torch.OutOfMemoryError) is not measured and is reported as
  skipped with the reason (`SKIPPED` lines, a `SUMMARY` and a `HEADLINE` line, `skipped` in the JSON);
  the cached memory is handed back and the next case runs. Every case's buffers are freed before the next.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

import moe_kernels
from moe_kernels.testing import assert_exact

from .provenance import gpu_state, provenance, run_cmd, utc_now

# Kineto keeps CUPTI attached after a profile unless told to tear it down, and every later launch pays
# for it: time_modes profiles, and timings after it must not be slowed (read when profiling starts).
os.environ.setdefault("TEARDOWN_CUPTI", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ModelCase:
    """One model's shapes at T tokens: the case of the families that need nothing more."""

    model: str
    T: int

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}"


@dataclass(frozen=True)
class Timing:
    us: float  # median
    p20_us: float
    p80_us: float


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float
    copy_bytes: int
    matmul_bf16_tflops: float
    matmul_shape: tuple[int, int, int]
    matmul_fp8_tflops: float | None  # None: no fp8 on this device (or on the CPU)
    label: str = "start"  # when in the run: "start", "middle:<family>", "end:<family>"
    at_s: float = 0.0  # seconds after the run started

    @property
    def copy_received_gbps(self) -> float:
        """A copy of N bytes reads N and writes N: as a bound on bytes received it is half of copy_gbps."""
        return self.copy_gbps / 2

    def value(self, kind: str) -> float | None:
        return {"copy": self.copy_gbps, "copy_received": self.copy_received_gbps,
                "matmul_bf16": self.matmul_bf16_tflops, "matmul_fp8": self.matmul_fp8_tflops}[kind]


CEILING_KINDS = ("copy", "copy_received", "matmul_bf16", "matmul_fp8")
CEILING_DRIFT = 0.10  # a ceiling measured this much lower at one point of a run than another: suspect
FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class Modes:
    """One call of a host-bound op, three ways (module docstring). None: not measurable here."""

    host_us: float | None
    kernel_us: float | None
    graph_us: float | None
    why_not: str | None = None  # why kernel_us / graph_us are missing


@dataclass
class Context:
    """One run: device, size of the sweep, where reports go, and the ceilings measured during it."""

    device: torch.device
    quick: bool
    out_dir: Path
    seed: int = 0
    flush_mode: str = "read"  # "read" (the method), "write" (the old zero-fill) or "none": perf mode compares
    # On a GPU, narrow a family's sweep to these perf.md models / token counts (None: the family's own);
    # the CPU's tiny shapes ignore them.
    models: tuple[str, ...] | None = None
    tokens: tuple[int, ...] | None = None
    profile: bool = False  # families that can keep a profiler table of one call write it to out_dir
    # Families whose ops are host-bound only in some cases (small-H permute backward, the layer) add
    # time_modes (host / kernel / graph replay) when this is set; router and losses always do.
    modes: bool = False
    # perf --dry-run: a check of the benches' code on the CPU, whose times mean nothing: the timings that take the
    # run's warmup and reps make one call each, with no warm-up.
    dry_run: bool = False
    started_s: float = field(default_factory=time.monotonic, init=False)
    started_utc: str = field(default_factory=utc_now, init=False)
    gpu_state_start: dict[str, Any] | None = field(default=None, init=False)
    ceilings_log: list[Ceilings] = field(default_factory=list, init=False)
    _flush: torch.Tensor | None = field(default=None, init=False, repr=False)
    _sink: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.flush_mode not in ("read", "write", "none"):
            raise ValueError(f"flush_mode: expected 'read', 'write' or 'none', got {self.flush_mode!r}")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def ours_runs_kernels(self) -> bool:
        """False where moe_kernels' ops run their PyTorch references (CPU, or no compiled extension)."""
        return self.is_cuda and moe_kernels.has_cuda_kernels()

    @property
    def warmup(self) -> int:
        if self.dry_run:
            return 0
        return (5 if self.quick else 10) if self.is_cuda else 1

    @property
    def reps(self) -> int:
        if self.dry_run:
            return 1
        return (30 if self.quick else 100) if self.is_cuda else (3 if self.quick else 5)

    @property
    def n_input_sets(self) -> int:
        return 3 if self.is_cuda else 2

    def derive(self, **changes: Any) -> "Context":
        """The same run with other settings (a perf part's sweep, a flush mode): one clock, one GPU state at
        the start, one log of ceiling measurements and one flush buffer."""
        new = replace(self, **changes)
        for name in ("started_s", "started_utc", "gpu_state_start", "ceilings_log", "_flush", "_sink"):
            setattr(new, name, getattr(self, name))
        return new

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s

    def time(self, fn: Callable[..., Any], inputs_list: Sequence[tuple]) -> Timing:
        return time_fn(fn, inputs_list=inputs_list, warmup=self.warmup, reps=self.reps,
                       device=self.device, flush=self.flush)

    def time_ab(self, fn_a: Callable[..., Any], inputs_a: Sequence[tuple], fn_b: Callable[..., Any],
                inputs_b: Sequence[tuple]) -> tuple[Timing, Timing]:
        """Two implementations timed rep by rep in alternation (A, B, A, B, ...), so a clock or thermal drift
        during the run moves both alike: the ratio is the figure to trust."""
        return time_ab(fn_a, inputs_a, fn_b, inputs_b, warmup=self.warmup, reps=self.reps, device=self.device,
                       flush=self.flush)

    def pick(self, models: dict[str, Any], tokens: Sequence[int]) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The GPU sweep narrowed by `models` / `tokens` (unknown model names are an error)."""
        if not self.is_cuda:
            return models, tuple(tokens)
        if self.models is not None:
            unknown = [m for m in self.models if m not in models]
            if unknown:
                raise ValueError(f"models: {unknown} not in this family's {list(models)}")
            models = {m: models[m] for m in self.models}
        return models, tuple(self.tokens) if self.tokens is not None else tuple(tokens)

    def time_modes(self, fn: Callable[..., Any], inputs_list: Sequence[tuple], capture=None) -> Modes:
        return time_modes(fn, inputs_list=inputs_list, warmup=self.warmup, reps=self.reps,
                          device=self.device, flush=self.flush, capture=capture)

    def ceilings(self) -> Ceilings:
        """The latest measurement (the start one is taken on first use)."""
        if not self.ceilings_log:
            self.measure_ceilings("start")
        return self.ceilings_log[-1]

    def measure_ceilings(self, label: str) -> Ceilings:
        """Appends a measurement labelled `label#<index in the run>` (unique, so a family run twice in one
        process is judged against its own)."""
        c = replace(measure_ceilings(self), label=f"{label}#{len(self.ceilings_log)}", at_s=round(self.elapsed_s(), 3))
        self.ceilings_log.append(c)
        if len(self.ceilings_log) == 1:  # the GPU's state once it is working, not as it sat idle before
            self.gpu_state_start = gpu_state(self)
        return c

    def finish(self, family: str, results: Sequence["Result"]) -> None:
        """Ends a family: an end measurement unless one came after its last result, then every result
        judged again against the nearest. Benches call it before writing their headlines; report() too."""
        last = max((r.at_s for r in results), default=0.0)
        tail = self.ceilings_log[-1] if self.ceilings_log else None
        if tail is None or not (tail.label.startswith("end:") and tail.at_s >= last):
            self.measure_ceilings(f"end:{family}")
        rejudge(self, results)

    def ceiling_of(self, r: "Result") -> Ceilings:
        """The measurement r was judged against."""
        return next((c for c in self.ceilings_log if c.label == r.ceiling_at), self.nearest_ceilings(r.at_s))

    def nearest_ceilings(self, at_s: float) -> Ceilings:
        self.ceilings()
        return min(self.ceilings_log, key=lambda c: abs(c.at_s - at_s))

    def case_done(self, family: str, i: int, n: int) -> None:
        """Called after case i (0-based) of n: the middle ceilings are measured half-way through."""
        if n > 1 and i == (n - 1) // 2:
            self.measure_ceilings(f"middle:{family}")

    def l2_flush_buffer(self) -> torch.Tensor | None:
        if self.is_cuda and self._flush is None:
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 64 << 20
            self._flush = torch.zeros(2 * l2 // 4, dtype=torch.float32, device=self.device)
            self._sink = torch.empty((), dtype=torch.float32, device=self.device)
        return self._flush

    def flush(self) -> None:
        """Evicts L2 before a timed call, as flush_mode says (nothing on the CPU)."""
        if not self.is_cuda or self.flush_mode == "none":
            return
        buf = self.l2_flush_buffer()
        if self.flush_mode == "write":
            buf.zero_()
        else:
            flush_l2(buf, self._sink)


def flush_l2(buf: torch.Tensor, sink: torch.Tensor) -> None:
    """Reads every line of buf (a sum into the 0-d `sink`) and writes nothing else: a zero-fill would
    leave dirty lines whose write-back to memory lands inside the next timed call."""
    torch.sum(buf, dim=0, dtype=sink.dtype, out=sink)


def time_fn(fn: Callable[..., Any], *, inputs_list: Sequence[tuple], warmup: int, reps: int,
            device: torch.device, flush: Callable[[], None] | None = None) -> Timing:
    """Times fn(*inputs_list[i % len(inputs_list)]) as the module docstring describes."""
    n = len(inputs_list)
    for i in range(warmup):
        fn(*inputs_list[i % n])
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize(device)
        for i in range(reps):
            if flush is not None:
                flush()
            starts[i].record()
            fn(*inputs_list[i % n])
            ends[i].record()
        torch.cuda.synchronize(device)
        times_us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        times_us = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*inputs_list[i % n])
            times_us.append((time.perf_counter() - t0) * 1e6)
    return _timing(times_us)


def time_ab(fn_a: Callable[..., Any], inputs_a: Sequence[tuple], fn_b: Callable[..., Any],
            inputs_b: Sequence[tuple], *, warmup: int, reps: int, device: torch.device,
            flush: Callable[[], None] | None = None) -> tuple[Timing, Timing]:
    """time_fn of two implementations, interleaved rep by rep (A, B, A, B, ...) in one event loop with one
    synchronisation at the end, as time_fn times one."""
    pairs = ((fn_a, inputs_a), (fn_b, inputs_b))
    for i in range(warmup):
        for fn, inputs in pairs:
            fn(*inputs[i % len(inputs)])
    if device.type != "cuda":
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(reps):
            for j, (fn, inputs) in enumerate(pairs):
                t0 = time.perf_counter()
                fn(*inputs[i % len(inputs)])
                times[j].append((time.perf_counter() - t0) * 1e6)
        return _timing(times[0]), _timing(times[1])
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in pairs]
    torch.cuda.synchronize(device)
    for i in range(reps):
        for j, (fn, inputs) in enumerate(pairs):
            if flush is not None:
                flush()
            events[j][i][0].record()
            fn(*inputs[i % len(inputs)])
            events[j][i][1].record()
    torch.cuda.synchronize(device)
    a, b = ([s.elapsed_time(e) * 1e3 for s, e in ev] for ev in events)
    return _timing(a), _timing(b)


def profile_table(fn: Callable[..., Any], inputs: tuple, *, device: torch.device, reps: int = 3,
                  row_limit: int = 40) -> str:
    """torch.profiler's key_averages table of `reps` calls (kernel by kernel on a GPU), sorted by device
    time: what a perf run keeps instead of a raw trace."""
    from torch.profiler import ProfilerActivity, profile

    fn(*inputs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=row_limit)


def _timing(times_us: Sequence[float]) -> Timing:
    p20, p50, p80 = np.percentile(times_us, [20, 50, 80])
    return Timing(us=float(p50), p20_us=float(p20), p80_us=float(p80))


def time_modes(fn: Callable[..., Any], *, inputs_list: Sequence[tuple], warmup: int, reps: int,
               device: torch.device, flush: Callable[[], None] | None = None,
               capture: Callable[[], tuple[Callable[..., Any], tuple, Callable[..., Any] | None]] | None = None
               ) -> Modes:
    """Host issue time, kernel time and graph replay time of one call (module docstring).

    `capture`, for a call that cannot be captured alone (the backward of a forward graph built outside the
    capture: autograd would run it on the forward's stream), returns (whole, inputs, part): a callable
    that can be captured (forward + backward), its inputs, and the part to subtract (the forward, or None);
    graph time is then replay(whole) - replay(part)."""
    n = len(inputs_list)
    for i in range(warmup):
        fn(*inputs_list[i % n])
    if device.type != "cuda":
        return Modes(host_us=time_fn(fn, inputs_list=inputs_list, warmup=0, reps=reps, device=device).us,
                     kernel_us=None, graph_us=None, why_not="n/a (CPU)")
    # Host: each call alone after a sync, the clock stopped when the call returns (no sync inside the
    # window): what the CPU spends issuing it, even where back-to-back calls would fill the launch queue.
    host = []
    for i in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(*inputs_list[i % n])
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(device)
    host_us = _timing(host).us
    # Kernels: the device time of every GPU activity the calls launched, from the profiler. The calls run
    # back to back without a flush, so this figure is L2-warm (the others are not).
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(*inputs_list[i % n])
        torch.cuda.synchronize(device)
    # Device-side kernel, copy and memset events only: a CPU event (a launch, an aten op) carries its
    # kernels' time too, and a user annotation spans them.
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)) / reps
    if capture is None:
        graph_us, why = _graph_replay_us(fn, inputs_list[0], reps=reps, device=device, flush=flush)
    else:
        whole, inputs, part = capture()
        graph_us, why = _graph_replay_us(whole, inputs, reps=reps, device=device, flush=flush)
        if graph_us is not None and part is not None:
            part_us, why = _graph_replay_us(part, inputs, reps=reps, device=device, flush=flush)
            graph_us = None if part_us is None else max(graph_us - part_us, 0.0)
    if graph_us is not None and graph_us < 0.5 * kernel_us:
        # Fewer kernels replayed than the eager call ran: the capture missed work (another stream).
        graph_us, why = None, f"capture incomplete: replay {graph_us:.1f} us < half the {kernel_us:.1f} us of kernels"
    return Modes(host_us=host_us, kernel_us=kernel_us, graph_us=graph_us, why_not=why)


def _graph_replay_us(fn: Callable[..., Any], inputs: tuple, *, reps: int, device: torch.device,
                     flush: Callable[[], None] | None) -> tuple[float | None, str | None]:
    prev = torch.cuda.current_stream(device)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(prev)
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
            for _ in range(3):
                fn(*inputs)
        prev.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*inputs)
    except Exception as e:  # an op that cannot be captured (a host sync): reported, not fatal
        # torch.cuda.graph restores the stream only after a successful capture_end: put it back, or every
        # later timing of the process would run on the abandoned capture stream.
        torch.cuda.set_stream(prev)
        torch.cuda.synchronize(device)
        return None, f"capture failed: {type(e).__name__}: {str(e)[:200]}"
    graph.replay()
    torch.cuda.synchronize(device)
    t = time_fn(lambda: graph.replay(), inputs_list=[()], warmup=2, reps=reps, device=device, flush=flush)
    return t.us, None


def measure_ceilings(ctx: Context) -> Ceilings:
    dev = ctx.device
    # 512 MiB dwarfs the 50 MB L2 of an H100/H200; on the CPU a small copy keeps the run short.
    n = (256 << 20) if ctx.is_cuda else (4 << 20)
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * src.element_size()
    copy_us = ctx.time(lambda s, d: d.copy_(s), [(src, dst)]).us
    del src, dst

    m = 8192 if ctx.is_cuda else 256
    a = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    mm_us = ctx.time(lambda: torch.mm(a, b), [()]).us
    return Ceilings(
        copy_gbps=copy_bytes / _nonzero(copy_us) / 1e3,
        copy_bytes=copy_bytes,
        matmul_bf16_tflops=2 * m**3 / _nonzero(mm_us) / 1e6,
        matmul_shape=(m, m, m),
        matmul_fp8_tflops=_fp8_matmul_tflops(ctx, a, b),
    )


def _nonzero(us: float) -> float:
    # A CPU timer can read 0 for a tiny call; rates must stay finite.
    return max(us, 1e-3)


def _fp8_matmul_tflops(ctx: Context, a: torch.Tensor, b: torch.Tensor) -> float | None:
    if not ctx.is_cuda or torch.cuda.get_device_capability(ctx.device) < (8, 9):
        return None
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # _scaled_mm takes its second operand column-major
    one = torch.ones((), dtype=torch.float32, device=ctx.device)

    def mm():
        return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    try:
        mm()
    except (RuntimeError, TypeError):  # a torch or GPU without this fp8 path: no ceiling, not an error
        return None
    return 2 * a.shape[0] * a.shape[1] * b.shape[0] / _nonzero(ctx.time(mm, [()]).us) / 1e6


def check_exact(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """moe_kernels.testing.assert_exact, with the comparison done on the device first: a passing
    check of a multi-GB tensor then costs no copy to the host."""
    if ours.shape != ref.shape or ours.dtype != ref.dtype or not torch.equal(ours, ref):
        assert_exact(ours, ref, what)


def check_peer(what: str, peer: torch.Tensor, ref: torch.Tensor) -> None:
    """A peer may round differently from the reference, but must agree within its output dtype's
    precision (torch.testing's default tolerance for the dtype): it computes the same function."""
    torch.testing.assert_close(peer, ref, msg=lambda m: f"{what}: {m}")


@dataclass
class Result:
    op: str  # e.g. "permute_fwd"
    case: str  # e.g. "deepseek-v3/T8192/uniform"
    shape: dict[str, int]
    dtype: str
    us: float
    p20_us: float
    p80_us: float
    bytes: int  # each input read once + each output written once
    flops: int
    gbps: float
    tflops: float | None  # None for ops without GEMM work
    ceiling: str  # the measured ceiling pct_of_ceiling refers to (CEILING_KINDS)
    pct_of_ceiling: float
    peer_us: dict[str, float]
    speedup: dict[str, float]  # peer time / our time
    peer_variant: dict[str, str] = field(default_factory=dict)  # which variant set the peer's time
    extra: dict[str, float] = field(default_factory=dict)  # other measurements of the case (e.g. peak memory)
    at_s: float = 0.0  # when it was measured, seconds after the run started
    ceiling_at: str = "start"  # the label of the ceiling measurement it is judged against (the nearest)
    suspect: bool = False  # above 100% of its ceiling: a ceiling or the timing is off
    # Host-bound ops: ours and each peer as Modes fields (host_us, kernel_us, graph_us; None where not
    # measurable), and the peer / ours ratio in each mode.
    modes: dict[str, float | None] = field(default_factory=dict)
    peer_modes: dict[str, dict[str, float | None]] = field(default_factory=dict)
    mode_speedup: dict[str, dict[str, float | None]] = field(default_factory=dict)
    modes_note: dict[str, str] = field(default_factory=dict)  # "ours" or peer -> why a mode is missing


@dataclass
class Report:
    results: list[Result]
    headline: list[str]
    failures: list[str]  # cases not timed because a correctness check failed
    skipped: list[str] = field(default_factory=list)  # cases not measured, with why (out of GPU memory)


def model_sweep(ctx: Context, models: dict, cpu_models: dict, tokens: Sequence[int], quick_tokens: Sequence[int],
                cpu_tokens: Sequence[int] = (64,)) -> list[tuple]:
    """(model name, T, *model parameters) for every model and token count: the perf.md shapes on a GPU
    (`quick_tokens` with --quick), the tiny ones on the CPU."""
    if ctx.is_cuda:
        chosen, counts = ctx.pick(models, quick_tokens if ctx.quick else tokens)
    else:
        chosen, counts = cpu_models, cpu_tokens
    return [(m, T, *chosen[m]) for m in chosen for T in counts]


def out_of_memory(e: BaseException) -> str:
    """A skipped case's reason: the allocator's first sentences (how much was asked for, how much was free)."""
    msg = " ".join(str(e).split())
    return "out of memory: " + (msg.split(" Including non-PyTorch")[0].split(" Of the allocated")[0][:240] or type(e).__name__)


def release(ctx: Context) -> None:
    """Frees what a finished (or abandoned) case left: cycles through its frames (an exception's traceback
    holds every local of the case) and the allocator's cached blocks, so the next case starts from the same
    free memory."""
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()


def skip_case(family: str, case: str, e: BaseException, skipped: list[str]) -> None:
    """Records a case that did not fit (torch.OutOfMemoryError) and says so at once on stdout."""
    why = f"{case}: {out_of_memory(e)}"
    skipped.append(why)
    print(f"SKIPPED {family} {why}", flush=True)


def run_cases(ctx: Context, family: str, cases: Sequence, run_case: Callable[[Context, Any], list]
              ) -> tuple[list, list[str], list[str]]:
    """Runs each case; a case whose correctness check fails (AssertionError) is reported, not timed, and
    the other cases still run; a case that runs out of GPU memory is recorded as skipped, its memory
    handed back, and the next case runs. Returns (results, failures, skipped)."""
    print(f"{family} on {ctx.device}: ours runs {'the CUDA kernels' if ctx.ours_runs_kernels else 'the reference'}",
          flush=True)
    results, failures, skipped = [], [], []
    for i, c in enumerate(cases):
        try:
            results += run_case(ctx, c)
        except AssertionError as e:
            failures.append(f"{c.name}: {e}")
        except torch.OutOfMemoryError as e:
            skip_case(family, c.name, e, skipped)
        release(ctx)
        ctx.case_done(family, i, len(cases))
    ctx.finish(family, results)
    return results, failures, skipped


def make_result(ctx: Context, *, op: str, case: str, shape: dict[str, int], dtype: torch.dtype,
                timing: Timing, nbytes: int, flops: int, peers: dict[str, Timing],
                peer_variant: dict[str, str] | None = None, ceiling: str | None = None,
                modes: Modes | None = None, peer_modes: dict[str, Modes] | None = None) -> Result:
    """`ceiling`: which ceiling judges the result (CEILING_KINDS); by default copy bandwidth or the matmul
    throughput of the operands' dtype (fp8 dtypes: the FP8 ceiling), whichever binds."""
    if ceiling is not None and ceiling not in CEILING_KINDS:
        raise ValueError(f"ceiling: expected one of {CEILING_KINDS}, got {ceiling!r}")
    us = _nonzero(timing.us)
    mode_speedup = {}
    if modes is not None:
        for p, m in (peer_modes or {}).items():
            mode_speedup[p] = {k: _ratio(getattr(m, k), getattr(modes, k)) for k in MODE_FIELDS}
    r = Result(
        op=op, case=case, shape=shape, dtype=str(dtype).removeprefix("torch."), us=timing.us,
        p20_us=timing.p20_us, p80_us=timing.p80_us, bytes=nbytes, flops=flops, gbps=nbytes / us / 1e3,
        tflops=flops / us / 1e6 if flops else None, ceiling=ceiling or "", pct_of_ceiling=0.0,
        peer_us={p: t.us for p, t in peers.items()},
        speedup={p: _nonzero(t.us) / us for p, t in peers.items()},
        peer_variant=peer_variant or {}, at_s=round(ctx.elapsed_s(), 3),
        modes={k: getattr(modes, k) for k in MODE_FIELDS} if modes is not None else {},
        peer_modes={p: {k: getattr(m, k) for k in MODE_FIELDS} for p, m in (peer_modes or {}).items()},
        mode_speedup=mode_speedup,
        modes_note={k: m.why_not for k, m in (({"ours": modes} if modes else {}) | (peer_modes or {})).items()
                    if m is not None and m.why_not},
    )
    judge(r, ctx.nearest_ceilings(r.at_s), fp8=dtype in FP8_DTYPES, kind=ceiling)
    return r


MODE_FIELDS = ("host_us", "kernel_us", "graph_us")


def _ratio(peer_us: float | None, ours_us: float | None) -> float | None:
    return None if peer_us is None or ours_us is None else _nonzero(peer_us) / _nonzero(ours_us)


def judge(r: Result, c: Ceilings, *, fp8: bool | None = None, kind: str | None = None) -> None:
    """Sets r's ceiling kind (when not fixed), pct_of_ceiling, ceiling_at and suspect against c."""
    if fp8 is None:
        fp8 = r.ceiling == "matmul_fp8" or r.dtype.startswith("float8")
    if not kind:
        mm = "matmul_fp8" if fp8 and c.matmul_fp8_tflops else "matmul_bf16"
        # Judged against whichever ceiling binds: copy bandwidth, or matmul throughput for GEMMs.
        mem_bound = r.tflops is None or r.tflops / c.value(mm) < r.gbps / c.copy_gbps
        kind = "copy" if mem_bound else mm
    value = c.value(kind)
    rate = r.gbps if kind.startswith("copy") else r.tflops
    r.ceiling, r.ceiling_at = kind, c.label
    r.pct_of_ceiling = 100 * (rate or 0.0) / value if value else 0.0
    r.suspect = r.pct_of_ceiling > 100.0


def rejudge(ctx: Context, results: Sequence[Result]) -> None:
    """Judges each result again against the ceiling measurement nearest to when it ran (the middle and
    end ones did not exist yet when it was made)."""
    for r in results:
        judge(r, ctx.nearest_ceilings(r.at_s), kind=r.ceiling)


def summarize(results: Sequence[Result]) -> dict[str, Any]:
    """Per op, over every case: geomean and worst % of ceiling, and per peer geomean and worst speedup
    (with the worst case's name); per mode too for host-bound ops."""
    out: dict[str, Any] = {}
    for op in dict.fromkeys(r.op for r in results):
        rs = [r for r in results if r.op == op]
        pct = [r.pct_of_ceiling for r in rs if r.pct_of_ceiling > 0]
        entry: dict[str, Any] = {
            "cases": len(rs),
            "ceiling": sorted({r.ceiling for r in rs}),
            "pct_of_ceiling": {"geomean": geomean(pct), "worst": min(pct) if pct else None,
                               "worst_case": min((r for r in rs if r.pct_of_ceiling > 0),
                                                 key=lambda r: r.pct_of_ceiling, default=rs[0]).case},
            "suspect_cases": [r.case for r in rs if r.suspect],
            "speedup": {},
        }
        for p in dict.fromkeys(p for r in rs for p in r.speedup):
            have = [r for r in rs if p in r.speedup]
            worst = min(have, key=lambda r: r.speedup[p])
            entry["speedup"][p] = {"geomean": geomean([r.speedup[p] for r in have]),
                                   "worst": worst.speedup[p], "worst_case": worst.case, "cases": len(have)}
        modes = {}
        for p in dict.fromkeys(p for r in rs for p in r.mode_speedup):
            for k in MODE_FIELDS:
                v = [r.mode_speedup[p][k] for r in rs if p in r.mode_speedup and r.mode_speedup[p][k] is not None]
                modes.setdefault(p, {})[k] = {"geomean": geomean(v), "worst": min(v) if v else None}
        if modes:
            entry["mode_speedup"] = modes
        out[op] = entry
    return out


def geomean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x > 0]
    return math.exp(statistics.fmean(map(math.log, xs))) if xs else None


def device_name(ctx: Context) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else (platform.processor() or platform.machine())


def run_metadata(ctx: Context) -> dict[str, Any]:
    driver = None
    if ctx.is_cuda:
        driver = run_cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                       f"--id={ctx.device.index or 0}"])
    return {
        "date": ctx.started_utc,
        "device": ctx.device.type,
        "device_name": device_name(ctx),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "moe_kernels": getattr(moe_kernels, "__version__", None),
        "has_cuda_kernels": moe_kernels.has_cuda_kernels(),
        "ours": "cuda kernels" if ctx.ours_runs_kernels else "pytorch reference",
        **provenance(ctx),
        "quick": ctx.quick,
        "warmup": ctx.warmup,
        "reps": ctx.reps,
        "input_sets": ctx.n_input_sets,
        "l2_flush_bytes": ctx.l2_flush_buffer().numel() * 4 if ctx.is_cuda else 0,
        "l2_flush": ctx.flush_mode if ctx.is_cuda else "none (CPU)",
    }


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def mode_cell(v: float | None, ctx: Context, spec: str = ".1f", suffix: str = "") -> str:
    if v is None:
        return "n/a (CPU)" if not ctx.is_cuda else "n/a"
    return f"{v:{spec}}{suffix}"


def suspect_reasons(ctx: Context, results: Sequence[Result], meta: dict[str, Any]) -> list[str]:
    """Why a run's figures should not be quoted as they are (empty: nothing known against them)."""
    why = [f"{r.op} {r.case}: {r.pct_of_ceiling:.1f}% of {r.ceiling}" for r in results if r.suspect]
    procs = meta.get("gpu_processes") or []
    # In a container nvidia-smi may list this process under the host's pid: one process is taken as ours.
    others = [p for p in procs if p.split(",")[0].strip() != str(os.getpid())] if len(procs) > 1 else []
    if others:
        why.append(f"other processes on the GPU: {'; '.join(others)}")
    # A CPU's timings swing far more than 10% run to run: drift is judged on a GPU only.
    for kind in ("copy", "matmul_bf16", "matmul_fp8") if meta.get("device") == "cuda" else ():
        v = [c.value(kind) for c in ctx.ceilings_log if c.value(kind)]
        if len(v) > 1 and min(v) < (1 - CEILING_DRIFT) * max(v):
            why.append(f"{kind} ceiling drifted {100 * (1 - min(v) / max(v)):.0f}% within the run "
                       f"({min(v):.0f}-{max(v):.0f})")
    end = meta.get("gpu_end") or {}
    reasons = str(end.get("clocks_event_reasons.active", "")).strip()
    if reasons and reasons not in ("0x0000000000000000", "0x0000000000000001", "[N/A]", "Not Active"):
        why.append(f"clock-event (throttle) reasons active at the end: {reasons}")
    return why


def report(ctx: Context, name: str, rep: Report) -> tuple[Path, Path]:
    """Measures the family's end ceilings and judges every result against the nearest measurement;
    prints the table, one `RESULT` line per case, `SUMMARY` (% of ceiling, geomean and worst) per op,
    `GEOMEAN` (with the worst case) per op and peer,
    `HEADLINE`, `SUSPECT`, `FAILED` and `SKIPPED` lines; writes bench_<name>.json and bench_<name>.png."""
    from rich.console import Console
    from rich.table import Table

    results = rep.results
    ctx.finish(name, results)
    c = ctx.ceiling_of(results[0]) if results else ctx.ceilings()
    peers = sorted({p for r in results for p in r.speedup}, key=lambda p: (p != "torch_eager", p))
    with_modes = any(r.modes for r in results)
    mode_peers = sorted({p for r in results for p in r.mode_speedup}, key=lambda p: (p != "torch_eager", p))
    fp8 = f", fp8 matmul {c.matmul_fp8_tflops:.1f}" if c.matmul_fp8_tflops else ""
    title = (f"{name} on {device_name(ctx)} (ours: {'cuda kernels' if ctx.ours_runs_kernels else 'reference'}):"
             f" copy {c.copy_gbps:.0f} GB/s, bf16 matmul {c.matmul_bf16_tflops:.1f}{fp8} TFLOP/s"
             f" ({len(ctx.ceilings_log)} ceiling measurements)")
    table = Table(title=title)
    cols = ["op", "case", "us (p20-p80)", "GB/s", "TFLOP/s", "% of ceiling", *(f"vs {p}" for p in peers)]
    if with_modes:
        cols += ["host / kernel / graph us", *(f"vs {p} host / kernel / graph" for p in mode_peers)]
    for col in cols:
        table.add_column(col, justify="left" if col in ("op", "case") else "right")
    for r in results:
        row = [r.op, r.case, f"{r.us:.1f} ({r.p20_us:.1f}-{r.p80_us:.1f})", f"{r.gbps:.1f}", _fmt(r.tflops, ".1f"),
               f"{r.pct_of_ceiling:.1f}% {r.ceiling}@{r.ceiling_at}{' SUSPECT' if r.suspect else ''}",
               *(_fmt(r.speedup.get(p), ".2f", "x") for p in peers)]
        if with_modes:
            row.append(" / ".join(mode_cell(r.modes.get(k), ctx) for k in MODE_FIELDS) if r.modes else "-")
            row += [" / ".join(mode_cell(r.mode_speedup[p][k], ctx, ".2f", "x") for k in MODE_FIELDS)
                    if p in r.mode_speedup else "-" for p in mode_peers]
        table.add_row(*row)
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)

    for r in results:
        dims = " ".join(f"{k}={v}" for k, v in r.shape.items())
        vs = " ".join(f"{p}={s:.2f}x" for p, s in r.speedup.items())
        modes = ""
        if r.modes:
            modes = " " + " ".join(f"{k}={mode_cell(v, ctx, '.2f')}" for k, v in r.modes.items())
            modes += "".join(f" {p}:{k.removesuffix('_us')}={mode_cell(v, ctx, '.2f', 'x')}"
                             for p, ms in r.mode_speedup.items() for k, v in ms.items())
        print(f"RESULT {r.op} {r.case} {dims} {r.dtype} us={r.us:.2f} GB/s={r.gbps:.1f} "
              f"TFLOP/s={_fmt(r.tflops, '.2f')} {r.ceiling}%={r.pct_of_ceiling:.1f}@{r.ceiling_at} {vs}{modes}"
              f"{' SUSPECT' if r.suspect else ''}")
    summary = summarize(results)
    for op, e in summary.items():
        pct = e["pct_of_ceiling"]
        print(f"SUMMARY {op} over {e['cases']} cases: % of {'/'.join(e['ceiling'])} geomean "
              f"{_fmt(pct['geomean'], '.1f')}, worst {_fmt(pct['worst'], '.1f')} ({pct['worst_case']})")
        for p, sp in e["speedup"].items():
            print(f"GEOMEAN {op} vs {p}: {sp['geomean']:.2f}x over {sp['cases']} cases; worst "
                  f"{sp['worst']:.2f}x ({sp['worst_case']})")
        for p, ms in e.get("mode_speedup", {}).items():
            print(f"SUMMARY {op} vs {p} by mode: " + ", ".join(
                f"{k.removesuffix('_us')} geomean {mode_cell(m['geomean'], ctx, '.2f', 'x')} "
                f"worst {mode_cell(m['worst'], ctx, '.2f', 'x')}" for k, m in ms.items()))
    for why in sorted({f"{k}: {v}" for r in results for k, v in r.modes_note.items() if ctx.is_cuda}):
        print(f"MODES n/a for {why}")
    if rep.skipped:
        print(f"SUMMARY {len(rep.skipped)} case(s) skipped, not measured: "
              + "; ".join(why.split(":")[0] for why in rep.skipped))
    for line in rep.headline:
        print(f"HEADLINE {line}")
    if rep.skipped:
        print(f"HEADLINE {len(rep.skipped)} case(s) not measured (skipped): " + "; ".join(rep.skipped))
    meta = run_metadata(ctx)
    suspect = suspect_reasons(ctx, results, meta)
    for line in suspect:
        print(f"SUSPECT {line}")
    for line in rep.failures:
        print(f"FAILED {line}")
    for line in rep.skipped:
        print(f"SKIPPED {line}")

    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = ctx.out_dir / f"bench_{name}.json", ctx.out_dir / f"bench_{name}.png"
    payload = {"suite": name, "meta": meta, "ceilings": asdict(c),
               "ceilings_log": [asdict(x) for x in ctx.ceilings_log], "method": __doc__,
               "headline": rep.headline, "failures": rep.failures, "skipped": rep.skipped, "suspect": bool(suspect),
               "suspect_reasons": suspect, "summary": summary, "results": [asdict(r) for r in results]}
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    plot(results, c, png_path, title=title)
    print(f"wrote {json_path} and {png_path}")
    return json_path, png_path


def plot(results: list[Result], c: Ceilings, path: Path, *, title: str) -> None:
    """One row per op: GB/s per case against the copy ceiling, and speedup per peer against 1x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in results)) or ["(no results)"]
    n_cases = max(sum(r.op == op for r in results) for op in ops)
    fig, axes = plt.subplots(len(ops), 2, squeeze=False, figsize=(max(12, 0.9 * n_cases), 4.5 * len(ops)))
    for (ax_bw, ax_sp), op in zip(axes, ops):
        rs = [r for r in results if r.op == op]
        x = np.arange(len(rs))
        ax_bw.bar(x, [r.gbps for r in rs], color="tab:blue")
        ax_bw.axhline(c.copy_gbps, color="tab:red", linestyle="--", label=f"copy {c.copy_gbps:.0f} GB/s")
        ax_bw.set(ylabel="GB/s", title=f"{op}: bandwidth")
        ax_bw.legend(loc="lower right", fontsize="small")
        peers = list(dict.fromkeys(p for r in rs for p in r.speedup))
        width = 0.8 / max(1, len(peers))
        for i, p in enumerate(peers):
            ax_sp.bar(x + (i - (len(peers) - 1) / 2) * width, [r.speedup.get(p, 0.0) for r in rs], width,
                      label=p)
        ax_sp.axhline(1.0, color="black", linewidth=0.8)
        ax_sp.set(ylabel="speedup (peer time / ours)", title=f"{op}: speedup")
        if peers:
            ax_sp.legend(loc="upper right", fontsize="small")
        for ax in (ax_bw, ax_sp):
            ax.set_xticks(x, [r.case for r in rs], rotation=90, fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
