"""Per-GPU memory of a training layout, estimated without allocating the model (`moe-train --plan`).

The model is built on the meta device and its parameters sorted by how parallelize shards them:
  experts     (w13, w2 of every MoE layer)       / (ep * etp), FSDP over edp (the replicas included), or in
              their block's unit over dp_shard without ep, etp, tp and cp
  split       (the q, k, v and o projections, MLA's q / q_b, kv_b and o, the dense MLPs: tensor_parallel's
              column and row slices; k and v only when tp divides the kv heads)   / tp, FSDP over dp_shard*cp
  replicated  (everything else: embeddings, LM head, norms, routers, shared experts, MLA's latent
              projections)   whole on every tp rank, FSDP over dp_shard*cp*tp
so a rank holds n / (tp * dp_shard * cp) of every non-expert parameter, and unsharded (FSDP's gathered copy)
n / tp of a split one and n of a replicated one.
Layers go to pp * stages_per_rank stages as moe_kernels.parallel.pipeline.stage_bounds splits them (the first
num_layers % stages stages one layer longer), pipeline rank r holding stages r, r + pp, ...; the embedding is on
the first stage, the final norm and the LM head on the last. The numbers are those of one pipeline rank:
`pp_rank`, or by default the one whose total is largest.

Parameters and their state (the trainer's: fp32 master weights, AdamW): parameters 4 bytes, AdamW state 8,
sharded as above. Compute happens in `compute_dtype` (bf16 under FSDP's mixed precision on CUDA; fp32 on
gloo/CPU, where there is none), c bytes an element; "a layer" below is a transformer block's parameters
sharded only by tp and ep * etp.
- Without pipeline parallelism: gradients 4 bytes, sharded as above (FSDP reduce-scatters them in fp32 after
  each unit's backward); FSDP's gathered copies in the compute dtype: two layers in flight (the one running
  and the one prefetched) plus, with tp = 1, the root unit's parameters (embedding, final norm, LM head), which
  torch 2.13's fully_shard keeps gathered from the forward to the backward (reshard_after_forward is False for
  a root).
- With pipeline parallelism, torch.distributed.pipelining (2.13) runs every micro-batch's backward through
  `backward_maybe_with_nosync`, which calls `set_reshard_after_backward(False)` and
  `set_requires_gradient_sync(False)` on the stage's FSDP root (recursively, every unit of the stage);
  only `perform_reduce_grad`, after the step's last backward, reduce-scatters and reshards. So during a
  step a rank holds, for every parameter of its stages: the gathered copy in the compute dtype (a backward
  leaves the whole stage gathered; the next forward reshards unit by unit and gathers again), and an
  unsharded gradient accumulator in fp32 (FSDP's `unsharded_accumulated_grad` in the reduce dtype under
  mixed precision, the unsharded parameter's fp32 `.grad` without it). The plan counts both, unsharded
  (sharded only by tp and ep * etp), instead of FSDP's two layers and the sharded gradients.

With `master_weights` (the trainer's paths without FSDP: one process, or expert-parallel replicas;
moe_kernels.train.master), per parameter a rank holds whole (its experts' slice): the fp32 master 4, a bf16 copy
c (not the routers', which compute in fp32), the fp32 main gradient 4 and AdamW 8; and transiently one bf16
gradient, the largest, until its hook adds it into its main gradient. Nothing is gathered.

Activations: the tensors autograd saves for the backward (what torch.autograd.graph.saved_tensors_hooks sees, each
storage once: a saved view holds its whole base), per micro-batch, read from the code of moe_kernels.models, .nn,
.dispatch and .parallel as it runs on the registered ops (CUDA's fused regions keep no more: the one-rank layer's `moe`
and `experts` regions, the `experts` region on the expert-parallel path's dispatched rows and the shared experts' `mlp`
region write the activation again in their backward instead of keeping it, R c F and T c Fs fewer than counted here, and
the shared experts' stacked gate and up weights, 2 c Fs H, without autocast; the `moe` region permutes x again in its
backward instead of keeping the permuted copy, R c H fewer). c is the compute dtype's bytes; b sequences of S tokens a
micro-batch; T = b S / (cp tp) the rank's tokens, Ta = b S / cp those its attention sees (tp gathers them), Tk = b S the
keys and values context parallelism gathers; nh = heads / tp, nkv = kv heads / tp, kvs = nkv, or when tp > kv heads nkv
= 1 and kvs = kv heads (each rank slices its head out of the whole projection, whose output the slice keeps); D head
dim. An RMSNorm over n features keeps N(n) = (4 + c) n + 4 a row (its fp32 input: a copy, or in fp32 the input itself;
the rsqrt; the normalised rows). Per layer:
  norms        2 T N(H)
  attention    Ta (c H + 2 c nh D + 4 nh)   projections' input, rotated q, output (o_proj's input), lse
               + without cp: Ta c (nkv + kvs) D   rotated k; v (the projection's output)
               + with cp: Ta c nh D + Tk 2 c nh D + 2 (S / cp) rope_dim c   the chunks' outputs concatenated;
                 the gathered keys and values (grouped-query heads repeated); the rank's rotary rows
               + q/k norms (Qwen3): Ta ((4 + c) nh D + 4 nh + 4 kvs' D + c nkv D + 4 nkv), kvs' = kvs in fp32
                 (the norm's input is then the projection's output), nkv otherwise
               MLA (DeepSeek) as a GPU runs it (fused attention; on the CPU, unequal head dims take the
                 math path and its S x S scores): Ta (c H + c nh (2 qk + nope + 2 v) + 4 nh + N(q_lora) +
                 c q_lora + 4 (kv_lora [+ rope in fp32]) + 4 + 2 c kv_lora), with cp the gathered k and v
  dense MLP    Tm (c H + 4 c F / tp), Tm = Ta under tp (the gathered input; gate, silu, up, product), else T
  MoE          T (c H + 4 E + 4 k)   router: its input (x itself, not an fp32 copy), logits, choices
               + T 4 c Fs   shared experts (their input is the router's: no c H)
               + the routed experts: R grouped rows of c (H + 3 F / etp) (input, gate/up, activation) and
                 the dispatch's row maps, weights and rows by backend below
  once         rotary tables 2 S rope_dim c (without cp), token ids 8 T; on the last stage T (N(H) + c H +
               4 V + 8) (final norm, LM head input, log-softmax, labels)
Routed experts, Td = T etp the tokens a dispatch carries (etp gathers them), k slots, E experts, El = E / ep
local ones, a = align, f = `capacity`, a factor of the balanced load Td k (moe_kernels.dispatch):
  ep = 1        R = Td k + min(E, Td k)(a - 1) (permute's worst case, reached); T 8k + R c H (row map,
                weights; the expert outputs unpermute keeps); with etp: Td 9k + R (c H + 8)
  all_to_all    R = f Td k + El (a - 1), f None: 1 (balanced routing; the backend holds what routing sends,
                so f > 1 sizes a busier rank); Td (17 k + c H k) + 5 N + 8 R, N = f Td k (the source's row
                map, masks, indices, weights and its Td k returned rows; the receiver's row map and masks)
  all_gather    R = ep Td k + El (a - 1) whatever f (every gathered pair: the worst case it allocates);
                ep Td 9k + R (4 H + 8) (row map, masks, weights; combine's fp32 partial sums)
  nvlink        R = min(C, ep M k) + El (a - 1), C = ceil(f M k) (f None: ep M k, the backend's default,
                every token of every rank here), M = Td (moe-train's max_tokens_per_rank, times etp);
                Td (8 k + c H k) + X (8 + 4 k), X = min(ep M, C) (source rows, weights, combine's saved slot
                rows; the handle's sources and row map). Its peer buffers, once per rank for every layer:
                ep M (8 + 8 k) + X c H (dispatch) + M k (c H + 4) (combine), the nvlink row of the table.
Pipelines keep several micro-batches in flight: 1F1B min(n, pp - s) on stage s, GPipe all n, interleaved
1F1B torch's warm-up count + 1 chunks, in its order over the rank's stages; n = num_microbatches (default
pp). With activation checkpointing a layer keeps only its input (c H a token; torch.utils.checkpoint holds it,
no saved-tensor hook sees it), the stage's ids and loss terms stay as above, and one layer at a time is
recomputed in full during the backward.

Not in the activations row (saved-tensor hooks do not see them), in the "logits, loss, stage buffers" row:
with the fused loss (linear_cross_entropy, moe-train's default) the gradients it computes in the forward and
holds until the backward, c H a token and up to 4 V H for the head's (fp32 or the weight's dtype), its fp32
accumulator of 4 V H, and one chunk's fp32 logits and gradient, (4 + c) V a row; without it the logits the
step holds through the backward and the loss's fp32 transients, (c + 8) V a token on the last stage. A
pipeline stage's received input and output, c H a token each, per micro-batch in flight.

Checked on the CPU: one process's saved bytes in fp32 and bf16 (tests/parallel/test_plan.py, within 0.1%),
and on 4 gloo ranks (fp32) the parameter, gradient, optimizer and activation bytes of every layout
parallelize builds within 5% (tests/parallel/test_plan_bytes.py; 2% seen, the rest routing imbalance
and, with cp, the attention mask the CPU materialises, [S / 2cp, S] fp32 a layer, which a GPU's kernels do
not).

A reserve of 5 GiB covers the CUDA context, NCCL's buffers and allocator fragmentation. The verdict compares
the total with the GPU's memory (80 GB by default). It is an estimate with stated terms, not a measurement.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from moe_kernels.parallel.layout import ParallelConfig

GiB = 1 << 30
RESERVE = 5 * GiB
EP_BACKENDS = ("all_to_all", "all_gather", "nvlink")
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


@dataclass(frozen=True)
class MemoryPlan:
    layout: ParallelConfig
    params: float  # bytes per GPU
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded parameters in the compute dtype (with pp: the rank's whole stages)
    activations: float  # saved for the backward, every micro-batch in flight
    reserve: float
    gpu_bytes: float
    workspace: float = 0.0  # held logits and the loss's transients; pipeline stage inputs and outputs
    dispatch: float = 0.0  # the nvlink backend's peer buffers
    pp_rank: int = 0  # the pipeline rank these numbers are for
    compute_dtype: torch.dtype = torch.bfloat16
    master_weights: bool = False  # params: fp32 masters + compute copies; grads: fp32 main + one compute-dtype

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.gathered + self.activations + self.workspace
                + self.dispatch + self.reserve)

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
        dt = str(self.compute_dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
        pipelined = self.layout.pp > 1
        if self.master_weights:
            rows = [(f"parameters (fp32 + {dt} copies)", self.params),
                    (f"gradients (fp32 + one {dt})", self.grads)]
        else:
            rows = [("parameters (fp32, sharded)", self.params),
                    ("gradients (fp32, stage unsharded)" if pipelined else "gradients (fp32, sharded)", self.grads)]
        rows += [("optimizer state (AdamW, fp32)", self.optimizer),
                 (f"stage parameters gathered ({dt})" if pipelined else f"FSDP-gathered layers ({dt})", self.gathered),
                 ("activations", self.activations), ("logits, loss, stage buffers", self.workspace)]
        if self.master_weights:  # no FSDP
            del rows[3]
        if self.dispatch:
            rows.append(("nvlink dispatch buffers", self.dispatch))
        rows += [("reserve (context, buffers)", self.reserve), ("total", self.total)]
        head = f"  (pipeline rank {self.pp_rank} of {self.layout.pp})\n" if pipelined else ""
        return head + "\n".join(f"  {name:<36}{v / GiB:>9.2f} GiB" for name, v in rows)


_LAYER = re.compile(r"^layers\.(\d+)\.")
_SPLIT = re.compile(r"\.(self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj|k_proj|v_proj)"
                    r"|mlp\.(gate_proj|up_proj|down_proj))\.weight$")


def _category(cfg, name: str, tp: int) -> str:
    """How parallelize shards parameter `name` (module docstring): "expert", "split" or "replicated"."""
    if ".experts." in name and "lora_" not in name:  # (peft's factors on the experts stay replicated)
        return "expert"
    m = _SPLIT.search(name)
    if m is None:
        return "replicated"
    if m.group(2) in ("k_proj", "v_proj") and cfg.num_kv_heads % tp:
        return "replicated"  # fewer kv heads than tp ranks: each rank holds the projection whole
    return "split"


# ---------------------------------------------------------------------------------------------------
# Activations (module docstring): bytes saved for the backward by one rank, one micro-batch


def _norm(n: float, c: int) -> float:
    """RMSNorm over n features, per row: its fp32 input, the rsqrt, the normalised rows."""
    return (4 + c) * n + 4


def _attention(cfg, pc: ParallelConfig, c: int, b: int, S: int) -> float:
    tp, cp = pc.tp, pc.cp
    Ta, Tk = b * S / cp, b * S
    H = cfg.hidden_size
    total = Ta * c * H  # the projections' input (tp: the gathered chunks)
    nh = cfg.num_heads // tp
    if cfg.mla is None:
        D = cfg.attn_head_dim
        if cfg.num_kv_heads % tp == 0:
            nkv = kvs = cfg.num_kv_heads // tp
        else:  # each rank keeps its query heads' kv head of the projection's whole output
            nkv, kvs = 1, cfg.num_kv_heads
        per = 2 * c * nh * D + 4 * nh  # rotated q, output (o_proj's input), log-sum-exp
        if cfg.qk_norm:
            per += _norm(nh * D, c) - 4 + 4 * nh  # q_norm over every head's rows
            per += 4 * (kvs if c == 4 else nkv) * D + c * nkv * D + 4 * nkv  # k_norm (fp32: its input's base)
        if cp == 1:
            per += c * nkv * D + c * kvs * D  # rotated k, v (a view of the projection's output)
            return total + Ta * per
        per += c * nh * D  # the two chunks' outputs concatenated
        return total + Ta * per + Tk * 2 * c * nh * D  # gathered k, v (grouped-query heads repeated)
    m = cfg.mla
    qk, vd, kl = m.qk_head_dim, m.v_head_dim, m.kv_lora_rank
    per = c * nh * qk + c * nh * vd + 4 * nh  # q (nope and rotated rope concatenated), output, log-sum-exp
    if m.q_lora_rank:
        per += _norm(m.q_lora_rank, c) + c * m.q_lora_rank  # q_a_layernorm, q_b_proj's input
    per += 4 * (kl + m.qk_rope_head_dim if c == 4 else kl) + 4 + c * kl + c * kl  # kv_a_layernorm, kv_b's input
    if cp == 1:
        per += c * nh * qk + c * nh * (m.qk_nope_head_dim + vd)  # k; v, a view of kv_b's output
        return total + Ta * per
    per += c * nh * vd
    return total + Ta * per + Tk * c * nh * (qk + vd)


def _routed(cfg, pc: ParallelConfig, tokens: float, ep_backend: str, capacity: float | None) -> tuple[float, float]:
    """(R, N): the grouped rows one rank's experts hold per MoE layer and micro-batch, padding included, and
    the (token, slot) pairs among them (module docstring); `tokens` the rank's tokens (after cp and tp)."""
    moe = cfg.moe
    k, E, align = moe.router.k, moe.num_experts, moe.permute_align
    Td = tokens * pc.etp
    if pc.ep == 1:
        return Td * k + min(E, Td * k) * (align - 1), Td * k
    pad = E // pc.ep * (align - 1)
    worst = pc.ep * Td * k  # every pair of the ep group's tokens here
    if ep_backend == "all_gather":
        N = worst
    elif ep_backend == "nvlink":
        N = worst if capacity is None else min(math.ceil(capacity * Td * k), worst)
    else:
        N = (1.0 if capacity is None else capacity) * Td * k
    return N + pad, N


def routed_rows(cfg, pc: ParallelConfig, tokens: float, ep_backend: str = "all_to_all",
                capacity: float | None = None) -> float:
    """Grouped expert rows (padding included) one rank holds per MoE layer and micro-batch of `tokens` tokens a
    rank (after cp and tp), as the ep_backend allocates them (module docstring)."""
    return _routed(cfg, pc, tokens, ep_backend, capacity)[0]


def _moe(cfg, pc: ParallelConfig, c: int, T: float, ep_backend: str, capacity: float | None) -> float:
    moe = cfg.moe
    H, E, k = cfg.hidden_size, moe.num_experts, moe.router.k
    total = T * (c * H + 4 * E + 4 * k)  # router: its input x (not an fp32 copy), logits, choices
    if moe.shared_ffn_size:  # (their input is the router's)
        per = 4 if moe.activation == "swiglu" else 2  # kept per shared row: gate, up, ... (no gate: up, activation)
        total += T * per * c * moe.shared_ffn_size
        if moe.shared_gate:
            total += T * (c * H + c)
    Td = T * pc.etp
    R, N = _routed(cfg, pc, T, ep_backend, capacity)
    # a grouped row: input, gate/up, activation (without a gate: input, up, activation)
    grouped = c * (H + (3 if moe.activation == "swiglu" else 2) * moe.ffn_size / pc.etp)
    if pc.ep == 1 and pc.etp == 1:  # permute's row map, unpermute's weights and expert outputs
        return total + T * 8 * k + R * (grouped + c * H)
    if pc.ep == 1:  # the etp group's tokens on a LocalDispatcher: its row values' masks and indices too
        return total + Td * 9 * k + R * (grouped + c * H + 8)
    if ep_backend == "all_gather":  # over every gathered token; combine's fp32 partial sums
        return total + pc.ep * Td * 9 * k + R * (grouped + 4 * H + 8)
    if ep_backend == "nvlink":  # source rows, weights, combine's slot rows; the handle's sources and row map
        X = min(pc.ep * Td, N)
        return total + Td * (8 * k + c * H * k) + X * (8 + 4 * k) + R * grouped
    # all_to_all: the source's row map, masks, indices, weights and returned rows; the receiver's
    return total + Td * (17 * k + c * H * k) + N * 5 + R * (grouped + 8)


def _layer(cfg, pc: ParallelConfig, i: int, c: int, b: int, S: int, ep_backend: str, capacity) -> float:
    """One transformer block's saved bytes for one micro-batch (without the rotary tables it shares)."""
    H = cfg.hidden_size
    T = b * S / (pc.cp * pc.tp)
    total = 2 * T * _norm(H, c) + _attention(cfg, pc, c, b, S)
    if pc.cp > 1:  # the rotary rows of the rank's positions, taken per layer
        total += 2 * (S / pc.cp) * cfg.rope_dim * c
    if i < cfg.first_k_dense:
        F = cfg.dense_ffn_size
        Tm = T * pc.tp
        return total + Tm * (c * H + 4 * c * F / pc.tp)
    return total + _moe(cfg, pc, c, T, ep_backend, capacity)


def _stage_activations(cfg, pc: ParallelConfig, layers: range, first: bool, last: bool, c: int, b: int, S: int,
                       checkpointing: bool, ep_backend: str, capacity, fused_loss: bool = True
                       ) -> tuple[float, float, float]:
    """(saved bytes, workspace bytes, a recomputed layer's saved bytes under checkpointing) of one stage and one
    micro-batch."""
    H, V = cfg.hidden_size, cfg.vocab_size
    T = b * S / (pc.cp * pc.tp)
    per_layer = [_layer(cfg, pc, i, c, b, S, ep_backend, capacity) for i in layers]
    recompute = 0.0
    if checkpointing:  # each layer keeps its input; one layer at a time recomputed in full in the backward
        acts = len(per_layer) * T * c * H
        recompute = max(per_layer, default=0.0) + (2 * S * cfg.rope_dim * c if pc.cp == 1 else 0.0)
    else:
        acts = sum(per_layer)
        if per_layer and pc.cp == 1:
            acts += 2 * S * cfg.rope_dim * c  # cos, sin: once a forward, every layer's
    if first:
        acts += 8 * T  # token ids
    workspace = 0.0
    if last and fused_loss:
        from moe_kernels.nn.linear_cross_entropy import default_chunk_size

        acts += T * _norm(H, c)  # the final norm; the fused loss saves nothing, it holds its gradients
        workspace += T * c * H + 8 * V * H + min(T, default_chunk_size(V)) * (4 + c) * V
    elif last:
        acts += T * (_norm(H, c) + c * H + 4 * V + 8)  # final norm, LM head input, log-softmax, labels
        workspace += T * (c + 8) * V  # the held logits; the loss's fp32 copy and gradients
    else:
        workspace += T * c * H  # the stage's output, held for its backward
    if not first:
        workspace += T * c * H  # the received input
    return acts, workspace, recompute


def _in_flight(schedule: str, pp: int, rank: int, n: int, v: int) -> int:
    """Micro-batch forwards whose activations pipeline rank `rank` holds at once (chunks, interleaved)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n * v
    if schedule == "interleaved-1f1b":  # torch's _get_warmup_ops, then one more forward before a backward
        warmup = (v - 1) * _per_round(pp, n) + 2 * (pp - 1 - rank)
        return min(warmup + 1, n * v)
    return min(n, pp - rank)


def _per_round(pp: int, n: int) -> int:
    """Micro-batches of a round of torch's interleaved schedule (ScheduleInterleaved1F1B)."""
    return n // max(1, n // pp)


def plan_memory(cfg, pc: ParallelConfig, *, batch_size: int, seq_len: int, activation_checkpointing: bool = False,
                gpu_bytes: float = 80e9, compute_dtype: torch.dtype = torch.bfloat16, ep_backend: str = "all_to_all",
                capacity: float | None = None, num_microbatches: int | None = None, schedule: str = "1f1b",
                stages_per_rank: int | None = None, pp_rank: int | None = None, fused_loss: bool = True,
                master_weights: bool = False) -> MemoryPlan:
    """Per-GPU memory of training model config `cfg` (moe_kernels.models) under the resolved layout `pc`
    (module docstring).

    batch_size: sequences of `seq_len` tokens per data-parallel rank and micro-batch. compute_dtype: the
    dtype of FSDP's gathered parameters and of the activations (bf16 under mixed precision on CUDA; fp32 on
    the CPU). ep_backend and capacity: the expert-parallel dispatch and its capacity as a factor of the
    balanced load (None: the backend's default, the worst case for nvlink; moe_kernels.dispatch).
    num_microbatches (default pp), schedule ("1f1b", "gpipe", "interleaved-1f1b") and stages_per_rank
    (default 2 for the interleaved schedule, else 1): the pipeline's. pp_rank: the pipeline rank to report
    (default: the one whose total is largest). fused_loss: the LM loss by linear_cross_entropy (moe-train's
    default, TrainConfig.fused_ce) or over materialised logits. master_weights: the trainer's path without FSDP
    (a layout of expert parallelism alone) with fp32 master weights and bf16 copies (module docstring)."""
    from moe_kernels.models import build_model
    from moe_kernels.parallel.pipeline import stage_bounds

    pc.check_model(cfg, seq_len)
    if ep_backend not in EP_BACKENDS:
        raise ValueError(f"plan_memory: ep_backend must be one of {EP_BACKENDS}, got {ep_backend!r}")
    if capacity is not None and not capacity > 0:
        raise ValueError(f"plan_memory: capacity must be a factor > 0 of the balanced load, or None; got {capacity!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"plan_memory: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if master_weights and pc.tp * pc.cp * pc.pp * pc.etp * pc.dp_replicate > 1:
        raise ValueError("plan_memory: master_weights is the trainer's path without FSDP (expert parallelism alone); "
                         f"this layout ({pc.describe()}) trains under FSDP's mixed precision")
    c = torch.empty((), dtype=compute_dtype).element_size()
    P = pc.pp
    v = stages_per_rank if stages_per_rank is not None else (2 if schedule == "interleaved-1f1b" and P > 1 else 1)
    n_mb = P if num_microbatches is None else num_microbatches
    L = cfg.num_layers
    bounds = stage_bounds(L, P * v)
    stage_of = {i: s for s, (lo, hi) in enumerate(bounds) for i in range(lo, hi)}
    with torch.device("meta"):
        model = build_model(cfg)
    fp32_kept = {n for n, p in build_model(cfg, device="meta", dtype=compute_dtype).named_parameters()
                 if p.dtype == torch.float32} if compute_dtype != torch.float32 else set(model.state_dict())

    # The experts' own FSDP unit spans edp, the replicas included; without ep, etp, tp and cp they are in their
    # block's unit, over dp_shard (replicated over dp_replicate).
    expert_fsdp = pc.edp if pc.ep * pc.etp * pc.tp * pc.cp > 1 else pc.dp_shard
    # Per pipeline rank: sharded (FSDP) and unsharded (tp, ep * etp only) element counts; per layer the latter.
    sharded, unsharded = [0.0] * P, [0.0] * P
    fp8_codes = [0.0] * P  # the FP8 all-gather's codes each expert shard keeps between steps (quant.fsdp_fp8)
    fp8_gather = _fp8_all_gather_applies(cfg, pc, expert_fsdp) and not master_weights
    layer_local = [0.0] * L
    root_local = 0.0  # the parameters outside the blocks (embedding, final norm, LM head)
    copied, largest = [0.0] * P, [0.0] * P  # master_weights: local elements with a compute copy; the largest
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else None
        if layer is not None:
            stage = stage_of[layer]
        else:
            stage = 0 if name.startswith("embed") else P * v - 1
        rank = stage % P
        cat = _category(cfg, name, pc.tp)
        n = p.numel()
        if cat == "expert":
            local = n / (pc.ep * pc.etp)
            sharded[rank] += local / expert_fsdp
            if fp8_gather:  # both layouts' codes, 1 byte an element each, and two fp32 scales per 128x128 tile
                fp8_codes[rank] += (2 + 8 / (128 * 128)) * local / expert_fsdp
        else:
            local = n / pc.tp if cat == "split" else n
            sharded[rank] += n / (pc.tp * pc.dp_shard * pc.cp)
        unsharded[rank] += local
        if name not in fp32_kept:
            copied[rank] += local
            largest[rank] = max(largest[rank], local)
        if layer is not None:
            layer_local[layer] += local
        else:
            root_local += local

    plans = []
    for r in range(P):
        chunks = []  # (saved, workspace, recomputed) of one micro-batch on each of the rank's stages
        for j in range(v):
            lo, hi = bounds[r + j * P]
            chunks.append(_stage_activations(cfg, pc, range(lo, hi), r + j * P == 0, r + j * P == P * v - 1, c,
                                             batch_size, seq_len, activation_checkpointing, ep_backend, capacity,
                                             fused_loss))
        acts = work = 0.0
        for f in range(_in_flight(schedule, P, r, n_mb, v)):
            # the schedule's forwards in order: rounds of n / rounds micro-batches on each local stage in turn
            a, w, _ = chunks[(f // _per_round(P, n_mb)) % v if v > 1 else 0]
            acts, work = acts + a, work + w
        acts += max(ch[2] for ch in chunks)
        if P > 1:  # the whole stage gathered, with fp32 gradient accumulators, for the whole step
            gathered, grads = c * unsharded[r], 4 * unsharded[r]
        else:
            gathered = c * (2 * max(layer_local, default=0.0) + (root_local if pc.tp == 1 else 0.0))
            grads = 4 * sharded[r]
        dispatch = 0.0
        if ep_backend == "nvlink" and pc.ep > 1 and any(hi > cfg.first_k_dense for lo, hi in
                                                       (bounds[r + j * P] for j in range(v))):
            dispatch = nvlink_buffer_bytes(cfg, pc, batch_size * seq_len / (pc.cp * pc.tp), c, capacity)
        params, optimizer = 4 * sharded[r] + fp8_codes[r], 8 * sharded[r]
        if master_weights:  # every local parameter whole, no FSDP
            params, grads = 4 * unsharded[r] + c * copied[r], 4 * unsharded[r] + c * largest[r]
            optimizer, gathered = 8 * unsharded[r], 0.0
        plans.append(MemoryPlan(pc, params=params, grads=grads, optimizer=optimizer, gathered=gathered,
                                activations=acts, reserve=RESERVE, gpu_bytes=gpu_bytes, workspace=work,
                                dispatch=dispatch, pp_rank=r, compute_dtype=compute_dtype,
                                master_weights=master_weights))
    if pp_rank is not None:
        if not 0 <= pp_rank < P:
            raise ValueError(f"plan_memory: pp_rank {pp_rank} is not a rank of pp={P}")
        return plans[pp_rank]
    return max(plans, key=lambda mp: mp.total)


def _fp8_all_gather_applies(cfg, pc: ParallelConfig, expert_fsdp: int) -> bool:
    """Whether parallelize() gathers the experts in E4M3 (moe_kernels.quant.fsdp_fp8.fp8_all_gather_applies,
    from the config alone: every expert dimension of a rank's slice a multiple of 16, the recipe's; off 128 the
    codes are zero-padded, which the count below leaves out: about 2% at GPT-OSS's 2880)."""
    from moe_kernels.quant.recipe import Fp8BlockwiseRecipe

    moe = getattr(cfg, "moe", None)
    recipe = getattr(moe, "recipe", None)
    if not isinstance(recipe, Fp8BlockwiseRecipe) or not recipe.fp8_dgrad or expert_fsdp < 2:
        return False
    local_experts = moe.router.num_experts // pc.ep
    F = moe.ffn_size // pc.etp
    return local_experts % expert_fsdp == 0 and F % 16 == 0 and cfg.hidden_size % 16 == 0


def nvlink_buffer_bytes(cfg, pc: ParallelConfig, tokens: float, c: int, capacity: float | None) -> float:
    """The nvlink backend's dispatch and combine buffers on one rank (moe_kernels.dispatch.nvlink's formula),
    `tokens` a rank's tokens per micro-batch (after cp and tp), c the payload's bytes an element."""
    k, H = cfg.moe.router.k, cfg.hidden_size
    P, M = pc.ep, tokens * pc.etp
    worst = P * M * k
    C = worst if capacity is None else min(math.ceil(capacity * M * k), worst)
    X = min(P * M, C)
    return P * M * (8 + 8 * k) + X * H * c + M * k * (H * c + 4)
