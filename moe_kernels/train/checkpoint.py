"""Checkpoints that survive a kill: write to a temporary file, fsync, rename, then move the `latest`
pointer the same way. A crash at any point leaves the previous checkpoint and pointer intact.

A checkpoint is `step_<step>.pt` (the full state in one file: one process, or `--save-full`) or a
directory `step_<step>` (a sharded checkpoint, every rank's shards: moe_kernels.parallel.checkpoint,
renamed into place whole once every rank has written)."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from moe_kernels.parallel.checkpoint import fsync_dir as _fsync_dir

LATEST = "latest"
_NAME = re.compile(r"step_(\d+)(\.pt)?")


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_of(path: str | Path) -> int | None:
    """The step number in a checkpoint's name (`step_0000100.pt` or the directory `step_0000100` -> 100), or
    None for other names."""
    match = _NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def is_sharded(path: str | Path) -> bool:
    """A sharded checkpoint (a directory), not a full-state file."""
    return Path(path).is_dir()


def checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints (files and sharded directories) in `directory`, oldest step first (by number: padding
    does not matter)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step_of(p), p) for p in directory.glob("step_*")]
    found = [(step, p) for step, p in found if step is not None and p.is_dir() != p.name.endswith(".pt")]
    return [p for _, p in sorted(found)]


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def save(directory: str | Path, step: int, state: dict, *, keep: int = 2) -> Path:
    """Writes `step_<step, 7 digits>.pt`, points `latest` at it, and removes the older checkpoints beyond the newest
    `keep` (counting the new one). Only checkpoints of earlier steps are removed: never the one just
    written, the one `latest` points to, or any of a later step."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.pt"
    _atomic_write(path, lambda f: torch.save(state, f))
    return point_latest(directory, path, keep=keep)


def point_latest(directory: str | Path, path: Path, *, keep: int = 2) -> Path:
    """Points `latest` at the checkpoint `path` (a file or a sharded directory already in place) and removes
    the older checkpoints beyond the newest `keep` (as save does)."""
    directory = Path(directory)
    step = step_of(path)
    _atomic_write(directory / LATEST, lambda f: f.write(Path(path).name.encode()))
    pointed = latest(directory)
    older = [p for p in checkpoints(directory) if step_of(p) < step]
    for old in older[: max(len(older) - (keep - 1), 0)]:
        if old != pointed:
            _remove(old)
    return Path(path)


def latest(directory: str | Path) -> Path | None:
    """The checkpoint `latest` points to, or None when there is no pointer or it names a missing file."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    return path if path.exists() else None


def clear(directory: str | Path) -> None:
    """Removes the checkpoints, the `latest` pointer and leftovers of interrupted writes in `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        name = path.name.removesuffix(".tmp").removesuffix(".old")
        if name == LATEST or step_of(name) is not None:
            _remove(path)


def load(path: str | Path) -> dict:
    """A full-state checkpoint, memory-mapped: a rank reads the pages of the tensors it copies, not the file."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
