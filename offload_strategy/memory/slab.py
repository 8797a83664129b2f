"""One page-aligned host allocation, pinned for the GPU by registration.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned caching allocator rounds every
request up to a power of two (a 20 GiB request pins 32 GiB), its memory is not page-aligned,
and on a CPU-only build the call raises. An anonymous ``mmap`` is page-aligned (what
``O_DIRECT`` needs), exactly as large as asked, and can be registered with
``cudaHostRegister`` where CUDA exists. The pools in :mod:`.pools` sub-allocate from it.
"""

from __future__ import annotations

import mmap
from typing import Optional

import torch

from ..config import format_bytes
from ..hardware.numa import prefer_node

PAGE_BYTES = mmap.PAGESIZE

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, and mapped
# into the device address space so that DHA views (GPU kernels reading host memory) work.
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02


class _Mapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA before it is unmapped.

    ``torch.frombuffer`` keeps a reference to this object (not a buffer export), so the memory
    must not be unmapped while any tensor view of it lives: calling ``mmap.close`` would leave
    those views dangling. Instead the mapping goes away when its last reference does, and this
    finaliser runs first (``mmap``'s own deallocation is what unmaps), so the driver never
    holds a registration for memory that is gone.
    """

    registered_ptr: Optional[int] = None

    def unregister(self) -> None:
        ptr, self.registered_ptr = self.registered_ptr, None
        if ptr is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))

    def __del__(self) -> None:
        try:
            self.unregister()
        except Exception:  # interpreter shutdown or a dead CUDA context: nothing left to pin
            pass


def _not_inherited(mapping: mmap.mmap) -> None:
    """A process forked later (a DataLoader worker: Lightning starts them after set-up) gets no
    copy of the slab: Linux copies pinned anonymous pages into the child at fork (since 5.9;
    before, the parent's next write moved its page while the GPU went on copying into the
    child's), tens of GB per worker. No child uses the slab; one that read it would fault."""
    try:
        mapping.madvise(mmap.MADV_DONTFORK)
    except (AttributeError, OSError):  # not Linux: fork copies nothing pinned there
        pass


def _map(nbytes: int, shared_fd: Optional[int]) -> _Mapping:
    """The slab's mapping: anonymous, or of the file ``shared_fd``; huge pages asked for, not
    inherited at fork, no page touched yet."""
    try:
        if shared_fd is None:
            mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            mapping = _Mapping(shared_fd, nbytes, flags=mmap.MAP_SHARED)
    except OSError as err:
        raise MemoryError(
            f"HostSlab could not map {format_bytes(nbytes)} ({nbytes} bytes) of host memory: {err}. "
            f"Lower the host budget or free host memory."
        ) from err
    try:
        # Fewer, larger pages: faster to fault in and to register, fewer TLB misses.
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no transparent huge pages here: 4 KiB pages work too
        pass
    _not_inherited(mapping)
    return mapping


class HostSlab:
    """One page-aligned host allocation of exactly ``nbytes`` (anonymous mmap), pinned with
    ``torch.cuda.cudart().cudaHostRegister`` where CUDA exists — never PyTorch's power-of-two
    pinned allocator.

    Processes forked after it is made do not inherit it (``MADV_DONTFORK``).

    Every page is faulted in at creation, in parallel over torch's intra-op threads, so that
    training never waits on the OS for a first touch. Given the GPU's NUMA node (``numa_node``),
    the mapping prefers that node before the first touch (``hardware/numa.py``), so the pages do
    not land on whichever socket a faulting thread runs; ``bound_node`` says whether that worked.
    ``pin=False``, a build without CUDA, or ``nbytes == 0`` give an unpinned slab (``pinned`` is False); code that needs pinned memory
    checks ``pinned``.

    ``close()`` (or leaving a ``with`` block) unregisters the memory and drops the slab's hold
    on the mapping. The mapping itself is unmapped when the last tensor viewing it is gone, so
    a view that outlives ``close()`` stays valid (unpinned) instead of pointing at freed memory.
    Fence outstanding asynchronous copies before closing.
    """

    def __init__(
        self, nbytes: int, pin: bool = True, shared_fd: Optional[int] = None, fault_in: bool = True, numa_node: Optional[int] = None,
    ) -> None:
        """``shared_fd``: map this file (every process mapping it sees the same bytes) instead of
        anonymous memory; ``fault_in``: back every page now (the file's first mapper does);
        ``numa_node``: the node the pages should come from (None or -1: no preference)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"HostSlab(nbytes={nbytes!r}): give a whole number of bytes >= 0.")
        if numa_node is not None and (isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < -1):
            raise ValueError(f"HostSlab(numa_node={numa_node!r}): give a NUMA node number >= 0, or None (or -1) for no preference.")
        self.nbytes = nbytes
        self.pinned = False
        self.bound_node: Optional[int] = None  # the node the mapping prefers, where binding it worked
        self._closed = False
        self._shared = shared_fd is not None
        self._mapping: Optional[_Mapping] = None
        if nbytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        mapping = _map(nbytes, shared_fd)
        self._mapping = mapping
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        if numa_node is not None and numa_node >= 0 and prefer_node(self.tensor.data_ptr(), nbytes, numa_node):
            self.bound_node = numa_node  # before any page is touched: a page keeps the node it first landed on
        if fault_in:  # a write to one byte per page makes the kernel back every page now
            self.tensor[::PAGE_BYTES].fill_(0)
        if pin and torch.cuda.is_available():
            self._register(mapping)

    def _register(self, mapping: _Mapping) -> None:
        ptr, nbytes = self.tensor.data_ptr(), self.nbytes
        status = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_FLAGS))
        if status != 0:
            self.close()
            raise RuntimeError(
                f"cudaHostRegister of {format_bytes(nbytes)} ({nbytes} bytes) at {ptr:#x} failed with "
                f"cudaError {status}. The pinned-memory limit (ulimit -l) or host memory may be too small: "
                f"lower the host budget, or pass pin=False to use pageable memory."
            )
        mapping.registered_ptr = ptr
        self.pinned = True

    def release(self, view: torch.Tensor) -> int:
        """Give the pages that lie wholly inside ``view`` (a view of this slab) back to the system,
        their contents gone: for memory about to be freed with the slab whose values were copied
        out first. Only an anonymous, unpinned slab's: a pinned page stays pinned (and resident)
        until the slab is unregistered, a shared one stays in its file. The bytes given back."""
        if self._mapping is None or self.pinned or self._shared or view.numel() == 0:
            return 0
        base = self.tensor.data_ptr()
        start = view.data_ptr() - base
        end = start + view.numel() * view.element_size()
        if start < 0 or end > self.nbytes:
            raise ValueError(f"release: the view (bytes {start} to {end}) is not inside this slab of {self.nbytes} bytes.")
        first, last = -(-start // PAGE_BYTES) * PAGE_BYTES, end // PAGE_BYTES * PAGE_BYTES
        if last <= first:
            return 0
        self._mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        return last - first

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unregister from CUDA and release the mapping; safe to call more than once."""
        mapping, self._mapping = self._mapping, None
        self._closed = True
        self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if mapping is not None:
            # Dropping our last reference unmaps now, unless a view of the tensor is alive.
            mapping.unregister()

    def __enter__(self) -> "HostSlab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self.pinned else "pageable")
        return f"HostSlab({format_bytes(self.nbytes)}, {state})"
