"""bf16 compute parameters with fp32 master weights and fp32 main gradients, for the trainer's paths without
FSDP (one process, and the expert-parallel replicas of moe_kernels.train.distributed).

Megatron-Core's and NeMo's recipe: the forward and backward run on bf16 parameters (no autocast, so no cast of
the weights per forward); each weight gradient is added into an fp32 main gradient as soon as autograd has
produced it (one fused add a parameter, from a post-accumulate-grad hook, so the bf16 gradient is freed at
once and accumulation over micro-batches happens in fp32; a kernel that can add its fp32 product into the main
gradient itself, the FP8 recipe's wgrad, does so from its epilogue through moe_kernels.nn.grad_sink, and no bf16
gradient is written); the optimizer (torch's AdamW, fused on CUDA) steps
on the fp32 masters with the fp32 gradients, and one `torch._foreach_copy_` then writes the bf16 copies.

At rest (outside `compute()`) every parameter holds its fp32 master and, after a backward, its fp32 main
gradient as `.grad`: the optimizer, clipping, the expert-parallel gradient reduction, checkpoints (the model's
and the optimizer's state dicts) and the transformers export see fp32 values, as without this helper, so a
resume is bit-identical and the export writes the masters. Inside `compute()` the parameters hold their bf16
copies. Parameters the model keeps in fp32 whatever its dtype (the routers: `build_model(cfg, dtype=bf16)`'s
per-parameter policy) are left alone: they compute, and take their gradients, in fp32.

Under FSDP2 (moe_kernels.parallel.parallelize) the same split is FSDP's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32): fp32 sharded masters and gradients, bf16 gathered parameters, routers in fp32 units.

Bytes a parameter (moe_kernels.parallel.plan, master_weights=True): fp32 master 4 + bf16 copy 2 + fp32 main
gradient 4 + AdamW 8, and one bf16 gradient at a time until its hook folds it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor, nn

from moe_kernels.nn import grad_sink
from moe_kernels.quant import weight_cache


def fp32_parameter_names(model_config) -> set[str]:
    """The parameters `build_model(model_config, dtype=bf16)` keeps in fp32 (the routers)."""
    from moe_kernels.models import build_model

    meta = build_model(model_config, device="meta", dtype=torch.bfloat16)
    return {name for name, p in meta.named_parameters() if p.dtype != torch.bfloat16}


class MasterWeights:
    """bf16 compute copies of `model`'s fp32 parameters (but those named in `keep_fp32`) and their fp32 main
    gradients (module docstring). Use:

        with master.compute():          # the parameters hold their bf16 copies
            for batch in micro_batches:
                loss(batch).backward()  # each bf16 weight gradient added into its fp32 main gradient
        clip(model); optimizer.step()   # fp32 masters, fp32 gradients
        master.write_compute_copies()   # masters -> bf16 (and the FP8 weight cache's tiles)
    """

    def __init__(self, model: nn.Module, keep_fp32: set[str] = frozenset(), dtype: torch.dtype = torch.bfloat16,
                 kernels_accumulate: bool = True):
        self.dtype = dtype
        # Weight-gradient kernels that can add into the fp32 main gradient from their epilogue do (the FP8
        # recipe's wgrad): no bf16 gradient written, no hook, fp32 accumulation of the products themselves.
        self.kernels_accumulate = kernels_accumulate
        self.params: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            if not p.requires_grad or name in keep_fp32 or not p.is_floating_point():
                continue
            if p.dtype != torch.float32:
                raise ValueError(f"MasterWeights: {name} is {p.dtype}; the masters are the fp32 parameters")
            self.params.append(p)
        self.copies: list[Tensor] = [p.detach().to(dtype) for p in self.params]
        self.main_grads: list[Tensor] = [torch.empty_like(p) for p in self.params]
        self._touched: list[bool] = [False] * len(self.params)  # a gradient arrived in this step
        self._active = False
        self._handles = [p.register_post_accumulate_grad_hook(self._folder(i)) for i, p in enumerate(self.params)]
        # Kernels that accumulate a weight gradient into its main gradient themselves (the FP8 recipe's wgrad,
        # moe_kernels.nn.grad_sink) find it here while compute() is active.
        for i, p in enumerate(self.params):
            grad_sink.register(p, _MainGradSink(self, i))

    def _folder(self, i: int):
        @torch.no_grad()
        def fold(p: Tensor) -> None:
            # (No gradient: a kernel wrote it into the main gradient itself, through the sink, and gave autograd
            # none; autograd still runs the hook.)
            if not self._active or p.grad is None:
                return
            # fp32 accumulation: a bf16 sum over micro-batches would keep 8 bits of each.
            if self._touched[i]:
                self.main_grads[i].add_(p.grad)
            else:
                self.main_grads[i].copy_(p.grad)
                self._touched[i] = True
            p.grad = None  # the bf16 gradient is freed now, not at the step

        return fold

    @contextlib.contextmanager
    def compute(self):
        """The parameters hold their bf16 copies inside; on exit the fp32 masters again, with the main gradients
        of this step's backward passes as `.grad` (parameters that got none keep None, as without the helper)."""
        if self._active:
            raise RuntimeError("MasterWeights.compute() is not reentrant")
        masters = [p.data for p in self.params]  # read now: a checkpoint load may have replaced them
        for p, copy in zip(self.params, self.copies):
            p.grad = None
            p.data = copy
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for i, (p, master) in enumerate(zip(self.params, masters)):
                p.data = master
                p.grad = self.main_grads[i] if self._touched[i] else None
            self._touched = [False] * len(self.params)

    @torch.no_grad()
    def write_compute_copies(self) -> None:
        """bf16 copies <- fp32 masters (after each optimizer step, and after loading a checkpoint). Written through
        the parameters, so their version counters move: a cache keyed on them (moe_kernels.quant.weight_cache)
        sees the change. Expert weights the FP8 recipe reads through that cache are written by the pass that
        quantizes them (weight_cache.refresh: the master read once, the copy and both layouts of its codes
        written); the rest by one foreach copy."""
        if not self.params:
            return
        masters = [p.data for p in self.params]
        for p, copy in zip(self.params, self.copies):
            p.data = copy
        try:
            rest = [(p, m) for p, m in zip(self.params, masters) if not weight_cache.refresh(p, m)]
            if rest:
                torch._foreach_copy_([p for p, _ in rest], [m for _, m in rest])
        finally:
            for p, master in zip(self.params, masters):
                p.data = master

    def bytes(self) -> tuple[int, int]:
        """(bf16 copies, fp32 main gradients) held besides the parameters."""
        return (sum(t.numel() * t.element_size() for t in self.copies),
                sum(t.numel() * t.element_size() for t in self.main_grads))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self.params:
            grad_sink.unregister(p)


class _MainGradSink:
    """Parameter i's fp32 main gradient as a kernel's output (moe_kernels.nn.grad_sink), live inside compute().
    It holds its MasterWeights weakly: the registry's values must not keep their parameter keys alive."""

    def __init__(self, master: MasterWeights, i: int):
        self.master, self.i = weakref.ref(master), i

    def buffer(self) -> Tensor | None:
        m = self.master()
        return m.main_grads[self.i] if m is not None and m._active and m.kernels_accumulate else None

    def written(self) -> bool:
        return self.master()._touched[self.i]

    def mark(self) -> None:
        self.master()._touched[self.i] = True
