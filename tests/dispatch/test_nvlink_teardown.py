"""The NVLink backend's IPC teardown order, on a transport whose CUDA calls and collectives are recorded
(no GPU needed): a region is freed only after every rank closed its mappings of it (unmap, barrier,
free), when it grows and in release_buffers; a transport collected without a live group frees nothing.
The real IPC path runs in tests/dispatch/test_nvlink_cuda.py on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_kernels.dispatch.nvlink import NvlinkDispatcher, _IpcTransport, _Transport

P, RANK = 3, 1


class _RecordingC:
    """The IPC calls of moe_kernels._C, recorded. This rank's n-th allocation is at n*100; rank r's allocation
    of the same region (mapped here) at n*100 + 10*(r + 1)."""

    def __init__(self, log):
        self.log, self.count = log, 0

    def ipc_malloc(self, nbytes, device):
        self.count += 1
        self.log.append(("malloc", 100 * self.count))
        return 100 * self.count

    def ipc_handle(self, ptr, device):
        return ptr

    def ipc_open(self, handle, device):
        self.log.append(("open", handle))
        return handle

    def ipc_close(self, ptr, device):
        self.log.append(("close", ptr))

    def ipc_free(self, ptr, device):
        self.log.append(("free", ptr))


class _RecordingIpc(_IpcTransport):
    def __init__(self, log):
        _Transport.__init__(self)
        self.group, self.C, self.device = "group", _RecordingC(log), torch.device("cpu")
        self.num_ranks, self.local_ranks = P, [RANK]
        self._mine, self._opened = {}, {}

    def _own_view(self, ptr, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def log(monkeypatch):
    log = []

    def all_gather_object(out, obj, group=None):
        log.append("all_gather")
        out[:] = [obj if r == RANK else obj + 10 * (r + 1) for r in range(P)]

    monkeypatch.setattr(dist, "barrier", lambda group=None: log.append("barrier"))
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: RANK)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    return log


def _taken(log):
    out = list(log)
    log.clear()
    return out


def test_region_growth_unmaps_then_barriers_then_frees(log):
    t = _RecordingIpc(log)
    t.ensure("dispatch", 1000)
    assert _taken(log) == ["sync", "barrier", ("malloc", 100), "all_gather", ("open", 110), ("open", 130), "barrier"]
    assert t.region("dispatch", RANK).numel() == 1000 and t.bases["dispatch"].tolist() == [110, 100, 130]
    t.ensure("dispatch", 600)  # fits: nothing happens
    assert log == []
    t.ensure("dispatch", 5000)
    # Every rank done with the old regions, every rank's mappings of them closed, then (after a barrier) freed.
    assert _taken(log) == ["sync", "barrier", ("close", 110), ("close", 130), "barrier", ("free", 100),
                           ("malloc", 200), "all_gather", ("open", 210), ("open", 230), "barrier"]
    assert t.region("dispatch", RANK).numel() == 5000 and t.bases["dispatch"].tolist() == [210, 200, 230]


def test_release_buffers_frees_after_every_rank_unmapped(log):
    t = _RecordingIpc(log)
    other = _RecordingIpc(log)
    group = object()
    NvlinkDispatcher._transports[(id(group), t.device)] = t
    NvlinkDispatcher._transports[(id(None), torch.device("meta"))] = other  # another group's: untouched
    try:
        t.ensure("header", 256)
        t.ensure("dispatch", 1000)
        other.ensure("dispatch", 1000)
        _taken(log)
        t.dropped_seen[RANK] = 7
        NvlinkDispatcher.release_buffers(group)
        assert _taken(log) == ["sync", "barrier", ("close", 110), ("close", 130), ("close", 210), ("close", 230),
                               "barrier", ("free", 100), ("free", 200)]
        assert not t._mine and not t._opened and not t.regions and not t.bases and not t.dropped_seen
        assert "dispatch" in other.regions
        NvlinkDispatcher.release_buffers(group)  # nothing left: no collective
        assert log == []
        t.ensure("dispatch", 1000)  # the next dispatch allocates again
        assert ("malloc", 300) in _taken(log)
    finally:
        NvlinkDispatcher._transports.pop((id(group), t.device))
        NvlinkDispatcher._transports.pop((id(None), torch.device("meta")))


def test_collected_or_groupless_transport_frees_nothing(log, monkeypatch):
    # Collected (e.g. at interpreter exit): no collective, the own mappings closed, the own regions left to
    # the driver. close() without a live group does the same.
    t = _RecordingIpc(log)
    t.ensure("dispatch", 1000)
    _taken(log)
    t.__del__()
    assert _taken(log) == ["sync", ("close", 110), ("close", 130)]
    assert not t._mine and not t.regions
    t.ensure("dispatch", 1000)
    _taken(log)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    t.close()
    assert _taken(log) == ["sync", ("close", 210), ("close", 230)]
    t.close()  # nothing left
    assert log == []
