"""ONNX export (moe_kernels.onnx): models on moe_kernels' ops export with `torch.onnx.export(..., dynamo=True)` as
it is, and onnxruntime runs them.

Error model for the comparisons with onnxruntime: the exported graph computes what the PyTorch model computes,
in fp32, with the same routing; onnxruntime and PyTorch differ only in how they round (the order of the sums in
GEMMs, softmax and norms, their exp / rsqrt / sigmoid approximations). So against the model in fp64,
onnxruntime's error is PyTorch's fp32 error in size: moe_kernels.testing.assert_close_to_fp64 (at most twice
PyTorch's, plus 8 fp32 ulps). Routing and data movement (chosen experts, row maps, group sizes, permuted rows,
counts) compare exactly; the ops' float results within fp32 rounding of their references
(assert_within_fp32_rounding)."""

import copy
import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers", minversion="5.0")

import moe_kernels as mk  # noqa: E402
from moe_kernels import onnx as mk_onnx  # noqa: E402
from moe_kernels.testing import (  # noqa: E402
    assert_close_to_fp64,
    assert_exact,
    assert_within_fp32_rounding,
    random_routing,
)
from tests.integrations.hf_models import H, _decisive_ids, _recorded_routing, build, inputs, moe_blocks  # noqa: E402

router_mod = importlib.import_module("moe_kernels.ops.router")
permute_mod = importlib.import_module("moe_kernels.ops.permute")
grouped_mm_mod = importlib.import_module("moe_kernels.ops.grouped_mm")
activation_mod = importlib.import_module("moe_kernels.ops.activation")


def _session(onnx_program) -> "ort.InferenceSession":
    return ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(session, *args) -> list[torch.Tensor]:
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


def assert_exports_and_runs(model, ref64, ids) -> None:
    """torch.onnx.export of the patched transformers model `model` on ids as it is: the ops' ONNX formulations, no
    moe_kernels op left in the graph, onnxruntime's logits within assert_close_to_fp64's bound of the model's own
    against ref64 (transformers' model in fp64; ids routed alike in fp32 and fp64)."""
    onnx_program = torch.onnx.export(model, (ids,), dynamo=True)
    assert not mk_onnx.exporting()
    assert not any(n.domain.startswith("moe_kernels") for n in onnx_program.model.graph)
    with torch.no_grad():
        ours, exact = model(ids).logits, ref64(ids).logits
    (got,) = _run(_session(onnx_program), ids)
    assert_close_to_fp64(got, ours, exact, "onnxruntime's logits")


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def _ops_called(model: nn.Module, ids: torch.Tensor) -> set[str]:
    """The moe_kernels ops a forward of `model` calls."""
    with torch.no_grad(), _OpRecorder() as recorder:
        model(ids)
    return {op for op in recorder.ops if op.startswith("moe_kernels.")}


def _custom_ops(graph: torch.fx.Graph) -> set[str]:
    return {str(n.target) for n in graph.nodes if n.op == "call_function" and "moe_kernels" in str(n.target)}


# ---------------------------------------------------------------------------------------------------
# The formulations, eagerly, against the references


@pytest.mark.parametrize("kind", ["uniform", "hot", "empty"])
@pytest.mark.parametrize("align", [1, 4])
def test_formulations_equal_the_references(kind, align):
    T, H, F_, E, k = 13, 8, 6, 6, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    idx = random_routing(T, E, k, kind=kind, drop=0.2, seed=1)
    for got, want, what in zip(mk_onnx.permute_traceable(x, idx, E, align),
                               permute_mod.permute_reference(x, idx, E, align), ("x_perm", "row_map", "group_sizes")):
        assert_exact(got, want, what)
    x_perm, row_map, sizes = permute_mod.permute_reference(x, idx, E, align)
    assert_exact(mk_onnx.tokens_per_expert_traceable(idx, E), permute_mod.tokens_per_expert_reference(idx, E), "counts")
    for dtype in (torch.float32, torch.float64):
        w13 = torch.randn(E, 2 * F_, H, generator=g, dtype=dtype)
        xp = x_perm.to(dtype)
        h = mk_onnx.grouped_mm_traceable(xp, w13, sizes)
        want = grouped_mm_mod.grouped_mm_reference(xp, w13, sizes)
        magnitude = grouped_mm_mod.grouped_mm_reference(xp.abs(), w13.abs(), sizes)
        assert_within_fp32_rounding(h, want, magnitude, f"grouped_mm {dtype}")
        assert not h[int(sizes.sum()):].any()  # rows past the groups: zero
        assert_exact(mk_onnx.swiglu_traceable(h), activation_mod.swiglu_reference(h), f"swiglu {dtype}")
        assert_exact(mk_onnx.squared_relu_traceable(h), activation_mod.squared_relu_reference(h),
                     f"squared_relu {dtype}")
        w = torch.rand(T, k, generator=g)
        assert_exact(mk_onnx.unpermute_traceable(h, row_map, w), permute_mod.unpermute_reference(h, row_map, w),
                     f"unpermute {dtype}")


ROUTERS = {  # the router_topk options the patched families use, as the op's explicit arguments
    "softmax": dict(k=2, score="softmax", pre_softmax=False, num_groups=1, group_topk=1, group_score_topk=1,
                    scaling_factor=1.0, normalize=True),
    "pre_softmax": dict(k=2, score="softmax", pre_softmax=True, num_groups=1, group_topk=1, group_score_topk=1,
                        scaling_factor=1.0, normalize=False),
    "biased_softmax": dict(k=2, score="softmax", pre_softmax=True, num_groups=1, group_topk=1, group_score_topk=1,
                           scaling_factor=1.0, normalize=True),
    "grouped_sigmoid": dict(k=3, score="sigmoid", pre_softmax=False, num_groups=4, group_topk=2, group_score_topk=2,
                            scaling_factor=2.5, normalize=True),
    "sqrtsoftplus": dict(k=3, score="sqrtsoftplus", pre_softmax=False, num_groups=1, group_topk=1,
                         group_score_topk=1, scaling_factor=1.0, normalize=False),
}


def _router_args(name: str, bias: torch.Tensor):
    o = ROUTERS[name]
    return (o["k"], o["score"], o["pre_softmax"], o["num_groups"], o["group_topk"], o["group_score_topk"],
            o["scaling_factor"], bias if _biased(o) else None, o["normalize"])


def _biased(o: dict) -> bool:
    return o["score"] != "softmax" or o["pre_softmax"] and o["normalize"]  # and ERNIE-4.5's softmax


@pytest.mark.parametrize("name", ROUTERS)
def test_router_formulation_equals_the_reference(name):
    """Distinct scores (torch.topk's order of ties is not specified in eager; ONNX's is checked below)."""
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 0.1
    args = _router_args(name, bias)
    w, idx = mk_onnx.router_topk_traceable(logits, *args)
    w_ref, idx_ref = router_mod.router_topk_reference(logits, *args)
    assert_exact(idx, idx_ref, "indices")
    assert_exact(w, w_ref, "weights")


# ---------------------------------------------------------------------------------------------------
# The ops in onnxruntime: ties, -inf and NaN logits, dropped slots, padding, empty groups


class _Ops(nn.Module):
    """Every op with a formulation, on inputs given at run time; returns all their outputs."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, align: int):
        super().__init__()
        self.w13, self.w2, self.align = nn.Parameter(w13), nn.Parameter(w2), align

    def forward(self, logits, bias, x, indices, weights):
        routed = []
        for o in ROUTERS.values():
            kw = {key: v for key, v in o.items() if key != "k"}
            routed += mk.router_topk(logits, o["k"], expert_bias=bias if _biased(o) else None, **kw)
        E = self.w13.shape[0]
        x_perm, row_map, sizes = mk.permute(x, indices, E, align=self.align)
        h = mk.grouped_mm(x_perm, self.w13, sizes)
        y = mk.grouped_mm(mk.ops.swiglu(h), self.w2, sizes)
        return (*routed, x_perm, row_map, sizes, h, y, mk.unpermute(y, row_map, weights),
                mk.tokens_per_expert(indices, E))


def test_ops_in_onnxruntime_follow_the_ops_rules():
    T, H, F_, E, align = 16, 8, 4, 8, 4
    g = torch.Generator().manual_seed(4)
    # Scores from a few values: many exact ties (the lower expert index first), -inf and NaN logits.
    logits = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])[torch.randint(0, 5, (T, E), generator=g)]
    logits[3, ::2] = -torch.inf
    logits[5] = -torch.inf
    logits[7, 1] = torch.nan
    logits[9, :5] = torch.nan
    bias = torch.tensor([0.0, 0.5])[torch.randint(0, 2, (E,), generator=g)]
    x = torch.randn(T, H, generator=g)
    indices = random_routing(T, E, 3, kind="empty", drop=0.25, seed=5)  # odd experts empty, a quarter dropped
    weights = torch.rand(T, 3, generator=g)
    w13, w2 = torch.randn(E, 2 * F_, H, generator=g), torch.randn(E, H, F_, generator=g)
    module = _Ops(w13, w2, align).eval()
    args = (logits, bias, x, indices, weights)
    got = _run(_session(torch.onnx.export(module, args, dynamo=True)), *args)

    for i, name in enumerate(ROUTERS):
        w_ref, idx_ref = router_mod.router_topk_reference(logits, *_router_args(name, bias))
        w, idx = got[2 * i], got[2 * i + 1]
        assert_exact(idx, idx_ref, f"{name} indices")
        assert torch.equal(w.isnan(), w_ref.isnan()), f"{name}: NaN weights"
        assert_within_fp32_rounding(w.nan_to_num(), w_ref.nan_to_num(), w_ref.nan_to_num().abs(), f"{name} weights")
    x_perm, row_map, sizes, h, y, out, counts = got[2 * len(ROUTERS):]
    for a, b, what in zip((x_perm, row_map, sizes), permute_mod.permute_reference(x, indices, E, align),
                          ("x_perm", "row_map", "group_sizes")):
        assert_exact(a, b, what)
    assert_exact(counts, permute_mod.tokens_per_expert_reference(indices, E), "tokens_per_expert")
    mm = grouped_mm_mod.grouped_mm_reference
    assert_within_fp32_rounding(h, mm(x_perm, w13, sizes), mm(x_perm.abs(), w13.abs(), sizes), "grouped_mm")
    act = activation_mod.swiglu_reference(h)
    assert_within_fp32_rounding(y, mm(act, w2, sizes), mm(act.abs(), w2.abs(), sizes), "grouped_mm (down)")
    assert_within_fp32_rounding(out, permute_mod.unpermute_reference(y, row_map, weights),
                                permute_mod.unpermute_reference(y.abs(), row_map, weights), "unpermute")


# ---------------------------------------------------------------------------------------------------
# patch_hf models: torch.onnx.export as it is, onnxruntime against PyTorch and fp64


def _models(family: str):
    """(fp32 model patched by patch_hf, transformers' own model in fp64: eager experts, the same weights),
    one MoE layer, no KV cache (a DynamicCache output does not export, patched or not)."""
    base = build(family, layers=1, use_cache=False).eval()
    ref64 = copy.deepcopy(base).double()
    ref64.set_experts_implementation("eager")
    return mk.patch_hf(base), ref64


def _assert_matches(session, model, ref64, ids, what):
    with torch.no_grad():
        ours = model(ids).logits
        exact = ref64(ids).logits
    (got,) = _run(session, ids)
    assert_close_to_fp64(got, ours, exact, f"{what}: onnxruntime's logits")


@pytest.mark.parametrize(("family", "dynamic"), [("qwen3_moe", True), ("deepseek_v3", False), ("mixtral", False),
                                               ("nemotron_h", False)])
def test_patched_model_exports_and_runs_in_onnxruntime(family, dynamic):
    model, ref64 = _models(family)
    ids = _decisive_ids(model, ref64, moe_blocks(model)[0].gate.top_k, "cpu")  # fp32 routes as fp64 does
    if dynamic:
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
        onnx_program = torch.onnx.export(model, (ids,), dynamo=True, dynamic_shapes=(dims,))
    else:
        onnx_program = torch.onnx.export(model, (ids,), dynamo=True)  # the call, no extra arguments
    assert not mk_onnx.exporting()
    assert not any(n.domain.startswith("moe_kernels") for n in onnx_program.model.graph)
    session = _session(onnx_program)
    _assert_matches(session, model, ref64, ids, family)
    if dynamic:
        for batch, seq in ((3, 5), (1, 1)):
            other = inputs(seed=7, batch=batch, seq=seq)
            with torch.no_grad(), _recorded_routing(model) as (picks, _), _recorded_routing(ref64) as (picks64, _):
                model(other), ref64(other)
            assert all(torch.equal(a, b) for a, b in zip(picks, picks64, strict=True))
            _assert_matches(session, model, ref64, other, f"{family} [{batch}, {seq}]")
    assert _ops_called(model, ids) >= {"moe_kernels.router_topk.default", "moe_kernels.permute.default",
                                       "moe_kernels.grouped_mm.default", "moe_kernels.unpermute.default",
                                       *(["moe_kernels.squared_relu.default"] if family == "nemotron_h" else [])}


def test_exported_program_decomposes_for_onnx():
    """torch.export keeps the custom ops (kernels for AOTInductor); decompositions() makes that program exportable."""
    model, ref64 = _models("mixtral")
    ids = _decisive_ids(model, ref64, moe_blocks(model)[0].gate.top_k, "cpu")
    ep = torch.export.export(model, (ids,))
    assert _custom_ops(ep.graph) >= {"moe_kernels.router_topk.default", "moe_kernels.permute.default",
                                     "moe_kernels.grouped_mm.default", "moe_kernels.unpermute.default"}
    ep = ep.run_decompositions(mk_onnx.decompositions())
    assert not _custom_ops(ep.graph)
    _assert_matches(_session(torch.onnx.export(ep)), model, ref64, ids, "decomposed ExportedProgram")


def test_unpatched_model_still_exports():
    """transformers' own code after patch_hf + unpatch_hf, with its exportable experts ("batched_mm": its default
    on the CPU, "grouped_mm", calls a custom op of transformers' that torch.onnx cannot convert either)."""
    model = build("qwen3_moe", layers=1, use_cache=False).eval()
    model.set_experts_implementation("batched_mm")
    mk.unpatch_hf(mk.patch_hf(model))
    ref64 = copy.deepcopy(model).double()
    ids = inputs()
    _assert_matches(_session(torch.onnx.export(model, (ids,), dynamo=True)), model, ref64, ids, "unpatched")


def test_import_loads_no_onnx_package():
    script = ("import sys, moe_kernels\n"
              "loaded = [m for m in ('onnx', 'onnxscript', 'onnxruntime', 'torch.onnx') if m in sys.modules]\n"
              "assert not loaded, loaded\n"
              "assert not moe_kernels.onnx.exporting()\n")
    subprocess.run([sys.executable, "-c", script], check=True)


class _BlockOutput(nn.Module):
    """The MoE block's output tensor (Llama 4's block returns (output, router logits))."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def test_fused_lora_on_llama4_exports():
    """Llama 4's patched block exports through transformers' forward, which reads the weights: while exporting, the
    fused peft adapters take peft's own path (W + s B A in the weight), so the exported block keeps the adapter
    (GPT-OSS's and Aria's experts, also stored [E, K, N], take the same path: test_peft.py; transformers' own
    forward of theirs does not export). Error model: the export's fp32 W + s B A products against eager's rank-r
    ones, a few fp32 roundings of the output's scale."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    torch.manual_seed(0)
    model = mk.patch_hf(peft.get_peft_model(build("llama4", layers=1, use_cache=False), config)).eval()
    block = _BlockOutput(moe_blocks(model.get_base_model())[0]).eval()
    x = torch.randn(1, 6, H)
    with torch.no_grad():
        eager = block(x)
        with model.disable_adapter():
            base = block(x)
    assert (eager - base).abs().max() > 0.1  # the adapter matters
    onnx_program = torch.onnx.export(block, (x,), dynamo=True)
    session = _session(onnx_program)
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]).reshape(eager.shape)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5 * eager.abs().max().item())
