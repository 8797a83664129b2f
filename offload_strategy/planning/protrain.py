"""ProTrain's search for parameters (§3.1.1, §3.3): how many units stay resident against how many
streaming buffers the rest of the GPU tier holds, each candidate priced by the step model.

ProTrain keeps the first ``n_persist`` chunks in execution order resident for the whole step
(they are never transferred, and their optimizer runs on the GPU) and streams the others through
``n_buffer`` chunk buffers; more persistent chunks mean less traffic but fewer buffers to prefetch
into. Here every count of persistent units (the first ones in execution order) is placed with the
same placement the strategy runs, whose buffer sizing (10Cache's Alg. 1-2) fills what the
persistent units leave, and simulated with ``planning/cost_model.py``. Counts whose persistent
units leave too little room for the streaming working set end the search (larger counts leave
less).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from .cost_model import Machine, StepPrediction, UnitCost, simulate_step
from .placement import NVME, Placement, PlacementError, UnitSize, place_units
from .sharding import Sharding


@dataclass(frozen=True)
class PlacementCandidate:
    persistent: int  # how many of the first units in execution order stay resident
    buffers: int  # streaming buffers the placement made of the rest
    prediction: StepPrediction
    placement: Placement


def search_persistent(
    sizes: Sequence[UnitSize],
    co_resident: Sequence[Sequence[int]],
    order: Sequence[int],
    costs: Mapping[int, UnitCost],
    machine: Machine,
    *,
    gpu_bytes: int,
    host_bytes: int,
    nvme_bytes: int,
    state_factor: float,
    stride: int = 1,
    sharding: Optional[Sharding] = None,
    gradients_until_update: bool = False,
    spill_gradients: bool = False,
) -> list[PlacementCandidate]:
    """Every feasible count of persistent units, fastest first (more persistent units on a tie).

    ``order``: unit indices in execution order; ``costs``: each unit's compute and update times
    (their ``home`` is ignored: the placement decides it). ``stride``: try every ``stride``-th
    count (and all units), as ProTrain's chunks group several modules: a coarser, faster search.
    ``sharding``: with sharded states, which rank keeps each unit's; ``gradients_until_update``
    and ``spill_gradients``: how long NVMe units' gradients live (see ``place_units``).
    """
    by_index = {u.index: u for u in sizes}
    candidates: list[PlacementCandidate] = []
    counts = list(range(0, len(order), max(stride, 1))) + [len(order)]
    for n in counts:
        try:
            placement = place_units(
                sizes, co_resident, gpu_bytes=gpu_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes, state_factor=state_factor,
                persistent=set(order[:n]), all_on_gpu=n == len(order), sharding=sharding,
                gradients_until_update=gradients_until_update, spill_gradients=spill_gradients,
            )
        except PlacementError:
            if n == 0:
                raise  # not even fully streamed: the budgets cannot hold the model
            break
        units = []
        for i in order:
            home = placement.home[i]
            cost = costs[i]
            state = int(by_index[i].trainable_bytes * state_factor) if home == NVME and (sharding is None or sharding.owns(i)) else 0
            # a persistent unit's optimizer runs in the GPU tier: counted as free beside the CPU's
            update = 0.0 if home == "gpu" else cost.update_seconds
            units.append(dataclasses.replace(cost, home=home, state_bytes=state, update_seconds=update))
        buffers = sum(placement.device_slots.values())
        candidates.append(PlacementCandidate(n, buffers, simulate_step(units, buffers, machine), placement))
    candidates.sort(key=lambda c: (round(c.prediction.seconds, 9), -c.persistent))
    return candidates
