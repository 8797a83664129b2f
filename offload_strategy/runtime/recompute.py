"""How long a unit fetched by a checkpointed block's recomputation stays in the GPU tier.

The recomputed graph holds the unit's parameters (views of its GPU-tier buffer) until the block's
backward has used them, so the buffer may not take another unit before. A unit with parameters to
train is let go once its gradients are in (``GradientPath``); a unit with nothing to train (a
frozen base under adapters, layers a finetuning callback has not unfrozen yet) has no gradient to
say so, and was held until the step ended: every frozen unit of every recomputed block at once,
more than the GPU tier the planner sized for one block's units at a time.

:class:`RecomputeHolds` lets them go when their block's backward is done: the block's checkpoint
(``runtime/activations.py``) runs its recomputation inside :meth:`recomputing`, which collects the
frozen units fetched there, and hooks the gradients of the block's inputs; once every one of them
is computed, nothing of the block's backward is left, and :meth:`release` lets the units go. A
block whose inputs need no gradient, and a recomputation that is not this runtime's (the model's
own checkpointing), keep the units until the step ends, as before.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Optional

from .state import UnitState


class RecomputeHolds:
    """See the module docstring."""

    def __init__(self, states: Sequence[UnitState]) -> None:
        self.states = states
        self._group: Optional[list[int]] = None  # the recomputation running now: the frozen units it fetched
        self._holds: Counter[int] = Counter()  # per frozen unit, the recomputations that hold it
        self._until_step_end: set[int] = set()  # fetched by a recomputation no group tracks

    @contextlib.contextmanager
    def recomputing(self, group: list[int]) -> Iterator[None]:
        previous, self._group = self._group, group
        try:
            yield
        finally:
            self._group = previous

    def fetched(self, s: UnitState) -> None:
        """``s`` was fetched by a recomputation (and is pinned): a frozen unit inside a group is
        held for that group."""
        index = s.unit.index
        if s.unit.trainable:
            return  # let go when its gradients are in
        if self._group is None:
            self._until_step_end.add(index)
            return
        self._group.append(index)
        self._holds[index] += 1

    def release(self, group: list[int]) -> None:
        """The group's block has finished its backward: its frozen units may leave the GPU tier."""
        for index in group:
            self._holds[index] -= 1
            if self._holds[index] <= 0:
                del self._holds[index]
                if index not in self._until_step_end:
                    self.states[index].recompute_pinned = False
        group.clear()

    def reset(self) -> None:
        """A step begins or ends: every pin is dropped with it."""
        self._holds.clear()
        self._until_step_end.clear()
