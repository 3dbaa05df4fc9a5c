"""The bench harness on a CPU: which ceiling judges a result and which measurement of it, the flush that
only reads, the three host-bound timings, summaries and byte/FLOP counts of the ops."""

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import bench_grouped_mm as bg
from bench import bench_router as br
from bench import bench_router_losses as bl
from bench import harness as h


def ceil(label, at_s, copy=1000.0, bf16=800.0, fp8=1600.0):
    return h.Ceilings(copy_gbps=copy, copy_bytes=1, matmul_bf16_tflops=bf16, matmul_shape=(1, 1, 1),
                      matmul_fp8_tflops=fp8, label=label, at_s=at_s)


@pytest.fixture
def ctx(tmp_path):
    c = h.Context(torch.device("cpu"), quick=True, out_dir=tmp_path)
    c.ceilings_log[:] = [ceil("start", 0.0, copy=1000.0), ceil("middle:x", 10.0, copy=800.0),
                         ceil("end:x", 20.0, copy=500.0)]
    return c


def result(*, us=1.0, nbytes=0, flops=0, dtype="bfloat16", ceiling="", at_s=0.0):
    return h.Result(op="op", case="case/T8", shape={}, dtype=dtype, us=us, p20_us=us, p80_us=us, bytes=nbytes,
                    flops=flops, gbps=nbytes / us / 1e3, tflops=flops / us / 1e6 if flops else None,
                    ceiling=ceiling, pct_of_ceiling=0.0, peer_us={}, speedup={}, at_s=at_s)


def test_nearest_measurement_in_time(ctx):
    assert [ctx.nearest_ceilings(t).label for t in (0.0, 4.9, 5.1, 14.0, 16.0, 99.0)] == [
        "start", "start", "middle:x", "middle:x", "end:x", "end:x"]
    r = result(nbytes=400_000, at_s=12.0)  # 400 GB/s
    h.rejudge(ctx, [r])
    assert (r.ceiling, r.ceiling_at, r.pct_of_ceiling, r.suspect) == ("copy", "middle:x", 50.0, False)
    r.at_s = 19.0
    h.rejudge(ctx, [r])
    assert (r.ceiling_at, r.pct_of_ceiling) == ("end:x", 80.0)


def test_ceiling_kind_binds_by_dtype_and_work():
    c = ceil("start", 0.0)
    gemm = result(us=1000.0, nbytes=10**8, flops=4 * 10**11)  # 400 TFLOP/s, 100 GB/s: compute-bound
    h.judge(gemm, c)
    assert (gemm.ceiling, gemm.pct_of_ceiling) == ("matmul_bf16", 50.0)
    fp8 = result(us=1000.0, nbytes=10**8, flops=4 * 10**11, dtype="float8_e4m3fn")
    h.judge(fp8, c)
    assert (fp8.ceiling, fp8.pct_of_ceiling) == ("matmul_fp8", 25.0)  # never against bf16 (was 50%)
    no_fp8 = result(us=1000.0, nbytes=10**8, flops=4 * 10**11, dtype="float8_e4m3fn")
    h.judge(no_fp8, ceil("start", 0.0, fp8=None))
    assert no_fp8.ceiling == "matmul_bf16"  # a device without an fp8 ceiling
    streaming = result(us=1000.0, nbytes=9 * 10**8, flops=10**9)  # 900 GB/s, 1 TFLOP/s
    h.judge(streaming, c)
    assert (streaming.ceiling, streaming.pct_of_ceiling) == ("copy", 90.0)
    received = result(us=1000.0, nbytes=4 * 10**8, ceiling="copy_received")  # 400 GB/s received
    h.judge(received, c, kind="copy_received")
    assert c.copy_received_gbps == 500.0 and received.pct_of_ceiling == 80.0  # not 40% of read + written


def test_above_the_ceiling_is_suspect(ctx):
    r = h.make_result(ctx, op="op", case="c/T8", shape={}, dtype=torch.bfloat16, timing=h.Timing(1.0, 1.0, 1.0),
                      nbytes=1_200_000, flops=0, peers={})  # 1200 GB/s against 1000 at the start
    assert r.suspect and r.pct_of_ceiling == pytest.approx(120.0)
    assert h.suspect_reasons(ctx, [r], {}) == ["op c/T8: 120.0% of copy"]
    with pytest.raises(ValueError, match="ceiling"):
        h.make_result(ctx, op="op", case="c", shape={}, dtype=torch.bfloat16, timing=h.Timing(1.0, 1.0, 1.0),
                      nbytes=1, flops=0, peers={}, ceiling="dram")


def test_other_gpu_processes_and_drift_make_a_run_suspect(ctx):
    meta = {"gpu_processes": ["1, python3, 100 MiB", "2, other, 5 MiB"]}
    assert any("other processes" in w for w in h.suspect_reasons(ctx, [], meta))
    # One process: ours, whatever pid a container's nvidia-smi shows for it.
    assert not any("other processes" in w for w in h.suspect_reasons(ctx, [], {"gpu_processes": ["1, py, 1 MiB"]}))
    # The fixture's copy ceiling fell from 1000 to 500 GB/s within the run (judged on a GPU only).
    assert any(w.startswith("copy ceiling drifted 50%") for w in h.suspect_reasons(ctx, [], {"device": "cuda"}))
    assert h.suspect_reasons(ctx, [], {"device": "cpu"}) == []
    ctx.ceilings_log[:] = [ceil("start", 0.0), ceil("end:x", 1.0, copy=950.0)]
    gpu = {"device": "cuda"}
    assert h.suspect_reasons(ctx, [], gpu | {"gpu_end": {"clocks_event_reasons.active": "0x0000000000000001"}}) == []
    assert h.suspect_reasons(ctx, [], gpu | {"gpu_end": {"clocks_event_reasons.active": "0x0000000000000004"}})


def test_labels_are_unique_and_finish_judges_again(tmp_path, monkeypatch):
    c = h.Context(torch.device("cpu"), quick=True, out_dir=tmp_path)
    measured = iter([ceil("", 0.0, copy=1000.0), ceil("", 0.0, copy=800.0), ceil("", 0.0, copy=500.0)])
    monkeypatch.setattr(h, "measure_ceilings", lambda ctx: next(measured))
    c.measure_ceilings("start")
    r = h.make_result(c, op="op", case="c", shape={}, dtype=torch.float32, timing=h.Timing(1.0, 1.0, 1.0),
                      nbytes=400_000, flops=0, peers={})  # 400 GB/s
    assert (r.ceiling_at, r.pct_of_ceiling) == ("start#0", 40.0)
    c.finish("fam", [r])  # an end measurement after the last result, then judged against the nearest
    c.finish("fam", [r])  # nothing ran since: no second end measurement
    assert [x.label for x in c.ceilings_log] == ["start#0", "end:fam#1"]
    c.ceilings_log[-1] = dataclasses.replace(c.ceilings_log[-1], at_s=10.0)  # well after the start
    r.at_s = 9.0
    h.rejudge(c, [r])
    assert (r.ceiling_at, r.pct_of_ceiling) == ("end:fam#1", 50.0) and c.ceiling_of(r).copy_gbps == 800.0


def test_missing_modes_say_why(ctx):
    ours, peer = h.Modes(10.0, 2.0, None, "capture failed: sync"), h.Modes(30.0, 4.0, 1.0)
    r = h.make_result(ctx, op="op", case="c", shape={}, dtype=torch.float32, timing=h.Timing(1.0, 1.0, 1.0),
                      nbytes=1, flops=0, peers={}, modes=ours, peer_modes={"eager": peer})
    assert r.modes_note == {"ours": "capture failed: sync"}


def test_middle_measured_half_way_once(ctx, monkeypatch):
    labels = []
    monkeypatch.setattr(ctx, "measure_ceilings", lambda label: labels.append(label))
    for i in range(5):
        ctx.case_done("fam", i, 5)
    ctx.case_done("one", 0, 1)  # a single case: start and end bracket it already
    assert labels == ["middle:fam"]


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_flush_reads_its_buffer_and_never_writes_it():
    buf = torch.rand(1 << 16)
    before, version = buf.clone(), buf._version
    sink = torch.empty(())
    with Recorder() as rec:
        h.flush_l2(buf, sink)
    assert buf._version == version and torch.equal(buf, before)
    assert sink.item() == pytest.approx(before.sum().item(), rel=1e-5)  # every element was read
    # Whatever ran, the buffer was never an argument the op's schema marks as written.
    assert rec.calls
    for func, args, kwargs in rec.calls:
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write:
                assert value is not buf, (func, a.name)


def test_flush_modes(tmp_path):
    with pytest.raises(ValueError, match="flush_mode"):
        h.Context(torch.device("cpu"), quick=True, out_dir=tmp_path, flush_mode="zero")
    h.Context(torch.device("cpu"), quick=True, out_dir=tmp_path, flush_mode="none").flush()  # no-op on a CPU


def test_time_modes_on_a_cpu():
    m = h.time_modes(lambda x: x + 1, inputs_list=[(torch.ones(8),)], warmup=1, reps=3, device=torch.device("cpu"))
    assert m.host_us > 0 and math.isfinite(m.host_us)
    assert (m.kernel_us, m.graph_us, m.why_not) == (None, None, "n/a (CPU)")
    assert h.mode_cell(None, h.Context(torch.device("cpu"), quick=True, out_dir=None)) == "n/a (CPU)"


def test_mode_speedups_and_summaries(ctx):
    ours, peer = h.Modes(10.0, 2.0, 1.0), h.Modes(30.0, 4.0, None)
    rs = [h.make_result(ctx, op="op", case=f"c/T{i}", shape={}, dtype=torch.float32,
                        timing=h.Timing(1.0, 1.0, 1.0), nbytes=100 * (i + 1), flops=0,
                        peers={"eager": h.Timing(s, s, s)}, modes=ours, peer_modes={"eager": peer})
          for i, s in enumerate((2.0, 8.0, 0.5))]
    assert rs[0].mode_speedup == {"eager": {"host_us": 3.0, "kernel_us": 2.0, "graph_us": None}}
    s = h.summarize(rs)["op"]
    assert s["cases"] == 3
    assert s["speedup"]["eager"]["geomean"] == pytest.approx(2.0)  # (2 * 8 * 0.5) ** (1/3)
    assert (s["speedup"]["eager"]["worst"], s["speedup"]["eager"]["worst_case"]) == (0.5, "c/T2")
    assert s["pct_of_ceiling"]["worst_case"] == "c/T0"
    assert s["mode_speedup"]["eager"]["host_us"]["geomean"] == pytest.approx(3.0)
    assert s["mode_speedup"]["eager"]["graph_us"] == {"geomean": None, "worst": None}


def test_byte_and_flop_counts():
    # router_topk at deepseek-v3 / 16384 in fp32 logits with the expert bias: logits + bias in, weights and
    # indices out; the backward reads grad weights, logits and indices and writes grad logits.
    c = br.Case("deepseek-v3", 16384, *br.MODELS["deepseek-v3"])
    T, E, k = 16384, 256, 8
    fwd = T * E * 4 + E * 4 + 2 * T * k * 4
    assert br.nbytes("router_topk_fwd", c) == fwd
    assert br.nbytes("router_topk_fwd_bwd", c) == fwd + T * k * 4 + T * E * 4 + T * k * 4 + T * E * 4
    lc = bl.Case("qwen3-30b-a3b", 4096, *bl.MODELS["qwen3-30b-a3b"])
    assert bl.nbytes("tokens_per_expert", lc) == 4096 * 8 * 4 + 128 * 4
    # scores read, counts read, the loss, and the gradient's one [E] row (broadcast over the T rows)
    assert bl.nbytes("aux_loss_fwd_bwd", lc) == 4096 * 128 * 4 + 128 * 4 + 4 + 128 * 4
    # grouped_mm at qwen3-30b-a3b w13 with an empty expert: only the non-empty experts' weights are read
    gc = bg.Case("qwen3-30b-a3b", 8192, 2048, 768, 128, 8, 1, "uniform", "w13")
    sizes = (0,) + (512,) * 127
    M, N, K, wb = 512 * 127, 2 * 768, 2048, 127 * 2 * 768 * 2048 * 2
    assert bg.nbytes("fwd", gc, sizes) == M * K * 2 + wb + 128 * 4 + M * N * 2
    assert bg.nbytes("wgrad", gc, sizes) == M * N * 2 + M * K * 2 + 128 * 4 + 128 * N * K * 2
