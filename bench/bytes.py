"""Byte model: the bytes every kernel of a computation reads and writes, counted on meta tensors.

The computation runs on the meta device (no memory, no kernels: each op's fake implementation gives its
outputs' shapes) under a TorchDispatchMode that sees every ATen op and every moe_kernels custom op with its
tensors. Each op that launches a kernel is one row:
  read     the bytes of its distinct tensor inputs (numel x element size; a view counts what it shows)
  written  the bytes of its outputs (an in-place op: its mutated arguments, each tensor of a list argument, and
           any output that is not one of them)
It is the compulsory traffic of each kernel: every operand once, as a kernel that keeps its tiles on chip
moves it (a GEMM's A and B read once, its output written once), so it is a lower bound of what the GPU moves
and the same count for every path. Ops that launch nothing are not rows: views (outputs that alias an
input: view, transpose, expand, slice, detach) and uninitialised allocations (empty, empty_like).
The registered custom ops are what the model counts: the fused eager regions, which launch the same kernels,
stand aside on meta tensors (`fused.launch_for` answers None off CUDA), so every kernel shows as one op. A
custom op is one kernel with its declared inputs and outputs: where its CUDA implementation runs more than
one kernel, the others are not seen (docs/benchmarks.md names them).
Shapes are the worst case the ops allocate without a host sync: with FP8's 128-row alignment every
row tensor has T*k + E*127 rows (rounded up to 128), so FP8 counts are upper bounds, BF16's exact.

Kinds: gemm (mm, the grouped GEMMs), kernel (the other moe_kernels ops and elementwise math), and the
passes that only move data: cast (a dtype change, `_to_copy`), copy/transpose (`clone`, `copy_`, `cat`; transpose
when its input is not contiguous), fill (zeros, ones, zero_, fill_), mask (masked_fill, where).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DATA_ONLY_KINDS = ("cast", "copy", "transpose", "fill", "mask")
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
_FILLS = {"zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full",
          "zero_", "fill_", "scalar_tensor"}
_MASKS = {"masked_fill", "masked_fill_", "where", "index_fill", "index_fill_"}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "linear"}


@dataclass
class Kernel:
    op: str  # "aten.mm", "moe_kernels.grouped_mm_fp8"
    kind: str
    read: int
    written: int
    shapes: str  # inputs -> outputs, for the table
    weights: tuple[str, ...] = ()  # the named weights it reads
    phase: str = ""

    @property
    def bytes(self) -> int:
        return self.read + self.written


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _kind(ns: str, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> str:
    if name in _FILLS:
        return "fill"
    if name in _MASKS:
        return "mask"
    if name in _GEMMS or (ns == "moe_kernels" and name.startswith("grouped_mm")):
        return "gemm"
    if name in ("_to_copy", "to", "type_as") and ins and outs:
        return "cast" if outs[0].dtype != ins[0].dtype else ("copy" if ins[0].is_contiguous() else "transpose")
    if name == "_foreach_copy_":
        return "cast" if ins[0].dtype != ins[-1].dtype else "copy"
    if name in ("clone", "copy_", "contiguous", "copy", "cat"):
        src = ins[-1] if name == "copy_" else ins[0]
        if name == "copy_" and outs and src.dtype != outs[0].dtype:
            return "cast"
        return "copy" if src.is_contiguous() else "transpose"
    return "kernel"


class ByteCounter(TorchDispatchMode):
    """Inside, every op that launches a kernel is appended to `kernels` (a Kernel). `weights` names tensors
    (by storage) whose reads are recorded in Kernel.weights; `phase` labels the rows appended next."""

    def __init__(self, weights: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.kernels: list[Kernel] = []
        self.phase = ""
        self._weights = {_storage(t): name for name, t in (weights or {}).items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func.namespace, func.overloadpacket.__name__
        if name in _NO_KERNEL:
            return out
        schema = func._schema
        aliased = [r.alias_info for r in schema.returns]
        if schema.returns and all(a is not None and not a.is_write for a in aliased):
            return out  # a view: launches nothing
        ins, seen = [], set()
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and id(a) not in seen:
                seen.add(id(a))
                ins.append(a)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # (a list argument, _foreach_copy_'s, writes each of its tensors)
        mutated = [t for a, arg in zip(args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write
                   for t in tree_leaves(a) if isinstance(t, torch.Tensor)]
        fresh = [t for t in outs if all(_storage(t) != _storage(m) for m in mutated)]
        kind = _kind(ns, name, ins, outs)
        # copy_ overwrites its destination (_foreach_copy_ each of its list), the copying weight quantization its
        # copy; the FP8 wgrad into a buffer reads it only when it accumulates.
        overwritten = {id(t) for t in tree_leaves(args[0])} if name in ("copy_", "_foreach_copy_") else (
            {id(args[1])} if name == "quantize_fp8_experts_dual_copy" else (
                {id(args[5])} if name == "grouped_mm_fp8_wgrad_into" and not args[6] else set()))
        read = 0 if kind == "fill" else sum(_nbytes(t) for t in ins if id(t) not in overwritten)
        written = sum(_nbytes(t) for t in mutated + fresh)  # an in-place op's output is its mutated argument
        weights = tuple(sorted({self._weights[_storage(t)] for t in ins
                                if _storage(t) in self._weights and id(t) not in overwritten}))
        shapes = " ".join(_shape(t) for t in ins) + " -> " + " ".join(_shape(t) for t in outs)
        self.kernels.append(Kernel(f"{ns}.{name}", kind, read, written, shapes, weights, self.phase))
        return out


def _shape(t: torch.Tensor) -> str:
    dt = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.uint8: "u8",
          torch.bool: "b"}.get(t.dtype, str(t.dtype).replace("torch.", ""))
    return f"{dt}[{','.join(map(str, t.shape))}]"


@dataclass
class Count:
    """One computation's kernels and their totals."""

    case: str
    kernels: list[Kernel]
    weight_reads: dict[str, int] = field(default_factory=dict)  # weight -> kernels that read it

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kernels:
            out[k.kind] = out.get(k.kind, 0) + k.bytes
        return out

    def data_only(self) -> list[Kernel]:
        """Kernels that only cast, copy, transpose, fill or mask."""
        return [k for k in self.kernels if k.kind in DATA_ONLY_KINDS]

    def to_json(self) -> dict:
        return {"case": self.case, "bytes": self.bytes, "launches": len(self.kernels), "by_kind": self.by_kind(),
                "weight_reads": self.weight_reads,
                "data_only": [f"{k.phase}: {k.op} {k.shapes} ({k.kind}, {k.bytes} B)" for k in self.data_only()],
                "kernels": [[k.phase, k.op, k.kind, k.read, k.written, k.shapes, list(k.weights)]
                            for k in self.kernels]}


@contextlib.contextmanager
def _weight_cache_on():
    """The FP8 weight cache on (as moe-train runs it), its previous state back after. Its entries are keyed
    by the parameters built here, so nothing of the caller's is hit or dropped."""
    from moe_kernels.quant import weight_cache

    was = weight_cache.enabled()
    weight_cache.enable(True)
    try:
        yield weight_cache
    finally:
        weight_cache.enable(was)


def _made_once(dtypes) -> None:
    """What the FP8 recipe makes once per process (the placeholders' 0-d zeros), made before counting: whether the
    counted step makes them would depend on what ran earlier in the process."""
    from moe_kernels.quant.recipe import _zero_scalar

    for dt in {*dtypes, torch.bfloat16, torch.float16, torch.float32}:
        _zero_scalar(dt, torch.device("meta"))


def layer(config, tokens: int, *, micro_batches: int = 1, dtype: torch.dtype = torch.bfloat16,
          master_weights: bool = False) -> Count:
    """MoELayer(config) fwd+bwd on [1, tokens, H] `dtype` (router fp32, as in training), `micro_batches`
    times with the gradients accumulated, then one optimizer step (the FP8 weight cache's generation bumped):
    the kernels of one optimizer step's layer work. The FP8 recipe runs with the weight cache on, as
    moe-train runs it. master_weights: as moe-train trains on CUDA without FSDP (moe_kernels.train.master):
    fp32 parameters with bf16 copies, each weight gradient folded into an fp32 main gradient by a hook, or
    written there by the kernel (the FP8 wgrad), and the copies rewritten after the step (counted)."""
    from moe_kernels.nn import MoELayer
    from moe_kernels.train.master import MasterWeights

    with torch.device("meta"):
        lay = MoELayer(config).to(torch.float32 if master_weights else dtype)
        lay.router.float()
        x = torch.empty(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
        dout = torch.empty(1, tokens, config.hidden_size, dtype=dtype)
    one = torch.ones((), device="meta")
    master = None
    if master_weights:
        master = MasterWeights(lay, {n for n, _ in lay.named_parameters() if n.startswith("router.")}, dtype)
    weights = {"w13": lay.experts.w13, "w2": lay.experts.w2}
    if master is not None:  # the kernels read the bf16 copies
        weights = {name: master.copies[next(i for i, p in enumerate(master.params) if p is w)]
                   for name, w in weights.items()}
    counter = ByteCounter(weights)
    _made_once([dtype])
    cache = _weight_cache_on() if config.recipe is not None else contextlib.nullcontext()
    with cache:
        if master is not None and config.recipe is not None:
            # A step before, counted apart and dropped: its write of the bf16 copies remakes the FP8 tiles
            # (weight_cache.refresh), so the counted step is a later one, whose forwards find their tiles made.
            _micro_batches(lay, x, dout, one, 1, master, ByteCounter())
            _step(config, master, ByteCounter())
        _micro_batches(lay, x, dout, one, micro_batches, master, counter)
        _step(config, master, counter)
    if master is not None:
        master.remove_hooks()
    return _count(f"layer x{micro_batches}", counter, weights)


def _micro_batches(lay, x, dout, one, n: int, master, counter: ByteCounter) -> None:
    with master.compute() if master is not None else contextlib.nullcontext():
        for mb in range(n):
            with counter:
                counter.phase = f"mb{mb} fwd"
                out, aux = lay(x)
                counter.phase = f"mb{mb} bwd"
                torch.autograd.backward((out, aux), (dout, one))
            x.grad = None


def _step(config, master, counter: ByteCounter) -> None:
    """The optimizer step's part that the model counts: the FP8 weight cache's generation bumped (as the
    optimizer's post-step hook does), then the masters' bf16 copies written (with the FP8 tiles)."""
    if config.recipe is not None:
        from moe_kernels.quant import weight_cache

        weight_cache._bump_generation()
    if master is not None:
        with counter:
            counter.phase = "step"
            master.write_compute_copies()


def expert_gemm(num_experts: int, n: int, k: int, rows: int, *, recipe=None, micro_batches: int = 1,
                dtype: torch.dtype = torch.bfloat16) -> Count:
    """One expert GEMM out = x @ w[e]^T per group (x [rows, k], w [E, n, k]) fwd+bwd (dx and dw), through
    `recipe.grouped_mm` (the weight cache on) or moe_kernels.ops.grouped_mm."""
    from moe_kernels.ops import grouped_mm

    with torch.device("meta"):
        x = torch.empty(rows, k, dtype=dtype, requires_grad=True)
        w = torch.empty(num_experts, n, k, dtype=dtype, requires_grad=True)
        sizes = torch.empty(num_experts, dtype=torch.int32)
        dout = torch.empty(rows, n, dtype=dtype)
    counter = ByteCounter({"w": w})
    _made_once([dtype])
    mm = recipe.grouped_mm if recipe is not None else grouped_mm
    with _weight_cache_on() if recipe is not None else contextlib.nullcontext():
        for mb in range(micro_batches):
            with counter:
                counter.phase = f"mb{mb} fwd"
                out = mm(x, w, sizes)
                counter.phase = f"mb{mb} bwd"
                out.backward(dout)
            x.grad = None
    return _count(f"expert gemm x{micro_batches}", counter, {"w": w})


def _count(case: str, counter: ByteCounter, weights: dict[str, torch.Tensor]) -> Count:
    reads = {name: sum(name in k.weights for k in counter.kernels) for name in weights}
    return Count(case, counter.kernels, reads)
