"""Data parallelism for the replicated parts of a (possibly expert-parallel) model.

Every rank of the data-parallel group trains on its own batch; the loss of a step is the mean of the
ranks' losses. So each gradient is divided by the group's size W after summing:
- replicated parameters (embeddings, attention, routers, shared experts): summed over the group;
- expert-parallel parameters (`apply_expert_parallel`): the dispatcher's backward already brought the
  gradients of every rank of the expert group that routed tokens to them, so they are summed only over
  `expert_dp_group`, the ranks that hold the same experts (None when each expert lives on one rank).
Call it between backward() and the optimizer step. Gradients are flattened into one buffer per dtype,
so there is one collective per dtype and group.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_kernels.nn import MoELayer, Router
from moe_kernels.parallel.expert_parallel import expert_parameters


def _sum_in_place(grads: list[Tensor], group) -> None:
    by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, group=None, *, expert_dp_group=None) -> None:
    """Average `model`'s gradients over the data-parallel `group` (default: the world), as described in
    the module docstring. Parameters without a gradient are skipped (on every rank alike)."""
    world = dist.get_world_size(group)
    experts = {id(p) for p in expert_parameters(model)}
    replicated, sharded = [], []
    for p in model.parameters():
        if p.grad is not None:
            (sharded if id(p) in experts else replicated).append(p.grad)
    if world > 1 and replicated:
        _sum_in_place(replicated, group)
    if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1 and sharded:
        _sum_in_place(sharded, expert_dp_group)
    for g in replicated + sharded:
        g.div_(world)


@torch.no_grad()
def all_reduce_expert_counts(model: nn.Module, group=None) -> None:
    """Sum every router's accumulated expert counts (`tokens_seen`) over `group`, so that the
    expert-bias update (Router.update_expert_bias) is the same on every rank."""
    for m in model.modules():
        if isinstance(m, Router) and m.tokens_seen is not None:
            dist.all_reduce(m.tokens_seen, group=group)



def apply_global_load_balancing(model: nn.Module, group=None) -> nn.Module:
    """Global-batch load balancing (Qwen's): every router's aux loss takes the expert frequencies f_e over
    the whole data-parallel batch (its counts summed over `group` in each forward) and the mean scores P_e
    over its own tokens, divided by the group's size. With equal token counts per rank, the mean of the
    ranks' losses is then the aux loss of the global batch. With tensor or context parallelism the group must
    hold every rank of the batches it covers (the default, the world, does). Returns the model."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers:
        raise ValueError("apply_global_load_balancing: the model has no Router")
    if any(isinstance(m, MoELayer) and m.config.backend == "torch" for m in model.modules()):
        raise ValueError("apply_global_load_balancing: the torch-native backend computes its own aux loss")
    for r in routers:
        r.balance_group = group if group is not None else dist.group.WORLD
    return model
