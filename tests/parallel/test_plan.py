"""Parallel layouts (ParallelConfig) and the per-GPU memory plan of `moe-train --plan`."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from moe_kernels.models import PRESETS, build_model
from moe_kernels.parallel.layout import ParallelConfig
from moe_kernels.parallel.plan import GiB, RESERVE, nvlink_buffer_bytes, plan_memory, routed_rows
from moe_kernels.train.cli import app


def test_layout_resolution_and_folding():
    pc = ParallelConfig(tp=2, ep=8).resolve()  # the fewest ranks: ep * etp must divide dp_shard * cp * tp
    assert (pc.world_size, pc.dp_shard, pc.edp) == (8, 4, 1)
    pc = ParallelConfig(tp=2, cp=2, ep=2, etp=2, dp_replicate=2).resolve(32)
    assert (pc.dp_shard, pc.edp) == (4, 8)
    assert ParallelConfig(pp=2, ep=4).smallest_world() == 8
    with pytest.raises(ValueError, match=r"ep\*etp = 8\*1 = 8 must divide dp_shard\*cp\*tp = 2\*1\*2 = 4"):
        ParallelConfig(tp=2, ep=8).resolve(4)
    with pytest.raises(ValueError, match="world size 6 is not a multiple of pp\\*dp_replicate\\*cp\\*tp = 1\\*1\\*1\\*4 = 4"):
        ParallelConfig(tp=4).resolve(6)
    with pytest.raises(ValueError, match="= 8 ranks, but the world has 16"):
        ParallelConfig(dp_shard=4, tp=2).resolve(16)
    with pytest.raises(ValueError, match="tp must be an int >= 1, got 0"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="ep=3 must divide the 8 experts"):
        ParallelConfig(ep=3).resolve(3).check_model(PRESETS["tiny-qwen3-moe"](), 128)
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
        ParallelConfig(cp=2).resolve(2).check_model(PRESETS["tiny-qwen3-moe"](), 126)


def _param_count(cfg, pred=lambda name: True) -> int:
    with torch.device("meta"):
        m = build_model(cfg)
    return sum(p.numel() for n, p in m.named_parameters() if pred(n))


def test_plan_shards_parameters_as_the_layout_says():
    cfg = PRESETS["tiny-qwen3-moe"]()
    n = _param_count(cfg)
    experts = _param_count(cfg, lambda name: ".experts." in name)
    one = plan_memory(cfg, ParallelConfig().resolve(1), batch_size=2, seq_len=64)
    assert one.params == 4 * n and one.grads == 4 * n and one.optimizer == 8 * n  # fp32 + fp32 + AdamW
    # dp_shard 2 with ep 2: experts split by ep (no FSDP left for them), the rest by FSDP: half of everything.
    two = plan_memory(cfg, ParallelConfig(ep=2).resolve(2), batch_size=2, seq_len=64)
    assert two.params == pytest.approx(4 * n / 2)
    # ep 1 on 2 FSDP ranks: the same half; ep 2 x etp 2 on 4 ranks: experts / 4 as well
    assert plan_memory(cfg, ParallelConfig().resolve(2), batch_size=2, seq_len=64).params == pytest.approx(4 * n / 2)
    four = plan_memory(cfg, ParallelConfig(ep=2, etp=2).resolve(4), batch_size=2, seq_len=64)
    assert four.params == pytest.approx(4 * n / 4)
    # tp 2 on 2 ranks: the experts FSDP-sharded over the 2 (ep 1), the split projections halved by tp, what
    # every tp rank holds whole (norms, routers, embeddings, the kv projections of fewer kv heads than ranks)
    # FSDP-sharded over dp_shard x cp x tp: half of everything again
    tp = plan_memory(cfg, ParallelConfig(tp=2).resolve(2), batch_size=2, seq_len=64)
    assert tp.params == pytest.approx(4 * n / 2)
    # ...while FSDP's gathered copy of a layer is what the rank holds of it unsharded: the split projections'
    # halves, the rest whole
    L = cfg.num_layers
    split = _param_count(cfg, lambda name: name.startswith("layers.0.") and name.endswith(("q_proj.weight",
                                                                                          "o_proj.weight")))
    layer0 = _param_count(cfg, lambda name: name.startswith("layers.0."))
    root = _param_count(cfg, lambda name: not name.startswith("layers."))
    assert L == 2 and cfg.num_kv_heads == 2  # (k and v split over tp 2)
    kv = _param_count(cfg, lambda name: name.startswith("layers.0.") and name.endswith(("k_proj.weight",
                                                                                       "v_proj.weight")))
    assert tp.gathered == pytest.approx(2 * 2 * (layer0 - (split + kv) / 2))  # two bf16 layers (tp > 1: no root)
    assert one.gathered == pytest.approx(2 * (2 * layer0 + root))  # one rank: two layers and the root unit
    # HSDP: experts under ep are FSDP-sharded over edp, the replicas included (parallelize's expert mesh)
    hsdp = plan_memory(cfg, ParallelConfig(dp_replicate=2, ep=2).resolve(4), batch_size=2, seq_len=64)
    assert hsdp.params == pytest.approx(4 * (experts / 4 + (n - experts) / 2))
    assert one.total == pytest.approx(one.params + one.grads + one.optimizer + one.gathered + one.activations
                                      + one.workspace + RESERVE)


def test_plan_counts_the_codes_the_fp8_all_gather_keeps():
    from moe_kernels.quant import Fp8BlockwiseRecipe

    def plan(layout, world, hf=(128, 128), **recipe):
        cfg = PRESETS["tiny-qwen3-moe"](hidden_size=hf[0], ffn_size=hf[1], recipe=Fp8BlockwiseRecipe(**recipe))
        bf16 = plan_memory(cfg.replace(recipe=None), layout.resolve(world), batch_size=2, seq_len=64)
        return cfg, plan_memory(cfg, layout.resolve(world), batch_size=2, seq_len=64).params - bf16.params

    # FSDP over 2 ranks: each rank's half of the experts keeps both layouts' codes (2 B) and two scales a tile.
    cfg, extra = plan(ParallelConfig(), 2)
    experts = _param_count(cfg, lambda name: ".experts." in name)
    assert extra == pytest.approx((2 + 8 / 128**2) * experts / 2)
    # EP 2 x FSDP 2 on 4 ranks: a quarter.
    assert plan(ParallelConfig(ep=2), 4)[1] == pytest.approx((2 + 8 / 128**2) * experts / 4)
    # H and F off 128 (GPT-OSS's 2880): gathered in FP8 too (the codes zero-padded, not counted).
    cfg, extra = plan(ParallelConfig(), 2, hf=(144, 208))
    assert extra == pytest.approx((2 + 8 / 128**2) * _param_count(cfg, lambda name: ".experts." in name) / 2)
    # Nothing where the bf16 gather stays: one FSDP rank, bf16 dgrad, experts that do not divide evenly.
    assert plan(ParallelConfig(ep=2), 2)[1] == 0  # ep 2 on 2 ranks: edp 1
    assert plan(ParallelConfig(), 2, fp8_dgrad=False)[1] == 0
    assert plan(ParallelConfig(), 16)[1] == 0  # 8 experts over 16 ranks


def test_plan_pipeline_stages_hold_their_parameters_unsharded_with_fp32_gradients():
    """torch.distributed.pipelining leaves every FSDP unit of a stage gathered after a micro-batch's backward and
    accumulates unsharded gradients until the step's last backward (module docstring): the plan counts the
    stage's parameters gathered in bf16 and fp32 gradient accumulators, unsharded by FSDP."""
    cfg = PRESETS["qwen3-30b-a3b"]()
    pc = ParallelConfig(pp=2, ep=2).resolve(8)  # a stage of 24 layers on 4 ranks: FSDP 4 x experts EP 2 x FSDP 2
    first = plan_memory(cfg, pc, batch_size=1, seq_len=4096, pp_rank=0)

    def stage0(name: str) -> bool:
        return name.startswith("embed") or (name.startswith("layers.") and int(name.split(".")[1]) < 24)

    experts = _param_count(cfg, lambda name: stage0(name) and ".experts." in name)
    rest = _param_count(cfg, stage0) - experts
    assert first.params == pytest.approx(4 * (experts / 2 / 2 + rest / 4))  # fp32, sharded
    assert first.optimizer == pytest.approx(2 * first.params)
    assert first.grads == pytest.approx(4 * (experts / 2 + rest))  # fp32 accumulators, only ep shards them
    assert first.gathered == pytest.approx(2 * (experts / 2 + rest))  # bf16
    # moe-train's example of the issue: "fits 66.9 GiB" with two gathered layers; about 90 GiB of parameters
    # and their state alone
    plan = plan_memory(cfg, pc, batch_size=1, seq_len=4096)
    assert (plan.params + plan.grads + plan.optimizer + plan.gathered) / GiB > 85 and not plan.fits
    assert "stage parameters gathered (bf16)" in plan.table() and "gradients (fp32, stage unsharded)" in plan.table()
    # Micro-batches in flight: 1F1B keeps pp - s on stage s, GPipe all of them.
    one_mb = plan_memory(cfg, pc, batch_size=1, seq_len=4096, pp_rank=0, num_microbatches=1, schedule="gpipe")
    assert first.activations == pytest.approx(2 * one_mb.activations)
    gpipe = plan_memory(cfg, pc, batch_size=1, seq_len=4096, pp_rank=0, num_microbatches=8, schedule="gpipe")
    assert gpipe.activations == pytest.approx(8 * one_mb.activations)
    last = plan_memory(cfg, pc, batch_size=1, seq_len=4096, pp_rank=1, num_microbatches=8)
    assert last.activations < first.activations


def test_plan_activations_follow_the_layout():
    cfg = PRESETS["qwen3-30b-a3b"]()
    plan = functools.partial(plan_memory, cfg, batch_size=1, seq_len=4096, fused_loss=False)
    base = plan(ParallelConfig(ep=8).resolve(8))
    ckpt = plan(ParallelConfig(ep=8).resolve(8), activation_checkpointing=True)
    cp2 = plan(ParallelConfig(ep=8, cp=2).resolve(8))
    dbl = plan(ParallelConfig(ep=8).resolve(8), batch_size=2)
    assert ckpt.activations < base.activations / 5
    # cp halves every rank's tokens but gathers the keys and values of whole sequences (0.601x here: those are a
    # fifth of the half's bytes, whose other terms, the router's input among them, are per token)
    assert base.activations / 2 < cp2.activations < 0.62 * base.activations
    assert dbl.activations == pytest.approx(2 * base.activations, rel=1e-3)  # (rotary tables per sequence)
    # The fused loss keeps none of the [T, V] terms: less, by the log-softmax, the labels and the head's input.
    fused = plan_memory(cfg, ParallelConfig(ep=8).resolve(8), batch_size=1, seq_len=4096)
    V, H = cfg.vocab_size, cfg.hidden_size
    assert base.activations - fused.activations == pytest.approx(4096 * (2 * H + 4 * V + 8), rel=1e-6)
    fp32 = plan(ParallelConfig(ep=8).resolve(8), compute_dtype=torch.float32)
    assert 1.5 * base.activations < fp32.activations < 2 * base.activations  # (some saved tensors are fp32 anyway)
    assert fp32.gathered == pytest.approx(2 * base.gathered) and fp32.params == base.params
    assert base.fits == (base.total <= 80e9) and ("fits" if base.fits else "does not fit") in base.verdict()


class _FusedAttention(torch.autograd.Function):
    """What a GPU's fused attention keeps for its backward (q, k, v, the output laid out [B, S, h, D], an fp32
    log-sum-exp): MLA's unequal head dims take the CPU's math path, which keeps the S x S scores instead."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:3], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset,overrides", [
    ("tiny-qwen3-moe", dict(first_k_dense=1, dense_ffn_size=64, shared_ffn_size=32, num_layers=3)),
    ("tiny-qwen3-moe", dict(align=16)),
    ("tiny-mixtral", {}),
    ("tiny-deepseek-v3", {}),
])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_loss"])
def test_plan_activations_are_the_bytes_autograd_saves(preset, overrides, dtype, fused):
    """One process, fp32 or bf16 weights and activations (the routers fp32): the plan's activation bytes are
    those saved-tensor hooks see during the forward and the loss, each storage once, with the loss over
    materialised logits or fused with the lm_head (linear_cross_entropy)."""
    from moe_kernels.parallel.sequence import cross_entropy_share, linear_cross_entropy_share
    from tests.parallel.test_plan_bytes import SavedBytes

    torch.manual_seed(0)
    cfg = PRESETS[preset](max_seq_len=64, **overrides)
    model = build_model(cfg, dtype=dtype)
    if cfg.mla is not None:
        for block in model.layers:
            block.self_attn.attend = _FusedAttention.apply
    ids = torch.randint(0, cfg.vocab_size, (2, 65))
    saved = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        if fused:
            hidden, aux = model(ids[:, :-1], return_hidden=True)
            loss = linear_cross_entropy_share(hidden, model.head_weight, ids[:, 1:], None) + aux
        else:
            logits, aux = model(ids[:, :-1])
            loss = cross_entropy_share(logits, ids[:, 1:], None) + aux
    plan = plan_memory(cfg, ParallelConfig().resolve(1), batch_size=2, seq_len=64, compute_dtype=dtype,
                       fused_loss=fused)
    assert plan.activations == pytest.approx(saved.peak, rel=1e-3)
    assert plan.compute_dtype == dtype and ("bf16" if dtype == torch.bfloat16 else "fp32") in plan.table()
    del loss


def test_plan_capacity_sizes_the_rows_each_backend_allocates():
    """`capacity` is a factor of the balanced load (a rank's tokens x k rows): nvlink allocates min(C, ep M k)
    grouped rows plus the alignment padding (by default the worst case, ep times the balanced load) and
    buffers sized from max_tokens_per_rank M and C, as moe_kernels.dispatch.nvlink does; all_to_all holds
    the rows routing sends (balanced unless a factor says otherwise); all_gather always every gathered pair."""
    from moe_kernels.dispatch.nvlink import VirtualNvlinkWorld

    cfg = PRESETS["tiny-qwen3-moe"](align=16)  # 8 experts, k 2
    pc = ParallelConfig(ep=4).resolve(4)
    T, k, El = 64, 2, 2
    for capacity in (None, 0.5, 1.25, 2.0, 100.0):
        rows = None if capacity is None else math.ceil(capacity * T * k)
        engine = VirtualNvlinkWorld(8, 4, max_tokens_per_rank=T, capacity=rows, device="cpu").engine
        assert routed_rows(cfg, pc, T, "nvlink", capacity) == engine.cap(k) + El * 15
    assert routed_rows(cfg, pc, T, "nvlink") == 4 * T * k + El * 15  # the backend's default: nothing dropped
    assert routed_rows(cfg, pc, T, "all_to_all") == T * k + El * 15
    assert routed_rows(cfg, pc, T, "all_to_all", 1.5) == 1.5 * T * k + El * 15
    assert routed_rows(cfg, pc, T, "all_gather", 1.5) == 4 * T * k + El * 15
    etp = ParallelConfig(ep=2, etp=2).resolve(4)  # the etp group's tokens travel together: M = 2 T
    assert routed_rows(cfg, etp, T, "nvlink", 2.0) == 2 * (2 * T) * k + 4 * 15
    try:
        import moe_kernels._C as C
    except ImportError:
        C = None
    if C is not None:  # the buffers: the extension's own layout for them
        H = cfg.hidden_size
        for capacity in (None, 1.0, 3.0):
            cap = 4 * T * k if capacity is None else math.ceil(capacity * T * k)
            X = min(4 * T, cap)
            want = C.nvlink_dispatch_layout(4, T, k, X, H * 2, 0)["bytes"] + C.nvlink_combine_bytes(T, k, H * 2)
            assert nvlink_buffer_bytes(cfg, pc, T, 2, capacity) == pytest.approx(want, rel=0.01)
    # the plan: the nvlink default is the worst case; a factor brings the rows and the buffers down
    big = PRESETS["qwen3-30b-a3b"]()
    pc8 = ParallelConfig(ep=8).resolve(8)
    kw = dict(batch_size=1, seq_len=4096)
    a2a = plan_memory(big, pc8, **kw)
    worst = plan_memory(big, pc8, ep_backend="nvlink", **kw)
    two = plan_memory(big, pc8, ep_backend="nvlink", capacity=2.0, **kw)
    half = plan_memory(big, pc8, ep_backend="nvlink", capacity=0.5, **kw)
    # the dispatch buffer receives each token once per rank: under ep M tokens it does not shrink with C
    assert a2a.dispatch == 0 and worst.dispatch == two.dispatch > half.dispatch > 0
    assert worst.activations > two.activations > a2a.activations / 2
    assert "nvlink dispatch buffers" in two.table() and "nvlink" not in a2a.table()
    with pytest.raises(ValueError, match="capacity must be a factor > 0"):
        plan_memory(big, pc8, ep_backend="nvlink", capacity=0, **kw)
    with pytest.raises(ValueError, match="ep_backend must be one of"):
        plan_memory(big, pc8, ep_backend="deepep", **kw)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
def test_cli_plan_prints_the_table_and_a_verdict(preset):
    result = CliRunner().invoke(app, ["--plan", "--preset", preset, "--tp", "2", "--ep", "8", "--seq-len", "4096",
                                      "--batch-size", "1"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "8 ranks: attention pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2; experts pp 1 x edp 1 x ep 8" in out
    for row in ("parameters (fp32, sharded)", "gradients", "optimizer state", "activations", "total"):
        assert row in out and "GiB" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("fits: ") or verdict.startswith("does not fit: ")
    if preset == "deepseek-v3":  # 671B parameters x 16 bytes over 8 GPUs
        assert verdict.startswith("does not fit") and "parameters + gradients + optimizer state" in verdict


def test_cli_plan_impossible_layouts_exit_nonzero_with_the_reason(tmp_path):
    r = CliRunner().invoke(app, ["--plan", "--preset", "qwen3-30b-a3b", "--ep", "7", "--world-size", "14"])
    assert r.exit_code == 1 and "ep=7 must divide the 128 experts" in r.output
    r = CliRunner().invoke(app, ["--plan", "--preset", "deepseek-v3", "--tp", "2", "--ep", "8", "--world-size", "4"])
    assert r.exit_code == 1 and "must divide dp_shard*cp*tp = 2*1*2 = 4" in r.output
    def said(r) -> str:  # the error box's text on one line (rich wraps it to the terminal's width)
        return " ".join(r.output.replace("│", " ").split())

    r = CliRunner().invoke(app, ["--world-size", "4", "--out", str(tmp_path / "a")])  # training: torchrun's world
    assert r.exit_code != 0 and "--world-size is for --plan only" in said(r)
    r = CliRunner().invoke(app, ["--pp", "2", "--steps", "1", "--out", str(tmp_path / "a")])  # one process, pp 2
    assert r.exit_code != 0 and "is not a multiple of pp*dp_replicate*cp*tp = 2*1*1*1 = 2" in said(r)
    r = CliRunner().invoke(app, ["--microbatches", "2", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "microbatches and pp_schedule are for pipeline parallelism" in said(r)
    r = CliRunner().invoke(app, ["--pp", "2", "--batch-size", "3", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "batch_size 3 must split into 2 micro-batches" in said(r)
    r = CliRunner().invoke(app, ["--pp", "4", "--microbatches", "2", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "moe-train: 1F1B needs num_microbatches=2 >= the 4 pipeline stages" in said(r)
    r = CliRunner().invoke(app, ["--pp", "2", "--microbatches", "0", "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and "moe-train: num_microbatches must be >= 1, got 0" in said(r)
    r = CliRunner().invoke(app, ["--tp", "2", "--steps", "1", "--out", str(tmp_path / "b")])  # one process, tp 2
    assert r.exit_code != 0 and "is not a multiple of pp*dp_replicate*cp*tp = 1*1*1*2 = 2" in said(r)


def test_cli_plan_takes_the_dispatch_capacity_and_the_pipeline_micro_batches():
    """--plan sizes the nvlink backend's rows from --capacity-factor, and with --pp splits the step's batch into
    its micro-batches as training does."""
    def plan(*extra):
        r = CliRunner().invoke(app, ["--plan", "--preset", "qwen3-30b-a3b", "--seq-len", "4096", *extra])
        assert r.exit_code == 0, r.output
        return r.output

    def gib(out: str, row: str) -> float:
        line = next(line for line in out.splitlines() if line.strip().startswith(row))
        return float(line.split()[-2] if line.split()[-1] == "GiB" else line.split()[-1].removesuffix("GiB"))

    worst = plan("--ep", "8", "--batch-size", "1", "--ep-backend", "nvlink")
    two = plan("--ep", "8", "--batch-size", "1", "--ep-backend", "nvlink", "--capacity-factor", "2")
    assert "nvlink dispatch, capacity 2x" in two and gib(two, "activations") < gib(worst, "activations")
    piped = plan("--pp", "2", "--ep", "2", "--world-size", "8", "--batch-size", "4", "--microbatches", "4")
    assert "per GPU, 1 x 4096 tokens per micro-batch (4 a step, 1f1b)" in piped
    r = CliRunner().invoke(app, ["--plan", "--preset", "qwen3-30b-a3b", "--pp", "2", "--batch-size", "3",
                                 "--world-size", "2"])
    assert r.exit_code == 1 and "batch_size 3 must split into 2 micro-batches" in r.output
