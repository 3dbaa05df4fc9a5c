"""grouped_mm: GPU tier. Forward, dgrad and wgrad against fp64, accepted when the error is at most
twice that of torch's own matmul at the same precision (moe_kernels.testing policy)."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels import _ext
from moe_kernels.ops.grouped_mm import grouped_mm_dgrad_reference, grouped_mm_reference, grouped_mm_wgrad_reference
from moe_kernels.testing import assert_close_to_fp64, assert_exact
from tests.emulation import EMULATED, skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2.5e8  # GEMM FLOP per case (fwd + dgrad + wgrad): the portable kernel emulates ~1 GFLOP/s


def splits(kind: str, M: int, E: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        sizes = torch.full((E,), M // E)
        sizes[: M - int(sizes.sum())] += 1
    elif kind == "skewed":  # Zipf-like: a few experts hold most rows
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        sizes = torch.bincount(torch.multinomial(p, M, replacement=True, generator=g), minlength=E)
    elif kind == "empty":  # every other expert empty
        live = torch.arange(E) % 2 == 0 if E > 1 else torch.ones(1, dtype=torch.bool)
        sizes = torch.zeros(E, dtype=torch.int64)
        sizes[live] = M // int(live.sum())
    elif kind == "single":  # one expert holds every row
        sizes = torch.zeros(E, dtype=torch.int64)
        sizes[E // 2] = M
    elif kind == "rising":  # skewed, the largest groups last (largest-first visiting reverses them)
        sizes = splits("skewed", M, E, seed).to(torch.int64).sort().values
    else:
        raise ValueError(kind)
    return sizes.to(torch.int32)


def torch_loop(x, w, gs, what):
    """Plain torch at the input precision (cuBLAS, fp32 accumulation): the error baseline."""
    out = {"fwd": [], "dgrad": [], "wgrad": []}[what]
    start = 0
    for e, n in enumerate(gs.tolist()):
        rows = slice(start, start + n)
        if what == "fwd":
            out.append(x[rows] @ w[e].t())
        start += n
    return torch.cat(out) if out else x.new_zeros((0, w.shape[1]))


def check_all(dev, x, w, gs, *, what=""):
    """fwd, dgrad and wgrad of one problem on `dev`; x [M, K], w [E, N, K] on the CPU or `dev`, any dtype."""
    M, n = x.shape[0], int(gs.sum())
    xd, wd, gsd = x.to(dev, copy=True), w.to(dev, copy=True), gs.to(dev)
    xg, wg = xd.clone().requires_grad_(), wd.clone().requires_grad_()
    out = mk.grouped_mm(xg, wg, gsd)
    g = torch.randn(M, w.shape[1], device=dev).to(x.dtype)
    out.backward(g)
    x64, w64, g64 = xd.double(), wd.double(), g.double()
    # Baselines: torch at the same precision, per expert.
    base_out = grouped_mm_reference(xd, wd, gsd) if x.dtype == torch.float32 else _loop_fwd(xd, wd, gs)
    base_dx, base_dw = _loop_bwd(g, xd, wd, gs)
    assert_close_to_fp64(out.detach()[:n], base_out[:n], grouped_mm_reference(x64, w64, gsd)[:n], f"fwd {what}",
                         floor=1e-3)
    assert_close_to_fp64(xg.grad[:n], base_dx[:n], grouped_mm_dgrad_reference(g64, w64, gsd)[:n], f"dgrad {what}",
                         floor=1e-3)
    assert bool((xg.grad[n:] == 0).all()), f"dgrad {what}: rows past the groups must be zero"
    assert_close_to_fp64(wg.grad, base_dw, grouped_mm_wgrad_reference(g64, x64, gsd), f"wgrad {what}", floor=1e-3)
    empty = (gs == 0).nonzero().flatten().tolist()
    for e in empty:
        assert bool((wg.grad[e] == 0).all()), f"wgrad {what}: empty group {e} must be zero"


def _loop_fwd(x, w, gs):
    parts, start = [], 0
    for e, n in enumerate(gs.tolist()):
        parts.append(x[start : start + n] @ w[e].t())
        start += n
    out = torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]))
    return torch.cat([out, x.new_zeros((x.shape[0] - out.shape[0], w.shape[1]))])


def _loop_bwd(g, x, w, gs):
    dx, dw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for e, n in enumerate(gs.tolist()):
        rows = slice(start, start + n)
        dx[rows] = g[rows] @ w[e]
        dw[e] = g[rows].t() @ x[rows]
        start += n
    return dx, dw


@pytest.mark.parametrize("E", [1, 8, 32, 128])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "single"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp64(cuda, E, kind, dtype):
    # M is not a multiple of any tile. Emulated: the same groups and rows, narrower products.
    M, N, K = (1000 + E, 256, 384) if not EMULATED else (1000 + E, 72, 96)
    gs = splits(kind, M - 3, E, seed=E)  # three rows past the groups
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) / K**0.5).to(dtype)
    check_all(cuda, x, w, gs, what=f"E={E} {kind} {dtype}")


@pytest.mark.parametrize("N,K,dtype", [(100, 64, torch.bfloat16), (64, 36, torch.float16), (96, 128, torch.float32)])
def test_portable_path(cuda, N, K, dtype):
    # N or K not a multiple of 8 (TMA alignment) or fp32: the portable kernel runs.
    E, M = 6, 500
    gs = splits("skewed", M, E, seed=1)
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) / K**0.5).to(dtype)
    if cuda.type == "cuda":
        C = _ext._C
        path = C.grouped_mm_path(0, _ext.dtype_code(dtype), E, M, N, K, 16, 16, 16, cuda.index or 0)
        assert path == 0, "expected the portable kernel"
    check_all(cuda, x, w, gs, what=f"portable N={N} K={K} {dtype}")


def test_path_choice(cuda):
    if cuda.type != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernels need an H100/H200")
    C = _ext._C
    assert C.grouped_mm_has_sm90
    bf16 = _ext.dtype_code(torch.bfloat16)
    assert C.grouped_mm_path(0, bf16, 128, 32768, 1536, 2048, 256, 256, 256, 0) == 1  # 256 rows per expert
    assert C.grouped_mm_path(0, bf16, 8, 65536, 4096, 14336, 256, 256, 256, 0) == 2
    assert C.grouped_mm_path(2, bf16, 8, 512, 4096, 4096, 256, 256, 256, 0) == 2
    assert C.grouped_mm_path(0, bf16, 8, 512, 4096, 4096, 258, 256, 256, 0) == 0  # misaligned pointer


# Local expert problems of specs/perf.md (EP=8 for deepseek-v3 and qwen3-235b), 4096 tokens.
PERF = {
    "deepseek-v3": (256 // 8, 7168, 2048, 8),
    "qwen3-235b": (128 // 8, 4096, 1536, 8),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "gpt-oss-120b": (128, 2880, 2880, 4),
}


@pytest.mark.gpu_memory
@pytest.mark.parametrize("name", list(PERF))
def test_perf_shapes(cuda, name):
    E, H, F, k = PERF[name]
    M = 4096 * k
    skip_if_too_large(3 * 2 * M * H * F * 3, EMULATION_BUDGET, "GEMM FLOP")
    gs = splits("skewed", M, E, seed=3)
    gen = torch.Generator(cuda).manual_seed(3)  # drawn on the device: deepseek-v3's w13 has 940M elements
    x = torch.randn(M, H, device=cuda, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * F, H, device=cuda, generator=gen) / H**0.5).to(torch.bfloat16)
    check_all(cuda, x, w13, gs, what=f"{name} w13")
    del w13
    h = torch.randn(M, F, device=cuda, generator=gen).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=cuda, generator=gen) / F**0.5).to(torch.bfloat16)
    check_all(cuda, h, w2, gs, what=f"{name} w2")


def test_sizes_past_m_are_memory_safe(cuda, checks_on):
    x = torch.randn(10, 16, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(2, 8, 16, device=cuda, dtype=torch.bfloat16)
    gs = torch.tensor([6, 9], dtype=torch.int32, device=cuda)
    with pytest.raises(ValueError, match="sums to 15"):
        mk.grouped_mm(x, w, gs)
    mk.set_checks(False)
    if cuda.type == "cuda" or EMULATED:  # clamped to M: rows 6..9 of group 1, nothing outside x or out is touched
        out = mk.grouped_mm(x, w, gs)
        ref = grouped_mm_reference(x.cpu(), w.cpu(), torch.tensor([6, 4], dtype=torch.int32))
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda_device
def test_deterministic_and_graph_capture(cuda):
    E, M, N, K = 16, 4096, 512, 1024
    gs = splits("skewed", M, E).to(cuda)
    x = torch.randn(M, K, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, N, K, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=cuda, dtype=torch.bfloat16)

    def step():
        x.grad = w.grad = None
        out = mk.grouped_mm(x, w, gs)
        out.backward(g)
        return out.detach(), x.grad, w.grad

    first = [t.clone() for t in step()]
    for a, b in zip(first, step()):
        assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dx, dw = step()
    gs.copy_(splits("uniform", M, E).to(cuda))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b, name in zip((out, dx, dw), eager, ("out", "dx", "dw")):
        assert_exact(a.cpu(), b.cpu(), f"graph replay {name}")


def test_degenerate_sizes(cuda):
    bf16 = torch.bfloat16
    gs = torch.tensor([3, 2], dtype=torch.int32, device=cuda)
    out = mk.grouped_mm(torch.randn(6, 0, device=cuda, dtype=bf16), torch.randn(2, 8, 0, device=cuda, dtype=bf16), gs)
    assert out.shape == (6, 8) and bool((out[:5] == 0).all()), "K = 0: zeros"
    out = mk.grouped_mm(torch.randn(6, 16, device=cuda, dtype=bf16), torch.randn(0, 8, 16, device=cuda, dtype=bf16),
                        torch.zeros(0, dtype=torch.int32, device=cuda))
    assert out.shape == (6, 8)
    dx = torch.ops.moe_kernels.grouped_mm_dgrad(torch.randn(6, 0, device=cuda, dtype=bf16),
                                                torch.randn(2, 0, 16, device=cuda, dtype=bf16), gs)
    assert dx.shape == (6, 16) and bool((dx == 0).all()), "N = 0: zero dx"
    x = torch.randn(0, 16, device=cuda, dtype=bf16)
    dw = torch.ops.moe_kernels.grouped_mm_wgrad(torch.randn(0, 8, device=cuda, dtype=bf16), x,
                                                torch.zeros(2, dtype=torch.int32, device=cuda))
    assert dw.shape == (2, 8, 16) and bool((dw == 0).all()), "no rows: zero dw"


def test_wgrad_without_rows(cuda):
    # M = 0 with TMA-friendly N and K, empty views at an offset into a buffer: dw is zeros and nothing
    # launches (the workspace and the launch must not see different pointers). Expected: the reference.
    gs = torch.tensor([0, 0, 0], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        buf = torch.randn(64, device=cuda, dtype=dtype)
        dout, x = buf[3:3].view(0, 16), buf[5:5].view(0, 32)
        dw = torch.ops.moe_kernels.grouped_mm_wgrad(dout, x, gs.to(cuda))
        assert_exact(dw.cpu(), grouped_mm_wgrad_reference(dout.cpu(), x.cpu(), gs), f"M = 0 wgrad {dtype}")
        w = torch.randn(3, 16, 32, device=cuda, dtype=dtype, requires_grad=True)
        xg = x.detach().requires_grad_()
        mk.grouped_mm(xg, w, gs.to(cuda)).sum().backward()
        assert xg.grad.shape == (0, 32) and bool((w.grad == 0).all()), f"M = 0 backward {dtype}"


def _sm90_or_skip(cuda):
    if cuda.type != "cuda" or torch.cuda.get_device_capability(cuda) != (9, 0) or not _ext._C.grouped_mm_has_sm90:
        pytest.skip("the sm_90a instances need an H100/H200 and a build with them")
    return _ext._C


@pytest.mark.parametrize("raster", [0, 1], ids=["along_m", "along_n"])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "rising", "empty", "single", "none"])
def test_every_sm90_instance(cuda, kind, raster):
    """Each bf16/fp16 instance of the tuning set (csrc/gemm/sm90_kernels.h), forced whatever the table says,
    against fp64 on one problem: odd M, rows past the groups, tiles straddling groups. Each instance also runs
    with its groups visited in expert order and largest first (group_order): the same bits, as each tile's
    reduction is the same."""
    from moe_kernels.ops.grouped_mm import _launch

    C = _sm90_or_skip(cuda)
    E, M, N, K = 8, 1003, 256, 384
    gs = splits(kind, M - 3, E, seed=5) if kind != "none" else torch.zeros(E, dtype=torch.int32)
    n = int(gs.sum())
    for i, spec in enumerate(C.grouped_mm_sm90_kernels()):
        dtype = {1: torch.float16, 2: torch.bfloat16}.get(spec["dtype"])
        if dtype is None:
            continue  # FP8: tests/ops/test_grouped_mm_fp8_gpu.py
        x = torch.randn(M, K, device=cuda).to(dtype)
        w = (torch.randn(E, N, K, device=cuda) / K**0.5).to(dtype)
        g = torch.randn(M, N, device=cuda).to(dtype)
        gsd = gs.to(cuda)
        op = ("fwd", "dgrad", "wgrad")[spec["op"]]
        a, b, shape = {"fwd": (x, w, (M, N)), "dgrad": (g, w, (M, K)), "wgrad": (g, x, (E, N, K))}[op]
        out = torch.full(shape, float("nan"), device=cuda, dtype=dtype)
        _launch(op, a, b, out, gsd, M, N, K, C, kernel=i, raster=raster)
        what = f"{spec['name']} raster={raster} {kind}"
        for group_order in (0, 1):
            again = torch.full(shape, float("nan"), device=cuda, dtype=dtype)
            _launch(op, a, b, again, gsd, M, N, K, C, kernel=i, raster=raster, group_order=group_order)
            assert torch.equal(again, out), f"{what} group_order={group_order}"
        x64, w64, g64 = x.double(), w.double(), g.double()
        if op == "fwd":
            if n:  # rows past the groups are unspecified
                ref, base = grouped_mm_reference(x64, w64, gsd), _loop_fwd(x, w, gs)
                assert_close_to_fp64(out[:n], base[:n], ref[:n], what, floor=1e-3)
        elif op == "dgrad":
            if n:
                ref, base = grouped_mm_dgrad_reference(g64, w64, gsd), _loop_bwd(g, x, w, gs)[0]
                assert_close_to_fp64(out[:n], base[:n], ref[:n], what, floor=1e-3)
            assert bool((out[n:] == 0).all()), f"{what}: rows past the groups must be zero"
        else:
            ref, base = grouped_mm_wgrad_reference(g64, x64, gsd), _loop_bwd(g, x, w, gs)[1]
            assert_close_to_fp64(out, base, ref, what, floor=1e-3)
            for e in (gs == 0).nonzero().flatten().tolist():
                assert bool((out[e] == 0).all()), f"{what}: empty group {e} must be zero"


@pytest.mark.parametrize("E", [1, 8, 256, 512, 513])
@pytest.mark.parametrize("kind", ["skewed", "rising", "empty", "ties", "past_m"])
def test_visit_order(cuda, E, kind):
    """The order the CUTLASS schedulers visit the groups in, as grouped_mm's own prepare kernel writes it on
    the device (GroupedParams::group_order): wgrad by default and group_order=1 the groups by their rows
    inside [0, M), largest first, ties in expert order; expert order for fwd and dgrad by default, with
    group_order=0, and past C.grouped_mm_max_ordered_groups (512) groups."""
    from moe_kernels.ops.grouped_mm import visit_order, visit_order_reference

    C = _ext.kernels("grouped_mm", torch.empty(1, device=cuda))
    if C is None:
        pytest.skip("no extension kernels on this device")
    assert C.grouped_mm_max_ordered_groups == 512
    M = 40 * E + 3
    if kind == "ties":  # a few distinct sizes, each held by many groups
        sizes = (torch.arange(E) * 7 % 3 * 5).to(torch.int32)
    elif kind == "past_m":  # the sizes sum past M: the groups at the end are clamped, some to 0
        sizes = splits("skewed", M, E, seed=E) * 2
    else:
        sizes = splits(kind, M, E, seed=E)
    gs = sizes.to(cuda)
    for op in ("fwd", "dgrad", "wgrad"):
        for group_order in (-1, 0, 1):
            got = visit_order(op, gs, M, 64, 96, group_order=group_order)
            want = visit_order_reference(op, gs, M, group_order)
            assert torch.equal(got.cpu(), want.cpu()), f"{op} group_order={group_order}"
            assert sorted(got.tolist()) == list(range(E)), "a permutation of the groups"
    if E > 1 and E <= 512 and kind == "rising":
        assert visit_order("wgrad", gs, M, 64, 96).tolist() != list(range(E)), "the order must change"


def test_group_order_is_checked(cuda):
    from moe_kernels.ops.grouped_mm import _launch

    C = _ext.kernels("grouped_mm", torch.empty(1, device=cuda))
    if C is None:
        pytest.skip("no extension kernels on this device")
    x = torch.randn(64, 128, device=cuda, dtype=torch.bfloat16)
    gs = torch.tensor([32, 32], dtype=torch.int32, device=cuda)
    out = torch.empty(2, 64, 128, device=cuda, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_order"):
        _launch("wgrad", x[:, :64], x, out, gs, 64, 64, 128, C, group_order=2)


def test_requested_instance_is_checked(cuda):
    C = _sm90_or_skip(cuda)
    from moe_kernels.ops.grouped_mm import _launch

    names = [k["name"] for k in C.grouped_mm_sm90_kernels()]
    x = torch.randn(64, 128, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(2, 64, 128, device=cuda, dtype=torch.bfloat16)
    gs = torch.tensor([32, 32], dtype=torch.int32, device=cuda)
    out = torch.empty(64, 64, device=cuda, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not serve fwd"):
        _launch("fwd", x, w, out, gs, 64, 64, 128, C, kernel=names.index("wgrad_bf16_coop_256x128x64_c1x1"))
    with pytest.raises(ValueError, match="raster"):
        _launch("fwd", x, w, out, gs, 64, 64, 128, C, raster=2)


def test_requested_instance_where_the_portable_kernel_runs(cuda):
    """The instance and raster order reach the extension: where no sm_90a kernel runs (the CPU-executed build,
    another GPU, fp32), asking for one is an error, not a silent portable run."""
    from moe_kernels.ops.grouped_mm import _launch

    C = _ext.kernels("grouped_mm", torch.empty(1, device=cuda))
    if C is None or (cuda.type == "cuda" and torch.cuda.get_device_capability(cuda) == (9, 0)):
        pytest.skip("sm_90a runs the instance (test_every_sm90_instance)")
    x = torch.randn(64, 128, device=cuda, dtype=torch.float32)
    w = torch.randn(2, 64, 128, device=cuda, dtype=torch.float32)
    gs = torch.tensor([32, 32], dtype=torch.int32, device=cuda)
    out = torch.empty(64, 64, device=cuda, dtype=torch.float32)
    with pytest.raises(ValueError, match="runs the portable kernel"):
        _launch("fwd", x, w, out, gs, 64, 64, 128, C, kernel=0)
    _launch("fwd", x, w, out, gs, 64, 64, 128, C)  # the table's choice: the portable kernel here
    assert torch.allclose(out, grouped_mm_reference(x, w, gs), rtol=1e-5, atol=1e-5)
