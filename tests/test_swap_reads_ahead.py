"""Backward reads ``swap_nvme`` activations ahead on the NVMe store's threads: when backward reaches
a swap block, the reads of its tensors and of the next block's are queued, in backward order, into
staging buffers of the swap's own host memory; an unpack waits only for its own tensor's read
(already issued, where the window had room) and launches its copy into the GPU tier. Before, an
unpack waited on autograd's thread for the write, then for the read, of every tensor of its block
and of the next block, one after the other."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.hardware.device import RACE_CHECK_ENV, EmulatedDevice, RaceCheck
from offload_strategy.memory.nvme import NvmeStore
from offload_strategy.runtime.activations.swap import ActivationSwap, _Swapped
from tests.helpers import assert_same_weights, train
from tests.test_activations import Swapped, gpt2


@dataclass
class _Wait:
    thread: str
    read: str  # the key whose read was waited for
    unpacking: Optional[str]  # the key of the copy whose unpack was running on that thread (None: none)


@dataclass
class ReadBooks:
    """Who read swapped activations from NVMe, and who waited for those reads: each read's key,
    whether its tensor's unpack had been called when it was issued, the threads that ran its
    chunks, and every wait for a read's result made inside an unpack (the thread, the read, the
    copy being unpacked)."""

    issued: dict[str, bool] = field(default_factory=dict)  # key -> issued before any unpack of its tensor
    chunk_threads: set[str] = field(default_factory=set)
    waits: list[_Wait] = field(default_factory=list)
    unpacked: set[str] = field(default_factory=set)
    _futures: dict[int, tuple[Future, str]] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "ReadBooks":
        unpack, read, read_chunk = ActivationSwap._unpack, NvmeStore.read, NvmeStore._read_chunk
        result, exception = Future.result, Future.exception

        def unpacking(swap, packed):
            key = packed.copy.key if isinstance(packed, _Swapped) else None
            outer, self._local.key = getattr(self._local, "key", None), key
            if key is not None:
                self.unpacked.add(key)
            try:
                return unpack(swap, packed)
            finally:
                self._local.key = outer

        def reading(store, key, dst, *args, **kwargs):
            future = read(store, key, dst, *args, **kwargs)
            self.issued.setdefault(key, key not in self.unpacked)
            self._futures[id(future)] = (future, key)
            return future

        def chunk(store, *args):
            self.chunk_threads.add(threading.current_thread().name)
            return read_chunk(store, *args)

        def waiting(method):
            def wait(future, *args, **kwargs):
                known = self._futures.get(id(future))
                inside = getattr(self._local, "key", "outside")
                if known is not None and known[0] is future and inside != "outside":
                    self.waits.append(_Wait(threading.current_thread().name, known[1], inside))
                return method(future, *args, **kwargs)
            return wait

        monkeypatch.setattr(ActivationSwap, "_unpack", unpacking)
        monkeypatch.setattr(NvmeStore, "read", reading)
        monkeypatch.setattr(NvmeStore, "_read_chunk", chunk)
        monkeypatch.setattr(Future, "result", waiting(result))
        monkeypatch.setattr(Future, "exception", waiting(exception))
        return self

    def assert_read_ahead(self) -> None:
        assert self.issued and self.chunk_threads, "no activation was read back from NVMe"
        assert all(name.startswith("nvme") for name in self.chunk_threads), sorted(self.chunk_threads)
        elsewhere = [w for w in self.waits if w.read != w.unpacking]
        assert not elsewhere, f"{len(elsewhere)} of {len(self.waits)} waits for a read were made in another tensor's unpack, e.g. {elsewhere[:3]}"
        ahead = sum(self.issued.values())
        assert ahead >= 1, f"none of the {len(self.issued)} reads was issued before its tensor's unpack"


def test_a_read_given_a_call_runs_it_on_the_stores_threads_first_and_fails_with_its_error(tmp_path):
    """``NvmeStore.read(after=)``: the caller queues a read behind a write still under way."""
    src, dst = torch.arange(8192, dtype=torch.int32).view(torch.uint8), torch.zeros(32768, dtype=torch.uint8)
    gate, threads = threading.Event(), []
    with NvmeStore(tmp_path, capacity=1 << 20) as store:
        written = store.write("k", src, after=gate.wait)

        def after_the_write() -> None:
            threads.append(threading.current_thread().name)
            written.result()

        read = store.read("k", dst, after=after_the_write)
        assert not read.done()  # the write waits for the gate, the read for the write
        gate.set()
        read.result()
        assert torch.equal(dst, src) and threads and all(name.startswith("nvme") for name in threads), threads
        with pytest.raises(ZeroDivisionError):
            store.read("k", dst, after=lambda: 1 / 0).result()


def test_an_unpack_by_hand_waits_only_for_its_own_read_issued_when_backward_reached_the_block_before(tmp_path, monkeypatch):
    """Three swap_nvme blocks of two tensors, unpacked in backward order: the first block backward
    reaches reads its own tensors at its first unpack, and from then on each block's reads are
    issued before any of its unpacks (when backward reached the block after it); every tensor
    comes back with its bytes, under the race check."""
    books = ReadBooks().install(monkeypatch)
    tensors = [torch.randn(n) for n in (3000, 2000, 2500, 1500, 1800, 2200)]
    with EmulatedDevice(capacity=1 << 20, race_check=RaceCheck(seed=5)) as device, NvmeStore(tmp_path, capacity=1 << 20) as store:
        # a slab with room for every read from the start: whether a read goes ahead depends on nothing else
        swap = ActivationSwap(device, store, is_parameter=lambda t: False, host_limit=1 << 20, host_capacity=1 << 18)
        for _ in range(2):
            swap.begin_forward()
            packed = []
            for block in range(3):
                with swap.hooks(block, "swap_nvme"):
                    packed += [swap._pack(block, "swap_nvme", t) for t in tensors[2 * block : 2 * block + 2]]
            back = [swap._unpack(p) for p in reversed(packed)][::-1]
            assert all(torch.equal(a, b) for a, b in zip(back, tensors))
        swap.close()
    books.assert_read_ahead()
    assert len(books.issued) == 12 and sum(books.issued.values()) == 10, books.issued  # per step, all but block 2's first
    assert {w.thread for w in books.waits} == {threading.current_thread().name}


@pytest.mark.slow
def test_swap_nvme_backward_reads_ahead_on_the_stores_threads_and_trains_as_plain(tmp_path, monkeypatch):
    """Every block's activations to NVMe, under the race check: backward's reads run on the
    store's threads, issued ahead of their tensors' unpacks, autograd's thread waiting in each
    unpack only for its own tensor's read; losses and weights are plain Lightning's, bit for bit."""
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2)
    monkeypatch.setenv(RACE_CHECK_ENV, "19")
    books, seen = ReadBooks().install(monkeypatch), Swapped()
    strategy = TieredStrategy(policy={"name": "auto", "activations": "swap_nvme"}, nvme_path=tmp_path / "nvme")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2, extra_callbacks=(seen,))
    last = seen.metrics[-1]
    assert last["activations/swapped_nvme_bytes"] > 0 and last["activations/swap_waits"] == 1, last
    books.assert_read_ahead()
    assert sum(books.issued.values()) > len(books.issued) / 2, books.issued  # all but the first block's, mostly
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
