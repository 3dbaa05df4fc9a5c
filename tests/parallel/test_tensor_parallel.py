"""parallelize() with tensor / sequence and context parallelism on 4 gloo ranks equals one process training
on the same batches, within fp32 rounding: every step's batch loss (the sum of its cp x tp ranks' shares),
the global gradient norm, and every parameter (each rank's slice of it) after the optimizer steps. Layouts:
TP 2 x FSDP 2 (experts FSDP over all 4 ranks), TP 2 x HSDP 2, attention TP 2 x DP 2 folded with experts EP 4
or EP 2, CP 2 x FSDP 2, attention CP 2 x DP 2 folded with experts EP 2, and CP 2 x TP 2; expert tensor
parallelism: FSDP 4 with experts EP 2 x ETP 2, attention CP 2 x DP 2 folded with experts EP 2 x ETP 2, and
attention TP 2 x FSDP 2 with experts ETP 2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.layout import ParallelConfig
from tests.distributed import run_world
from tests.parallel.test_data_parallel import _batch

pytestmark = pytest.mark.distributed


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _slice_of(want: torch.Tensor, got: torch.Tensor, index: int) -> torch.Tensor:
    """The part of the one-process parameter a rank holds: equal shapes, or 1/n along the one dimension
    that differs (tensor-parallel rows or columns, or the rank's experts)."""
    dims = [d for d in range(want.dim()) if want.shape[d] != got.shape[d]]
    if not dims:
        return want
    (d,) = dims
    return want.chunk(want.shape[d] // got.shape[d], dim=d)[index]


def _expert_slice(want: torch.Tensor, name: str, ep_rank: int, ep: int, etp_rank: int, etp: int,
                  gated: bool = True) -> torch.Tensor:
    """The part of a one-process expert weight a rank holds: its ep rank's experts, and with etp its slice of
    each expert's ffn width (the gate rows' slice then the up rows' of w13, or the up rows' alone without a gate;
    w2's columns)."""
    want = want.chunk(ep, dim=0)[ep_rank]
    if etp == 1:
        return want
    if name.endswith("w2"):
        return want.chunk(etp, dim=2)[etp_rank]
    if not gated:
        return want.chunk(etp, dim=1)[etp_rank]
    gate, up = want.chunk(2, dim=1)
    return torch.cat([gate.chunk(etp, dim=1)[etp_rank], up.chunk(etp, dim=1)[etp_rank]], dim=1)


def _labels(ids, masked):
    """Next-token labels; masked: the first three positions ignored (-100), unevenly over the chunks."""
    labels = ids[:, 1:].clone()
    if masked:
        labels[:, :3] = -100
    return labels


def _ref_loss(model, ids, masked):
    logits, aux = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), _labels(ids, masked).flatten()) + aux


def _worker(rank, P, family, layout_kw, steps, model_kw, global_balance, masked=False):
    from moe_kernels.parallel import apply_global_load_balancing
    from moe_kernels.parallel.parallelize import parallelize

    torch.manual_seed(0)
    ref = build_model(PRESETS[family](num_experts=8, **model_kw))
    par = parallelize(copy.deepcopy(ref), ParallelConfig(**layout_kw))
    if global_balance:  # the aux loss of the global batch: the reference trains on all batches as one
        apply_global_load_balancing(par.model)
    model, pc = par.model, par.layout
    batches = pc.dp_replicate * pc.dp_shard
    batch, tp_rank = rank // (pc.cp * pc.tp), rank % pc.tp
    etp_rank, ep_rank = rank % pc.etp, (rank // pc.etp) % pc.ep
    opts = [torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)]
    vocab = ref.config.vocab_size
    where = f"rank {rank}/{P} {family} {pc.describe()}"
    for step in range(steps):
        ref_losses = []
        if global_balance:
            _ref_loss(ref, torch.cat([_batch(step, b, vocab) for b in range(batches)]), masked).backward()
        for b in range(batches if not global_balance else 0):
            loss = _ref_loss(ref, _batch(step, b, vocab), masked)
            (loss / batches).backward()
            ref_losses.append(loss.detach())
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ids = _batch(step, batch, vocab)
        logits, aux = model(ids[:, :-1])
        assert logits.shape[1] == (ids.shape[1] - 1) // (pc.cp * pc.tp), where
        share = par.cross_entropy(logits, _labels(ids, masked)) + aux
        share.backward()
        norm = par.clip_grad_norm_(1.0)
        if not global_balance:
            torch.testing.assert_close(par.batch_loss(share), ref_losses[batch], rtol=1e-5, atol=1e-6, msg=where)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6, msg=where)
        for opt in opts:
            opt.step()
            opt.zero_grad()

    check_slices(model, ref, pc, tp_rank, ep_rank, etp_rank, where)


def check_slices(model, ref, pc, tp_rank: int, ep_rank: int, etp_rank: int, where: str) -> None:
    """Every parameter of a parallelized model equals this rank's slice of the one-process model's."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got = _full(p.detach())
        if ".experts." in name:
            want = _expert_slice(ref_params[name].detach(), name, ep_rank, pc.ep, etp_rank, pc.etp)
        else:
            want = _slice_of(ref_params[name].detach(), got, tp_rank)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")


@pytest.mark.parametrize("family,layout,model_kw", [
    # TP 2 x FSDP 2 (q/k norms held whole); experts FSDP over all 4 ranks (also in the HSDP and folded cases)
    pytest.param("tiny-qwen3-moe", dict(tp=2), {}, marks=pytest.mark.extended),
    # TP 4 over 2 key/value heads: each pair of ranks reads one head of the k/v projections, held whole
    ("tiny-qwen3-moe", dict(tp=4), {}),
    # folded: attention TP 2 x DP 2 (MLA, a dense layer, shared experts, sequence-wise aux loss), experts EP 4
    ("tiny-deepseek-v3", dict(tp=2, ep=4), {}),
    ("tiny-mixtral", dict(tp=2, ep=2), dict(z_loss_coeff=1e-2)),  # experts EP 2 over each tp pair; z-loss
    ("tiny-qwen3-moe", dict(dp_replicate=2, tp=2), dict(tie_embeddings=True)),  # TP 2 x HSDP 2, tied embeddings
    pytest.param("tiny-qwen3-moe", dict(cp=2), {}, marks=pytest.mark.extended),  # CP 2 x FSDP 2 (also folded below)
    # folded: attention CP 2 x DP 2, experts EP 2 (MLA, the sequence-wise aux loss over split sequences)
    ("tiny-deepseek-v3", dict(cp=2, ep=2), {}),
    ("tiny-mixtral", dict(cp=2, tp=2), dict(z_loss_coeff=1e-2)),  # CP 2 x TP 2: one batch on all 4 ranks
    # FSDP 4; experts EP 2 x ETP 2 (4 batches, 2 experts' slices each)
    pytest.param("tiny-mixtral", dict(ep=2, etp=2), {}, marks=pytest.mark.extended),
    # folded: attention CP 2 x DP 2, experts EP 2 x ETP 2 (MLA, shared experts, sequence-wise aux loss)
    ("tiny-deepseek-v3", dict(cp=2, ep=2, etp=2), {}),
    # attention TP 2 x FSDP 2; every expert split over each tp pair
    pytest.param("tiny-qwen3-moe", dict(tp=2, etp=2), {}, marks=pytest.mark.extended),
], ids=["qwen3-tp2", "qwen3-tp4-kv2", "deepseek-tp2-ep4", "mixtral-tp2-ep2", "qwen3-tp2-hsdp2", "qwen3-cp2", "deepseek-cp2-ep2",
        "mixtral-cp2-tp2", "mixtral-ep2-etp2", "deepseek-cp2-ep2-etp2", "qwen3-tp2-etp2"])
def test_tensor_parallel_training_equals_one_process(family, layout, model_kw):
    run_world(_worker, 4, family, layout, 2, model_kw, False)


def test_ignored_labels():
    # Labels set to -100 (padding, prompts) are left out of the mean, as F.cross_entropy does in one process.
    run_world(_worker, 4, "tiny-qwen3-moe", dict(cp=2, tp=2), 1, {}, False, True)


def test_tensor_parallel_with_global_batch_balancing():
    # The aux loss over both batches' tokens (apply_global_load_balancing): equal to one process training on
    # the two batches as one (gradient norms and parameters).
    run_world(_worker, 4, "tiny-mixtral", dict(tp=2), 2, dict(z_loss_coeff=1e-2), True)


def _worker_refuses(rank, P):
    from moe_kernels.parallel.parallelize import parallelize

    with pytest.raises(ValueError, match="the 3 key/value heads must divide one another"):
        parallelize(build_model(PRESETS["tiny-qwen3-moe"](num_heads=12, num_kv_heads=3)), ParallelConfig(tp=4))
    with pytest.raises(ValueError, match="tp=4 must divide the 2 attention heads"):
        parallelize(build_model(PRESETS["tiny-qwen3-moe"](num_heads=2, num_kv_heads=2)), ParallelConfig(tp=4))
    with pytest.raises(ValueError, match="torch-native MoE backend"):
        parallelize(build_model(PRESETS["tiny-qwen3-moe"](backend="torch")), ParallelConfig(cp=2))
    model = build_model(PRESETS["tiny-deepseek-v3"](dense_ffn_size=66))
    with pytest.raises(ValueError, match="tp=4 must divide the dense ffn size 66"):
        parallelize(model, ParallelConfig(tp=4))
    assert model.layers[0].mlp.gate_proj.out_features == 66, "refused before any layer was split"


def test_tensor_parallel_refusals():
    run_world(_worker_refuses, 4)
