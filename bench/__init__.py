"""Microbenchmarks for moe_kernels: `python -m bench --help`. Method in harness.py's docstring."""
