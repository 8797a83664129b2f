"""How long a unit fetched by a checkpointed block's recomputation stays in the GPU tier.

The recomputation hands the block's backward the tensors its forward saved, computed again; some
of them are views of a unit's GPU-tier buffer (a weight, its transpose), which the checkpoint
keeps until the node that saved them has run. So the buffer may not take another unit before.

Each call of a checkpointed block (``runtime/activations/policies.py::_checkpointed``) is tracked by a
:class:`Recomputation`: in its forward, the checkpoint's saved-tensor hooks are wrapped so that
every saved tensor viewing a streamed unit's buffer is counted (``saved``); in each backward (one
autograd graph task, ``torch._C._current_graph_task_id``) its recomputation holds the units it
fetches, and a unit is let go as soon as the last of its views has been unpacked by the node that
needs it (a unit none of whose views were saved, right after the recomputation), and whatever is
still held when that backward ends. So a block's units leave with that block's backward in that
graph, not when their gradients are complete: two forwards before one backward (a siamese pair,
a consistency loss) complete their gradients only in the second graph's backward, and held every
recomputed block's units until then, more than the GPU tier the planner sized for one block's
units at a time.

A unit fetched by a recomputation that is not this runtime's (the model's own checkpointing) has
no count: a unit with parameters to train is let go once its gradients are in (the engine calls
:meth:`gradients_complete`), a frozen one when the step ends.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..state import UnitState


@dataclass
class _Run:
    """One backward's recomputation of one block call."""

    generation: int  # the step it belongs to (RecomputeHolds.reset starts a new one)
    held: Counter[int] = field(default_factory=Counter)  # the units it fetched, and how often
    left: Counter[int] = field(default_factory=Counter)  # per unit, the saved views still to be unpacked
    queued: bool = False  # its release at the end of the backward is queued


@dataclass(frozen=True)
class _View:
    """What the checkpoint packed for a saved tensor that views ``unit``'s buffer."""

    packed: Any
    unit: int


class Recomputation:
    """One call of a checkpointed block: the views of units its forward saved, and per backward
    what its recomputation holds."""

    def __init__(self, holds: RecomputeHolds) -> None:
        self.holds = holds
        self.saved: Counter[int] = Counter()  # per unit, the saved tensors viewing its buffer
        self._runs: dict[int, _Run] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Around the block's forward inside the checkpoint: the checkpoint's saved-tensor hooks
        (on top now) wrapped, so that views of a unit's buffer are counted when saved and when
        unpacked."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            yield
            return
        pack, unpack = top
        owner = self.holds.owner

        def counted_pack(t: torch.Tensor) -> Any:
            packed = pack(t)
            unit = owner(t)
            if unit is None:
                return packed
            self.saved[unit] += 1
            return _View(packed, unit)

        def counted_unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, _View):
                return unpack(packed)
            t = unpack(packed.packed)  # the first one recomputes the block
            self.holds.unpacked(self._run(), packed.unit)
            return t

        with torch.autograd.graph.saved_tensors_hooks(counted_pack, counted_unpack):
            yield

    def _run(self) -> _Run:
        task = torch._C._current_graph_task_id()
        run = self._runs.get(task)
        if run is None or run.generation != self.holds.generation:
            run = self._runs[task] = _Run(self.holds.generation, left=Counter(self.saved))
        return run

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Around the block's recomputation in a backward: the units it fetches are held for it."""
        run = self._run()
        try:
            with self.holds.recomputing(run):
                yield
        finally:  # also when the checkpoint stops it early, every saved tensor recomputed
            self.holds.recomputed(run)


class RecomputeHolds:
    """See the module docstring. ``owner``: the streamed unit whose GPU-tier buffer a tensor views
    (None: none)."""

    def __init__(self, states: Sequence[UnitState], owner: Callable[[torch.Tensor], Optional[int]]) -> None:
        self.states = states
        self.owner = owner
        self.generation = 0
        self._run: Optional[_Run] = None  # the recomputation running now
        self._holds: Counter[int] = Counter()  # per unit, the holds of recomputations' runs
        self._ungrouped: set[int] = set()  # fetched by a recomputation no run tracks

    def track(self) -> Recomputation:
        """A checkpointed block is called: its views and recomputations are tracked."""
        return Recomputation(self)

    @contextlib.contextmanager
    def recomputing(self, run: _Run) -> Iterator[None]:
        previous, self._run = self._run, run
        try:
            yield
        finally:
            self._run = previous

    def fetched(self, s: UnitState) -> None:
        """``s`` was fetched by a recomputation: it stays in the GPU tier until let go."""
        s.recompute_pinned = True
        index = s.unit.index
        run = self._run
        if run is None:
            self._ungrouped.add(index)
            return
        run.held[index] += 1
        self._holds[index] += 1

    def recomputed(self, run: _Run) -> None:
        """The run's recomputation has ended: the units it fetched of which no view was saved go,
        and whatever it still holds goes when this backward ends."""
        for index in [i for i in run.held if run.left[i] <= 0]:
            self._release(run, index)
        if not run.queued and run.held and torch._C._current_graph_task_id() != -1:
            run.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._release_all(run))

    def unpacked(self, run: _Run, index: int) -> None:
        """A node unpacked a view of unit ``index`` in the run's backward: the last one lets it go
        (the node computes with it before any other unit is fetched)."""
        run.left[index] -= 1
        if run.left[index] <= 0:
            self._release(run, index)

    def _release_all(self, run: _Run) -> None:
        for index in list(run.held):
            self._release(run, index)

    def _release(self, run: _Run, index: int) -> None:
        count = run.held.pop(index, 0)
        if not count or run.generation != self.generation:
            return
        self._holds[index] -= count
        if self._holds[index] <= 0:
            del self._holds[index]
            self._unpin(index)

    def gradients_complete(self, s: UnitState) -> None:
        """Every gradient of ``s`` is in: a recomputation no run tracks no longer needs it."""
        self._ungrouped.discard(s.unit.index)
        self._unpin(s.unit.index)

    def _unpin(self, index: int) -> None:
        if index not in self._holds and index not in self._ungrouped:
            self.states[index].recompute_pinned = False

    def reset(self) -> None:
        """A step begins or ends: every hold is dropped with it."""
        self.generation += 1
        self._holds.clear()
        self._ungrouped.clear()
        for s in self.states:
            s.recompute_pinned = False
