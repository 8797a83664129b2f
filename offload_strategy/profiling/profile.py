"""``StepProfile``: what one profiled training step recorded, as plain JSON-serialisable data.

Recorded by module and autograd hooks during the first training step (10Cache §3.2.1), not by
wall-clock schedules: the order in which units are used (the prefetch table), their sizes, and the
compute time spent while each unit was in use.
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StepProfile":
        data = json.loads(text)
        for key in ("forward_seconds", "backward_seconds"):
            data[key] = {int(k): float(v) for k, v in data[key].items()}
        return cls(**data)
