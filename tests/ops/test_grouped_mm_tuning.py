"""The sm_90a grouped GEMM instances and their choice (csrc/gemm/sm90_kernels.h, csrc/gemm/sm90_table.h): CPU tier.

The choice is host code compiled into every extension, so it is checked here without a GPU: the table covers
every perf.md problem, each row names an instance that serves it, every instance is instantiated once as the
list says, and every input gets an answer (or a clear error for what no instance serves)."""

import importlib
import math
import random
import re
from pathlib import Path

import pytest

from bench import bench_tune_grouped_mm as T
from moe_kernels import _ext

ROOT = Path(__file__).resolve().parents[2]
SM90 = ROOT / "csrc" / "gemm" / "sm90"
BF16, FP16, FP8, FP32 = 2, 1, 3, 0


@pytest.fixture(scope="module")
def C():
    for mod in (_ext._C, _ext._EMU):
        if mod is not None:
            return mod
    for name in ("moe_kernels._C_emu", "moe_kernels._C"):
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    pytest.skip("no extension built")


def _serves(spec, op, dtype, out):
    return (spec["op"], spec["dtype"], spec["out"]) == (op, dtype, out)


def _instances() -> dict[str, tuple[str, str]]:
    """{instance name: (its macro, the macro's arguments after the name)} over csrc/gemm/sm90/*.cu, where each
    translation unit instantiates several; a name instantiated twice fails."""
    out = {}
    for path in sorted(SM90.glob("*.cu")):
        for m in re.finditer(r"^(MOE_\w+_INSTANCE)\((\w+), (.*)\)\s*$", path.read_text(), re.M):
            macro, name, args = m.groups()
            assert name not in out, f"{name} is instantiated twice"
            out[name] = (macro, args)
    return out


def test_every_instance_is_instantiated_once_with_its_listed_configuration(C):
    specs = {k["name"]: k for k in C.grouped_mm_sm90_kernels()}
    instances = _instances()
    # The gathered products' kernels (expert_mlp) are not table instances: named in gather_run's list.
    gather = {n: a for n, (macro, a) in instances.items() if macro == "MOE_GATHER_SM90_INSTANCE"}
    dispatch = (ROOT / "csrc" / "gemm" / "sm90_dispatch.cu").read_text()
    listed = re.findall(r"X\((\w+)\)", dispatch[dispatch.index("#define MOE_GATHER_INSTANCES(X)"):].split("\n")[0])
    assert sorted(gather) == sorted(listed) and len(listed) == 3, (sorted(gather), listed)
    for name, args in gather.items():
        assert re.fullmatch(r"cutlass::bfloat16_t, GemmOp::k\w+", args), name
        instances.pop(name)
    assert set(instances) == set(specs), "one instantiation per listed instance"
    el = {"cutlass::bfloat16_t": BF16, "cutlass::half_t": FP16}
    ops = {"kFwd": 0, "kDgrad": 1, "kWgrad": 2}
    for name, (macro, args) in instances.items():
        s = specs[name]
        if macro == "MOE_GROUPED_SM90_INSTANCE":
            m = re.fullmatch(r"([\w:]+), GemmOp::(\w+), Sm90Config<(\d+), (\d+), (\d+), (\d+), (\d+), (true|false)>",
                             args)
            assert m, name
            element, op, tm, tn, tk, cm, cn, pp = m.groups()
            assert (el[element], el[element], ops[op]) == (s["dtype"], s["out"], s["op"]), name
            assert (int(tm), int(tn), int(tk)) == tuple(s["tile"]) and (int(cm), int(cn)) == tuple(s["cluster"]), name
            assert (pp == "true") == s["pingpong"], name
            continue
        # FP8 blockwise: cooperative on 128x128x128 tiles with a cluster along M, or ping-pong on 64x128x128
        # tiles (fp8_blockwise.cuh's two schedules).
        if macro == "MOE_FP8_BLOCKWISE_INSTANCE":
            m = re.fullmatch(r"GemmOp::(\w+), ([\w:]+), (\d+)", args)
            assert m, name
            op, out, cm = m.groups()
            config = ((128, 128, 128), (int(cm), 1), False)
        else:
            assert macro == "MOE_FP8_BLOCKWISE_PINGPONG_INSTANCE", f"{name}: {macro}"
            m = re.fullmatch(r"GemmOp::(\w+), ([\w:]+)", args)
            assert m, name
            op, out = m.groups()
            config = ((64, 128, 128), (1, 1), True)
        out_code = {"float": FP32, "cutlass::bfloat16_t": BF16}[out]
        assert (FP8, out_code, ops[op]) == (s["dtype"], s["out"], s["op"]), name
        assert (tuple(s["tile"]), tuple(s["cluster"]), s["pingpong"]) == config, name


def test_dispatch_list_is_the_kernel_list_in_order(C):
    src = (ROOT / "csrc" / "gemm" / "sm90_dispatch.cu").read_text()
    body = src[src.index("#define MOE_SM90_INSTANCES(X)"):src.index("#define MOE_DECLARE")]
    assert re.findall(r"X\((\w+)\)", body) == [k["name"] for k in C.grouped_mm_sm90_kernels()]


def test_compiled_table_is_the_file(C):
    """The extension was built from the committed table (rebuild after `tune_grouped_mm` rewrites it)."""
    rows = T.parse((ROOT / "csrc" / "gemm" / "sm90_table.h").read_text())
    compiled = C.grouped_mm_sm90_table()
    assert len(rows) == len(compiled) > 0
    for r, c in zip(rows, compiled):
        assert (r.op, r.dtype, r.out, r.E, r.M, r.N, r.K, r.kernel, r.raster, r.tuned) == (
            c["op"], c["dtype"], c["out"], c["E"], c["M"], c["N"], c["K"], c["kernel"], c["raster"], c["tuned"])


def test_table_covers_every_perf_problem_with_an_instance_that_serves_it(C):
    specs = {k["name"]: k for k in C.grouped_mm_sm90_kernels()}
    rows = {(r["op"], r["dtype"], r["out"], r["E"], r["M"], r["N"], r["K"]): r for r in C.grouped_mm_sm90_table()}
    probs = T.problems()
    assert len(probs) == 5 * 4 * 2 * 6  # models x token counts x GEMMs x (3 bf16 + 3 fp8) products
    for p in probs:
        row = rows.get(p.key)
        assert row is not None, f"no table row for {p.name}"
        assert _serves(specs[row["kernel"]], p.op, p.dtype, p.out), f"{p.name}: {row['kernel']}"
        assert row["raster"] in (0, 1)
        # The problem's own row is what the choice returns.
        kernel, raster, index = C.grouped_mm_sm90_choice(p.op, p.dtype, p.out, p.E, p.M, p.N, p.K)
        assert (kernel, raster) == (row["kernel"], row["raster"]) and index >= 0, p.name


def test_untuned_rows_hold_the_rule(C):
    for r in C.grouped_mm_sm90_table():
        if not r["tuned"]:
            kernel, raster, index = C.grouped_mm_sm90_rule(r["op"], r["dtype"], r["out"], r["E"], r["M"], r["N"], r["K"])
            assert (kernel, raster, index) == (r["kernel"], r["raster"], -1), r


def test_choice_is_total(C):
    """Random problems, on and off the table: always an instance that serves the product and dtypes."""
    specs = C.grouped_mm_sm90_kernels()
    table = C.grouped_mm_sm90_table()
    rng = random.Random(0)
    combos = [(0, BF16, BF16), (1, BF16, BF16), (2, BF16, BF16), (0, FP16, FP16), (1, FP16, FP16), (2, FP16, FP16),
              (0, FP8, BF16), (2, FP8, FP32), (2, FP8, BF16)]
    for i in range(3000):
        op, dt, out = rng.choice(combos)
        if i % 3 == 0:  # a table shape with another M
            r = rng.choice(table)
            op, dt, out, E, N, K = r["op"], r["dtype"], r["out"], r["E"], r["N"], r["K"]
        else:
            E, N, K = rng.randint(1, 4096), 8 * rng.randint(1, 4096), 8 * rng.randint(1, 4096)
        M = rng.choice([0, 1, rng.randint(1, 1 << 20), rng.randint(1, 1 << 31)])
        kernel, raster, _ = C.grouped_mm_sm90_choice(op, dt, out, E, M, N, K)
        spec = next(s for s in specs if s["name"] == kernel)
        assert _serves(spec, op, dt, out) and raster in (0, 1), (op, dt, out, E, M, N, K, kernel)


def test_nearest_row_by_ratio(C):
    """Between two rows of one shape, M picks the nearer by ratio (the token counts double)."""
    table = C.grouped_mm_sm90_table()
    by_shape = {}
    for i, r in enumerate(table):
        by_shape.setdefault((r["op"], r["dtype"], r["out"], r["E"], r["N"], r["K"]), []).append((r["M"], i))
    shape, ms = next((s, sorted(v)) for s, v in by_shape.items() if len(v) >= 2)
    (m0, i0), (m1, i1) = ms[0], ms[1]
    below = int(math.sqrt(m0 * m1) * 0.9)
    above = int(math.sqrt(m0 * m1) * 1.1) + 1
    op, dt, out, E, N, K = shape
    assert C.grouped_mm_sm90_choice(op, dt, out, E, below, N, K)[2] == i0
    assert C.grouped_mm_sm90_choice(op, dt, out, E, above, N, K)[2] == i1
    assert C.grouped_mm_sm90_choice(op, dt, out, E, 0, N, K)[2] == i0  # M = 0 counts as one row


@pytest.mark.parametrize("op,dt,out", [(0, FP32, FP32), (1, FP8, BF16), (0, FP8, FP32), (0, BF16, FP16)])
def test_what_no_instance_serves_is_an_error(C, op, dt, out):
    with pytest.raises(ValueError, match="no sm_90a kernel"):
        C.grouped_mm_sm90_choice(op, dt, out, 8, 1024, 256, 256)


def test_rule_table_round_trips_and_equals_the_rule(C, tmp_path):
    path = T.write_rule_table(tmp_path / "t.h", C)
    rows = T.parse(path.read_text())
    assert [r.kernel for r in rows] == [C.grouped_mm_sm90_rule(*p.key)[0] for p in T.problems()]
    assert not any(r.tuned for r in rows) and all(r.label for r in rows)
    assert T.parse(T.render(rows, "x")) == rows


def test_pick_takes_the_least_geomean_over_routings():
    times = {("a", 0): {"uniform": 100.0, "zipf": 400.0},  # geomean 200
             ("b", 1): {"uniform": 150.0, "zipf": 240.0},  # geomean ~190: the winner
             ("c", 0): {"uniform": 90.0, "zipf": 500.0}}
    assert T.pick(times) == ("b", 1)


def test_sweep_plan_without_a_gpu(C, tmp_path, capsys):
    """On a CPU the bench prints the plan and writes nothing."""
    import torch

    from bench import harness as h

    ctx = h.Context(device=torch.device("cpu"), quick=True, out_dir=tmp_path)
    rep = T.run(ctx)
    assert "not run" in rep.headline[0] and not list(tmp_path.iterdir())
    assert f"{len(T.problems())} problems" in capsys.readouterr().out


def test_sweep_logic_with_faked_kernels(C, tmp_path, monkeypatch):
    """The GPU sweep's own logic on the CPU (so it cannot break unnoticed between GPU runs): the kernels
    replaced by the reference, the timings by a fixed cost per candidate. It must pick the cheapest candidate
    per problem, write a table the extension's parser reads back with those rows tuned and the rest the
    rule's, check each candidate's output, and record every timing."""
    import torch

    from bench import bench_grouped_mm as G
    from bench import harness as h
    from moe_kernels.ops.grouped_mm import grouped_mm_dgrad_reference, grouped_mm_reference, grouped_mm_wgrad_reference

    tiny = [T.Problem("tiny", 64, "w13", op, BF16, BF16, 4, 64, 32, 48) for op in (0, 1, 2)]
    monkeypatch.setattr(T, "problems", lambda *a, **k: list(tiny))
    monkeypatch.setitem(G.MODELS, "tiny", (48, 16, 4, 1, 1))
    cost = {name: 10.0 + i for i, name in enumerate(k["name"] for k in C.grouped_mm_sm90_kernels())}
    fastest = {p.op: min((n for n in cost if n.startswith(("fwd_", "dgrad_", "wgrad_")[p.op]) and "_bf16_" in n),
                         key=cost.get) for p in tiny}
    calls = []

    def runner(C_, p, inp, sizes, kernel, raster):
        name = C_.grouped_mm_sm90_kernels()[kernel]["name"]
        ref = (grouped_mm_reference, grouped_mm_dgrad_reference, grouped_mm_wgrad_reference)[p.op]

        def fn():
            calls.append(name)
            out = ref(inp["a"].float(), inp["b"].float(), sizes).to(torch.bfloat16)
            out.cost_us = cost[name] + (5.0 if raster == 0 else 0.0)  # along N cheaper here
            return out
        return fn

    def fake_time(fn, **kw):
        us = fn().cost_us
        return h.Timing(us, us, us)

    monkeypatch.setattr(T, "_runner", runner)
    monkeypatch.setattr(T, "_torch_peer", lambda *a: None)
    monkeypatch.setattr(T.h, "time_fn", fake_time)
    ctx = h.Context(device=torch.device("cpu"), quick=True, out_dir=tmp_path)
    table, records, failures = T.sweep(ctx, C, budget_s=60)
    assert not failures and len(records) == 3
    for p, row in zip(tiny, table):
        assert row.tuned and (row.kernel, row.raster) == (fastest[p.op], 1), p.name
    written = T.parse((tmp_path / "sm90_table.h").read_text())
    assert [(r.kernel, r.raster, r.tuned) for r in written] == [(r.kernel, r.raster, r.tuned) for r in table]
    assert "3 of 3 rows tuned" in (tmp_path / "sm90_table.h").read_text()
    saved = __import__("json").loads((tmp_path / "tune_grouped_mm.json").read_text())
    assert len(saved["records"][0]["times_us"]) == len(T.candidates(tiny[0], C.grouped_mm_sm90_kernels()))
    assert set(calls) >= set(fastest.values())


def test_sweep_stops_at_its_budget(C, tmp_path, monkeypatch):
    import torch

    from bench import harness as h

    tiny = [T.Problem("tiny", 64, "w13", 0, BF16, BF16, 4, 64, 32, 48)]
    monkeypatch.setattr(T, "problems", lambda *a, **k: list(tiny))
    ctx = h.Context(device=torch.device("cpu"), quick=True, out_dir=tmp_path)
    table, records, failures = T.sweep(ctx, C, budget_s=-1)
    assert not records and not any(r.tuned for r in table)
    assert "0 of 1 rows tuned" in (tmp_path / "sm90_table.h").read_text()
