"""peft LoRA on fused expert weights through grouped GEMMs (moe_kernels.nn.lora), in peft's own format.

    model = get_peft_model(model, LoraConfig(r=8, target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"]))
    moe_kernels.patch_hf(model)          # or moe_kernels.integrations.peft.fuse_lora(model)

peft wraps each targeted 3D parameter in a `ParamWrapper` that, on every forward, parametrizes the weight
as W + s B A: a full copy of the expert weights. `fuse_lora` changes the class of every such wrapper whose
innermost module runs moe_kernels' grouped experts (our `GroupedExperts`, or a transformers experts module
on the "moe_kernels" experts implementation) to `MoeKernelsParamWrapper`, a subclass that keeps peft's
parameters, state dict keys, merging and saving, and only replaces how the adapter is applied: its factors
are handed to the experts' forward (moe_kernels.nn.lora.lora_terms), which adds two rank-r grouped GEMMs.
Experts stored [E, K, N] (GPT-OSS's, Aria's, Llama 4's patched block) take it too, in their layout. Cases the
fused path does not cover run peft's own code: several active adapters at once, non-float weights, an ONNX
export. Adapters saved from a fused model load with `PeftModel.from_pretrained`; call `fuse_lora` (or `patch_hf`)
again after loading.

Expert parallelism (`moe_kernels.parallel.apply_expert_parallel`, after `get_peft_model`): the adapters stay
whole on every rank, every expert's factors, as peft creates, saves and loads them, while the rank's weights are
its E / P experts. The wrapper hands the experts (and peft's own paths: merging, several adapters) the slices of
this rank's experts. A backward fills those slices with the gradients of every rank's tokens routed to them and
leaves the other experts' zero, so the data-parallel mean over the group that every replicated parameter takes
(DDP, FSDP2, `moe_kernels.parallel.GradientReducer`) is each factor's gradient, and the ranks' adapters stay
equal. Adapters created after `apply_expert_parallel` would hold only the rank's experts under names every rank
shares; they are refused.

peft is imported only when a model holds its wrappers.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from moe_kernels import onnx as _onnx
from moe_kernels.nn.lora import EXPERT_RANGE_ATTR, FFN_SLICE_ATTR, LORA_ATTR, SLICED_DELTA_ATTR, ffn_slice, unwrapped

_WRAPPER = "MoeKernelsParamWrapper"
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _param_wrapper_class():
    mod = sys.modules.get("peft.tuners.lora.layer")
    return getattr(mod, "ParamWrapper", None) if mod is not None else None


def _runs_grouped_experts(module: nn.Module) -> bool:
    """Our GroupedExperts, or transformers experts that run moe_kernels' experts forward."""
    from moe_kernels.integrations.hf.patching import runs_our_experts
    from moe_kernels.nn.experts import GroupedExperts

    return isinstance(module, GroupedExperts) or runs_our_experts(module)


def _make_wrapper_class():
    ParamWrapper = _param_wrapper_class()

    class MoeKernelsParamWrapper(ParamWrapper):
        """peft's ParamWrapper whose adapter reaches the grouped experts as low-rank terms (module docstring)."""

        def _local_experts(self) -> slice | None:
            """The experts this rank holds, where the wrapped experts are expert-parallel (None: all of them)."""
            held = self.get_base_layer().__dict__.get(EXPERT_RANGE_ATTR)
            if held is None:
                return None
            first, count, total = held
            if self.num_experts != total:
                raise ValueError(
                    f"moe_kernels: the LoRA adapter on {self.parameter_name} holds {self.num_experts} experts and the "
                    f"expert-parallel layer {total}: it was created after apply_expert_parallel, from this rank's "
                    "experts alone, under names every rank shares. Create the adapters (get_peft_model, "
                    "PeftModel.from_pretrained) before apply_expert_parallel")
            return slice(first, first + count)

        def _ffn_slice(self):
            """(lo, width, ffn, gated) where the wrapped experts are expert-tensor-parallel (each expert's ffn width
            split: moe_kernels.parallel.expert_parallel), else None."""
            base = self.get_base_layer()
            held = base.__dict__.get(FFN_SLICE_ATTR)
            return None if held is None else (held, base.gated)

        def get_delta_factors(self, adapter_name):
            lhs, rhs, scaling = super().get_delta_factors(adapter_name)
            local = self._local_experts()
            if local is not None:
                lhs, rhs = lhs[local], rhs[local]
            ffn = self._ffn_slice()
            if ffn is not None:  # [E, N, K] experts: lhs [E, N, r] (w13's ffn rows), rhs [E, r, K] (w2's ffn columns)
                (held, gated), name = ffn, self.parameter_name
                lhs, rhs = (ffn_slice(lhs, name, held, gated, 1), rhs) if name == "w13" else \
                    (lhs, ffn_slice(rhs, name, held, gated, 2))
            return lhs, rhs, scaling

        def get_delta_weight(self, adapter_name, *args, **kwargs):
            delta = super().get_delta_weight(adapter_name, *args, **kwargs)
            local = self._local_experts()
            if local is not None:
                delta = delta[local]
            ffn = self._ffn_slice()
            if ffn is not None:  # [E, N, K]: w13's ffn rows, w2's ffn columns
                (held, gated), name = ffn, self.parameter_name
                delta = ffn_slice(delta, name, held, gated, 1 if name == "w13" else 2)
            return delta

        @contextlib.contextmanager
        def _activate_lora(self, active_adapters):
            adapters = [a for a in active_adapters if a in self.lora_A]
            base = self.get_base_layer()
            param = self.get_param()
            # The delta in the stored layout is s lhs rhs: for [E, N, K] weights (peft swapped in and out)
            # lhs = B [E, N, r], rhs = A [E, r, K]; for [E, K, N] ones lhs [E, K, r], rhs [E, r, N]. The experts
            # apply it in their own layout (moe_kernels.nn.lora, moe_kernels.integrations.hf.experts._kn_mm).
            # While torch.onnx exports, experts may take transformers' forward (experts stored [E, K, N]), which reads
            # the weight, not our terms: peft's own path then, W + s B A in the weight.
            if (len(adapters) != 1 or self.num_experts == 1 or param.dtype not in _FLOAT
                    or not _runs_grouped_experts(base) or not hasattr(self, "get_delta_factors")
                    or _onnx.exporting()):  # peft without factor access: its own path
                # (on expert-parallel experts, with this rank's slice of the delta: get_delta_weight/_factors below)
                sliced = EXPERT_RANGE_ATTR in base.__dict__
                if sliced:
                    base.__dict__[SLICED_DELTA_ATTR] = base.__dict__.get(SLICED_DELTA_ATTR, 0) + 1
                try:
                    with super()._activate_lora(active_adapters):
                        yield
                finally:
                    if sliced:
                        base.__dict__[SLICED_DELTA_ATTR] -= 1
                return
            entry = self.get_delta_factors(adapters[0])  # (lhs, rhs, scaling)
            terms = base.__dict__.setdefault(LORA_ATTR, {}).setdefault(self.parameter_name, [])
            terms.append(entry)
            try:
                yield
            finally:
                terms[:] = [t for t in terms if t is not entry]
                if not terms:
                    base.__dict__[LORA_ATTR].pop(self.parameter_name, None)

    MoeKernelsParamWrapper.__module__ = __name__
    MoeKernelsParamWrapper.__qualname__ = _WRAPPER  # what pickles name (moe_kernels.integrations.peft.<qualname>)
    # peft recognises its wrappers by class name ("ParamWrapper"): adding or loading a further adapter finds the
    # wrapper by that name to add the adapter to it, and refuses any other tuner layer in its place.
    MoeKernelsParamWrapper.__name__ = ParamWrapper.__name__
    return MoeKernelsParamWrapper


def _wrapper_class():
    """The one MoeKernelsParamWrapper class of this process, created on first use (peft loaded)."""
    cls = globals().get(_WRAPPER)
    if cls is None:
        cls = globals()[_WRAPPER] = _make_wrapper_class()
    return cls


def __getattr__(name: str):
    # Importable by name (pickles of fused models load in a fresh process), created on first use.
    if name == _WRAPPER and _param_wrapper_class() is None:
        import peft.tuners.lora.layer  # noqa: F401
    if name == _WRAPPER:
        return _wrapper_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fuse_lora(model: nn.Module) -> int:
    """Make every peft `ParamWrapper` around moe_kernels' grouped experts apply its adapter as grouped
    low-rank GEMMs (module docstring); returns how many wrappers changed. Without peft loaded: 0."""
    ParamWrapper = _param_wrapper_class()
    if ParamWrapper is None:
        return 0
    cls = _wrapper_class()
    changed = 0
    for module in model.modules():
        if type(module) is ParamWrapper and _runs_grouped_experts(unwrapped(module)):
            module.__class__ = cls
            changed += 1
    return changed


def unfuse_lora(model: nn.Module) -> int:
    """Back to peft's own wrappers (W + BA formed on each forward); returns how many changed. ValueError on an
    expert-parallel model: peft's own wrapper would add every expert's delta to this rank's experts."""
    ParamWrapper = _param_wrapper_class()
    if ParamWrapper is None or _WRAPPER not in globals():
        return 0
    wrappers = [m for m in model.modules() if type(m) is globals()[_WRAPPER]]
    if any(EXPERT_RANGE_ATTR in m.get_base_layer().__dict__ for m in wrappers):
        raise ValueError("unfuse_lora: the experts are expert-parallel (apply_expert_parallel); peft's own wrappers "
                         "would add every expert's delta to this rank's experts")
    for module in wrappers:
        module.__class__ = ParamWrapper
    return len(wrappers)
