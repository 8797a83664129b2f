"""Pinned host memory for gradients the placement did not plan: the homes of parameters unfrozen
after set-up in units that had none (a finetuning callback, ``requires_grad_(True)`` in a hook or
a training step), and gradient buffers taken beyond the plan's (``runtime/grads/buffers.py``).

A copy out of the GPU tier into pageable memory is synchronous on CUDA (the host waits for
everything queued before it, and no copy overlaps it), so these are pinned as the slab is: slabs
of their own (:class:`~offload_strategy.memory.slab.HostSlab`, exactly as large as asked, pinned
by registration), made when first needed and kept for reuse once given back.

They count against the host budget (``host_memory``), not the runtime's allowance: a backbone's
gradients can be GBs. ``room`` says what the budget leaves beside the placement's host bytes, the
activations' swaps and the saved values of speculative updates (the core sets it; None: no
budget, an engine built by hand); a request beyond it raises :class:`PlacementError` with the
numbers. The engine counts what is held in its host bytes (``TieredEngine.host_bytes_held``).
Late homes are held until the engine is replaced: the step that unfroze the parameters is
followed by a placement that plans their gradients in the slab (``PlanSession.after_step``).
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Callable, Optional

import torch

from ...config import format_bytes
from ...memory.slab import HostSlab
from ...planning.placement import HOST, PlacementError

log = logging.getLogger(__name__)


class PastRoom(enum.Enum):
    """What a request past the host budget's room does."""

    REFUSE = enum.auto()  # a late-unfrozen home: the user can unfreeze before fit instead
    WARN = enum.auto()  # a buffer beyond the pool: gradients waiting for their reductions must land somewhere
    IGNORE = enum.auto()  # the update worker failed: the run is stopping


class GradientOverflow:
    """See the module docstring. ``pin``: register the slabs for the GPU's copies; ``numa_node``:
    the node their pages come from (the GPU's; None for no preference)."""

    def __init__(self, pin: bool, numa_node: Optional[int] = None) -> None:
        self.pin = pin
        self.numa_node = numa_node
        self.room: Callable[[], Optional[int]] = lambda: None
        self._slabs: dict[int, HostSlab] = {}  # address -> slab, every one held
        self._free: list[HostSlab] = []  # given back, for the next request they hold
        self._lock = threading.Lock()
        self._warned = False  # past the room once already (buffers beyond the pool): said once

    @property
    def nbytes(self) -> int:
        """Host bytes held (given back or not: kept for reuse until the engine closes)."""
        with self._lock:
            return sum(slab.nbytes for slab in self._slabs.values())

    def take(self, nbytes: int, what: str, past_room: PastRoom = PastRoom.REFUSE) -> torch.Tensor:
        """``nbytes`` of pinned host memory (1-D uint8) for ``what`` (said in an error or a
        warning); past ``room``, as ``past_room`` says."""
        with self._lock:
            slab = self._reuse(nbytes)
        if slab is None:
            room = self.room() if past_room is not PastRoom.IGNORE else None  # outside the lock: it may read ``nbytes``
            with self._lock:
                self._check_room(nbytes, what, room, past_room)
                slab = HostSlab(nbytes, pin=self.pin, numa_node=self.numa_node)
                self._slabs[slab.tensor.data_ptr()] = slab
        return slab.tensor[:nbytes]

    def _reuse(self, nbytes: int) -> Optional[HostSlab]:
        """The smallest slab given back that holds ``nbytes``, taken off the free list."""
        fitting = [slab for slab in self._free if slab.nbytes >= nbytes]
        if not fitting:
            return None
        slab = min(fitting, key=lambda s: s.nbytes)
        self._free.remove(slab)
        return slab

    def _check_room(self, nbytes: int, what: str, room: Optional[int], past_room: PastRoom) -> None:
        held = sum(slab.nbytes for slab in self._slabs.values())
        if room is None or held + nbytes <= room:
            return
        said = (
            f"{what} need {format_bytes(nbytes)} of pinned host memory the placement did not plan, beside "
            f"{format_bytes(held)} already taken so; host_memory leaves {format_bytes(max(room, 0))} beside the placement, the "
            f"activations' swaps and speculative updates' saved values. Raise host_memory by at least "
            f"{format_bytes(held + nbytes - room)}"
        )
        if past_room is PastRoom.REFUSE:
            raise PlacementError(f"{said}, or make the parameters trainable before fit (the placement then plans their gradients).", tier=HOST)
        if not self._warned:
            self._warned = True
            log.warning("tiered: %s to keep the process within it; taken all the same (gradients waiting for their reductions).", said)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory taken from here."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(slab.tensor.data_ptr() <= start and end <= slab.tensor.data_ptr() + slab.nbytes for slab in self._slabs.values())

    def give_back(self, tensor: torch.Tensor) -> bool:
        """``tensor`` (what ``take`` returned) is free for another request; False where it was not taken from here."""
        with self._lock:
            slab = self._slabs.get(tensor.untyped_storage().data_ptr())
            if slab is None:
                return False
            if slab not in self._free:
                self._free.append(slab)
            return True

    def close(self) -> None:
        """Every copy into the slabs has completed (the engine synchronised the device first)."""
        with self._lock:
            slabs, self._slabs, self._free = list(self._slabs.values()), {}, []
        for slab in slabs:
            slab.close()
