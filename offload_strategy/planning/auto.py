"""The auto policy's joint search: parameters and activations priced together by the step model.

ProTrain §3.3 searches the persistent chunks, the chunk buffers, and the swapped and checkpointed
blocks as one space, ordered by memory, and keeps the fastest configuration that fits. Here the
GPU tier is split between the two:

- the activations' side is the Pareto front of ProTrain's interleaved layouts under LoHan's
  step-time model (:func:`~.activations.layout_frontier`): each layout on it is faster than every
  layout that needs less of the GPU tier (and, below the least peak of those, the layouts that
  recompute from inputs in host memory, visited last: they serve only where nothing else fits);
- for a layout's peak, the parameters get the rest of the GPU tier, and
  :func:`~.protrain.search_persistent` finds how many leading units stay resident and how many
  streaming buffers the rest makes, pricing each with the discrete-event model (:mod:`.cost_model`);
- a split's step is the parameters' predicted step with its layout's work and traffic added
  (:func:`layout_added_seconds`): recomputes lengthen backward, and swaps share the links with
  the parameters' own copies (their forward copies host -> GPU, their backward refetches), so a
  pass lasts at least as long as its busiest link.

Front layouts are visited fastest first (largest peak first), and the visit stops once the
layout beside the parameters' best placement with the whole GPU tier cannot beat the best split
found: parameters are never faster with less of the GPU tier (each pass, and the bytes they copy
in, only grow, and a pass with the layout is the longer of its own and the layout's), and layouts
further along the front only cost more. The front's swaps are split between host memory and NVMe
for the host room the caller expects; where a placement's streamed units leave less, the front is
made again for the room they leave, and the faster of the two searches' plans is kept. With many
units the resident count is tried in steps (ProTrain's chunks group modules the same way), which keeps a 48-block model well under a second.

Pure: profiles and budgets in, a plan out, or a :class:`~.placement.PlacementError` that says what
the GPU tier would need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..config import Tier
from .activations import (CHECKPOINT_HOST, KEEP, RECOMPUTED, SWAP_NVME, ActivationPlan, BlockCost, Links, layout_frontier,
                          move_seconds, recomputes)
from .cost_model import Machine, StepPrediction, UnitCost
from .placement import PlacementError, UnitSize, minimum_gpu_bytes
from .searches.resident_count import PlacementCandidate, search_persistent
from .sharding import Sharding

# resident counts tried per search at most; more units are tried in steps
SEARCH_POINTS = 48


@dataclass(frozen=True)
class AutoPlan:
    parameters: PlacementCandidate
    activations: Optional[ActivationPlan]  # None: the model has no blocks to manage
    seconds: float  # predicted step: the parameters' step plus what the layout adds


def plan_auto(
    sizes: Sequence[UnitSize],
    co_resident: Sequence[Sequence[int]],
    order: Sequence[int],
    unit_costs: Mapping[int, UnitCost],
    machine: Machine,
    *,
    gpu_bytes: int,
    host_bytes: int,
    nvme_bytes: int,
    state_factor: float,
    blocks: Sequence[BlockCost] = (),
    links: Optional[Links] = None,
    activation_host_bytes: int = 0,
    block_units: Sequence[Sequence[int]] = (),
    sharding: Optional[Sharding] = None,
    gradients_until_update: bool = False,
    spill_gradients: bool = False,
    head: int = 0,
) -> AutoPlan:
    """The fastest plan within the budgets; see the module docstring.

    ``blocks``: profiled costs of the repeated blocks (none: parameters only); ``links``: the
    bandwidths activation swaps use and the parameter traffic they compete with; ``activation_host_bytes``:
    host memory left for swapped activations; ``block_units``: the units each block uses, which a
    checkpointed block's recompute needs resident together; ``sharding``: with sharded states,
    which rank keeps each unit's; ``gradients_until_update``, ``spill_gradients``: how long NVMe
    units' gradients live, as the runtime will keep them (``placement.place_units``); ``head``: what
    the head's backward holds beyond the blocks' moments (``activations.peak_bytes``).
    """
    stride = max(1, len(order) // SEARCH_POINTS) if blocks else 1
    parameters = _ParameterSearch(
        sizes, co_resident, block_units, order, unit_costs, machine, host_bytes, nvme_bytes, state_factor, stride, sharding,
        (gradients_until_update, spill_gradients),
    )

    if not blocks:
        only = parameters(gpu_bytes)
        return AutoPlan(only, None, only.prediction.seconds)
    if links is None:
        links = Links.beside(machine)
    smallest = (minimum_gpu_bytes(sizes, co_resident), minimum_gpu_bytes(sizes, [*co_resident, *block_units]))
    visit = _FrontVisit(parameters, sizes, blocks, links, gpu_bytes, smallest, head)
    found = visit(activation_host_bytes)
    if found.host_room is not None and found.host_room < activation_host_bytes:
        # Layouts were split between host and NVMe for host room the placements' streamed units
        # then took: split them again for the room those leave (their swaps beyond it go to NVMe,
        # or, without a path there, the layouts that recompute instead come onto the front).
        again = visit(found.host_room)
        best = min((p for p in (found.best, again.best) if p is not None), key=lambda p: p.seconds, default=None)
        found = _Visited(best, found.elsewhere or again.elsewhere, None, again.front)
    if found.best is None:  # more of the GPU tier would not help where host memory or NVMe was short
        raise found.elsewhere or _no_layout_fits(found.front, gpu_bytes, *smallest)
    return found.best


@dataclass(frozen=True)
class _Visited:
    best: Optional[AutoPlan]
    elsewhere: Optional[PlacementError]  # a split refused for host memory or NVMe, not the GPU tier
    host_room: Optional[int]  # the least host room a placement left a layout whose host swaps did not fit it
    front: Sequence[ActivationPlan]


@dataclass(frozen=True)
class _FrontVisit:
    """The front's layouts, fastest first, each beside the parameters' best placement in what it
    leaves of the GPU tier (see the module docstring)."""

    parameters: "_ParameterSearch"
    sizes: Sequence[UnitSize]
    blocks: Sequence[BlockCost]
    links: Links
    gpu_bytes: int
    smallest: tuple[int, int]  # the parameters' least GPU tier without and with a recomputed block's units
    head: int = 0  # what the head's backward holds beyond the blocks' moments

    def __call__(self, activation_host_bytes: int) -> _Visited:
        front = layout_frontier(self.blocks, self.links, activation_host_bytes, self.head)
        if front and self.gpu_bytes - front[0].peak_bytes >= self.smallest[0]:
            # the layout with the smallest peak leaves the parameters the most of the GPU tier:
            # where host memory or NVMe cannot hold them there, they cannot beside any layout
            try:
                self.parameters(self.gpu_bytes - front[0].peak_bytes)
            except PlacementError as error:
                if error.tier is not Tier.GPU:
                    return _Visited(None, error, None, front)
        fastest_parameters: Optional[PlacementCandidate] = None  # with the whole GPU tier: a bound for every split
        best: Optional[AutoPlan] = None
        elsewhere: Optional[PlacementError] = None
        host_room: Optional[int] = None
        for layout in reversed(front):  # fastest layout (largest peak) first
            if best is not None and fastest_parameters is not None and self._priced(fastest_parameters, layout) >= best.seconds:
                break
            candidate, refused, room = _parameters_beside(self.parameters, layout, self.blocks, self.gpu_bytes, self.smallest)
            elsewhere = elsewhere or refused
            host_room = room if host_room is None or (room is not None and room < host_room) else host_room
            if candidate is None:
                continue
            if fastest_parameters is None:
                fastest_parameters = self.parameters(self.gpu_bytes)
            total = self._priced(candidate, layout)
            if best is None or total < best.seconds - 1e-12:
                best = AutoPlan(candidate, layout, total)
        return _Visited(best, elsewhere, host_room, front)

    def _priced(self, candidate: PlacementCandidate, layout: ActivationPlan) -> float:
        return _priced(candidate, self.sizes, self.blocks, layout, self.links)


def _priced(candidate: PlacementCandidate, sizes: Sequence[UnitSize], blocks: Sequence[BlockCost], layout: ActivationPlan, links: Links) -> float:
    """The split's step: the parameters' and what the layout adds beside them."""
    streamed = sum(u.nbytes for u in sizes if candidate.placement.home.get(u.index, Tier.GPU) != Tier.GPU)
    return candidate.prediction.seconds + layout_added_seconds(candidate.prediction, streamed, blocks, layout.layout, links)


def recompute_seconds(blocks: Sequence[BlockCost], layout: Sequence[str]) -> float:
    return sum(b.forward_seconds for b, policy in zip(blocks, layout) if policy in RECOMPUTED)


def layout_added_seconds(
    parameters: StepPrediction, streamed_bytes: int, blocks: Sequence[BlockCost], layout: Sequence[str], links: Links,
) -> float:
    """What ``layout`` adds to the parameters' predicted step (LoHan Eq. 2 and 5, each pass as
    long as its busiest resource, with the parameters' traffic on the same links): forward lasts
    at least its swaps out (GPU -> host, and on to NVMe); backward at least its recomputes on top
    of its own work, and at least the parameters' refetches plus the swaps coming back on the
    host -> GPU link (and the NVMe reads). ``streamed_bytes``: the offloaded units' bytes, which
    forward copies in once; what the parameters copy in beyond that is backward's refetch."""
    swapped = sum(b.moved_bytes(policy) for b, policy in zip(blocks, layout))
    on_nvme = sum(b.activation_bytes for b, policy in zip(blocks, layout) if policy == SWAP_NVME)
    refetched = max(parameters.h2d_bytes - streamed_bytes, 0)
    forward = max(parameters.forward_seconds, move_seconds(swapped, links.d2h), move_seconds(on_nvme, links.nvme_write))
    backward = max(
        parameters.backward_seconds + recompute_seconds(blocks, layout),
        move_seconds(refetched + swapped, links.h2d) if swapped else 0.0,  # the parameters' own refetches are priced already
        move_seconds(on_nvme, links.nvme_read),
    )
    return forward - parameters.forward_seconds + backward - parameters.backward_seconds


def _parameters_beside(
    parameters: "_ParameterSearch", layout: ActivationPlan, blocks: Sequence[BlockCost], gpu_bytes: int, smallest: tuple[int, int],
) -> tuple[Optional[PlacementCandidate], Optional[PlacementError], Optional[int]]:
    """The parameters' best placement in what ``layout`` leaves of the GPU tier, when every budget
    holds both (the layout's host swaps beside the units streamed from host memory, its NVMe swaps
    beside the NVMe units' files); otherwise the
    refusal, when it was host memory or NVMe that fell short, or the host room the placement left
    when the layout's host swaps did not fit it. ``smallest``: the parameters' least GPU tier
    without and with a recomputed block's units together."""
    recompute = recomputes(layout.layout)
    budget = gpu_bytes - layout.peak_bytes
    host_bytes, nvme_bytes = parameters.host_bytes, parameters.nvme_bytes
    if budget < smallest[recompute]:
        return None, None, None
    try:
        candidate = parameters(budget, recompute)
    except PlacementError as error:
        return None, (error if error.tier is not Tier.GPU else None), None
    swapped = sum(b.host_bytes(policy) for b, policy in zip(blocks, layout.layout))
    if swapped > host_bytes - candidate.placement.host_bytes:
        return None, None, max(host_bytes - candidate.placement.host_bytes, 0)  # the layout was priced with host room this placement's streamed units take
    on_nvme = sum(b.activation_bytes for b, policy in zip(blocks, layout.layout) if policy == SWAP_NVME)
    if on_nvme > nvme_bytes - candidate.placement.nvme_bytes:
        return None, None, None  # ... or with NVMe room its units' parameters and states take
    return candidate, None, None


def _no_layout_fits(front: Sequence[ActivationPlan], gpu_bytes: int, smallest_parameters: int, smallest_with_blocks: int) -> PlacementError:
    """Each layout with the parameters' smallest working set beside it (a whole block's units when
    it recomputes): the least of them is the GPU tier to ask for."""
    need = min((layout.peak_bytes + (smallest_with_blocks if recomputes(layout.layout) else smallest_parameters), layout) for layout in front)
    return PlacementError(
        f"gpu_memory={gpu_bytes:,} bytes cannot hold the activations of any layout beside the parameters' smallest working set: "
        f"the least is {need[0]:,} bytes ({need[1].peak_bytes:,} for the activations laid out {describe_layout(need[1].layout)}, "
        f"the rest for the parameters); raise gpu_memory to at least that, or lower the batch size or sequence length."
    )


@dataclass(frozen=True)
class _ParameterSearch:
    """ProTrain's search of the parameters' placement within ``budget`` bytes of the GPU tier;
    with ``recompute``, a checkpointed block's units must also fit resident together."""

    sizes: Sequence[UnitSize]
    co_resident: Sequence[Sequence[int]]
    block_units: Sequence[Sequence[int]]
    order: Sequence[int]
    unit_costs: Mapping[int, UnitCost]
    machine: Machine
    host_bytes: int
    nvme_bytes: int
    state_factor: float
    stride: int
    sharding: Optional[Sharding]
    gradient_life: tuple[bool, bool]  # (gradients_until_update, spill_gradients)

    def __call__(self, budget: int, recompute: bool = False) -> PlacementCandidate:
        together = [*self.co_resident, *self.block_units] if recompute else self.co_resident
        until_update, spill = self.gradient_life
        return search_persistent(
            self.sizes, together, self.order, self.unit_costs, self.machine, gpu_bytes=budget, host_bytes=self.host_bytes,
            nvme_bytes=self.nvme_bytes, state_factor=self.state_factor, stride=self.stride, sharding=self.sharding,
            gradients_until_update=until_update, spill_gradients=spill,
        )[0]


def describe_layout(layout: Sequence[str]) -> str:
    """``S C K`` for a few blocks (swap, checkpoint, keep; ``H`` checkpointed from host memory); counts for many."""
    if len(layout) <= 16:
        return " ".join("H" if p == CHECKPOINT_HOST else p[0].upper() for p in layout)
    swapped = sum(p.startswith("swap") for p in layout)
    from_host = f" ({layout.count(CHECKPOINT_HOST)} from host memory)" if CHECKPOINT_HOST in layout else ""
    return f"{layout.count(KEEP)} kept, {sum(p in RECOMPUTED for p in layout)} checkpointed{from_host}, {swapped} swapped"
