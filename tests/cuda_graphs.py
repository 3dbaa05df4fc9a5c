"""Capture a training step in a CUDA graph and replay it on new inputs (the tests' common pattern)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_and_replay(step: Callable[[], list], refresh: Callable[[], None]) -> tuple[list, list]:
    """Warms `step` up on a side stream (as torch.cuda.graphs asks), captures it, calls `refresh` to write
    new values into the static inputs, replays; returns (the replay's outputs, `step` run eagerly on the
    same inputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        refresh()
    graph.replay()
    torch.cuda.synchronize()
    return captured, step()
