"""Where one unit stands at run time: its buffers, its fetch in flight, its gradients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..hardware.device import Event
from ..memory import Slot
from .units import TransferUnit


@dataclass(eq=False)
class Fetch:
    """A copy into the GPU tier in flight: NVMe read (optional), then host → GPU copy."""

    slot: Slot
    staging: Optional[Slot] = None
    nvme: Any = None  # Future of the NVMe read
    event: Optional[Event] = None


@dataclass(eq=False)
class UnitState:
    unit: TransferUnit
    home: str
    device_slot: Optional[Slot] = None  # GPU-tier buffer while resident (persistent: fixed region)
    home_views: list[torch.Tensor] = field(default_factory=list)  # host home (HOST units)
    placeholders: list[torch.Tensor] = field(default_factory=list)  # NVME units while not resident
    master_dtypes: list[torch.dtype] = field(default_factory=list)  # per param: what it is updated in
    master_views: list[Optional[torch.Tensor]] = field(default_factory=list)  # HOST units: fp32 masters of low-precision params
    grad_views: list[Optional[torch.Tensor]] = field(default_factory=list)  # host gradient home per param, in its master dtype
    grad_fresh: list[bool] = field(default_factory=list)
    grad_events: list[Optional[Event]] = field(default_factory=list)
    # fp32 masters: a 16-bit gradient lands here (pinned, the copy is async) and is widened into
    # grad_views when waited for, copied over a stale gradient or added to a fresh one
    grad_landing: list[Optional[torch.Tensor]] = field(default_factory=list)
    grad_pending: list[Optional[str]] = field(default_factory=list)  # None, "copy" or "add"
    fetch: Optional[Fetch] = None
    host_copy: Optional[Slot] = None  # NVMe units: a current copy kept in a staging buffer (10Cache's GPU-designated CPU buffer)
    pins: int = 0
    used_in_backward: bool = False  # this step; with gradients still to come, evicted only if nothing else can be
    grads_arrived: int = 0  # this backward; all arrived: the unit can be updated
    # Used by a forward that backward recomputes (activation checkpointing): the recomputed graph
    # holds plain views of the unit's buffer, so the unit stays until its gradients are complete.
    recompute_pinned: bool = False
    updated: bool = False  # this step, already (during backward)
    bound: bool = False  # parameters currently point into device_slot
    reduce_ready: bool = False  # data parallel: complete for this step, its reduction due in the canonical order
    reductions: list[Any] = field(default_factory=list)  # data parallel: its collectives in flight

    @property
    def widened(self) -> bool:
        """Some parameter is computed in low precision and updated through an fp32 master."""
        return any(d != p.dtype for d, p in zip(self.master_dtypes, self.unit.params))

    @property
    def resident(self) -> bool:
        return self.device_slot is not None and self.fetch is None


def nan_placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    # One element expanded to the parameter's shape: right shape, dtype and device, no memory.
    return torch.full((1,), float("nan"), dtype=p.dtype, device=device).expand(p.shape)
