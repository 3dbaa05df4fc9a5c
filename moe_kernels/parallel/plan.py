"""Per-GPU memory of a training layout, estimated without allocating the model (`moe-train --plan`).

The model is built on the meta device and its parameters sorted by how the layout shards them:
  experts          (w13, w2 of every MoE layer)   / (ep * etp), FSDP over expert_shard (edp in a replica)
  tensor-parallel  (attention, dense MLPs, shared experts, embeddings, LM head)   / tp, FSDP over dp_shard*cp
  replicated       (routers, norms)                FSDP over dp_shard*cp
Layers go to pp stages of ceil(L / pp) consecutive layers, the embedding on the first, the final norm and
the LM head on the last; the numbers are those of the stage that needs the most.

Bytes per parameter (the trainer's: fp32 master weights, bf16 compute): parameters 4, gradients 4 (fp32
reduction), AdamW state 8, all sharded as above; plus the bf16 copies FSDP gathers for compute, two layers
at a time (the one running and the one prefetched), sharded only by tp and ep * etp.

Activations, in bf16 bytes per token of one layer, saved for the backward pass (with flash attention, so
no S x S scores): attention 2H + 2 nh D + 2 nkv D (GQA; MLA: its latent and per-head projections), MoE
2H + k (2H + 3F / etp) + 2E (fp32 router logits), shared experts H + 3 F_s, dense MLP H + 3 F_d. Each
rank holds batch_size * seq_len / cp tokens of a micro-batch, split again by tp (sequence and head
parallelism); with EP the expert rows it processes are, on balanced routing, as many as its own tokens
bring. A pipeline's first stage keeps pp micro-batches in flight (1F1B). With activation checkpointing a
layer keeps only its input (H per token) and one layer at a time is recomputed in full. The last stage
adds the logits, V per token in bf16 and fp32, / tp.

A reserve of 5 GiB covers the CUDA context, communication buffers and allocator fragmentation. The
verdict compares the total with the GPU's memory (80 GB by default). It is an estimate with stated
terms, not a measurement.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from moe_kernels.parallel.layout import ParallelConfig

GiB = 1 << 30
RESERVE = 5 * GiB


@dataclass(frozen=True)
class MemoryPlan:
    layout: ParallelConfig
    params: float  # bytes per GPU
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded bf16 layers in flight
    activations: float
    reserve: float
    gpu_bytes: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def verdict(self) -> str:
        gb = self.gpu_bytes / 1e9
        if self.fits:
            return f"fits: {self.total / GiB:.1f} GiB of a {gb:.0f} GB GPU"
        biggest = max(("parameters + gradients + optimizer state", self.params + self.grads + self.optimizer),
                      ("activations", self.activations), key=lambda kv: kv[1])
        hint = ("shard them over more ranks (dp_shard, ep, pp)" if biggest[0].startswith("param")
                else "use activation checkpointing, fewer tokens per micro-batch, or more cp / tp / pp")
        return (f"does not fit: {self.total / GiB:.1f} GiB needed on a {gb:.0f} GB GPU "
                f"({self.total / GiB - self.gpu_bytes / GiB:.1f} GiB over); most is {biggest[0]} "
                f"({biggest[1] / GiB:.1f} GiB): {hint}")

    def table(self) -> str:
        rows = [("parameters (fp32, sharded)", self.params), ("gradients (fp32, sharded)", self.grads),
                ("optimizer state (AdamW, fp32)", self.optimizer), ("FSDP-gathered layers (bf16)", self.gathered),
                ("activations", self.activations), ("reserve (context, buffers)", self.reserve),
                ("total", self.total)]
        return "\n".join(f"  {name:<32}{v / GiB:>9.2f} GiB" for name, v in rows)


_LAYER = re.compile(r"^layers\.(\d+)\.")


def _category(name: str, ndim: int) -> str:
    if ".experts." in name:
        return "expert"
    if ".router." in name or ndim < 2:
        return "replicated"
    return "tp"


def _per_token_activation_bytes(cfg, layer: int, pc: ParallelConfig) -> float:
    """bf16 bytes one token leaves for the backward pass in one layer (module docstring)."""
    H = cfg.hidden_size
    if cfg.mla is None:
        D = cfg.attn_head_dim
        attn = 2 * H + 2 * cfg.num_heads * D + 2 * cfg.num_kv_heads * D
    else:
        m = cfg.mla
        q = (m.q_lora_rank or 0) * 2 + cfg.num_heads * m.qk_head_dim
        kv = 2 * (m.kv_lora_rank + m.qk_rope_head_dim) + cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        attn = 2 * H + q + kv + cfg.num_heads * m.v_head_dim
    if layer < cfg.first_k_dense:
        mlp = H + 3 * cfg.dense_ffn_size
    else:
        moe = cfg.moe
        k, F = moe.router.k, moe.ffn_size
        mlp = 2 * H + k * (2 * H + 3 * F / pc.etp) + 2 * moe.num_experts
        if moe.shared_ffn_size:
            mlp += H + 3 * moe.shared_ffn_size
    return 2 * (attn + mlp) / pc.tp


def plan_memory(cfg, pc: ParallelConfig, *, batch_size: int, seq_len: int, activation_checkpointing: bool = False,
                gpu_bytes: float = 80e9) -> MemoryPlan:
    """Per-GPU memory of training model config `cfg` (moe_kernels.models) under the resolved layout `pc`,
    `batch_size` sequences of `seq_len` tokens per data-parallel rank and micro-batch."""
    from moe_kernels.models import build_model

    pc.check_model(cfg, seq_len)
    with torch.device("meta"):
        model = build_model(cfg)
    L, pp = cfg.num_layers, pc.pp
    per_stage = math.ceil(L / pp)
    stages = [dict(expert=0.0, tp=0.0, replicated=0.0) for _ in range(pp)]
    layer_params = [0.0] * L  # per-GPU bf16 copy sizes (tp and ep sharding only), for FSDP's gathers
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            stage = layer // per_stage
        else:
            layer = None
            stage = 0 if name.startswith("embed") else pp - 1
        cat = _category(name, p.dim())
        n = p.numel()
        if cat == "expert":
            local = n / (pc.ep * pc.etp)
            stages[stage]["expert"] += local / pc.expert_shard
        elif cat == "tp":
            local = n / pc.tp
            stages[stage]["tp"] += local / (pc.dp_shard * pc.cp)
        else:
            local = n
            stages[stage]["replicated"] += local / (pc.dp_shard * pc.cp)
        if layer is not None:
            layer_params[layer] += local
    worst = max(range(pp), key=lambda s: sum(stages[s].values()))
    n_params = sum(stages[worst].values())
    gathered = 2 * 2 * max(layer_params[s] for s in range(L))  # two bf16 layers in flight

    tokens = batch_size * seq_len / pc.cp  # per rank and micro-batch
    first = range(0, min(per_stage, L))
    per_layer = [_per_token_activation_bytes(cfg, i, pc) for i in first]
    in_flight = pp  # the first stage under 1F1B
    if activation_checkpointing:
        acts = tokens * (in_flight * len(per_layer) * 2 * cfg.hidden_size / pc.tp + max(per_layer))
    else:
        acts = tokens * in_flight * sum(per_layer)
    logits = tokens * cfg.vocab_size * (2 + 4) / pc.tp  # on the last stage
    if pp == 1:
        acts += logits
    else:
        last = range((pp - 1) * per_stage, L)
        last_acts = tokens * (sum(_per_token_activation_bytes(cfg, i, pc) for i in last) if not activation_checkpointing
                              else len(last) * 2 * cfg.hidden_size / pc.tp) + logits
        acts = max(acts, last_acts)
    return MemoryPlan(pc, params=4 * n_params, grads=4 * n_params, optimizer=8 * n_params, gathered=gathered,
                      activations=acts, reserve=RESERVE, gpu_bytes=gpu_bytes)
