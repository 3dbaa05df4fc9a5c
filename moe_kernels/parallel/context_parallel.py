"""Context parallelism for a moe_kernels MoETransformer, applied from outside.

Each of the cp ranks holds 2 of the 2 * cp chunks of every sequence (moe_kernels.parallel.sequence: chunks
c and 2cp-1-c, so every rank gets the same share of the causal attention's work). Everything but attention
runs on those tokens alone. In attention, each rank's queries and keys are rotated at their global positions
(the rotary cos/sin rows of its positions), then the keys and values of all cp ranks are gathered (Llama 3's
all-gather context parallelism) and put in positional order, and the rank's queries attend to them under the
causal mask of their positions. The gather's backward sums every rank's key and value gradients onto the
rank that owns the position (a reduce-scatter).

With tensor parallelism as well, the tp ranks of one cp rank first join their sequence-parallel pieces
(tensor_parallel's all-gather), so the attention sees the cp rank's S / cp tokens and its 1/tp of the heads.

Each of the rank's two chunks attends to the gathered keys up to its own end under a causal mask aligned at
the lower right (torch.nn.attention.bias.causal_lower_right): two fused causal attention calls (flash or
memory-efficient on a GPU), no [S/cp, S] mask tensor. The keys are gathered whole (Llama 3's all-gather
variant); a ring would overlap the exchange with the computation.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from moe_kernels.parallel.sequence import SequenceSharding, blocks_of
from moe_kernels.parallel.tensor_parallel import gather_sequence


def _context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, *, sharding: SequenceSharding,
                                seq_len: list) -> Tensor:
    """q, k, v [B, h, S/cp, D] at this rank's positions -> out [B, h, S/cp, D]."""
    S = seq_len[0]
    order = sharding.cp_order(S, q.device)
    k = gather_sequence(k, sharding.cp_group, dim=2).index_select(2, order)
    v = gather_sequence(v, sharding.cp_group, dim=2).index_select(2, order)
    if k.shape[1] != q.shape[1]:  # grouped-query: whole heads (the lower-right causal kernels take no GQA)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    # The rank's two chunks: chunk j (positions [j n, (j+1) n)) sees the keys before its end, causally aligned at
    # the lower right: one fused causal attention each, no mask tensor.
    n = S // (2 * sharding.cp)
    out = []
    for part, j in ((q[:, :, :n], sharding.cp_rank), (q[:, :, n:], 2 * sharding.cp - 1 - sharding.cp_rank)):
        end = (j + 1) * n
        out.append(F.scaled_dot_product_attention(part, k[:, :, :end], v[:, :, :end], attn_mask=causal_lower_right(n, end),
                                                  scale=scale))
    return torch.cat(out, dim=2)


def apply_context_parallel(model: nn.Module, sharding: SequenceSharding) -> None:
    """Every attention module of `model` attends across the cp ranks of `sharding` (module docstring), in place.
    The sequence chunks themselves come from apply_sequence_sharding."""
    for block in blocks_of(model):
        attn = block.self_attn
        seq_len: list = [0]  # the whole sequence's length, seen in each forward (the rotary tables' rows)

        def local_rotary(module, args, seq_len=seq_len):
            x, cos, sin = args
            seq_len[0] = cos.shape[0]
            positions = sharding.cp_positions(cos.shape[0], cos.device)
            return (x, cos[positions], sin[positions])

        attn.register_forward_pre_hook(local_rotary)
        attn.attend = partial(_context_parallel_attention, sharding=sharding, seq_len=seq_len)
