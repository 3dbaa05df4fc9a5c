"""Expert-parallel dispatch and combine: the NVLink backend's kernels on virtual ranks on one GPU.

P = 8 virtual ranks (EP 8), each with T tokens, routed top-k over E experts (E / P per rank), hidden H:
the deepseek-v3 shape (H 7168, E 256, k 8, 4096 tokens per rank) in bf16 and with an FP8 payload (E4M3
codes and 1x128 block scales). All ranks' buffers live on the one GPU and the ranks run one after another
in stream order, so a call moves every rank's traffic through this GPU's memory.

Ops: dispatch (notify, send, layout: rows grouped by local expert with align 128) and combine (push, then
each source's fp32 sum over its slots), each timed twice, as two results per case:
  <case>/sms_all  our copy kernels on every SM of the GPU (num_sms = its multiprocessor count): like for
                  like with the peer, whose torch copies and permutes take the whole GPU and cannot be
                  capped. perf.md's bar (every implementation given the same SMs) is judged on these.
  <case>/sms20    our default, num_sms = 20 (moe_kernels.dispatch.nvlink.DEFAULT_NUM_SMS), which leaves
                  the other SMs to overlapping compute: what a training step gets.
The SM count caps the copy kernels' grid (notify, send, push and pull; the layout kernels size their own
grids). The result's shape records it as `sms`. On the CPU-executed build there are no SMs: sms_all is
CPU_ALL_SMS (an H100's 132), so both grids still differ; its times mean nothing there.
GB/s = bytes received by all ranks / time, judged against the received-bytes ceiling (harness ceiling
"copy_received"):
  dispatch  each (token, destination rank) copy: its row (H * b) + scale row + slot table (8k + 8 B)
  combine   each (token, slot) row back at its source: H * b
Ceilings and peers, in the same run on the same inputs:
  copy_received      the device copy bandwidth (harness) counted by bytes received: a copy of N bytes
                     reads N and writes N, the copy ceiling counts both, so a transfer that receives N
                     bytes is bounded by copy bandwidth / 2. On one GPU every byte received is a byte
                     read from and written to this GPU's memory: this is the bound here.
  all_to_all_virtual the all-to-all backend's computation (permute by expert, a host sync for the split
                     sizes, the exchange, the regrouping permute; combine in reverse), its NCCL exchange
                     replaced by device copies between the virtual ranks' tensors; timed once per case
                     (it takes no SM count) and compared with both of ours.
On a real node each rank's traffic crosses NVLink in parallel instead: the reference points there are
DeepEP's 153 / 158 GB/s (dispatch / combine) per H800 and about 320 GB/s reported on 8xH200.

Memory: capacity 2*T*k expert rows per rank (twice the balanced load; the check asserts nothing was
dropped), so each dispatch allocates about 2*T*k rows per rank instead of the worst case P*T*min(k, E/P).

Checked first, on the first input set and at each SM count: each virtual rank's grouped rows, group
sizes and combined output against the one-rank dispatcher (LocalDispatcher) on the same routing,
bit-exact (the combine sums the same products in the same order).

On a CPU the quick case (tiny shapes) runs the CPU-executed kernels when MOE_KERNELS_EMULATE=1 is set
and checks the plumbing; its times mean nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels import _ext
from moe_kernels.dispatch import LocalDispatcher, VirtualNvlinkWorld
from moe_kernels.dispatch.nvlink import DEFAULT_NUM_SMS
from moe_kernels.ops.permute import permute, permuted_row_values, unpermute
from moe_kernels.ops.quant import quantize_fp8

from . import bars
from . import harness as h

P = 8
MODELS = {"deepseek-v3": (7168, 256, 8), "qwen3-235b": (4096, 128, 8)}
CPU_MODELS = {"tiny": (64, 16, 4)}
ALIGN = 128
CPU_ALL_SMS = 132  # the CPU-executed build has no SMs; an H100's count keeps the two grids apart
BAR = bars.quote("dispatch")


def sm_counts(ctx: h.Context) -> dict[str, int]:
    """Case suffix -> num_sms: every SM (like for like with the peer), and our default."""
    all_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.is_cuda else CPU_ALL_SMS
    return {"sms_all": all_sms, f"sms{DEFAULT_NUM_SMS}": DEFAULT_NUM_SMS}


@dataclass(frozen=True)
class Case:
    model: str
    T: int
    H: int
    E: int
    k: int
    payload: str  # "bf16" or "fp8"

    @property
    def name(self) -> str:
        return f"{self.model}/EP{P}/T{self.T}/{self.payload}"

    @property
    def shape(self) -> dict[str, int]:
        return dict(P=P, T=self.T, H=self.H, E=self.E, k=self.k)


def cases(ctx: h.Context) -> list[Case]:
    if not ctx.is_cuda:
        return [Case("tiny", 16, *CPU_MODELS["tiny"], p) for p in ("bf16", "fp8")]
    models, tokens = ctx.pick({"deepseek-v3": MODELS["deepseek-v3"]} if ctx.quick and ctx.models is None
                              else MODELS, (4096,))
    return [Case(m, T, *models[m], p) for m in models for T in tokens for p in ("bf16", "fp8")]


def make_inputs(ctx: h.Context, c: Case, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    dev = ctx.device
    xs, ss, ws, idx = [], [], [], []
    for _ in range(P):
        x = torch.randn(c.T, c.H, generator=gen).to(dev, torch.bfloat16)
        if c.payload == "fp8":
            q, s = quantize_fp8(x.float(), "block")
            xs.append(q)
            ss.append(s)
        else:
            xs.append(x)
            ss.append(None)
        ws.append(torch.rand(c.T, c.k, generator=gen).to(dev))
        idx.append(torch.rand(c.T, c.E, generator=gen).argsort(1)[:, : c.k].int().to(dev))
    return {"x": xs, "scales": ss, "weights": ws, "indices": idx}


def _ys(ds):
    """Expert outputs: the received rows in bf16 (the experts' output dtype)."""
    return [d.x.to(torch.bfloat16) if d.x.dtype != torch.bfloat16 else d.x for d in ds]


class _AllToAllVirtual:
    """The all-to-all backend's steps on P virtual ranks; all_to_all_single becomes slicing + cat."""

    def __init__(self, E: int):
        self.E, self.El = E, E // P

    def dispatch(self, xs, ws, idxs, scales):
        E, El = self.E, self.El
        perms = [permute(x, i, E) for x, i in zip(xs, idxs)]
        counts = torch.stack([p[2] for p in perms]).view(P, P, El)  # [src, dst, local expert]
        sizes = counts.sum(2).tolist()  # the host sync of the all-to-all backend
        starts = [[sum(sizes[s][:d]) for d in range(P)] for s in range(P)]
        w_rows = [permuted_row_values(w, p[1], p[0].shape[0]) for w, p in zip(ws, perms)]
        s_perm = [None if s is None else permute(s, i, E)[0] for s, i in zip(scales, idxs)]
        out = []
        for d in range(P):
            take = lambda rows, s: rows[s][starts[s][d] : starts[s][d] + sizes[s][d]]  # noqa: E731
            x_recv = torch.cat([take([p[0] for p in perms], s) for s in range(P)])
            # The weights and scale rows travel too (their own exchanges in the backend); only moved here.
            torch.cat([take(w_rows, s) for s in range(P)])
            if s_perm[0] is not None:
                torch.cat([take(s_perm, s) for s in range(P)])
            block = torch.arange(El, dtype=torch.int32, device=x_recv.device).repeat(P)
            local = torch.repeat_interleave(block, counts[:, d].reshape(-1).long(), output_size=x_recv.shape[0])
            xg, rmap, gs = permute(x_recv, local[:, None], El, align=ALIGN)
            out.append((xg, rmap, gs))
        return out, perms, sizes, starts

    def combine(self, ys, state, ws):
        out_d, perms, sizes, starts = state
        back = [unpermute(y, rmap) for y, (_, rmap, _) in zip(ys, out_d)]  # [N_d, H] per destination
        recv_starts = [[sum(sizes[s2][d] for s2 in range(s)) for d in range(P)] for s in range(P)]
        outs = []
        for s in range(P):
            rows = torch.cat([back[d][recv_starts[s][d] : recv_starts[s][d] + sizes[s][d]] for d in range(P)])
            pad = perms[s][0].shape[0] - rows.shape[0]
            rows = torch.cat([rows, rows.new_zeros((pad, rows.shape[1]))]) if pad else rows
            outs.append(unpermute(rows, perms[s][1], ws[s]))
        return outs


def received_bytes(c: Case, ds, op: str) -> int:
    b = 1 if c.payload == "fp8" else 2
    scale = 4 * -(-c.H // 128) if c.payload == "fp8" else 0
    total = 0
    for d in ds:
        n_tokens = int(d.handle.num_received)
        n_slots = int((d.local_indices >= 0).sum())
        total += n_tokens * (c.H * b + scale + 8 * c.k + 8) if op == "dispatch" else n_slots * c.H * 2
    return total


def check(c: Case, world: VirtualNvlinkWorld, s: dict) -> list:
    ds = world.dispatch(s["x"], s["weights"], s["indices"], align=ALIGN, scales=s["scales"])
    outs = world.combine(_ys(ds), [d.handle for d in ds])
    x_all, w_all, i_all = (torch.cat(s[k]) for k in ("x", "weights", "indices"))
    El = c.E // P
    for r, d in enumerate(ds):
        local = torch.where((i_all >= r * El) & (i_all < (r + 1) * El), i_all - r * El, -1).int()
        want = LocalDispatcher(El).dispatch(x_all, w_all, local, align=ALIGN)
        rows = int(want.group_sizes.sum())
        h.check_exact(f"{c.name} rank {r} group sizes", d.group_sizes, want.group_sizes)
        h.check_exact(f"{c.name} rank {r} rows", d.x[:rows].view(torch.uint8), want.x[:rows].view(torch.uint8))
        disp = LocalDispatcher(c.E)
        one = disp.dispatch(s["x"][r], s["weights"][r], s["indices"][r], align=ALIGN)
        h.check_exact(f"{c.name} rank {r} combine", outs[r], disp.combine(_ys([one])[0], one.handle))
    return ds


def run_case(ctx: h.Context, c: Case) -> list[h.Result]:
    sets = [make_inputs(ctx, c, ctx.seed + i) for i in range(ctx.n_input_sets)]
    # One world at a time (each holds its own EP 8 buffers): time_ours' locals are gone when it returns.
    ours = {suffix: (num_sms, time_ours(ctx, c, sets, num_sms)) for suffix, num_sms in sm_counts(ctx).items()}
    a2a = _AllToAllVirtual(c.E)

    def a2a_dispatch(s):
        return a2a.dispatch(s["x"], s["weights"], s["indices"], s["scales"])

    def a2a_combine(ys, state, ws):
        return a2a.combine(ys, state, ws)

    # The peer takes no SM count: timed once, compared with each of ours.
    state = a2a_dispatch(sets[0])
    a2a_comb_inputs = [([o[0].to(torch.bfloat16) for o in state[0]], state, sets[0]["weights"])]
    peer = {"dispatch": ctx.time(a2a_dispatch, [(s,) for s in sets]), "combine": ctx.time(a2a_combine, a2a_comb_inputs)}
    results = []
    for suffix, (num_sms, timings) in ours.items():
        for op, (t, received) in timings.items():
            r = h.make_result(ctx, op=op, case=f"{c.name}/{suffix}", shape={**c.shape, "sms": num_sms},
                              dtype=torch.bfloat16, timing=t, nbytes=received, flops=0,
                              peers={"all_to_all_virtual": peer[op]}, ceiling="copy_received")
            r.extra["received_mib"] = received / 2**20
            results.append(r)
    return results


def time_ours(ctx: h.Context, c: Case, sets: list[dict], num_sms: int) -> dict[str, tuple[h.Timing, int]]:
    """Checks, then times our dispatch and combine on `num_sms` SMs: op -> (timing, bytes received)."""
    # capacity 2*T*k expert rows per rank, twice the balanced load: uniform routing drops nothing (checked),
    # and the grouped rows stay near what a real run allocates (the worst case is P*T*min(k, E/P) rows).
    world = VirtualNvlinkWorld(c.E, P, max_tokens_per_rank=c.T, capacity=2 * c.T * c.k, num_sms=num_sms,
                               device=ctx.device)
    ds = check(c, world, sets[0])
    assert world.dropped_tokens() == 0, f"{c.name}: tokens dropped at capacity {2 * c.T * c.k}"

    def dispatch(s):
        return world.dispatch(s["x"], s["weights"], s["indices"], align=ALIGN, scales=s["scales"])

    def combine(ys, handles):
        return world.combine(ys, handles)

    # combine is timed on the first set's dispatch (several sets of EP 8 grouped rows would not fit at once)
    return {"dispatch": (ctx.time(dispatch, [(s,) for s in sets]), received_bytes(c, ds, "dispatch")),
            "combine": (ctx.time(combine, [(_ys(ds), [x.handle for x in ds])]), received_bytes(c, ds, "combine"))}


def headline(ctx: h.Context, results: list[h.Result]) -> list[str]:
    """One line per deepseek-v3 result (every result on the CPU); perf.md's bar judged on the sms_all ones."""
    bar = bars.bar("dispatch").threshold("pct_of_copy_received").value
    lines = []
    for r in results:
        if not (r.case.startswith("deepseek-v3") or not ctx.is_cuda):
            continue
        received = ctx.ceiling_of(r).copy_received_gbps  # the one r is judged against
        line = (f"{r.op} {r.case}: {r.gbps:.0f} GB/s received on {r.shape['sms']} SMs, {r.pct_of_ceiling:.1f}% of "
                f"the {received:.0f} GB/s received-bytes ceiling (copy bandwidth / 2), "
                f"{r.speedup['all_to_all_virtual']:.2f}x the all-to-all backend's steps (virtual ranks on one GPU)")
        if r.case.endswith("/sms_all"):
            ok = "meets bar" if r.pct_of_ceiling >= bar else "below bar"
            line += f"; every SM, like for like with the peer ({BAR}) [{ok}]"
        else:
            line += "; our default SM share, the rest left to overlapping compute (no bar)"
        lines.append(line)
    return lines


def run(ctx: h.Context) -> h.Report:
    if not ctx.is_cuda and _ext.emulation() is None:
        print("dispatch: skipped, the nvlink kernels need a GPU, or MOE_KERNELS_EMULATE=1 on a CPU (the "
              "CPU-executed build)")
        return h.Report([], [], [])
    results, failures, skipped = h.run_cases(ctx, "dispatch", cases(ctx), run_case)
    return h.Report(results, headline(ctx, results), failures, skipped)
