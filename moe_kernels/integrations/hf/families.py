"""The supported families (router, block and experts classes per transformers module) and the families matched by
their router's code."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .common import _TM
from .experts import _dbrx_experts_forward, _ergo_experts_forward, _llama4_block_forward, _llama4_experts_forward
from .jetmoe import (
    BLOCK_METHODS,
    MOA_METHODS,
    _projection_forward,
    jetmoe_dims,
    jetmoe_moa_problem,
    jetmoe_problem,
    jetmoe_router_forward,
)
from .routings import (
    afmoe_problem,
    afmoe_router_forward,
    aria_router_forward,
    axk2_problem,
    beam_router_forward,
    cohere2_problem,
    cohere2_router_forward,
    dbrx_problem,
    deepseek_v2_problem,
    deepseek_v2_router_forward,
    deepseek_v3_problem,
    deepseek_v3_router_forward,
    deepseek_v4_problem,
    deepseek_v4_router_forward,
    ergo_problem,
    ergo_router_forward,
    ernie_problem,
    ernie_router_forward,
    flint_router_forward,
    gemma4_router_forward,
    gpt_oss_router_forward,
    granite_router_forward,
    hunyuan_router_forward,
    hy_v3_problem,
    hy_v3_router_forward,
    inkling2_problem,
    inkling2_router_forward,
    jamba_router_forward,
    laguna_problem,
    laguna_router_forward,
    lara_mini_router_forward,
    lfm2_problem,
    lfm2_router_forward,
    llama4_problem,
    longcat_problem,
    longcat_router_forward,
    minicpm5_router_forward,
    minimax_m2_problem,
    minimax_m2_router_forward,
    minimax_m3_problem,
    minimax_m3_router_forward,
    mistral4_problem,
    mistral4_router_forward,
    mistral_large4_router_forward,
    mixtral_router_forward,
    qwen_normalized_router_forward,
    qwen_router_forward,
)


def _ergo_dims(experts: nn.Module) -> tuple[int, int, object]:
    """(H, F, weight dtype) of Ergo's experts: up_proj [E, H, F], down_proj [E, F, H]."""
    return experts.up_proj.shape[1], experts.up_proj.shape[2], experts.up_proj.dtype


def _dbrx_dims(experts: nn.Module) -> tuple[int, int, object]:
    """(H, F, weight dtype) of DBRX's experts, whose weights sit on their GLU module (w1, v1, w2 [E * F, H])."""
    return experts.hidden_size, experts.ffn_hidden_size, experts.mlp.w2.dtype


@dataclass(frozen=True)
class _Family:
    name: str
    module: str  # transformers module defining the classes
    block: str
    gate: str
    experts: str
    router_forward: Callable
    problem: Callable | None = None  # (gate, block, E) -> why the router's settings do not run, or None
    reference: bool = True  # its router's code is a routing reference other families are matched against
    zero_experts: str | None = None  # the block's count of zero-computation experts the router also scores
    kn_experts: bool = False  # experts stored [E, K, N] (is_transposed; GPT-OSS's with biases, interleaved gate/up)
    block_forward: Callable | None = None  # the block's forward replaced (its router stays transformers')
    # the experts' forward replaced: with block_forward, the one the block calls; alone, experts outside transformers'
    # experts interface (DBRX's), behind transformers' block and router (or our router_forward: Ergo's)
    experts_forward: Callable | None = None
    # (experts) -> (H, F, weight dtype) where the weights are not the experts' gate_up_proj / down_proj (DBRX's)
    expert_dims: Callable | None = None
    experts_only_routers: tuple[str, ...] = ()  # router classes that stay transformers' (our experts behind them)
    # (name, function) of the block's methods replaced where its experts are its own projections (JetMoE's: no
    # experts module; `problem` checks the block whole, `expert_dims` reads the block)
    block_methods: tuple[tuple[str, Callable], ...] = ()


FAMILIES = (
    _Family("Mixtral", _TM + "mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter",
            "MixtralExperts", mixtral_router_forward),
    _Family("Qwen2-MoE", _TM + "qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter",
            "Qwen2MoeExperts", qwen_router_forward),
    _Family("Qwen3-MoE", _TM + "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter",
            "Qwen3MoeExperts", qwen_router_forward, reference=False),
    _Family("OLMoE", _TM + "olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts",
            qwen_router_forward, reference=False),
    _Family("DeepSeek-V3", _TM + "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter",
            "DeepseekV3Experts", deepseek_v3_router_forward, deepseek_v3_problem),
    _Family("Qwen3-VL-MoE", _TM + "qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock",
            "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextExperts", qwen_normalized_router_forward),
    _Family("MiniMax-M2", _TM + "minimax_m2.modeling_minimax_m2", "MiniMaxM2SparseMoeBlock", "MiniMaxM2TopKRouter",
            "MiniMaxM2Experts", minimax_m2_router_forward, minimax_m2_problem),
    _Family("DeepSeek-V2", _TM + "deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe", "DeepseekV2TopkRouter",
            "DeepseekV2Experts", deepseek_v2_router_forward, deepseek_v2_problem),
    _Family("GPT-OSS", _TM + "gpt_oss.modeling_gpt_oss", "GptOssMLP", "GptOssTopKRouter", "GptOssExperts",
            gpt_oss_router_forward, kn_experts=True),
    _Family("ERNIE-4.5", _TM + "ernie4_5_moe.modeling_ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock",
            "Ernie4_5_MoeTopKRouter", "Ernie4_5_MoeExperts", ernie_router_forward, ernie_problem),
    _Family("DeepSeek-V4", _TM + "deepseek_v4.modeling_deepseek_v4", "DeepseekV4SparseMoeBlock",
            "DeepseekV4TopKRouter", "DeepseekV4Experts", deepseek_v4_router_forward, deepseek_v4_problem,
            experts_only_routers=("DeepseekV4HashRouter",)),
    _Family("Mistral 4", _TM + "mistral4.modeling_mistral4", "Mistral4MoE", "Mistral4TopkRouter", "Mistral4Experts",
            mistral4_router_forward, mistral4_problem),
    _Family("Mistral Large 4", _TM + "mistral_large4.modeling_mistral_large4", "MistralLarge4TextMoE",
            "MistralLarge4TextTopkRouter", "MistralLarge4TextExperts", mistral_large4_router_forward,
            mistral4_problem),
    _Family("Gemma 4", _TM + "gemma4.modeling_gemma4", "Gemma4TextDecoderLayer", "Gemma4TextRouter",
            "Gemma4TextExperts", gemma4_router_forward),
    _Family("Llama 4", _TM + "llama4.modeling_llama4", "Llama4TextMoe", "Llama4Router", "Llama4TextExperts", None,
            llama4_problem, reference=False, block_forward=_llama4_block_forward,
            experts_forward=_llama4_experts_forward),
    _Family("Granite-MoE", _TM + "granitemoe.modeling_granitemoe", "GraniteMoeMoE", "GraniteMoeTopKRouter",
            "GraniteMoeExperts", granite_router_forward),
    _Family("Jamba", _TM + "jamba.modeling_jamba", "JambaSparseMoeBlock", "JambaTopKRouter", "JambaExperts",
            jamba_router_forward),
    _Family("HunYuan-MoE-V1", _TM + "hunyuan_v1_moe.modeling_hunyuan_v1_moe", "HunYuanMoEV1Moe", "HunYuanMoEV1Gate",
            "HunYuanMoEV1Experts", hunyuan_router_forward),
    _Family("LFM2-MoE", _TM + "lfm2_moe.modeling_lfm2_moe", "Lfm2MoeSparseMoeBlock", "Lfm2MoeTopKRouter",
            "Lfm2MoeExperts", lfm2_router_forward, lfm2_problem),
    _Family("AFMoE", _TM + "afmoe.modeling_afmoe", "AfmoeSparseMoeBlock", "AfmoeTokenChoiceRouter", "AfmoeExperts",
            afmoe_router_forward, afmoe_problem),
    _Family("Cohere2-MoE", _TM + "cohere2_moe.modeling_cohere2_moe", "Cohere2MoeSparseMoeBlock",
            "Cohere2MoeTopKRouter", "Cohere2MoeExperts", cohere2_router_forward, cohere2_problem),
    _Family("HY-V3", _TM + "hy_v3.modeling_hy_v3", "HYV3MoE", "HYV3TopKRouter", "HYV3Experts", hy_v3_router_forward,
            hy_v3_problem),
    _Family("Laguna", _TM + "laguna.modeling_laguna", "LagunaSparseMoeBlock", "LagunaTopKRouter", "LagunaExperts",
            laguna_router_forward, laguna_problem),
    _Family("MiniCPM5-MoE", _TM + "minicpm5_moe.modeling_minicpm5_moe", "MiniCPM5MoeMoE", "MiniCPM5MoeTopkRouter",
            "MiniCPM5MoeExperts", minicpm5_router_forward, deepseek_v3_problem),
    _Family("AXK2", _TM + "axk2.modeling_axk2", "AXK2MoE", "AXK2TopkRouter", "AXK2Experts",
            deepseek_v3_router_forward, axk2_problem, reference=False),
    _Family("Beam", _TM + "beam.modeling_beam", "BeamMoE", "BeamTopKRouter", "BeamExperts", beam_router_forward,
            deepseek_v3_problem),
    _Family("Lara-Mini", _TM + "lara_mini.modeling_lara_mini", "LaraMiniSparseMoeBlock", "LaraMiniTopKRouter",
            "LaraMiniExperts", lara_mini_router_forward),
    _Family("Flint", _TM + "flint.modeling_flint", "FlintSparseMoeBlock", "FlintTopKRouter", "FlintExperts",
            flint_router_forward),
    _Family("Inkling2", _TM + "inkling2.modeling_inkling2", "Inkling2SparseMoeBlock", "Inkling2TopKRouter",
            "Inkling2Experts", inkling2_router_forward, inkling2_problem),
    _Family("MiniMax-M3", _TM + "minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLSparseMoeBlock",
            "MiniMaxM3VLTopKRouter", "MiniMaxM3VLExperts", minimax_m3_router_forward, minimax_m3_problem),
    _Family("Aria", _TM + "aria.modeling_aria", "AriaTextMoELayer", "AriaTextTopKRouter", "AriaExperts",
            aria_router_forward, kn_experts=True),
    # Routers router_topk does not reproduce, left as they are, our experts behind them:
    # PhiMoE's sparsemixer (experts sampled in training, a straight-through gradient), Kolibri's selection by
    # logit + bias with the chosen logits' sigmoids as weights, Zaya's MLP router carrying state across layers.
    _Family("PhiMoE", _TM + "phimoe.modeling_phimoe", "PhimoeSparseMoeBlock", "PhimoeTopKRouter", "PhimoeExperts",
            None, reference=False, experts_only_routers=("PhimoeTopKRouter",)),
    _Family("Kolibri", _TM + "kolibri1.modeling_kolibri1", "Kolibri1SparseMoeBlock", "Kolibri1TopKRouter",
            "Kolibri1Experts", None, reference=False, experts_only_routers=("Kolibri1TopKRouter",)),
    _Family("Zaya", _TM + "zaya.modeling_zaya", "ZayaSparseMoeBlock", "ZayaRouter", "ZayaExperts", None,
            reference=False, experts_only_routers=("ZayaRouter",)),
    # Kolibri 1.1's router is Kolibri's selection (logit + bias, the chosen logits' sigmoids); Inkling's weighs the
    # chosen experts and its shared experts together (a softmax over their log-sigmoids) and returns the shared
    # experts' share beside the routed weights.
    _Family("Kolibri 1.1", _TM + "kolibri1_1.modeling_kolibri1_1", "Kolibri1_1SparseMoeBlock", "Kolibri1_1TopKRouter",
            "Kolibri1_1Experts", None, reference=False, experts_only_routers=("Kolibri1_1TopKRouter",)),
    _Family("Inkling", _TM + "inkling.modeling_inkling", "InklingMoE", "InklingTopkRouter", "InklingExperts", None,
            reference=False, experts_only_routers=("InklingTopkRouter",)),
    # Muse Spark: its router (top-k weights renormalised with an epsilon, then scaled) stays; its experts apply a norm
    # to each expert's output before the routing weight (post_expert_norm), on the projected width.
    _Family("Muse Spark", _TM + "muse_spark.modeling_muse_spark", "MuseSparkMoE", "MuseSparkTopkRouter",
            "MuseSparkExperts", None, reference=False, experts_only_routers=("MuseSparkTopkRouter",)),
    # DBRX: its block and router stay transformers'; its experts (no experts interface) run ours.
    _Family("DBRX", _TM + "dbrx.modeling_dbrx", "DbrxFFN", "DbrxRouter", "DbrxExperts", None, dbrx_problem,
            reference=False, experts_forward=_dbrx_experts_forward, experts_only_routers=("DbrxRouter",),
            expert_dims=_dbrx_dims),
    # Ergo: our router; its experts (without a gate, stored [E, K, N], an RMSNorm per expert after them) replaced
    # whole, the norm on the permuted rows.
    _Family("Ergo", _TM + "ergo.modeling_ergo", "ErgoMoE", "ErgoTopkRouter", "ErgoExperts", ergo_router_forward,
            ergo_problem, reference=False, experts_forward=_ergo_experts_forward, expert_dims=_ergo_dims),
    # JetMoE: its MoE block and its attention experts (MoA), the experts' projections on the block itself; the block's
    # forward (the MoA's map and reduce), the router and the projections' forward replaced
    # (moe_kernels.integrations.hf.jetmoe).
    _Family("JetMoE", _TM + "jetmoe.modeling_jetmoe", "JetMoeMoE", "JetMoeTopKGating", "JetMoeParallelExperts",
            jetmoe_router_forward, jetmoe_problem, reference=False, experts_forward=_projection_forward,
            expert_dims=jetmoe_dims, block_methods=BLOCK_METHODS),
    _Family("JetMoE", _TM + "jetmoe.modeling_jetmoe", "JetMoeMoA", "JetMoeTopKGating",
            "JetMoeParallelExperts", jetmoe_router_forward, jetmoe_moa_problem, reference=False,
            experts_forward=_projection_forward, expert_dims=jetmoe_dims, block_methods=MOA_METHODS),
    _Family("Longcat-Flash", _TM + "longcat_flash.modeling_longcat_flash", "LongcatFlashMoE", "LongcatFlashTopkRouter",
            "LongcatFlashExperts", longcat_router_forward, longcat_problem, zero_experts="zero_expert_num"),
)

SUPPORTED = tuple(dict.fromkeys(f.name for f in FAMILIES))  # (JetMoE's two blocks: one family)


def _family_classes(fam: _Family):
    """(block, gate, experts) classes, or None when transformers has not loaded that family's module (then
    no model in this process can hold one of its blocks)."""
    mod = sys.modules.get(fam.module)
    if mod is None:
        return None
    classes = tuple(getattr(mod, name, None) for name in (fam.block, fam.gate, fam.experts))
    return None if any(c is None for c in classes) else classes


# Families matched by their router's code. transformers generates most MoE models from a few (its modular
# files), so many routers are a reference family's router under another name (GLM-4.5's, Dots1's, Kimi-Linear's
# are DeepSeek-V3's; Qwen3-Next's and FlexOlmo's are Qwen2-MoE's; MiniMax's is Mixtral's). A router class routes
# exactly as a reference family does when its `forward` has the reference's source text, character for
# character, and every global name that source reads (F, torch, nn, helpers) is the same object in both modules:
# then the same code runs on the same attributes. Checked in the installed transformers, class by class, so a
# router that transformers changes stops matching (and is left alone, named in the warning) instead of being
# routed by code that no longer agrees with it.
_MATCHED: dict[type, _Family | None] = {}


def _forward_of(cls: type):
    fn = getattr(cls, "forward", None)
    return fn if isinstance(fn, types.FunctionType) else None


@functools.cache
def _source(fn) -> str | None:
    """A function's source text, or None where there is none. Cached: each class is compared with every
    reference router, and inspect tokenizes the file from the function's first line on every call."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _same_code(fn, ref) -> bool:
    src = _source(fn)
    if src is None or src != _source(ref):
        return False
    missing = object()
    return all(fn.__globals__.get(n, missing) is ref.__globals__.get(n, missing) for n in _names(fn.__code__)
               if n in fn.__globals__ or n in ref.__globals__)


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _matched_family(cls: type) -> _Family | None:
    """The family a transformers router class routes as, by its code (above), or None. Cached per class."""
    if cls in _MATCHED:
        return _MATCHED[cls]
    found = None
    fn = _forward_of(cls)
    if fn is not None and cls.__module__.startswith(_TM):
        for ref in FAMILIES:
            if not ref.reference:
                continue
            try:
                ref_cls = getattr(importlib.import_module(ref.module), ref.gate)
            except (ImportError, AttributeError):
                continue
            ref_fn = _forward_of(ref_cls)
            if ref_fn is not None and _same_code(fn, ref_fn):
                short = cls.__module__[len(_TM):].split(".")[0]
                found = _Family(f"{short} ({ref.name} routing)", cls.__module__, None, cls.__name__, None,
                                ref.router_forward, ref.problem, reference=False, zero_experts=ref.zero_experts,
                                kn_experts=ref.kn_experts)
                break
    _MATCHED[cls] = found
    return found


def matched_routers(models: Iterable[str] | None = None) -> dict[str, str]:
    """{router class (module.Class): the family whose routing it runs} for every router class of the installed
    transformers that patch_hf runs: the named families' and those matched by their code. Imports every
    transformers model module whose source names a router or gate (seconds), or only those of `models`
    (transformers.models' package names, such as "glm4_moe"); for documentation and tests."""
    keep = None if models is None else {models} if isinstance(models, str) else set(models)
    out = {}
    for fam in FAMILIES:
        if keep is not None and fam.module.split(".")[2] not in keep:
            continue
        try:
            if isinstance(getattr(importlib.import_module(fam.module), fam.gate, None), type):
                out[f"{fam.module}.{fam.gate}"] = fam.name
        except ImportError:  # a transformers without that model
            continue
    for name, text in _modeling_files(keep):
        if "def forward" not in text or ("Router" not in text and "Gate" not in text):
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # a model whose optional dependencies are missing
            continue
        for attr, cls in vars(mod).items():
            if isinstance(cls, type) and cls.__module__ == name and issubclass(cls, nn.Module):
                key = f"{name}.{attr}"
                if key not in out and (fam := _matched_family(cls)) is not None:
                    out[key] = fam.name
    return out


def _transformers_class(name: str) -> type | None:
    """A class of transformers' model modules by name: loaded modules first, then the source files (one read
    each) to find the module to import. For unpickling in a fresh process."""
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith(_TM) and isinstance(cls := getattr(mod, name, None), type) and cls.__name__ == name:
            return cls
    for mod_name, text in _modeling_files():
        if f"class {name}(" in text:
            cls = getattr(importlib.import_module(mod_name), name, None)
            if isinstance(cls, type):
                return cls
    return None


def _modeling_files(models: set[str] | None = None) -> Iterator[tuple[str, str]]:
    """(module name, source text) of every transformers model module (of `models` only, where given), by its
    file (nothing imported but transformers.models itself); none without transformers."""
    try:
        import transformers.models
    except ImportError:
        return
    for path in sorted(Path(transformers.models.__file__).parent.glob("*/modeling_*.py")):
        if models is not None and path.parent.name not in models:
            continue
        yield f"{_TM}{path.parent.name}.{path.stem}", path.read_text(encoding="utf-8", errors="replace")

