"""What the engine's collaborators share: one context, made by the engine and passed to each
constructor (as FSDP2's ``FSDPParamGroup`` receives its ``FSDPCommContext``). The collaborators
read and change the unit states through it; none of them holds another's state.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..hardware.device import Device, TimeMark
from ..memory.nvme import NvmeStore
from ..planning.placement import HOST_SLOT_ALIGNMENT, Placement, align
from .metrics import RequestStats
from .offloaded import mark_offloaded, mark_present
from .scheduler import PrefetchTable
from .state import UnitState
from .tiers import TierMemory


class Phase(enum.Enum):
    """Which half of a training step the engine is in (decided by what autograd runs)."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class StepState:
    """The step in progress, as the engine sets it at its boundaries."""

    active: bool = False  # inside a training or evaluation step: the prefetch table applies
    in_training_step: bool = False  # the training step's code runs (after an optimizer step too, under manual optimization)
    phase: Phase = Phase.FORWARD
    update_in_backward: bool = False  # this backward ends a step: units update as their gradients complete
    clip_value: Optional[float] = None  # gradient clipping by value, applied per unit
    norms_wanted: bool = False  # clipping by norm follows backward: gradients' norms are taken as they leave for NVMe
    gradient_scale: Optional[torch.Tensor] = None  # clipping's coefficient, for gradients multiplied where their update reads them
    stalled_seconds: float = 0.0  # the training thread's waits for units, cumulative over the run
    # in a timed step, the compute's waits for units as marks either side of each (on CUDA the GPU
    # waits, not the host): the step timer leaves them out of the units' compute
    stall_marks: Optional[list[tuple[TimeMark, TimeMark]]] = None


@dataclass(eq=False)
class EngineContext:
    """The unit states, the tiers' memory and the NVMe store, and the step in progress."""

    device: Device
    placement: Placement
    states: list[UnitState]
    memory: TierMemory
    offloaded_class: type  # the class of parameters at placeholders (runtime/offloaded.py)
    store: Optional[NvmeStore] = None
    table: PrefetchTable = field(default_factory=PrefetchTable)
    requests: RequestStats = field(default_factory=RequestStats)
    step: StepState = field(default_factory=StepState)
    param_slot: dict[int, tuple[UnitState, int]] = field(default_factory=dict)  # id(param) -> (unit, position)
    fp32_masters: bool = False

    @staticmethod
    def key(s: UnitState) -> str:
        """The NVMe file of a unit's parameters."""
        return f"unit{s.unit.index}"

    @staticmethod
    def gradient_key(s: UnitState) -> str:
        """The NVMe file where a unit's gradients wait for its update."""
        return f"unit{s.unit.index}.grad"

    def bind(self, s: UnitState, tensors: Sequence[torch.Tensor]) -> None:
        """Point the unit's parameters at ``tensors`` (its placeholders: marked offloaded)."""
        self.note_writes(s)
        away = bool(s.placeholders) and tensors is s.placeholders
        for p, name, t in zip(s.unit.params, s.unit.param_names, tensors):
            mark_present(p)
            p.data = t
            if away:
                mark_offloaded(p, self.offloaded_class, name)
        s.bound_to = list(tensors)
        s.bound_versions = [p._version for p in s.unit.params]

    @staticmethod
    def note_writes(s: UnitState) -> bool:
        """Whether user code wrote one of the unit's parameters in place since the engine pointed it
        (``nn.Embedding(max_norm=...)`` renormalises its weight in every forward; a constraint
        applied under ``torch.no_grad()`` inside the training step). Such writes move the
        parameter's version counter; they are recorded in ``s.written`` so that fp32 masters kept
        apart take the written values before the next update. A write through ``p.data`` moves no
        counter and is not seen."""
        if len(s.bound_versions) != len(s.unit.params):
            return False
        written = {i for i, (p, v) in enumerate(zip(s.unit.params, s.bound_versions)) if p._version != v}
        if written:
            s.written |= written
            s.bound_versions = [p._version for p in s.unit.params]
        return bool(written)

    @staticmethod
    def rebound(s: UnitState) -> dict[int, torch.Tensor]:
        """Positions of the unit's parameters that user code gave a tensor of its own
        (``p.data = t``) since the engine bound them, with that tensor. Only addresses and shapes
        are read, so a parameter at a placeholder is not lent."""
        if len(s.bound_to) != len(s.unit.params):
            return {}
        return {i: p.data for i, (p, t) in enumerate(zip(s.unit.params, s.bound_to)) if not _same_tensor(p, t)}

    def read_home(self, s: UnitState) -> torch.Tensor:
        """A fresh host buffer holding an NVMe unit's bytes (from its kept copy, or from disk)."""
        buffer = torch.empty(align(s.unit.nbytes, HOST_SLOT_ALIGNMENT), dtype=torch.uint8)
        if s.host_copy is not None:
            buffer.copy_(s.host_copy.tensor[: buffer.numel()])
        else:
            assert self.store is not None, "NVMe units have the store"
            self.store.read(self.key(s), buffer).result()
        return buffer

    def settle_host_copy(self, s: UnitState) -> None:
        """The host waits for the last copy out of the unit's kept staging copy into the GPU tier:
        a device-side wait ordered only compute after it, so on CUDA it may still be queued, and
        releasing, refilling or writing the slot now would change what it copies."""
        if s.host_copy_read is not None:
            self.device.host_wait(s.host_copy_read)
            s.host_copy_read = None

    def write_home(self, s: UnitState, buffer: torch.Tensor) -> None:
        """An NVMe unit's new bytes go home (and to its kept host copy)."""
        assert self.store is not None, "NVMe units have the store"
        self.store.write(self.key(s), buffer).result()
        if s.host_copy is not None:
            self.settle_host_copy(s)
            self.device.check_host_access(s.host_copy.tensor, "writes an NVMe unit's kept staging copy")
            s.host_copy.tensor[: buffer.numel()].copy_(buffer)

    def home_bytes(self, s: UnitState) -> torch.Tensor:
        """A host unit's home as one byte range (its views are consecutive in one slab slot)."""
        region = self.memory.home_region
        start = s.home_views[0].data_ptr() - region.data_ptr()
        return region[start : start + s.unit.nbytes]


def _same_tensor(p: torch.Tensor, t: torch.Tensor) -> bool:
    return p.data_ptr() == t.data_ptr() and p.shape == t.shape and p.stride() == t.stride() and p.dtype == t.dtype
