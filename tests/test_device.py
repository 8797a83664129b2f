"""The Device abstraction: byte-exact asynchronous copies, throttling, ordering, budgets, teardown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from offload_strategy.config import HardwareSpec
from offload_strategy.hardware.device import CudaDevice, DeviceMemoryError, EmulatedDevice, Event, make_device

MB = 10**6


@pytest.fixture
def device():
    dev = EmulatedDevice(capacity=64 * MB)
    try:
        yield dev
    finally:
        dev.close()  # non-daemon copy threads would otherwise keep pytest from exiting


def _random(shape, dtype, generator):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (1001,), (3, 0)])
def test_round_trip_is_byte_exact(device, dtype, shape):
    src = _random(shape, dtype, torch.Generator().manual_seed(0))
    nbytes = src.numel() * src.element_size()
    slot = device.allocate(nbytes)
    back = torch.zeros_like(src)
    device.wait(device.copy_to_device(slot, src))
    device.wait(device.copy_to_host(back, slot))
    assert torch.equal(slot, src.reshape(-1).view(torch.uint8))
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))  # bit-exact, NaN payloads included
    assert (device.bytes_to_device, device.bytes_to_host) == (nbytes, nbytes)


def test_copies_between_dtypes_move_bytes(device):
    src = torch.arange(9, dtype=torch.bfloat16)  # 18 bytes into a float16 slot of 9 elements
    dst = torch.empty(9, dtype=torch.float16)
    device.copy_to_host(dst, src).wait()
    assert torch.equal(dst.view(torch.bfloat16), src)


def test_copies_are_asynchronous():
    nbytes, gbps = 5 * MB, 0.05  # 0.1 s on the throttled link
    with EmulatedDevice(capacity=nbytes, h2d_gbps=gbps) as dev:
        slot, src = dev.allocate(nbytes), torch.ones(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        event = dev.copy_to_device(slot, src)
        assert time.perf_counter() - start < 0.05  # back well before the copy's 0.1 s, however busy the machine
        assert not event.done() and event.finished_at is None
        blocked = dev.wait(event)
        assert event.done() and blocked > 0.05
        assert event.finished_at - event.issued_at >= nbytes / (gbps * 1e9)
        assert event.wait() == 0.0  # already complete: no second wait
        assert int(slot.sum()) == nbytes


def test_throttled_copy_takes_nbytes_over_bandwidth():
    nbytes, gbps = 2 * MB, 0.04  # 0.05 s
    with EmulatedDevice(capacity=nbytes, d2h_gbps=gbps) as dev:
        src, dst = dev.allocate(nbytes), torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        dev.copy_to_host(dst, src).wait()
        assert time.perf_counter() - start >= nbytes / (gbps * 1e9)


def test_copies_in_one_direction_complete_in_issue_order():
    sizes = [3 * MB, 10, 1 * MB, 1, 2 * MB]  # the small ones would win a race if there were one
    with EmulatedDevice(capacity=sum(sizes), h2d_gbps=0.5) as dev:
        events = [dev.copy_to_device(dev.allocate(n), torch.full((n,), 7, dtype=torch.uint8)) for n in sizes]
        dev.wait(events[-1])
        assert all(event.done() for event in events)
        finished = [event.finished_at for event in events]
        assert finished == sorted(finished)
        assert dev.bytes_to_device == sum(sizes)


def test_synchronize_waits_for_both_directions():
    with EmulatedDevice(capacity=2 * MB, h2d_gbps=0.1, d2h_gbps=0.1) as dev:
        up = dev.copy_to_device(dev.allocate(MB), torch.ones(MB, dtype=torch.uint8))
        down = dev.copy_to_host(torch.empty(MB, dtype=torch.uint8), dev.allocate(MB))
        dev.synchronize()
        assert up.done() and down.done()


def test_allocate_enforces_capacity_with_the_numbers():
    with EmulatedDevice(capacity=3 * 2**20) as dev:
        buffer = dev.allocate(2 * 2**20)
        assert buffer.dtype == torch.uint8 and buffer.shape == (2 * 2**20,) and buffer.device.type == "cpu"
        with pytest.raises(DeviceMemoryError, match=r"2\.00 MiB.*4\.00 MiB.*3\.00 MiB.*gpu_memory") as err:
            dev.allocate(2 * 2**20)
        assert isinstance(err.value, ValueError)
        assert dev.allocated == 2 * 2**20  # a refused request takes nothing
        dev.allocate(2**20)  # exactly full is fine
        assert dev.allocated == dev.capacity


def test_size_mismatch_and_non_contiguous_are_refused(device):
    with pytest.raises(ValueError, match=r"dst holds 12 bytes.*src holds 16 bytes"):
        device.copy_to_device(torch.empty(3, dtype=torch.float32), torch.empty(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        device.copy_to_host(torch.empty(6), torch.empty(2, 3).t())
    assert device.bytes_to_device == device.bytes_to_host == 0


class _Exploding(torch.Tensor):
    """A tensor whose in-place copy fails, as a bug in a copy would, on the copy thread."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("boom in copy")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_an_exception_in_a_copy_surfaces_and_the_link_survives(device):
    dst = torch.empty(8, dtype=torch.uint8).as_subclass(_Exploding)
    event = device.copy_to_device(dst, torch.ones(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="boom in copy"):
        device.wait(event)
    with pytest.raises(RuntimeError, match="boom in copy"):
        event.wait()
    assert event.done() and isinstance(event.error, RuntimeError)
    with pytest.raises(RuntimeError, match="boom in copy"):
        device.synchronize()  # nobody has to wait on the failed event to learn about it
    device.synchronize()  # reported once
    good = torch.empty(8, dtype=torch.uint8)
    device.wait(device.copy_to_device(good, torch.ones(8, dtype=torch.uint8)))
    assert int(good.sum()) == 8


def _device_threads() -> int:
    """Threads of emulated devices only: other tests' stores may stop theirs while this one runs."""
    return sum(t.name.startswith("offload-") for t in threading.enumerate())


def test_close_joins_threads_and_is_idempotent():
    before = _device_threads()
    dev = EmulatedDevice(capacity=MB, h2d_gbps=0.1)
    assert _device_threads() == before + 2
    event = dev.copy_to_device(dev.allocate(MB), torch.ones(MB, dtype=torch.uint8))
    dev.close()
    assert event.done()  # queued copies complete before the threads stop
    assert _device_threads() == before
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.copy_to_device(torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8))
    with EmulatedDevice(capacity=MB):
        assert _device_threads() == before + 2
    assert _device_threads() == before


def test_a_dropped_device_stops_its_threads():
    before = _device_threads()
    dev = EmulatedDevice(capacity=MB)
    del dev
    assert _device_threads() == before


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="capacity=-1"):
        EmulatedDevice(capacity=-1)
    before = _device_threads()
    with pytest.raises(ValueError, match="d2h_gbps=0"):
        EmulatedDevice(capacity=MB, d2h_gbps=0)
    assert _device_threads() == before


def test_make_device_on_cpu():
    spec = HardwareSpec(name="t", gpu="none", gpu_memory=0, gpu_bf16_tflops=None, gpu_fp16_tflops=None,
                        h2d_gbps=0.01, d2h_gbps=None, host_memory=2**30, cpu_cores=2)
    with make_device(torch.device("cpu"), MB) as plain:
        assert isinstance(plain, EmulatedDevice) and plain.is_emulated
        assert plain.compute == torch.device("cpu") and plain.capacity == MB
        start = time.perf_counter()
        plain.copy_to_device(plain.allocate(MB), torch.ones(MB, dtype=torch.uint8)).wait()
        assert time.perf_counter() - start < 0.05  # unthrottled unless asked: 0.1 s at the spec's bandwidth
    with make_device(torch.device("cpu"), MB, spec, throttle=True) as throttled:
        start = time.perf_counter()
        throttled.copy_to_device(throttled.allocate(MB), torch.ones(MB, dtype=torch.uint8)).wait()
        assert time.perf_counter() - start >= MB / (0.01 * 1e9)


# -- CUDA --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_round_trip_through_pinned_memory():
    size = 3 * MB + 7
    src = torch.randint(0, 256, (size,), dtype=torch.uint8).pin_memory()
    back = torch.zeros(size, dtype=torch.uint8).pin_memory()
    with make_device(torch.device("cuda"), 16 * MB) as dev:
        assert isinstance(dev, CudaDevice) and not dev.is_emulated and dev.compute.index is not None
        slot = dev.allocate(size)
        assert slot.is_cuda and slot.dtype == torch.uint8
        dev.wait(dev.copy_to_device(slot, src))
        event = dev.copy_to_host(back, slot)
        assert isinstance(event, Event)
        event.wait()
        assert event.done()
        assert torch.equal(back, src)
        with pytest.raises(DeviceMemoryError):
            dev.allocate(16 * MB)


@pytest.mark.gpu
def test_cuda_wait_orders_compute_after_the_copy():
    size = 256 * 2**20  # a copy of several ms, while the sum below is queued in microseconds
    src = torch.ones(size, dtype=torch.uint8).pin_memory()
    with CudaDevice(torch.device("cuda", 0), size) as dev:
        slot = dev.allocate(size)
        for _ in range(3):
            slot.zero_()
            event = dev.copy_to_device(slot, src)
            assert dev.wait(event) == 0.0  # the GPU waits, not the host
            total = slot.sum(dtype=torch.int64)  # on the compute stream
            assert int(total) == size
