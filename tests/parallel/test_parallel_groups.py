"""parallelize()'s communicators on 4 gloo ranks: created only for the dimensions larger than one, each rank
set once (the expert-parallel "ep" dimension excepted: its own communicator, even when another dimension has
the same ranks or it spans the world), a dimension spanning the world the default group, and at most one
group of a single rank, this rank's alone, shared by whatever needs one. The FSDP meshes are built from
these groups with the layout's ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.layout import ParallelConfig
from tests.distributed import run_world

pytestmark = pytest.mark.distributed

ONE = "this rank"  # the shared single-rank group, created by each rank for itself
# layout -> the rank sets every rank creates, in order (ep's marked "ep").
CASES = [
    (dict(dp_shard=4), []),  # FSDP over the world: the default group
    (dict(ep=2), [[0, 2], [1, 3], ("ep", [0, 1]), ("ep", [2, 3])]),  # edp, ep
    (dict(ep=4), [("ep", [0, 1, 2, 3]), ONE]),  # ep spans the world; edp a single rank
    # dp_shard: {0,2},{1,3} (also edp); tp: {0,1},{2,3} (also the sequence group); dp_shard x tp the world.
    (dict(tp=2, ep=2), [[0, 2], [1, 3], [0, 1], [2, 3], ("ep", [0, 1]), ("ep", [2, 3])]),
    # dp_shard x cp the world; cp: {0,1},{2,3} (also the sequence group); edp {0,2},{1,3}.
    (dict(cp=2, ep=2), [[0, 1], [2, 3], [0, 2], [1, 3], ("ep", [0, 1]), ("ep", [2, 3])]),
    # dp_replicate: {0,2},{1,3} (also edp); dp_shard {0,1},{2,3}.
    (dict(dp_replicate=2, ep=2), [[0, 2], [1, 3], [0, 1], [2, 3], ("ep", [0, 1]), ("ep", [2, 3])]),
    # pp: {0,2},{1,3}; stage {0,1},{2,3} (also dp_shard); edp a single rank.
    (dict(pp=2, ep=2), [[0, 2], [1, 3], [0, 1], [2, 3], ("ep", [0, 1]), ("ep", [2, 3]), ONE]),
]


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _worker(rank, P):
    from moe_kernels.parallel.parallelize import parallelize

    created = []
    new_group = dist.new_group

    def counting(ranks=None, *args, **kwargs):
        group = new_group(ranks, *args, **kwargs)
        created.append((kwargs.get("group_desc"), list(ranks), group))
        return group

    for layout, want in CASES:
        torch.manual_seed(0)
        model = build_model(PRESETS["tiny-deepseek-v3"](num_experts=8))
        created.clear()
        dist.new_group = counting
        try:
            par = parallelize(model, ParallelConfig(**layout), num_microbatches=2 if layout.get("pp") else None)
        finally:
            dist.new_group = new_group
        where = f"rank {rank} {layout}"
        got = [[rank] if len(r) == 1 else (("ep", r) if desc == "ep" else r) for desc, r, _ in created]
        assert got == [[rank] if w == ONE else w for w in want], (where, created)
        singles = [r for _, r, _ in created if len(r) == 1]
        assert singles in ([], [[rank]]), (where, singles)
        shared = [tuple(r) for desc, r, _ in created if desc != "ep" and len(r) > 1]
        assert len(shared) == len(set(shared)), (where, shared)

        # Every group this rank created and belongs to is in use: a dimension of the layout, or an FSDP mesh's.
        groups = par.groups
        meshes = {id(p.device_mesh): p.device_mesh for p in par.model.parameters() if hasattr(p, "device_mesh")}
        used = {id(g) for g in groups.values() if g is not None}
        used |= {id(m.get_group(d)) for m in meshes.values() for d in range(m.ndim)}
        used |= {id(m.dispatcher.group) for m in par.model.modules() if getattr(m, "dispatcher", None) is not None}
        mine = [g for _, r, g in created if rank in r]
        assert all(id(g) in used for g in mine), where

        # ep: its own communicator, never the default group nor another dimension's.
        EP = layout.get("ep", 1)
        if EP > 1:
            ep = groups["ep"]
            others = [g for k, g in groups.items() if k != "ep" and g is not None]
            assert ep is not dist.group.WORLD and all(ep is not g for g in others), where
            assert _ranks(ep) == [r for r in range(P) if r // EP == rank // EP], where

        # FSDP meshes hold the layout's ranks: their coordinates and groups agree.
        for m in meshes.values():
            coords = m.get_coordinate()
            assert m.mesh[tuple(coords)].item() == rank, (where, m)
            for d in range(m.ndim):
                line = m.mesh.movedim(d, -1)[tuple(c for i, c in enumerate(coords) if i != d)]
                assert _ranks(m.get_group(d)) == line.tolist(), (where, m, d)
        if layout.get("dp_shard") == 4:
            assert groups["dp_shard_cp"] is dist.group.WORLD
        del par, model


def test_communicators_only_for_dimensions_larger_than_one():
    run_world(_worker, 4)
