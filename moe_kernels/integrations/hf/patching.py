"""patch_hf / unpatch_hf: finding the MoE blocks of a model, checking their structure, and installing our forwards."""

from __future__ import annotations

import importlib
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from moe_kernels.nn.lora import EXPERT_RANGE_ATTR, unwrapped

from .common import (
    _PATCH_ATTR,
    _RECIPE_ATTR,
    _SHARDED,
    _WEIGHT_DTYPES,
    DISPATCHER_ATTR,
    EXPERTS_IMPLEMENTATION,
    _base_class,
    _experts_of,
    _gate_top_k,
    _gate_weight,
    _is_dtensor,
    _router_of,
    _up_name,
)
from .experts import moe_kernels_experts_forward
from .families import (
    FAMILIES,
    SUPPORTED,
    _Family,
    _family_classes,
    _matched_family,
    _transformers_class,
)

_MOE_NAME = re.compile(r"(MoE|Moe|MoeBlock|MoEBlock|MoeLayer|MoELayer)$")


def _parallel_problem(block: nn.Module) -> str | None:
    """Why a block of a supported class was parallelised in a way patch_hf cannot run, or None."""
    gate, experts = _router_of(block), _experts_of(block)
    if any(_is_dtensor(p) for m in (gate, experts) if isinstance(m, nn.Module) for p in m.parameters()):
        return _SHARDED
    if getattr(experts, "_is_expert_parallel", False):
        return ("holds one rank's experts (transformers' expert parallelism was applied); patch_hf runs whole "
                "models: load the model without transformers' parallelism to patch it")
    return None



def _experts_only(fam: _Family, gate: nn.Module) -> bool:
    """The block's router is one the family leaves on transformers' code (its experts still run ours)."""
    cls = type(gate)
    return cls.__name__ in fam.experts_only_routers and cls.__module__ == fam.module


def _structure_problem(fam: _Family, block: nn.Module, gate_cls: type, experts_cls: type) -> str | None:
    """Why this block of a supported class cannot run on our ops, or None."""
    gate, experts = _router_of(block), _experts_of(block)
    if _base_class(gate) is not gate_cls and not _experts_only(fam, gate):
        return f"its router is a {type(gate).__name__}, not transformers' {gate_cls.__name__}"
    if fam.block_methods:  # the experts are the block's own projections (JetMoE's): the family checks it whole
        return fam.problem(gate, block, getattr(gate, "num_experts", 0))
    if not isinstance(experts, experts_cls):
        return f"its experts module is a {type(experts).__name__}, not transformers' {experts_cls.__name__}"
    if fam.experts_forward is not None:  # the family checks its block whole (Llama 4's, DBRX's)
        E = getattr(experts, "num_experts", None)
        if not isinstance(E, int) or E < 1 or getattr(block, "num_experts", E) != E:
            return "its experts module has no valid num_experts"
        k = _gate_top_k(gate) or getattr(block, "top_k", 0)  # (DBRX's block holds it)
        if not isinstance(k, int) or not 1 <= k <= E:
            return "its router has no valid top_k"
        return fam.problem(gate, block, E) if fam.problem is not None else None
    if not hasattr(type(experts).forward, "__wrapped__") or not hasattr(experts, "config"):
        return "its experts do not dispatch through transformers' experts interface"
    kn = fam.kn_experts  # stored [E, K, N]: GPT-OSS's (biases, [E, H, 2F] interleaved gate/up, [E, F, H]), Aria's
    gated = getattr(experts, "has_gate", True)  # without a gate (Nemotron-H's): up_proj [E, F, H], act_fn(up)
    flags = (("is_transposed", kn),)
    if not kn:
        flags += (("has_bias", False), ("is_concatenated", True))
    for flag, expected in flags:
        if getattr(experts, flag, expected) != expected:
            return f"its experts have {flag}={not expected}"
    if getattr(experts, "has_post_expert_norm", False) and (
            kn or not isinstance(getattr(experts, "post_expert_norm", None), nn.Module)):
        return ("its experts have has_post_expert_norm=True " + ("stored [E, K, N]" if kn else "and no "
                "post_expert_norm module") + "; a post-expert norm runs on experts stored [E, 2F, H] / [E, H, F]")
    if not gated and (kn or not callable(getattr(experts, "act_fn", None))):
        return ("its experts have has_gate=False " + ("stored [E, K, N]" if kn else "and no act_fn") +
                "; experts without a gate run stored [E, F, H] / [E, H, F] with an act_fn")
    up = _up_name(experts)
    w13, w2 = getattr(experts, up, None), getattr(experts, "down_proj", None)
    # transformers' router stays (PhiMoE's, Kolibri's, Zaya's, whose has no [E, H] weight): the experts alone checked
    wg = None if _experts_only(fam, gate) else _gate_weight(gate)
    if not all(isinstance(t, Tensor) for t in (w13, w2)) or not (wg is None or isinstance(wg, Tensor)):
        return f"it lacks {up}/down_proj/router weight tensors (transformers 4.x layout?)"
    if w13.dtype not in _WEIGHT_DTYPES or w2.dtype != w13.dtype:
        return f"its expert weights are {w13.dtype}/{w2.dtype} (quantised?); grouped_mm takes fp32/bf16/fp16"
    E = getattr(experts, "num_experts", None)
    if w13.dim() != 3 or w2.dim() != 3 or (wg is not None and wg.dim() != 2):
        return "its weights are not [E, 2F, H] / [E, H, F] / [E, H] (or transposed, with biases)"
    if kn:  # stored [E, K, N]
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        b13, b2 = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
        biases_fit = (isinstance(b13, Tensor) and isinstance(b2, Tensor) and tuple(b13.shape) == tuple(w13.shape[:2])
                      and tuple(b2.shape) == tuple(w2.shape[:2]) and b13.dtype == b2.dtype == w13.dtype)
        if getattr(experts, "has_bias", False) and not biases_fit:
            return "its expert biases are not [E, 2F] / [E, H] in the weights' dtype"
    H, F2 = w13.shape[2], w13.shape[1]
    F = F2 // 2 if gated else F2
    held = experts.__dict__.get(EXPERT_RANGE_ATTR)  # apply_expert_parallel's: this rank's experts (patched already)
    E_held = E if held is None else held[1]
    Z = getattr(block, fam.zero_experts, None) if fam.zero_experts else 0  # Longcat-Flash's zero-computation experts
    if not isinstance(Z, int) or Z < 0:
        return f"its {fam.zero_experts}={Z!r} is not a count of experts"
    router_fits = wg is None or tuple(wg.shape) == (E + Z, _router_width(block, H))
    experts_fit = (w13.shape[0], w2.shape[0]) == (E_held, E_held) and not (gated and F2 % 2) and tuple(
        w2.shape[1:]) == (H, F)
    if not experts_fit or not router_fits:
        router = "transformers'" if wg is None else tuple(wg.shape)
        return (f"unexpected weight shapes {up} {tuple(w13.shape)}, down_proj {tuple(w2.shape)}, "
                f"router {router} for {E} experts" + (f" and {Z} zero-computation experts" if Z else ""))
    if not 1 <= _gate_top_k(gate) <= E + Z:
        return "its router has no valid top_k"
    return fam.problem(gate, block, E) if fam.problem is not None else None


def _router_width(block: nn.Module, H: int) -> int:
    """The width of the router's input: the experts' H, or the model's hidden size where the block projects the
    tokens to a latent width for its experts (Nemotron-H's `fc1_latent_proj` [L, H] Linear: the router reads the
    hidden states, the experts the projected ones; inside any adapter wrapper, peft's LoRA on that Linear)."""
    latent = block._modules.get("fc1_latent_proj")
    latent = unwrapped(latent) if isinstance(latent, nn.Module) else None
    return latent.in_features if isinstance(latent, nn.Linear) and latent.out_features == H else H


def _looks_like_moe(module: nn.Module) -> bool:
    experts = getattr(module, "_modules", {}).get("experts")
    return experts is not None or bool(_MOE_NAME.search(type(module).__name__))


def _scan(model: nn.Module) -> Iterator[tuple[str, nn.Module, _Family | None, str | None]]:
    """(path, block, family or None, problem or None) for every MoE-like block, outermost first; a block's
    own submodules are not visited."""
    from moe_kernels.nn.moe import MoELayer  # already ours

    families = [(fam, classes) for fam in FAMILIES if (classes := _family_classes(fam)) is not None]
    generic = (f"not a supported family (supported with transformers 5.x: {', '.join(SUPPORTED)}, and the families "
               "whose router is the same code as one of theirs)")
    version = getattr(sys.modules.get("transformers"), "__version__", "5")
    if not version.split(".")[0].isdigit() or int(version.split(".")[0]) < 5:
        generic += f"; this is transformers {version}, whose MoE blocks have another layout"

    def visit(module: nn.Module, path: str):
        if isinstance(module, MoELayer):
            return
        for fam, (block_cls, gate_cls, experts_cls) in families:
            if isinstance(module, block_cls) and _router_of(module) is not None:
                yield path, module, fam, _structure_problem(fam, module, gate_cls, experts_cls)
                return
        gate, experts = _router_of(module), _experts_of(module)
        if isinstance(gate, nn.Module) and isinstance(experts, nn.Module):
            fam = _matched_family(_base_class(gate))  # a router with a named family's code
            if fam is not None:
                yield path, module, fam, _structure_problem(fam, module, _base_class(gate), type(experts))
                return
        if _looks_like_moe(module):
            # an MoE-like module that is no supported block may hold some: ERNIE-4.5-VL's Ernie4_5_VLMoeMoeBlock (a
            # text and a vision MoE block, no experts of its own), JetMoE's attention (its `experts` a supported
            # block, a JetMoeMoA with its own router); one whose experts are no supported block stays unsupported
            inner = [item for name, child in module.named_children()
                     for item in visit(child, f"{path}.{name}" if path else name)]
            experts = module._modules.get("experts")
            found = [block for _, block, fam, _ in inner if fam is not None]
            if found and (experts is None or any(block is experts for block in found)):
                yield from inner
                return
            yield path, module, None, generic
            return
        for name, child in module.named_children():
            yield from visit(child, f"{path}.{name}" if path else name)

    yield from visit(model, "")


# ---------------------------------------------------------------------------------------------------
# Installing and removing forwards


_PATCHED_CLASSES: dict[type, type] = {}  # transformers' router (or block) class -> our subclass


def _patched_class(cls: type, new_forward: Callable | None = None,
                   methods: tuple[tuple[str, Callable], ...] = ()) -> type:
    """`MoeKernels<cls>`: transformers' router (or, for Llama 4, block) class with `new_forward` as its forward (or
    with `methods`, (name, function) pairs: JetMoE's blocks), defined in moe_kernels.integrations.hf (pickle finds it
    there by name; in a fresh process the package's `__getattr__` defines it through `_unpickled_class`). An
    instance whose class was restored by `unpatch_hf` but that is called through a method captured while
    patched (a later wrapper) runs transformers' method."""
    sub = _PATCHED_CLASSES.get(cls)
    if sub is None:

        def guarded(method: str, fn: Callable) -> Callable:
            def patched(self, *args, **kwargs):
                if not isinstance(self, sub):  # restored by unpatch_hf (a subclass made later, FSDP's, stays ours)
                    return getattr(cls, method)(self, *args, **kwargs)
                return fn(self, *args, **kwargs)

            patched.__name__ = method
            return patched

        name = f"MoeKernels{cls.__name__}"
        package = sys.modules[__package__]  # moe_kernels.integrations.hf: where pickle looks the class up
        replaced = {m: guarded(m, fn) for m, fn in ((("forward", new_forward),) if new_forward else methods)}
        sub = type(name, (cls,), {**replaced, "__module__": package.__name__, "__qualname__": name,
                                  "_moe_kernels_base": cls})
        _PATCHED_CLASSES[cls] = sub
        setattr(package, name, sub)
    return sub



def _unpickled_class(name: str) -> type | None:
    """Unpickling a patched model in a fresh process: the router (or block) subclass `name` names, defined now, or
    None."""
    if name.startswith("MoeKernels"):
        base = name[len("MoeKernels"):]
        for fam in FAMILIES:
            if fam.block_forward is None and base == fam.gate:
                return _patched_class(getattr(importlib.import_module(fam.module), fam.gate), fam.router_forward)
            if fam.block_methods and base == fam.block:
                return _patched_class(getattr(importlib.import_module(fam.module), base), methods=fam.block_methods)
            if (fam.block_forward is not None and base == fam.block) or (
                    fam.experts_forward is not None and base == fam.experts):
                forward = fam.block_forward if base == fam.block else fam.experts_forward
                return _patched_class(getattr(importlib.import_module(fam.module), base), forward)
        cls = _transformers_class(base)
        if cls is not None and (fam := _matched_family(cls)) is not None:
            return _patched_class(cls, fam.router_forward)
    return None



def _swap_class(module: nn.Module, new_forward: Callable | None = None,
                methods: tuple[tuple[str, Callable], ...] = ()) -> None:
    """module's class becomes its patched subclass (once)."""
    if _PATCH_ATTR in module.__dict__:
        return
    sub = _patched_class(type(module), new_forward, methods)
    saved = None
    # accelerate (device_map / offloading) wraps `forward` in an instance attribute that calls
    # `_old_forward`, bound when the hook was added: point it at our forward, keep the hook.
    if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__:
        saved = module.__dict__["_old_forward"]
        module._old_forward = types.MethodType(sub.forward, module)
    module.__dict__[_PATCH_ATTR] = saved
    module.__class__ = sub


def _install(block: nn.Module, fam: _Family, recipe) -> None:
    if fam.block_methods:  # the block's methods, its router and its experts' projections (JetMoE's), each of these
        # inside any adapter wrappers; the recipe on the block and the projections
        _swap_class(block, methods=fam.block_methods)
        _swap_class(_router_of(block), fam.router_forward)
        block.__dict__[_RECIPE_ATTR] = recipe
        experts_cls = _family_classes(fam)[2]
        for child in block.children():
            if isinstance(projection := unwrapped(child), experts_cls):
                _swap_class(projection, fam.experts_forward)
                projection.__dict__[_RECIPE_ATTR] = recipe
        return
    if fam.experts_forward is not None:  # the experts' forward (and Llama 4's block's, or Ergo's router's)
        if fam.block_forward is not None:
            _swap_class(block, fam.block_forward)
        elif fam.router_forward is not None and not _experts_only(fam, _router_of(block)):
            _swap_class(_router_of(block), fam.router_forward)
        _swap_class(_experts_of(block), fam.experts_forward)
        _experts_of(block).__dict__[_RECIPE_ATTR] = recipe
        return
    gate, experts = _router_of(block), _experts_of(block)
    if not _experts_only(fam, gate):
        _swap_class(gate, fam.router_forward)
    if _PATCH_ATTR not in experts.__dict__:
        experts.__dict__[_PATCH_ATTR] = experts.config._experts_implementation
        experts.config._experts_implementation_internal = EXPERTS_IMPLEMENTATION  # this config only
    experts.__dict__[_RECIPE_ATTR] = recipe


def _uninstall(module: nn.Module) -> bool:
    if DISPATCHER_ATTR in module.__dict__:
        raise ValueError("unpatch_hf: the experts are expert-parallel (each rank holds E / P of them); only "
                         "moe_kernels' experts forward runs them")
    module.__dict__.pop(_RECIPE_ATTR, None)
    if _PATCH_ATTR not in module.__dict__:
        return False
    saved = module.__dict__.pop(_PATCH_ATTR)
    if type(module) in _PATCHED_CLASSES.values():  # a router (or a block)
        module.__class__ = _base_class(module)
        if saved is not None:
            module._old_forward = saved
    elif module.config._experts_implementation == EXPERTS_IMPLEMENTATION:  # experts: unless changed since
        module.config._experts_implementation_internal = saved
    return True


def register_experts_implementation() -> bool:
    """Register `moe_kernels_experts_forward` as "moe_kernels" in transformers' ExpertsInterface (the experts
    only; transformers' router stays). Returns False when this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moe_kernels_experts_forward)
    return True


def runs_our_experts(module: nn.Module) -> bool:
    """Whether a transformers experts module runs moe_kernels' experts forward: selected as the "moe_kernels"
    experts implementation, or experts whose forward patch_hf replaced (Llama 4's, DBRX's), or a block patch_hf
    runs whole with its experts' projections (JetMoE's)."""
    if getattr(getattr(module, "config", None), "_experts_implementation", None) == EXPERTS_IMPLEMENTATION:
        return True
    return type(module) in _PATCHED_CLASSES.values() and any(
        (f.experts_forward is not None and _base_class(module).__name__ == f.experts)
        or (f.block_methods and _base_class(module).__name__ == f.block) for f in FAMILIES)


def is_patched(module: nn.Module) -> bool:
    """Whether any submodule of `module` runs a moe_kernels forward installed by `patch_hf`."""
    return any(type(m) in _PATCHED_CLASSES.values() or (
        _PATCH_ATTR in m.__dict__ and m.config._experts_implementation == EXPERTS_IMPLEMENTATION)
        for m in module.modules())


def patch_hf(model: nn.Module, *, recipe=None) -> nn.Module:
    """Run every supported MoE block of a transformers model on moe_kernels' ops, in place; returns `model`.

    Supported (transformers 5.x): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, Qwen3-VL-MoE, MiniMax-M2,
    DeepSeek-V2, DeepSeek-V4, GPT-OSS, ERNIE-4.5, Mistral 4, Mistral Large 4, Gemma 4, Llama 4 (its block's
    forward: see the package docstring), Granite-MoE, Jamba, HunYuan-MoE-V1, LFM2-MoE, AFMoE, Cohere2-MoE, HY-V3,
    Laguna, MiniCPM5-MoE, AXK2, Beam, Lara-Mini, Flint, Inkling2, MiniMax-M3, Aria, Longcat-Flash, JetMoE (its MoE
    blocks and attention experts: moe_kernels.integrations.hf.jetmoe), Ergo (its
    experts' forward too: the norm per expert), and PhiMoE's, Kolibri's (1 and 1.1), Zaya's, Muse Spark's, Inkling's
    and DBRX's experts behind transformers' own routers (routings:
    `moe_kernels.integrations.hf.routings`), and
    every family whose router has one of their routers' code (`_matched_family`: GLM-4.5, Qwen3-Next,
    Qwen3.5-MoE, Kimi-Linear, Granite 4.0, Nemotron-H (experts without a gate), ...; `matched_routers()` lists
    them). Each block keeps its parameters and its router module; the router's and the experts' forwards change
    (see the module docstring), and only for Llama 4 and JetMoE the block's own forward (JetMoE's MoA: its map and
    reduce). Other MoE-like blocks are left alone and listed in one warning. Patching a patched model changes
    nothing but the recipe; `unpatch_hf` undoes it.

    recipe: a moe_kernels.quant recipe (Fp8BlockwiseRecipe(), Nvfp4Recipe()) for the routed experts' GEMMs
    (their weights stay as they are; quantization happens in each GEMM), or None for the model's precision.
    Only patch_hf applies a recipe: the experts implementation registered as "moe_kernels" (for
    `experts_implementation=`) runs at the model's precision.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_hf: expected a torch.nn.Module, got {type(model).__name__}")
    from moe_kernels.quant import Fp8BlockwiseRecipe, Nvfp4Recipe

    if recipe is not None and not isinstance(recipe, (Fp8BlockwiseRecipe, Nvfp4Recipe)):
        raise TypeError(f"patch_hf: `recipe` must be an Fp8BlockwiseRecipe() or Nvfp4Recipe() instance or None, got "
                        f"{recipe!r}")
    register_experts_implementation()
    found = list(_scan(model))
    for path, block, fam, _ in found:  # refused before anything is patched: such a model would fail later
        if fam is not None and (problem := _parallel_problem(block)) is not None:
            raise ValueError(f"patch_hf: the MoE block at {path or '<root>'} {problem}")
    if recipe is not None:  # every block must fit the recipe before any is patched
        for path, block, fam, problem in found:
            if fam is not None and problem is None:
                experts = _experts_of(block)
                where = f"patch_hf: the MoE block at {path or '<root>'} does not fit the recipe"
                kn = fam.kn_experts or fam.block_forward is not None  # stored [E, H, 2F] and [E, F, H]
                if fam.expert_dims is not None:  # (JetMoE's: the block's own projections)
                    H, F_, dtype = fam.expert_dims(block if fam.block_methods else experts)
                elif kn:
                    F_, H, dtype = experts.down_proj.shape[1], experts.gate_up_proj.shape[1], experts.down_proj.dtype
                else:
                    F_, H = experts.down_proj.shape[-1], getattr(experts, _up_name(experts)).shape[-1]
                    dtype = experts.down_proj.dtype
                try:
                    recipe.check_shapes(H, F_)
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
                if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"{where}: its expert weights are {dtype}; the recipes quantize fp32, bf16 or "
                                     "fp16")
    patched, skipped = 0, {}
    for path, block, fam, problem in found:
        if fam is not None and problem is None:
            _install(block, fam, recipe)
            patched += 1
        else:
            skipped.setdefault((type(block).__name__, problem), []).append(path or "<root>")
    if skipped:
        lines = []
        for (cls, problem), paths in skipped.items():
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")
            lines.append(f"  {cls} at {shown}: {problem}")
        warnings.warn(
            f"moe_kernels.patch_hf: left {sum(map(len, skipped.values()))} MoE block(s) on transformers' code "
            f"(unsupported):\n" + "\n".join(lines),
            UserWarning,
            stacklevel=2,
        )
    elif not patched:
        warnings.warn(f"moe_kernels.patch_hf: found no MoE blocks in {type(model).__name__}", UserWarning, stacklevel=2)
    from moe_kernels.integrations.peft import fuse_lora

    fuse_lora(model)  # peft LoRA on the patched experts: grouped low-rank GEMMs instead of W + BA
    return model


def unpatch_hf(model: nn.Module) -> nn.Module:
    """Undo `patch_hf`: every patched router and experts module runs transformers' forward again. Returns `model`."""
    for module in model.modules():
        _uninstall(module)
    return model


# "moe_kernels" is a valid experts implementation as soon as both moe_kernels and transformers' experts
# interface are imported, in either order (from_pretrained(..., experts_implementation="moe_kernels") and
# models unpickled in a fresh process name it). Importing transformers here would add seconds to every
