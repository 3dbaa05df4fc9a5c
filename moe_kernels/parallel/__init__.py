"""Parallelism applied to a finished model from outside (ARCHITECTURE.md, decision 7).

    mesh = expert_parallel_mesh(P, "cuda")          # (W / P, P) ranks: ("edp", "ep")
    apply_expert_parallel(model, mesh.ep_group)     # each rank keeps E/P experts, tokens dispatched
    ...loss.backward()
    all_reduce_gradients(model, None, expert_dp_group=mesh.edp_group)   # replicated parameters averaged
    all_reduce_expert_counts(model, None)           # before router.update_expert_bias()
    optimizer.step()

The gradient group (None: the world) is every rank that trains on its own batch (all expert-parallel
groups together); `edp_group` the ranks holding the same experts (None when P is the whole world).
"""

from moe_kernels.parallel.data_parallel import all_reduce_expert_counts, all_reduce_gradients, apply_global_load_balancing
from moe_kernels.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from moe_kernels.parallel.mesh import ExpertParallelMesh, expert_parallel_mesh

__all__ = [
    "ExpertParallelMesh",
    "all_reduce_expert_counts",
    "all_reduce_gradients",
    "apply_expert_parallel",
    "apply_global_load_balancing",
    "expert_parallel_mesh",
    "expert_parameters",
]
