"""The GPU tier on the CPU-executed kernels (MOE_KERNELS_EMULATE=1): what it may skip, and why.

The CPU execution layer runs every CUDA thread as a fiber, so a kernel runs about a million times
slower than on an H100 (the portable GEMM does about 0.7 GFLOP/s). Cases past these budgets are
skipped under emulation with their size in the reason; the same cases run on a GPU.
"""

from __future__ import annotations

import pytest

from moe_kernels import _ext

EMULATED = _ext.emulation() is not None

# About a second of emulated work per op call.
MAX_EMULATED_FLOP = 5e8
MAX_EMULATED_ELEMENTS = 1 << 25


def skip_if_too_large(*, flop: float = 0.0, elements: float = 0.0, what: str = "") -> None:
    """Skip under emulation when a case exceeds the budget (a GEMM's FLOP, or elements moved)."""
    if not EMULATED:
        return
    if flop > MAX_EMULATED_FLOP:
        pytest.skip(f"too large to emulate: {flop / 1e9:.1f} GFLOP{' (' + what + ')' if what else ''}")
    if elements > MAX_EMULATED_ELEMENTS:
        pytest.skip(f"too large to emulate: {elements / 1e6:.0f} M elements{' (' + what + ')' if what else ''}")


def skip_if_emulated(reason: str) -> None:
    """Skip under emulation for one of the allowed reasons (the CUTLASS sm90 paths, CUDA graphs, several
    streams, device-mismatch checks)."""
    if EMULATED:
        pytest.skip(f"not emulated: {reason}")
