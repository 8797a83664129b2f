"""Compute times of every training step, unit by unit, with the waits for units left out (what
the step model needs is compute, not the stalls of the placement that happened to run; ProTrain
§3.2's inter-operator view): a module's time runs from its start to the next module's start, a
unit's backward from its first saved tensor unpacked to the next unit's.

The times are the compute's own, read from marks the device records where the compute is queued
(``Device.mark_time``): on CUDA the host only launches kernels, and host time around a module is
its launch time plus whatever host wait falls inside it. The marks are read after the step (the
profiled step's at its end, with one wait for the GPU; the others' when first asked for)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from ..hardware.device import Device, TimeMark
from ..planning.profile import StepProfile
from .context import StepState


class _Part(enum.Enum):
    FORWARD = "forward"
    OUTSIDE_FORWARD = "outside forward"
    BACKWARD = "backward"
    OUTSIDE_BACKWARD = "outside backward"


@dataclass(frozen=True)
class _Mark:
    """Where an interval being timed began: its unit (None before the first), the compute's mark,
    and how many waits for units the step had made then."""

    unit: Optional[int]
    at: TimeMark
    stalls: int


@dataclass(frozen=True)
class _Interval:
    part: _Part
    unit: Optional[int]
    start: _Mark
    end: _Mark


@dataclass
class _Pending:
    """A timed step whose marks are not read yet."""

    timing: StepProfile
    intervals: list[_Interval]
    stalls: list[tuple[TimeMark, TimeMark]]


class StepTimer:
    """``timing`` is the step in progress, ``last_timing`` the last one whose optimizer step ran,
    ``profile`` the profiled first step's (with the order units were used in)."""

    def __init__(self, step: StepState, device: Device, unit_names: list[str], unit_bytes: list[int]) -> None:
        self.step = step
        self.device = device
        self.profile = StepProfile(unit_names=unit_names, unit_bytes=unit_bytes)
        self.timing: Optional[StepProfile] = None
        self._last_timing: Optional[StepProfile] = None
        self._pending: Optional[_Pending] = None
        self._intervals: list[_Interval] = []
        self._forward: Optional[_Mark] = None
        self._backward: Optional[_Mark] = None

    @property
    def last_timing(self) -> Optional[StepProfile]:
        if self._pending is not None:
            self._last_timing, self._pending = self._read(self._pending), None
        return self._last_timing

    def _mark(self, unit: Optional[int]) -> _Mark:
        stalls = self.step.stall_marks
        return _Mark(unit, self.device.mark_time(), 0 if stalls is None else len(stalls))

    def _close(self, part: _Part, mark: _Mark) -> None:
        self._intervals.append(_Interval(part, mark.unit, mark, self._mark(mark.unit)))

    def begin(self, train: bool) -> None:
        """A step starts (evaluation steps are not timed)."""
        self.timing = StepProfile(unit_names=self.profile.unit_names, unit_bytes=self.profile.unit_bytes) if train else None
        self.step.mark_stalls(train)
        self._intervals = []
        self._backward = None
        self._forward = self._mark(None) if train else None

    def module_starts(self, unit: int) -> None:
        """A module using ``unit`` starts: what ran since the last such start (the module before and
        the functional code after it, which hooks miss) is that module's unit's compute."""
        timing, mark = self.timing, self._forward
        if timing is None:
            return
        if mark is not None:
            self._close(_Part.OUTSIDE_FORWARD if mark.unit is None else _Part.FORWARD, mark)
        if unit not in timing.forward_seconds:
            timing.order.append(unit)
            timing.forward_seconds[unit] = 0.0
        self._forward = self._mark(unit)

    def begin_backward(self) -> None:
        """Forward's last interval (the head and the loss) ends."""
        if self.timing is None or self._forward is None:
            return
        self._close(_Part.OUTSIDE_FORWARD, self._forward)
        self._forward = None
        self._backward = self._mark(None)

    def unpacked(self, unit: int) -> None:
        """Backward unpacked a saved tensor of ``unit``: a new unit's backward interval starts
        (persistent units' backward falls in these intervals)."""
        if self.timing is not None and (self._backward is None or self._backward.unit != unit):
            self._close_backward()
            self._backward = self._mark(unit)

    def end_backward(self) -> None:
        if self.timing is not None:
            self._close_backward()
            self._backward = None

    def _close_backward(self) -> None:
        # None: the loss and the units kept in the GPU tier at the end of the model
        if self._backward is not None and self.timing is not None:
            self._close(_Part.OUTSIDE_BACKWARD if self._backward.unit is None else _Part.BACKWARD, self._backward)

    def _read(self, pending: _Pending) -> StepProfile:
        """The step's compute seconds from its marks, each interval less the waits for units in it."""
        between, timing = self.device.seconds_between, pending.timing
        for interval in pending.intervals:
            stalled = sum(between(a, b) for a, b in pending.stalls[interval.start.stalls:interval.end.stalls])
            elapsed = between(interval.start.at, interval.end.at) - stalled
            unit = interval.unit if interval.unit is not None else -1
            if interval.part is _Part.FORWARD:
                timing.forward_seconds[unit] = timing.forward_seconds.get(unit, 0.0) + elapsed
            elif interval.part is _Part.BACKWARD:
                timing.backward_seconds[unit] = timing.backward_seconds.get(unit, 0.0) + elapsed
            elif interval.part is _Part.OUTSIDE_FORWARD:
                timing.outside_forward_seconds += elapsed
            else:
                timing.outside_backward_seconds += elapsed
        return timing

    def finish(self, update_log: list[tuple[int, float, float]], profiled: bool) -> None:
        """Keep this step's compute and update times; the profiled step's are its profile's."""
        timing, self.timing = self.timing, None
        stalls = self.step.take_stalls()
        if timing is None:
            return
        for index, start, end in update_log:
            timing.update_seconds[index] = timing.update_seconds.get(index, 0.0) + end - start
        self._pending = _Pending(timing, self._intervals, stalls or [])
        self._intervals = []
        if profiled:
            read = self.last_timing
            assert read is not None
            self.profile.forward_seconds = dict(read.forward_seconds)
            self.profile.backward_seconds = dict(read.backward_seconds)
            self.profile.update_seconds = dict(read.update_seconds)
            self.profile.outside_forward_seconds = read.outside_forward_seconds
            self.profile.outside_backward_seconds = read.outside_backward_seconds
