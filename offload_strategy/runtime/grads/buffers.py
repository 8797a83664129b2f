"""Host buffers the gradients of NVMe units pass through: LoHan's active gradient offloading
(§IV-C). When every unit is updated as soon as its gradients are complete, a unit's gradient is
needed only from its first gradient to its update, so host memory holds the gradients of the units
in flight between backward and the update worker, not of the model: a unit takes a buffer when its
first gradient arrives and gives it back once updated. With every buffer taken, backward waits for
the worker to finish an update; if nothing submitted holds one (a step that does not update in
backward), or the worker failed (and skips the updates that would give buffers back), a buffer of
its own is taken from the pinned overflow (``runtime/grads/overflow.py``, within the host budget)
and given back there after the update, so the step is never stuck.

Under data parallelism with sharded states, the gradients of a unit another rank owns pass
through a buffer too: it goes back once the reduction has sent them to the owner.

When the update must wait for every gradient (clipping by norm) or for more micro-batches
(accumulation), a unit's complete gradients go on from their buffer to NVMe, and come back into a
buffer for the next micro-batch to add to, or for the update (``GradientPath.spill``).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from ...planning.placement import HOST_SLOT_ALIGNMENT, align
from ..state import UnitState
from .overflow import GradientOverflow, PastRoom


def gradient_bytes(s: UnitState) -> int:
    """A unit's gradients in their masters' dtypes, and the landing area of its 16-bit ones."""
    nbytes = align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT)
    return nbytes + (align(s.unit.nbytes, HOST_SLOT_ALIGNMENT) if s.widened else 0)


class GradientBuffers:
    """The buffers, and which unit holds which; the units' gradient records pointing into them are
    the gradient path's (``GradientPath.take_buffer``, ``release_buffer``). ``overflow``: where
    buffers beyond the pool come from (pinned, counted in the host budget); an unpinned one
    without a bound where not given."""

    def __init__(self, slots: list[torch.Tensor], overflow: Optional[GradientOverflow] = None) -> None:
        self.free = list(slots)
        self.pooled = {t.data_ptr() for t in slots}
        self.slot_bytes = max((t.numel() for t in slots), default=0)
        self.overflow = overflow if overflow is not None else GradientOverflow(pin=False)
        self.held: dict[int, torch.Tensor] = {}  # unit index -> its buffer
        self.submitted: set[int] = set()  # units holding a buffer whose update is on the worker
        self.sending: dict[int, UnitState] = {}  # another rank's units holding a buffer until their reductions end
        self.changed = threading.Condition()
        self.extra = 0  # buffers made beyond the pool (over the run)
        self.most_held = 0
        # set by the updater: its worker failed, and skips the updates that would give buffers back
        self.worker_failed: Callable[[], bool] = lambda: False

    def acquire(self, s: UnitState) -> torch.Tensor:
        """The unit's first gradient arrives: a buffer for all of its gradients."""
        with self.changed:
            while not self.free and self.submitted and not self.worker_failed():
                self.changed.wait(timeout=0.05)
            if self.free:
                buffer = self.free.pop()
            else:  # as large as the pool's, so that any unit can take it once given back
                what = f"a gradient buffer beyond the plan's {len(self.pooled)} (for {s.unit.name!r})"
                past_room = PastRoom.IGNORE if self.worker_failed() else PastRoom.WARN
                buffer = self.overflow.take(max(gradient_bytes(s), self.slot_bytes), what, past_room)
                self.extra += 1
            self.held[s.unit.index] = buffer
            self.most_held = max(self.most_held, len(self.held))
        return buffer

    def sent(self, s: UnitState) -> None:
        """The unit's gradients are on their way to the rank that owns it: the buffer goes back once
        they have left (its reductions ended)."""
        if s.unit.index in self.held:
            self.sending[s.unit.index] = s

    def reclaimable(self) -> list[UnitState]:
        """With no buffer free, the units whose gradients have reached their owners, whose buffers
        may go back; when none has yet, the one sent first, to be waited for (the others are sent
        after it, in the canonical order)."""
        if self.free or not self.sending:
            return []
        done = [u for u in self.sending.values() if all(work.is_completed() for work in u.reductions)]
        return done or [next(iter(self.sending.values()))]

    def holds(self, s: UnitState) -> bool:
        return s.unit.index in self.held

    def buffer_of(self, s: UnitState) -> torch.Tensor:
        return self.held[s.unit.index]

    def wait_settled(self, s: UnitState) -> None:
        """The unit's buffer is no longer on the worker (its gradients written to NVMe, or updated)."""
        if s.unit.index not in self.submitted:  # the common case, on every gradient's arrival: no lock
            return
        with self.changed:
            while s.unit.index in self.submitted and not self.worker_failed():
                self.changed.wait(timeout=0.05)

    def submitted_for_update(self, s: UnitState) -> None:
        with self.changed:
            if s.unit.index in self.held:
                self.submitted.add(s.unit.index)

    def settled(self, s: UnitState) -> None:
        """The unit's update ran: its buffer is off the worker, even where it stays held (a
        parameter no optimizer steps keeps accumulating its gradient, as in plain training)."""
        with self.changed:
            self.submitted.discard(s.unit.index)
            self.changed.notify_all()

    def stop_sending(self, s: UnitState) -> None:
        """A unit sent to its owner: its reductions have ended (the collective reads the buffer until then)."""
        if self.sending.pop(s.unit.index, None) is not None:
            s.wait_reductions()

    def release(self, s: UnitState) -> None:
        """The unit's buffer goes back (no record points into it any more)."""
        self.stop_sending(s)
        with self.changed:
            buffer = self.held.pop(s.unit.index, None)
            self.submitted.discard(s.unit.index)
            if buffer is not None and buffer.data_ptr() in self.pooled:
                self.free.append(buffer)
            elif buffer is not None:
                self.overflow.give_back(buffer)
            self.changed.notify_all()
