"""Fixed-size slots carved once from one buffer, reused for every swap (10Cache §3.3.1, Fig. 5).

Allocating pinned (or device) memory during training is slow and fragments memory; 10Cache
allocates one contiguous block before training, cuts it into buffers whose sizes follow the
model's tensor sizes, and keeps a free list per size. Acquire and release here are a list pop
and push under a lock: no OS call, no torch allocation, no new storage.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import format_bytes
from ..planning.searches.buffer_counts import SizeClass


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(eq=False)
class Slot:
    """One buffer of a :class:`SlotPool`: ``tensor`` is a uint8 view of exactly ``slot_bytes``
    starting ``offset`` bytes into the pool's backing tensor. Compared by identity."""

    slot_bytes: int
    offset: int
    tensor: torch.Tensor

    def view(self, dtype: torch.dtype, shape: Sequence[int], byte_offset: int = 0) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` over the slot's memory from ``byte_offset`` on (no copy)."""
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Slot.view: shape {shape} has a negative dimension.")
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if byte_offset < 0 or byte_offset + nbytes > self.slot_bytes:
            raise ValueError(
                f"Slot.view: a {dtype} tensor of shape {shape} needs {nbytes} bytes at byte_offset {byte_offset}, "
                f"but the slot holds {self.slot_bytes} bytes; acquire a slot of at least {byte_offset + nbytes} bytes."
            )
        start = self.tensor.storage_offset() + byte_offset
        if start % itemsize:
            raise ValueError(
                f"Slot.view: {dtype} needs {itemsize}-byte alignment, but the view would start at byte {start} of "
                f"the backing storage (slot offset {self.offset}, byte_offset {byte_offset}); use a byte_offset "
                f"that is a multiple of {itemsize}."
            )
        return self.tensor[byte_offset : byte_offset + nbytes].view(dtype).view(shape)


class PoolExhausted(RuntimeError):
    """No free slot can hold the request: release slots first, or plan a larger pool."""


class SlotPool:
    """Fixed-size slots carved once from one backing buffer, with a free list per size class
    (10Cache §3.3.1, Fig. 5). Allocation after construction never calls the OS or torch's
    allocator.

    Slots are laid out contiguously in the order of ``classes``, each rounded up to
    ``alignment`` bytes so that every slot starts at an aligned offset (and at an aligned
    address when the backing is, as a :class:`~offload_strategy.memory.slab.HostSlab` is:
    ``O_DIRECT`` reads and writes need page-aligned buffers). Slots of a class are handed out
    lowest offset first and reused last-released first. Safe to use from several threads.
    """

    def __init__(self, backing: torch.Tensor, classes: Sequence[SizeClass], alignment: int = 4096, name: str = "pool") -> None:
        if not isinstance(backing, torch.Tensor) or backing.dtype != torch.uint8 or backing.dim() != 1 or not backing.is_contiguous():
            described = f"{backing.dtype} tensor of shape {tuple(backing.shape)}" if isinstance(backing, torch.Tensor) else repr(type(backing))
            raise ValueError(f"SlotPool {name!r}: the backing must be a contiguous 1-D uint8 tensor, got a {described}.")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"SlotPool {name!r}: alignment={alignment!r} must be a whole number of bytes > 0.")
        classes = tuple(classes)
        for cls in classes:
            if not isinstance(cls, SizeClass):
                raise ValueError(f"SlotPool {name!r}: {cls!r} is not a SizeClass(slot_bytes, count).")
        sizes = [cls.slot_bytes for cls in classes]
        repeated = sorted({size for size in sizes if sizes.count(size) > 1})
        if repeated:
            raise ValueError(f"SlotPool {name!r}: slot sizes {repeated} appear in more than one class; give each size once with the total count.")
        needed = self.required_bytes(classes, alignment)
        if backing.numel() < needed:
            raise ValueError(
                f"SlotPool {name!r} needs {needed} bytes ({format_bytes(needed)}) for its slots at {alignment}-byte "
                f"alignment, but the backing holds {backing.numel()} bytes ({format_bytes(backing.numel())}); "
                f"allocate at least SlotPool.required_bytes(classes, alignment) bytes, or plan fewer slots."
            )
        self.name = name
        self.alignment = alignment
        self.classes = classes
        self.backing = backing
        self.before_release: Optional[Callable[[Slot], None]] = None  # checks a slot is free to give back
        self._slots: dict[int, Slot] = {}  # offset -> slot, every slot of this pool
        self._free: dict[int, list[Slot]] = {}
        offset = 0
        for cls in classes:
            carved = []
            for _ in range(cls.count):
                carved.append(Slot(cls.slot_bytes, offset, backing[offset : offset + cls.slot_bytes]))
                offset += _round_up(cls.slot_bytes, alignment)
            self._slots.update((slot.offset, slot) for slot in carved)
            self._free[cls.slot_bytes] = carved[::-1]  # pop() from the end: lowest offset first
        self._sizes = sorted(self._free)
        self._in_use: set[int] = set()
        self._capacity = sum(cls.total_bytes for cls in classes)
        self._used = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def slots(self) -> list[Slot]:
        """Every slot of the pool, free or not, by offset."""
        return [self._slots[offset] for offset in sorted(self._slots)]

    @staticmethod
    def required_bytes(classes: Sequence[SizeClass], alignment: int = 4096) -> int:
        """Bytes of backing the classes need: every slot rounded up to ``alignment``."""
        return sum(cls.count * _round_up(cls.slot_bytes, alignment) for cls in classes)

    def try_acquire(self, nbytes: int) -> Optional[Slot]:
        """A free slot of the smallest class that holds ``nbytes``, a larger class if that one is
        empty, or None when no free slot can hold it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"SlotPool {self.name!r}: cannot acquire {nbytes!r} bytes; give a whole number >= 0.")
        sizes = self._sizes
        with self._lock:
            for i in range(bisect.bisect_left(sizes, nbytes), len(sizes)):
                free = self._free[sizes[i]]
                if free:
                    slot = free.pop()
                    self._in_use.add(slot.offset)
                    self._used += slot.slot_bytes
                    if self._used > self._peak:
                        self._peak = self._used
                    return slot
        return None

    def acquire(self, nbytes: int) -> Slot:
        """Like :meth:`try_acquire`, but raises :class:`PoolExhausted` with the numbers."""
        slot = self.try_acquire(nbytes)
        if slot is None:
            raise PoolExhausted(self._exhausted_message(nbytes))
        return slot

    def release(self, slot: Slot) -> None:
        """Return ``slot`` to its free list; refuses slots of other pools and double releases
        (and, with ``before_release`` set, whatever it refuses: a slot a copy may still use)."""
        if self.before_release is not None:
            self.before_release(slot)
        with self._lock:
            if self._slots.get(slot.offset) is not slot:
                raise ValueError(
                    f"SlotPool {self.name!r}: the slot of {slot.slot_bytes} bytes at offset {slot.offset} is not "
                    f"from this pool; release it to the pool that gave it out."
                )
            if slot.offset not in self._in_use:
                raise ValueError(
                    f"SlotPool {self.name!r}: the slot of {slot.slot_bytes} bytes at offset {slot.offset} is already "
                    f"free (released twice?); release each acquired slot exactly once."
                )
            self._in_use.remove(slot.offset)
            self._free[slot.slot_bytes].append(slot)
            self._used -= slot.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        """Sum of the slot sizes (without alignment padding)."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Sum of ``slot_bytes`` of the slots acquired and not yet released."""
        return self._used

    @property
    def peak_used_bytes(self) -> int:
        return self._peak

    def free_slots(self, slot_bytes: int) -> int:
        """Free slots in the class of exactly ``slot_bytes``."""
        free = self._free.get(slot_bytes)
        if free is None:
            raise ValueError(f"SlotPool {self.name!r} has no class of {slot_bytes}-byte slots; its classes are {self._sizes}.")
        return len(free)

    def _exhausted_message(self, nbytes: int) -> str:
        per_class = ", ".join(
            f"{cls.slot_bytes} B: {self.free_slots(cls.slot_bytes)} of {cls.count} free" for cls in sorted(self.classes, key=lambda c: c.slot_bytes)
        )
        largest = self._sizes[-1] if self._sizes else 0
        if nbytes > largest:
            return (
                f"SlotPool {self.name!r}: no slot can hold {nbytes} bytes ({format_bytes(nbytes)}); the largest class "
                f"is {largest} bytes [{per_class or 'no classes'}]. Plan a size class of at least {nbytes} bytes."
            )
        return (
            f"SlotPool {self.name!r}: no free slot of >= {nbytes} bytes ({format_bytes(nbytes)}) [{per_class}]; "
            f"{format_bytes(self._used)} of {format_bytes(self._capacity)} in use. Release slots first, or plan "
            f"more slots of >= {nbytes} bytes."
        )

    def __repr__(self) -> str:
        return (
            f"SlotPool({self.name!r}, {len(self._slots)} slots in {len(self._sizes)} classes, "
            f"{format_bytes(self._used)} of {format_bytes(self._capacity)} in use)"
        )
