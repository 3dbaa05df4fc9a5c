"""Checkpoints that survive a kill: write to a temporary file, fsync, rename, then move the `latest`
pointer the same way. A crash at any point leaves the previous checkpoint and pointer intact."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def save(directory: str | Path, step: int, state: dict, *, keep: int = 2) -> Path:
    """Writes `step_XXXXXXX.pt`, points `latest` at it, and removes all but the newest `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.pt"
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(directory / LATEST, lambda f: f.write(path.name.encode()))
    for old in sorted(directory.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def latest(directory: str | Path) -> Path | None:
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    return path if path.exists() else None


def load(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)
