"""Updates during backward under clipping by norm, taken back when the norm says so.

Clipping by norm multiplies every gradient by ``min(max_norm / (total_norm + 1e-6), 1)``, and the
total norm is known only once backward is over, so the updates LoHan §IV-C overlaps with backward
would have to wait for it. But on a step whose norm stays under the threshold the coefficient is
exactly 1.0, and multiplying by it changes no bit: an update made with the gradient as it arrived
is the update plain training makes. So a host unit is updated as soon as its gradients are
complete, as without clipping, after its previous values (parameters, fp32 masters, optimizer
states) are copied aside; when the step's norm turns out above the threshold those values are
put back and the unit is updated again after backward with its clipped gradient, as without
speculation. Its gradient stays at home meanwhile, for the norm and for that second update.

What it costs is host memory for the previous values (``room``, what the host budget leaves; the
units that do not fit are updated after backward as before) and a copy of them per update. A
step after one that clipped does not speculate: norms above the threshold tend to come in runs
(the first steps of a run), where every speculation would be redone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .optimizers import UnitOptimizers, UnitSlot


@dataclass
class _Saved:
    """One unit's previous values: the tensors' copies, and each master's state entries."""

    buffers: list[torch.Tensor]
    states: list[Optional[list[tuple[str, Any]]]] = field(default_factory=list)  # per master: (key, value or None for a tensor)


class SpeculativeUpdates:
    """See the module docstring. The training thread decides and settles; the update worker saves."""

    def __init__(self) -> None:
        self.room = 0  # host bytes the previous values may take
        self.allowed = False  # the recipe lets this step's updates run ahead of clipping
        self.active = False  # ... and this step does
        self.clipped_last = False  # the last step that clipped by norm did clip
        self.saved: dict[int, _Saved] = {}  # unit index -> its previous values, buffers kept between steps
        self.reserved: dict[int, int] = {}  # unit index -> bytes set aside for it
        self.speculated: list[int] = []  # units updated speculatively in this step
        self.counts = {"speculated_units": 0, "redone_steps": 0, "steps": 0}

    def begin_step(self, allowed: bool) -> bool:
        self.allowed = allowed
        self.active = allowed and not self.clipped_last
        self.speculated = []
        return self.active

    @property
    def held_bytes(self) -> int:
        return sum(self.reserved.values())

    def reserve(self, unit_index: int, nbytes: int) -> bool:
        """Room for a unit's previous values (kept from step to step once given)."""
        if unit_index in self.reserved and self.reserved[unit_index] >= nbytes:
            return True
        if self.held_bytes - self.reserved.get(unit_index, 0) + nbytes > self.room:
            return False
        self.reserved[unit_index] = nbytes
        return True

    def save(self, slot: UnitSlot, copies: list[torch.Tensor]) -> None:
        """On the worker, right before the unit's step: its masters, the 16-bit copies forward
        reads (where they are apart from the masters), and its optimizer states."""
        sources, states = _sources(slot, copies)
        kept = self.saved.get(slot.unit_index)
        if kept is None or [(b.shape, b.dtype) for b in kept.buffers] != [(t.shape, t.dtype) for t in sources]:
            kept = _Saved([torch.empty_like(t, device="cpu") for t in sources])
            self.saved[slot.unit_index] = kept
        for buffer, tensor in zip(kept.buffers, sources):
            buffer.copy_(tensor)
        kept.states = states
        self.speculated.append(slot.unit_index)

    def settle(self, clipped: bool, unit_optimizers: UnitOptimizers, copies_of: Any) -> list[int]:
        """After backward, the norm known: keep the speculative updates, or put every speculated
        unit back as it was (``copies_of(unit_index)``: its 16-bit copies, as given to ``save``).
        Returns the units to update again."""
        if not self.allowed:
            return []
        self.clipped_last = clipped
        self.counts["steps"] += 1
        self.counts["speculated_units"] = len(self.speculated)
        if not clipped or not self.active or not self.speculated:
            return []
        self.counts["redone_steps"] += 1
        for index in self.speculated:
            slot = unit_optimizers.slots[index]
            _restore(self.saved[index], slot, copies_of(index))
        return list(self.speculated)


def _sources(slot: UnitSlot, copies: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Optional[list[tuple[str, Any]]]]]:
    """The tensors an update writes, in a fixed order, and the layout of each master's state."""
    sources = list(slot.masters) + [copies[k] for k in range(len(slot.masters)) if slot.widened(k)]
    layouts: list[Optional[list[tuple[str, Any]]]] = []
    for master in slot.masters:
        state = slot.inner.state.get(master)
        if not state:
            layouts.append(None)
            continue
        layout = []
        for key, value in state.items():
            if torch.is_tensor(value):
                sources.append(value)
                layout.append((key, None))
            else:
                layout.append((key, value))
        layouts.append(layout)
    return sources, layouts


def _restore(saved: _Saved, slot: UnitSlot, copies: list[torch.Tensor]) -> None:
    buffers = iter(saved.buffers)
    for master in slot.masters:
        master.copy_(next(buffers))
    for k in range(len(slot.masters)):
        if slot.widened(k):
            copies[k].copy_(next(buffers))
    for master, layout in zip(slot.masters, saved.states):
        if layout is None:  # the optimizer had no state for it before this step
            slot.inner.state.pop(master, None)
            continue
        slot.inner.state[master] = {key: next(buffers).clone() if value is None else value for key, value in layout}
