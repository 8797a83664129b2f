"""``StepProfile``: what one profiled training step recorded, as plain JSON-serialisable data.

Recorded by module and autograd hooks during the first training step (10Cache §3.2.1), not by
wall-clock schedules: the order in which units are used (the prefetch table), their sizes, and the
compute time spent while each unit was in use (waits for units left out). The engine times every
training step the same way (``TieredEngine.last_timing``, without the order).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass, field, replace


@dataclass
class StepProfile:
    unit_names: list[str]
    unit_bytes: list[int]
    order: list[int] = field(default_factory=list)  # unit indices in the order they were used
    forward_seconds: dict[int, float] = field(default_factory=dict)  # time inside the modules using each unit
    backward_seconds: dict[int, float] = field(default_factory=dict)  # from a unit's backward use to the next one's
    update_seconds: dict[int, float] = field(default_factory=dict)  # the optimizer's work on each offloaded unit
    outside_forward_seconds: float = 0.0  # forward compute before the first unit's module and from the last one's start to backward (the head and the loss)
    outside_backward_seconds: float = 0.0  # backward before the first offloaded unit's (loss, trailing persistent units)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StepProfile":
        data = json.loads(text)
        for key in ("forward_seconds", "backward_seconds", "update_seconds"):
            data[key] = {int(k): float(v) for k, v in data.get(key, {}).items()}
        return cls(**data)


def mean_timing(timings: list[StepProfile]) -> StepProfile:
    """The mean of several timed steps of one engine, unit by unit (a unit missing from a step
    counts as 0 there); the first one's order. Steps differ by a few percent on a busy host."""
    if not timings:
        raise ValueError("mean_timing needs at least one timed step.")
    first, n = timings[0], len(timings)

    def mean(key: str) -> dict[int, float]:
        units = {i for t in timings for i in getattr(t, key)}
        return {i: sum(getattr(t, key).get(i, 0.0) for t in timings) / n for i in sorted(units)}

    return StepProfile(
        unit_names=list(first.unit_names), unit_bytes=list(first.unit_bytes), order=list(first.order),
        forward_seconds=mean("forward_seconds"), backward_seconds=mean("backward_seconds"), update_seconds=mean("update_seconds"),
        outside_forward_seconds=sum(t.outside_forward_seconds for t in timings) / n,
        outside_backward_seconds=sum(t.outside_backward_seconds for t in timings) / n,
    )


def fastest_timing(timings: list[StepProfile]) -> StepProfile:
    """Unit by unit, the least of several timed steps of one engine; the last one's order. A
    neighbour process or the host only ever adds time to a step: the least of two warm steps is
    the work, unless the machine was busy in both."""
    if not timings:
        raise ValueError("fastest_timing needs at least one timed step.")
    last = timings[-1]

    def least(key: str) -> dict[int, float]:
        units = {i for t in timings for i in getattr(t, key)}
        return {i: min(getattr(t, key)[i] for t in timings if i in getattr(t, key)) for i in sorted(units)}

    return StepProfile(
        unit_names=list(last.unit_names), unit_bytes=list(last.unit_bytes), order=list(last.order),
        forward_seconds=least("forward_seconds"), backward_seconds=least("backward_seconds"), update_seconds=least("update_seconds"),
        outside_forward_seconds=min(t.outside_forward_seconds for t in timings),
        outside_backward_seconds=min(t.outside_backward_seconds for t in timings),
    )


SPIKE_FACTOR = 2.0  # a time over twice its group's median is a stall, not the work


def hold_spikes(seconds: Mapping[int, float], groups: Mapping[int, Hashable], factor: float = SPIKE_FACTOR) -> dict[int, float]:
    """Each time held to ``factor`` times the median of its group's (``groups``: index -> key;
    units whose parameters have the same shapes do the same work), so that a stall of a few units
    in one profiled step (a neighbour process, a page fault on first touch) does not decide the
    plan. A group of fewer than three has no majority to compare with and is kept as measured."""
    members: dict[Hashable, list[float]] = {}
    for index, value in seconds.items():
        members.setdefault(groups.get(index, ("alone", index)), []).append(value)
    medians = {key: statistics.median(values) for key, values in members.items() if len(values) >= 3}
    out = {}
    for index, value in seconds.items():
        median = medians.get(groups.get(index, ("alone", index)))
        out[index] = median if median is not None and value > factor * median else value
    return out


def steady_timing(timing: StepProfile, groups: Mapping[int, Hashable], factor: float = SPIKE_FACTOR) -> StepProfile:
    """``timing`` with every unit's forward and backward time held by :func:`hold_spikes`."""
    return replace(
        timing, order=list(timing.order),
        forward_seconds=hold_spikes(timing.forward_seconds, groups, factor), backward_seconds=hold_spikes(timing.backward_seconds, groups, factor),
    )
