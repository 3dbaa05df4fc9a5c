"""Microbenchmarks for moe_kernels: `python -m bench --help`. Method in harness.py's docstring."""

# op family -> module with run(ctx: harness.Context) -> harness.Report; imported only when selected.
BENCHES = {
    "permute": "bench.bench_permute",
    "router": "bench.bench_router",
    "router_losses": "bench.bench_router_losses",
    "quant": "bench.bench_quant",
    "grouped_mm": "bench.bench_grouped_mm",
    "grouped_mm_fp8": "bench.bench_grouped_mm_fp8",
    "moe_layer": "bench.bench_moe_layer",
    "lora": "bench.bench_lora",
    "dispatch": "bench.bench_dispatch",
    "train": "bench.bench_train",
    "overhead": "bench.bench_overhead",
    "bytes": "bench.bench_bytes",
    "moe_layer_fp8": "bench.bench_moe_layer_fp8",
    "tune_grouped_mm": "bench.bench_tune_grouped_mm",
    "expert_mlp": "bench.bench_expert_mlp",
    "hf_blocks": "bench.bench_hf_blocks",
    "activation": "bench.bench_activation",
}
