"""Parallelism applied to a finished model from outside (ARCHITECTURE.md, decision 7).

    apply_expert_parallel(model, ep_group)          # each rank keeps E/P experts, tokens dispatched
    ...loss.backward()
    all_reduce_gradients(model, world, expert_dp_group=replicas)   # replicated parameters averaged
    all_reduce_expert_counts(model, world)          # before router.update_expert_bias()
    optimizer.step()

`world` is every rank that trains on its own batch (all expert-parallel groups together), `replicas` the
ranks holding the same experts (None when the expert-parallel group is the whole world).
"""

from moe_kernels.parallel.data_parallel import all_reduce_expert_counts, all_reduce_gradients, apply_global_load_balancing
from moe_kernels.parallel.expert_parallel import apply_expert_parallel, expert_parameters

__all__ = [
    "all_reduce_expert_counts",
    "all_reduce_gradients",
    "apply_expert_parallel",
    "apply_global_load_balancing",
    "expert_parameters",
]
