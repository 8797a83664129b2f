"""Per-unit compute times come from marks on the compute's own timeline (``Device.mark_time``), not
from the host's clock: on CUDA the host only launches a module's kernels, and its time lands on
whichever module the host next waits in."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from offload_strategy.hardware.device import EmulatedDevice, TimeMark
from offload_strategy.planning.placement import UnitSize, place_units
from offload_strategy.runtime.engine import TieredEngine
from offload_strategy.runtime.units import build_units

QUEUED_SECONDS = 0.3


class QueuedComputeDevice(EmulatedDevice):
    """An emulated tier whose compute runs behind the host, as a GPU's does: :meth:`launch` queues
    seconds of compute and returns at once; a mark is reached when the queue gets there;
    :meth:`host_sync` blocks the host until the queue is empty (``.item()`` on CUDA)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.free_at = 0.0

    def launch(self, seconds: float) -> None:
        self.free_at = max(self.free_at, time.perf_counter()) + seconds

    def host_sync(self) -> None:
        time.sleep(max(0.0, self.free_at - time.perf_counter()))

    def mark_time(self) -> TimeMark:
        mark = TimeMark()
        mark.at = max(mark.at, self.free_at)
        return mark


class Launching(nn.Linear):
    """A layer whose kernels take QUEUED_SECONDS on the device."""

    device: QueuedComputeDevice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.device.launch(QUEUED_SECONDS)
        return super().forward(x)


class Syncing(nn.Linear):
    """A layer that takes no device time but makes the host wait for the device (a host read)."""

    device: QueuedComputeDevice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.device.host_sync()
        return super().forward(x)


def test_a_module_is_charged_its_compute_not_the_host_wait_that_follows_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Launching(8, 8), Syncing(8, 8), nn.Linear(8, 1))
    units, users = build_units(model)
    sizes = [UnitSize(u.index, u.nbytes, u.nbytes) for u in units]
    placement = place_units(sizes, [[u.index for u in used] for used in users.values()], gpu_bytes=1 << 20, host_bytes=1 << 20,
                            nvme_bytes=0, state_factor=2)
    device = QueuedComputeDevice(capacity=1 << 20)
    model[1].device = model[2].device = device
    engine = TieredEngine(model, units, users, placement, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        engine.begin_step(profile=True)
        with engine.saved_tensor_hooks():
            loss = model(torch.ones(4, 8)).sum()
        engine.begin_backward()
        loss.backward()
        engine.end_backward()
        engine.step(optimizer)
    finally:
        engine.close(materialize=True)
        device.close()
    launching, syncing = (next(u.index for u in units if u.name.startswith(name)) for name in ("1", "2"))
    forward = engine.timer.profile.forward_seconds
    # on the host's clock the launch is instant and the wait falls in the next layer: 0 s and 0.3 s
    assert forward[launching] >= QUEUED_SECONDS * 0.95, forward
    assert forward[syncing] < QUEUED_SECONDS / 3, forward
    assert engine.timer.last_timing is not None and engine.timer.last_timing.forward_seconds[launching] == forward[launching]


@pytest.mark.gpu
def test_cuda_time_marks_read_the_gpus_time_not_the_launch():
    from offload_strategy.hardware.device import make_device

    with make_device(torch.device("cuda"), 1 << 20) as device:
        a = torch.randn(4096, 4096, device=device.compute)
        torch.cuda.synchronize()
        host_start = time.perf_counter()
        start = device.mark_time()
        for _ in range(20):
            a = a @ a / 64
        end = device.mark_time()
        launched = time.perf_counter() - host_start
        gpu = device.seconds_between(start, end)
        torch.cuda.synchronize()
        assert gpu > 2 * launched, (gpu, launched)  # 20 GEMMs of 4096^3 take far longer than their launches
