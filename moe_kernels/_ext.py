"""Access to the compiled extension `moe_kernels._C` and the process-wide checking mode."""

from __future__ import annotations

import os
import warnings

import torch

try:
    from moe_kernels import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # built without CUDA, or not built at all
    _C = None
    _IMPORT_ERROR = str(exc)

_DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.uint8: 5,
}

_checks = os.environ.get("MOE_KERNELS_CHECK", "0") not in ("", "0")
_warned_fallback = False


def has_cuda_kernels() -> bool:
    """True when the CUDA extension was compiled and imports."""
    return _C is not None


def import_error() -> str | None:
    return _IMPORT_ERROR


def set_checks(enabled: bool) -> None:
    """Checking mode: validate tensor *values* (indices, row maps) on the device before each kernel.

    It syncs with the host, so it is off by default; `MOE_KERNELS_CHECK=1` turns it on at import.
    """
    global _checks
    _checks = bool(enabled)


def checks_enabled() -> bool:
    return _checks


def kernels(op: str):
    """The extension module, or None (after one warning) when CUDA tensors must use the references."""
    global _warned_fallback
    if _C is None and not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"moe_kernels was installed without its CUDA extension ({_IMPORT_ERROR}); "
            f"{op} and every other op run their PyTorch references on CUDA tensors (slow). "
            "Reinstall with nvcc available to build the kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _C


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


def launch_args(t: torch.Tensor) -> dict:
    """Device index and current stream of the tensor's device, as the extension takes them."""
    return {"device": t.device.index, "stream": torch.cuda.current_stream(t.device).cuda_stream}


def ptr(t: torch.Tensor | None) -> int:
    """Device address of a tensor, 0 for None or an empty tensor."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()
