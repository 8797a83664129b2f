"""The update pipeline of NVMe units on the worker (LoHan Fig. 3b): read unit i+1, update unit i,
write unit i-1. It owns the update buffers (``TierMemory.update_pool``), so the worker never
shares a staging buffer with the fetch path.

The training thread starts a unit's reads as its gradients complete (one unit ahead, with buffers
that are free); the worker takes them when it updates the unit, or takes the buffers back when it
runs short; writes are left in flight while the next unit updates and reaped as buffers are needed.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Optional

from ...memory import Slot
from ...planning.placement import HOST_SLOT_ALIGNMENT, align
from ..context import EngineContext
from .nvme_states import NvmeOptimizerStates
from ..state import UnitState

# a unit's reads ahead: (parameter buffer, state buffer or None, the reads in flight)
ReadAhead = tuple[Slot, Optional[Slot], list[Any]]


class NvmeUpdatePipeline:
    def __init__(self, ctx: EngineContext, nvme_states: NvmeOptimizerStates) -> None:
        self.ctx = ctx
        self.nvme_states = nvme_states
        self.pool = ctx.memory.update_pool
        self.reads_ahead: dict[int, ReadAhead] = {}
        self.writes_behind: deque[tuple[list[Any], list[Slot]]] = deque()
        self.lock = threading.Lock()  # the update pool and the reads ahead, shared with the worker
        self.counts = {"reads_ahead": 0, "writes_behind": 0}  # updates that found their reads done ahead / a write still behind

    def start_reads(self, s: UnitState) -> None:
        """Training thread, as the unit's gradients complete: read its parameters and states from
        NVMe now, while the worker is busy with the units before it."""
        if self.reads_ahead:
            return
        size = self.pool.classes[0].slot_bytes
        known = self.nvme_states.known(s.unit.index)
        # under the lock, so that the worker never sees these buffers taken but not yet listed
        with self.lock:
            if self.pool.free_slots(size) < (2 if known else 1):
                return
            params = self.pool.try_acquire(s.unit.nbytes)
            states = self.pool.try_acquire(self.nvme_states.sizes[s.unit.index]) if known and params is not None else None
            if params is None or (known and states is None):
                for got in (params, states):
                    if got is not None:
                        self.pool.release(got)
                return
            reads = [self.nvme_states.store.read(self.ctx.key(s), params.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)])]
            if states is not None:
                reads.append(self.nvme_states.read(s.unit.index, states.tensor))
            self.reads_ahead[s.unit.index] = (params, states, reads)

    def take_reads(self, index: int) -> Optional[ReadAhead]:
        """Worker: the unit's reads ahead, if they were started."""
        with self.lock:
            return self.reads_ahead.pop(index, None)

    def buffer(self, nbytes: int) -> Slot:
        """Worker: a free update buffer, waiting for the oldest write behind if there is none,
        else taking back the buffers of a read ahead (that unit will then read for itself)."""
        while True:
            with self.lock:
                slot = self.pool.try_acquire(nbytes)
                if slot is not None:
                    return slot
                taken = None
                if not self.writes_behind:
                    if not self.reads_ahead:
                        return self.pool.acquire(nbytes)  # raises with the numbers
                    _, taken = self.reads_ahead.popitem()
            if taken is None:
                self.reap(block=True, one=True)
                continue
            params, states, reads = taken
            for r in reads:
                r.exception()
            # released and taken in one hold, so that a new read ahead cannot take them in between
            with self.lock:
                self.pool.release(params)
                if states is not None:
                    self.pool.release(states)
                slot = self.pool.try_acquire(nbytes)
                if slot is not None:
                    return slot

    def before_update(self) -> None:
        """Worker, before a unit's update: count a write still behind, release finished ones."""
        if self.writes_behind and not all(w.done() for w in self.writes_behind[-1][0]):
            self.counts["writes_behind"] += 1  # the last unit is still being written
        self.reap(block=False)

    def write_behind(self, writes: list[Any], buffers: list[Slot]) -> None:
        self.writes_behind.append((writes, buffers))

    def reap(self, block: bool, one: bool = False) -> None:
        """Release the buffers of finished writes (waiting for them with ``block``). Only the
        worker, or the training thread once the worker is idle, calls this."""
        while self.writes_behind:
            writes, buffers = self.writes_behind[0]
            if not block and not all(w.done() for w in writes):
                return
            self.writes_behind.popleft()
            for w in writes:
                w.result()  # a failed write (a full disk) fails the update
            for buffer in buffers:
                self.pool.release(buffer)
            if one:
                return

    def finish(self) -> None:
        """Training thread, worker idle: every write done, every unused read released."""
        try:
            self.reap(block=True)
        finally:
            for params, states, reads in self.reads_ahead.values():
                for r in reads:
                    r.exception()
                self.pool.release(params)
                if states is not None:
                    self.pool.release(states)
            self.reads_ahead.clear()
