"""Random bad and edge-case calls of the public ops, for tests/ops/test_bad_inputs.py and scripts/fuzz_ops.py.

A case (one seed) is a valid call of one op at small random sizes (0 tokens, one expert, odd widths among
them) with 0-3 random changes to its arguments: a tensor's dtype, rank, a size, its strides, a storage
offset, one value (NaN, inf, out-of-range indices), an empty tensor, None, requires_grad; an int, float,
string or dtype argument swapped for an edge value. What a call may do: return, or raise a TypeError or
ValueError that names the op and the argument (or torch's schema error, which names the argument). Never
crash, read out of bounds (the CPU-executed kernels run under ASan in CI), raise another exception type
from inside the op, or hang.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import moe_kernels as mk
from moe_kernels.ops import activation
from moe_kernels.ops.expert_mlp import expert_mlp
from moe_kernels.ops.grouped_mm_nvfp4 import grouped_mm_nvfp4, quantize_nvfp4_experts
from moe_kernels.ops.permute import permute_reference, permuted_rows

F32, BF16, F16, F64, I32, I64 = torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64
E4M3 = torch.float8_e4m3fn
DTYPES = (F32, BF16, F16, F64, I32, I64, torch.bool, E4M3, torch.uint8)
# Ops with a backward: a returned output that requires grad is differentiated too.
DIFFERENTIABLE = {"permute", "unpermute", "router_topk", "router_fused", "router_aux_scores", "aux_loss",
                  "seq_aux_loss", "z_loss", "grouped_mm", "swiglu", "expert_mlp", "apply_capacity"}


@dataclass
class Case:
    seed: int
    op: str
    fn: Callable
    args: list
    kwargs: dict
    changes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"seed {self.seed}: {self.op} with {self.changes or 'no change'}"


def _routing(g, T, E, k, device):
    if T == 0:
        return torch.empty(0, k, dtype=I32, device=device)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(I32).to(device)


def _build(op: str, g: torch.Generator, r: random.Random, dev) -> tuple[Callable, list, dict]:
    """A valid call of `op` on `dev`."""
    T, E = r.choice([0, 1, 5, 33, 64]), r.choice([1, 3, 8, 16, 32])
    k = r.randint(1, min(E, 4))
    H = r.choice([1, 7, 16, 128, 136])
    rn = lambda *shape, dtype=F32: torch.randn(*shape, generator=g).to(dtype).to(dev)  # noqa: E731
    fdt = r.choice([F32, BF16])
    idx = _routing(g, T, E, k, dev)
    if op in ("permute", "unpermute", "tokens_per_expert", "permute_quantize_fp8", "expert_mlp"):
        x = rn(T, H, dtype=fdt)
        if op == "permute":
            return mk.permute, [x, idx, E], dict(align=r.choice([1, 2, 16, 128]))
        if op == "tokens_per_expert":
            return mk.tokens_per_expert, [idx, E], {}
        if op == "permute_quantize_fp8":
            return (mk.permute_quantize_fp8, [rn(T, r.choice([128, 256]), dtype=BF16), idx, E],
                    dict(align=128, pow2_scale=r.random() < 0.5))
        y, row_map, _ = permute_reference(x.cpu(), idx.cpu(), E, 1)
        if op == "unpermute":
            return mk.unpermute, [y.to(dev), row_map.to(dev), torch.rand(T, k, generator=g).to(dev)], {}
        _, rmap, gs = permute_reference(x[:, :0].cpu(), idx.cpu(), E, 1)
        F = r.choice([4, 8])
        w13, w2 = rn(E, 2 * F, H, dtype=fdt) * 0.1, rn(E, H, F, dtype=fdt) * 0.1
        return expert_mlp, [x, rmap.to(dev), gs.to(dev), w13, w2, None], dict(num_rows=permuted_rows(T, k, E, 1))
    if op in ("router_topk", "router_fused", "router_aux_scores", "z_loss"):
        logits = rn(T, E, dtype=fdt)
        score = r.choice(["softmax", "sigmoid", "sqrtsoftplus"])
        kw: dict[str, Any] = dict(score=score)
        if op == "z_loss":
            return mk.z_loss, [logits, 1e-3], {}
        if op == "router_aux_scores":
            return mk.router_aux_scores, [logits, k], kw
        if E % 4 == 0 and E >= 8 and r.random() < 0.5:
            kw.update(num_groups=4, group_topk=2, group_score_topk=1)
        if score != "softmax" and r.random() < 0.5:
            kw["expert_bias"] = rn(E)
        if op == "router_topk":
            return mk.router_topk, [logits, k], kw
        kw.update(aux_coeff=r.choice([0.0, 0.01]), z_coeff=r.choice([0.0, 1e-3]))
        if T and r.random() < 0.5:
            kw.update(seq_coeff=0.01, seq_len=r.choice([1, T]))
        return mk.router_fused, [logits, k], kw
    if op in ("aux_loss", "seq_aux_loss", "apply_capacity", "update_expert_bias"):
        counts = (torch.bincount(idx.flatten().long().cpu(), minlength=E) if T else torch.zeros(E)).to(I32).to(dev)
        scores = torch.rand(T, E, generator=g).to(dev)
        if op == "aux_loss":
            return mk.aux_loss, [scores, counts, k, 0.01], {}
        if op == "seq_aux_loss":
            return mk.seq_aux_loss, [scores, idx, 0.01], dict(seq_len=max(T, 1))
        if op == "apply_capacity":
            return (mk.apply_capacity, [torch.rand(T, k, generator=g).to(dev), idx, E, r.choice([0.5, 1.0, 2.0])],
                    dict(policy=r.choice(["probs", "position"])))
        return mk.update_expert_bias, [torch.zeros(E, device=dev), counts, 1e-3], {}
    M = T * k // E * E + r.choice([0, 3])
    sizes = torch.full((E,), T * k // E, dtype=I32).to(dev)
    if op == "grouped_mm":
        K, N = r.choice([(16, 8), (64, 32), (128, 256)])
        return mk.grouped_mm, [rn(M, K, dtype=fdt), rn(E, N, K, dtype=fdt), sizes], {}
    Kq, Nq = r.choice([(128, 128), (256, 128), (128, 384)])
    if op == "grouped_mm_fp8":
        xq, xs = mk.quantize_fp8(rn(M, Kq), "block")
        wq, ws = mk.quantize_fp8_experts(rn(E, Nq, Kq))
        return mk.grouped_mm_fp8, [xq, xs, wq, ws, sizes], {}
    if op == "grouped_mm_fp8_wgrad":
        sizes = torch.full((E,), 128 * r.randint(0, 1), dtype=I32).to(dev)
        M = int(sizes.sum().item()) + r.choice([0, 128])
        return (mk.grouped_mm_fp8_wgrad, [*mk.quantize_fp8_tokens(rn(M, Nq)), *mk.quantize_fp8_tokens(rn(M, Kq)), sizes],
                dict(out_dtype=r.choice([F32, BF16])))
    if op == "quantize_fp8":
        x = rn(r.choice([0, 1, 129, 256]), r.choice([128, 136, 256]), dtype=fdt)
        return mk.quantize_fp8, [x], dict(granularity=r.choice(["block", "tile", "tensor", "row"]), pow2_scale=r.random() < 0.5)
    if op == "dequantize_fp8":
        return mk.dequantize_fp8, [*mk.quantize_fp8(rn(256, 256), "block"), "block"], {}
    if op == "quantize_fp8_experts":
        return mk.quantize_fp8_experts, [rn(E, r.choice([128, 200, 256]), r.choice([128, 256]), dtype=fdt)], {}
    if op == "quantize_fp8_experts_dual":
        return (mk.quantize_fp8_experts_dual, [rn(E, r.choice([128, 200]), r.choice([136, 256]), dtype=fdt)],
                dict(pad_to_block=r.random() < 0.5))
    if op == "quantize_fp8_tokens":
        return mk.quantize_fp8_tokens, [rn(r.choice([0, 1, 100, 300]), r.choice([64, 128, 256]), dtype=fdt)], {}
    if op == "quantize_nvfp4":
        x = rn(r.choice([0, 1, 16, 33]), r.choice([16, 48, 64]), dtype=fdt)
        return (mk.quantize_nvfp4, [x],
                dict(global_amax=r.choice([None, torch.tensor(4.0, device=dev)]), tile_2d=r.random() < 0.3))
    if op == "grouped_mm_nvfp4":
        Kn = r.choice([32, 64])
        return (grouped_mm_nvfp4, [*mk.quantize_nvfp4(rn(M, Kn)), *quantize_nvfp4_experts(rn(E, 32, Kn)), sizes],
                dict(out_dtype=r.choice([BF16, F32])))
    if op == "dequantize_nvfp4":
        return mk.dequantize_nvfp4, list(mk.quantize_nvfp4(rn(32, 64))), {}
    rw = torch.rand(M, generator=g).to(dev)
    if op == "swiglu":
        return activation.swiglu, [rn(M, 2 * r.choice([1, 8, 64, 128]), dtype=fdt), r.choice([None, rw])], {}
    h = rn(M, 256, dtype=BF16)
    if op == "swiglu_quantize_fp8":
        return activation.swiglu_quantize_fp8, [h, r.choice([None, rw])], {}
    hs = rn(M, r.choice([8, 200, 256]), dtype=r.choice([BF16, torch.float16]))
    if op == "squared_relu_quantize_fp8":
        return activation.squared_relu_quantize_fp8, [hs], dict(pow2_scale=r.random() < 0.5)
    if op == "squared_relu_bwd_quantize_fp8":
        return activation.squared_relu_bwd_quantize_fp8, [rn(*hs.shape, dtype=hs.dtype), hs], {}
    if op == "quantize_fp8_dual":
        return activation.quantize_fp8_dual, [hs], dict(pow2_scale=r.random() < 0.5)
    assert op == "swiglu_bwd_quantize_fp8", op
    return activation.swiglu_bwd_quantize_fp8, [rn(M, 128, dtype=BF16), h, rw], dict(need_dw=r.random() < 0.5)


OPS = ("permute", "unpermute", "tokens_per_expert", "permute_quantize_fp8", "expert_mlp", "router_topk",
       "router_fused", "router_aux_scores", "z_loss", "aux_loss", "seq_aux_loss", "apply_capacity",
       "update_expert_bias", "grouped_mm", "grouped_mm_fp8", "grouped_mm_fp8_wgrad", "quantize_fp8",
       "dequantize_fp8", "quantize_fp8_experts", "quantize_fp8_experts_dual", "quantize_fp8_tokens",
       "quantize_nvfp4", "dequantize_nvfp4", "grouped_mm_nvfp4", "swiglu", "swiglu_quantize_fp8", "swiglu_bwd_quantize_fp8",
       "squared_relu_quantize_fp8", "squared_relu_bwd_quantize_fp8", "quantize_fp8_dual")


def _like(t: torch.Tensor, shape, g) -> torch.Tensor:
    if t.dtype == E4M3 or t.is_floating_point():
        return torch.randn(shape, generator=g).to(t.dtype).to(t.device)
    if t.dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool, device=t.device)
    return torch.randint(0, 4, shape, generator=g).to(t.dtype).to(t.device)


def _change_tensor(t: torch.Tensor, r: random.Random, g) -> tuple[Any, str]:
    kind = r.choice(["dtype", "rank-", "rank+", "size", "strides", "offset", "value", "empty", "grad", "none"])
    if kind == "dtype":
        dt = r.choice(DTYPES)
        return (t.float().clamp(-448, 448).to(E4M3) if dt == E4M3 and t.dtype != E4M3 else t.to(dt)), f"dtype {dt}"
    if kind == "rank-" and t.dim() > 0:
        return (t.flatten()[: t.numel() // 2] if t.dim() == 1 or t.shape[0] == 0 else t[0]), kind
    if kind == "rank+":
        return t.unsqueeze(r.randint(0, t.dim())), kind
    if kind == "size" and t.dim() > 0:
        d = r.randrange(t.dim())
        shape = list(t.shape)
        shape[d] = r.choice([0, 1, shape[d] + 1, max(shape[d] - 1, 0), 2 * shape[d] + 3])
        return _like(t, shape, g), f"size {tuple(t.shape)} -> {tuple(shape)}"
    if kind == "strides" and t.dim() >= 1 and t.numel() > 1:
        if t.dim() >= 2 and r.random() < 0.5:
            return t.transpose(-1, -2).contiguous().transpose(-1, -2), "column-major"
        return torch.repeat_interleave(t, 2, dim=-1)[..., ::2], "stride 2"
    if kind == "offset" and t.dim() >= 1 and t.numel() > 0:
        flat = t.reshape(-1)
        return torch.cat([flat[:1], flat])[1:].view(t.shape), "storage offset"
    if kind == "value" and t.numel() > 0 and t.dtype != E4M3:
        t = t.detach().contiguous().clone()
        flat, i = t.view(-1), r.randrange(t.numel())
        if t.is_floating_point():
            v = r.choice([float("nan"), float("inf"), -float("inf"), 1e30, -0.0])
        elif t.dtype == torch.bool:
            v = not bool(flat[i])
        else:
            info = torch.iinfo(t.dtype)
            v = max(info.min, min(info.max, r.choice([-1, -2, info.min, info.max, 10**6, t.numel() + 1])))
        flat[i] = v
        return t, f"value {v}"
    if kind == "empty" and t.dim() > 0:
        return t[:0], kind
    if kind == "grad" and t.is_floating_point() and t.dtype != E4M3:
        return t.detach().clone().requires_grad_(), "requires_grad"
    if kind == "none":
        return None, "None"
    return t, "unchanged"


def _change_scalar(v, r: random.Random) -> tuple[Any, str]:
    if isinstance(v, bool):
        new = not v
    elif isinstance(v, int):
        new = r.choice([0, -1, v + 1, 1000 * v + 7, 2**31, -(2**63)])
    elif isinstance(v, float):
        new = r.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30])
    elif isinstance(v, str):
        new = r.choice(["", "bogus", v.upper(), v + " "])
    elif isinstance(v, torch.dtype):
        new = r.choice(DTYPES)
    elif v is None:
        new = r.choice([0, "x"])
    else:
        return v, "unchanged"
    return new, f"{v!r} -> {new!r}"


def make_case(seed: int, device="cpu") -> Case:
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    op = r.choice(OPS)
    fn, args, kwargs = _build(op, g, r, torch.device(device))
    case = Case(seed, op, fn, list(args), dict(kwargs))
    for _ in range(r.choice([0, 1, 1, 1, 2, 2, 3])):
        keys = [("arg", i) for i in range(len(case.args))] + [("kw", k) for k in case.kwargs]
        where, key = r.choice(keys)
        holder = case.args if where == "arg" else case.kwargs
        v = holder[key]
        holder[key], what = _change_tensor(v, r, g) if isinstance(v, torch.Tensor) else _change_scalar(v, r)
        case.changes.append(f"{where} {key}: {what}")
    return case


@dataclass
class Outcome:
    ok: bool
    error: BaseException | None = None
    outputs: Any = None

    def acceptable(self) -> bool:
        """Returned, or raised an error that names what was wrong: a TypeError or ValueError from our checks,
        or torch's schema error for a wrong argument type (it names the argument)."""
        e = self.error
        if e is None:
            return True
        msg = str(e)
        if type(e) in (TypeError, ValueError):
            return "`" in msg or "argument" in msg
        return type(e) is RuntimeError and "for argument '" in msg


def run_case(case: Case) -> Outcome:
    try:
        out = case.fn(*case.args, **case.kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        inputs = [a for a in [*case.args, *case.kwargs.values()] if isinstance(a, torch.Tensor) and a.requires_grad]
        diff = [o for o in outs if o.requires_grad]
        if case.op in DIFFERENTIABLE and inputs and diff:
            torch.autograd.grad(sum(o.float().sum() for o in diff), inputs, allow_unused=True)
        return Outcome(True, outputs=outs)
    except Exception as e:  # noqa: BLE001 - the outcome is what is judged
        return Outcome(False, error=e)


def explain(case: Case, outcome: Outcome) -> str:
    e = outcome.error
    where = traceback.extract_tb(e.__traceback__)[-1] if e is not None and e.__traceback__ else None
    at = f" at {where.filename.split('/')[-1]}:{where.lineno}" if where else ""
    return f"{case.describe()}: {type(e).__name__}{at}: {str(e).splitlines()[0] if str(e) else ''}"
