"""Master weights (moe_kernels.train.master, TrainConfig.master_weights), forced on on the CPU: bf16
parameters for compute, fp32 masters and main gradients. A step equals the recipe written out by hand bit for
bit (with grad_accum 2 the main gradients are fp32 sums of the batches' bf16 gradients), the forward casts no
parameter, the loss curve tracks the fp32 run's, a resume is bit-identical, the routers stay fp32, and
--plan's bytes are what the trainer holds."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_kernels.parallel.layout import ParallelConfig
from moe_kernels.parallel.plan import plan_memory
from moe_kernels.testing import assert_tracks_loss_curve
from moe_kernels.train.master import fp32_parameter_names
from moe_kernels.train.trainer import TrainConfig, Trainer, _param_groups, lr_factor
from tests.distributed import run_world

COMMON = dict(preset="tiny-qwen3-moe", num_layers=1, steps=4, batch_size=2, seq_len=32, warmup_steps=1,
              log_every=1, eval_every=100, eval_batches=1, checkpoint_every=100, device="cpu")


def _quiet(*_, **__):
    pass


def _trainer(tmp, name, **kw) -> Trainer:
    return Trainer(TrainConfig(**{**COMMON, **kw}, out_dir=f"{tmp}/{name}"), echo=_quiet)


class _Reference:
    """The recipe by hand: a bf16 model (routers fp32), fp32 master copies stepped by torch's AdamW from the
    fp32 sums of the bf16 gradients, the bf16 parameters the masters rounded."""

    def __init__(self, trainer: Trainer):  # an fp32 trainer of the same config: the same init and batches
        self.t = trainer
        keep = fp32_parameter_names(trainer.model_config)
        self.model = trainer.model
        self.cast = {n: p for n, p in self.model.named_parameters() if n not in keep}
        self.masters = {n: (p.detach().clone() if n in self.cast else p) for n, p in self.model.named_parameters()}
        for p in self.cast.values():
            p.data = p.data.to(torch.bfloat16)
        cfg = trainer.cfg
        groups = _param_groups(self.model, cfg.weight_decay)
        by_id = {id(p): self.masters[n] for n, p in self.model.named_parameters()}
        self.opt = torch.optim.AdamW([{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups],
                                     lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))

    def step(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        N = self.t.cfg.grad_accum
        main = {}
        for j in range(N):
            x, y = self.t.data.batch(step, j, N)
            loss, aux = self.model(x, y)
            ((loss + aux) / N if N > 1 else loss + aux).backward()
            for n, p in self.cast.items():  # each batch's bf16 gradient summed in fp32
                main[n] = p.grad.float() if n not in main else main[n] + p.grad.float()
                p.grad = None
        for n, m in self.masters.items():
            m.grad = main[n] if n in self.cast else m.grad
        torch.nn.utils.clip_grad_norm_(list(self.masters.values()), self.t.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.cast.items():
                p.copy_(self.masters[n])
        for layer in self.model.moe_layers():
            if layer.router.expert_bias is not None:
                layer.router.update_expert_bias()
        return main, loss


def _check_equal(trainer: Trainer, ref: _Reference, what: str) -> None:
    params = dict(trainer.model.named_parameters())
    for n, m in ref.masters.items():
        assert params[n].dtype == torch.float32 and torch.equal(params[n], m), f"{what}: master {n}"
    copies = {id(p): c for p, c in zip(trainer.master.params, trainer.master.copies)}
    for n, p in ref.cast.items():
        assert torch.equal(copies[id(params[n])], p), f"{what}: bf16 copy {n}"


def test_steps_equal_the_recipe_by_hand(tmp_path):
    # One batch a step with clipping (on the fp32 main gradients); two batches a step unclipped (a factor 1.0
    # keeps the main gradients as they were summed).
    for accum, clip in ((1, 1.0), (2, 1e9)):
        trainer = _trainer(tmp_path, f"mw{accum}", master_weights=True, grad_accum=accum, grad_clip=clip)
        ref = _Reference(_trainer(tmp_path, f"ref{accum}", grad_accum=accum, grad_clip=clip))
        assert ref.t.master is None and trainer.master is not None  # off on the CPU by default
        _check_equal(trainer, ref, "init")
        for step in range(2):
            main = {}
            seen = trainer.optimizer.register_step_pre_hook(lambda *_: main.update(
                {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
            out = trainer.train_step()
            seen.remove()
            want, _ = ref.step(step)
            if clip == 1.0:
                assert float(out["grad_norm"]) > clip  # the clipping ran
            else:
                for n, g in want.items():
                    assert main[n].dtype == torch.float32 and torch.equal(main[n], g), f"step {step}: main grad {n}"
            _check_equal(trainer, ref, f"accum {accum}, step {step}")


class _ParameterCasts(TorchDispatchMode):
    """Records the dtype conversions whose input is one of `named`'s tensors (by storage): their names."""

    def __init__(self, named):
        super().__init__()
        self.names = {t.untyped_storage().data_ptr(): n for n, t in named}
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and torch.is_tensor(args[0]):
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.casts.append(name)
        return func(*args, **(kwargs or {}))


def test_the_forward_casts_no_parameter(tmp_path):
    x, y = _trainer(tmp_path, "data").data.batch(0)
    for fused_ce in (False, True):
        trainer = _trainer(tmp_path, f"mw{fused_ce}", master_weights=True, fused_ce=fused_ce)
        with trainer._compute():
            with _ParameterCasts(trainer.model.named_parameters()) as mode:
                trainer._loss(x, y)
            dtypes = {n: p.dtype for n, p in trainer.model.named_parameters()}
        # The fused loss's CPU path upcasts the lm_head for its fp32-output GEMM (exact; CUDA has the GEMM).
        assert mode.casts == (["lm_head.weight"] * 2 if fused_ce else [])
    # The routers compute in fp32 (their own parameters), everything else in bf16; at rest all are fp32.
    assert {n for n, d in dtypes.items() if d == torch.float32} == {"layers.0.mlp.router.weight"}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    # The copies are written through the parameters: their version counters move (the FP8 weight cache's key).
    versions = [p._version for p in trainer.master.params]
    trainer.master.write_compute_copies()
    assert all(p._version > v for p, v in zip(trainer.master.params, versions))
    # Autocast over fp32 parameters (the trainer's without master weights, on CUDA) casts them in every
    # forward: the count sees it.
    fp32 = _trainer(tmp_path, "fp32", fused_ce=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), _ParameterCasts(fp32.model.named_parameters()) as mode:
        fp32.model(x)
    assert "layers.0.self_attn.q_proj.weight" in mode.casts


def test_loss_curve_tracks_fp32(tmp_path):
    def curve(name, **kw):
        t = _trainer(tmp_path, name, **kw)
        return torch.tensor([float(t.train_step()["loss"]) for _ in range(COMMON["steps"])], dtype=torch.float64)

    assert_tracks_loss_curve(curve("mw", master_weights=True), curve("fp32"), [curve("seed", seed=1)],
                             "bf16 parameters with fp32 master weights")


def test_resume_is_bit_identical(tmp_path):
    kw = dict(master_weights=True, checkpoint_every=2, grad_accum=2)
    whole = _trainer(tmp_path, "whole", **kw)
    whole.train()
    saved = torch.load(tmp_path / "whole/checkpoints/step_0000002.pt", weights_only=False)
    assert all(v.dtype == torch.float32 for v in saved["model"].values() if v.is_floating_point())  # the masters
    resumed = _trainer(tmp_path, "whole", **kw)  # the same out_dir: resumes from step 2
    assert resumed.resume(tmp_path / "whole/checkpoints/step_0000002.pt") and resumed.step == 2
    resumed.train()
    for (n, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(whole.master.copies, resumed.master.copies):
        assert torch.equal(a, b)
    router = resumed.model.layers[0].mlp.router.weight
    assert router.dtype == torch.float32 and all(id(router) != id(p) for p in resumed.master.params)


def test_plan_counts_what_the_trainer_holds(tmp_path):
    trainer = _trainer(tmp_path, "mw", master_weights=True)
    trainer.train_step()
    masters = sum(p.numel() * 4 for p in trainer.model.parameters())
    copies, main_grads = trainer.master.bytes()
    largest = max(c.numel() * c.element_size() for c in trainer.master.copies)
    router = sum(p.numel() * 4 for n, p in trainer.model.named_parameters() if "router" in n)
    adam = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.ndim > 0)
    plan = plan_memory(trainer.model_config, ParallelConfig().resolve(1), batch_size=2, seq_len=32,
                       master_weights=True)
    assert plan.params == masters + copies  # fp32 master 4 + bf16 copy 2 (not the routers')
    assert plan.grads == main_grads + router + largest  # fp32 main 4 (routers: their own fp32 .grad) + one bf16
    assert plan.optimizer == adam and plan.gathered == 0
    assert "fp32 + bf16 copies" in plan.table()


def _expert_parallel_worker(rank, world, tmp: str):
    cfg = dict(COMMON, expert_parallel=2, checkpoint_every=2, grad_accum=2)
    whole = _trainer(tmp, "ep", master_weights=True, **cfg)
    losses = [r["loss"] for r in whole.train() if r["kind"] == "train"]
    # The gradients are reduced after the backward, over the fp32 main gradients (no hooks on bf16 ones).
    assert whole.par.grad_reducer._handles == []
    fp32 = [r["loss"] for r in _trainer(tmp, "fp32", **cfg).train() if r["kind"] == "train"]
    for a, b in zip(losses, fp32):  # bf16 compute: a few bf16 ulps of the loss (1 ulp = 0.4%)
        assert abs(a - b) <= 2e-2 * b, (losses, fp32)
    resumed = _trainer(tmp, "ep", master_weights=True, **cfg)  # from the sharded step-2 checkpoint
    assert resumed.resume(f"{tmp}/ep/checkpoints/step_0000002") and resumed.step == 2
    resumed.train()
    for (n, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), n
    for a, b in zip(whole.master.copies, resumed.master.copies):
        assert torch.equal(a, b)


@pytest.mark.distributed
def test_expert_parallel_master_weights(tmp_path):
    """Two gloo ranks, experts split: the fp32 run's losses within bf16 rounding; a resume from the sharded
    checkpoint is bit-identical."""
    run_world(_expert_parallel_worker, 2, str(tmp_path))


def _fp8_experts_steps(kernels_accumulate: bool, micro_batches: int):
    """A GroupedExperts under the FP8 recipe with master weights: `micro_batches` backward passes into the main
    gradients. Returns the main gradients (w13, w2), each weight gradient product the recipe computed (in
    backward order: w2's, then w13's, per micro-batch; fp32 where the kernel accumulates, else the bf16 it
    returns), and the dtypes of the gradients autograd handed to the parameters."""
    import moe_kernels.quant.recipe as recipe_module
    from moe_kernels.nn.experts import GroupedExperts
    from moe_kernels.quant import Fp8BlockwiseRecipe
    from moe_kernels.train.master import MasterWeights

    torch.manual_seed(0)
    experts = GroupedExperts(3, 128, 128)
    recipe = Fp8BlockwiseRecipe()
    autograd_grads = []  # (a hook registered before the master weights' fold, which frees the gradient)
    for p in experts.parameters():
        p.register_post_accumulate_grad_hook(lambda p: autograd_grads.append(p.grad.dtype) if p.grad is not None
                                             else None)
    master = MasterWeights(experts, kernels_accumulate=kernels_accumulate)
    products = []
    original = recipe_module.grouped_mm_fp8_wgrad

    def spy(*args, out=None, accumulate=False, **kw):
        products.append(original(*args, **kw))  # the product alone (fp32, or the bf16 the hook path returns)
        return original(*args, out=out, accumulate=accumulate, **kw)

    gs = torch.tensor([128, 0, 256], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    recipe_module.grouped_mm_fp8_wgrad = spy
    try:
        with master.compute():
            for _ in range(micro_batches):
                x = torch.randn(384, 128, generator=gen).bfloat16()
                experts(x, gs, mm=recipe.grouped_mm).float().square().sum().backward()
    finally:
        recipe_module.grouped_mm_fp8_wgrad = original
        master.remove_hooks()
    return (experts.w13.grad, experts.w2.grad), products, autograd_grads


def _in_order(terms):
    total = terms[0].float().clone()
    for t in terms[1:]:
        total += t.float()
    return total


def test_fp8_wgrad_accumulates_into_the_main_gradient_itself():
    """The FP8 recipe's wgrad writes the first micro-batch's product into the fp32 main gradient and adds the
    later ones there from its epilogue (moe_kernels.nn.grad_sink): autograd gets no gradient for the expert
    weights, and the main gradient is the fp32 products summed in order, bit for bit. The hook's path sums
    the same products rounded to bf16 first."""

    (w13, w2), products, autograd_grads = _fp8_experts_steps(True, 3)
    assert autograd_grads == [] and all(t.dtype == torch.float32 for t in products) and len(products) == 6
    assert torch.equal(w2, _in_order(products[0::2])) and torch.equal(w13, _in_order(products[1::2]))
    (h13, h2), hooked_products, hooked_grads = _fp8_experts_steps(False, 3)
    assert hooked_grads == [torch.bfloat16] * 6 and all(t.dtype == torch.bfloat16 for t in hooked_products)
    assert torch.equal(h2, _in_order(hooked_products[0::2])) and torch.equal(h13, _in_order(hooked_products[1::2]))
    # The same products: the bf16 ones are the fp32 ones rounded once.
    for fp32, bf16 in zip(products, hooked_products):
        assert torch.equal(fp32.to(torch.bfloat16), bf16)
    assert not torch.equal(w13, h13)


def _fp8_layer_steps(monkeypatch, refresh: bool, steps: int = 3):
    """An FP8-recipe MoELayer trained with master weights and the weight cache on, as moe-train runs it: the
    losses, the final masters, and the weight cache's counts."""
    from moe_kernels.nn import PRESETS, MoELayer
    from moe_kernels.quant import Fp8BlockwiseRecipe, weight_cache
    from moe_kernels.train.master import MasterWeights

    if not refresh:
        monkeypatch.setattr(weight_cache, "refresh", lambda w, master: False)
    torch.manual_seed(0)
    cfg = PRESETS["qwen3-30b-a3b"](hidden_size=128, ffn_size=128, num_experts=4, k=2, recipe=Fp8BlockwiseRecipe())
    layer = MoELayer(cfg)
    master = MasterWeights(layer, {n for n, _ in layer.named_parameters() if n.startswith("router.")})
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    weight_cache.enable(True)
    before = weight_cache.stats()
    try:
        for _ in range(steps):
            with master.compute():
                for _ in range(2):
                    x = torch.randn(1, 96, 128, generator=gen).bfloat16()
                    out, aux = layer(x)
                    loss = out.float().square().mean() + aux
                    loss.backward()
                    losses.append(loss.detach())
            opt.step()
            master.write_compute_copies()
            opt.zero_grad(set_to_none=True)
    finally:
        counts = {k: weight_cache.stats()[k] - before[k] for k in ("quantized", "refreshed", "hits")}
        weight_cache.enable(False)
        master.remove_hooks()
    return torch.stack(losses), {n: p.detach().clone() for n, p in layer.named_parameters()}, counts


def test_fp8_step_writes_the_tiles_with_the_copies(monkeypatch):
    """The step's write of the bf16 copies remakes the FP8 tiles of the expert weights in the same pass
    (weight_cache.refresh): after the first step no forward quantizes, and training is bit-identical to
    copying the masters and quantizing the copies in the next forward."""
    losses, params, counts = _fp8_layer_steps(monkeypatch, refresh=True)
    assert counts["quantized"] == 2 and counts["refreshed"] == 2 * 3  # w13 and w2: the first forward, each step
    with monkeypatch.context() as m:
        want_losses, want_params, want_counts = _fp8_layer_steps(m, refresh=False)
    assert want_counts["quantized"] == 2 * 3 and want_counts["refreshed"] == 0
    assert torch.equal(losses, want_losses)
    for n, p in params.items():
        assert torch.equal(p, want_params[n]), n
