"""What the engine's collaborators share: one context, made by the engine and passed to each
constructor (as FSDP2's ``FSDPParamGroup`` receives its ``FSDPCommContext``). The collaborators
read and change the unit states through it; none of them holds another's state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..hardware.device import Device, TimeMark
from ..memory.nvme import NvmeStore
from ..planning.placement import HOST_SLOT_ALIGNMENT, Placement, align
from .metrics import RequestStats
from .params.scheduler import PrefetchTable
from .state import UnitState
from .tiers import TierMemory


class Phase(enum.Enum):
    """Which half of a training step the engine is in (decided by what autograd runs)."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class StepState:
    """The step in progress. Its fields change only through its named transitions, which the
    engine calls at the step's boundaries (the forwards between steps and the step timer call
    theirs); everyone else reads them."""

    active: bool = False  # inside a training or evaluation step: the prefetch table applies
    in_training_step: bool = False  # the training step's code runs (after an optimizer step too, under manual optimization)
    phase: Phase = Phase.FORWARD
    update_in_backward: bool = False  # this backward ends a step: units update as their gradients complete
    clip_value: Optional[float] = None  # gradient clipping by value, applied per unit
    norms_wanted: bool = False  # clipping by norm follows backward: gradients' norms are taken as they leave for NVMe
    gradient_scale: Optional[torch.Tensor] = None  # clipping's coefficient, for gradients multiplied where their update reads them
    # in a timed step, the compute's waits for units as marks either side of each (on CUDA the GPU
    # waits, not the host): the step timer leaves them out of the units' compute
    stall_marks: Optional[list[tuple[TimeMark, TimeMark]]] = None

    def begin(self, update_in_backward: bool, clip_value: Optional[float], norms_wanted: bool) -> None:
        """A training or evaluation step starts, in its forward."""
        self.phase = Phase.FORWARD
        self.active = True
        self.update_in_backward = update_in_backward
        self.clip_value = clip_value
        self.norms_wanted = norms_wanted

    def activate(self) -> None:
        """Modules run between steps (``runtime/params/forwards.py``): as inside a step, until :meth:`deactivate`."""
        self.active = True

    def deactivate(self) -> None:
        """No step runs: parameters point at their homes, reads of them are lent."""
        self.active = False

    def updates_begin(self) -> None:
        """The optimizer step's updates start: the step's forwards and backwards are over."""
        self.active = False
        self.update_in_backward = False

    def optimizer_step_ended(self) -> None:
        self.updates_begin()
        self.gradient_scale = None

    def scale_gradients(self, coefficient: torch.Tensor) -> None:
        """Clipping by norm: gradients read for their update are multiplied by ``coefficient``."""
        self.gradient_scale = coefficient

    def enter_forward(self) -> None:
        """Another forward in the same step (manual optimization), or a step's first."""
        self.phase = Phase.FORWARD

    def enter_backward(self) -> None:
        self.phase = Phase.BACKWARD

    def training_step_code(self, running: bool) -> None:
        """The training step's own code starts (True) or returned (False)."""
        self.in_training_step = running

    def mark_stalls(self, timed: bool) -> None:
        """A step starts: its waits for units are marked where it is timed."""
        self.stall_marks = [] if timed else None

    def take_stalls(self) -> Optional[list[tuple[TimeMark, TimeMark]]]:
        """The step's marked waits, which stop being marked."""
        stalls, self.stall_marks = self.stall_marks, None
        return stalls


@dataclass(eq=False)
class EngineContext:
    """The unit states, the tiers' memory and the NVMe store, and the step in progress."""

    device: Device
    placement: Placement
    states: list[UnitState]
    memory: TierMemory
    store: Optional[NvmeStore] = None
    offloaded_class: type = object  # the class of parameters at placeholders (runtime/params/offloaded.py), set once the hooks exist
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

    def home_bytes(self, s: UnitState) -> torch.Tensor:
        """A host unit's home as one byte range (its views are consecutive in one slab slot)."""
        region = self.memory.home_region
        start = s.home_views[0].data_ptr() - region.data_ptr()
        return region[start : start + s.unit.nbytes]


def _same_tensor(p: torch.Tensor, t: torch.Tensor) -> bool:
    return p.data_ptr() == t.data_ptr() and p.shape == t.shape and p.stride() == t.stride() and p.dtype == t.dtype
