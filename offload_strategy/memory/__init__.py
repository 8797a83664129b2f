"""Host and device memory the runtime swaps through: one pinned, page-aligned host slab and
fixed-size slot pools carved from it (or from a device arena) once, before training."""

from .pools import PoolExhausted, SizeClass, Slot, SlotPool
from .slab import PAGE_BYTES, HostSlab

__all__ = ["PAGE_BYTES", "HostSlab", "PoolExhausted", "SizeClass", "Slot", "SlotPool"]
