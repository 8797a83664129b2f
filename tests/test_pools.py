"""HostSlab and SlotPool: aligned, exact, allocation-free after setup."""

import ctypes
import gc
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from offload_strategy.memory import PAGE_BYTES, HostSlab, PoolExhausted, SizeClass, Slot, SlotPool

# Fig. 5 of 10Cache in miniature: one 4096-byte, two 1024-byte, four 512-byte slots.
CLASSES = [SizeClass(4096, 1), SizeClass(1024, 2), SizeClass(512, 4)]


def _mincore(address: int, nbytes: int):
    """(resident pages, mapped?) of an address range, from the kernel's page tables."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // PAGE_BYTES)
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vector) != 0:
        assert ctypes.get_errno() == 12  # ENOMEM: part of the range is not mapped
        return 0, False
    return sum(byte & 1 for byte in vector), True


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux page tables")


# ---------------------------------------------------------------- HostSlab


@linux_only
def test_host_slab_is_aligned_exact_resident_and_writable():
    nbytes = 5 * PAGE_BYTES + 123  # not a whole number of pages: still exactly this many bytes
    with HostSlab(nbytes, pin=False) as slab:
        t = slab.tensor
        assert t.dtype == torch.uint8 and t.dim() == 1 and t.device.type == "cpu"
        assert t.numel() == slab.nbytes == nbytes
        assert t.data_ptr() % 4096 == 0
        assert not slab.pinned
        assert _mincore(t.data_ptr(), nbytes) == (6, True)  # every page faulted in at creation
        t.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
        assert int(t[nbytes - 1]) == (nbytes - 1) % 251
        assert int(t.to(torch.int64).sum()) == int(torch.arange(nbytes).remainder(251).sum())


def test_host_slab_zero_bytes():
    slab = HostSlab(0)
    assert slab.nbytes == 0 and slab.tensor.numel() == 0 and slab.tensor.dtype == torch.uint8
    assert not slab.pinned
    slab.close()
    slab.close()
    assert slab.closed


@pytest.mark.parametrize("bad", [-1, 1.5, "4KiB", True])
def test_host_slab_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="whole number of bytes"):
        HostSlab(bad)


@linux_only
def test_host_slab_close_is_idempotent_and_unmaps():
    slab = HostSlab(4 * PAGE_BYTES, pin=False)
    address = slab.tensor.data_ptr()
    assert _mincore(address, 4 * PAGE_BYTES)[1]
    slab.close()
    slab.close()
    assert slab.closed and not slab.pinned and slab.tensor.numel() == 0
    assert _mincore(address, 4 * PAGE_BYTES) == (0, False)


@linux_only
def test_host_slab_view_outliving_close_keeps_memory_valid():
    # Unmapping under a live view would make it dangle (a segfault on use); instead the mapping
    # lives until the last view goes.
    slab = HostSlab(2 * PAGE_BYTES, pin=False)
    address = slab.tensor.data_ptr()
    view = slab.tensor[PAGE_BYTES:]
    slab.close()
    view.fill_(7)
    assert int(view.sum()) == 7 * PAGE_BYTES
    del view
    gc.collect()
    assert _mincore(address, 2 * PAGE_BYTES) == (0, False)


@pytest.mark.gpu
def test_host_slab_pinned_copies_to_gpu_non_blocking():
    nbytes = 3 * 1024 * 1024 + 5
    with HostSlab(nbytes, pin=True) as slab:
        assert slab.pinned and slab.tensor.is_pinned()
        source = torch.arange(nbytes, dtype=torch.int64).remainder(256).to(torch.uint8)
        slab.tensor.copy_(source)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            on_gpu = slab.tensor.to("cuda", non_blocking=True)
            back = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            back.copy_(slab.tensor, non_blocking=True)
        stream.synchronize()
        assert torch.equal(on_gpu.cpu(), source) and torch.equal(back.cpu(), source)
        # A pool carved from a pinned slab gives pinned slots.
        pool = SlotPool(slab.tensor, [SizeClass(1024 * 1024, 2)])
        assert pool.acquire(1000).tensor.is_pinned()
    assert not slab.pinned


# ---------------------------------------------------------------- SlotPool


@pytest.fixture
def slab():
    with HostSlab(SlotPool.required_bytes(CLASSES), pin=False) as slab:
        yield slab


def _all_slots(pool):
    slots = []
    while (slot := pool.try_acquire(0)) is not None:
        slots.append(slot)
    return slots


def test_required_bytes_rounds_every_slot_to_the_alignment():
    assert SlotPool.required_bytes(CLASSES) == 7 * 4096
    assert SlotPool.required_bytes(CLASSES, alignment=512) == 4096 + 2 * 1024 + 4 * 512
    assert SlotPool.required_bytes([SizeClass(4097, 2)]) == 4 * 4096


def test_slots_are_aligned_disjoint_and_inside_the_backing(slab):
    pool = SlotPool(slab.tensor, CLASSES, name="host")
    base, end = slab.tensor.data_ptr(), slab.tensor.data_ptr() + slab.nbytes
    slots = _all_slots(pool)
    assert sorted(s.slot_bytes for s in slots) == [512] * 4 + [1024] * 2 + [4096]
    spans = sorted((s.tensor.data_ptr(), s.tensor.data_ptr() + s.slot_bytes) for s in slots)
    for (start, stop), (next_start, _) in zip(spans, spans[1:]):
        assert stop <= next_start  # disjoint
    for slot in slots:
        assert slot.tensor.dtype == torch.uint8 and slot.tensor.numel() == slot.slot_bytes
        assert slot.offset % 4096 == 0 and slot.tensor.data_ptr() % 4096 == 0
        assert base <= slot.tensor.data_ptr() and slot.tensor.data_ptr() + slot.slot_bytes <= end
        assert slot.tensor.data_ptr() == base + slot.offset
        assert slot.tensor.untyped_storage().data_ptr() == slab.tensor.untyped_storage().data_ptr()
    # Laid out in the order of the classes: the 4096-byte slot first (Fig. 5).
    assert [s.offset for s in sorted(slots, key=lambda s: s.offset)][:2] == [0, 4096]
    assert next(s for s in slots if s.offset == 0).slot_bytes == 4096


def test_backing_too_small_or_wrong_is_refused():
    with pytest.raises(ValueError, match=r"needs 28672 bytes .* backing holds 28671 bytes"):
        SlotPool(torch.empty(7 * 4096 - 1, dtype=torch.uint8), CLASSES, name="host")
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        SlotPool(torch.empty(7 * 4096, dtype=torch.float32), CLASSES)
    with pytest.raises(ValueError, match=r"slot sizes \[512\] appear in more than one class"):
        SlotPool(torch.empty(10 * 4096, dtype=torch.uint8), [SizeClass(512, 1), SizeClass(512, 2)])


def test_acquire_picks_smallest_fitting_class_then_falls_back_to_larger(slab):
    pool = SlotPool(slab.tensor, CLASSES)
    assert pool.acquire(1).slot_bytes == 512
    assert pool.acquire(512).slot_bytes == 512
    assert pool.acquire(513).slot_bytes == 1024
    assert pool.acquire(600).slot_bytes == 1024
    # 1024-byte class now empty: a 700-byte request takes the 4096-byte slot, not a 512.
    assert pool.free_slots(1024) == 0 and pool.free_slots(512) == 2
    assert pool.acquire(700).slot_bytes == 4096
    assert pool.try_acquire(700) is None
    assert pool.acquire(500).slot_bytes == 512


def test_exhausted_pool_raises_with_numbers(slab):
    pool = SlotPool(slab.tensor, CLASSES, name="host-fp16")
    for _ in range(3):
        pool.acquire(1000)
    with pytest.raises(PoolExhausted) as info:
        pool.acquire(1000)
    message = str(info.value)
    assert "'host-fp16'" in message and ">= 1000 bytes" in message
    assert "4096 B: 0 of 1 free" in message and "1024 B: 0 of 2 free" in message and "512 B: 4 of 4 free" in message
    with pytest.raises(PoolExhausted, match=r"no slot can hold 5000 bytes .* largest class is 4096 bytes"):
        pool.acquire(5000)
    assert isinstance(info.value, RuntimeError)


def test_release_and_reacquire_reuses_the_same_memory(slab):
    pool = SlotPool(slab.tensor, CLASSES)
    first = pool.acquire(512)
    assert first.offset == 4096 + 2 * 4096  # after the 4096 and 1024 classes: lowest 512 slot first
    first.tensor.fill_(42)
    pool.release(first)
    again = pool.acquire(400)
    assert again is first and again.tensor.data_ptr() == first.tensor.data_ptr()
    assert int(again.tensor[0]) == 42  # contents are not cleared: the caller overwrites


def test_double_release_and_foreign_slots_are_refused(slab):
    pool = SlotPool(slab.tensor, CLASSES, name="a")
    slot = pool.acquire(512)
    pool.release(slot)
    with pytest.raises(ValueError, match=r"512 bytes at offset 12288 is already free"):
        pool.release(slot)
    other = SlotPool(torch.empty(SlotPool.required_bytes(CLASSES), dtype=torch.uint8), CLASSES, name="b")
    with pytest.raises(ValueError, match="not from this pool"):
        pool.release(other.acquire(512))
    lookalike = Slot(512, slot.offset, slot.tensor)
    with pytest.raises(ValueError, match="not from this pool"):
        pool.release(lookalike)
    assert pool.used_bytes == 0


def test_used_and_peak_accounting(slab):
    pool = SlotPool(slab.tensor, CLASSES)
    assert pool.capacity_bytes == 4096 + 2 * 1024 + 4 * 512
    assert pool.used_bytes == pool.peak_used_bytes == 0
    a = pool.acquire(100)  # a 512 slot
    b = pool.acquire(1000)  # a 1024 slot
    assert pool.used_bytes == pool.peak_used_bytes == 1536
    pool.release(b)
    assert pool.used_bytes == 512 and pool.peak_used_bytes == 1536
    c = pool.acquire(4000)
    assert pool.used_bytes == 512 + 4096 and pool.peak_used_bytes == 512 + 4096
    pool.release(a)
    pool.release(c)
    assert pool.used_bytes == 0 and pool.peak_used_bytes == 4608
    with pytest.raises(ValueError, match=r"no class of 2048-byte slots; its classes are \[512, 1024, 4096\]"):
        pool.free_slots(2048)


def test_acquire_release_never_allocates(slab):
    pool = SlotPool(slab.tensor, CLASSES)
    base, end = slab.tensor.data_ptr(), slab.tensor.data_ptr() + slab.nbytes
    storage = slab.tensor.untyped_storage().data_ptr()
    held = [pool.acquire(2000)]  # keep one slot busy so the loop also exercises fallbacks
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(10_000):
            slot = pool.acquire((i * 37) % 1024 + 1)
            assert base <= slot.tensor.data_ptr() < end
            assert slot.tensor.untyped_storage().data_ptr() == storage
            pool.release(slot)
    allocated = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage or e.name == "[memory]"]
    assert allocated == []
    pool.release(held[0])
    assert pool.used_bytes == 0 and pool.peak_used_bytes == 4096 + 1024


def test_profiler_sees_allocations():
    # The check above is only meaningful if the profiler does report CPU tensor allocations.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(1000, dtype=torch.uint8)
    assert any(e.cpu_memory_usage > 0 for e in prof.events())


def test_slot_view_is_typed_zero_copy_and_checked(slab):
    pool = SlotPool(slab.tensor, CLASSES)
    slot = pool.acquire(1024)
    floats = slot.view(torch.float32, (4, 8), byte_offset=128)
    assert floats.shape == (4, 8) and floats.dtype == torch.float32
    assert floats.data_ptr() == slot.tensor.data_ptr() + 128
    floats.fill_(1.5)
    assert torch.equal(slot.tensor[128:256].view(torch.float32), torch.full((32,), 1.5))
    assert slot.view(torch.bfloat16, (512,)).numel() == 512  # exactly fills the slot
    assert slot.view(torch.float64, (0,)).numel() == 0
    with pytest.raises(ValueError, match=r"needs 1028 bytes at byte_offset 0, but the slot holds 1024 bytes"):
        slot.view(torch.float32, (257,))
    with pytest.raises(ValueError, match=r"needs 1024 bytes at byte_offset 4, but the slot holds 1024 bytes"):
        slot.view(torch.float32, (256,), byte_offset=4)
    with pytest.raises(ValueError, match=r"4-byte alignment.*multiple of 4"):
        slot.view(torch.float32, (4,), byte_offset=2)
    with pytest.raises(ValueError, match="negative"):
        slot.view(torch.float32, (-1, 4))


def test_threads_never_share_a_slot(slab):
    import threading

    pool = SlotPool(slab.tensor, [SizeClass(512, 4)])
    errors = []

    def worker(tag: int) -> None:
        for _ in range(2000):
            slot = pool.try_acquire(512)
            if slot is None:
                continue
            slot.tensor[0] = tag
            if int(slot.tensor[0]) != tag:
                errors.append(tag)
            pool.release(slot)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and pool.used_bytes == 0 and pool.free_slots(512) == 4
