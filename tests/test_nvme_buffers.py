"""The NVMe store's bounce buffers (one ``CHUNK`` a worker thread, for unaligned ``O_DIRECT``
requests) are given back once a store outlives training: the units left on NVMe after ``fit``
keep their store open for the life of the process."""

from __future__ import annotations

import pytest
import torch

from offload_strategy.hardware.resident import proc_status
from offload_strategy.memory.nvme import CHUNK, NvmeStore


@pytest.mark.no_race_check  # measures the resident set
def test_the_bounce_buffers_pages_are_given_back_and_the_store_still_reads(tmp_path):
    store = NvmeStore(tmp_path, capacity=64 * 2**20, workers=4)
    try:
        if not store.direct:
            pytest.skip("no O_DIRECT on this file system: requests go straight to the file, without bounce buffers")
        values = torch.randn(3 * CHUNK // 4 + 1)[1:]  # one element in: unaligned, so every chunk goes through a bounce buffer
        store.write("unit", values).result()
        back = torch.empty_like(values)
        store.read("unit", back).result()
        assert torch.equal(back, values)
        touched = len(store._bounces) * CHUNK
        assert touched >= CHUNK
        held = proc_status("VmRSS")  # (the buffers are shared anonymous memory: RssShmem, not RssAnon)
        store.release_buffers()
        given_back = held - proc_status("VmRSS")
        assert given_back >= touched * 3 // 4, f"{given_back / 2**20:.1f} MiB given back of {touched / 2**20:.0f} MiB of bounce buffers"
        again = torch.zeros_like(values)
        store.read("unit", again).result()  # through the same mappings, their pages faulted in afresh
        assert torch.equal(again, values)
    finally:
        store.close()
