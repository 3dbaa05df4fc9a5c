"""Model presets: plain functions returning a ModelConfig; keyword overrides name any field of ModelConfig,
MoEConfig, RouterConfig or MLAConfig (e.g. vocab_size=256, num_layers=4, max_seq_len=2048, backend="reference").

Tiny presets run a training step at batch 8 x 128 tokens well under a second on a CPU. The full-size ones are the
published architectures (config.json of the released checkpoints); build them on the meta device for accounting.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_kernels.models.config import MLAConfig, ModelConfig, YarnConfig
from moe_kernels.nn import MoEConfig, RouterConfig


def _mixtral(*, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, num_experts, k, ffn_size,
             max_seq_len, aux_loss_coeff, overrides) -> ModelConfig:
    """Softmax over the top-k logits (Mixtral's renormalised top-k), global load-balancing loss."""
    router = RouterConfig(hidden_size=hidden_size, num_experts=num_experts, k=k, score="softmax",
                          aux_loss_coeff=aux_loss_coeff)
    return ModelConfig(
        family="mixtral", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, moe=MoEConfig(router=router, ffn_size=ffn_size), max_seq_len=max_seq_len,
        rope_theta=1e6, rms_norm_eps=1e-5,
    ).replace(**overrides)


def _qwen3_moe(*, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, num_experts, k, ffn_size,
               max_seq_len, overrides) -> ModelConfig:
    """Softmax over all experts, top-k renormalised (norm_topk_prob=True: selection by logits, softmax over the
    k chosen), global load-balancing loss 1e-3; q/k RMSNorm per head."""
    router = RouterConfig(hidden_size=hidden_size, num_experts=num_experts, k=k, score="softmax", aux_loss_coeff=1e-3)
    return ModelConfig(
        family="qwen3_moe", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        moe=MoEConfig(router=router, ffn_size=ffn_size), max_seq_len=max_seq_len, rope_theta=1e6, rms_norm_eps=1e-6,
    ).replace(**overrides)


def _deepseek_v3(*, vocab_size, hidden_size, num_layers, num_heads, mla, first_k_dense, dense_ffn_size, num_experts,
                 k, num_groups, group_topk, ffn_size, max_seq_len, rope_scaling, overrides) -> ModelConfig:
    """Sigmoid scores, selection by score + expert bias (aux-loss-free balancing, sequence-wise aux loss 1e-4),
    group-limited (group score = sum of its top-2), weights normalised then x2.5, one shared expert."""
    router = RouterConfig(
        hidden_size=hidden_size, num_experts=num_experts, k=k, score="sigmoid", num_groups=num_groups,
        group_topk=group_topk, group_score_topk=min(2, num_experts // num_groups), scaling_factor=2.5,
        normalize=True, expert_bias=True, seq_aux_loss_coeff=1e-4,
    )
    return ModelConfig(
        family="deepseek_v3", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_heads, moe=MoEConfig(router=router, ffn_size=ffn_size,
        shared_ffn_size=ffn_size), first_k_dense=first_k_dense, dense_ffn_size=dense_ffn_size, mla=mla,
        max_seq_len=max_seq_len, rope_theta=10000.0, rope_scaling=rope_scaling, rope_interleave=True,
        rms_norm_eps=1e-6,
    ).replace(**overrides)


# ---------------------------------------------------------------------------------------------------
# Tiny (CPU tests, smoke training)


def tiny_mixtral(**overrides) -> ModelConfig:
    return _mixtral(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8, k=2,
                    ffn_size=64, max_seq_len=512, aux_loss_coeff=1e-2, overrides=overrides)


def tiny_qwen3_moe(**overrides) -> ModelConfig:
    return _qwen3_moe(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      num_experts=8, k=2, ffn_size=32, max_seq_len=512, overrides=overrides)


def tiny_deepseek_v3(**overrides) -> ModelConfig:
    mla = MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    return _deepseek_v3(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, mla=mla, first_k_dense=1,
                        dense_ffn_size=128, num_experts=8, k=2, num_groups=4, group_topk=2, ffn_size=32,
                        max_seq_len=512, rope_scaling=None, overrides=overrides)


# ---------------------------------------------------------------------------------------------------
# Published sizes


def mixtral_8x7b(**overrides) -> ModelConfig:
    """mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active."""
    return _mixtral(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, num_experts=8,
                    k=2, ffn_size=14336, max_seq_len=32768, aux_loss_coeff=2e-2, overrides=overrides)


def qwen3_30b_a3b(**overrides) -> ModelConfig:
    """Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active."""
    return _qwen3_moe(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                      num_experts=128, k=8, ffn_size=768, max_seq_len=40960, overrides=overrides)


def qwen3_30b_a3b_4layers(**overrides) -> ModelConfig:
    """Qwen3-30B-A3B's widths with 4 layers: the one-GPU training benchmark (specs/perf.md)."""
    return qwen3_30b_a3b(**{"num_layers": 4, **overrides})


def qwen3_235b_a22b(**overrides) -> ModelConfig:
    """Qwen/Qwen3-235B-A22B: 235B parameters, 22B active."""
    return _qwen3_moe(vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
                      num_experts=128, k=8, ffn_size=1536, max_seq_len=40960, overrides=overrides)


def deepseek_v3(**overrides) -> ModelConfig:
    """deepseek-ai/DeepSeek-V3: 671B parameters (without the multi-token-prediction module), 37B active; YaRN to
    128K context as released (pass rope_scaling=None, max_seq_len=4096 for the pre-training rotary)."""
    mla = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    yarn = YarnConfig(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                      mscale_all_dim=1.0)
    return _deepseek_v3(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, mla=mla, first_k_dense=3,
                        dense_ffn_size=18432, num_experts=256, k=8, num_groups=8, group_topk=4, ffn_size=2048,
                        max_seq_len=163840, rope_scaling=yarn, overrides=overrides)


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny-mixtral": tiny_mixtral,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "tiny-deepseek-v3": tiny_deepseek_v3,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "qwen3-30b-a3b-4layers": qwen3_30b_a3b_4layers,
    "qwen3-235b-a22b": qwen3_235b_a22b,
    "deepseek-v3": deepseek_v3,
}
