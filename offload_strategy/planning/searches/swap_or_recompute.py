"""LoHan's activation swapping strategy (lohan.txt §IV-D, Algorithm 1), on measured block costs.

LoHan either swaps a layer's activations to host memory (or, past what host memory holds, the
SSD) or recomputes them. Its iteration-time model is Eq. 1-5: each pass takes as long as its
busiest resource (compute with recomputation, either PCIe direction, the SSD), and host memory
takes the swapped activations first, the SSD the rest (Eq. 3: α·A = A - MEM_avail). Here those
equations are :func:`~.activations.step_seconds` and :func:`~.activations.split_swaps`, priced on a
layout where a swapped block is ``swap_host`` / ``swap_nvme`` and every other block ``checkpoint``.

The search (Algorithm 1): blocks are taken in order of offloading benefit (Eq. 6, recompute work
over activation bytes: a block is better swapped than recomputed when it is costly to recompute or
cheap to move; the recompute work is the block's measured forward time, proportional to its FLOPs
on one device), each added to the swapped set while the predicted step time keeps falling. Since
the step time is convex in the swapped amount (§IV-D), the first rise marks the optimum, and the
three shapes of the curve are LoHan's three cases:

1. the step time only rises with the swapped amount: PCIe is the bottleneck even with full
   recomputation, so LoHan swaps the least that is safe;
2. it only falls: compute is the bottleneck even with everything swapped, so everything is swapped;
3. it falls then rises: the amount at the turn is optimal.

"Safe" is the GPU tier's budget: LoHan keeps swapping past the turn while the swapped amount is
under ``A_interBlock`` (the least that keeps its GPU memory from running out); here, while the
layout's activation peak (:func:`~.activations.peak_bytes`) is over ``gpu_bytes``. The algorithm
stops at the first layer that does not lower the time once the set chosen so far is safe (its
lines 11-13; the layer that made the time rise is not swapped). Unlike LoHan's, the runtime's
peak can rise with more swapping (a swapped block is brought back while the one below is still
on its way out): when the walk ends on a set that does not fit, the fastest prefix of the
benefit order that fits is taken instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..activations import (CHECKPOINT, CHECKPOINT_HOST, KEEP, SWAP_HOST, ActivationPlan, BlockCost, Links, nvme_swapped_bytes,
                          peak_bytes, split_swaps, step_seconds)

# what the step-time curve over the swapped amount looks like (§IV-D)
RISING, FALLING, TURNING = 1, 2, 3


@dataclass(frozen=True)
class LohanSearch:
    plan: ActivationPlan
    order: tuple[int, ...]  # blocks by offloading benefit, highest first
    curve: tuple[tuple[int, float], ...]  # (swapped bytes, predicted seconds) with the first 1, 2, ... blocks of ``order`` swapped
    case: int  # RISING, FALLING or TURNING: LoHan's case 1, 2 or 3


def offloading_benefit(cost: BlockCost) -> float:
    """Eq. 6: recompute work per byte of activations (seconds per byte here)."""
    return cost.forward_seconds / cost.activation_bytes if cost.activation_bytes else math.inf


def offloading_order(costs: Sequence[BlockCost]) -> list[int]:
    """Blocks by offloading benefit, highest first; ties keep forward order."""
    return sorted(range(len(costs)), key=lambda j: -offloading_benefit(costs[j]))


def _layout(costs: Sequence[BlockCost], swapped: set[int], host_bytes: int, recomputed: str = CHECKPOINT) -> list[str]:
    return split_swaps(costs, [SWAP_HOST if j in swapped else recomputed for j in range(len(costs))], host_bytes)


def curve_case(curve: Sequence[tuple[int, float]]) -> int:
    """Which of LoHan's three cases a step-time curve (in increasing swapped amount) is."""
    times = [t for _, t in curve]
    if all(b >= a - 1e-12 for a, b in zip(times, times[1:])):
        return RISING
    if all(b <= a + 1e-12 for a, b in zip(times, times[1:])):
        return FALLING
    return TURNING


def lohan_search(costs: Sequence[BlockCost], links: Links, gpu_bytes: int, host_bytes: int, head: int = 0) -> LohanSearch:
    """Algorithm 1 on ``costs`` (one per block, forward order). Without an NVMe link, swaps beyond
    ``host_bytes`` have nowhere to go and such sets do not fit. The recomputed blocks keep their
    inputs in the GPU tier where some set fits so, and otherwise in host memory (LoHan's
    ``A_interBlock``: the inter-block activations offloaded, the least that keeps the GPU's
    memory from running out). Raises ValueError with the smallest peak of any set when none fits
    ``gpu_bytes`` (``head``: :func:`~.activations.peak_bytes`)."""
    if not costs:
        raise ValueError("LoHan's activation search needs at least one block.")
    order = offloading_order(costs)
    least: list[int] = []  # the smallest peak of each walk that found no set fitting
    for recomputed in (CHECKPOINT, CHECKPOINT_HOST):
        walk = _walk(costs, order, links, gpu_bytes, host_bytes, head, recomputed)
        if not isinstance(walk, tuple):
            least += [] if walk is None else [walk]
            continue
        layout, seconds, peak = walk
        curve = [(sum(costs[j].activation_bytes for j in order[:k]), seconds[k]) for k in range(1, len(order) + 1)]
        plan = ActivationPlan(tuple(layout), step_seconds(costs, layout, links), peak)
        return LohanSearch(plan, tuple(order), tuple(curve), curve_case(curve))
    raise ValueError(
        f"LoHan's swapping leaves at least {min(least):,} bytes of activations in the GPU tier at the worst moment, "
        f"over the {gpu_bytes:,} bytes it has{'' if links.nvme_write > 0 else ' (and no NVMe tier to swap to beyond host memory)'}; "
        f"raise gpu_memory, lower the batch size or sequence length, or use activations='auto', which can also keep blocks."
    )


def _walk(costs: Sequence[BlockCost], order: Sequence[int], links: Links, gpu_bytes: int, host_bytes: int, head: int, recomputed: str):
    """Algorithm 1's walk with the recomputed blocks under ``recomputed``: (the chosen layout, the
    step seconds with the first k blocks of ``order`` swapped for each k, its peak); the smallest
    peak of any set where none fits; None where no set is possible (the inputs beyond host memory)."""
    if recomputed == CHECKPOINT_HOST and sum(c.input_bytes for c in costs) > host_bytes:
        return None
    # the first k blocks of the benefit order swapped, for k = 0 (all recomputed) .. all
    layouts = [_layout(costs, set(order[:k]), host_bytes, recomputed) for k in range(len(order) + 1)]
    seconds = [step_seconds(costs, layout, links) for layout in layouts]
    peaks = [peak_bytes(costs, layout, head) for layout in layouts]
    safe = [peak <= gpu_bytes and links.holds_on_nvme(nvme_swapped_bytes(costs, layout)) for peak, layout in zip(peaks, layouts)]
    chosen, best = 0, math.inf
    for k in range(1, len(order) + 1):
        if seconds[k] >= best - 1e-12 and safe[chosen]:
            break
        chosen, best = k, min(best, seconds[k])
    if not safe[chosen]:
        # here swapping more can raise the peak (a block coming back while another is on its
        # way out), so the walk may end on a set that does not fit: the fastest prefix that does
        fitting = [k for k in range(len(order) + 1) if safe[k]]
        if not fitting:
            return min(peaks)
        chosen = min(fitting, key=lambda k: (round(seconds[k], 12), k))
    return layouts[chosen], seconds, peaks[chosen]


def lohan_layout(costs: Sequence[BlockCost], links: Links, gpu_bytes: int, host_bytes: int, head: int = 0) -> ActivationPlan:
    """``activations="lohan"``: every block kept when that fits (nothing to manage), otherwise
    Algorithm 1's swapped set with the other blocks recomputed."""
    keep_all = [KEEP] * len(costs)
    if peak_bytes(costs, keep_all, head) <= gpu_bytes:
        return ActivationPlan(tuple(keep_all), step_seconds(costs, keep_all, links), peak_bytes(costs, keep_all, head))
    return lohan_search(costs, links, gpu_bytes, host_bytes, head).plan
