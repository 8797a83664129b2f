"""Swapped activations live in one slab of the swap's own: exactly what a step swaps to host memory,
within the swap's host limit (``runtime/activations/swap_memory.py``), instead of PyTorch's pinned
caching allocator, which rounds every buffer up to a power of two and never gives it back."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.hardware.device import RACE_CHECK_ENV
from offload_strategy.memory.slab import PAGE_BYTES
from offload_strategy.runtime.activations.swap_memory import HELD_ALIGNMENT, SwapMemory
from tests.helpers import assert_same_weights, train
from tests.test_activations import gpt2


def _counted(n: int) -> int:
    return -(-n // HELD_ALIGNMENT) * HELD_ALIGNMENT


def test_the_slab_becomes_what_a_step_held_and_never_more_than_the_limit():
    memory = SwapMemory(limit=10_000)
    assert memory.held_bytes == 0
    first = [memory.take(n) for n in (3000, 2000, 100)]  # no slab yet: slabs of their own, exactly as large
    assert all(b is not None for b in first) and memory.held_bytes == 5100
    assert memory.take(5000) is None  # over the limit: the swap keeps the tensor or sends it to NVMe
    memory.new_step()
    assert memory.slab.nbytes == sum(_counted(n) for n in (3000, 2000, 100)) == memory.held_bytes
    second = [memory.take(n) for n in (3000, 2000, 100)]
    assert all(b is not None and memory.contains(b) for b in second) and memory.held_bytes == memory.slab.nbytes
    assert len({b.data_ptr() for b in second}) == 3 and all(b.data_ptr() % HELD_ALIGNMENT == 0 for b in second)
    memory.close()


def test_a_read_ahead_takes_no_buffer_of_its_own_while_staging_buffers_will_make_room():
    """``take(wait=False)``: no wait for a staging buffer in use, and no slab of its own beside it
    (it will make room); once none is in use, a slab of its own within the limit as ``take``."""
    memory = SwapMemory(limit=3 * 4096, capacity=4096)
    done = {"first": False}
    a = memory.take(4096, staging=True)
    assert a is not None
    memory.give_back_after(a, lambda: done["first"], lambda: None)
    assert memory.take(4096, staging=True, wait=False) is None and memory.held_bytes == 4096
    done["first"] = True
    b = memory.take(4096, staging=True, wait=False)  # given back now: the slab again
    assert b is not None and b.data_ptr() == a.data_ptr()
    c = memory.take(8192, staging=True, wait=False)  # nothing in use to wait for: a slab of its own
    assert c is not None and not memory.contains(c) and memory.held_bytes == 3 * 4096
    assert memory.take(4096, staging=True, wait=False) is None  # the limit
    memory.close()


def test_staging_buffers_are_reused_once_their_write_is_done():
    memory = SwapMemory(limit=None, capacity=8192)
    done = {"first": False}
    a = memory.take(4096, staging=True)
    assert a is not None and memory.contains(a)
    memory.give_back_after(a, lambda: done["first"], lambda: done.update(first=True))
    b = memory.take(8192, staging=True)  # only room once the first is given back: waits for it
    assert done["first"] and b is not None and b.data_ptr() == a.data_ptr() and memory.held_bytes == 8192
    memory.close()


def test_a_swap_by_hand_holds_its_host_copies_in_its_slab_and_no_nvme_copy_in_host_memory(tmp_path):
    """Steps of three swapped tensors, the middle one to NVMe: the host copies become views of one
    slab, as large as they are and the NVMe copy's page-aligned buffer for its write and its read
    beside them, and the NVMe copy holds no host buffer once written (each came back with its bytes)."""
    from offload_strategy.hardware.device import EmulatedDevice
    from offload_strategy.memory.nvme import NvmeStore
    from offload_strategy.runtime.activations.swap import ActivationSwap

    tensors = [torch.randn(n) for n in (3000, 2000, 1500)]
    with EmulatedDevice(capacity=1 << 20) as device, NvmeStore(tmp_path, capacity=1 << 20) as store:
        swap = ActivationSwap(device, store, is_parameter=lambda t: False, host_limit=1 << 20)
        for _ in range(3):
            swap.begin_forward()
            packed = []
            for i, t in enumerate(tensors):
                destination = "swap_nvme" if i == 1 else "swap_host"
                with swap.hooks(i, destination):
                    packed.append(swap._pack(i, destination, t))
            held = [packed[0].copy, packed[2].copy]
            assert packed[1].copy.host is None and packed[1].copy.key is not None
            back = [swap._unpack(p) for p in reversed(packed)][::-1]
            assert all(torch.equal(a, b) for a, b in zip(back, tensors))
        host_copies = sum(_counted(c.nbytes) for c in held)
        assert all(swap.memory.contains(c.host) for c in held) and swap.memory.held_bytes == swap.memory.slab.nbytes
        assert host_copies < swap.memory.slab.nbytes <= host_copies + 8000 + PAGE_BYTES, swap.memory
        swap.close()


class SwapSeen(L.Callback):
    """At each batch's end: the host bytes the swap holds, its slab's, what its host copies and
    its NVMe copies hold (at the slab's alignment), whether each host copy lies in the slab, and
    whether any NVMe copy still holds a host buffer."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, int, bool, bool]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        swap = trainer.strategy.tiered.activations.policies_in_use.swap
        assert swap.device.race_check is not None
        copies = [c for cs in swap.stats.blocks.values() for c in cs]
        held, on_nvme = [c for c in copies if c.key is None], [c for c in copies if c.key is not None]
        self.seen.append((
            swap.memory.held_bytes, swap.memory.slab.nbytes, sum(_counted(c.nbytes) for c in held), sum(_counted(c.nbytes) for c in on_nvme),
            all(c.host is not None and swap.memory.contains(c.host) for c in held), any(c.host is not None for c in on_nvme),
        ))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("swap_host",) * 4, ("swap_nvme", "swap_host", "checkpoint", "swap_nvme")], ids=["host", "host_and_nvme"])
def test_a_swapped_run_holds_in_host_memory_what_it_swaps_there_and_trains_as_plain(tmp_path, monkeypatch, layout):
    """Every step the same batch shape: from the second step under one placement the swap holds
    one slab, each host copy a view of it (the first step runs the parameters in their least
    share while it measures the layout, and the swap is attached anew beside the placement after
    it: here from the third step); where every swap goes to host memory the slab is as large as the host
    copies together (at 64-byte alignment), and beside NVMe swaps it holds besides only what is
    being written there (less than they swap); an NVMe copy holds no host memory once written.
    Before, each copy was a buffer of its own (on a GPU, a power of two of PyTorch's pinned
    allocator), and an NVMe copy's stayed until the next step. Backward reads an NVMe block ahead
    into buffers of the slab, at most the block it reaches next (here one of the two: less than
    they swap). Under the race check: no buffer is reused, read from NVMe into or given back
    while a copy may still use it."""
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2)
    monkeypatch.setenv(RACE_CHECK_ENV, "6")
    seen = SwapSeen()
    strategy = TieredStrategy(policy={"name": "auto", "activations": layout}, nvme_path=tmp_path / "nvme")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    for held_bytes, slab_bytes, host_copies, nvme_copies, in_slab, nvme_holds_host in seen.seen[2:]:
        assert host_copies > 0 and in_slab and not nvme_holds_host, seen.seen
        if "swap_nvme" in layout:
            # NVMe writes are queued behind their copies: one still in flight when the slab is full
            # borrows a buffer of its own for a moment; backward's reads ahead hold one NVMe block
            # at most: always less than the NVMe swaps themselves
            assert host_copies <= slab_bytes <= held_bytes < host_copies + nvme_copies, seen.seen
        else:
            assert slab_bytes == host_copies == held_bytes, seen.seen
