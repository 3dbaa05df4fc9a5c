"""Expert weights quantized once per optimizer step: the FP8 codes and scales of the forward's 128x128
tiles, and the transposed tiles dgrad reads, kept per parameter until the parameter changes. Where dgrad
runs in FP8, both layouts come from one kernel (quantize_fp8_experts_dual: one read of the weight, the
codes written twice), so no transpose pass over the codes follows.

Without it the FP8 recipe re-quantizes every expert weight in every forward (a read of the weight in its
own precision and a write of its codes in both layouts). A training
step of N micro-batches, each maybe recomputed under activation checkpointing, reads each weight for
quantization once with the cache, N to 2N times without it.

An entry is valid while all of these hold, checked on every lookup (a few attribute reads, no sync):
- the parameter's version counter is unchanged (every in-place change bumps it: the optimizer's update,
  `copy_`, `load_state_dict`, a `.mul_` under `no_grad`),
- its storage is where it was (`data_ptr`) with the same shape, strides and dtype,
- no optimizer has stepped since it was made: a post-step hook on every torch.optim optimizer bumps a
  global generation, which covers parameters whose update lands elsewhere first (FSDP2 updates the
  sharded parameter and refills the unsharded one by all-gather),
- the recipe option that shapes the codes (`pow2_scale`) is the same.
Entries are made and used only where a backward is in view (grad mode on and the weight requiring
grad): under `no_grad`, `inference_mode` or for frozen experts the weight is quantized afresh and
nothing is kept.

The cache is off until `enable()`: it is exact only where every change of a weight between optimizer steps
bumps its version counter. FSDP2 refills its unsharded parameters by all-gather with the version counter
preserved (torch.autograd._unsafe_preserve_version_counter), so an in-place change of a shard outside an
optimizer step (a checkpoint load into a live model, a manual edit) would go unseen there. moe-train enables
it on its paths without FSDP2 (one process, expert parallelism). Under FSDP2, parallelize() has each rank
quantize its shard once per step and gather the codes (moe_kernels.quant.fsdp_fp8): the gathered parameter
carries its tiles, taken here as they are; where that does not apply, the gathered bf16 weights are quantized
in every forward, as without the cache. With fp32 master weights (moe_kernels.train.master) the step's
write of the bf16 copies remakes the entries in the same pass (`refresh`): the master read once, the copy and
both layouts of its codes written, so no forward quantizes. Entries hold a weak reference to their parameter, so a dropped model frees them. The
cache holds 2 bytes per expert weight element (the codes in both layouts; a layout whose rows are no multiple of 128
long is held zero-padded to one, `Fp8Weights.gemm_tiles`) plus 2 x 4 bytes per 128x128
tile of scales between steps; `clear()` drops every entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from moe_kernels.ops.grouped_mm_fp8 import quantize_fp8_experts, quantize_fp8_experts_dual
from moe_kernels.ops.quant import BLOCK, pad_codes_to_block
from moe_kernels.quant.fsdp_fp8 import Fp8GatheredWeight

_generation = 0
_enabled = False
_lock = threading.Lock()
_entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
_stats = {"quantized": 0, "transposed": 0, "hits": 0, "refreshed": 0, "padded": 0, "pad_copies": 0}


def _bump_generation(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1


register_optimizer_step_post_hook(_bump_generation)


@dataclass
class Fp8Weights:
    """One expert weight [E, N, K] in E4M3: `q` [E, N, K] with `scale` [E, ceil(N/128), K/128] (the forward's
    tiles), and `qt` [E, K, N] with `scale_t` [E, K/128, ceil(N/128)] (dgrad's; a 128x128 tile is its own
    transpose, so these are the same codes and scales laid out the other way): made with the forward's by
    quantize_fp8_experts_dual when dgrad was in view, else transposed from them on first use."""

    q: Tensor
    scale: Tensor
    qt: Tensor | None = None
    scale_t: Tensor | None = None
    key: tuple = field(default=(), repr=False)
    padded: dict = field(default_factory=dict, repr=False)  # "q" / "qt": their codes zero-padded (gemm_tiles)

    def transposed(self) -> tuple[Tensor, Tensor]:
        if self.qt is None:
            self.qt = self.q.transpose(1, 2).contiguous()
            self.scale_t = self.scale.transpose(1, 2).contiguous()
            _stats["transposed"] += 1
        return self.qt, self.scale_t

    def gemm_tiles(self, transposed: bool) -> tuple[Tensor, Tensor]:
        """grouped_mm_fp8's weight operand: the stored layout's tiles (`transposed` False) or dgrad's, with the
        codes' rows zero-padded to a multiple of 128 where their length is none (the scales already cover the
        last partial tile): [E, rows, ceil(cols / 128) * 128]. Written padded by the quantization that made both
        layouts (`_dual_entry`); otherwise padded here by a copy, once per entry. The unpadded layout is a view
        of the padded codes, so the codes are held once."""
        name = "qt" if transposed else "q"
        q, scale = self.transposed() if transposed else (self.q, self.scale)
        cols = q.shape[-1]
        if cols % BLOCK == 0:
            return q, scale
        p = self.padded.get(name)
        if p is None:
            p = pad_codes_to_block(q)
            self.padded[name] = p
            _stats["padded"] += 1
            _stats["pad_copies"] += 1
            if getattr(self, name) is q:
                setattr(self, name, p[..., :cols])
        return p, scale


def _key(w: Tensor, pow2_scale: bool) -> tuple:
    return (w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device, pow2_scale, _generation)


def enable(on: bool = True) -> None:
    """Turn the cache on (or off, dropping every entry): only where weights change through optimizer steps or
    version-bumping in-place ops between forwards (module docstring: not under FSDP2)."""
    global _enabled
    _enabled = bool(on)
    if not _enabled:
        clear()


def enabled() -> bool:
    return _enabled


def cacheable(w: Tensor) -> bool:
    """Whether a lookup for `w` may use and keep an entry (decided outside autograd functions, whose forward
    runs with grad mode off): the cache is on, a backward is in view, and the weight is a plain tensor."""
    return (_enabled and torch.is_grad_enabled() and w.requires_grad and not torch.is_inference_mode_enabled()
            and type(w) in (Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling())


def _dual_entry(tiles: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple) -> Fp8Weights:
    """An entry from quantize_fp8_experts_dual(..., pad_to_block=True): a layout whose rows are no multiple of 128
    long is held padded (gemm_tiles' operand, made in the quantizing pass), its unpadded layout a view of it."""
    q, scale, qt, scale_t = tiles
    K, N = qt.shape[1], q.shape[1]
    padded = {}
    if q.shape[2] != K:
        padded["q"], q = q, q[..., :K]
    if qt.shape[2] != N:
        padded["qt"], qt = qt, qt[..., :N]
    _stats["padded"] += len(padded)
    return Fp8Weights(q, scale, qt, scale_t, key=key, padded=padded)


def _quantize(w: Tensor, pow2_scale: bool, transposed: bool, key: tuple = ()) -> Fp8Weights:
    _stats["quantized"] += 1
    if transposed:  # both layouts from one read of w, each zero-padded where its GEMM contracts past 128s
        return _dual_entry(quantize_fp8_experts_dual(w.detach(), pow2_scale=pow2_scale, pad_to_block=True), key)
    return Fp8Weights(*quantize_fp8_experts(w.detach(), pow2_scale=pow2_scale), key=key)


def fp8_expert_weights(w: Tensor, *, pow2_scale: bool, cache: bool, transposed: bool = False) -> Fp8Weights:
    """The E4M3 tiles of `w` [E, N, K]: from the cache when `cache` (see `cacheable`) and an entry is valid,
    else quantized now (and kept when `cache`). `transposed`: dgrad's tiles will be read too, so a fresh
    quantization writes both layouts at once."""
    if isinstance(w, Fp8GatheredWeight):  # gathered by FSDP2 in FP8 (moe_kernels.quant.fsdp_fp8)
        return _gathered(w, pow2_scale)
    if not cache:
        return _quantize(w, pow2_scale, transposed)
    key = _key(w, pow2_scale)
    with _lock:
        entry = _entries.get(w)
        if entry is not None and entry.key == key:
            _stats["hits"] += 1
            return entry
    entry = _quantize(w, pow2_scale, transposed, key)
    with _lock:
        _entries[w] = entry
    return entry


@dataclass
class _GatheredFp8Weights(Fp8Weights):
    """The tiles of an FP8-gathered weight: the forward's as gathered now; dgrad's read from the parameter when
    the backward asks, after FSDP2 gathered them again (in dgrad's layout)."""

    gathered: Fp8GatheredWeight | None = field(default=None, repr=False)

    def transposed(self) -> tuple[Tensor, Tensor]:
        q_t, scale_t = self.gathered.dgrad_tiles()  # codes zero-padded past N: gemm_tiles hands them on as they are
        return _unpadded(q_t, self.gathered.shape[1], self.padded, "qt"), scale_t


def _gathered(w: Fp8GatheredWeight, pow2_scale: bool) -> Fp8Weights:
    if w.pow2_scale != pow2_scale:
        raise ValueError(f"Fp8BlockwiseRecipe(pow2_scale={pow2_scale}): the expert weight was gathered in FP8 with "
                         f"pow2_scale={w.pow2_scale} (enable_fp8_all_gather's); make the two agree")
    q, scale = w.forward_tiles()
    padded: dict = {}
    return _GatheredFp8Weights(_unpadded(q, w.shape[2], padded, "q"), scale, padded=padded, gathered=w)


def _unpadded(q: Tensor, cols: int, padded: dict, name: str) -> Tensor:
    """Codes gathered zero-padded past `cols` (fsdp_fp8): the unpadded view, the padded codes kept in `padded`."""
    if q.shape[-1] == cols:
        return q
    padded[name] = q
    return q[..., :cols]


def refresh(w: Tensor, master: Tensor) -> bool:
    """Write `w` (a compute copy: bf16 or fp16 [E, N, K] expert weights) from its fp32 `master` and remake w's
    entry from the same pass (quantize_fp8_experts_dual with copy_to: one read of the master writes the copy and
    both layouts of its codes), so the next forward finds the step's tiles made. For moe_kernels.train.master's
    copies after an optimizer step; call it with the step's generation already bumped (an optimizer stepping
    afterwards, before the next forward, makes the entry miss: correct, one quantization wasted). Done where w holds an
    entry (its pow2_scale kept; both layouts written even where the entry had the forward's alone: the
    transposed codes' byte per element costs less than reading the copy back to quantize it): True. Else w is
    left alone (False) for the caller to copy as before, and its next forward quantizes as usual. Not under
    CUDA-graph capture (a lookup is host work)."""
    if not _enabled:
        return False
    with _lock:
        entry = _entries.get(w)
    if entry is None or not entry.key or isinstance(entry, _GatheredFp8Weights):
        return False
    if (master.dtype != torch.float32 or w.dtype not in (torch.bfloat16, torch.float16) or w.dim() != 3
            or master.shape != w.shape or master.device != w.device or not w.is_contiguous()):
        return False
    if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    pow2_scale = entry.key[6]
    with torch.no_grad():
        tiles = quantize_fp8_experts_dual(master, pow2_scale=pow2_scale, copy_to=w, pad_to_block=True)
    fresh = _dual_entry(tiles, _key(w, pow2_scale))  # w's version moved with the write
    with _lock:
        _entries[w] = fresh
    _stats["refreshed"] += 1
    return True


def clear() -> None:
    """Drop every cached entry (their memory is freed once no autograd graph holds them)."""
    with _lock:
        _entries.clear()


def stats() -> dict[str, int]:
    """Counts since import: weights quantized (in one or both layouts), transposed copies made afterwards
    (an entry made without dgrad's tiles, asked for them later), cache hits, entries remade with their
    compute copies (`refresh`), layouts whose codes are held zero-padded to a multiple of 128 (`gemm_tiles`), and
    of those the ones padded by a copy after their quantization (`pad_copies`: an entry made without dgrad's
    layout, or gathered by FSDP2)."""
    return dict(_stats, entries=len(_entries))
