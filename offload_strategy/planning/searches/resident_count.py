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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..cost_model import Machine, StepPrediction, UnitCost, simulate_step
from ..placement import GPU, NVME, Placement, PlacementError, UnitSize, place_units
from ..sharding import Sharding


@dataclass(frozen=True)
class PlacementCandidate:
    persistent: int  # how many of the first units in execution order stay resident
    buffers: int  # streaming buffers the placement made of the rest
    prediction: StepPrediction
    placement: Placement


def _feasible_counts(place: Callable[[int], Placement | PlacementError], counts: Sequence[int]) -> list[tuple[int, Placement]]:
    """The counts of persistent units whose placement fits, from ``counts`` (ascending). A count
    the GPU tier cannot hold ends them (all units, which need no streaming buffers, is tried
    after it); one host memory or NVMe cannot hold does not, since more resident units leave
    less for them. Where the GPU tier refuses a count right after host memory or NVMe refused the
    one before and none has fitted, the counts between are bisected for the most the GPU tier
    holds: the fit may lie between two tried counts. Raises the first refusal when none fits."""
    placed: list[tuple[int, Placement]] = []
    refused: Optional[PlacementError] = None
    previous = -1  # the last count tried, when it was refused for host memory or NVMe
    k = 0
    while k < len(counts):
        n = counts[k]
        k += 1
        result = place(n)
        if isinstance(result, Placement):
            placed.append((n, result))
            continue
        refused = refused or result
        if result.tier is not GPU:
            previous = n
            continue
        if not placed and previous >= 0 and n - previous > 1:
            placed += _most_the_gpu_holds(place, previous, n)
        k = max(k, len(counts) - 1)
    if not placed and refused is not None:
        raise refused  # no count fits: the budgets cannot hold the model
    return placed


def _most_the_gpu_holds(place: Callable[[int], Placement | PlacementError], low: int, high: int) -> list[tuple[int, Placement]]:
    """The largest count between ``low`` (refused elsewhere) and ``high`` (refused by the GPU
    tier) that the GPU tier holds, with its placement where everything fits."""
    best: Placement | PlacementError | None = None
    while high - low > 1:
        middle = (low + high) // 2
        result = place(middle)
        if isinstance(result, PlacementError) and result.tier is GPU:
            high = middle
        else:
            low, best = middle, result
    return [(low, best)] if isinstance(best, Placement) else []


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
    """Every feasible count of persistent units, fastest first (more persistent units on a tie);
    which counts are tried: :func:`_feasible_counts` (streaming everything may not fit host
    memory where keeping some units resident does).

    ``order``: unit indices in execution order; ``costs``: each unit's compute and update times
    (their ``home`` is ignored: the placement decides it). ``stride``: try every ``stride``-th
    count (and all units), as ProTrain's chunks group several modules: a coarser, faster search.
    ``sharding``: with sharded states, which rank keeps each unit's; ``gradients_until_update``
    and ``spill_gradients``: how long NVMe units' gradients live (see ``place_units``).
    """
    by_index = {u.index: u for u in sizes}

    def place(n: int) -> Placement | PlacementError:
        try:
            return place_units(
                sizes, co_resident, gpu_bytes=gpu_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes, state_factor=state_factor,
                persistent=set(order[:n]), all_on_gpu=n == len(order), sharding=sharding,
                gradients_until_update=gradients_until_update, spill_gradients=spill_gradients,
            )
        except PlacementError as error:
            return error

    candidates: list[PlacementCandidate] = []
    for n, placement in _feasible_counts(place, list(range(0, len(order), max(stride, 1))) + [len(order)]):
        units = []
        for i in order:
            home = placement.home[i]
            cost = costs[i]
            state = int(by_index[i].trainable_bytes * state_factor) if home == NVME and (sharding is None or sharding.owns(i)) else 0
            # a persistent unit's optimizer runs in the GPU tier: counted as free beside the CPU's
            update = 0.0 if home == "gpu" else cost.update_seconds
            units.append(dataclasses.replace(cost, home=home, state_bytes=state, update_seconds=update))
        buffers = sum(placement.device_slots.values())
        candidates.append(PlacementCandidate(n, buffers, simulate_step(units, buffers, machine, placement.host_copies), placement))
    candidates.sort(key=lambda c: (round(c.prediction.seconds, 9), -c.persistent))
    return candidates
