"""Training FLOPs per token, counting only the experts a token is routed to.

    flops_per_token = 3 * forward                     (backward = 2 x forward: input grads + weight grads)
    forward         = 2 * active_matmul_params + sum over layers of attention(S)

active_matmul_params: the weights a token is multiplied with, once each (one multiply-add = 2 FLOPs):
    attention        GQA: H*nh*D (q) + 2*H*nkv*D (k, v) + nh*D*H (o)
                     MLA: H*q_lora + q_lora*nh*(nope+rope) (or H*nh*(nope+rope)) + H*(kv_lora+rope)
                          + kv_lora*nh*(nope+v) + nh*v*H
    dense MLP        3*H*F_dense
    MoE              E*H (router) + k*3*H*F (routed experts) + 3*H*F_shared (+ H for a shared gate)
    LM head          V*H
Not counted: the embedding lookup (a gather), norms, rotary, softmax, activations, routing and permutation.

attention(S) per layer and token: the score product QK^T costs 2*S*nh*d_qk and the value product 2*S*nh*d_v
for a full S x S score matrix (2*2*S*nh*D when d_qk = d_v = D). Causal masking leaves (S+1)/2 ~ S/2 keys per
query on average, so with causal=True (the default) we count half: S*nh*(d_qk + d_v). causal=False counts the
full square, the convention of PaLM's MFU and torchtitan.
"""

from __future__ import annotations

from moe_kernels.models.config import ModelConfig


def attention_matmul_params(cfg: ModelConfig) -> int:
    H, nh = cfg.hidden_size, cfg.num_heads
    m = cfg.mla
    if m is None:
        D = cfg.attn_head_dim
        return H * nh * D + 2 * H * cfg.num_kv_heads * D + nh * D * H
    q = H * nh * m.qk_head_dim if m.q_lora_rank is None else H * m.q_lora_rank + m.q_lora_rank * nh * m.qk_head_dim
    kv = H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + nh * m.v_head_dim * H


def moe_active_matmul_params(cfg: ModelConfig) -> int:
    moe, H = cfg.moe, cfg.hidden_size
    m = 3 if moe.activation == "swiglu" else 2  # matrices per expert MLP: gate, up, down (no gate: up, down)
    shared = m * H * moe.shared_ffn_size + (H if moe.shared_gate else 0)
    return moe.num_experts * H + moe.router.k * m * H * moe.ffn_size + shared


def active_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights one token passes through in a forward (routed experts: only its k)."""
    attention = cfg.num_layers * attention_matmul_params(cfg)
    dense = cfg.first_k_dense * 3 * cfg.hidden_size * cfg.dense_ffn_size
    return attention + dense + cfg.num_moe_layers * moe_active_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """Forward QK^T and AV FLOPs of one token, summed over layers (see the module docstring)."""
    if cfg.mla is None:
        d_qk = d_v = cfg.attn_head_dim
    else:
        d_qk, d_v = cfg.mla.qk_head_dim, cfg.mla.v_head_dim
    full = 2 * seq_len * cfg.num_heads * (d_qk + d_v)
    return cfg.num_layers * (full // 2 if causal else full)


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    if seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be >= 1, got {seq_len}")
    return 3 * (2 * active_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal=causal))
