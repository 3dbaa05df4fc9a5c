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

from dataclasses import dataclass, field

import torch.distributed as dist


def _groups_along(shape: tuple[int, int], dim: int):
    """This rank's group along `dim` of a row-major (rows, cols) grid over the world's ranks (every rank
    calls new_group for every group of the dimension, in the same order, as torch requires)."""
    rows, cols = shape
    rank, world = dist.get_rank(), rows * cols
    # The expert-parallel dimension gets its own communicator even when it spans the world: the token
    # dispatch's collectives in the backward then never share one with the gradient all-reduces that the
    # backward's hooks start on the default group (their relative order is the autograd engine's).
    if shape[dim] == world and dim == 0:
        return dist.group.WORLD
    if dim == 1:
        lines = [list(range(r * cols, (r + 1) * cols)) for r in range(rows)]
    else:
        lines = [list(range(c, world, cols)) for c in range(cols)]
    mine = None
    for ranks in lines:
        group = dist.new_group(ranks, group_desc=f"expert_mesh_{'ep' if dim else 'edp'}")
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
    shape = (world // expert_parallel, expert_parallel)
    ep = _groups_along(shape, 1) if expert_parallel > 1 else None
    edp = _groups_along(shape, 0) if shape[0] > 1 else None
    return ExpertParallelMesh(expert_parallel, dist.get_rank() % expert_parallel, edp, ep)
