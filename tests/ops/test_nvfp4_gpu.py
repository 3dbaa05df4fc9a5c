"""NVFP4 quantization: GPU tier, CUDA kernels against the reference bit for bit."""

import pytest
import torch

import moe_kernels as mk
from moe_kernels.ops.quant import dequantize_nvfp4_reference, quantize_nvfp4_reference
from moe_kernels.testing import assert_exact
from tests.emulation import skip_if_too_large

pytestmark = pytest.mark.gpu
EMULATION_BUDGET = 2**22  # elements per case

SHAPES = [(0, 16), (1, 16), (7, 48), (17, 64), (130, 7168), (4096, 2048)]


def _input(M, K, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)
    if specials and M * K > 64:
        flat = x.view(-1)
        flat[16:32] = 0.0  # an all-zero block
        flat[40] = -0.0
        flat[50] = 1e-42
        flat[64:80] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties of the grid
    return x.to(dtype)


def _check(x_cpu, x_dev, what, **kw):
    dev_kw = {k: (v.to(x_dev.device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    p, sb, sg = mk.quantize_nvfp4(x_dev, **dev_kw)
    rp, rsb, rsg = quantize_nvfp4_reference(x_cpu, kw.get("global_amax"), kw.get("tile_2d", False), kw.get("rng"))
    assert_exact(sg.cpu(), rsg, f"{what} global scale")
    assert_exact(sb.cpu().view(torch.uint8), rsb.view(torch.uint8), f"{what} block scales")
    assert_exact(p.cpu(), rp, f"{what} codes")
    for dt in (torch.float32, torch.bfloat16):
        assert_exact(mk.dequantize_nvfp4(p, sb, sg, dtype=dt).cpu(), dequantize_nvfp4_reference(rp, rsb, rsg, dt),
                     f"{what} dequant {dt}")


@pytest.mark.parametrize("M,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["1d", "2d", "stochastic", "given_amax"])
def test_quantize_matches_reference(cuda, M, K, dtype, mode):
    skip_if_too_large(M * K, EMULATION_BUDGET, "elements")
    x = _input(M, K, dtype, seed=M + K, specials=True)
    kw = {"1d": {}, "2d": {"tile_2d": True}, "stochastic": {"rng": torch.tensor([2024, 77])},
          "given_amax": {"global_amax": torch.tensor(50.0)}}[mode]
    _check(x, x.to(cuda), f"{mode} {M}x{K} {dtype}", **kw)


def test_nan_and_inf(cuda):
    x = _input(4, 64, torch.float32, seed=1)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    _check(x, x.to(cuda), "non-finite")
    _check(x, x.to(cuda), "non-finite, given amax", global_amax=torch.tensor(10.0))


def test_misaligned_input_takes_the_scalar_path(cuda):
    x = _input(9, 64, torch.bfloat16, seed=3)
    base = torch.empty(x.numel() + 1, dtype=x.dtype, device=cuda)
    dev = base[1:].view(9, 64)
    dev.copy_(x.to(cuda))
    assert dev.data_ptr() % 16 != 0
    _check(x, dev, "misaligned")
    _check(x, dev, "misaligned, stochastic", rng=torch.tensor([5, 0]))


@pytest.mark.cuda_device
def test_rng_offset_read_on_device_in_cuda_graph(cuda):
    # The (seed, offset) pair is a device tensor: a captured graph reads it at every replay, so the caller
    # advances the offset between replays and gets fresh, reproducible draws.
    x = torch.full((32, 256), 1.2, device=cuda)
    x[:, ::16] = 6.0
    rng = torch.tensor([99, 0], device=cuda)
    amax = torch.tensor(2688.0, device=cuda)
    mk.quantize_nvfp4(x, global_amax=amax, rng=rng)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.quantize_nvfp4(x, global_amax=amax, rng=rng)
    seen = []
    for offset in (0, 8192, 16384):
        rng[1] = offset
        graph.replay()
        torch.cuda.synchronize()
        ref = quantize_nvfp4_reference(x.cpu(), amax.cpu(), False, torch.tensor([99, offset]))
        assert_exact(out[0].cpu(), ref[0], f"replay at offset {offset}")
        seen.append(out[0].clone())
    assert not torch.equal(seen[0], seen[1])


def test_deterministic(cuda):
    skip_if_too_large(4096 * 7168, EMULATION_BUDGET, "elements")
    x = torch.randn(4096, 7168, device=cuda, dtype=torch.bfloat16)
    first = mk.quantize_nvfp4(x)
    for _ in range(3):
        again = mk.quantize_nvfp4(x)
        assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
