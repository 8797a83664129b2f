"""Swapping a block's saved activations out of the GPU tier and back ahead of its backward.

Inside a swap block's forward, saved-tensor hooks (ProTrain §3.1.2's activation swapping; the
offload side of LoHan §IV-B) hand every tensor autograd saves for backward to this class:

- a tensor that is, or views, a parameter stays where it is (the engine re-fetches parameters by
  itself; an activation swap must never copy a weight);
- a tensor smaller than ``MIN_SWAP_BYTES`` stays (the copy would cost more than it frees);
- any other tensor is copied to host memory asynchronously and the GPU-tier original is let go; a
  ``swap_nvme`` block's copies continue from host memory to the NVMe store, written by the store's
  threads once each copy has landed (the pack hook never waits for a copy), and their host
  buffers are let go once written. Host memory holds at most ``host_limit`` bytes of swapped activations
  per step: beyond it a ``swap_host`` tensor goes on to NVMe when there is a store, and otherwise
  stays in the GPU tier (counted in ``stats.host_full_bytes``).

Every host buffer is a view of the swap's own slab (:class:`~.swap_memory.SwapMemory`): exactly
what a step's swaps hold, never more than ``host_limit``, instead of PyTorch's pinned caching
allocator (powers of two, never given back). An NVMe copy's buffer is lent only while its write,
or in backward its read and copy into the GPU tier, is under way.

Backward unpacks a block's tensors in reverse order. The first unpack of a block brings back all of
that block's tensors (unless they were brought back ahead) and starts bringing back the next swap
block's (prefetch by block order), so later unpacks, and the next block's, find their tensors
already in the GPU tier, or on their way. A copy in host memory is copied into the GPU tier at
once; one on NVMe is read ahead: its read is queued on the store's threads (which first wait for
its write) into a staging buffer of the swap's host memory, in backward order while that memory
has room without a wait, and each unpack copies into the GPU tier what has been read by then. An
unpack waits on autograd's thread only for its own tensor's read, already issued unless the
window had no room for it.

A swapped run computes exactly what a kept run computes: values are copied bit for bit, and each
tensor comes back with its own strides, since CPU and GPU kernels may add up in another order for
another layout (Qwen2-MoE's experts save the two halves of ``gate_up_proj``'s output, views with
gaps between their rows; brought back contiguous, the gradients differed in the last bits). A
tensor that covers its memory exactly (contiguous, or a transposed or permuted one) is copied as
that memory; views with gaps (``split``, ``chunk``: attention's query, key and value) are copied
as their storage, once for all the block's views of it, and come back as views of one copy.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...config import BlockPolicy
from ...hardware.device import Device, Event
from ...memory.nvme import NvmeSpaceError, NvmeStore
from .swap_memory import SwapMemory

SWAP_HOST, SWAP_NVME = BlockPolicy.SWAP_HOST, BlockPolicy.SWAP_NVME
# Saved tensors below this size stay in the GPU tier.
MIN_SWAP_BYTES = 4096


@dataclass(eq=False)
class _Copy:
    """A span of GPU-tier memory that left it: a tensor's own, or the storage of views with gaps."""

    block: int
    nbytes: int
    host: Optional[torch.Tensor]  # its bytes in host memory (None once written to NVMe)
    to_host: Optional[Event]
    key: Optional[str] = None  # NVMe key
    written: Any = None  # Future of the NVMe write
    back: Optional[torch.Tensor] = None  # its bytes in the GPU tier once brought back
    to_device: Optional[Event] = None
    out_of_host: Optional[Event] = None  # the last copy out of ``host`` into the GPU tier (waited for before it is reused)
    source: Optional[torch.Tensor] = None  # a view of the storage, held until its block's forward ends
    views: int = 0  # saved tensors that lie in it
    unpacked: int = 0  # of them, unpacked in this round (once each, however often a node reads them)
    staging: Optional[torch.Tensor] = None  # an NVMe copy's host buffer its read in backward fills
    read: Optional[Future] = None  # that read, until its tensor's unpack has seen it end
    queued: bool = False  # its read waits for room in the swap's host memory (``_read_ahead``)
    consumed: bool = False  # every view unpacked: its GPU-tier bytes are autograd's alone
    round: int = 0  # rounds of unpacks before this one (a later backward through a kept graph starts one)


@dataclass(eq=False)
class _Swapped:
    """One saved tensor that left the GPU tier: where in its copy it lies, and its layout."""

    copy: _Copy
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of ``dtype`` from the copy's start
    round: int = -1  # the copy's round that last unpacked it

    @property
    def block(self) -> int:
        return self.copy.block

    def view(self) -> torch.Tensor:
        assert self.copy.back is not None
        return self.copy.back.view(self.dtype).as_strided(self.shape, self.stride, self.offset)


def _coming_back(copy: _Copy) -> Event:
    """The copy of ``copy``'s bytes into the GPU tier, started with their buffer there (``_bring_back``)."""
    assert copy.to_device is not None, "a copy brought back has its copy into the GPU tier under way"
    return copy.to_device


def _covers_its_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one span of memory without gaps or overlaps (any order)."""
    return t.is_contiguous() or torch.empty_like(t, device="meta").stride() == t.stride()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first element of ``t``'s storage it reaches, and one past the last (elements of its dtype)."""
    start = int(t.storage_offset())  # an int in eager mode, where saved-tensor hooks run
    return start, start + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1


def _bytes_at(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements ``start`` to ``end`` of ``t``'s storage, as a contiguous 1-D uint8 view of them."""
    return t.detach().as_strided((end - start,), (1,), start).view(torch.uint8)


@dataclass
class SwapStats:
    """Bytes by destination in the last training forward, and how backward found them."""

    kept_bytes: int = 0
    host_bytes: int = 0
    nvme_bytes: int = 0
    prefetched: int = 0
    waited: int = 0  # unpacks that had to fetch synchronously
    wait_seconds: float = 0.0
    host_full_bytes: int = 0  # swap_host tensors kept in the GPU tier: host limit reached, no NVMe store
    blocks: dict[int, list[_Copy]] = field(default_factory=dict)


class ActivationSwap:
    """Saved-tensor hooks for swap blocks; see the module docstring.

    ``is_parameter`` tells whether a saved tensor is or views a parameter; ``outer`` is the pair
    of hooks that would have packed it otherwise (the engine's), or None.
    """

    def __init__(self, device: Device, store: Optional[NvmeStore], is_parameter: Callable[[torch.Tensor], bool], host_limit: Optional[int] = None,
                 host_capacity: int = 0) -> None:
        """``host_capacity``: the host bytes the layout swaps, where known (the slab's first size)."""
        self.device = device
        self.store = store
        self.host_limit = host_limit
        self.memory = SwapMemory(host_limit, host_capacity, pin=device.compute.type == "cuda", numa_node=device.numa_node)
        self.is_parameter = is_parameter
        self.outer: Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = None
        self.stats = SwapStats()
        self._keys = itertools.count()
        self._order: list[int] = []  # swap blocks in the order forward ran them
        # the storages of views with gaps copied in the running block's forward, by address
        self._storages: dict[tuple[int, int], _Copy] = {}
        self._queued: deque[_Copy] = deque()  # NVMe copies whose reads wait for room, in backward order
        self._reading: list[_Copy] = []  # NVMe copies being read ahead, not yet copied into the GPU tier
        self._reading_bytes = 0  # their bytes
        self._nvme_bytes: dict[int, int] = {}  # bytes each block swapped to NVMe this step: the largest is the read-ahead window

    def begin_forward(self) -> None:
        """A training forward starts: what the last step swapped is gone (its backward consumed it)."""
        self._forget_all()
        self.memory.new_step()

    def _forget_all(self) -> None:
        for copies in self.stats.blocks.values():
            for c in copies:
                self._forget(c)
        self.stats = SwapStats()
        self._order = []
        self._queued.clear()
        self._reading, self._reading_bytes, self._nvme_bytes = [], 0, {}

    @contextlib.contextmanager
    def hooks(self, block: int, destination: str) -> Iterator[None]:
        """Saved-tensor hooks for one run of a swap block's forward."""
        if block not in self.stats.blocks:
            self.stats.blocks[block] = []
            self._order.append(block)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(block, destination, t), self._unpack):
                yield
        finally:
            # the storages views were copied from were held so that none of their addresses was
            # reused by another storage (which would have matched) while the block ran
            for copy in self._storages.values():
                copy.source = None
            self._storages.clear()

    def pack_after_forward(self, block: int, destination: str, tensors: list[torch.Tensor]) -> list[Any]:
        """``tensors`` a block's forward saved, swapped out after it ended (the profiled block,
        measured kept, whose layout is chosen from what it saved): as its hooks would have packed
        them, in the order saved; :meth:`unpack` brings each back."""
        with self.hooks(block, destination):
            return [self._pack(block, destination, t) for t in tensors]

    def unpack(self, packed: Any) -> torch.Tensor:
        return self._unpack(packed)

    # -- forward ------------------------------------------------------------------------------------

    def _pack(self, block: int, destination: str, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if self.is_parameter(t):
            return self._keep(t)
        if nbytes < MIN_SWAP_BYTES or t.layout != torch.strided:
            self.stats.kept_bytes += nbytes
            return self._keep(t)
        start, end = _span(t)
        storage = t.untyped_storage()
        whole = storage.nbytes() // t.element_size()
        shared = not _covers_its_memory(t) and 2 * (end - start) >= whole and storage.nbytes() % t.element_size() == 0
        if not shared:  # its own bytes (with the gaps between them, if any)
            copy, offset = self._copy_out(block, destination, _bytes_at(t, start, end)), start
        else:  # a view with gaps over most of its storage: the storage once, for all the block's views of it
            key = (storage.data_ptr(), storage.nbytes())
            copy, offset = self._storages.get(key), 0
            if copy is None:
                copy = self._copy_out(block, destination, _bytes_at(t, 0, whole))
                if copy is not None:
                    copy.source = t
                    self._storages[key] = copy
        if copy is None:
            self.stats.kept_bytes += nbytes
            return self._keep(t)
        copy.views += 1
        return _Swapped(copy, t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()) - offset)

    def _keep(self, t: torch.Tensor) -> Any:
        return ("outer", self.outer[0](t)) if self.outer else t

    def _copy_out(self, block: int, destination: str, memory: torch.Tensor) -> Optional[_Copy]:
        """Start copying ``memory`` (1-D bytes) out of the GPU tier; None where it must stay."""
        nbytes = memory.numel()
        to = self._destination(destination, nbytes)
        host = self.memory.take(nbytes, staging=to == SWAP_NVME) if to else None
        if host is None and to == SWAP_HOST and self.store is not None:  # the swap's host memory is full
            to = SWAP_NVME
            host = self.memory.take(nbytes, staging=True)
        if host is None and to == SWAP_NVME:
            # held swap_host copies fill the limit: one pageable buffer of the tensor's size, written at once
            host = torch.empty(nbytes, dtype=torch.uint8)
        if host is None:
            self.stats.host_full_bytes += nbytes
            return None
        copy = _Copy(block, nbytes, host, self.device.copy_to_host(host, memory))
        if to == SWAP_NVME:
            if not self._write_out(copy, destination):
                return None
        else:
            self.stats.host_bytes += nbytes
        self.stats.blocks[block].append(copy)
        return copy

    def _destination(self, requested: str, nbytes: int) -> str:
        """Where a tensor of a ``requested`` block goes: NVMe, host memory, or nowhere ("": it stays)."""
        if requested == SWAP_NVME and self.store is not None:
            return SWAP_NVME
        if self.host_limit is None or self.stats.host_bytes + nbytes <= self.host_limit:
            return SWAP_HOST
        return SWAP_NVME if self.store is not None else ""

    def _write_out(self, copy: _Copy, requested: str) -> bool:
        """``copy``'s bytes on from its host buffer to the NVMe store; the buffer is given back
        once written. False where the store is full and the tensor may stay in the GPU tier."""
        assert self.store is not None and copy.to_host is not None and copy.host is not None, "an NVMe copy has a store and a host buffer"
        host, to_host = copy.host, copy.to_host
        copy.to_host, copy.host = None, None
        key = f"activation{next(self._keys)}"
        try:
            # the store's threads wait for the copy, then write: the pack hook only queues both
            # (backward's unpack waits for the write)
            written = self.store.write(key, host, after=functools.partial(self.device.host_wait, to_host))
        except NvmeSpaceError:
            self.device.host_wait(to_host)  # the buffer goes: not while the copy may still write it
            if self.memory.owns(host):
                self.memory.give_back_after(host, lambda: True, lambda: None)
            if requested == SWAP_NVME:
                raise
            self.stats.host_full_bytes += copy.nbytes  # over host memory and the NVMe budget: it stays
            return False
        if self.memory.owns(host):
            self.memory.give_back_after(host, written.done, written.exception)  # exception() waits for it
        else:
            written.exception()  # the pageable buffer beyond the limit: one at a time
        copy.written, copy.key = written, key
        self.stats.nvme_bytes += copy.nbytes
        self._nvme_bytes[copy.block] = self._nvme_bytes.get(copy.block, 0) + copy.nbytes
        return True

    # -- backward -----------------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "outer":
            assert self.outer is not None, "packed by the outer hooks, which stay once set (``_keep``)"
            return self.outer[1](packed[1])
        if not isinstance(packed, _Swapped):
            return packed
        copy = packed.copy
        if copy.consumed:  # every view was unpacked: a later backward through a kept graph (or a node reading again) fetches it again
            copy.consumed, copy.unpacked, copy.round = False, 0, copy.round + 1
        ahead = copy.back is not None or copy.queued or copy.read is not None
        start = time.perf_counter()
        # this block and the next one backward reaches: idempotent, so the first unpack of a
        # block brought back ahead starts the next one's, as a waited one's does
        self._bring_back(packed.block)
        self._prefetch_below(packed.block)
        self._launch_landed()
        self._read_ahead()
        self._land(copy)
        self.device.wait(_coming_back(copy))
        if ahead:
            self.stats.prefetched += 1
        else:
            self.stats.waited += 1
            self.stats.wait_seconds += time.perf_counter() - start
        view = packed.view()
        if packed.round != copy.round:  # a node reading its saved tensors twice unpacks them twice: counted once
            packed.round = copy.round
            copy.unpacked += 1
        if copy.unpacked >= copy.views:
            # autograd holds the views now; letting go of the copy frees the GPU tier when it is done
            copy.back, copy.to_device, copy.consumed = None, None, True
        return view

    def _bring_back(self, block: int) -> None:
        """Start bringing ``block``'s copies back: those in host memory are copied into the GPU
        tier now, those on NVMe join the reads ahead (in backward order: last saved first)."""
        for c in reversed(self.stats.blocks.get(block, [])):
            if c.back is not None or c.consumed or c.queued or c.read is not None:
                continue
            if c.key is not None:
                c.queued = True
                self._queued.append(c)
                continue
            c.back = torch.empty(c.nbytes, dtype=torch.uint8, device=self.device.compute)
            if c.to_host is not None:
                self.device.host_wait(c.to_host)
                c.to_host = None
            assert c.host is not None, "a copy loses its host bytes only when forgotten (``begin_forward``), after which no block lists it"
            c.to_device = c.out_of_host = self.device.copy_to_device(c.back, c.host)

    def _read_ahead(self) -> None:
        """Queue the waiting NVMe reads, in backward order, each into a staging buffer of the
        swap's host memory, while the reads not yet copied into the GPU tier hold less than the
        read-ahead window (the most one block swapped to NVMe: the block after the one backward
        is in, while it runs) and the swap's host memory has room without a wait, within its
        limit; the rest wait for a later unpack, or are read by their own."""
        window = max(self._nvme_bytes.values(), default=0)
        while self._queued and (not self._reading or self._reading_bytes + self._queued[0].nbytes <= window):
            staging = self.memory.take(self._queued[0].nbytes, staging=True, wait=False)
            if staging is None:
                return
            self._issue_read(self._queued.popleft(), staging)

    def _issue_read(self, c: _Copy, buffer: torch.Tensor) -> None:
        """The store's threads wait for ``c``'s write, then read it into ``buffer``; the caller
        only queues both (the key stays until the next forward: a backward through a kept graph
        reads it again)."""
        assert self.store is not None and c.key is not None and c.written is not None, "a key is given only where there is a store (``_write_out``)"
        self.device.check_host_access(buffer, "reads a swapped activation from NVMe into a staging buffer")
        c.queued, c.staging = False, buffer
        c.read = self.store.read(c.key, buffer, after=c.written.result)
        self._reading.append(c)
        self._reading_bytes += c.nbytes

    def _launch_landed(self) -> None:
        """Copy into the GPU tier what the reads ahead have finished reading, without waiting
        for the others (a failed read's error is raised by its tensor's unpack)."""
        landed = [c for c in self._reading if c.read is not None and c.read.done()]
        for c in landed:
            self._launch(c)

    def _land(self, c: _Copy) -> None:
        """``c``'s copy into the GPU tier under way: an NVMe copy's read (issued now where the
        window had no room for it) waited for, its copy launched."""
        if c.back is None and c.key is not None:
            if c.queued:
                self._queued.remove(c)
                self._issue_read(c, self._staging_now(c.nbytes))
            assert c.read is not None, "an NVMe copy not back is queued or being read (``_bring_back``)"
            c.read.result()
            self._launch(c)
        if c.read is not None:
            read, c.read = c.read, None
            read.result()  # a read launched ahead: raise its error, if any

    def _staging_now(self, nbytes: int) -> torch.Tensor:
        """A staging buffer for a read its unpack needs now: waiting for room in the swap's host
        memory, or (held swap_host copies fill the limit) a pageable one, freed once copied."""
        staging = self.memory.take(nbytes, staging=True)
        return staging if staging is not None else torch.empty(nbytes, dtype=torch.uint8)

    def _launch(self, c: _Copy) -> None:
        """The copy of ``c``'s read bytes into the GPU tier; its staging buffer is given back
        once that copy is done."""
        buffer, c.staging = c.staging, None
        assert buffer is not None, "a copy launched has been read into a staging buffer (``_issue_read``)"
        self._reading.remove(c)
        self._reading_bytes -= c.nbytes
        c.back = torch.empty(c.nbytes, dtype=torch.uint8, device=self.device.compute)
        to_device = c.to_device = self.device.copy_to_device(c.back, buffer)
        if self.memory.owns(buffer):
            self.memory.give_back_after(buffer, to_device.done, lambda: self.device.host_wait(to_device))
        else:  # the pageable buffer is freed on return: the copy has read it first (as CUDA's from pageable memory has)
            self.device.host_wait(to_device)

    def _prefetch_below(self, block: int) -> None:
        """Start bringing back the swap block that backward reaches next."""
        position = self._order.index(block) if block in self._order else -1
        if position > 0:
            self._bring_back(self._order[position - 1])

    def _forget(self, c: _Copy) -> None:
        if c.read is not None:
            c.read.exception()  # the read may still write its staging buffer, which the next step reuses
        c.read, c.staging, c.queued = None, None, False
        if c.key is not None and self.store is not None:
            if c.written is not None:
                c.written.exception()  # wait; a failed write is moot once the tensor is not needed
            self.store.delete(c.key)
            c.key = None
        for event in (c.to_host, c.out_of_host):  # the host buffer is reused next step: no copy may still use it
            if event is not None:
                self.device.host_wait(event)
        c.host = c.back = c.source = c.to_host = c.out_of_host = None

    def close(self) -> None:
        self._forget_all()
        self.memory.close()
