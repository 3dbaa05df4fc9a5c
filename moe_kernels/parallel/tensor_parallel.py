"""Tensor parallelism with sequence parallelism for a moe_kernels MoETransformer, applied from outside.

`apply_tensor_parallel(model, group)` splits attention and the dense MLP layers over the n ranks of `group`
(the Megatron-LM layout) and leaves each rank 1/n of every sequence everywhere else:

    embed_tokens          this rank's chunk of the sequence (moe_kernels.parallel.sequence), then
    input_layernorm       on the chunk
    self_attn             all-gather of the chunks; q/k/v (MLA: q_b, kv_b) column-wise, i.e. 1/n of the heads;
                          o_proj row-wise, its partial sums reduce-scattered back to the chunks
    post_attention_layernorm, the MoE layer (router, experts, shared experts), final norm, lm_head: on the chunk
    dense MLP layers      all-gather; gate/up column-wise, down row-wise; reduce-scatter

So the model's logits cover this rank's chunk of the sequence and every loss is a share (SequenceSharding:
the chunks, the routers' sequence group, the cross-entropy share).

Parameters come in two kinds, and moe_kernels.parallel.parallelize reduces each kind's gradients over the
right ranks:
  split       the column and row slices above: each rank holds other values, the gradient of its slice is
              complete (the all-gather / reduce-scatter pair sums every rank's part in the backward);
  replicated  everything else (norms, Qwen3's q/k norms, MLA's latent projections and norms, routers, shared
              experts, embeddings, lm_head; the key/value projections when there are fewer key/value heads
              than ranks, each rank then keeping the one head its query heads read): equal on every rank,
              each rank's gradient only its chunk's (or its heads') part, summed over the group.
The autograd functions below are Megatron-LM's pair: the all-gather's backward is a reduce-scatter and the
reduce-scatter's backward an all-gather. Plain local tensors (no DTensor): the MoE layer's custom ops and
MLA's rotary key, shared by all heads, need the partial gradients summed where DTensor would not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.nn import MoELayer, SharedExperts
from moe_kernels.parallel.sequence import blocks_of


# The single-tensor collectives (torch 2.13 names them *_single; all_gather_into_tensor and
# reduce_scatter_tensor before): no list of parts to copy out and concatenate. gloo has both in torch 2.13
# (concatenated along dim 0 only, not stacked); where its reduce-scatter is missing, a sum and a chunk.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NO_TENSOR_REDUCE_SCATTER: set[str] = set()  # backends found without it (older gloo)


def _gather_chunks(x: Tensor, group, dim: int) -> Tensor:
    """Every rank's x concatenated along `dim`, in rank order: gathered into one [n * x.shape[0], ...] buffer
    (the ranks' x stacked), then the rank axis moved next to `dim` (free when the sizes before `dim` are 1)."""
    n = dist.get_world_size(group)
    dim = dim % x.dim()
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    if dim == 0:
        return out
    return out.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1).contiguous()


def _reduce_scatter_chunks(x: Tensor, group, dim: int) -> Tensor:
    """The sum over the ranks of x, this rank's chunk along `dim`: the n chunks stacked into one buffer
    (free when the sizes before `dim` are 1), one reduce-scatter."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    dim = dim % x.dim()
    backend = str(dist.get_backend(group))
    if backend not in _NO_TENSOR_REDUCE_SCATTER:
        stacked = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # [n, ..., d, ...]
        out = x.new_empty(stacked.shape[1:])
        flat = stacked.view(n * stacked.shape[1], *stacked.shape[2:])  # the chunks concatenated along dim 0
        if backend != "gloo":
            _reduce_scatter_single(out, flat, group=group)
            return out
        try:
            _reduce_scatter_single(out, flat, group=group)
            return out
        except (RuntimeError, NotImplementedError):  # an older gloo: refused on every rank, before any exchange
            _NO_TENSOR_REDUCE_SCATTER.add(backend)
    total = x.contiguous().clone()  # a sum, then this rank's chunk
    dist.all_reduce(total, group=group)
    return total.chunk(n, dim=dim)[r].contiguous()


class _SequenceCollective(torch.autograd.Function):
    """gather: the chunks of every rank concatenated along `dim`, whose backward is a reduce-scatter (the sum of
    the ranks' gradients, chunked); else the reduce-scatter of the ranks' partial results, whose backward is
    an all-gather."""

    @staticmethod
    def forward(ctx, x, group, dim, gather):
        ctx.group, ctx.dim, ctx.gather = group, dim, gather
        return (_gather_chunks if gather else _reduce_scatter_chunks)(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_chunks if ctx.gather else _gather_chunks)(grad, ctx.group, ctx.dim), None, None, None


def gather_sequence(x: Tensor, group, dim: int = 1) -> Tensor:
    return _SequenceCollective.apply(x, group, dim, True)


def reduce_scatter_sequence(x: Tensor, group, dim: int = 1) -> Tensor:
    return _SequenceCollective.apply(x, group, dim, False)


# ---------------------------------------------------------------------------------------------------
# Splitting the modules


# On each split module: {parameter name: the dimension split over the tp group} (for full checkpoints).
SPLIT_DIMS = "_tp_split_dims"


def _keep(module: nn.Linear, name: str, value: Tensor, dim: int) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))
    module.__dict__.setdefault(SPLIT_DIMS, {})[name] = dim


def _columns(linear: nn.Linear, n: int, r: int) -> None:
    """Column-parallel: this rank's 1/n of the output features (rows of the weight)."""
    out = linear.out_features // n
    _keep(linear, "weight", linear.weight[r * out : (r + 1) * out], 0)
    if linear.bias is not None:
        _keep(linear, "bias", linear.bias[r * out : (r + 1) * out], 0)
    linear.out_features = out


def _rows(linear: nn.Linear, n: int, r: int) -> None:
    """Row-parallel: this rank's 1/n of the input features (columns of the weight). The outputs are partial
    sums; a bias would be added once per rank, so a row-parallel layer must have none."""
    if linear.bias is not None:
        raise ValueError("apply_tensor_parallel: a row-parallel layer with a bias is not supported")
    inp = linear.in_features // n
    _keep(linear, "weight", linear.weight[:, r * inp : (r + 1) * inp], 1)
    linear.in_features = inp


def _gather_input(group):
    def hook(module, args):
        return (gather_sequence(args[0], group), *args[1:])

    return hook


def _scatter_output(group):
    def hook(module, args, out):
        return reduce_scatter_sequence(out, group)

    return hook


def _one_head(head: int, D: int):
    """Keeps one head's features of a projection's output (the key/value head of this rank's query heads when
    there are fewer key/value heads than ranks: the projection is held whole, its gradient summed over the
    ranks, each of which used one head)."""

    def hook(module, args, out):
        return out[..., head * D : (head + 1) * D]

    return hook


def _split_attention(attn: nn.Module, n: int, r: int) -> list[nn.Module]:
    """Heads split over the ranks; returns the replicated submodules (their gradients are partial)."""
    replicated = []
    if hasattr(attn, "mla"):  # MLAttention
        if attn.mla.q_lora_rank is None:
            _columns(attn.q_proj, n, r)
        else:
            _columns(attn.q_b_proj, n, r)
            replicated += [attn.q_a_proj, attn.q_a_layernorm]
        _columns(attn.kv_b_proj, n, r)
        replicated += [attn.kv_a_proj_with_mqa, attn.kv_a_layernorm]
        attn.num_heads //= n
    else:
        nh, nkv = attn.num_heads, attn.num_kv_heads
        _columns(attn.q_proj, n, r)
        if nkv % n == 0:
            for proj in (attn.k_proj, attn.v_proj):
                _columns(proj, n, r)
            attn.num_kv_heads = nkv // n
        else:  # n % nkv == 0: this rank's query heads share key/value head r * nkv / n
            for proj in (attn.k_proj, attn.v_proj):
                proj.register_forward_hook(_one_head(r * nkv // n, attn.head_dim))
                replicated.append(proj)
            attn.num_kv_heads = 1
        replicated += [m for m in (attn.q_norm, attn.k_norm) if m is not None]
        attn.num_heads = nh // n
    _rows(attn.o_proj, n, r)
    return replicated


def _split_mlp(mlp: SharedExperts, n: int, r: int) -> list[nn.Module]:
    _columns(mlp.gate_proj, n, r)  # (dense MLPs are SwiGLU; MoE layers' shared experts stay replicated)
    _columns(mlp.up_proj, n, r)
    _rows(mlp.down_proj, n, r)
    return [mlp.gate] if mlp.gate is not None else []


def apply_tensor_parallel(model: nn.Module, group) -> list[list[nn.Module]]:
    """Split `model` (a moe_kernels.models MoETransformer, built identically on every rank, checked by
    sequence.check_sequence_parallel) over the ranks of `group`, in place (module docstring); the sequence
    chunks come from apply_sequence_sharding. Returns the replicated modules, one list per transformer block
    and a last one for the embedding, final norm and lm_head: their gradients are this rank's part, to be
    summed over the group (parallelize puts them in FSDP units over the data-parallel and tensor-parallel
    ranks)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    replicated: list[list[nn.Module]] = []
    for block in blocks_of(model):
        mods = [block.input_layernorm, block.post_attention_layernorm]
        mods += _split_attention(block.self_attn, n, r)
        block.self_attn.register_forward_pre_hook(_gather_input(group))
        block.self_attn.register_forward_hook(_scatter_output(group))
        if isinstance(block.mlp, MoELayer):
            mods.append(block.mlp.router)
            if block.mlp.shared_experts is not None:
                mods.append(block.mlp.shared_experts)
        else:
            mods += _split_mlp(block.mlp, n, r)
            block.mlp.register_forward_pre_hook(_gather_input(group))
            block.mlp.register_forward_hook(_scatter_output(group))
        replicated.append(mods)
    replicated.append([m for m in (model.embed_tokens, model.norm, model.lm_head) if m is not None])
    return replicated
