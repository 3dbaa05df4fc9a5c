"""Gradient buffers a weight-gradient kernel may write into itself.

The trainer's master weights (moe_kernels.train.master) keep an fp32 main gradient per parameter and fold
each bf16 weight gradient into it from a post-accumulate-grad hook: the GEMM writes the gradient, the hook
reads it back and reads and writes the main gradient. A kernel that can add its fp32 accumulators into the
main gradient from its epilogue (grouped_mm_fp8_wgrad(..., out=, accumulate=)) skips both: it asks here for
the parameter's sink, writes into it, marks it, and gives autograd no gradient for that parameter (so no
hook runs and no bf16 gradient is ever written).

A sink is registered per parameter by its owner and is live only while the owner says so (the master
weights' `compute()`); outside, `sink_of` returns None and gradients flow as usual. Inside, a backward that
reaches such a kernel writes the main gradient whether or not that call asked for the parameter's gradient
(`torch.autograd.grad(loss, inputs)` adds the weight gradient there too); a sink holds its owner weakly.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


class GradSink(Protocol):
    def buffer(self) -> Tensor | None:
        """The fp32 buffer to write (the parameter's shape, contiguous), or None when not live."""

    def written(self) -> bool:
        """Whether this step already holds a gradient there (then add into it; else overwrite it)."""

    def mark(self) -> None:
        """Record that a gradient was written into the buffer."""


_sinks: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(param: Tensor, sink: GradSink) -> None:
    _sinks[param] = sink


def unregister(param: Tensor) -> None:
    _sinks.pop(param, None)


def sink_of(param: Tensor) -> GradSink | None:
    """The live sink of `param`, or None."""
    sink = _sinks.get(param)
    return sink if sink is not None and sink.buffer() is not None else None
