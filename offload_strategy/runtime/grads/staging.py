"""Where a later micro-batch's gradient lands in host memory before the update worker adds it at
home: a few pieces of pinned memory, made at the first micro-batch that accumulates.

Autograd's thread only queues the copy out of the GPU tier into a piece and the add behind it on
the worker; the worker waits for the copy, adds, and gives the piece back. A gradient larger than
a piece goes in pieces, so the memory stays a few pieces whatever the model (a copy into pageable
memory, as ``grad.to("cpu")`` makes, would wait on the host for everything queued before it).
With every piece in use, autograd's thread waits for the worker to give one back.

The pieces (at most ``PIECES * PIECE_BYTES``, 32 MiB) are not in the placement's host budget: the
planner does not know whether a run accumulates. They are within ``RUNTIME_HOST_ALLOWANCE``'s room.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from ...memory import HostSlab
from ...planning.placement import HOST_SLOT_ALIGNMENT, align

# Each piece holds up to this many bytes of one gradient; a copy this size crosses PCIe in a
# fraction of a millisecond, and the worker adds one while the next crosses.
PIECE_BYTES = 8 << 20
PIECES = 4


class AccumulationStaging:
    """The pieces, for gradients of at most ``largest`` bytes (in pinned memory where ``pin``, on
    ``numa_node`` where given)."""

    def __init__(self, largest: int, pin: bool, numa_node: Optional[int] = None) -> None:
        self.numa_node = numa_node
        self.piece_bytes = align(max(1, min(largest, PIECE_BYTES)), HOST_SLOT_ALIGNMENT)
        self.pin = pin
        self._slab: Optional[HostSlab] = None
        self._free: list[torch.Tensor] = []
        self._changed = threading.Condition()
        self.extra = 0  # pieces made beyond the few, while the worker that gives them back had failed
        # set by the updater: its worker failed, and skips the adds that would give pieces back
        self.worker_failed: Callable[[], bool] = lambda: False

    def elements_per_piece(self, dtype: torch.dtype) -> int:
        return self.piece_bytes // dtype.itemsize

    def acquire(self) -> torch.Tensor:
        """A free piece (1-D uint8 of ``piece_bytes``); waits while the worker holds every one."""
        with self._changed:
            if self._slab is None:
                self._slab = HostSlab(self.piece_bytes * PIECES, pin=self.pin, numa_node=self.numa_node)
                self._free = [self._slab.tensor[k * self.piece_bytes : (k + 1) * self.piece_bytes] for k in range(PIECES)]
            while not self._free and not self.worker_failed():
                self._changed.wait(timeout=0.05)
            if self._free:
                return self._free.pop()
            self.extra += 1
            return torch.empty(self.piece_bytes, dtype=torch.uint8)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in the pieces' slab."""
        slab = self._slab
        if slab is None or slab.closed:
            return False
        start, base = tensor.data_ptr(), slab.tensor.data_ptr()
        return base <= start and start + tensor.numel() * tensor.element_size() <= base + slab.nbytes

    def release(self, piece: torch.Tensor) -> None:
        with self._changed:
            slab = self._slab
            if slab is not None and not slab.closed and piece.untyped_storage().data_ptr() == slab.tensor.untyped_storage().data_ptr():
                self._free.append(piece)
                self._changed.notify_all()

    def close(self) -> None:
        """Every copy into a piece has completed (the engine synchronised the device first)."""
        with self._changed:
            slab, self._slab, self._free = self._slab, None, []
        if slab is not None:
            slab.close()
