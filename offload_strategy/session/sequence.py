"""The planning sequence: the profiling placement, the search, the activation layout beside it and
the placement again, as decisions over a profile and the placement in use.

The running session (:class:`~offload_strategy.session.plans.PlanSession`) takes each decision
between two steps and has the core build an engine for it; :func:`plan_from_profile` takes them
all at once on a profile given whole (the shapes' analytic one, or one a run measured), placing
with the planner directly. Both call the functions here, so a profile gives the same plan either
way. What the decisions read of the placement in use (host memory and NVMe it holds, its spare
staging buffers, the parameter bytes it moves) comes in as :class:`Held`: the engine's own counts
while one runs, the placement's where none does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..config import BlockPolicy
from ..planning.activations import RECOMPUTED, ActivationPlan, BesideBlocks, BlockCost, Links, peak_bytes
from ..planning.auto import AutoPlan
from ..planning.cost_model import Bandwidth, Machine, UnitCost
from ..planning.placement import GPU, Placement, PlacementError, UnitSize
from ..planning.planner import ModelUnits, Planner, Resident, TierBudgets


@dataclass(frozen=True)
class Held:
    """What the placement in use holds, as the layout decisions read it: host memory its tiers
    take, NVMe its units take, its staging buffers beyond the minimum, and the parameter bytes
    it moves into the GPU tier each pass (the traffic swaps share the links with)."""

    host: int = 0
    nvme: int = 0
    spare_staging: int = 0
    moved: int = 0

    @classmethod
    def of(cls, placement: Placement, sizes: Sequence[UnitSize]) -> "Held":
        """What ``placement`` holds, without an engine."""
        moved = sum(s.nbytes for s in sizes if placement.home[s.index] != GPU)
        return cls(placement.host_bytes, placement.nvme_bytes, placement.spare_staging_bytes, moved)

    def host_left(self, budgets: TierBudgets) -> int:
        return max(budgets.host - self.host, 0)

    def nvme_room(self, budgets: TierBudgets) -> int:
        return max(budgets.nvme - self.nvme, 0)

    def room(self, budgets: TierBudgets, has_nvme: bool) -> int:
        """Host memory and (with an NVMe tier) NVMe left for activations moved out of the GPU tier."""
        return self.host_left(budgets) + (self.nvme_room(budgets) if has_nvme else 0)

    def links(self, machine: Bandwidth, budgets: TierBudgets, nvme_room: bool = True) -> Links:
        """The links swaps use beside this placement's traffic (with ``nvme_room``: the NVMe it leaves)."""
        return Links.beside(machine, self.moved, self.nvme_room(budgets) if nvme_room else None)


@dataclass(frozen=True)
class Profile:
    """What the warm steps measured, or the shapes predict: the units in first-use order and each
    one's costs, the blocks' costs and the activations beside the blocks."""

    order: list[int]
    units: Mapping[int, UnitCost]
    blocks: list[BlockCost]
    beside: BesideBlocks


# -- the decisions -----------------------------------------------------------------------------------


def profiling_share(planner: Planner, placement: Placement, together: list[list[int]], gpu_bytes: int,
                    placed_after: bool = False) -> tuple[Placement, bool]:
    """The placement the profiled steps run: the parameters in the least share host memory and
    NVMe hold the rest beside (the fewest buffers), ``placement`` (the first-use one in
    ``gpu_bytes``) where that is no smaller or refused; ``placement`` too where the search does
    not run (unless the parameters are ``placed_after`` the profiled step whatever the policy: a
    layout the user fixed) or a unit has nothing to train. A ``placement`` that offloads nothing
    is no exception: every parameter in the GPU tier leaves the profiled steps' activations, not
    yet measured, only what the parameters do not take. Returns it and whether it is the
    profiling one."""
    if not (planner.searching or placed_after) or any(not size.trainable_bytes for size in planner.units.sizes):
        # a unit with nothing to train that the model's own checkpointing recomputes stays in the
        # GPU tier until the step ends (``RecomputeHolds`` lets go only this runtime's blocks'), and
        # a model's own checkpointing may show itself only in its first backward: the fewest
        # buffers might not hold them (a frozen base under adapters, a finetuning callback's frozen layers)
        return placement, False
    # what host memory and NVMe can hold the rest of (one buffer more where the step measures a fixed layout)
    smallest = planner.least_parameter_share(together) + (planner.first_step_buffer() if placed_after else 0)
    if smallest >= placement.gpu_bytes:
        return placement, False
    try:
        return planner.place(planner.units, smallest, together, activations_auto=True), True
    except PlacementError:  # host memory may need some units resident: the first-use placement, then
        planner.place(planner.units, gpu_bytes, together, activations_auto=True)
        return placement, False


def profiling_layout(planner: Planner, costs: Sequence[BlockCost], beside: BesideBlocks, running: Sequence[str], room: int) -> Sequence[str]:
    """The profiling steps' layout (the first block kept, the others recomputed) moved out of the
    GPU tier as far as it must be to fit beside the parameters' smallest share: the recomputed
    blocks' inputs in host memory; else the kept block, the one the profile measures, swapped
    there after its forward (kept, it is held while every later block is recomputed: two blocks'
    activations at once, where the layouts searched after it hold one); else both. The first of
    these that fits there whose moved bytes fit in ``room``, what host memory and the NVMe tier
    leave beside the placement in use (the swap puts what host memory does not hold on NVMe, as
    the planner counts the room for moved-out activations); ``running`` where it fits as it is
    or none of them does."""
    left = planner.gpu_beside(planner.smallest_parameter_share(running) + beside.in_blocks)
    if peak_bytes(costs, running, beside.head) <= left:
        return running
    from_host = _moved(running, BlockPolicy.CHECKPOINT, BlockPolicy.CHECKPOINT_HOST)
    for layout in (from_host, _moved(running, BlockPolicy.KEEP, BlockPolicy.SWAP_HOST), _moved(from_host, BlockPolicy.KEEP, BlockPolicy.SWAP_HOST)):
        moved = sum(c.host_bytes(p) for c, p in zip(costs, layout))
        if layout != list(running) and peak_bytes(costs, layout, beside.head) <= left and moved <= room:
            return layout
    return running


def _moved(layout: Sequence[str], policy: str, to: str) -> list[str]:
    return [to if p == policy else p for p in layout]


def searched_share(planner: Planner, order: list[int], count: int, layout: Optional[ActivationPlan], current: Placement,
                   profiling: bool) -> Optional[Resident]:
    """The search's ``count`` leading units resident, in what its ``layout`` leaves of the GPU
    tier; None where the placement in use already is that (``profiling``: it is the profiling
    one, which the search's replaces)."""
    peak = layout.peak_bytes if layout is not None else 0
    resident = {i for i, home in current.home.items() if home == GPU}
    return planner.keep_resident(order, count, resident, planner.gpu_beside(peak), current.gpu_bytes, profiling=profiling)


def choose_layout(
    planner: Planner, searched: Optional[ActivationPlan], costs: list[BlockCost], beside: BesideBlocks, links: Links, layout_planner: str,
    running: Sequence[str], parameter_bytes: int, host_left: int, lent: int,
) -> tuple[ActivationPlan, Optional[int]]:
    """The layout beside ``parameter_bytes`` of parameters: the one searched with them where it
    fits there, else the planner's; and the GPU bytes the parameters must be placed again in
    where none fits beside them (then :func:`layout_placed_again`). ``lent``: spare staging
    buffers of the profiling placement, which give way to what the layout keeps in host memory."""
    if searched is not None and searched.peak_bytes <= planner.gpu_beside(parameter_bytes):
        return searched, None  # the parameters were placed for this layout's recomputed blocks, not another's
    plan, again = planner.layout(costs, links, layout_planner, parameter_bytes, host_left + lent, running, beside)
    if lent:
        planner.keep_host_for_layout(sum(c.host_bytes(p) for c, p in zip(costs, plan.layout)))
    return plan, again


def layout_placed_again(
    planner: Planner, placed_for: ActivationPlan, costs: list[BlockCost], beside: BesideBlocks, links: Links, layout_planner: str,
    parameter_bytes: int, host_left: int,
) -> ActivationPlan:
    """The layout for what the parameters, placed again, left; the one they were placed for
    where the new one recomputes a block that one does not (that block's units were not placed
    together). That one fits: they were placed in what it leaves."""
    plan = planner.layout_beside(costs, links, layout_planner, parameter_bytes, host_left, beside)
    return plan if _recomputed(plan.layout) <= _recomputed(placed_for.layout) else placed_for


def _recomputed(layout: Sequence[str]) -> set[int]:
    return {i for i, policy in enumerate(layout) if policy in RECOMPUTED}


# -- the whole sequence on a profile given whole ----------------------------------------------------------


@dataclass(frozen=True)
class SequencePlan:
    """What the sequence decided on a profile: the placement the run ends with, its layout (None:
    no planner lays the blocks out, their policies are the run's own), the parameters' share of
    the GPU tier, the placement the profiled steps ran, and the search's plan where one ran."""

    placement: Placement
    layout: Optional[ActivationPlan]
    gpu_for_parameters: int
    profiled: Placement
    search: Optional[AutoPlan] = None


@dataclass
class _Run:
    """The sequence's state between its decisions, as the session keeps it between steps."""

    planner: Planner
    activations_auto: bool
    running: Sequence[str]
    placement: Placement
    gpu_for_parameters: int
    profiling: bool = False

    def place(self, gpu_bytes: int, policies: Optional[Sequence[str]] = None) -> None:
        """The parameters placed again in ``gpu_bytes``, grouped for ``policies`` (the blocks' in place by default)."""
        planner = self.planner
        together = planner.working_groups(self.running if policies is None else policies)
        self.placement = planner.place(planner.units, gpu_bytes, together, self.activations_auto)
        self.gpu_for_parameters, self.profiling = gpu_bytes, False

    def held(self) -> Held:
        return Held.of(self.placement, self.planner.units.sizes)


def plan_from_profile(
    planner: Planner, model: ModelUnits, profile: Profile, running: Sequence[str], layout_planner: Optional[str], machine: Machine,
    measured: str = "in the profile given", search: bool = True,
) -> SequencePlan:
    """The sequence the session runs between steps, on ``profile`` at once: the first placement
    in the whole GPU tier grouped for the ``running`` layout (the profiling one under a layout
    planner), the profiling placement, the search (``placement="search"``), the layout beside
    it and the placement again. Raises PlacementError or ValueError where the run would stop
    (``measured``: where the profile's figures come from, for the refusal; ``search=False``
    leaves the search out, for a quick first answer)."""
    budgets = planner.budgets
    measuring = layout_planner is not None and bool(profile.blocks)
    together = planner.working_groups(running, model=model)
    first = planner.place(model, budgets.gpu, together, activations_auto=layout_planner is not None)
    run = _Run(planner, layout_planner is not None, running, first, budgets.gpu)
    if layout_planner is None and profile.blocks and planner.policy.name != "none":
        _count_fixed_layout(run, profile, measured)
    if measuring:
        assert layout_planner is not None
        run.placement, run.profiling = profiling_share(planner, first, together, budgets.gpu)
        run.running = profiling_layout(planner, profile.blocks, profile.beside, running, run.held().room(budgets, planner.has_nvme))
        # the profiled steps stop where no layout fits even beside the parameters' smallest share
        planner.refuse_unfitting_activations(profile.blocks, layout_planner, run.running, measured, profile.beside, running=run.running)
    profiled = run.placement
    # the session searches where an engine runs the profiled steps: something offloaded in them
    searched = _search(run, profile, machine, joint=measuring and layout_planner == "auto") if search and planner.searching and profiled.offloaded else None
    layout = _lay_out(run, profile, machine, searched, layout_planner) if measuring and layout_planner is not None else None
    return SequencePlan(run.placement, layout, run.gpu_for_parameters, profiled, searched)


def _count_fixed_layout(run: _Run, profile: Profile, measured: str) -> None:
    """A layout the user fixed, counted in the GPU tier as the session counts it once the first
    forward measured it (``ActivationControl._count_fixed_layout``): refused where its peak does
    not fit beside the parameters' least share, the parameters placed again beside it where they
    take too much (``PlanSession._place_beside_fixed_layout``)."""
    planner = run.planner
    peak = Planner.fixed_layout_peak(profile.blocks, run.running, profile.beside)
    planner.refuse_unfitting_fixed_layout(peak, run.running, measured, profile.beside, run.placement.gpu_bytes)
    if peak > planner.gpu_beside(run.placement.gpu_bytes):
        run.place(planner.gpu_beside(peak))


def _search(run: _Run, profile: Profile, machine: Machine, joint: bool) -> Optional[AutoPlan]:
    """The search after the profiled steps, and its placement (as ``PlanSession._search_placement``)."""
    planner, held = run.planner, run.held()
    try:
        plan = planner.search_priced(
            profile.order, profile.units, machine, blocks=profile.blocks if joint else (),
            links=held.links(machine, planner.budgets) if joint else None, activation_host_bytes=held.host_left(planner.budgets),
            beside=profile.beside if joint else BesideBlocks(),
        )
    except PlacementError:
        return None  # the first-use placement stays
    layout = plan.activations
    resident = searched_share(planner, profile.order, plan.parameters.persistent, layout, run.placement, run.profiling)
    if resident is not None:
        run.place(resident.gpu_bytes, layout.layout if layout is not None else None)
    return plan


def _lay_out(run: _Run, profile: Profile, machine: Machine, searched: Optional[AutoPlan], layout_planner: str) -> ActivationPlan:
    """The layout after the profiled steps, and the placements it asks (as ``PlanSession._plan_activations``)."""
    planner, held, budgets = run.planner, run.held(), run.planner.budgets
    lent = held.spare_staging if run.profiling else 0
    parameters = planner.gpu_placed if planner.gpu_placed is not None else run.placement.gpu_bytes
    layout, again = choose_layout(
        planner, searched.activations if searched is not None else None, profile.blocks, profile.beside, held.links(machine, budgets),
        layout_planner, run.running, parameters, held.host_left(budgets), lent,
    )
    if again is not None:
        run.place(again, layout.layout)  # no longer the profiling placement
        held = run.held()
        assert planner.gpu_placed is not None
        layout = layout_placed_again(planner, layout, profile.blocks, profile.beside, held.links(machine, budgets), layout_planner,
                                     planner.gpu_placed, held.host_left(budgets))
    run.running = layout.layout
    if run.profiling:  # no search replaced the profiling placement: the parameters take what the layout leaves
        run.place(planner.gpu_beside(layout.peak_bytes))
    return layout
