"""`moe-train --plan` against what 4 gloo ranks really hold: for small configurations of every layout
parallelize builds, the plan's parameter, gradient, optimizer-state and activation bytes (and with pipeline
parallelism its gathered stage parameters) are within 5% of the bytes of each rank's tensors:

  parameters   the local shards of the rank's model (DTensor.to_local())
  gradients    their local gradients after the step's backward; with pp the stage's unsharded fp32
               accumulators FSDP holds when the schedule's last backward is done (before its reduce-scatter)
  optimizer    AdamW's state tensors after one step
  activations  the peak of the storages autograd saved for the backward (saved_tensors_hooks, each storage
               once, parameters excluded), over the whole forward and backward: with pp every micro-batch the
               schedule keeps in flight

fp32 throughout (gloo has no bf16 mixed precision), so the plan is asked with compute_dtype=torch.float32.
One spawn of 4 processes runs every layout in turn."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.layout import ParallelConfig
from moe_kernels.parallel.plan import plan_memory
from tests.distributed import run_world

pytestmark = pytest.mark.distributed

# Qwen3-style attention (GQA with q/k norms), a dense first layer, shared experts next to the routed ones.
MODEL = dict(first_k_dense=1, dense_ffn_size=64, shared_ffn_size=32, num_layers=3, max_seq_len=64)
B, S = 2, 64  # sequences of a micro-batch on each data-parallel rank, tokens each
LAYOUTS = [  # (name, ParallelConfig keywords, plan / parallelize options)
    ("FSDP", dict(dp_shard=4), {}),
    ("HSDP x EP", dict(dp_replicate=2, ep=2), {}),
    ("TP x FSDP", dict(tp=2), {}),
    ("EP x ETP", dict(ep=2, etp=2), {}),
    ("EP all_gather", dict(ep=4), dict(ep_backend="all_gather")),
    ("CP x TP", dict(cp=2, tp=2), {}),
    ("PP 2 x FSDP", dict(pp=2), dict(num_microbatches=2)),
    ("PP 2 x EP", dict(pp=2, ep=2), dict(num_microbatches=2)),
]
TOLERANCE = 0.05


class SavedBytes:
    """saved_tensors_hooks that track the bytes of the storages autograd holds for the backward (each once,
    parameters excluded) and their peak."""

    def __init__(self, model: nn.Module):
        self.model, self.live, self.current, self.peak = model, {}, 0, 0

    def _parameter_storages(self) -> set:
        # The tensors the modules hold now: FSDP's gathered parameters while their unit runs.
        return {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                for m in self.model.modules() for p in m._parameters.values() if p is not None}

    def pack(self, t):
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or isinstance(t, nn.Parameter) or key in self._parameter_storages():
            return t
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Held(t, self, key)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def release(self, key) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


class _Held:
    def __init__(self, t, owner: SavedBytes, key):
        self.t, self.owner, self.key = t, owner, key

    def __del__(self):
        self.owner.release(self.key)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _unsharded_stage_bytes(stage_module: nn.Module) -> tuple[int, int]:
    """(gathered parameters, gradient accumulators) FSDP holds for a pipeline stage, each FSDP unit once."""
    from torch.distributed.fsdp import FSDPModule

    states = {}
    for m in stage_module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            states[id(state)] = state
    params = grads = 0
    for state in states.values():
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                if not hasattr(fp, "_unsharded_param"):
                    continue
                unsharded = fp._unsharded_param
                params += unsharded.untyped_storage().nbytes()
                g = fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None else unsharded.grad
                grads += 0 if g is None else _nbytes(g)
    return params, grads


def _worker(rank, world):
    from torch.distributed.pipelining import stage as pipelining_stage

    from moe_kernels.parallel.parallelize import parallelize

    held = {}
    reduce_grad = pipelining_stage._PipelineStageBase.perform_reduce_grad

    def counting_reduce_grad(self, *args, **kwargs):  # the step's last backward is done, nothing reduced yet
        p, g = _unsharded_stage_bytes(self.submod)
        held["gathered"], held["grads"] = held.get("gathered", 0) + p, held.get("grads", 0) + g
        return reduce_grad(self, *args, **kwargs)

    pipelining_stage._PipelineStageBase.perform_reduce_grad = counting_reduce_grad
    problems = []
    try:
        for name, layout, options in LAYOUTS:
            held.clear()
            torch.manual_seed(0)
            cfg = PRESETS["tiny-qwen3-moe"](**MODEL)
            pc = ParallelConfig(**layout).resolve(world)
            n_mb = options.get("num_microbatches", 1)
            par = parallelize(build_model(cfg), pc, **options)
            optimizer = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
            ids = torch.randint(0, cfg.vocab_size, (B * n_mb, S + 1), generator=torch.Generator().manual_seed(rank))
            saved = SavedBytes(par.model)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                par.forward_backward(ids[:, :-1], ids[:, 1:])
            params = sum(_nbytes(p) for p in par.model.parameters())
            grads = held["grads"] if pc.pp > 1 else sum(_nbytes(p.grad) for p in par.model.parameters()
                                                         if p.grad is not None)
            optimizer.step()
            state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
            pp_rank = rank // (world // pc.pp)
            plan = plan_memory(cfg, pc, batch_size=B, seq_len=S, compute_dtype=torch.float32, pp_rank=pp_rank,
                               **options)
            pairs = [("parameters", plan.params, params), ("gradients", plan.grads, grads),
                     ("optimizer state", plan.optimizer, state), ("activations", plan.activations, saved.peak)]
            if pc.pp > 1:
                pairs.append(("gathered stage parameters", plan.gathered, held["gathered"]))
            for what, planned, real in pairs:
                if abs(planned / real - 1) > TOLERANCE:
                    problems.append(f"rank {rank} {name} ({pc.describe()}): {what} planned {planned:.0f} bytes, "
                                    f"held {real} ({planned / real - 1:+.1%})")
    finally:
        pipelining_stage._PipelineStageBase.perform_reduce_grad = reduce_grad
    assert not problems, "\n".join(problems)


def test_plan_counts_what_each_rank_holds():
    run_world(_worker, 4)
