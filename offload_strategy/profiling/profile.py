"""``StepProfile``: what one profiled training step recorded, as plain JSON-serialisable data.

Recorded by module and autograd hooks during the first training step (10Cache §3.2.1), not by
wall-clock schedules: the order in which units are used (the prefetch table), their sizes, and the
compute time spent while each unit was in use (waits for units left out). The engine times every
training step the same way (``TieredEngine.last_timing``, without the order).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class StepProfile:
    unit_names: list[str]
    unit_bytes: list[int]
    order: list[int] = field(default_factory=list)  # unit indices in the order they were used
    forward_seconds: dict[int, float] = field(default_factory=dict)  # time inside the modules using each unit
    backward_seconds: dict[int, float] = field(default_factory=dict)  # from a unit's backward use to the next one's
    update_seconds: dict[int, float] = field(default_factory=dict)  # the optimizer's work on each offloaded unit
    outside_forward_seconds: float = 0.0  # forward compute in no unit's module (the loss)
    outside_backward_seconds: float = 0.0  # backward before the first offloaded unit's (loss, trailing persistent units)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StepProfile":
        data = json.loads(text)
        for key in ("forward_seconds", "backward_seconds", "update_seconds"):
            data[key] = {int(k): float(v) for k, v in data.get(key, {}).items()}
        return cls(**data)
