"""Host memory for swapped activations: one slab of exactly what a step's swaps hold, within a hard limit.

Why not ``torch.empty(pin_memory=True)`` per saved tensor: PyTorch's caching host allocator rounds
each request up to a power of two and never gives memory back, so the swap's host use could reach
twice its limit, and the first step paid a ``cudaHostAlloc`` per tensor. Here every buffer is a view
of one :class:`~offload_strategy.memory.slab.HostSlab` (pinned by registration, page-aligned, as
large as asked), handed out first-fit:

- a ``swap_host`` copy is *held* until the next training forward starts (``new_step``);
- a ``swap_nvme`` copy's buffer is *staging*: given back once its NVMe write, or its copy into the
  GPU tier, is done (``give_back_after``), so NVMe swaps hold only what is in flight.

A step whose swaps do not fit the slab takes what is missing as slabs of their own (exactly the
request, page-rounded), while the slab and those stay within ``limit``; beyond it ``take`` says no
(the swap then sends the tensor to NVMe or keeps it in the GPU tier). The next step's slab is the
most any step held at once: so from the second step on the swap's host memory is one slab of what
the layout swaps, never more than ``limit``.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...config import format_bytes
from ...memory.slab import PAGE_BYTES, HostSlab
from ...planning.placement import align

# every buffer starts at a multiple of this (a cache line: copies in and out run at full speed)
HELD_ALIGNMENT = 64


@dataclass
class _Pending:
    """A buffer given back once ``done()`` says its last user finished (``wait()`` blocks for it):
    the span ``start``-``end`` of the slab, or the slab of its own at address ``extra``."""

    start: int
    end: int
    extra: Optional[int]
    done: Callable[[], bool]
    wait: Callable[[], object]


def _counted(nbytes: int) -> int:
    return align(nbytes, HELD_ALIGNMENT)


class SwapMemory:
    """See the module docstring. ``limit``: the most host memory the swap may hold (None: no bound);
    ``capacity``: the slab's first size (the layout's swapped bytes where known, else 0: the first
    step measures them); ``pin``: register the slabs for the GPU's copies; ``numa_node``: the
    GPU's NUMA node, which the slabs' pages come from (None: no preference)."""

    def __init__(self, limit: Optional[int], capacity: int = 0, pin: bool = False, numa_node: Optional[int] = None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"SwapMemory: limit={limit} must be a number of bytes >= 0, or None for no bound.")
        self.limit = limit
        self.pin = pin
        self.numa_node = numa_node
        self.slab = HostSlab(self._bounded(max(capacity, 0)), pin=pin, numa_node=numa_node)
        self._free: list[tuple[int, int]] = [(0, self.slab.nbytes)] if self.slab.nbytes else []  # sorted gaps [start, end)
        self._pending: deque[_Pending] = deque()
        self._extra: dict[int, HostSlab] = {}  # slabs of their own for what the slab could not hold, by address
        self._high = 0  # the end of the highest span of the slab handed out this step
        self.peak = 0  # the most the slab's spans reached, with the slabs of their own beside them, since it was sized

    @property
    def held_bytes(self) -> int:
        """Host memory the swap holds: the slab and the slabs of their own taken beside it."""
        return self.slab.nbytes + sum(s.nbytes for s in self._extra.values())

    def _bounded(self, nbytes: int) -> int:
        return nbytes if self.limit is None else min(nbytes, self.limit)

    def contains(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` lies in the slab."""
        base = self.slab.tensor.data_ptr()
        return self.slab.nbytes > 0 and base <= buffer.data_ptr() and buffer.data_ptr() + buffer.numel() <= base + self.slab.nbytes

    def owns(self, buffer: torch.Tensor) -> bool:
        """Whether :meth:`take` handed ``buffer`` out (from the slab or as a slab of its own)."""
        return self.contains(buffer) or buffer.data_ptr() in self._extra

    # -- handing out -----------------------------------------------------------------------------------

    def take(self, nbytes: int, staging: bool = False, wait: bool = True) -> Optional[torch.Tensor]:
        """A uint8 buffer of ``nbytes``: from the slab (waiting for staging buffers still in use
        where that makes room), else a slab of its own within the limit; None beyond the limit.
        ``staging``: page-aligned, for NVMe's direct reads and writes. ``wait=False`` (a read
        ahead): no wait, and while staging buffers are still in use no slab of its own either
        (they will make room): None, to ask again later."""
        alignment = PAGE_BYTES if staging else HELD_ALIGNMENT
        start = self._fit(nbytes, alignment)
        while start is None and wait and self._pending:
            self._settle(self._pending.popleft())
            start = self._fit(nbytes, alignment)
        if start is not None:
            self._high = max(self._high, start + _counted(nbytes))
            buffer = self.slab.tensor[start : start + nbytes]
        elif (self._pending and not wait) or (self.limit is not None and self.held_bytes + nbytes > self.limit):
            return None
        else:
            extra = HostSlab(nbytes, pin=self.pin, numa_node=self.numa_node)
            self._extra[extra.tensor.data_ptr()] = extra
            buffer = extra.tensor
        self.peak = max(self.peak, self._high + sum(_counted(s.nbytes) for s in self._extra.values()))
        return buffer

    def _fit(self, nbytes: int, alignment: int) -> Optional[int]:
        """First fit among the gaps (taken out of them), or None."""
        self._settle_done()
        base = self.slab.tensor.data_ptr() if self.slab.nbytes else 0
        for i, (lo, hi) in enumerate(self._free):
            start = align(base + lo, alignment) - base
            end = start + _counted(nbytes)
            if end <= hi:
                self._free[i : i + 1] = [gap for gap in ((lo, start), (end, hi)) if gap[1] > gap[0]]
                return start
        return None

    # -- giving back -----------------------------------------------------------------------------------

    def give_back_after(self, buffer: torch.Tensor, done: Callable[[], bool], wait: Callable[[], object]) -> None:
        """``buffer`` (a staging buffer from :meth:`take`) is free once ``done()``; ``wait()`` blocks until it is."""
        address = buffer.data_ptr()
        if address in self._extra:  # a slab of its own: let go once done
            self._pending.append(_Pending(-1, -1, address, done, wait))
            return
        start = address - self.slab.tensor.data_ptr()
        self._pending.append(_Pending(start, start + _counted(buffer.numel()), None, done, wait))

    def _settle_done(self) -> None:
        while self._pending and self._pending[0].done():
            self._settle(self._pending.popleft())

    def _settle(self, pending: _Pending) -> None:
        pending.wait()  # at once where done: the host's wait, which a race check books
        if pending.extra is not None:
            self._extra.pop(pending.extra, None)
        else:
            self._release(pending.start, pending.end)

    def _release(self, start: int, end: int) -> None:
        i = bisect.bisect(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:  # merge with the gap after
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # ... and the one before
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))

    def new_step(self) -> None:
        """A training forward starts; every buffer of the last step is free (the caller waited for
        the copies out of the held ones). The slab becomes the most the last steps held at once,
        within the limit, where that is more than it holds."""
        while self._pending:
            self._settle(self._pending.popleft())
        self._extra.clear()
        need = self._bounded(self.peak)
        if need > self.slab.nbytes:
            self.slab.close()
            self.slab = HostSlab(need, pin=self.pin, numa_node=self.numa_node)
        self._free = [(0, self.slab.nbytes)] if self.slab.nbytes else []
        self._high = 0

    def close(self) -> None:
        while self._pending:
            self._settle(self._pending.popleft())
        self._extra.clear()
        self.slab.close()
        self._free = []

    def __repr__(self) -> str:
        return f"SwapMemory({format_bytes(self.held_bytes)} held, peak {format_bytes(self.peak)}, limit {self.limit})"
