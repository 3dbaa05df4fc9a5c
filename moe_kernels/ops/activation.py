"""Fused activations for the experts: SwiGLU, out[r] = silu(h[r, :F]) * h[r, F:] (* row_weights[r]), and the
squared ReLU of experts without a gate, relu(h)^2 (`squared_relu`).

h is the [R, 2F] output of the w13 grouped GEMM (gate columns first). Routing weights, when given
per row, are applied here instead of in unpermute (one pass less over the expert outputs).

swiglu_quantize_fp8 is the forward for the FP8 blockwise recipe: the down projection's input written as E4M3
only, in the two layouts the recipe reads, from one read of h (no bf16 activation, no separate quantize
passes). Its reference is the composition it replaces, matched bit for bit:
    a = swiglu(h, row_weights)
    a_q, a_scale = quantize_fp8(a, "block", pad_to_block=True)  # [R, Fp], [R, Fp / 128]: the forward GEMM's operand
    a_t_q, a_t_scale = quantize_fp8_tokens(a)                   # [F, Rp], [F, Rp / 128]: wgrad's operand
swiglu_bwd_quantize_fp8 is its backward: dh written as E4M3 only, in the two layouts the up projection's
backward reads, from one read of dout and h; its reference, matched bit for bit:
    dh, drow_weights = swiglu_bwd(dout, h, row_weights)
    dh_q, dh_scale = quantize_fp8(dh, "block", pad_to_block=True)  # [R, Wp], [R, Wp / 128]: dgrad's operand
    dh_t_q, dh_t_scale = quantize_fp8_tokens(dh)                   # [2F, Rp], [2F, Rp / 128]: wgrad's operand
Fp and Wp are F and 2F rounded up to a multiple of 128 (the codes past them zero: the GEMMs contract over them),
Rp the rows; F need only be a multiple of 8 (GPT-OSS's 2880).
squared_relu_quantize_fp8 and squared_relu_bwd_quantize_fp8 are the same for experts without a gate: relu(h)^2,
or its backward's dh, written as E4M3 only in both layouts, F zero-padded to a multiple of 128 in the forward
blocks (Nemotron 3 Nano's 1856); their reference:
    v = squared_relu(h)                                         # or squared_relu's backward dh
    v_q, v_scale = quantize_fp8(v, "block", pad_to_block=True)  # [R, Fp], [R, Fp / 128]
    v_t_q, v_t_scale = quantize_fp8_tokens(v)                   # [F, Rp], [F, Rp / 128]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_kernels import _ext
from moe_kernels import onnx as _onnx
from moe_kernels.ops._checks import CUDA_FLOAT_DTYPES, FLOAT_DTYPES, check_cuda_dtype, check_shape, check_tensor
from moe_kernels.ops.quant import fp8_layouts_empty, fp8_layouts_reference, quantize_fp8


def _check(h: Tensor, row_weights: Tensor | None, op: str = "swiglu") -> None:
    check_tensor(op, "h", h, ndim=2, dtypes=FLOAT_DTYPES)
    if h.shape[1] % 2:
        raise ValueError(f"{op}: `h` must hold [gate | up] halves, got an odd width {h.shape[1]}")
    if row_weights is not None:
        check_tensor(op, "row_weights", row_weights, ndim=1, dtypes=FLOAT_DTYPES, device=h.device)
        check_shape(op, "row_weights", row_weights, (h.shape[0],), "one weight per row of h")


def _check_bwd(dout: Tensor, h: Tensor, row_weights: Tensor | None) -> None:
    _check(h, row_weights, "swiglu backward")
    check_tensor("swiglu backward", "dout", dout, ndim=2, dtypes=(h.dtype,), device=h.device)
    check_shape("swiglu backward", "dout", dout, (h.shape[0], h.shape[1] // 2), "[R, F], h being [R, 2F]")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_reference(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    f = h.shape[1] // 2
    gate, up = h[:, :f].to(_acc(h.dtype)), h[:, f:].to(_acc(h.dtype))
    out = F.silu(gate) * up
    if row_weights is not None:
        out = out * row_weights[:, None].to(out.dtype)
    return out.to(h.dtype)


def swiglu_bwd_reference(dout: Tensor, h: Tensor, row_weights: Tensor | None, need_dw: bool) -> tuple[Tensor, Tensor]:
    acc = _acc(h.dtype)
    f = h.shape[1] // 2
    gate, up, d = h[:, :f].to(acc), h[:, f:].to(acc), dout.to(acc)
    s = torch.sigmoid(gate)
    silu = gate * s
    scaled = d * row_weights[:, None].to(acc) if row_weights is not None else d
    dh = torch.cat([scaled * up * (s + gate * s * (1 - s)), scaled * silu], dim=1).to(h.dtype)
    dw = (d * silu * up).sum(-1) if need_dw else h.new_empty((0,), dtype=acc)
    return dh, dw


@torch.library.custom_op("moe_kernels::swiglu", mutates_args=())
def _swiglu(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    _check(h, row_weights)
    return swiglu_reference(h, row_weights)


@torch.library.custom_op("moe_kernels::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dout: Tensor, h: Tensor, row_weights: Tensor | None, need_dw: bool) -> tuple[Tensor, Tensor]:
    _check_bwd(dout, h, row_weights)
    return swiglu_bwd_reference(dout, h, row_weights, need_dw)


@_swiglu.register_fake
def _(h, row_weights=None):
    _check(h, row_weights)
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@_swiglu_bwd.register_fake
def _(dout, h, row_weights, need_dw):
    _check_bwd(dout, h, row_weights)
    return h.new_empty(h.shape), h.new_empty((h.shape[0],) if need_dw else (0,), dtype=_acc(h.dtype))


@_ext.cuda_impl(_swiglu)
def _swiglu_cuda(h, row_weights=None):
    _check(h, row_weights)
    check_cuda_dtype("swiglu", "h", h)
    C = _ext.kernels("swiglu", h)
    if C is None:
        return swiglu_reference(h, row_weights)
    out = h.new_empty((h.shape[0], h.shape[1] // 2))
    w = None if row_weights is None else row_weights.float().contiguous()
    C.swiglu_fwd(h=_ext.ptr(h), row_weights=_ext.ptr(w), out=_ext.ptr(out), rows=h.shape[0], ffn=h.shape[1] // 2,
                 dtype=_ext.dtype_code(h.dtype), **_ext.launch_args(h))
    return out


@_ext.cuda_impl(_swiglu_bwd)
def _swiglu_bwd_cuda(dout, h, row_weights, need_dw):
    _check_bwd(dout, h, row_weights)
    check_cuda_dtype("swiglu backward", "h", h)
    C = _ext.kernels("swiglu", h)
    if C is None:
        return swiglu_bwd_reference(dout, h, row_weights, need_dw)
    dh = torch.empty_like(h)
    dw = torch.empty((h.shape[0],) if need_dw else (0,), dtype=torch.float32, device=h.device)
    w = None if row_weights is None else row_weights.float().contiguous()
    C.swiglu_bwd(dout=_ext.ptr(dout), h=_ext.ptr(h), row_weights=_ext.ptr(w), dh=_ext.ptr(dh),
                 drow_weights=_ext.ptr(dw) if need_dw else 0, rows=h.shape[0], ffn=h.shape[1] // 2,
                 dtype=_ext.dtype_code(h.dtype), **_ext.launch_args(h))
    return dh, dw


def _setup(ctx, inputs, output):
    h, row_weights = inputs
    ctx.need_dw = row_weights is not None and ctx.needs_input_grad[1]
    ctx.w_dtype = None if row_weights is None else row_weights.dtype
    ctx.save_for_backward(h, row_weights)


def _backward(ctx, grad):
    h, row_weights = ctx.saved_tensors
    dh, dw = torch.ops.moe_kernels.swiglu_bwd(grad.contiguous(), h, row_weights, ctx.need_dw)
    return dh, (dw.to(ctx.w_dtype) if ctx.need_dw else None)


_swiglu.register_autograd(_backward, setup_context=_setup)


def swiglu(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    """[R, 2F] -> [R, F]: silu(gate) * up, times row_weights[r] when given; fp32 math, output in h's dtype."""
    if _onnx.exporting():
        return _onnx.swiglu_traceable(h, row_weights)
    return torch.ops.moe_kernels.swiglu(h, row_weights)


# ---------------------------------------------------------------------------------------------------
# Squared ReLU (experts without a gate: Nemotron-H's, Primer's)


def _check_squared_relu(h: Tensor) -> None:
    check_tensor("squared_relu", "h", h, dtypes=FLOAT_DTYPES)


def _check_squared_relu_bwd(dout: Tensor, h: Tensor) -> None:
    _check_squared_relu(h)
    check_tensor("squared_relu backward", "dout", dout, dtypes=(h.dtype,), device=h.device)
    check_shape("squared_relu backward", "dout", dout, h.shape, "the shape of h")


def squared_relu_reference(h: Tensor) -> Tensor:
    """relu(h)^2 in h's dtype, as torch's relu then square compute it (transformers' ReLUSquaredActivation)."""
    return torch.square(torch.relu(h))


def squared_relu_bwd_reference(dout: Tensor, h: Tensor) -> Tensor:
    """torch's backward of square(relu(h)): dout * (2 relu(h)) (2 relu(h) in h's dtype: inf in fp16 from 32768), zero
    wherever relu(h) <= 0 (even for an inf or NaN dout, as relu's backward masks), NaN where h is NaN."""
    r = torch.relu(h)
    return torch.where((r > 0) | r.isnan(), dout * (2 * r), torch.zeros_like(r))


@torch.library.custom_op("moe_kernels::squared_relu", mutates_args=())
def _squared_relu(h: Tensor) -> Tensor:
    _check_squared_relu(h)
    return squared_relu_reference(h)


@torch.library.custom_op("moe_kernels::squared_relu_bwd", mutates_args=())
def _squared_relu_bwd(dout: Tensor, h: Tensor) -> Tensor:
    _check_squared_relu_bwd(dout, h)
    return squared_relu_bwd_reference(dout, h)


@_squared_relu.register_fake
def _(h):
    _check_squared_relu(h)
    return torch.empty_like(h)


@_squared_relu_bwd.register_fake
def _(dout, h):
    _check_squared_relu_bwd(dout, h)
    return torch.empty_like(h)


@_ext.cuda_impl(_squared_relu)
def _squared_relu_cuda(h):
    _check_squared_relu(h)
    check_cuda_dtype("squared_relu", "h", h)
    C = _ext.kernels("squared_relu", h)
    if C is None:
        return squared_relu_reference(h)
    out = torch.empty_like(h)
    C.squared_relu_fwd(_ext.ptr(h), _ext.ptr(out), h.numel(), _ext.dtype_code(h.dtype), *_ext.launch_args(h).values())
    return out


@_ext.cuda_impl(_squared_relu_bwd)
def _squared_relu_bwd_cuda(dout, h):
    _check_squared_relu_bwd(dout, h)
    check_cuda_dtype("squared_relu backward", "h", h)
    C = _ext.kernels("squared_relu", h)
    if C is None:
        return squared_relu_bwd_reference(dout, h)
    dh = torch.empty_like(h)
    C.squared_relu_bwd(_ext.ptr(dout), _ext.ptr(h), _ext.ptr(dh), h.numel(), _ext.dtype_code(h.dtype),
                       *_ext.launch_args(h).values())
    return dh


def _setup_squared_relu(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward_squared_relu(ctx, grad):
    (h,) = ctx.saved_tensors
    return torch.ops.moe_kernels.squared_relu_bwd(grad.to(h.dtype).contiguous(), h)


_squared_relu.register_autograd(_backward_squared_relu, setup_context=_setup_squared_relu)


def squared_relu(h: Tensor) -> Tensor:
    """relu(h)^2 elementwise (a contiguous float tensor of any shape), one pass each way: bit for bit torch's
    `torch.square(torch.relu(h))` and its gradient, in every dtype (each product formed in fp32 and rounded to the
    dtype, as torch rounds it; relu is exact). The backward keeps h only (torch's keeps relu(h) as well)."""
    if _onnx.exporting():
        return _onnx.squared_relu_traceable(h)
    if not isinstance(h, Tensor):  # (the op checks the rest; the dispatcher would reject this less clearly)
        raise TypeError(f"squared_relu: `h` must be a torch.Tensor, got {type(h).__name__}")
    return torch.ops.moe_kernels.squared_relu(h)


# ---------------------------------------------------------------------------------------------------
# SwiGLU writing FP8 (the FP8 recipe's down-projection input)


def _check_fp8(h: Tensor, row_weights: Tensor | None) -> None:
    op = "swiglu_quantize_fp8"
    check_tensor(op, "h", h, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    _check(h, row_weights, op)
    _check_ffn_fp8(op, h)


def _check_ffn_fp8(op: str, h: Tensor) -> None:
    if (h.shape[1] // 2) % 8:
        raise ValueError(f"{op}: `h` is [R, 2F] with F = {h.shape[1] // 2}, which must be a multiple of 8 (16-byte "
                         "rows of gate and up)")


def swiglu_quantize_fp8_reference(
    h: Tensor, row_weights: Tensor | None = None, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_layouts_reference(swiglu_reference(h, row_weights), pow2_scale)


@torch.library.custom_op("moe_kernels::swiglu_quantize_fp8", mutates_args=())
def _swiglu_quantize_fp8(h: Tensor, row_weights: Tensor | None, pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_fp8(h, row_weights)
    return swiglu_quantize_fp8_reference(h, row_weights, pow2_scale)


@_swiglu_quantize_fp8.register_fake
def _(h, row_weights, pow2_scale):
    _check_fp8(h, row_weights)
    return fp8_layouts_empty(h, h.shape[0], h.shape[1] // 2)


@_ext.cuda_impl(_swiglu_quantize_fp8)
def _swiglu_quantize_fp8_cuda(h, row_weights, pow2_scale):
    _check_fp8(h, row_weights)
    C = _ext.kernels("swiglu_quantize_fp8", h)
    if C is None:
        return swiglu_quantize_fp8_reference(h, row_weights, pow2_scale)
    if h.dtype == torch.float32:  # a 128 x 128 fp32 tile does not fit the kernel's shared memory: the composition
        return torch.ops.moe_kernels.quantize_fp8_dual(torch.ops.moe_kernels.swiglu(h, row_weights), pow2_scale)
    w = None if row_weights is None else row_weights.float().contiguous()
    return swiglu_fp8_on(C, tuple(_ext.launch_args(h).values()), h, w, pow2_scale)


def swiglu_fp8_on(C, launch: tuple[int, int], h: Tensor, w: Tensor | None, pow2_scale: bool
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """swiglu_quantize_fp8's kernel on checked 16-bit rows h [R, 2F] and fp32 row weights w (or None), on extension
    C at `launch` (device, stream), for the op's implementation (the fused FP8 region launches the same kernel from
    python_api/regions_fp8.cpp)."""
    if h.data_ptr() % 16:
        h = h.clone()  # 16-byte loads of gate and up
    R, F = h.shape[0], h.shape[1] // 2
    q, scale, q_t, scale_t = out = fp8_layouts_empty(h, R, F)
    C.swiglu_fwd_fp8(_ext.ptr(h), _ext.ptr(w), _ext.ptr(q), _ext.ptr(scale), _ext.ptr(q_t), _ext.ptr(scale_t), R, F,
                     pow2_scale, _ext.dtype_code(h.dtype), *launch)
    return out


def swiglu_quantize_fp8(
    h: Tensor, row_weights: Tensor | None = None, *, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[R, 2F] (F % 8 == 0) -> (a_q [R, Fp] E4M3, a_scale [R, Fp / 128], a_t_q [F, Rp] E4M3, a_t_scale [F, Rp / 128])
    for a = swiglu(h, row_weights): the forward's 1x128 blocks along F (zero-padded to Fp = ceil(F / 128) * 128
    with zero codes) and wgrad's 1x128 blocks along the rows (Rp = R rounded up to 128, padding codes 0), bit for
    bit quantize_fp8(a, "block", pad_to_block=True) and quantize_fp8_tokens(a). No autograd (the FP8 recipe's
    function wraps it)."""
    return _ext.direct(_swiglu_quantize_fp8, h, h, row_weights, bool(pow2_scale))


# ---------------------------------------------------------------------------------------------------
# SwiGLU backward writing FP8 (the FP8 recipe's up-projection gradient)


def _check_bwd_fp8(dout: Tensor, h: Tensor, row_weights: Tensor | None) -> None:
    op = "swiglu_bwd_quantize_fp8"
    check_tensor(op, "h", h, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    _check(h, row_weights, op)
    check_tensor(op, "dout", dout, ndim=2, dtypes=(h.dtype,), device=h.device)
    check_shape(op, "dout", dout, (h.shape[0], h.shape[1] // 2), "[R, F] for h [R, 2F]")
    _check_ffn_fp8(op, h)


def swiglu_bwd_quantize_fp8_reference(
    dout: Tensor, h: Tensor, row_weights: Tensor | None = None, need_dw: bool = False, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dh, dw = swiglu_bwd_reference(dout, h, row_weights, need_dw)
    return (*fp8_layouts_reference(dh, pow2_scale), dw)


@torch.library.custom_op("moe_kernels::swiglu_bwd_quantize_fp8", mutates_args=())
def _swiglu_bwd_quantize_fp8(
    dout: Tensor, h: Tensor, row_weights: Tensor | None, need_dw: bool, pow2_scale: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_bwd_fp8(dout, h, row_weights)
    return swiglu_bwd_quantize_fp8_reference(dout, h, row_weights, need_dw, pow2_scale)


@_swiglu_bwd_quantize_fp8.register_fake
def _(dout, h, row_weights, need_dw, pow2_scale):
    _check_bwd_fp8(dout, h, row_weights)
    return (*fp8_layouts_empty(h, *h.shape), h.new_empty((h.shape[0],) if need_dw else (0,), dtype=torch.float32))


@_ext.cuda_impl(_swiglu_bwd_quantize_fp8)
def _swiglu_bwd_quantize_fp8_cuda(dout, h, row_weights, need_dw, pow2_scale):
    _check_bwd_fp8(dout, h, row_weights)
    C = _ext.kernels("swiglu_bwd_quantize_fp8", h)
    if C is None:
        return swiglu_bwd_quantize_fp8_reference(dout, h, row_weights, need_dw, pow2_scale)
    if h.dtype == torch.float32:  # a 128 x 128 fp32 tile does not fit the kernel's shared memory: the composition
        dh, dw = torch.ops.moe_kernels.swiglu_bwd(dout, h, row_weights, need_dw)
        return (*torch.ops.moe_kernels.quantize_fp8_dual(dh, pow2_scale), dw)
    R, W = h.shape
    dw = torch.empty((R,) if need_dw else (0,), dtype=torch.float32, device=h.device)
    w = None if row_weights is None else row_weights.float().contiguous()
    launch = _ext.launch_args(h)
    q, scale, q_t, scale_t = swiglu_bwd_fp8_on(C, tuple(launch.values()), dout, h, w, pow2_scale)
    if need_dw:  # swiglu_bwd's own reduction (bit for bit the composition's), dh not written; its vector width (so
        # its drow_weights reduction order) follows the pointers of dout and h as given
        C.swiglu_bwd(dout=_ext.ptr(dout), h=_ext.ptr(h), row_weights=_ext.ptr(w), dh=0, drow_weights=_ext.ptr(dw),
                     rows=R, ffn=W // 2, dtype=_ext.dtype_code(h.dtype), **launch)
    return q, scale, q_t, scale_t, dw


def swiglu_bwd_fp8_on(C, launch: tuple[int, int], dout: Tensor, h: Tensor, w: Tensor | None, pow2_scale: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """swiglu_bwd_quantize_fp8's kernel (dh in both E4M3 layouts, no row weights' gradient) on checked 16-bit dout
    [R, F] and h [R, 2F], fp32 row weights w (or None), on extension C at `launch` (device, stream), for the op's
    implementation (the fused FP8 region launches the same kernel from python_api/regions_fp8.cpp)."""
    h = h if h.data_ptr() % 16 == 0 else h.clone()  # 16-byte loads of gate, up and dout
    dout = dout if dout.data_ptr() % 16 == 0 else dout.clone()
    R, W = h.shape
    q, scale, q_t, scale_t = out = fp8_layouts_empty(h, R, W)
    C.swiglu_bwd_fp8(_ext.ptr(dout), _ext.ptr(h), _ext.ptr(w), _ext.ptr(q), _ext.ptr(scale), _ext.ptr(q_t),
                     _ext.ptr(scale_t), R, W // 2, pow2_scale, _ext.dtype_code(h.dtype), *launch)
    return out


def swiglu_bwd_quantize_fp8(
    dout: Tensor, h: Tensor, row_weights: Tensor | None = None, *, need_dw: bool = False, pow2_scale: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """swiglu's backward with dh [R, 2F] (F % 8 == 0) written in E4M3 only: (dh_q [R, Wp], dh_scale [R, Wp / 128],
    dh_t_q [2F, Rp], dh_t_scale [2F, Rp / 128], drow_weights [R] fp32, or [0] without `need_dw`): the up
    projection's dgrad operand (1x128 blocks along 2F, zero-padded to Wp = ceil(2F / 128) * 128 with zero codes)
    and its wgrad operand (1x128 blocks along the rows, Rp = R rounded up to 128, padding codes 0), bit for bit
    quantize_fp8(dh, "block", pad_to_block=True) and quantize_fp8_tokens(dh) for dh, drow_weights =
    swiglu_bwd(dout, h, row_weights). No autograd (the FP8 recipe's function calls it)."""
    _check_bwd_fp8(dout, h, row_weights)
    return _ext.direct(_swiglu_bwd_quantize_fp8, dout, dout, h, row_weights, bool(need_dw), bool(pow2_scale))


# ---------------------------------------------------------------------------------------------------
# Squared ReLU writing FP8, forward and backward (the FP8 recipe's down-projection input, and the up projection's
# output gradient, of experts without a gate)

ROWS_FP8_IDENTITY, ROWS_FP8_SQUARED_RELU, ROWS_FP8_SQUARED_RELU_BWD = 0, 1, 2  # the extension's rows_fp8 ops
_SQRELU_FP8 = "squared_relu_quantize_fp8"
_SQRELU_BWD_FP8 = "squared_relu_bwd_quantize_fp8"


def _check_squared_relu_fp8(op: str, h: Tensor, dout: Tensor | None = None) -> None:
    check_tensor(op, "h", h, ndim=2, dtypes=CUDA_FLOAT_DTYPES)
    if dout is not None:
        check_tensor(op, "dout", dout, ndim=2, dtypes=(h.dtype,), device=h.device)
        check_shape(op, "dout", dout, h.shape, "the shape of h")
    if h.shape[1] % 8:
        raise ValueError(f"{op}: `h` is [R, F] with F = {h.shape[1]}, which must be a multiple of 8 (16-byte rows)")


def squared_relu_quantize_fp8_reference(h: Tensor, pow2_scale: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_layouts_reference(squared_relu_reference(h), pow2_scale)


def squared_relu_bwd_quantize_fp8_reference(dout: Tensor, h: Tensor, pow2_scale: bool = False
                                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_layouts_reference(squared_relu_bwd_reference(dout, h), pow2_scale)


@torch.library.custom_op("moe_kernels::squared_relu_quantize_fp8", mutates_args=())
def _squared_relu_quantize_fp8(h: Tensor, pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_squared_relu_fp8(_SQRELU_FP8, h)
    return squared_relu_quantize_fp8_reference(h, pow2_scale)


@torch.library.custom_op("moe_kernels::squared_relu_bwd_quantize_fp8", mutates_args=())
def _squared_relu_bwd_quantize_fp8(dout: Tensor, h: Tensor, pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_squared_relu_fp8(_SQRELU_BWD_FP8, h, dout)
    return squared_relu_bwd_quantize_fp8_reference(dout, h, pow2_scale)


@_squared_relu_quantize_fp8.register_fake
def _(h, pow2_scale):
    _check_squared_relu_fp8(_SQRELU_FP8, h)
    return fp8_layouts_empty(h, *h.shape)


@_squared_relu_bwd_quantize_fp8.register_fake
def _(dout, h, pow2_scale):
    _check_squared_relu_fp8(_SQRELU_BWD_FP8, h, dout)
    return fp8_layouts_empty(h, *h.shape)


def _rows_fp8_cuda(op: str, code: int, x: Tensor, dout: Tensor | None, pow2_scale: bool, reference, composed):
    """The rows_fp8 kernel (`code`: its op) writing both E4M3 layouts of an elementwise value of x (and dout), or
    `reference()` off the kernels, `composed()` (the unfused ops, then both quantizations) for fp32."""
    C = _ext.kernels(op, x)
    if C is None:
        return reference()
    if x.dtype == torch.float32:  # a 128 x 128 fp32 tile does not fit the kernel's shared memory: the composition
        v = composed()
        return (*quantize_fp8(v, "block", pow2_scale=pow2_scale, pad_to_block=True),
                *torch.ops.moe_kernels.quantize_fp8_tokens(v, pow2_scale))
    return rows_fp8_on(C, tuple(_ext.launch_args(x).values()), code, x, dout, pow2_scale)


def rows_fp8_on(C, launch: tuple[int, int], code: int, x: Tensor, dout: Tensor | None, pow2_scale: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows_fp8 kernel (`code`: its op) on checked 16-bit x [R, C] (and dout), on extension C at `launch`
    (device, stream), for the ops' implementations (the fused FP8 region launches the same kernel from
    python_api/regions_fp8.cpp)."""
    x = x if x.data_ptr() % 16 == 0 else x.clone()  # 16-byte loads
    if dout is not None and dout.data_ptr() % 16:
        dout = dout.clone()
    q, scale, q_t, scale_t = out = fp8_layouts_empty(x, *x.shape)
    C.rows_fp8(code, _ext.ptr(x), _ext.ptr(dout), _ext.ptr(q), _ext.ptr(scale), _ext.ptr(q_t), _ext.ptr(scale_t),
               x.shape[0], x.shape[1], pow2_scale, _ext.dtype_code(x.dtype), *launch)
    return out


@_ext.cuda_impl(_squared_relu_quantize_fp8)
def _squared_relu_quantize_fp8_cuda(h, pow2_scale):
    _check_squared_relu_fp8(_SQRELU_FP8, h)
    return _rows_fp8_cuda(_SQRELU_FP8, ROWS_FP8_SQUARED_RELU, h, None, pow2_scale,
                          lambda: squared_relu_quantize_fp8_reference(h, pow2_scale),
                          lambda: torch.ops.moe_kernels.squared_relu(h))


@_ext.cuda_impl(_squared_relu_bwd_quantize_fp8)
def _squared_relu_bwd_quantize_fp8_cuda(dout, h, pow2_scale):
    _check_squared_relu_fp8(_SQRELU_BWD_FP8, h, dout)
    return _rows_fp8_cuda(_SQRELU_BWD_FP8, ROWS_FP8_SQUARED_RELU_BWD, h, dout, pow2_scale,
                          lambda: squared_relu_bwd_quantize_fp8_reference(dout, h, pow2_scale),
                          lambda: torch.ops.moe_kernels.squared_relu_bwd(dout, h))


def squared_relu_quantize_fp8(h: Tensor, *, pow2_scale: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[R, F] (F % 8 == 0) -> (a_q [R, Fp] E4M3, a_scale [R, Fp / 128], a_t_q [F, Rp] E4M3, a_t_scale [F, Rp / 128])
    for a = squared_relu(h), from one read of h: the down projection's forward operand (1x128 blocks along F, F
    zero-padded to Fp = ceil(F / 128) * 128 with zero codes) and its wgrad operand (1x128 blocks along the rows,
    Rp = R rounded up to 128, padding codes 0); bit for bit quantize_fp8(a, "block", pad_to_block=True) and
    quantize_fp8_tokens(a). No autograd (the FP8 recipe's function wraps it)."""
    _check_squared_relu_fp8(_SQRELU_FP8, h)
    return _ext.direct(_squared_relu_quantize_fp8, h, h, bool(pow2_scale))


def squared_relu_bwd_quantize_fp8(dout: Tensor, h: Tensor, *, pow2_scale: bool = False
                                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """squared_relu's backward with dh [R, F] written in E4M3 only, from one read of dout and h: (dh_q [R, Fp],
    dh_scale [R, Fp / 128], dh_t_q [F, Rp], dh_t_scale [F, Rp / 128]), the up projection's dgrad operand (F
    zero-padded to a multiple of 128) and its wgrad operand; bit for bit quantize_fp8(dh, "block",
    pad_to_block=True) and quantize_fp8_tokens(dh) of dh = squared_relu's backward. No autograd."""
    _check_squared_relu_fp8(_SQRELU_BWD_FP8, h, dout)
    return _ext.direct(_squared_relu_bwd_quantize_fp8, dout, dout, h, bool(pow2_scale))


# ---------------------------------------------------------------------------------------------------
# Both FP8 layouts of a tensor from one read (a GEMM operand and its wgrad copy, where no producer writes them)

_DUAL = "quantize_fp8_dual"


def _check_dual(t: Tensor) -> None:
    check_tensor(_DUAL, "t", t, ndim=2, dtypes=CUDA_FLOAT_DTYPES, contiguous=False)
    if t.shape[1] % 8:
        raise ValueError(f"{_DUAL}: `t` is [R, C] with C = {t.shape[1]}, which must be a multiple of 8 (16-byte rows)")


def quantize_fp8_dual_reference(t: Tensor, pow2_scale: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_layouts_reference(t.contiguous(), pow2_scale)


@torch.library.custom_op("moe_kernels::quantize_fp8_dual", mutates_args=())
def _quantize_fp8_dual(t: Tensor, pow2_scale: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_dual(t)
    return quantize_fp8_dual_reference(t, pow2_scale)


@_quantize_fp8_dual.register_fake
def _(t, pow2_scale):
    _check_dual(t)
    return fp8_layouts_empty(t, *t.shape)


@_ext.cuda_impl(_quantize_fp8_dual)
def _quantize_fp8_dual_cuda(t, pow2_scale):
    _check_dual(t)
    t = t.contiguous()
    return _rows_fp8_cuda(_DUAL, ROWS_FP8_IDENTITY, t, None, pow2_scale, lambda: quantize_fp8_dual_reference(t, pow2_scale),
                          lambda: t)


def quantize_fp8_dual(t: Tensor, *, pow2_scale: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[R, C] (C % 8 == 0) -> (q [R, Cp] E4M3, scale [R, Cp / 128], q_t [C, Rp] E4M3, scale_t [C, Rp / 128]) from one
    read of t: an FP8 GEMM's operand (1x128 blocks along C, zero-padded to Cp = ceil(C / 128) * 128) and its wgrad
    copy (1x128 blocks along the rows, transposed, Rp = R rounded up to 128, padding codes 0); bit for bit
    quantize_fp8(t, "block", pad_to_block=True) and quantize_fp8_tokens(t). For the FP8 recipe's operands that no
    producer writes (a dispatched expert input, the gradient a combine hands back). No autograd."""
    _check_dual(t)
    return _ext.direct(_quantize_fp8_dual, t, t, bool(pow2_scale))
