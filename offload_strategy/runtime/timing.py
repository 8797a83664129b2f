"""Compute times of every training step, unit by unit, with the waits for units left out (what
the step model needs is compute, not the stalls of the placement that happened to run; ProTrain
§3.2's inter-operator view): a module's time runs from its start to the next module's start, a
unit's backward from its first saved tensor unpacked to the next unit's."""

from __future__ import annotations

import time
from typing import Optional

from ..profiling import StepProfile
from .context import StepState

# where an interval being timed began: (unit, or None before the first unit; time; stalled seconds then)
_Mark = tuple[Optional[int], float, float]


class StepTimer:
    """``timing`` is the step in progress, ``last_timing`` the last one whose optimizer step ran,
    ``profile`` the profiled first step's (with the order units were used in)."""

    def __init__(self, step: StepState, unit_names: list[str], unit_bytes: list[int]) -> None:
        self.step = step
        self.profile = StepProfile(unit_names=unit_names, unit_bytes=unit_bytes)
        self.timing: Optional[StepProfile] = None
        self.last_timing: Optional[StepProfile] = None
        self._forward: Optional[_Mark] = None
        self._backward: Optional[_Mark] = None

    def _mark(self, unit: Optional[int]) -> _Mark:
        return (unit, time.perf_counter(), self.step.stalled_seconds)

    def _elapsed(self, mark: _Mark) -> float:
        return time.perf_counter() - mark[1] - (self.step.stalled_seconds - mark[2])

    def begin(self, train: bool) -> None:
        """A step starts (evaluation steps are not timed)."""
        self.timing = StepProfile(unit_names=self.profile.unit_names, unit_bytes=self.profile.unit_bytes) if train else None
        self._backward = None
        self._forward = self._mark(None)

    def module_starts(self, unit: int) -> None:
        """A module using ``unit`` starts: what ran since the last such start (the module before and
        the functional code after it, which hooks miss) is that module's unit's compute."""
        timing, mark = self.timing, self._forward
        if timing is not None and mark is not None:
            previous, elapsed = mark[0], self._elapsed(mark)
            if previous is None:
                timing.outside_forward_seconds += elapsed
            else:
                timing.forward_seconds[previous] = timing.forward_seconds.get(previous, 0.0) + elapsed
            if unit not in timing.forward_seconds:
                timing.order.append(unit)
                timing.forward_seconds[unit] = 0.0
        self._forward = self._mark(unit)

    def begin_backward(self) -> None:
        """Forward's last interval (the head and the loss) ends."""
        if self.timing is None or self._forward is None:
            return
        self.timing.outside_forward_seconds += self._elapsed(self._forward)
        self._forward = None
        self._backward = self._mark(None)

    def unpacked(self, unit: int) -> None:
        """Backward unpacked a saved tensor of ``unit``: a new unit's backward interval starts
        (persistent units' backward falls in these intervals)."""
        if self.timing is not None and (self._backward is None or self._backward[0] != unit):
            self._close_backward()
            self._backward = self._mark(unit)

    def end_backward(self) -> None:
        if self.timing is not None:
            self._close_backward()
            self._backward = None

    def _close_backward(self) -> None:
        mark, timing = self._backward, self.timing
        if mark is None or timing is None:
            return
        unit, elapsed = mark[0], self._elapsed(mark)
        if unit is None:  # the loss and the units kept in the GPU tier at the end of the model
            timing.outside_backward_seconds += elapsed
        else:
            timing.backward_seconds[unit] = timing.backward_seconds.get(unit, 0.0) + elapsed

    def finish(self, update_log: list[tuple[int, float, float]], profiled: bool) -> None:
        """Keep this step's compute and update times; the profiled step's are its profile's."""
        timing, self.timing = self.timing, None
        if timing is None:
            return
        for index, start, end in update_log:
            timing.update_seconds[index] = timing.update_seconds.get(index, 0.0) + end - start
        self.last_timing = timing
        if profiled:
            self.profile.forward_seconds = dict(timing.forward_seconds)
            self.profile.backward_seconds = dict(timing.backward_seconds)
            self.profile.update_seconds = dict(timing.update_seconds)
            self.profile.outside_forward_seconds = timing.outside_forward_seconds
            self.profile.outside_backward_seconds = timing.outside_backward_seconds
