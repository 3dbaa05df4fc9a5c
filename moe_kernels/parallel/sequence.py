"""How the ranks that share one batch split its sequences (context and sequence parallelism).

The cp x tp ranks of one data-parallel slot hold one batch. Context parallelism cuts every sequence of S
tokens into 2 * cp chunks and gives rank c chunks c and 2 * cp - 1 - c (load-balanced causal sharding: an
early chunk, cheap under the causal mask, with a late one); tensor parallelism's sequence parallelism then
cuts those S / cp tokens into tp contiguous pieces. Each rank embeds, normalises, routes and runs the MoE
layer on its S / (cp * tp) tokens, and every loss is a share: the shares of the cp x tp ranks add up to the
batch's loss (`cross_entropy_share`, or `linear_cross_entropy_share` from the hidden states without the logits,
and the routers' aux losses through Router.sequence_group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.nn import MoELayer, linear_cross_entropy


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a MoETransformer (`layers`, a ModuleList) or of a pipeline rank's stages
    (a ModuleDict under the full model's indices)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


class SequenceSharding:
    """cp_group / tp_group: this rank's context- and tensor-parallel groups (None for a size of 1);
    group: all cp x tp ranks of the batch (the routers' sequence group)."""

    def __init__(self, cp_group, tp_group, group):
        self.cp_group, self.tp_group, self.group = cp_group, tp_group, group
        self.cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self._cache: dict = {}

    def _cached(self, key: tuple, make):
        """Per (what, length, device): every layer asks for the same tensors in every forward. One length
        and device kept per kind."""
        held = self._cache.get(key[0])
        if held is None or held[0] != key:
            held = self._cache[key[0]] = (key, make())
        return held[1]

    def check_length(self, S: int) -> None:
        if S % (2 * self.cp if self.cp > 1 else 1) or (S // self.cp) % self.tp:
            need = []
            if self.cp > 1:
                need.append(f"a multiple of 2*cp = {2 * self.cp}")
            if self.tp > 1:
                need.append(f"S/cp a multiple of tp = {self.tp}" if self.cp > 1 else f"a multiple of tp = {self.tp}")
            raise ValueError(f"the sequence length {S} must split into whole chunks: {' and '.join(need)}")

    def _positions_of(self, c: int, S: int) -> Tensor:
        """The positions context-parallel rank c holds, in its order: chunk c, then chunk 2cp-1-c."""
        if self.cp == 1:
            return torch.arange(S)
        n = S // (2 * self.cp)
        second = 2 * self.cp - 1 - c
        return torch.cat([torch.arange(c * n, (c + 1) * n), torch.arange(second * n, (second + 1) * n)])

    def cp_positions(self, S: int, device=None) -> Tensor:
        """The positions this context-parallel rank holds, in its order."""
        return self._cached(("positions", S, str(device)), lambda: self._positions_of(self.cp_rank, S).to(device))

    def cp_order(self, S: int, device=None) -> Tensor:
        """Where each position lands when every cp rank's tokens are concatenated in rank order: gathered
        keys indexed by this are in positional order."""
        return self._cached(("order", S, str(device)), lambda: torch.argsort(
            torch.cat([self._positions_of(c, S) for c in range(self.cp)])).to(device))

    def local(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a batch tensor ([B, S, ...] along `dim`): what its logits cover."""
        S = t.shape[dim]
        self.check_length(S)
        if self.cp > 1:
            t = t.index_select(dim, self.cp_positions(S, t.device))
        if self.tp > 1:
            t = t.chunk(self.tp, dim=dim)[self.tp_rank]
        return t


def cross_entropy_share(logits: Tensor, labels: Tensor, sharding: SequenceSharding | None,
                        ignore_index: int = -100) -> Tensor:
    """This rank's share of the batch's mean cross-entropy over its labels other than `ignore_index`: logits
    [B, S_local, V] of its tokens, labels [B, S] of the whole batch (sharding None: the plain mean)."""
    import torch.nn.functional as F

    logits = logits.float()  # (bf16 logits under FSDP's mixed precision: the loss in fp32)
    if sharding is None:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index)
    local = sharding.local(labels)
    counted = (labels != ignore_index).sum().clamp(min=1)  # the whole batch's, as the plain mean counts them
    return F.cross_entropy(logits.flatten(0, 1), local.flatten(), reduction="sum", ignore_index=ignore_index) / counted


def linear_cross_entropy_share(hidden: Tensor, weight: Tensor, labels: Tensor, sharding: SequenceSharding | None,
                               ignore_index: int = -100) -> Tensor:
    """cross_entropy_share from the final hidden states [B, S_local, H] and the output projection's weight [V, H]
    (moe_kernels.nn.linear_cross_entropy: the lm_head and the loss over chunks of tokens, no [B, S_local, V]
    logits). The vocabulary is never split over ranks (tensor parallelism leaves the lm_head whole, each rank
    projecting its own tokens), so each rank's loss needs only its tokens' rows and the whole weight."""
    if sharding is None:
        return linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index)
    local = sharding.local(labels)
    counted = (labels != ignore_index).sum().clamp(min=1)  # the whole batch's, as the plain mean counts them
    return linear_cross_entropy(hidden, weight, local, ignore_index=ignore_index, reduction="sum") / counted


def check_sequence_parallel(model: nn.Module, tp: int) -> None:
    """What splitting the sequences (and with tp, the dense layers) needs of the model, checked before any
    module is changed; ValueError naming the numbers."""
    if getattr(model, "layers", None) is None or not hasattr(model, "embed_tokens"):
        raise ValueError("parallelize: tp and cp need a moe_kernels.models MoETransformer")
    for m in model.modules():
        if isinstance(m, MoELayer) and m.config.backend == "torch":
            raise ValueError("parallelize: the torch-native MoE backend computes its own aux loss over whole "
                             "sequences; use the default backend with tp or cp > 1")
    for block in blocks_of(model):
        attn = block.self_attn
        if not hasattr(attn, "mla") and (attn.num_heads % tp or (attn.num_kv_heads % tp and tp % attn.num_kv_heads)):
            raise ValueError(
                f"parallelize: tp={tp} must divide the {attn.num_heads} query heads, and tp and the "
                f"{attn.num_kv_heads} key/value heads must divide one another")
        if not isinstance(block.mlp, MoELayer) and block.mlp.gate_proj.out_features % tp:
            raise ValueError(f"parallelize: tp={tp} must divide the dense ffn size {block.mlp.gate_proj.out_features}")


def apply_sequence_sharding(model: nn.Module, sharding: SequenceSharding) -> None:
    """The embedding keeps this rank's tokens of every sequence; the routers count over the sharding's group
    and return loss shares."""
    def local_ids(module, args):
        return (sharding.local(args[0]), *args[1:])

    if model.embed_tokens is not None:  # (not on a pipeline rank without the first stage: its inputs are local)
        model.embed_tokens.register_forward_pre_hook(local_ids)
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.router.sequence_group = sharding.group
