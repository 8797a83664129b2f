"""One pair of copy streams per run, made at set-up and shared by every engine a re-placement
builds. Before, each engine's device took two new streams from PyTorch's pool (32 per priority,
handed out in turn), so after a few re-placements a copy stream could be one NCCL or another
engine was already using, a false dependency. Both streams also ran at the default priority.
On the emulated device the pair is its two copy threads. A run's engines across two forced
re-placements copy on the same pair: tests/test_replacement_memory.py (it runs them already)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from offload_strategy.hardware import device as device_module
from offload_strategy.hardware.device import (
    CudaCopyStreams, CudaDevice, EmulatedCopyStreams, EmulatedDevice, make_copy_streams, make_device,
)


def _copy_threads(device) -> tuple[threading.Thread, ...]:
    return tuple(link.thread for link in device._links.values())


def test_a_device_closes_only_the_streams_it_made():
    made = EmulatedCopyStreams()
    try:
        with EmulatedDevice(capacity=1 << 20, streams=made) as first:
            event = first.copy_to_device(first.allocate(64), torch.ones(64, dtype=torch.uint8))
        assert event.done() and not made.closed  # the close waited for its copies and left the streams open
        with make_device(torch.device("cpu"), 1 << 20, streams=made) as second:
            slot = second.allocate(64)
            second.copy_to_device(slot, torch.full((64,), 7, dtype=torch.uint8)).wait()
            assert int(slot.sum()) == 7 * 64 and _copy_threads(second) == (made.to_device.thread, made.to_host.thread)
    finally:
        made.close()
    assert made.closed and not made.to_device.thread.is_alive()
    with pytest.raises(ValueError, match="closed"):
        EmulatedDevice(capacity=1 << 20, streams=made)
    with EmulatedDevice(capacity=1 << 20) as own:
        assert not own.streams.closed
    assert own.streams.closed  # one it made itself goes with it


def test_streams_refused_for_another_kind_of_device():
    with contextlib.closing(EmulatedCopyStreams(h2d_gbps=1.0)) as streams:
        with pytest.raises(ValueError, match="bandwidths"):
            EmulatedDevice(capacity=1, h2d_gbps=2.0, streams=streams)
        with pytest.raises(ValueError, match="make them for that device"):
            CudaDevice(torch.device("cuda", 0), 1, streams=streams)


class _FakeStream:
    """Records what a copy stream was asked for; a GPU whose priorities run 0 (least) to -5."""

    made: list[tuple[torch.device, int]] = []

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        self.device, self.priority = device, priority
        _FakeStream.made.append((device, priority))

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -5

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    """torch.cuda.Stream and the device context on a machine without CUDA: only the arguments the
    streams are made with are checked, no copy runs."""
    _FakeStream.made = []
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(device_module, "gpu_numa_node", lambda index: None)
    return _FakeStream.made


def test_host_to_gpu_at_the_highest_priority_gpu_to_host_at_the_default(fake_cuda_streams):
    streams = make_copy_streams(torch.device("cuda"))
    assert isinstance(streams, CudaCopyStreams) and streams.device == torch.device("cuda", 1)
    assert fake_cuda_streams == [(torch.device("cuda", 1), -5), (torch.device("cuda", 1), 0)]
    assert (streams.to_device.priority, streams.to_host.priority) == (-5, 0)
    devices = [make_device(torch.device("cuda", 1), 0, streams=streams) for _ in range(3)]  # three engines' devices
    assert len(fake_cuda_streams) == 2  # no stream taken beyond the pair
    assert all(d._streams == {"host-to-device": streams.to_device, "device-to-host": streams.to_host} for d in devices)
    with pytest.raises(ValueError, match="on cuda:1 given to a device on cuda:0"):
        CudaDevice(torch.device("cuda", 0), 0, streams=streams)


@pytest.mark.gpu
def test_cuda_copy_streams_are_shared_and_prioritised():
    least, greatest = torch.cuda.Stream.priority_range()
    streams = make_copy_streams(torch.device("cuda"))
    try:
        assert streams.to_device.priority == min(least, greatest) < streams.to_host.priority == 0
        size = 4 << 20
        src = torch.arange(size, dtype=torch.int64).to(torch.uint8).pin_memory()
        for _ in range(2):  # two engines' devices, one after the other
            with make_device(torch.device("cuda"), size, streams=streams) as device:
                assert device.streams is streams
                assert device._streams["host-to-device"].cuda_stream == streams.to_device.cuda_stream
                assert streams.to_device.cuda_stream != torch.cuda.current_stream().cuda_stream
                slot = device.allocate(size)
                device.wait(device.copy_to_device(slot, src))
                assert torch.equal(slot.cpu(), src)
            assert not streams.closed
    finally:
        streams.close()
    with pytest.raises(ValueError, match="closed"):
        make_device(torch.device("cuda"), 0, streams=streams)
