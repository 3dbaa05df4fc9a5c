"""Decoder-only MoE transformer: Mixtral, Qwen3-MoE and DeepSeek-V3 from one set of blocks.

    h = embed(ids)
    for each layer:  h = h + attention(rms_norm(h));  h = h + mlp(rms_norm(h))   (mlp: dense SwiGLU or MoELayer)
    logits = lm_head(rms_norm(h))

Shapes: B batch, S sequence, H hidden, V vocabulary, nh query heads, nkv key/value heads, D head dim. Module and
parameter names follow Hugging Face's (q_proj, kv_a_proj_with_mqa, input_layernorm, ...) so checkpoint
conversion is a short table; the MoE blocks are moe_kernels.nn.MoELayer. No parallelism in here: it is applied
from outside (moe_kernels.parallel).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from moe_kernels.models.config import ModelConfig, YarnConfig
from moe_kernels.nn import GroupedExperts, MoELayer, Router, SharedExperts, linear_cross_entropy
from moe_kernels.nn.router import recomputation


def _checkpoint_contexts():
    """torch.utils.checkpoint's (forward, recompute) contexts: the recompute does not count tokens again."""
    return nullcontext(), recomputation()


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float, *, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Rotary position embedding


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(cfg: ModelConfig) -> float:
    y = cfg.rope_scaling
    return y.factor if y.factor is not None else cfg.max_seq_len / y.original_max_seq_len


def rope_inv_freq(cfg: ModelConfig, device=None) -> tuple[Tensor, float]:
    """Inverse frequencies [rope_dim / 2] fp32 and the factor that scales cos/sin (1 without YaRN)."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    y: YarnConfig | None = cfg.rope_scaling
    if y is None:
        return 1.0 / pos_freqs, 1.0
    factor = _yarn_factor(cfg)
    attention_factor = y.attention_factor
    if attention_factor is None:
        attention_factor = (
            yarn_mscale(factor, y.mscale) / yarn_mscale(factor, y.mscale_all_dim)
            if y.mscale and y.mscale_all_dim
            else yarn_mscale(factor)
        )

    # Dimensions rotating fewer than beta_slow times over the original context are interpolated (divided by
    # factor), those rotating more than beta_fast times extrapolated (kept), with a linear ramp between.
    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(y.original_max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, seq_len: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [S, rope_dim] for positions 0..S-1, frequencies repeated twice (cat(f, f)), in `dtype`.
    Computed per call (a [S, D/2] outer product) so a model built on the meta device needs no buffers filled."""
    inv_freq, scale = rope_inv_freq(cfg, device)
    freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleave: bool = False) -> Tensor:
    """x [B, h, S, D] rotated by position. Default: dim i pairs with i + D/2 (rotate_half). interleave: dims
    (2i, 2i+1) pair, and the output lists the rotated even dims then the odd ones (transformers'
    apply_rotary_pos_emb_interleave; the same permutation hits q and k, so scores are unchanged by it)."""
    if not interleave:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---------------------------------------------------------------------------------------------------
# Attention


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale + causal mask) v over [B, h, S, D] (grouped-query when k has fewer heads). Each
    attention module calls it through its `attend` attribute, which context parallelism replaces from outside
    (its queries see keys gathered from the other ranks)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Causal grouped-query attention; Qwen3 adds an RMSNorm over each query and key head before the rotation."""

    def __init__(self, cfg: ModelConfig, *, dtype=None):
        super().__init__()
        H, nh, nkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.attn_head_dim
        linear = partial(nn.Linear, bias=False, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, D
        self.q_proj, self.k_proj, self.v_proj = linear(H, nh * D), linear(H, nkv * D), linear(H, nkv * D)
        self.o_proj = linear(nh * D, H)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.attend = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, h, S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, self.head_dim**-0.5)  # [B, nh, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 section 2.1, V3 section 2.1.1), transformers' DeepseekV3Attention:

        q = q_b(norm(q_a(x)))                    [B, S, nh, nope + rope]   (or q_proj(x) without q_lora_rank)
        c_kv, k_rope = kv_a(x)                   [B, S, kv_lora], [B, S, rope]: one rotary key shared by all heads
        k_nope, v = kv_b(norm(c_kv))             [B, S, nh, nope], [B, S, nh, v_head]
        out = softmax(q . [k_nope, rope(k_rope)] * scale) v,  scale = (nope + rope)^-0.5 (* yarn mscale^2)
    """

    def __init__(self, cfg: ModelConfig, *, dtype=None):
        super().__init__()
        m, H, nh = cfg.mla, cfg.hidden_size, cfg.num_heads
        eps = 1e-6  # the latent norms ignore rms_norm_eps (DeepSeek's code and transformers' both)
        linear = partial(nn.Linear, bias=False, dtype=dtype)
        self.num_heads, self.mla, self.interleave = nh, m, cfg.rope_interleave
        if m.q_lora_rank is None:
            self.q_proj = linear(H, nh * m.qk_head_dim)
        else:
            self.q_a_proj = linear(H, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps, dtype=dtype)
            self.q_b_proj = linear(m.q_lora_rank, nh * m.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(H, m.kv_lora_rank + m.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps, dtype=dtype)
        self.kv_b_proj = linear(m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = linear(nh * m.v_head_dim, H)
        self.scale = m.qk_head_dim**-0.5
        y = cfg.rope_scaling
        if y is not None and y.mscale_all_dim:  # YaRN's attention temperature, on the softmax (DeepSeek only)
            self.scale *= yarn_mscale(_yarn_factor(cfg), y.mscale_all_dim) ** 2
        self.attend = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        m, nh = self.mla, self.num_heads
        q = self.q_proj(x) if self.mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, S, nh, m.qk_head_dim).transpose(1, 2)  # [B, nh, S, nope + rope]
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, S, nh, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)  # [B, nh, S, .]
        q_rope = apply_rope(q_rope, cos, sin, interleave=self.interleave)
        k_rope = apply_rope(k_rope.view(B, 1, S, m.qk_rope_head_dim), cos, sin, interleave=self.interleave)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, nh, S, m.qk_rope_head_dim)), dim=-1)
        out = self.attend(q, k, v, self.scale)  # [B, nh, S, v_head]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


# ---------------------------------------------------------------------------------------------------
# Blocks and the model


class Block(nn.Module):
    """Pre-norm residual block; `mlp` is a dense SwiGLU MLP (SharedExperts: every token goes through it) for the
    first `first_k_dense` layers and an MoELayer after."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype=None):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, dtype=dtype) if cfg.mla is not None else Attention(cfg, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.is_moe = layer_idx >= cfg.first_k_dense
        self.mlp = MoELayer(cfg.moe, dtype=dtype) if self.is_moe else SharedExperts(H, cfg.dense_ffn_size, dtype=dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            out, aux = self.mlp(h)
        else:
            out, aux = self.mlp(h), torch.zeros((), device=x.device, dtype=torch.float32)
        return x + out, aux


class MoETransformer(nn.Module):
    """forward(input_ids [B, S] int64) -> (logits [B, S, V] in the model's dtype, aux_loss: fp32 scalar, the sum
    of every MoE layer's routing losses, already multiplied by their coefficients).
    forward(input_ids, return_hidden=True) -> (the final norm's hidden states [B, S, H], aux_loss): for a loss
    that applies `head_weight` itself (moe_kernels.nn.linear_cross_entropy: no [B, S, V] logits).
    forward(input_ids, targets [B, S]) -> (that loss, the mean cross-entropy over the targets other than -100, fp32
    scalar; aux_loss)."""

    def __init__(self, config: ModelConfig, *, dtype=None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(config, i, dtype=dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        self.activation_checkpointing = False

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, *,
                return_hidden: bool = False) -> tuple[Tensor, Tensor]:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"MoETransformer: input_ids must be [B, S] int64, got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        S = input_ids.shape[1]
        if S > self.config.max_seq_len:
            raise ValueError(f"MoETransformer: sequence length {S} > config.max_seq_len={self.config.max_seq_len}")
        h = self.embed_tokens(input_ids)  # [B, S, H]
        cos, sin = rope_cos_sin(self.config, S, h.device, h.dtype)
        aux = torch.zeros((), device=h.device, dtype=torch.float32)
        for block in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h, layer_aux = checkpoint(block, h, cos, sin, use_reentrant=False, context_fn=_checkpoint_contexts)
            else:
                h, layer_aux = block(h, cos, sin)
            aux = aux + layer_aux
        h = self.norm(h)
        if targets is not None:
            if return_hidden:
                raise ValueError("MoETransformer: pass targets (for the loss) or return_hidden, not both")
            return linear_cross_entropy(h, self.head_weight, targets), aux
        if return_hidden:
            return h, aux
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed_tokens.weight)
        return logits, aux

    @property
    def head_weight(self) -> Tensor:
        """The output projection's weight [V, H]: lm_head's, or the embedding's when they are tied."""
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def moe_layers(self) -> Iterator[MoELayer]:
        """The MoELayer of each MoE block, in depth order (e.g. for `layer.router.update_expert_bias()`)."""
        return (block.mlp for block in self.layers if block.is_moe)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in the backward (torch.utils.checkpoint, use_reentrant=False). The routers run
        again in the recomputation but count their tokens (`tokens_seen`) only once."""
        self.activation_checkpointing = bool(enabled)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, splits: dict | None = None) -> None:
        """Normal(0, init_std) matrices and embeddings, output projections (o_proj, down_proj, experts' w2) scaled
        by 1/sqrt(2 * num_layers) (GPT-2 / Megatron), norms 1, expert bias and counts 0: every value drawn from
        `seed` by its parameter's name and position (moe_kernels.models.init), so a sharded model (`splits`,
        FSDP DTensors) gets the pieces of the same model. seed None: one drawn from torch's generator. Also what
        fills a model built on the meta device after `to_empty()`."""
        from moe_kernels.models.init import init_parameters, model_rules

        if seed is None:
            seed = default_seed()
        init_parameters(self, model_rules(self, self.config), seed, splits)


def default_seed() -> int:
    """A model seed drawn from torch's default generator (so torch.manual_seed(s) fixes the model)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def build_model(cfg: ModelConfig, device=None, dtype=None, *, seed: int | None = None) -> MoETransformer:
    """The model with its parameters on `device` in `dtype` (routers stay fp32), initialised by
    init_weights(seed) (seed None: drawn from torch's generator). Built on the meta device and then
    materialised, so nothing is drawn twice. device="meta" allocates nothing (for parameter, FLOP and memory
    accounting, or to parallelize before materialising: moe_kernels.parallel.parallelize(..., seed=))."""
    with torch.device("meta"):
        model = MoETransformer(cfg, dtype=dtype)
    device = torch.device(device) if device is not None else torch.empty(()).device  # torch's default device
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights(seed)
    return model
