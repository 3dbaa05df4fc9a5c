import subprocess
import sys

import torch

import moe_kernels
from moe_kernels.env import CUDA_OPS, collect


def test_report_runs_and_names_everything():
    out = subprocess.run([sys.executable, "-m", "moe_kernels"], capture_output=True, text=True, check=True).stdout
    for field in ("torch", "extension_built", "gpu", "ops:"):
        assert field in out
    for op in CUDA_OPS:
        assert op in out


def test_collect_is_consistent():
    info = collect()
    assert info["torch"] == torch.__version__
    assert info["extension_built"] == moe_kernels.has_cuda_kernels()
    assert set(info["ops"]) == set(CUDA_OPS)
    if not torch.cuda.is_available():
        assert all(v == "PyTorch reference" for v in info["ops"].values())
    if moe_kernels.has_cuda_kernels():
        assert all(a.startswith("sm_") for a in info["extension_archs"])
