"""The CPU execution layer (tools/cuda_on_cpu): its source rewrite, its collectives' results, and the
errors it must report (an exited lane in a mask, lanes in different collectives, a read outside the
mask, a deadlock, a bad launch configuration)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "cuda_on_cpu"))
import rewrite  # noqa: E402

try:
    emu = importlib.import_module("moe_kernels._C_emu")
except ImportError:
    emu = None
needs_emu = pytest.mark.skipif(emu is None, reason="moe_kernels._C_emu is not built (no CUDA headers)")


def test_rewrite_launches_keep_lines_and_names():
    src = (
        "void f(cudaStream_t s) {\n"
        "  k<T, 4><<<dim3(g, 2), 128,\n"
        "           smem, s>>>(a, b);\n"
        "  ns::plain<<<1, 32>>>();  // <<< in a comment stays\n"
        "}\n"
    )
    out = rewrite.rewrite_source(src, "/x/f.cu")
    assert out.startswith('#line 1 "/x/f.cu"\n')
    body = out.split("\n", 1)[1]
    assert body.count("\n") == src.count("\n")
    assert ('::emu::launch("k<T, 4>", __FILE__, __LINE__, ::emu::kernel_address(k<T, 4>), dim3(g, 2), 128,\n'
            '           smem, s)') in body
    assert "[&](auto... emu_a) { k<T, 4>(emu_a...); }, a, b);" in body
    assert ('::emu::launch("ns::plain", __FILE__, __LINE__, ::emu::kernel_address(ns::plain), 1, 32)'
            '([&](auto... emu_a) { ns::plain(emu_a...); });') in body
    assert "// <<< in a comment stays" in body


def test_rewrite_shared_declarations():
    src = (
        "  extern __shared__ __align__(16) unsigned char smem[];\n"
        "  __shared__ typename Scan::TempStorage a, b;\n"
        "  __shared__ float tile[16][65];\n"
    )
    body = rewrite.rewrite_source(src, "f.cu").split("\n", 1)[1]
    lines = body.split("\n")
    assert lines[0] == "  unsigned char* const smem = reinterpret_cast<unsigned char*>(::emu::dynamic_shared());"
    assert lines[1].startswith("  static typename Scan::TempStorage a, b; ")
    assert "::emu::shared_declared(&a, sizeof(a), &emu_epoch_a);" in lines[1]
    assert "::emu::shared_declared(&b, sizeof(b), &emu_epoch_b);" in lines[1]
    assert lines[2].startswith("  static float tile[16][65]; ") and "&emu_epoch_tile" in lines[2]


def _run(name, n=64 * 16, dtype=torch.int32):
    out = torch.full((n,), -7, dtype=dtype)
    emu.emu_selftest(name=name, out=out.data_ptr())
    return out


@needs_emu
def test_collectives_follow_ptx_semantics():
    o = _run("collectives").view(-1, 16)[:32].tolist()
    for lane in range(32):
        seg = lane // 8 * 8
        r = o[lane]
        assert r[0] == (seg + 3) * 10
        assert r[1] == (lane - 2 if lane - 2 >= seg else lane) * 10
        assert r[2] == (lane + 3 if lane + 3 < seg + 8 else lane) * 10
        assert r[3] == (lane ^ 5) * 10
        assert r[4] == sum(1 << i for i in range(32) if i % 3 == 0) - 2**32 * (31 % 3 == 0)
        assert r[5] == 0xF << (lane // 4 * 4) or r[5] == (0xF << (lane // 4 * 4)) - 2**32
        assert r[6] == sum(range(32))
        assert r[7] == 7 - 31
        assert r[8] == 31 * 3
        assert r[9] == 1 and r[10] == 0
        assert r[11] == -1 and r[12] == 1  # all lanes agree: the full mask, pred 1
        assert r[13] == 2 * (lane ^ 1) + 1
        assert r[14] == (lane ^ 8 if lane < 16 else -7)
        assert r[15] == 0xF


@needs_emu
def test_shared_memory_is_poisoned_and_barriers_order():
    assert (_run("poison", 128, torch.int64).view(torch.int32)[:128] == -1).all()
    assert _run("barrier", 64).tolist() == list(range(63, -1, -1))


@needs_emu
@pytest.mark.parametrize("wait,first,second", [("wait0", True, True), ("wait1", True, False),
                                               ("nowait", False, False)])
def test_cp_async_lands_at_its_wait(wait, first, second):
    # A copy's destination holds the poison until the thread waits for its commit group; a barrier alone does not
    # wait. wait1 leaves the newest group in flight.
    buf = torch.zeros(640, dtype=torch.int32)
    buf[:512] = torch.arange(512, dtype=torch.int32)
    emu.emu_selftest(name=f"cp_async_{wait}", out=buf.data_ptr())
    mirror = torch.arange(63, -1, -1, dtype=torch.int32) * 4
    poison = torch.full((64,), -1, dtype=torch.int32)
    assert torch.equal(buf[512:576], mirror if first else poison)
    assert torch.equal(buf[576:640], mirror + 256 if second else poison)


@needs_emu
@pytest.mark.parametrize(
    "name,message",
    [
        ("exited_lane", r"exited_lane_kernel, block \(0,0,0\), warp 0, lane 16 .*exited while lane 0 waits for it in __shfl_xor_sync"),
        ("mixed_collectives", r"lane 0 .*waits in __shfl_xor_sync .* for lane 16, which waits in __ballot_sync .*"
                              r"different collectives"),
        ("outside_mask", r"__shfl_sync reads lane 20, outside its mask 0x0000ffff"),
        ("deadlock", r"deadlock_kernel, block \(0,0,0\) deadlocked:\n  warp 0, lane 0 waits in __syncthreads"),
        ("bad_block", r"cudaErrorInvalidConfiguration"),
        ("big_smem", r"cudaErrorInvalidConfiguration"),
        ("big_smem_opted_in", r"^big_smem_opted_in: cudaErrorInvalidConfiguration"),  # 64 KB ran, 96 KB not
    ],
)
def test_errors_name_kernel_block_warp_and_lane(name, message):
    with pytest.raises(RuntimeError, match=message):
        _run(name)


@pytest.fixture
def schedule():
    """Sets the layer's schedule for one test and restores the previous one."""
    saved = []

    def set_(spec):
        previous = emu.emu_schedule(spec=spec)
        if not saved:
            saved.append(previous)

    yield set_
    if saved:
        emu.emu_schedule(spec=saved[0])


@needs_emu
def test_schedule_orders_threads(schedule):
    # A read of the lower neighbour's write with no barrier: the forward order hides the race, the
    # reverse order shows it (the poison), a random order shows it for some threads.
    schedule("forward")
    assert _run("race_lower", 64).tolist() == [0] + list(range(63))
    schedule("reverse")
    assert _run("race_lower", 64).tolist() == [0] + [-1] * 63
    schedule("random:1")
    got = _run("race_lower", 64).tolist()
    assert set(got[1:]) - {-1} <= set(range(63)) and -1 in got and any(v != -1 for v in got[1:])
    # With the barrier every order gives the same exchange.
    for spec in ("forward", "reverse", "random:2", "serial", "serial-reverse", "serial-random:3"):
        schedule(spec)
        assert _run("barrier", 64).tolist() == list(range(63, -1, -1))


@needs_emu
def test_serial_schedules_run_a_warp_ahead(schedule):
    # Two warps exchange through shared memory with only __syncwarp after the writes. Rounds advance every
    # warp one synchronisation point at a time, so no round order sees the race; a serial schedule runs
    # one warp to its end before the other writes.
    right = [(t + 32) % 64 for t in range(64)]
    for spec in ("forward", "reverse", "random:4"):
        schedule(spec)
        assert _run("race_across_warps", 64).tolist() == right
    schedule("serial")
    assert _run("race_across_warps", 64).tolist() == [-1] * 32 + right[32:]
    schedule("serial-reverse")
    assert _run("race_across_warps", 64).tolist() == right[:32] + [-1] * 32
    schedule("serial-random:1")
    got = _run("race_across_warps", 64).tolist()
    assert all(v in (-1, r) for v, r in zip(got, right))


@needs_emu
def test_schedule_orders_blocks(schedule):
    def tickets(spec):
        schedule(spec)
        out = torch.zeros(16, dtype=torch.int32)
        emu.emu_selftest(name="block_order", out=out.data_ptr())
        assert out[0] == 15
        return out[1:].tolist()

    assert tickets("forward") == list(range(15))
    assert tickets("reverse") == list(range(14, -1, -1))
    shuffled = [tickets(f"random:{seed}") for seed in range(4)]
    assert all(sorted(t) == list(range(15)) for t in shuffled)  # every block ran once
    assert any(t not in (list(range(15)), list(range(14, -1, -1))) for t in shuffled)
    assert tickets("random:3") == shuffled[3]  # a seed replays its order
    assert tickets("serial") == list(range(15)) and tickets("serial-reverse") == list(range(14, -1, -1))


@needs_emu
def test_schedule_names_itself_in_errors_and_rejects_bad_specs(schedule):
    schedule("random:5")
    with pytest.raises(RuntimeError, match=r"deadlocked:(.|\n)*schedule random:5\)"):
        _run("deadlock")
    for bad in ("backwards", "random:", "random:x", "random5", "random:-1", "random:+5", "random: 5",
                "random:99999999999999999999999", "serial-", "serial-backwards", "serialrandom"):
        with pytest.raises(ValueError, match="schedule"):
            schedule(bad)
