"""Access to the compiled extension `moe_kernels._C` and the process-wide checking mode.

Emulation (`MOE_KERNELS_EMULATE=1`, or `=asan` for the AddressSanitizer build): the ops' CUDA
implementations also serve CPU tensors, running our CUDA kernels on the CPU through
`moe_kernels._C_emu` (tools/cuda_on_cpu), device 0, stream 0. It is test tooling: slow, and off
unless asked for. It never replaces `_C` for CUDA tensors.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from typing import NamedTuple

import torch
from torch._C import _functorch as _C_functorch
from torch.autograd import forward_ad as _forward_ad

try:
    from moe_kernels import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # built without CUDA, or not built at all
    _C = None
    _IMPORT_ERROR = str(exc)

_EMULATE = os.environ.get("MOE_KERNELS_EMULATE", "0").strip().lower()
_EMU_MODULES = {"1": "_C_emu", "true": "_C_emu", "asan": "_C_emu_asan"}
if _EMULATE in ("", "0", "false"):
    _EMU = None
elif _EMULATE in _EMU_MODULES:
    import importlib

    try:
        _EMU = importlib.import_module(f"moe_kernels.{_EMU_MODULES[_EMULATE]}")
    except ImportError as exc:
        raise ImportError(
            f"MOE_KERNELS_EMULATE={_EMULATE} needs moe_kernels.{_EMU_MODULES[_EMULATE]}, which is not built "
            f"({exc}); `pip install -e .` builds _C_emu when a C++ compiler and the CUDA headers are found "
            "(MOE_KERNELS_EMU_SANITIZE=1 adds _C_emu_asan)"
        ) from exc
else:
    raise ValueError(f"MOE_KERNELS_EMULATE must be 0, 1 or asan, got {_EMULATE!r}")

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


def extension():
    """The extension module the ops call: the CPU-executed one under MOE_KERNELS_EMULATE, else `_C`; None
    when neither is built."""
    return _EMU if _EMU is not None else _C


def has_cuda_kernels() -> bool:
    """True when the CUDA extension was compiled and imports."""
    return _C is not None


def import_error() -> str | None:
    return _IMPORT_ERROR


def emulation() -> str | None:
    """The module running CUDA kernels on CPU tensors (`_C_emu` or `_C_emu_asan`), None when off."""
    return _EMU.__name__.rsplit(".", 1)[-1] if _EMU is not None else None


_reference_mode = False


@contextlib.contextmanager
def reference_ops():
    """Inside, the ops on CPU tensors run their references even under emulation: how the GPU tier
    computes expected values (outside emulation the CPU always runs the references)."""
    global _reference_mode
    previous, _reference_mode = _reference_mode, True
    try:
        yield
    finally:
        _reference_mode = previous


def runs_references(t: torch.Tensor) -> bool:
    """True when ops on `t` run their references (a CPU tensor, outside emulation), which validate
    values on the host anyway; the kernels' callers only check values in the checking mode."""
    return t.device.type == "cpu" and (_EMU is None or _reference_mode)


_IMPLS: dict = {}  # custom op -> its CUDA implementation (cuda_impl), for `direct`


def cuda_impl(op):
    """Decorator: `fn` is `op`'s CUDA implementation; under emulation it also serves CPU tensors,
    except inside `reference_ops()`, where they get the op's own (reference) implementation."""

    def register(fn):
        op.register_kernel("cuda")(fn)
        _IMPLS[op] = fn
        if _EMU is not None:
            reference = op._init_fn  # the custom op's body: checks, then the reference

            @functools.wraps(fn)
            def on_cpu(*args, **kwargs):
                return reference(*args, **kwargs) if _reference_mode else fn(*args, **kwargs)

            op.register_kernel("cpu")(on_cpu)
        return fn

    return register


def set_checks(enabled: bool) -> None:
    """Checking mode: validate tensor *values* (indices, row maps) on the device before each kernel.

    It syncs with the host, so it is off by default; `MOE_KERNELS_CHECK=1` turns it on at import.
    """
    global _checks
    _checks = bool(enabled)


def checks_enabled() -> bool:
    return _checks


_device_ok: dict[int, bool] = {}
_driver: list[str | None] = []  # [why the driver cannot run the kernels, or None], once per process

_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver


def version_str(v: int) -> str:
    """CUDA's integer versions (12080) as "12.8"."""
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "none"


def driver_problem() -> str | None:
    """Why the installed NVIDIA driver cannot run the extension's CUDA runtime, or None when it can.

    `_C` links the CUDA runtime statically. Minor-version compatibility lets a 13.x runtime run on any
    13.0+ driver; an older major version (R535-R570 drivers are CUDA 12) cannot run it at all, and some
    systems only say so at the first runtime call (cudaErrorInsufficientDriver)."""
    if _C is None:
        return None
    if _driver:
        return _driver[0]
    runtime, driver = _C.cuda_runtime_version(), _C.cuda_driver_version()
    fix = (f"install an R580 or newer driver, or rebuild moe_kernels with a CUDA {driver // 1000}.x toolkit"
           if driver else "install an R580 or newer NVIDIA driver")
    reason = None
    if driver == 0:
        reason = f"no NVIDIA driver was found, and the kernels need one for CUDA {version_str(runtime)}: {fix}"
    elif driver // 1000 < runtime // 1000:
        reason = (f"the NVIDIA driver supports CUDA {version_str(driver)} but the kernels were built with CUDA "
                  f"{version_str(runtime)}: {fix}")
    else:
        probe = getattr(_C, "runtime_probe", None)
        if probe is not None and probe() == _INSUFFICIENT_DRIVER:
            reason = (f"the NVIDIA driver (CUDA {version_str(driver)}) is too old for the kernels' CUDA "
                      f"{version_str(runtime)} runtime (cudaErrorInsufficientDriver): {fix}")
    _driver.append(reason)
    return reason


def built_archs() -> list[str]:
    """The CUDA architectures the extension was compiled for, as CMake names them (`80-real`, `90a`,
    `120`: machine code and PTX, `120-virtual`: PTX only)."""
    return [a for a in _C.cuda_archs.split(",") if a] if _C is not None else []


_ARCH = re.compile(r"^(?:sm_|compute_)?(\d+)([af]?)(?:-(real|virtual))?$")


def parse_arch(arch: str) -> tuple[int, int, str, bool, bool]:
    """A CMake CUDA architecture -> (major, minor, variant "", "a" or "f", has machine code, has PTX).
    `90a` is 9.0 arch-specific with both; `100f-real` 10.0 family-specific machine code; `120-virtual` PTX."""
    m = _ARCH.match(arch.strip())
    if m is None:
        raise ValueError(f"unknown CUDA architecture {arch!r} (expected e.g. 80, 90a, 100f-real, 120-virtual)")
    number, variant, kind = int(m.group(1)), m.group(2), m.group(3)
    return number // 10, number % 10, variant, kind != "virtual", kind != "real"


def arch_runs_on(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether code built for any of `archs` runs on a GPU of `capability`, by CUDA's compatibility rules:
    - machine code for sm_XY runs on X.Y and the later minors of major X (sm_80 on 8.6 and 8.9, sm_100 on 10.3);
    - sm_XYa (arch-specific, machine code or PTX) only on X.Y itself;
    - sm_XYf (family-specific) on X.Y and the later minors of its major (sm_100f on 10.0 and 10.3);
    - PTX of compute_XY is compiled by the driver for any GPU of capability X.Y or later (compute_120 on 13.0).
    """
    major, minor = capability
    for arch in archs:
        x, y, variant, sass, ptx = parse_arch(arch)
        if variant == "a":
            if (x, y) == (major, minor):
                return True
        elif x == major and y <= minor and (sass or ptx):
            return True
        elif ptx and variant == "" and (x, y) <= (major, minor):
            return True
    return False


def describe_arch(arch: str) -> str:
    """`sm_80`, `sm_120 + PTX`, `PTX compute_120` for the report."""
    x, y, variant, sass, ptx = parse_arch(arch)
    name = f"{x}{y}{variant}"
    if sass and ptx:
        return f"sm_{name} + PTX"
    return f"sm_{name}" if sass else f"PTX compute_{name}"


def _device_supported(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_ok:
        _device_ok[index] = arch_runs_on(built_archs(), torch.cuda.get_device_capability(index))
    return _device_ok[index]


def extension_runs_on(device: torch.device) -> bool:
    """Whether the extension's kernels run on this CUDA device (built, a driver that runs its runtime, built
    for its architecture): `kernels`' rule without the warning, for choosing an implementation."""
    return _C is not None and driver_problem() is None and _device_supported(device)


def kernels(op: str, t: torch.Tensor):
    """The extension module, or None (after one warning) when `t`'s GPU must use the references:
    the extension is not built, the driver cannot run its CUDA runtime, or it was not built for this
    GPU's architecture."""
    global _warned_fallback
    if t.device.type == "cpu":  # only reached under emulation (cuda_impl)
        return _EMU
    reason = None
    if _C is None:
        reason = f"moe_kernels was installed without its CUDA extension ({_IMPORT_ERROR})"
    elif driver_problem() is not None:
        reason = driver_problem()
    elif not _device_supported(t.device):
        cc = torch.cuda.get_device_capability(t.device)
        reason = (
            f"the CUDA extension was built for {', '.join(describe_arch(a) for a in built_archs())}, "
            f"not this GPU (sm_{cc[0]}{cc[1]}); rebuild with MOE_KERNELS_CUDA_ARCHS"
        )
    if reason is None:
        return _C
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"{reason}: {op} and every other op run their PyTorch references on CUDA tensors (slow).",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


def launch_args(t: torch.Tensor) -> dict:
    """Device index and current stream of the tensor's device, as the extension takes them."""
    if t.device.type == "cpu":  # emulation: one device, one stream
        return {"device": 0, "stream": 0}
    return {"device": t.device.index, "stream": torch.cuda.current_stream(t.device).cuda_stream}


_WORKSPACE_ALIGN = 256


def workspace(nbytes: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A uint8 workspace of `nbytes` on `like`'s device and its 256-byte aligned address. CUDA's allocators
    align to at least 256 bytes; host memory (emulation) is padded to align."""
    pad = _WORKSPACE_ALIGN if like.device.type == "cpu" else 0
    ws = torch.empty(nbytes + pad, dtype=torch.uint8, device=like.device)
    p = ws.data_ptr() if ws.numel() else 0
    return ws, (p + _WORKSPACE_ALIGN - 1) // _WORKSPACE_ALIGN * _WORKSPACE_ALIGN if pad and p else p


_region_needs: dict[tuple, int] = {}  # workspace bytes last asked for, per region and shape


def with_workspace(key: tuple, fn, like: torch.Tensor, *args) -> None:
    """Calls a region entry `fn(*args, workspace, workspace_bytes, device, stream)` (the last two in `args`): with
    the size remembered for `key` first, again with the size it asks for when that was too small (the regions'
    convention, python_api/regions.cpp)."""
    *head, device, stream = args
    with_scratch(key, like, (), lambda parts, ws, nbytes: fn(*head, ws, nbytes, device, stream))


def with_scratch(key: tuple, like: torch.Tensor, sizes: tuple[int, ...], call) -> None:
    """The regions' workspace convention for an entry that also takes scratch: one allocation carved into parts of
    `sizes` bytes and the workspace; `call(parts' addresses, workspace address, workspace bytes)` returns 0 when it
    launched, else the workspace bytes it needs (remembered for `key`, so the steady state is one call). The
    allocation is held until the call has queued its launches."""
    nbytes = _region_needs.get(key, 0)
    while True:
        _, (*parts, ws) = carve(like, *sizes, nbytes)
        need = call(parts, ws, nbytes)
        if not need:
            return
        _region_needs[key] = nbytes = max(need, nbytes)


def carve(like: torch.Tensor, *nbytes: int, saved: bool = False) -> tuple[torch.Tensor, list[int]]:
    """One uint8 allocation on `like`'s device holding consecutive parts of `nbytes` bytes each, and each part's
    address (0 for an empty part): a region's scratch and saved tensors in one allocator call. Parts start at
    multiples of 256 bytes from an aligned start, as `workspace` aligns it; with `saved`, from the allocation's
    own start (256 bytes on CUDA, 64 on the CPU), so that a part sits at the same offset in any copy of it (the
    copy autograd makes when saved_tensors_hooks offload it, or a recomputed forward's allocation)."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total if n else -1)
        total += (n + _WORKSPACE_ALIGN - 1) // _WORKSPACE_ALIGN * _WORKSPACE_ALIGN
    if saved:
        buf = torch.empty(total, dtype=torch.uint8, device=like.device)
        base = buf.data_ptr() if total else 0
    else:
        buf, base = workspace(total, like)
    return buf, [base + o if o >= 0 else 0 for o in offsets]


def ptr(t: torch.Tensor | None) -> int:
    """Device address of a tensor, 0 for None or an empty tensor."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


_counters: dict[tuple[int, int], torch.Tensor] = {}
_captured_counters: list[torch.Tensor] = []


def counter(like: torch.Tensor, device: int, stream: int) -> int:
    """Address of a uint32 that is zero when a kernel starts: a kernel that picks its last block by an atomic
    ticket on it leaves it at zero again. Eagerly, one per (device, stream), kept for the process (launches on
    one stream are ordered, so they share it). Under CUDA-graph capture, a fresh one per captured launch whose
    zero fill is a node of the graph, so every replay starts from zero whichever graph replays first; kept
    alive for as long as a graph may replay it."""
    if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        c = torch.zeros((1,), dtype=torch.int32, device=like.device)
        _captured_counters.append(c)
        return c.data_ptr()
    key = (device, stream)
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = torch.zeros((1,), dtype=torch.int32, device=like.device)
    return c.data_ptr()


class Launch(NamedTuple):
    """Where an eager call's kernels run: the extension module, the device index and the stream handle."""

    C: object
    device: int
    stream: int


_ONNX_FLAGS = "torch.onnx._internal.exporter._flags"  # what moe_kernels.onnx.exporting() reads


def _transformed(t: torch.Tensor) -> bool:
    """Whether something around this call needs the registered op, for `eager` and `direct` alike: torch.compile,
    torch.export, ONNX export or jit tracing (fake implementations, decompositions), a torch.func transform
    (vmap, grad, functionalize: their wrapped tensors hold no data the kernels could read), a fake or subclass
    tensor, or the checking mode (it validates values first)."""
    if (type(t) is not torch.Tensor or _checks or torch.compiler.is_compiling()
            or _C_functorch.peek_interpreter_stack() is not None or torch.jit.is_tracing()):
        return True
    flags = sys.modules.get(_ONNX_FLAGS)
    return flags is not None and getattr(flags, "_is_onnx_exporting", False)


def eager(t: torch.Tensor) -> Launch | None:
    """The launch for an op called eagerly on `t`, resolved once per call chain; None where the registered op
    must run instead (`_transformed`), where the references run (CPU tensors outside emulation) and on a GPU
    the extension cannot serve."""
    if _transformed(t):
        return None
    if t.device.type != "cuda":  # the CPU (kernels only under emulation), meta, other backends
        return Launch(_EMU, 0, 0) if t.device.type == "cpu" and _EMU is not None and not _reference_mode else None
    C = kernels("moe_kernels", t)
    if C is None:
        return None
    return Launch(C, t.device.index, torch.cuda.current_stream(t.device).cuda_stream)


def direct(op, t: torch.Tensor, *args):
    """op(*args), its CUDA implementation called straight (no dispatcher, no custom-op wrapper: tens of
    microseconds of host work a call) where nothing needs the registered op: no autograd is being recorded
    (grad mode off, as inside the precision recipes' autograd functions, forward and backward), every tensor
    argument is a plain tensor on a device the kernels serve eagerly (`t`, the op's first tensor: a CUDA
    tensor, or the CPU under emulation), nothing transforms the ops (`_transformed`), and nothing observes them:
    no functional tensor, no forward-mode AD level (its tangents), no dispatch mode (a tracer such as make_fx,
    a FlopCounterMode, a selective-checkpoint policy: they see the registered op). The same code runs either
    way, so the results are the same bit for bit; ops that write into an argument are not called this way (the
    dispatcher bumps that argument's version counter)."""
    if (torch.is_grad_enabled() or _transformed(t)
            or (t.device.type != "cuda" and (t.device.type != "cpu" or _EMU is None or _reference_mode))
            or torch._C._len_torch_dispatch_stack() or _forward_ad._current_level >= 0
            or torch._is_functional_tensor(t)):
        return op(*args)
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) is not torch.Tensor:
            return op(*args)
    return _IMPLS[op](*args)


_sizes: dict[tuple, int] = {}


def size_of(C, name: str, *args) -> int:
    """C.<name>(*args) for the extension's pure size functions (chunk counts, workspace bytes), remembered per
    arguments: the hot path asks once per shape."""
    key = (name, *args)
    n = _sizes.get(key)
    if n is None:
        n = _sizes[key] = getattr(C, name)(*args)
    return n
