"""The device mesh for data + expert parallelism.

W ranks form a (W / P, P) mesh named ("edp", "ep"): an "ep" row of P consecutive ranks splits each MoE
layer's experts (apply_expert_parallel), an "edp" column holds the ranks with the same experts (their
expert gradients are averaged there), and the whole mesh is the data-parallel group of the replicated
parameters. Attention and the rest of the model see plain data parallelism over all W ranks: "parallel
folding" in its simplest form, the expert mesh laid over the same ranks as the attention's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ExpertParallelMesh:
    mesh: DeviceMesh

    @property
    def ep_group(self):
        """This rank's expert-parallel group (P ranks)."""
        return self.mesh.get_group("ep")

    @property
    def edp_group(self):
        """The ranks holding this rank's experts (W / P ranks), None when P is the whole world."""
        return self.mesh.get_group("edp") if self.mesh.size(0) > 1 else None

    @property
    def expert_parallel(self) -> int:
        return self.mesh.size(1)

    @property
    def ep_rank(self) -> int:
        return self.mesh.get_local_rank("ep")


def expert_parallel_mesh(expert_parallel: int, device_type: str = "cuda") -> ExpertParallelMesh:
    """The (W / P, P) mesh over the default process group's W ranks (every rank must call it)."""
    world = dist.get_world_size()
    if expert_parallel < 1 or world % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} must divide the number of ranks ({world})")
    mesh = init_device_mesh(device_type, (world // expert_parallel, expert_parallel), mesh_dim_names=("edp", "ep"))
    return ExpertParallelMesh(mesh)
