"""A GPU tier of "all that is free" leaves a margin beside the plan: cuBLAS's workspaces, and a share
of the GPU for NCCL's buffers (made by the first collective, after the budget is read), the caching
allocator's fragmentation and SDPA's and cuDNN's workspaces. Free memory the caching allocator
holds unused counts as free. It left cuBLAS's workspaces alone (66 MiB on an H200)."""

from __future__ import annotations

import pytest
import torch

from offload_strategy.hardware.probe import GPU_MARGIN_SHARE, gpu_free, gpu_margin, gpu_room

GIB, MIB = 2**30, 2**20


def test_the_margin_of_an_80_gib_gpu():
    margin = gpu_margin(total=80 * GIB, workspaces=66 * MIB, reserved=3 * GIB, allocated=2 * GIB)
    assert margin.share == int(80 * GIB * GPU_MARGIN_SHARE) == 4 * GIB
    assert margin.cached == GIB and margin.nbytes == 4 * GIB + 66 * MIB
    # 70 GiB free to the driver, 1 GiB more reserved and unused in the cache: 71 GiB less the margin
    assert gpu_room(70 * GIB, margin) == 71 * GIB - 4 * GIB - 66 * MIB
    assert "NCCL" in margin.describe() and "4.00 GiB" in margin.describe()


def test_the_margin_takes_nothing_below_zero_and_ignores_a_cache_allocated_in_full():
    margin = gpu_margin(total=16 * GIB, workspaces=66 * MIB, reserved=GIB, allocated=2 * GIB)
    assert margin.cached == 0
    assert gpu_room(100 * MIB, margin) == 0


@pytest.mark.gpu
def test_all_that_is_free_on_a_gpu_leaves_the_margin():
    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    assert gpu_free(device) <= free - int(total * GPU_MARGIN_SHARE)
