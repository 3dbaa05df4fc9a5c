"""Hugging Face transformers drop-in: run a loaded model's MoE blocks on moe_kernels' ops.

    model = AutoModelForCausalLM.from_pretrained(...)
    moe_kernels.patch_hf(model)      # in place; returns the model
    moe_kernels.unpatch_hf(model)    # back to transformers' own code

Written against the transformers 5.x layout, where every supported sparse MoE block holds

- a router module `gate` with `weight` [E, H] that returns `(router_logits, top_k_weights, top_k_index)`;
  transformers records `router_logits` from that module's output with a forward hook (`OutputRecorder`,
  installed by class) for `output_router_logits` and its load-balancing loss;
- an experts module (decorated with `use_experts_implementation`) with `gate_up_proj` [E, 2F, H] (gate rows
  [0, F), then up rows [F, 2F)), `down_proj` [E, H, F] and `act_fn`, called as
  `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`; experts without a gate
  (transformers' `has_gate=False`, Nemotron-H's squared ReLU) hold `up_proj` [E, F, H] instead and compute
  act_fn(up).

Both weights already have grouped_mm's [E, N, K] layout (out x in, like nn.Linear): they are passed to it as
they are, read from the module at every call, so nothing is copied and nothing but the model holds them.

Patching changes two forwards per block, chosen at call time (nothing is bound to an instance, so a
patched model survives deepcopy, pickling, `nn.DataParallel` replication and wrappers installed later, such
as accelerate's offloading hooks; transformers' classes themselves are never modified):

- the router's: the router instance's class becomes a subclass of transformers' router class, defined here
  (`MoeKernels<RouterClass>`, importable, so pickles load in a fresh process), whose forward computes the
  same logits from the router's own weight (F.linear, as transformers computes them), then `router_topk`
  with the family's routing, returning the same triple, so the recording hook, the router logits and the
  model's own aux loss are unchanged;
- the experts': the block's config selects the "moe_kernels" experts implementation in transformers' own
  experts interface (the previous choice is remembered for `unpatch_hf`), which runs `permute` ->
  `grouped_mm(gate_up_proj)` -> the gate activation (our fused `swiglu` where the experts compute
  transformers' default SiLU gate, else the module's own; act_fn(up) for experts without a gate) ->
  `grouped_mm(down_proj)` -> `unpermute` (routing
  weights applied there, the Hugging Face order). `model.set_experts_implementation("eager")` (or
  any other) after `patch_hf` therefore switches the experts away from our ops, as it would without it.

`unpatch_hf` restores the router classes and the experts implementation; a forward captured while patched
(a wrapper installed after `patch_hf`) still runs and falls back to transformers' code.

The block's own forward still runs: its return type, reshapes, Mixtral's jitter, Qwen2-MoE's gated shared
expert and DeepSeek-V3's shared experts are transformers' code. Gradients reach the original parameters
(router weight through router_topk's backward, expert weights through grouped_mm's).

Routing per family: `moe_kernels.integrations.hf.routings`; GPT-OSS's, Llama 4's and DBRX's experts:
`moe_kernels.integrations.hf.experts` (DBRX's experts, outside the experts interface, get an importable subclass
as the routers do; its router stays transformers'). JetMoE, whose blocks hold their experts' projections and whose
attention is a mixture of experts too: `moe_kernels.integrations.hf.jetmoe` (the block's forward, the MoA's map and
reduce, the router and the projections replaced).

Not supported (left alone, listed in one warning): any other block that looks like an MoE block (a child named
`experts`, or a class name ending in MoE/Moe/MoeBlock/MoeLayer), and supported classes whose structure differs
from the above (biases, transposed or quantised expert weights outside GPT-OSS's layout, a replaced router,
transformers 4.x per-expert ModuleLists).

The experts implementation alone (transformers' own router): `model.set_experts_implementation("moe_kernels")`,
or `from_pretrained(..., experts_implementation="moe_kernels")`: "moe_kernels" is registered in
transformers' experts interface as soon as both moe_kernels and transformers.integrations.moe are imported,
in either order (a post-import hook when moe_kernels comes first). It covers the experts' GEMMs only and
runs at the model's precision; `patch_hf` also replaces the routers (router_topk) and takes a recipe.

transformers is imported lazily: importing moe_kernels never imports it.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

from .common import DISPATCHER_ATTR, EXPERTS_IMPLEMENTATION
from .experts import moe_kernels_experts_forward
from .families import FAMILIES, SUPPORTED, matched_routers
from .patching import (
    _unpickled_class,
    is_patched,
    patch_hf,
    register_experts_implementation,
    unpatch_hf,
)

__all__ = ["DISPATCHER_ATTR", "EXPERTS_IMPLEMENTATION", "FAMILIES", "SUPPORTED", "is_patched", "matched_routers",
           "moe_kernels_experts_forward", "patch_hf", "register_experts_implementation", "unpatch_hf"]


def __getattr__(name: str):
    """Unpickling a patched model in a fresh process: define the router (or block) subclass it names."""
    cls = _unpickled_class(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls





# "moe_kernels" is a valid experts implementation as soon as both moe_kernels and transformers' experts
# interface are imported, in either order (from_pretrained(..., experts_implementation="moe_kernels") and
# models unpickled in a fresh process name it). Importing transformers here would add seconds to every
# `import moe_kernels`, so when it is not loaded yet a post-import hook registers it right after
# transformers.integrations.moe has executed.
_INTERFACE_MODULE = "transformers.integrations.moe"


def _register_after_import() -> None:
    try:
        register_experts_implementation()
    except Exception as exc:  # never break transformers' import
        warnings.warn(f"moe_kernels: could not register the 'moe_kernels' experts implementation: {exc!r}",
                      UserWarning, stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then registers our experts implementation. Everything else is the real loader's."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _remove_import_hook()
        _register_after_import()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds transformers.integrations.moe through the other finders and wraps its loader."""

    def find_spec(self, name, path, target=None):
        if name != _INTERFACE_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _remove_import_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ImportHook)]


def _install_import_hook() -> None:
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


if _INTERFACE_MODULE in sys.modules:
    register_experts_implementation()
else:
    _install_import_hook()
