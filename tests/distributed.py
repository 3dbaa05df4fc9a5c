"""Runs a test body on P gloo ranks (processes on the CPU), the way the multi-process tier works.

The body is a module-level function `fn(rank, world_size, *args)`; an exception on any rank fails the
test with that rank's traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any group exists: see below)
import torch.multiprocessing as mp

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is imported.
# torch imports it lazily (the first custom-op call pulls in torch._dynamo, which imports it), so on a
# rank that imports it after init_process_group those defaults hold the gloo group past
# destroy_process_group: its worker threads are never joined and still drop finished Work objects
# (and the tensors they hold, which needs the GIL) while the interpreter finalizes at exit; the thread
# then exits inside a noexcept destructor -> std::terminate -> SIGABRT ("terminate called without an
# active exception"). Imported here, before the group exists, the defaults are None and
# destroy_process_group frees the group, joining its threads.


def _entry(rank: int, fn, world_size: int, init_method: str, args: tuple) -> None:
    torch.set_num_threads(1)  # P processes share the machine's cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Every rank done with its collectives before any tears its group down: a gloo pair torn down
        # while its peer still sends aborts the peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without finalizing the interpreter: gloo's worker threads can still be
    # dropping Work objects then (the abort above, seen under load). A failing rank raised before here,
    # so its traceback still reaches the parent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks are forked from a fork server that imported these once (multiprocessing's forkserver), instead of
# each rank starting a fresh interpreter and importing torch and the package again: about 5 s a world of 4
# on two cores, against 0.2 s. The server holds no threads and no CUDA context (it only imports), so a
# fork of it is as clean as a spawn. It starts with the first world and keeps the environment of that
# moment: a test that changes what a new process reads at start (an environment variable the C library
# or an import reads) asks for `fresh=True`, a spawned interpreter.
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.nn",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "pytest",
    "moe_kernels",
    "moe_kernels.models",
    "moe_kernels.parallel",
    "moe_kernels.train",
    "tests.distributed",
]


def run_world(fn, world_size: int, *args, fresh: bool = False) -> None:
    """Runs `fn(rank, world_size, *args)` on `world_size` gloo ranks; `fresh=True` starts each rank as a new
    interpreter (spawn) rather than a fork of the preloaded server."""
    method = "spawn" if fresh else "forkserver"
    if not fresh:
        mp.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first world of the session
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry, args=(fn, world_size, f"file://{tmp}/store", args), nprocs=world_size, start_method=method
        )
