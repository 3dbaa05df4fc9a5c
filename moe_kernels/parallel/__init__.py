"""Parallelism applied to a finished model from outside (ARCHITECTURE.md, decision 7).

    mesh = expert_parallel_mesh(P, "cuda")          # (W / P, P) ranks: ("edp", "ep")
    apply_expert_parallel(model, mesh.ep_group)     # each rank keeps E/P experts, tokens dispatched
    ...loss.backward()
    all_reduce_gradients(model, None, expert_dp_group=mesh.edp_group)   # replicated parameters averaged
    all_reduce_expert_counts(model, None)           # before router.update_expert_bias()
    optimizer.step()

Sharded data parallelism (FSDP2), tensor / sequence and context parallelism folded with expert
parallelism in one call, and the memory plan of any layout (also `moe-train --plan`):

    par = parallelize(model, ParallelConfig(tp=2, cp=2, ep=8))   # dp_shard: what the world leaves
    logits, aux = par.model(ids[:, :-1])                         # this rank's tokens of each sequence
    loss = par.cross_entropy(logits, ids[:, 1:]) + aux           # this rank's share of the batch's loss
    loss.backward(); par.clip_grad_norm_(1.0); optimizer.step()
    plan_memory(config, ParallelConfig(tp=2, ep=8).resolve(), batch_size=1, seq_len=4096).verdict()

The gradient group (None: the world) is every rank that trains on its own batch (all expert-parallel
groups together); `edp_group` the ranks holding the same experts (None when P is the whole world).
"""

from moe_kernels.parallel.checkpoint import load_sharded, save_sharded
from moe_kernels.parallel.data_parallel import all_reduce_expert_counts, all_reduce_gradients, apply_global_load_balancing
from moe_kernels.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from moe_kernels.parallel.layout import ParallelConfig
from moe_kernels.parallel.mesh import ExpertParallelMesh, expert_parallel_mesh
from moe_kernels.parallel.parallelize import Parallelized, parallelize
from moe_kernels.parallel.pipeline import Pipelined, apply_pipeline_parallel
from moe_kernels.parallel.plan import MemoryPlan, plan_memory

__all__ = [
    "ExpertParallelMesh",
    "MemoryPlan",
    "ParallelConfig",
    "Parallelized",
    "Pipelined",
    "all_reduce_expert_counts",
    "all_reduce_gradients",
    "apply_expert_parallel",
    "apply_global_load_balancing",
    "apply_pipeline_parallel",
    "expert_parallel_mesh",
    "expert_parameters",
    "load_sharded",
    "parallelize",
    "plan_memory",
    "save_sharded",
]
