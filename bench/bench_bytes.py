"""Bytes moved by the MoE layer and its expert GEMMs, BF16 against the FP8 blockwise recipe (bench/bytes.py's
byte model: every kernel's reads and writes counted on meta tensors; no device, no kernels run).

Cases (perf.md shapes; `--tokens` overrides the token count):
  deepseek-v3-ep8  DeepSeek-V3's layer with its EP-8 local expert count (32 experts, H 7168, F 2048, k 8,
                   the shared expert and the sigmoid router with groups), 8192 tokens
  qwen3-30b-a3b    E 128, H 2048, F 768, k 8, 8192 tokens
  nemotron-3-nano  E 128, H 2688, F 1856 (no multiple of 128: zero-padded along the FP8 contractions), k 6,
                   experts without a gate (squared ReLU), a shared expert of F 3712, sigmoid routing; 8192 tokens;
                   a measurement without a bar
  gpt-oss-120b     E 128, H = F = 2880 (no multiples of 128: zero-padded along the FP8 contractions), k 4,
                   softmax over the top-4 (the perf.md preset: SwiGLU, no expert biases); 8192 tokens; a
                   measurement without a bar
Per case and path (bf16, fp8):
  step x1     one micro-batch fwd+bwd and the optimizer step after it: the FP8 weights quantized once
  later mb    a later micro-batch of a step with gradient accumulation (the FP8 weight cache hits; the
              weight gradients accumulate into .grad)
  gemm        one expert GEMM (w13, then w2) fwd+bwd alone, x1
  ... (mw)    step x1 and later mb with master weights, as moe-train trains on CUDA without FSDP: fp32 masters,
              bf16 copies rewritten after the step, BF16's weight gradients folded into fp32 main gradients
              by a hook, the FP8 wgrad writing them from its epilogue
and per FP8 case: how many kernels read each bf16 expert weight in a step of 2 micro-batches, and every
kernel that only casts, copies, transposes, fills or masks (the table names them), split into those the
BF16 layer has too (the router's fp32 input cast and its gradient's cast back, autograd's zero gradients
for the router's and permute's integer outputs) and the FP8 path's own.
Each path runs once uncounted first: the counts are a training process's steady state, without what it makes
once (the FP8 gradient placeholders' 0-d zero scalar).
Bar (issue 27, bench.bars "fp8_layer_bytes"): the FP8 layer fwd+bwd moves at most 0.6x the BF16 layer's bytes
(judged at both "step x1" and "later mb"); each weight read at most once per optimizer step; no data-only
kernel of the FP8 path's own.
"""

from __future__ import annotations

import json

from moe_kernels.nn import PRESETS
from moe_kernels.quant.recipe import Fp8BlockwiseRecipe

from . import bars
from . import bytes as B
from . import harness as h

CASES = {"deepseek-v3-ep8": ("deepseek-v3", dict(num_experts=32)), "qwen3-30b-a3b": ("qwen3-30b-a3b", {}),
         "nemotron-3-nano": ("deepseek-v3", dict(hidden_size=2688, ffn_size=1856, shared_ffn_size=3712, num_experts=128,
                                                 k=6, num_groups=None, group_topk=None, activation="squared_relu")),
         "gpt-oss-120b": ("gpt-oss-120b", {})}
NO_BAR = {"nemotron-3-nano", "gpt-oss-120b"}
TOKENS = 8192
BAR = bars.bar("fp8_layer_bytes").threshold("bytes_fraction").value


def _later(count: B.Count) -> int:
    """Bytes of the last micro-batch of a count over several."""
    last = [k.phase for k in count.kernels if k.phase.startswith("mb")][-1].split()[0]  # (not the step's rows)
    return sum(k.bytes for k in count.kernels if k.phase.startswith(last + " "))


def case(name: str, tokens: int) -> dict:
    preset, kw = CASES[name]
    cfg = PRESETS[preset](**kw)
    row = {"case": name, "T": tokens, "E": cfg.num_experts, "H": cfg.hidden_size, "F": cfg.ffn_size,
           "k": cfg.router.k}
    for path, c in (("bf16", cfg), ("fp8", cfg.replace(recipe=Fp8BlockwiseRecipe()))):
        B.layer(c, tokens, micro_batches=1)  # warm-up, not counted: what a process makes once (a 0-d zero)
        one, two = B.layer(c, tokens, micro_batches=1), B.layer(c, tokens, micro_batches=2)
        rows = tokens * cfg.router.k
        up_rows = 2 * cfg.ffn_size if cfg.activation == "swiglu" else cfg.ffn_size
        gemms = [B.expert_gemm(cfg.num_experts, n, kk, rows, recipe=c.recipe)
                 for n, kk in ((up_rows, cfg.hidden_size), (cfg.hidden_size, cfg.ffn_size))]
        mw_one = B.layer(c, tokens, micro_batches=1, master_weights=True)
        mw_two = B.layer(c, tokens, micro_batches=2, master_weights=True)
        row[path] = {"step_x1": one.to_json(), "later_mb_bytes": _later(two), "weight_reads_x2": two.weight_reads,
                     "gemm_w13": gemms[0].to_json(), "gemm_w2": gemms[1].to_json(),
                     "mw_step_x1_bytes": mw_one.bytes, "mw_later_mb_bytes": _later(mw_two)}
    b, f = row["bf16"], row["fp8"]
    row["ratio_step_x1"] = f["step_x1"]["bytes"] / b["step_x1"]["bytes"]
    row["ratio_later_mb"] = f["later_mb_bytes"] / b["later_mb_bytes"]
    row["ratio_step_x1_mw"] = f["mw_step_x1_bytes"] / b["mw_step_x1_bytes"]
    row["ratio_later_mb_mw"] = f["mw_later_mb_bytes"] / b["mw_later_mb_bytes"]
    row["ratio_gemm_w13"] = f["gemm_w13"]["bytes"] / b["gemm_w13"]["bytes"]
    row["ratio_gemm_w2"] = f["gemm_w2"]["bytes"] / b["gemm_w2"]["bytes"]
    row["fp8_added_data_only"] = _added(f["step_x1"]["data_only"], b["step_x1"]["data_only"])
    row["bar_met"] = None if name in NO_BAR else (
        row["ratio_step_x1"] <= BAR and row["ratio_later_mb"] <= BAR
        and all(v <= 1 for v in f["weight_reads_x2"].values()) and not row["fp8_added_data_only"])
    return row


def _added(fp8: list[str], bf16: list[str]) -> list[str]:
    """The FP8 path's data-only kernels that the BF16 path does not have (as a multiset)."""
    left = list(bf16)
    out = []
    for k in fp8:
        if k in left:
            left.remove(k)
        else:
            out.append(k)
    return out


def run(ctx: h.Context) -> h.Report:
    tokens = ctx.tokens or (TOKENS,)
    rows, failures = [], []
    cases = [(n, T) for n in CASES for T in tokens]
    for i, (name, T) in enumerate(cases):
        try:
            rows.append(case(name, T))
        except (RuntimeError, ValueError) as e:
            failures.append(f"{name}/T{T}: {type(e).__name__}: {e}")
        ctx.case_done("bytes", i, len(cases))
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "bytes_table.json").write_text(json.dumps(
        {"meta": h.run_metadata(ctx), "rows": rows, "method": __doc__, "model": B.__doc__}, indent=1) + "\n")
    _print(rows)
    head = [f"{r['case']}/T{r['T']} bytes, FP8 / BF16 (byte model): layer step x1 {r['ratio_step_x1']:.2f}x, later "
            f"micro-batch {r['ratio_later_mb']:.2f}x (with master weights {r['ratio_step_x1_mw']:.2f}x and "
            f"{r['ratio_later_mb_mw']:.2f}x), w13 GEMM fwd+bwd {r['ratio_gemm_w13']:.2f}x, w2 "
            f"{r['ratio_gemm_w2']:.2f}x; FP8 weight reads a 2-micro-batch step {r['fp8']['weight_reads_x2']}; "
            f"data-only kernels on the FP8 path: {len(r['fp8_added_data_only'])} of its own, "
            f"{len(r['fp8']['step_x1']['data_only']) - len(r['fp8_added_data_only'])} shared with the BF16 layer"
            + ("; no bar" if r["bar_met"] is None else
               f" ({bars.quote('fp8_layer_bytes')}, each weight read once a step, no data-only kernel of its own: "
               f"{'met' if r['bar_met'] else 'missed'})") for r in rows]
    return h.Report([], head, failures)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def _print(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Bytes moved (GB), byte model on meta tensors: BF16 vs FP8 blockwise recipe")
    for c in ("case", "path", "layer step x1", "later micro-batch", "w13 GEMM", "w2 GEMM", "launches",
              "GB by kind (step x1)"):
        t.add_column(c, justify="left" if c in ("case", "path", "GB by kind (step x1)") else "right")
    for r in rows:
        for p in ("bf16", "fp8"):
            d = r[p]
            kinds = ", ".join(f"{k} {_gb(v)}" for k, v in sorted(d["step_x1"]["by_kind"].items(), key=lambda kv: -kv[1]))
            t.add_row(f"{r['case']}/T{r['T']}", p, _gb(d["step_x1"]["bytes"]), _gb(d["later_mb_bytes"]),
                      _gb(d["gemm_w13"]["bytes"]), _gb(d["gemm_w2"]["bytes"]), str(d["step_x1"]["launches"]), kinds)
    console = Console()
    (console if console.is_terminal else Console(width=220)).print(t)
    for r in rows:
        print(f"BYTES {r['case']}/T{r['T']} step_x1={r['ratio_step_x1']:.3f} later_mb={r['ratio_later_mb']:.3f} "
              f"gemm_w13={r['ratio_gemm_w13']:.3f} gemm_w2={r['ratio_gemm_w2']:.3f} "
              f"fp8_weight_reads_x2={r['fp8']['weight_reads_x2']}")
        for line in r["fp8"]["step_x1"]["data_only"]:
            own = "FP8's own" if line in r["fp8_added_data_only"] else "also on the BF16 path"
            print(f"  data-only on the FP8 path ({own}): {line}")
