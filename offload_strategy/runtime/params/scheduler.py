"""The prefetch table and the eviction choice of the 10Cache scheduler (§3.2.1, §3.4, Alg. 3-4).

One profiled training step records the order in which units are used (forward pre-hooks, then
backward unpacks of saved parameters). Later steps walk the table with a cursor: after each use
the next units in the table are prefetched into free GPU-tier buffers, and when a buffer is needed
the resident unit whose next use lies farthest ahead is evicted.

Deviations from 10Cache, and why:
- Alg. 3 evicts the tensor that just finished and prefetches into its buffer. We evict on demand,
  choosing by next use in the table (Belady's rule over the profiled order). This keeps the units
  used last in forward, which backward needs first, without a special case at the turn.
- Alg. 4's write-back on eviction is not needed for parameters: between optimizer steps the copy in
  the GPU tier equals the one at home, so eviction only frees the buffer.
- The profiled step may take several micro-batches (gradient accumulation): each starts the
  cursor again at the top, and a prefetch never reaches past the end of the micro-batch's own
  part of the table into the next one's forward. After the step's last backward no such forward
  comes before the updates, which write the units' homes (on the update worker, during backward)
  while, on CUDA, the copy out of them could still be queued; between micro-batches the training
  step may write at home first too (``TieredEngine.begin_step``).
- The cursor resynchronises on a use found a few entries ahead; on a use farther ahead (a step
  that skips layers: LayerDrop) it moves there too, counting the use as unexpected; a use the
  table holds nowhere ahead (eval loops, dynamic graphs) leaves it alone. Such uses are fetched on
  demand and counted: a changed order costs time, never correctness.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Optional

# How far ahead of the cursor a use may be found and still move the cursor there.
RESYNC_WINDOW = 8


class PrefetchTable:
    """Unit uses of one training step, in order."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.recording = False
        self.frozen = False
        self.cursor = 0
        self._positions: dict[int, list[int]] = {}
        self._starts: list[int] = []  # where each micro-batch after the first starts in the order

    def start_recording(self) -> None:
        self.order.clear()
        self._starts.clear()
        self.recording = True

    def freeze(self) -> None:
        """End of the profiled step: the table is fixed from here on."""
        self.recording = False
        self.frozen = bool(self.order)
        self._positions = {}
        for position, unit in enumerate(self.order):
            self._positions.setdefault(unit, []).append(position)

    def restart(self) -> None:
        """A training step (a micro-batch, under gradient accumulation) starts: from the top."""
        if self.recording and self.order:
            self._starts.append(len(self.order))
        self.cursor = 0

    def record(self, unit: int) -> bool:
        """Advance past a use of ``unit``; False when the table did not expect it here."""
        if self.recording:
            if not self.order or self.order[-1] != unit:
                self.order.append(unit)
            return True
        if not self.frozen:
            return False
        end = min(len(self.order), self.cursor + RESYNC_WINDOW)
        for position in range(self.cursor, end):
            if self.order[position] == unit:
                self.cursor = position + 1
                return True
        # A unit used again right after its entry (a module called twice) is expected too.
        if self.cursor > 0 and self.order[self.cursor - 1] == unit:
            return True
        # Further ahead: this step skips what the table holds in between (a layer LayerDrop
        # leaves out, a module skipped on some steps); the cursor follows, so that the next
        # units are prefetched again. Still counted as unexpected.
        ahead = self.next_use(unit)
        if ahead is not None:
            self.cursor += ahead + 1
        return False

    def upcoming(self, limit: int) -> Iterator[int]:
        """The next distinct units the table expects, at most ``limit`` entries ahead."""
        if not self.frozen:
            return iter(())
        return iter(self.order[self.cursor : min(self.cursor + limit, self._part_end())])

    def _part_end(self) -> int:
        """The end of the micro-batch's part of the table the cursor is in."""
        i = bisect.bisect_left(self._starts, self.cursor)
        return self._starts[i] if i < len(self._starts) else len(self.order)

    def next_use(self, unit: int) -> Optional[int]:
        """Distance from the cursor to the unit's next use this step; None if not used again."""
        positions = self._positions.get(unit)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor)
        return positions[i] - self.cursor if i < len(positions) else None

    def farthest(self, candidates: Iterable[int]) -> Optional[int]:
        """Belady's choice: the candidate needed last (or never again this step)."""
        best, best_distance = None, -1
        for unit in candidates:
            distance = self.next_use(unit)
            distance = 1 << 30 if distance is None else distance
            if distance > best_distance:
                best, best_distance = unit, distance
        return best
