"""Parallel layouts: how W ranks split a MoE model, attention and experts on two meshes over the same ranks.

    attention mesh  pp x dp_replicate x dp_shard x cp x tp
    expert mesh     pp x edp x ep x etp,   ep * etp dividing dp_shard * cp * tp

("parallel folding", the MoE Parallel Folding paper: the experts fold their ep x etp ranks into the
attention's dp_shard x cp x tp ranks of each pipeline stage and data-parallel replica; edp is what is left,
edp = dp_replicate * dp_shard * cp * tp / (ep * etp).)

- dp_replicate: plain data parallelism (replicas, gradients all-reduced);
- dp_shard: data parallelism with parameters, gradients and optimizer state sharded (FSDP);
- tp: tensor parallelism for attention and the dense layers, with sequence parallelism in between;
- cp: context parallelism, each rank one part of every sequence;
- pp: pipeline stages of consecutive layers;
- ep: expert parallelism, each rank E / ep experts of every MoE layer;
- etp: expert tensor parallelism, each expert's ffn width split over etp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "etp")


@dataclass(frozen=True)
class ParallelConfig:
    """The sizes of the parallel dimensions; dp_shard None means "whatever the world leaves" (resolve)."""

    dp_shard: int | None = None
    dp_replicate: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self):
        for name in DIMS:
            v = getattr(self, name)
            if v is None and name == "dp_shard":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelConfig: {name} must be an int >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        """Ranks of the layout (dp_shard resolved)."""
        if self.dp_shard is None:
            raise ValueError("ParallelConfig: dp_shard is not resolved yet (resolve(world_size) first)")
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks holding the same experts in one pipeline stage (the replicas
        included); parallelize FSDP-shards each expert over all of them."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    def smallest_world(self) -> int:
        """The fewest ranks this layout runs on: dp_shard as given, or the smallest that makes ep * etp
        divide dp_shard * cp * tp (`tp=2, ep=8` gives 8 ranks, dp_shard 4)."""
        if self.dp_shard is not None:
            return self.world_size
        inner = self.cp * self.tp
        return self.pp * self.dp_replicate * math.lcm(inner, self.ep * self.etp)

    def resolve(self, world_size: int | None = None) -> "ParallelConfig":
        """dp_shard filled in from `world_size` (None: the smallest world), every rule checked; raises
        ValueError naming the numbers when the layout is impossible."""
        fixed = self.pp * self.dp_replicate * self.cp * self.tp
        if world_size is None:
            world_size = self.smallest_world()
        if self.dp_shard is None:
            if world_size % fixed:
                raise ValueError(f"world size {world_size} is not a multiple of pp*dp_replicate*cp*tp = "
                                 f"{self.pp}*{self.dp_replicate}*{self.cp}*{self.tp} = {fixed}")
            pc = replace(self, dp_shard=world_size // fixed)
        else:
            pc = self
            if pc.world_size != world_size:
                raise ValueError(f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*"
                                 f"{self.cp}*{self.tp} = {pc.world_size} ranks, but the world has {world_size}")
        inner = pc.dp_shard * pc.cp * pc.tp
        if inner % (pc.ep * pc.etp):
            raise ValueError(f"ep*etp = {pc.ep}*{pc.etp} = {pc.ep * pc.etp} must divide dp_shard*cp*tp = "
                             f"{pc.dp_shard}*{pc.cp}*{pc.tp} = {inner} (the experts fold into the attention's ranks "
                             "of one stage and replica)")
        return pc

    def check_model(self, cfg, seq_len: int) -> None:
        """Rules the model sets (cfg: a moe_kernels.models ModelConfig); ValueError naming the numbers."""
        moe = cfg.moe
        problems = []
        if moe.num_experts % self.ep:
            problems.append(f"ep={self.ep} must divide the {moe.num_experts} experts")
        if moe.ffn_size % self.etp:
            problems.append(f"etp={self.etp} must divide the expert ffn size {moe.ffn_size}")
        if cfg.num_heads % self.tp:
            problems.append(f"tp={self.tp} must divide the {cfg.num_heads} attention heads")
        if cfg.mla is None and cfg.num_kv_heads % self.tp and self.tp % cfg.num_kv_heads:
            problems.append(f"tp={self.tp} and the {cfg.num_kv_heads} key/value heads must divide one another")
        if self.pp > cfg.num_layers:
            problems.append(f"pp={self.pp} stages for {cfg.num_layers} layers")
        if seq_len % (2 * self.cp) and self.cp > 1:
            problems.append(f"the sequence length {seq_len} must be a multiple of 2*cp = {2 * self.cp} "
                            "(load-balanced causal sharding: two chunks per rank)")
        if self.tp > 1 and (seq_len // self.cp) % self.tp:
            where = f"each context-parallel rank's {seq_len // self.cp} tokens" if self.cp > 1 else \
                f"the sequence length {seq_len}"
            problems.append(f"{where} must be a multiple of tp={self.tp} (sequence parallelism)")
        if problems:
            raise ValueError("impossible layout: " + "; ".join(problems))

    def describe(self) -> str:
        return (f"{self.world_size} ranks: attention pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
                f"{self.dp_shard} x cp {self.cp} x tp {self.tp}; experts pp {self.pp} x edp {self.edp} x ep {self.ep} "
                f"x etp {self.etp}")
