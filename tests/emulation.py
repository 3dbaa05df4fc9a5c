"""The GPU tier on the CPU-executed kernels (MOE_KERNELS_EMULATE=1): what it may skip, and why.

The CPU execution layer runs every CUDA thread as a fiber, so a kernel runs about a million times
slower than on an H100. Each test file states a budget for its cases (in its own unit: logits, elements
moved, GEMM FLOP); a case past it is skipped under emulation with its size in the reason. The same
cases run on a GPU, and smaller cases of the same code paths run under emulation.
"""

from __future__ import annotations

import pytest

from moe_kernels import _ext

EMULATED = _ext.emulation() is not None
# MOE_KERNELS_EMULATE=asan: the kernels built with AddressSanitizer + UBSan (_C_emu_asan), several times slower again.
SANITIZED = _ext.emulation() == "_C_emu_asan"


def skip_if_too_large(size: float, budget: float, what: str) -> None:
    """Skip under emulation when `size` (of `what`) exceeds the file's emulation budget."""
    if EMULATED and size > budget:
        pytest.skip(f"too large to emulate: {what} = {size:.3g} > {budget:.3g}")


def skip_if_sanitized_and_large(size: float, budget: float, what: str) -> None:
    """Skip on the sanitized kernels when `size` exceeds `budget`: for a file's variants of a large case (an empty
    or a single group) whose memory accesses its smaller cases and the large shape's uniform case check there
    already. Every case still runs in the emulated tier, without the sanitizers."""
    if SANITIZED and size > budget:
        pytest.skip(f"a variant too large for the sanitized kernels: {what} = {size:.3g} > {budget:.3g} (the "
                    "emulated tier runs it)")


def skip_if_sanitized(reason: str) -> None:
    """Skip on the sanitized kernels only: a variant whose memory accesses another case checks there already (the
    reason says which). It still runs in the emulated tier, without the sanitizers."""
    if SANITIZED:
        pytest.skip(f"not on the sanitized kernels: {reason} (the emulated tier runs it)")


def skip_if_emulated(reason: str) -> None:
    """Skip under emulation for one of the allowed reasons (the CUTLASS sm90 paths, CUDA graphs, several
    streams, device-mismatch checks)."""
    if EMULATED:
        pytest.skip(f"not emulated: {reason}")


def misaligned_copy(t, device):
    """A copy of `t` on `device` that does not start on 16 bytes (a view one element into a larger buffer): the
    kernels' scalar paths, or their copy to an aligned buffer."""
    import torch

    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    x = base[1:].view(t.shape)
    x.copy_(t.to(device))
    assert x.data_ptr() % 16 != 0
    return x
