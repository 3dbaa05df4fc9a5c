"""Initial weights that every layout draws alike, each rank only its own pieces.

A parameter's values are drawn in blocks along its first dimension: one expert of a GroupedExperts weight
([E, ...]: block e is expert e), or a run of rows of a matrix or embedding (`BLOCK_ELEMENTS` values or one
row, whichever is more). Block b of parameter `name` comes from its own generator, seeded from
(seed, name, b), on the parameter's device. So the value of any element depends only on the seed, the
parameter's name in the full model and its global shape: a rank holding a slice (an ep rank's experts, a
tensor-parallel slice, an FSDP shard, a pipeline stage) draws the blocks its slice touches and keeps its
part, and every layout, one process included, gets the same model. At deepseek-v3 a rank draws one
expert at a time, never a whole [256, 4096, 7168] w13.

Values are drawn in fp32 and cast to the parameter's dtype. A CUDA generator and the CPU one give different
streams, so a model is the same in every layout on one kind of device.

The rules (`MoETransformer.init_weights`'s): matrices and embeddings Normal(0, init_std), output projections
(o_proj, down_proj, the experts' w2) Normal(0, init_std / sqrt(2 * num_layers)), norms 1, biases, expert
bias and expert counts 0.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import Tensor, nn

BLOCK_ELEMENTS = 1 << 22  # values drawn from one generator (at least one row)

# (kind, std): kind "normal", "ones" or "zeros"
Rule = tuple[str, float]


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{int(seed)}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_block(shape: tuple) -> int:
    """Rows (first-dimension entries) of a parameter drawn from one generator: one expert of a 3-d expert
    weight, else as many rows as make BLOCK_ELEMENTS values (at least one)."""
    if len(shape) >= 3:
        return 1
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def draw_block(seed: int, name: str, block: int, shape: tuple, std: float, device) -> Tensor:
    """Block `block` of parameter `name` (full shape `shape`): its rows, every other dimension whole, fp32."""
    rows = rows_per_block(shape)
    lo = block * rows
    n = min(rows, shape[0] - lo)
    gen = torch.Generator(device=device)
    gen.manual_seed(_block_seed(seed, name, block))
    out = torch.empty((n, *shape[1:]), dtype=torch.float32, device=device)
    return out.normal_(0.0, std, generator=gen)


def model_rules(model: nn.Module, config) -> dict[str, Rule]:
    """name -> rule for every parameter and buffer of a moe_kernels model (its full-model names); a parameter
    no rule covers is a ValueError (so a new module cannot be left uninitialised)."""
    from moe_kernels.models.transformer import RMSNorm
    from moe_kernels.nn import GroupedExperts, Router

    std = config.init_std
    out_std = std / math.sqrt(2 * config.num_layers)
    rules: dict[str, Rule] = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        own = dict(module.named_parameters(recurse=False))
        own.update(dict(module.named_buffers(recurse=False)))
        for pname in own:
            if isinstance(module, (nn.Linear, nn.Embedding)) and pname == "weight":
                rule = ("normal", out_std if mname.endswith(("o_proj", "down_proj")) else std)
            elif isinstance(module, nn.Linear) and pname == "bias":
                rule = ("zeros", 0.0)
            elif isinstance(module, RMSNorm) and pname == "weight":
                rule = ("ones", 0.0)
            elif isinstance(module, GroupedExperts) and pname in ("w13", "w2"):
                rule = ("normal", std if pname == "w13" else out_std)
            elif isinstance(module, Router) and pname == "weight":
                rule = ("normal", std)
            elif isinstance(module, Router) and pname in ("expert_bias", "tokens_seen"):
                rule = ("zeros", 0.0)
            else:
                raise ValueError(f"init_weights: no initialisation rule for {prefix + pname} "
                                 f"({type(module).__name__}.{pname})")
            rules[prefix + pname] = rule
    return rules


# A split from the full tensor to a rank's logical tensor (moe_kernels.parallel.full_state.Split): (kind,
# group, dim), kind "dim" (a chunk of `dim` over the group) or "gate_up" (w13's gate and up rows, each
# chunked). Here the group is given as (size, rank) or as a process group.
Split = tuple[str, Any, int]


def _group_size_rank(group) -> tuple[int, int]:
    if isinstance(group, tuple):
        return group
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def global_indices(t: Tensor, splits: list[Split]) -> tuple[tuple, list[Tensor]]:
    """(the full tensor's shape, for each dimension the full tensor's indices this rank's local tensor holds):
    the splits from the full tensor to the rank's logical tensor, then its FSDP shard when `t` is a
    DTensor."""
    shape = list(t.shape)
    for _, group, dim in splits:
        shape[dim] *= _group_size_rank(group)[0]
    idx = [torch.arange(s) for s in shape]
    for kind, group, dim in splits:
        n, r = _group_size_rank(group)
        if kind == "gate_up":
            gate, up = idx[dim].chunk(2)
            idx[dim] = torch.cat([gate.chunk(n)[r], up.chunk(n)[r]])
        else:
            idx[dim] = _chunk(idx[dim], n, r)
    if _is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        idx = [i[o : o + s] for i, o, s in zip(idx, offset, local_shape)]
    return tuple(shape), idx


def _chunk(i: Tensor, n: int, r: int) -> Tensor:
    chunks = i.chunk(n)
    return chunks[r] if r < len(chunks) else i[:0]


@torch.no_grad()
def fill(t: Tensor, name: str, rule: Rule, seed: int, splits: list[Split] | None = None) -> None:
    """Writes `name`'s initial values into `t` (a full tensor, a rank's slice of it or an FSDP DTensor shard)."""
    local = t.to_local() if _is_dtensor(t) else t
    if local.device.type == "meta" or local.numel() == 0:
        return
    kind, std = rule
    if kind != "normal":
        local.fill_(1 if kind == "ones" else 0)
        return
    full_shape, idx = global_indices(t, splits or [])
    rows = idx[0]
    if rows.numel() and int(rows[-1] - rows[0]) + 1 != rows.numel():
        raise ValueError(f"init_weights: {name}'s rows on this rank are not contiguous")
    first, count = int(rows[0]), rows.numel()
    per = rows_per_block(full_shape)
    whole = [i.numel() == s for i, s in zip(idx, full_shape)]
    device = local.device
    for b in range(first // per, (first + count - 1) // per + 1):
        block = draw_block(seed, name, b, full_shape, std, device)
        lo, hi = max(first, b * per), min(first + count, b * per + block.shape[0])
        part = block[lo - b * per : hi - b * per]
        for d in range(1, part.dim()):
            if not whole[d]:
                part = part.index_select(d, idx[d].to(device))
        local[lo - first : hi - first].copy_(part)


@torch.no_grad()
def init_parameters(model: nn.Module, rules: dict[str, Rule], seed: int, splits: dict[str, list[Split]] | None = None):
    """Fills every parameter and buffer of `model` (names as in the full model) by its rule; `splits`: name ->
    the splits from the full tensor to this rank's (moe_kernels.parallel.full_state.splits_of)."""
    splits = splits or {}
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name, t in tensors.items():
        fill(t, name, rules[name], seed, splits.get(name))
