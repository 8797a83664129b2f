"""Direct-host-access views: the host tensor itself on the emulated tier, a CUDA view over pinned
memory on a GPU (reads and writes land in the host bytes)."""

from __future__ import annotations

import pytest
import torch

from offload_strategy.memory.dha import can_view, device_view


def test_on_the_emulated_tier_the_view_is_the_host_tensor():
    host = torch.arange(6, dtype=torch.float32)
    assert device_view(host, torch.device("cpu")) is host


def test_what_can_be_viewed():
    assert can_view(torch.zeros(4), torch.device("cpu"))  # off a GPU the view is the tensor itself
    assert not can_view(torch.zeros(4), torch.device("cuda", 0))  # not pinned


def test_a_cuda_view_needs_pinned_contiguous_memory():
    with pytest.raises(ValueError, match="needs a pinned host tensor, got one on cpu \\(not pinned\\)"):
        device_view(torch.zeros(4), torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_cuda_view_reads_and_writes_the_host_bytes(dtype):
    host = torch.arange(64, dtype=torch.float32).to(dtype).pin_memory()
    view = device_view(host, torch.device("cuda", 0))
    assert view.is_cuda and view.dtype == dtype and view.data_ptr() == host.data_ptr()
    assert torch.equal(view.cpu(), host)  # the GPU reads what the host wrote
    view.mul_(2)
    torch.cuda.synchronize()
    assert torch.equal(host, (torch.arange(64, dtype=torch.float32) * 2).to(dtype))  # and writes it back in place
    with pytest.raises(ValueError, match="contiguous"):
        device_view(host.view(8, 8).t(), torch.device("cuda", 0))
