"""FSDP2 all-gathers of expert weights in E4M3: each rank quantizes its shard once per optimizer step and the
ranks gather the codes and scales, 1 byte per weight element instead of bf16's 2.

Under FSDP2 (torch.distributed.fsdp.fully_shard) an expert weight [E, N, K] is sharded along the experts, so
a rank's shard is E / world whole experts and the FP8 blockwise recipe's 128x128 tiles never cross shards.
`enable_fp8_all_gather(experts)`, called before `fully_shard`, makes w13 and w2 `Fp8ShardWeight`s: FSDP2's
all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`, the hook torchao's float8 training
uses) then asks the shard for its all-gather inputs, and the shard answers with its E4M3 codes and scales:
- the forward's gather sends the forward's tiles (codes [e, N, Kp], scales [e, N/128, K/128]);
- the backward's gather (FSDP2 reshards the experts after the forward and gathers them again when the
  backward reaches them) sends dgrad's transposed tiles (codes [e, K, Np], scales [e, K/128, N/128]).
Kp and Np are K and N rounded up to a multiple of 128 (the codes past them zero, as the GEMMs contract over
them: GPT-OSS's 2880 is none; N/128 and K/128 round up too), so the gathered codes go to the GEMMs as they are.
Where the two layouts' codes differ in size (N or K off 128) the backward's gather sends the forward's tiles
too (FSDP2 sizes each parameter's all-gather buffers once), and dgrad's are transposed from them on arrival.
Both come from one quantize_fp8_experts_dual pass over the shard, made on the first gather after the shard
changed (its version counter, bumped by the optimizer's in-place update, or an optimizer step since) and kept
until then: each weight is read for quantization once per step, 1/world of it per rank. The shard keeps
those codes between steps: 2 bytes per shard element plus 8 per 128x128 tile (what the weight cache holds
for a whole weight without FSDP2, here 1/world of it; `moe-train --plan` counts it).

The gathered parameter is an `Fp8GatheredWeight`: a tensor of the weight's shape and FSDP2's compute dtype
that holds the gathered codes and scales. The recipe (weight_cache.fp8_expert_weights) takes its tiles as
they are; the tiles of the other layout, where they were not gathered (a forward recomputed inside the
backward under activation checkpointing, or an FSDP unit that keeps its parameters gathered into the
backward), are transposed from them on the spot. Any other op on it runs on its dequantized values (the
values the FP8 GEMMs use). Gradients are plain tensors of the weight's dtype, reduce-scattered as FSDP2 does.

The codes equal those the recipe makes from FSDP2's gathered bf16 weight (the shard is cast to FSDP2's
param_dtype first, then quantized, tile by tile): training takes the same values with or without this, and
tests hold the two bit for bit. Requirements, checked by `fp8_all_gather_applies`: the FP8 blockwise recipe
with FP8 dgrad, N and K multiples of 16 (the recipe's own), plain (not DTensor) parameters and experts that
divide evenly over the FSDP ranks (FSDP2's extension takes no padding of differently shaped inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves, tree_map_only

from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_experts_dual

aten = torch.ops.aten
BLOCK = 128

# Ops that keep a shard a shard (FSDP2's sharding and padding, materialising from meta, moving, copying in):
# their results wrap the inner result. Every other op returns a plain tensor.
_KEEP_SHARD = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.clone.default, aten.detach.default, aten.alias.default,
    aten.empty_strided.default, aten.narrow.default, aten.chunk.default,
}

_generation = 0


def _bump_generation(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1


register_optimizer_step_post_hook(_bump_generation)


def _inplace(func) -> bool:
    return func._schema.name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                                  for a in func._schema.arguments[:1])


class Fp8ShardWeight(Tensor):
    """An expert weight (or its FSDP2 shard) in its own precision, whose FSDP2 all-gather sends E4M3 codes and
    scales. Every op runs on the values it wraps; see the module docstring."""

    _data: Tensor
    pow2_scale: bool

    @staticmethod
    def __new__(cls, data: Tensor, pow2_scale: bool = False):
        return Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                             storage_offset=data.storage_offset(), dtype=data.dtype,
                                             device=data.device, layout=data.layout,
                                             requires_grad=data.requires_grad)

    def __init__(self, data: Tensor, pow2_scale: bool = False):
        self._data = data
        self.pow2_scale = pow2_scale
        self._quantized: tuple | None = None  # (key, (q, scale, q_t, scale_t))

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"Fp8ShardWeight({self._data!r}, pow2_scale={self.pow2_scale})"

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, DCP's checkpoints) as the plain tensor it wraps: a checkpoint loads anywhere.
        return self._data.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_data"], {"pow2_scale": self.pow2_scale}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8ShardWeight(inner["_data"], meta["pow2_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pow2 = next(a.pow2_scale for a in tree_leaves((args, kwargs)) if isinstance(a, Fp8ShardWeight))
        out = func(*tree_map_only(Fp8ShardWeight, lambda t: t._data, args),
                   **tree_map_only(Fp8ShardWeight, lambda t: t._data, kwargs))
        if _inplace(func) and args and isinstance(args[0], Fp8ShardWeight):
            return args[0]
        if func in _KEEP_SHARD:
            return tree_map_only(Tensor, lambda t: Fp8ShardWeight(t, pow2), out)
        return out

    # FSDP2's all-gather extension
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if mesh is not None and mesh.size() < 2:
            raise RuntimeError("Fp8ShardWeight: FSDP2 over one rank copies a single all-gather input; gather this "
                               "weight in bf16 there (fp8_all_gather_applies says so)")
        if tuple(outer_size[1:]) != tuple(self.shape[1:]):
            raise RuntimeError(f"Fp8ShardWeight: the shard {tuple(self.shape)} of {tuple(outer_size)} is not whole "
                               "experts (FSDP2 must shard dim 0: the 128x128 tiles never cross experts)")
        dtype = mp_policy.param_dtype or self.dtype
        q, scale, q_t, scale_t = self.quantized(dtype)
        # Gathered by the backward (hooks the autograd engine runs): dgrad's tiles, where they are as large as the
        # forward's (FSDP2 sizes a parameter's all-gather buffers once); else the forward's, transposed on arrival.
        dgrad = torch._C._current_graph_task_id() != -1 and q_t.numel() == q.numel()
        return ((q_t, scale_t) if dgrad else (q, scale)), (dgrad, dtype)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        codes, scales = outputs
        transposed, _dtype = metadata
        if out is not None:
            out._set(codes, scales, transposed)
            return None
        shape = (codes.shape[0], *self.shape[1:])  # (the codes' rows may be zero-padded past K or N)
        # The codes and scales are views of FSDP2's all-gather outputs, which it frees and refills itself.
        return Fp8GatheredWeight(codes, scales, transposed, shape, param_dtype, self.pow2_scale), ()

    def quantized(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The shard's E4M3 tiles in both layouts (quantize_fp8_experts_dual of the shard cast to `dtype`, each
        layout's codes zero-padded to a multiple of 128 along its rows), made once per version of the shard and
        optimizer step."""
        d = self._data
        key = (self._version, d._version, d.data_ptr(), d.dtype, dtype, _generation)
        if self._quantized is None or self._quantized[0] != key:
            w = d.detach() if d.dtype == dtype else d.detach().to(dtype)
            self._quantized = (key, quantize_fp8_experts_dual(w, pow2_scale=self.pow2_scale, pad_to_block=True))
            stats["quantized"] += 1
        return self._quantized[1]


def _transpose_tiles(codes: Tensor, scales: Tensor, cols: int) -> tuple[Tensor, Tensor]:
    """The other layout of codes [E, rows, colsp] (zero-padded past `cols`) and their scales: codes [E, cols, rowsp],
    zero-padded past `rows`, written in one pass."""
    stats["transposed"] += 1
    E, rows = codes.shape[:2]
    out = codes.new_empty((E, cols, -(-rows // BLOCK) * BLOCK))
    out_u8 = out.view(torch.uint8)
    out_u8[..., :rows].copy_(codes.view(torch.uint8)[..., :cols].transpose(1, 2))
    out_u8[..., rows:].zero_()
    return out, scales.transpose(1, 2).contiguous()


class Fp8GatheredWeight(Tensor):
    """The gathered expert weight [E, N, K] (nominal dtype FSDP2's param_dtype): E4M3 codes and fp32 scales in
    the forward's layout or dgrad's transposed one, as the last all-gather sent them."""

    @staticmethod
    def __new__(cls, codes, scales, transposed, shape, dtype, pow2_scale):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scales, transposed, shape, dtype, pow2_scale):
        self.pow2_scale = pow2_scale
        self._set(codes, scales, transposed)

    def _set(self, codes: Tensor, scales: Tensor, transposed: bool) -> None:
        self._codes, self._scales, self._transposed = codes, scales, transposed

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return (f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"layout={'dgrad' if self._transposed else 'forward'})")

    def forward_tiles(self) -> tuple[Tensor, Tensor]:
        """(codes [E, N, Kp], scales [E, N/128, K/128]) as of now (Kp: K rounded up to 128, codes past K zero)."""
        if self._transposed:
            return _transpose_tiles(self._codes, self._scales, self.shape[1])
        return self._codes, self._scales

    def dgrad_tiles(self) -> tuple[Tensor, Tensor]:
        """(codes [E, K, Np], scales [E, K/128, N/128]) as of now (Np: N rounded up to 128, codes past N zero)."""
        if self._transposed:
            return self._codes, self._scales
        return _transpose_tiles(self._codes, self._scales, self.shape[2])

    def dequantized(self) -> Tensor:
        q, s = self.forward_tiles()
        E, N, K = self.shape
        Np, Kp = s.shape[1] * BLOCK, s.shape[2] * BLOCK
        rows = q.float() if N == Np else torch.nn.functional.pad(q.float(), (0, 0, 0, Np - N))
        blocks = rows.view(E, Np // BLOCK, BLOCK, Kp // BLOCK, BLOCK)
        scale = s[:, :, None, :, None]
        values = torch.where(scale == 0, torch.zeros((), device=q.device), blocks / scale)
        return values.view(E, Np, Kp)[:, :N, :K].to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default) or (
                func is aten.as_strided.default and tuple(args[1]) == tuple(args[0].shape)
                and tuple(args[2]) == tuple(args[0].stride()) and (len(args) < 4 or args[3] in (0, None))):
            t = args[0]
            return Fp8GatheredWeight(t._codes, t._scales, t._transposed, t.shape, t.dtype, t.pow2_scale)
        if _inplace(func) and args and isinstance(args[0], Fp8GatheredWeight):
            raise RuntimeError(f"{func}: an FP8-gathered expert weight is read-only between FSDP2's all-gathers; "
                               "change the sharded parameter instead")
        return func(*tree_map_only(Fp8GatheredWeight, lambda t: t.dequantized(), args),
                    **tree_map_only(Fp8GatheredWeight, lambda t: t.dequantized(), kwargs))


stats = {"quantized": 0, "transposed": 0}


def fp8_all_gather_applies(experts: nn.Module, recipe, shard_world: int) -> str | None:
    """None where `experts`' weights can be gathered in FP8 over `shard_world` FSDP ranks, else why not."""
    from moe_kernels.quant.recipe import Fp8BlockwiseRecipe

    if not isinstance(recipe, Fp8BlockwiseRecipe):
        return "the experts' recipe is not fp8-blockwise"
    if not recipe.fp8_dgrad:
        return "the recipe's dgrad is not FP8 (it reads the weight in bf16)"
    if shard_world < 2:
        return "one FSDP rank (nothing is gathered)"
    for name in ("w13", "w2"):
        w = getattr(experts, name, None)
        if not isinstance(w, nn.Parameter) or w.dim() != 3:
            return f"no 3-d expert weight {name}"
        if type(w.data) not in (Tensor, Fp8ShardWeight):
            return f"{name} is a {type(w.data).__name__}, not a plain tensor"
        E, N, K = w.shape
        if N % 16 or K % 16:
            return f"{name} is [{E}, {N}, {K}]: N and K must be multiples of 16 (the recipe's)"
        if E % shard_world:
            return f"{name}'s {E} experts do not divide evenly over {shard_world} FSDP ranks"
    return None


def enable_fp8_all_gather(experts: nn.Module, pow2_scale: bool = False) -> None:
    """Make `experts`' w13 and w2 Fp8ShardWeights, in place, before fully_shard (see the module docstring)."""
    for name in ("w13", "w2"):
        w = getattr(experts, name)
        if isinstance(w.data, Fp8ShardWeight):
            continue
        setattr(experts, name, nn.Parameter(Fp8ShardWeight(w.data, pow2_scale), requires_grad=w.requires_grad))
