"""The process groups for data + expert parallelism.

W ranks form a (W / P, P) grid named ("edp", "ep"): an "ep" row of P consecutive ranks splits each MoE
layer's experts (apply_expert_parallel), an "edp" column holds the ranks with the same experts (their
expert gradients are averaged there), and the whole grid is the data-parallel group of the replicated
parameters. Attention and the rest of the model see plain data parallelism over all W ranks: "parallel
folding" in its simplest form, the expert grid laid over the same ranks as the attention's.

Communicators are created only for the dimensions larger than one (a DeviceMesh makes one for every
dimension, W single-rank groups for a dimension of size 1); an "edp" dimension spanning the world is the
default group itself, an "ep" one its own communicator (the dispatch's collectives in the backward never
share one with the gradient all-reduces started from the backward's hooks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _groups_along(grid, dims: tuple[int, ...], desc: str, made: dict | None = None, *, world: bool = True):
    """This rank's group of the ranks that differ from it only along `dims` of `grid` (a tensor holding each of
    the world's ranks once, ascending along every dimension): one line, its ranks in grid order. None when the
    lines are single ranks. Every rank calls new_group for every line of the dimension, in the same order, as
    torch requires. A line spanning the world is the default group (`world=False`: its own communicator).
    `made` (rank tuple -> group, shared by the calls of one set-up) reuses a rank set's group."""
    rank, n = dist.get_rank(), math.prod(grid.shape[d] for d in dims)
    if n == 1:
        return None
    if world and n == grid.numel():
        return dist.group.WORLD
    others = [d for d in range(grid.ndim) if d not in dims]
    mine = None
    for ranks in grid.permute(*others, *dims).reshape(-1, n).tolist():
        group = None if made is None else made.get(tuple(ranks))
        if group is None:
            group = dist.new_group(ranks, group_desc=desc)
            if made is not None:
                made[tuple(ranks)] = group
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class ExpertParallelMesh:
    expert_parallel: int  # P
    ep_rank: int  # this rank's place in its "ep" row
    edp_group: object  # the ranks holding this rank's experts (W / P ranks), None when P is the whole world
    _ep_group: object = field(repr=False)  # None when P == 1 (made on first use)
    _single: list = field(default_factory=list, repr=False, compare=False)

    @property
    def ep_group(self):
        """This rank's expert-parallel group (P ranks). For P == 1 a group of this rank alone, created on first
        use by this rank only."""
        if self._ep_group is not None:
            return self._ep_group
        if not self._single:
            self._single.append(dist.new_group([dist.get_rank()], use_local_synchronization=True,
                                               group_desc="expert_mesh_ep"))
        return self._single[0]


def expert_parallel_mesh(expert_parallel: int, device_type: str = "cuda") -> ExpertParallelMesh:
    """The (W / P, P) grid over the default process group's W ranks (every rank must call it). `device_type`
    is kept for callers (the groups take the default group's backend)."""
    world = dist.get_world_size()
    if expert_parallel < 1 or world % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} must divide the number of ranks ({world})")
    grid = torch.arange(world).view(world // expert_parallel, expert_parallel)
    # The expert-parallel dimension gets its own communicator even when it spans the world: the token
    # dispatch's collectives in the backward then never share one with the gradient all-reduces that the
    # backward's hooks start on the default group (their relative order is the autograd engine's).
    ep = _groups_along(grid, (1,), "expert_mesh_ep", world=False)
    edp = _groups_along(grid, (0,), "expert_mesh_edp")
    return ExpertParallelMesh(expert_parallel, dist.get_rank() % expert_parallel, edp, ep)
