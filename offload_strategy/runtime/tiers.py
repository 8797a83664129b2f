"""The memory one placement needs, allocated once: the GPU tier's persistent units' region and its
arena of streaming buffers, and the pinned host slab (host homes, gradient homes, the NVMe
staging and update buffers), carved into the unit states' views."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..hardware.device import Device
from ..memory import HostSlab, SizeClass, Slot, SlotPool
from ..planning.placement import DEVICE_SLOT_ALIGNMENT, GPU, HOST, HOST_SLOT_ALIGNMENT, Placement, align
from .grads.buffers import gradient_bytes
from .state import UnitState


# maps host memory every rank of the machine sees: (bytes, the homes' (unit index, bytes)) -> the slab
SharedHomes = Callable[[int, list[tuple[int, int]]], HostSlab]


@dataclass(eq=False)
class TierMemory:
    arena: torch.Tensor  # the GPU tier's streaming buffers
    device_pool: SlotPool  # streaming buffers
    class_sizes: list[int]  # the streaming buffers' sizes, ascending
    slab: HostSlab
    staging_pool: SlotPool  # what NVMe units pass through on their way to the GPU tier
    update_pool: SlotPool  # the update worker's own staging buffers
    update_buffers: int
    master_region: torch.Tensor  # fp32 masters of host-homed 16-bit units (never transferred: not pinned)
    gradient_slots: list[torch.Tensor]  # buffers the gradients of NVMe units pass through (runtime/grads/buffers.py)
    home_region: torch.Tensor  # host homes: the start of the slab, or the machine's shared copy
    shared_slab: Optional[HostSlab] = None  # the host homes every rank of the machine maps (shared_homes.py)
    # each persistent unit's fixed region of the GPU tier (the cache makes it the unit's slot)
    persistent_slots: dict[int, Slot] = field(default_factory=dict)
    # each offloaded unit's gradient home for the run, where it keeps one (the gradient path binds it)
    gradient_homes: dict[int, torch.Tensor] = field(default_factory=dict)
    # the persistent units, an allocation of their own: after the engine the parameters keep it
    # as their memory (``Lending.materialize_for_good``), and the streaming buffers go
    persistent_region: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))

    @classmethod
    def allocate(
        cls, states: list[UnitState], placement: Placement, device: Device, owns: Callable[[int], bool], shared_homes: Optional[SharedHomes] = None,
    ) -> "TierMemory":
        """``owns``: whether this process updates a unit (under sharded states, only its owner
        keeps its fp32 masters); ``shared_homes``: where the placement shares host homes among
        the machine's ranks, what maps them."""
        persistent, persistent_slots = _persistent_region(states, device)
        arena, device_pool, class_sizes = _streaming_arena(placement, device)
        host = _host_tier(states, placement, device, shared_homes)
        masters = _master_region([s for s in states if owns(s.unit.index)])
        return cls(arena, device_pool, class_sizes, host.slab, host.staging_pool, host.update_pool, host.update_buffers, masters,
                   host.gradient_slots, host.home_region, host.shared_slab, persistent_slots, host.gradient_homes, persistent)

    def own_class(self, nbytes: int) -> int:
        """The smallest buffer size that holds ``nbytes``: where a unit of that size belongs."""
        return self.class_sizes[bisect.bisect_left(self.class_sizes, nbytes)]

    def release_home(self, s: UnitState) -> None:
        """The pages of host unit ``s``'s home, its values copied out (the engine closes), go back
        to the system (``HostSlab.release``): unit by unit, the values move out of the slab with
        one unit's copy at a time beside it, not the whole homes' at once."""
        if self.shared_slab is not None or not s.home_views:
            return
        start = min(v.data_ptr() for v in s.home_views)
        end = max(v.data_ptr() + v.numel() * v.element_size() for v in s.home_views)
        self.slab.release(self.slab.tensor[start - self.slab.tensor.data_ptr() : end - self.slab.tensor.data_ptr()])

    def host_fixed_bytes(self) -> int:
        """Host homes and gradients in the slab (the staging buffers excluded)."""
        return self.slab.nbytes - self.staging_pool.capacity_bytes


def _persistent_region(states: list[UnitState], device: Device) -> tuple[torch.Tensor, dict[int, Slot]]:
    """The persistent units' region of the GPU tier and each one's fixed slot in it."""
    persistent = [s for s in states if s.home == GPU]
    region = device.allocate(sum(align(s.unit.nbytes, DEVICE_SLOT_ALIGNMENT) for s in persistent))
    offset = 0
    slots = {}
    for s in persistent:
        size = align(s.unit.nbytes, DEVICE_SLOT_ALIGNMENT)
        slots[s.unit.index] = Slot(slot_bytes=size, offset=offset, tensor=region[offset : offset + size])
        offset += size
    return region, slots


def _streaming_arena(placement: Placement, device: Device) -> tuple[torch.Tensor, SlotPool, list[int]]:
    classes = [SizeClass(slot_bytes=b, count=c) for b, c in sorted(placement.device_slots.items(), reverse=True)]
    arena = device.allocate(SlotPool.required_bytes(classes, DEVICE_SLOT_ALIGNMENT) if classes else 0)
    pool = SlotPool(arena, classes, alignment=DEVICE_SLOT_ALIGNMENT, name="GPU tier")
    return arena, pool, sorted(c.slot_bytes for c in classes)


@dataclass
class _HostTier:
    slab: HostSlab
    staging_pool: SlotPool
    update_pool: SlotPool
    update_buffers: int
    gradient_slots: list[torch.Tensor]
    home_region: torch.Tensor
    shared_slab: Optional[HostSlab]
    gradient_homes: dict[int, torch.Tensor]


def _host_tier(states: list[UnitState], placement: Placement, device: Device, shared_homes: Optional[SharedHomes]) -> _HostTier:
    offloaded = [s for s in states if s.home != GPU]
    homed = [s for s in offloaded if s.home == HOST]
    layout = [(s.unit.index, align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)) for s in homed]
    home_bytes = sum(size for _, size in layout)
    own_homes = home_bytes if shared_homes is None else 0  # shared: not in this rank's slab
    grad_bytes = sum(gradient_bytes(s) for s in offloaded if s.unit.trainable and not s.transient_gradients)  # with the 16-bit landing areas
    gradient_slot = max((gradient_bytes(s) for s in offloaded if s.transient_gradients), default=0)
    gradient_count = sum(placement.gradient_slots.values()) if gradient_slot else 0
    staging_classes = [SizeClass(slot_bytes=b, count=c) for b, c in sorted(placement.staging_slots.items(), reverse=True)]
    staging_bytes = SlotPool.required_bytes(staging_classes, HOST_SLOT_ALIGNMENT) if staging_classes else 0
    # The update worker's own staging buffers, so it never shares one with the fetch path; the
    # others keep NVMe units in host memory between forward and backward (Placement.host_copies).
    update_buffers = placement.update_staging_buffers
    update_classes = [SizeClass(slot_bytes=c.slot_bytes, count=update_buffers) for c in staging_classes[:1]]
    staging_classes = [SizeClass(c.slot_bytes, c.count - (update_buffers if k == 0 else 0)) for k, c in enumerate(staging_classes)]
    pin = device.compute.type == "cuda"
    # its pages from the GPU's NUMA node: copies from the other socket's memory cross the link between sockets
    slab = HostSlab(own_homes + grad_bytes + gradient_slot * gradient_count + staging_bytes, pin=pin, numa_node=device.numa_node)
    host = slab.tensor
    shared_slab = shared_homes(home_bytes, layout) if shared_homes is not None else None
    home_region = host[:home_bytes] if shared_slab is None else shared_slab.tensor
    _carve_homes(homed, home_region)
    gradient_homes = _carve_gradients(offloaded, host[own_homes:])
    offset = own_homes + sum(t.numel() for t in gradient_homes.values())
    gradient_slots = [host[offset + k * gradient_slot : offset + (k + 1) * gradient_slot] for k in range(gradient_count)]
    offset += gradient_slot * gradient_count
    update_bytes = SlotPool.required_bytes(update_classes, HOST_SLOT_ALIGNMENT) if update_classes else 0
    update_pool = SlotPool(host[offset : offset + update_bytes], update_classes, alignment=HOST_SLOT_ALIGNMENT, name="NVMe update")
    staging_pool = SlotPool(host[offset + update_bytes :], staging_classes, alignment=HOST_SLOT_ALIGNMENT, name="NVMe staging")
    return _HostTier(slab, staging_pool, update_pool, update_buffers, gradient_slots, home_region, shared_slab, gradient_homes)


def _carve_homes(homed: list[UnitState], region: torch.Tensor) -> None:
    """Each host unit's home, in order, from ``region``."""
    offset = 0
    for s in homed:
        size = align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)
        s.home_views = s.unit.views(region[offset : offset + size])
        offset += size


def _carve_gradients(offloaded: list[UnitState], host: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each offloaded unit's gradient home (and 16-bit landing area), in order from ``host``."""
    offset = 0
    homes = {}
    for s in offloaded:
        if s.unit.trainable and not s.transient_gradients:
            size = gradient_bytes(s)
            homes[s.unit.index] = host[offset : offset + size]
            offset += size
    return homes


def _master_region(states: list[UnitState]) -> torch.Tensor:
    widened = [s for s in states if s.home == HOST and s.widened]
    sizes = [align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT) for s in widened]
    region = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for s, size in zip(widened, sizes):
        views = s.unit.typed_views(region[offset : offset + size], s.master_dtypes)
        s.master_views = [v if d != p.dtype else None for v, d, p in zip(views, s.master_dtypes, s.unit.params)]
        offset += size
    return region


def refuse_dha_on_a_gpu(placement: Placement, device: Device) -> None:
    """Units computed in place at home are bound to their host homes, CPU tensors: a GPU's
    kernels cannot take them (binding device views of the pinned home has not run on a GPU)."""
    if placement.dha and not device.is_emulated:
        raise ValueError(
            f"placement.dha puts {len(placement.dha)} unit(s) (indices {sorted(placement.dha)[:8]}) in place at home, "
            f"which runs only on the emulated GPU tier: on {device.compute} their parameters would be host tensors "
            f"in GPU kernels. Give those units a home of gpu, host or nvme instead (placement.dha=frozenset())."
        )
