"""Argument validation shared by every op: clear exceptions that name the argument, raised before
any kernel runs. Used by the references, the CUDA implementations and the fake implementations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CUDA_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: `{name}` must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: `{name}` must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: `{name}` is on {t.device}, expected {device} like the other inputs")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: `{name}` must be contiguous (call .contiguous() first), got strides {t.stride()}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: `{name}` must have shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def check_int(op: str, name: str, v, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        raise TypeError(f"{op}: `{name}` must be an int, got {type(v).__name__}")
    if v < minimum or (maximum is not None and v > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{op}: `{name}` must be {bound}, got {v}")


def check_cuda_dtype(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = CUDA_FLOAT_DTYPES) -> None:
    if t.dtype not in dtypes:
        raise TypeError(
            f"{op}: the CUDA kernel takes `{name}` in ({_dtype_names(dtypes)}), got {t.dtype}; "
            "fp64 runs on the CPU reference only"
        )
