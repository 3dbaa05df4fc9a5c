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
    assert '::emu::launch("k<T, 4>", __FILE__, __LINE__, dim3(g, 2), 128,\n           smem, s)' in body
    assert "[&](auto... emu_a) { k<T, 4>(emu_a...); }, a, b);" in body
    assert '::emu::launch("ns::plain", __FILE__, __LINE__, 1, 32)([&](auto... emu_a) { ns::plain(emu_a...); });' in body
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
    ],
)
def test_errors_name_kernel_block_warp_and_lane(name, message):
    with pytest.raises(RuntimeError, match=message):
        _run(name)
