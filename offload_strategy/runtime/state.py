"""Where one unit stands at run time: its buffers, its fetch in flight, its gradients."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..hardware.device import Event
from ..memory import Slot
from .units import TransferUnit

if TYPE_CHECKING:  # the gradient path owns its records
    from .grads.path import GradientRecord


@dataclass(eq=False)
class Fetch:
    """A copy into the GPU tier in flight: NVMe read (optional), then host → GPU copy."""

    slot: Slot
    staging: Optional[Slot] = None
    nvme: Any = None  # Future of the NVMe read
    event: Optional[Event] = None


class Landing(enum.Enum):
    """What a 16-bit gradient that landed beside an fp32 master's gradient does once waited for."""

    COPY = "copy"  # replaces a gradient of an earlier accumulation
    ADD = "add"  # adds to this accumulation's gradient


@dataclass(eq=False)
class UnitState:
    unit: TransferUnit
    home: str
    device_slot: Optional[Slot] = None  # GPU-tier buffer while resident (persistent: fixed region)
    home_views: list[torch.Tensor] = field(default_factory=list)  # host home (HOST units)
    placeholders: list[torch.Tensor] = field(default_factory=list)  # NVME units while not resident
    master_dtypes: list[torch.dtype] = field(default_factory=list)  # per param: what it is updated in
    master_views: list[Optional[torch.Tensor]] = field(default_factory=list)  # HOST units: fp32 masters of low-precision params
    grads: list[GradientRecord] = field(default_factory=list)  # offloaded units: one per parameter
    fetch: Optional[Fetch] = None
    host_copy: Optional[Slot] = None  # NVMe units: a current copy kept in a staging buffer (10Cache's GPU-designated CPU buffer)
    host_copy_read: Optional[Event] = None  # the last copy out of it into the GPU tier, until the host has waited for it
    home_read: Optional[Event] = None  # HOST units: the last copy out of the home into the GPU tier, until the host has waited for it
    pins: int = 0
    used_in_backward: bool = False  # this step; with gradients still to come, evicted only if nothing else can be
    grads_arrived: int = 0  # this backward; all arrived: the unit can be updated
    # Used by a forward that backward recomputes (activation checkpointing): the recomputed graph
    # holds plain views of the unit's buffer, so the unit stays until its gradients are complete.
    recompute_pinned: bool = False
    updated: bool = False  # this step, already (during backward)
    bound: bool = False  # parameters currently point into device_slot
    bound_to: list[torch.Tensor] = field(default_factory=list)  # per param: what the engine last pointed it at
    bound_versions: list[int] = field(default_factory=list)  # per param: its version counter when last pointed
    written: set[int] = field(default_factory=set)  # positions written in place since their last update (UnitCache.note_writes)
    handed_out: set[int] = field(default_factory=set)  # positions whose ``.data`` user code took inside this step
    reduce_ready: bool = False  # data parallel: complete for this step, its reduction due in the canonical order
    reductions: list[Any] = field(default_factory=list)  # data parallel: its collectives in flight
    # an NVMe unit whose gradients live in a shared buffer from the first to the update (runtime/grads/buffers.py)
    transient_gradients: bool = False

    @property
    def widened(self) -> bool:
        """Some parameter is computed in low precision and updated through an fp32 master."""
        return any(d != p.dtype for d, p in zip(self.master_dtypes, self.unit.params))

    @property
    def resident(self) -> bool:
        return self.device_slot is not None and self.fetch is None

    def wait_reductions(self) -> None:
        """Data parallel: this unit's gradient reductions in flight have finished."""
        works, self.reductions = self.reductions, []
        for work in works:
            work.wait()


def one_element(fill: float, shape: tuple[int, ...], dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """One element seen with ``shape``: right shape, dtype and device, no memory. A 0-d element,
    so that it expands to any shape, a 0-d one (a scalar parameter, a step count) included."""
    return torch.full((), fill, dtype=dtype, device=device).expand(shape)


def nan_placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    # NaN, so that a value read by mistake shows; 0 for integer parameters
    fill = float("nan") if p.dtype.is_floating_point or p.dtype.is_complex else 0
    return one_element(fill, p.shape, p.dtype, device)
