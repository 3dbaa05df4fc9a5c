import os

import pytest
import torch

import moe_kernels

# MOE_KERNELS_EMULATE=1 (or asan) runs the GPU tier on CPU tensors through the CPU-executed kernels
# (moe_kernels._C_emu): our CUDA sources, executed. MOE_KERNELS_TEST_DEVICE=cpu runs the GPU tier
# against the CPU references: a dry run that checks the test code itself (it proves nothing about the
# kernels).
EMULATED = moe_kernels._ext.emulation() is not None
if EMULATED:
    # Memory a kernel should have written but did not reads as NaN (floats) or the largest integer, not
    # as the zeros of fresh pages.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
_DRY_RUN_DEVICE = os.environ.get("MOE_KERNELS_TEST_DEVICE") or ("cpu" if EMULATED else None)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: N worker processes share the machine's cores, one intra-op thread each.
    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto`: a worker a core, at most one per 3 GB of memory (a worker holds torch,
    transformers and a test's models; the distributed tests fork 2-8 ranks of their own) and at most 8.
    None with a CUDA device: the GPU tier's large cases expect the device to themselves. The emulated
    kernels run one CUDA thread at a time, so their tiers gain the most. PYTEST_XDIST_AUTO_NUM_WORKERS
    still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    if torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 3.0 * cores
    return max(1, min(cores, int(mem_gb // 3), 8))


def pytest_collection_modifyitems(config, items):
    # The few cases that run for minutes on the CPU-executed kernels (`long`) first: pytest -n hands each worker a
    # run of consecutive tests, then more as it finishes them, so one collected last would keep a worker busy after
    # the others ran out of work.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    # More cases of families CI covers already (extra parallel layouts): scripts/extended_tests.sh.
    if not os.environ.get("MOE_KERNELS_EXTENDED"):
        skip_extended = pytest.mark.skip(reason="extended case: scripts/extended_tests.sh runs it")
        for item in items:
            if "extended" in item.keywords:
                item.add_marker(skip_extended)
    # GPU tier: skipped without a CUDA device unless emulated. With a device but no compiled kernels the
    # tests run and fail, so a broken build never passes quietly on a GPU machine. `cuda_device` tests
    # need the physical device (CUDA graphs, streams, IPC) even under emulation.
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    skip_device = pytest.mark.skip(reason="needs a physical CUDA device (graphs, streams, device mismatches or device memory), not emulated")
    for item in items:
        if "cuda_device" in item.keywords:
            item.add_marker(skip_device)
        elif "gpu" in item.keywords and not _DRY_RUN_DEVICE:
            item.add_marker(skip_gpu)


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
