import os

import pytest
import torch

import moe_kernels

# MOE_KERNELS_TEST_DEVICE=cpu runs the GPU tier against the CPU references: a dry run that checks the
# test code itself on a machine without a GPU (it proves nothing about the kernels).
_DRY_RUN_DEVICE = os.environ.get("MOE_KERNELS_TEST_DEVICE")


def pytest_collection_modifyitems(config, items):
    # GPU tier: skipped without a CUDA device. With a device but no compiled kernels the tests run and
    # fail, so a broken build never passes quietly on a GPU machine.
    if torch.cuda.is_available() or _DRY_RUN_DEVICE:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda():
    if _DRY_RUN_DEVICE:
        return torch.device(_DRY_RUN_DEVICE)
    assert moe_kernels.has_cuda_kernels(), "a CUDA device is present but moe_kernels._C is not built"
    return torch.device("cuda")


@pytest.fixture
def checks_on():
    moe_kernels.set_checks(True)
    yield
    moe_kernels.set_checks(False)
