"""Tensors autograd saves for backward, packed so that a GPU-tier buffer can take another unit
between forward and backward: a saved tensor that aliases a streamed unit's buffer is replaced by a
reference (unit, offset, shape, strides), and a saved 16-bit cast of a streamed weight by a
reference to the parameter; backward's unpack fetches the unit again. What else is saved is
counted (``SavedBytes``: the activations the planner prices).

The first unpack of a unit's tensor in a step's backward marks the unit used in backward (the
cache keeps it while its gradients come) and times the backward (``StepTimer.unpacked``); the
forwards between steps call :meth:`SavedTensors.unpack` with that (``runtime/params/forwards.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...planning.placement import GPU
from ..params.cache import UnitCache
from ..context import EngineContext, Phase
from .saved_bytes import SavedBytes
from ..timing import StepTimer


def _storage_address(t: torch.Tensor) -> Optional[int]:
    """Where ``t``'s storage starts (None: a tensor without one, as a torch.func transform's wrapper)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None



@dataclass(frozen=True)
class _SavedRef:
    """A saved tensor that aliases a unit's GPU-tier buffer, re-materialised on unpack."""

    unit: int
    byte_offset: int  # from the start of the unit's buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _SavedCast:
    """A saved 16-bit cast of a streamed parameter (autocast's, under ``*-mixed``): cast again from
    the unit when backward unpacks it, so that no copy of the weight outlives the unit's eviction
    (a cast gives the same bits every time)."""

    unit: int
    position: int  # of the parameter in its unit
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in the cast's elements
    dtype: torch.dtype


SIXTEEN_BITS = (torch.bfloat16, torch.float16)


class SavedTensors:
    """See the module docstring. Owns ``UnitState.used_in_backward``."""

    def __init__(self, ctx: EngineContext, cache: UnitCache, timer: StepTimer) -> None:
        self.ctx, self.cache, self.timer = ctx, cache, timer
        # what a saved tensor aliasing the GPU tier shares with it
        self.arena_device, self.arena_storage = ctx.memory.arena.device, ctx.memory.arena.untyped_storage().data_ptr()
        self.persistent_storage = ctx.memory.persistent_region.untyped_storage().data_ptr()
        self.bytes = SavedBytes()  # kept for backward by the last forward (parameters excluded)
        self.backward_log: list[float] = []  # times of this step's backward uses of units

    def new_step(self) -> None:
        self.bytes.clear()
        self.backward_log = []
        self.step_ended()

    def step_ended(self) -> None:
        """No unit has been used in the next step's backward yet."""
        for s in self.ctx.states:
            s.used_in_backward = False

    def in_arena(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views the GPU tier's arena."""
        return t.device == self.arena_device and _storage_address(t) == self.arena_storage

    def streamed_unit_of(self, t: torch.Tensor) -> Optional[int]:
        """The streamed unit whose GPU-tier buffer ``t`` views (None: none)."""
        if not self.in_arena(t):
            return None
        s = self.cache.owner(t.data_ptr())
        return s.unit.index if s is not None else None

    def pack(self, t: torch.Tensor) -> Any:
        if t.device == self.arena_device and t.untyped_storage().data_ptr() == self.persistent_storage:
            return t  # persistent units never move
        if t.device != self.arena_device or t.untyped_storage().data_ptr() != self.arena_storage:
            cast = self._streamed_cast(t)
            if cast is not None:
                return cast
            step = self.ctx.step
            if step.active and step.phase is Phase.FORWARD:
                self.bytes.add(t)  # kept for backward (checkpointed blocks save only inputs)
            return t
        ptr = t.data_ptr()
        s = self.cache.owner(ptr)
        if s is None:
            return t  # a buffer no unit holds now
        return _SavedRef(s.unit.index, self.cache.owner_offset(s, ptr), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _streamed_cast(self, t: torch.Tensor) -> Optional[_SavedCast]:
        """``t`` (or the tensor it views) as a reference to the streamed parameter it is the 16-bit
        cast of, or None. Autocast casts a weight for each operation that computes in 16 bits (and
        caches the cast of a trainable one until its region exits); a saved cast would keep the
        weight's bytes in the GPU tier until backward, outside the plan."""
        if t.dtype not in SIXTEEN_BITS or not t.requires_grad:
            return None
        base = t if t._base is None else t._base
        node = base.grad_fn
        if node is None or node.name() != "ToCopyBackward0" or base.storage_offset() != 0 or not base.is_contiguous():
            return None
        where = self.ctx.param_slot.get(id(getattr(node.next_functions[0][0], "variable", None)))
        if where is None or where[0].home == GPU:
            return None
        s, i = where
        p = s.unit.params[i]
        if base.shape != p.shape or base.device != p.device or not p.is_contiguous():
            return None
        return _SavedCast(s.unit.index, i, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    @staticmethod
    def unit_of(packed: Any) -> Optional[int]:
        """The unit a packed tensor refers to (None: a tensor saved as it is)."""
        return packed.unit if isinstance(packed, (_SavedRef, _SavedCast)) else None

    def unpack(self, packed: Any, in_step: bool) -> torch.Tensor:
        """``in_step``: unpacked by a step's backward (not one of a graph built between steps)."""
        unit = self.unit_of(packed)
        if unit is None:
            return packed
        if in_step:
            self._used_in_backward(unit)
        if isinstance(packed, _SavedCast):
            self.cache.request(packed.unit)
            cast = self.ctx.states[packed.unit].unit.params[packed.position].detach().to(packed.dtype)
            return cast.as_strided(packed.shape, packed.stride, packed.storage_offset)
        buffer = self.cache.request(packed.unit)
        typed = buffer.view(packed.dtype)
        element = typed.element_size()
        # as_strided's offset counts from the start of the storage, not of the view
        return typed.as_strided(packed.shape, packed.stride, typed.storage_offset() + packed.byte_offset // element)

    def _used_in_backward(self, unit: int) -> None:
        self.ctx.step.enter_backward()
        self.backward_log.append(time.perf_counter())
        self.timer.unpacked(unit)
        self.ctx.states[unit].used_in_backward = True
