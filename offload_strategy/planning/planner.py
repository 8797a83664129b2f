"""The planner: what the strategy places, from what it knows.

The planning session (``session/plans.py``) builds a :class:`Planner` at set-up and asks it for
each placement; it keeps the run's phase and hands the planner what the run measured as arguments.
The planner's three kinds of decision, in the order a run asks for them:

1. Placing: every unit's home from sizes alone (10Cache's first-use allocator,
   ``placement.py``), or from the plan file, or as the placement mode fixes them.
2. The search: after the profiled first step, under ``placement="search"``, how many leading
   units stay resident, priced by the step model from the measured times (ProTrain §3.3,
   ``auto.py``), jointly with the activation layout under ``activations="auto"``.
3. The layout: under ``activations="auto"``, every block's activation policy (``activations.py``,
   ``planning/searches/swap_or_recompute.py``); when no layout fits beside the parameters' share of the GPU tier, that share
   shrinks to the smallest working set first.

Pure: no torch state. Errors say what does not fit, the numbers, and what to do.
"""

from __future__ import annotations

import dataclasses

import math

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Callable, Optional

from ..config import ActivationPlanner, BlockPolicy, PlacementMode, PolicyConfig, Tier, format_bytes
from .profile import StepProfile, steady_timing
from .activations import (RECOMPUTED, ActivationPlan, BesideBlocks, BlockCost, Links, choose_layout, interleaved_layout, peak_bytes, recomputes,
                          teraio_layout)
from .auto import AutoPlan, plan_auto
from .cost_model import Machine, UnitCost, costs_from_timing
from .searches.swap_or_recompute import lohan_layout
from .placement import DEVICE_SLOT_ALIGNMENT, Placement, PlacementError, UnitSize, minimum_gpu_bytes, place_units
from .plan_file import PlanFile, check_plan
from .sharding import Sharding

# What a set-up minimum leaves out when the blocks' activations are planned from the first step.
_ACTIVATIONS_NOT_COUNTED = (
    "That minimum is for parameters alone: with policy.activations='auto' the blocks' activations share the GPU "
    "tier too; they are measured in the first training step, and if the tier is then too small the run stops "
    "in that step's forward, before anything is updated, with the minimum for both. A layout of your own "
    "(policy.activations='keep', 'checkpoint', ...) is measured and counted the same way; "
    "policy.activations='swap_host' keeps most of them out of the GPU tier."
)

_LAYOUTS: dict[str, Callable[..., ActivationPlan]] = {ActivationPlanner.TERAIO: teraio_layout, ActivationPlanner.LOHAN: lohan_layout}


def layout_for(planner: str) -> Callable[..., ActivationPlan]:
    """The layout function of an activation planner (``auto``: ProTrain's layout search), each
    called as ``(costs, links, gpu_bytes=..., host_bytes=..., head=...)``."""
    return _LAYOUTS.get(planner, choose_layout)


def layout_beside_smallest(lay_out: Callable[[bool], ActivationPlan]) -> ActivationPlan:
    """The layout beside the parameters' smallest share of the GPU tier. ``lay_out(recomputing)``
    lays the blocks out beside the share for one grouping (ValueError where nothing fits): first
    each module's units alone, which serves a layout that recomputes no block; then a whole
    block's units together, which a recomputed block needs. Raises the last refusal."""
    refusal: Optional[ValueError] = None
    for recomputing in (False, True):
        try:
            plan = lay_out(recomputing)
        except ValueError as error:
            refusal = error
            continue
        if recomputing or not recomputes(plan.layout):
            return plan
    assert refusal is not None
    raise refusal


@dataclass(frozen=True)
class TierBudgets:
    """Bytes the strategy may use in each tier, resolved against what was free at setup."""

    gpu: int
    host: int
    nvme: int


@dataclass(frozen=True)
class ModelUnits:
    """What the planner knows of the model before any step."""

    sizes: list[UnitSize]
    names: list[str]
    co_resident: list[list[int]]  # the units each module uses together
    block_units: list[list[int]]  # the units each repeated block uses
    state_factor: float  # optimizer-state bytes per trainable parameter byte
    sharding: Optional[Sharding] = None  # under sharded states: which rank keeps each unit's
    # every step updates each unit as its gradients complete: NVMe units' gradients are transient
    gradients_until_update: bool = False
    # ... and wait on NVMe for the update after something that needs them all (clipping by norm)
    spill_gradients: bool = False
    # per unit, what decides its work (its parameters' shapes): equal keys, equal compute, so a
    # stall of a few of them in the profiled step is held to their group's median
    work: Sequence[Hashable] = ()
    tensors: Optional[Sequence[int]] = None  # per unit, its trainable tensors (each reduced on its own across ranks)
    # the units of each layer the model recomputes in backward itself (its own activation
    # checkpointing), all held at once then, whatever this runtime does with the activations
    recomputed_by_model: tuple[tuple[int, ...], ...] = ()

    @property
    def together(self) -> list[list[int]]:
        """The unit sets used together whatever the activation layout: each module's, and each
        layer's that the model recomputes itself."""
        return [*self.co_resident, *(list(units) for units in self.recomputed_by_model)]


@dataclass(frozen=True)
class Resident:
    """The search's choice: the units kept resident, and the GPU bytes the parameters get."""

    units: frozenset[int]
    gpu_bytes: int


class Planner:
    def __init__(
        self, policy: PolicyConfig, budgets: TierBudgets, has_nvme: bool, plan: Optional[PlanFile] = None,
        explain_nvme_shortfall: Callable[[PlacementError], None] = lambda error: None, model: Optional[ModelUnits] = None,
    ) -> None:
        self.policy = policy
        self.budgets = budgets
        self.has_nvme = has_nvme
        self.plan = plan
        self.explain_nvme_shortfall = explain_nvme_shortfall  # raises a clearer error where the disk is full
        self.model = model  # what the last placement knew of the model (``place`` sets it)
        self.resident: Optional[Resident] = None  # what the search chose, kept while it fits
        self.gpu_placed: Optional[int] = None  # what the last placement used for parameters, gradients and states
        self.search_result: Optional[AutoPlan] = None
        # host bytes the activation layout keeps there: the staging buffers beyond the minimum leave them
        self.host_reserve = 0
        # per unit grouping, the least GPU share host memory and NVMe hold the rest of (and the model it is for)
        self._least_shares: dict[tuple[tuple[int, ...], ...], tuple[ModelUnits, int]] = {}

    @property
    def searching(self) -> bool:
        """``placement="search"`` without a plan file (which fixes every home)."""
        return self.policy.placement == PlacementMode.SEARCH and self.plan is None

    @property
    def units(self) -> ModelUnits:
        """What is known of the model's units (set by the first ``place``)."""
        if self.model is None:
            raise RuntimeError("the planner knows no model yet: place() it first.")
        return self.model

    def settle_gpu_budget(self, gpu: int) -> None:
        """The GPU tier once the profiled steps measured what the allocator holds beyond it
        (``session/budgets.py::gpu_after_profiling``), before the plan that follows them."""
        self.budgets = dataclasses.replace(self.budgets, gpu=gpu)

    def gpu_beside(self, taken: int) -> int:
        """The GPU tier left beside ``taken`` bytes of it: the parameters' share beside the
        activations' peak, or the activations' room beside the parameters. The one place the tier
        is split between the two (the planning session, the activation control and the estimate ask it)."""
        return self.budgets.gpu - taken

    def note_recomputed_by_model(self, groups: tuple[tuple[int, ...], ...]) -> None:
        """The model's own checkpointing recomputes these unit groups: plans to come keep each together."""
        self.model = replace(self.units, recomputed_by_model=groups)

    def keep_host_for_layout(self, nbytes: int) -> None:
        """Host bytes the activation layout keeps there: the staging buffers beyond the minimum leave them."""
        self.host_reserve = nbytes

    def working_groups(self, block_policies: Sequence[str], every_block: bool = False, model: Optional[ModelUnits] = None) -> list[list[int]]:
        """The unit sets that must be in the GPU tier together: each module's units and, since a
        checkpointed block's recompute holds views of all its units until their gradients are in,
        each checkpointed block's (every block's with ``every_block``); of ``model``, the one the
        last placement knew by default."""
        model = model if model is not None else self.units
        blocks = [units for units, policy in zip(model.block_units, block_policies) if every_block or policy in RECOMPUTED]
        return [*model.together, *blocks]

    # -- phase 1: placing ---------------------------------------------------------------------------

    def place(self, model: ModelUnits, gpu_bytes: int, together: list[list[int]], activations_auto: bool) -> Placement:
        """Every unit's home within the budgets, ``gpu_bytes`` of the GPU tier for parameters."""
        self.model = model
        homes, gpu_bytes = self._fixed_homes(together, gpu_bytes)
        placement = self._place(together, gpu_bytes, homes, activations_auto)
        self.gpu_placed = placement.gpu_bytes
        return placement

    def _fixed_homes(self, together: list[list[int]], gpu_bytes: int) -> tuple[Optional[dict[int, str]], int]:
        """What the plan file or the placement mode fixes: every unit's home; and the GPU bytes
        parameters may use (``layerwise``: one layer's)."""
        model, mode = self.units, self.policy.placement
        if self.plan is not None:
            check_plan(self.plan, model.names, [u.nbytes for u in model.sizes], len(model.block_units))
            return {u.index: planned.home for u, planned in zip(model.sizes, self.plan.units)}, gpu_bytes
        if mode in (PlacementMode.HOST, PlacementMode.LAYERWISE, PlacementMode.OFFLOAD_STATES):
            if mode == PlacementMode.LAYERWISE:  # one layer's working set at a time, however large the budget
                gpu_bytes = min(gpu_bytes, minimum_gpu_bytes(model.sizes, together, self.policy.prefetch))
            return {u.index: Tier.HOST for u in model.sizes}, gpu_bytes
        if mode == PlacementMode.NVME:
            if not self.has_nvme:
                raise ValueError("policy.placement='nvme' keeps every unit on NVMe, but no nvme_path was given; name a directory for the NVMe tier.")
            return {u.index: Tier.NVME for u in model.sizes}, gpu_bytes
        return None, gpu_bytes

    def _place(self, together: list[list[int]], gpu_bytes: int, homes: Optional[dict[int, str]], activations_auto: bool) -> Placement:
        """``place_units`` within the budgets; a refusal says what the policy and the blocks add."""
        model, budgets = self.units, self.budgets

        def place_for(sharding: Optional[Sharding], persistent: Optional[frozenset[int]]) -> Placement:
            return place_units(
                model.sizes, together, gpu_bytes=gpu_bytes, host_bytes=budgets.host, nvme_bytes=budgets.nvme, state_factor=model.state_factor,
                all_on_gpu=self.policy.name == "none", homes=homes, sharding=sharding, prefetch=self.policy.prefetch, persistent=persistent,
                gradients_until_update=model.gradients_until_update, spill_gradients=model.spill_gradients,
                buffer_per_unit=self.policy.placement == PlacementMode.OFFLOAD_STATES and self.plan is None, host_reserve=self.host_reserve,
            )

        def place(persistent: Optional[frozenset[int]] = None) -> Placement:
            mine, *others = _every_rank(model.sharding)
            placement = place_for(mine, persistent)
            for sharding in others:  # the searched units fall back, or a refusal is raised, on every rank alike
                try:
                    place_for(sharding, persistent)
                except PlacementError as error:
                    raise _on_rank(sharding, error) from None
            return placement

        resident = self.resident.units if self.resident is not None and homes is None else None
        try:
            return place(resident)
        except PlacementError as error:
            self.explain_nvme_shortfall(error)
            if resident is not None:
                # the searched units no longer fit (activations took part of the GPU tier): first-use placement
                self.resident = None
                return place()
            raise self._refusal(error, together, gpu_bytes, homes, activations_auto) from None

    def _refusal(self, error: PlacementError, together: list[list[int]], gpu_bytes: int, homes: Optional[dict], activations_auto: bool) -> PlacementError:
        model, mode = self.units, self.policy.placement
        if mode == PlacementMode.OFFLOAD_STATES and self.plan is None:
            return error  # it says what the mode needs
        if homes is not None and self.plan is None:  # the policy fixed every home
            return PlacementError(
                f"policy.placement={str(mode)!r} puts every unit's parameters in {'NVMe' if mode == PlacementMode.NVME else 'host memory'}, "
                f"and then: {error} Or use policy.placement='fill', which places what does not fit elsewhere."
            )
        if len(together) > len(model.co_resident) and minimum_gpu_bytes(model.sizes, model.co_resident, self.policy.prefetch) <= gpu_bytes:
            return PlacementError(f"{error} {self._checkpoint_note(activations_auto)}")
        if activations_auto:
            return PlacementError(f"{error} {_ACTIVATIONS_NOT_COUNTED}")
        return error

    def _checkpoint_note(self, activations_auto: bool) -> str:
        sizes, recomputed = self.units.sizes, self.units.recomputed_by_model
        block = max((sum(sizes[i].nbytes for i in units) for units in self.units.block_units), default=0)
        profiling = " (activations='auto' checkpoints every block but the first in its profiling step)" if activations_auto else ""
        if recomputed:
            layer = max(sum(sizes[i].nbytes for i in units) for units in recomputed)
            return (
                f"The model checkpoints {len(recomputed)} of its layers itself (Hugging Face's gradient_checkpointing, or its own "
                f"torch.utils.checkpoint), and each recomputation holds all of a layer's parameters in the GPU tier, "
                f"{format_bytes(layer)} for the largest; below that, turn the model's own checkpointing off (policy.activations='auto' "
                f"then checkpoints or swaps blocks where the GPU tier needs it)."
            )
        return (
            f"Checkpointed blocks recompute with all their parameters in the GPU tier, {format_bytes(block)} for the largest block"
            f"{profiling}; below that, keep or swap the blocks' activations instead (policy.activations='swap_host')."
        )

    # -- phase 2: the search over resident units ----------------------------------------------------

    def search(
        self, timing: StepProfile, trainable: Sequence[bool], machine: Machine, direct_gradients: bool,
        blocks: Sequence[BlockCost] = (), links: Optional[Links] = None, activation_host_bytes: int = 0, beside: BesideBlocks = BesideBlocks(),
    ) -> tuple[AutoPlan, list[int]]:
        """ProTrain's search (§3.3) over how many leading units stay resident, each count priced
        by the step model from the measured times of ``timing`` (``direct_gradients``: every
        offloaded gradient is written at home, no copy on the link); with ``blocks``, jointly with
        the activation layout, ``beside`` the bytes outside the blocks' layouts (counted in the
        layout's peak). Returns the plan and the units in first-use
        order. Raises PlacementError when no split of the GPU tier fits."""
        order, costs = self.priced(timing, trainable, direct_gradients)
        return self.search_priced(order, costs, machine, blocks, links, activation_host_bytes, beside), order

    def priced(self, timing: StepProfile, trainable: Sequence[bool], direct_gradients: bool) -> tuple[list[int], dict[int, UnitCost]]:
        """The units in first-use order and each one's costs, from the measured times of ``timing``."""
        model = self.units
        used = list(dict.fromkeys(timing.order))
        order = used + [i for i in range(len(model.sizes)) if i not in used]
        timing = steady_timing(timing, dict(enumerate(model.work)))
        owns = model.sharding.owns if model.sharding is not None else None
        costs = costs_from_timing(timing, list(trainable), {u.index: u.trainable_bytes for u in model.sizes}, owns, model.tensors)
        if direct_gradients:
            costs = {i: replace(c, direct_gradient=True) for i, c in costs.items()}
        return order, costs

    def search_priced(
        self, order: Sequence[int], costs: Mapping[int, UnitCost], machine: Machine, blocks: Sequence[BlockCost] = (), links: Optional[Links] = None,
        activation_host_bytes: int = 0, beside: BesideBlocks = BesideBlocks(),
    ) -> AutoPlan:
        """The search of :meth:`search` over units priced already (measured, or from their shapes)."""
        model, budgets = self.units, self.budgets
        plan = plan_auto(
            model.sizes, model.together, order, costs, machine, gpu_bytes=max(self.gpu_beside(beside.in_blocks), 0), host_bytes=budgets.host,
            nvme_bytes=budgets.nvme, state_factor=model.state_factor, blocks=blocks, links=links,
            activation_host_bytes=activation_host_bytes, block_units=model.block_units, sharding=model.sharding,
            gradients_until_update=model.gradients_until_update, spill_gradients=model.spill_gradients, head=beside.head,
        )
        if plan.activations is not None and beside.in_blocks:
            plan = replace(plan, activations=replace(plan.activations, peak_bytes=plan.activations.peak_bytes + beside.in_blocks))
        self.search_result = plan
        return plan

    def keep_resident(self, order: list[int], count: int, current: set[int], gpu_bytes: int, placed: int, profiling: bool = False) -> Optional[Resident]:
        """The first ``count`` units of ``order`` resident, in ``gpu_bytes`` of the GPU tier (what
        the activation layout searched with them leaves); None when the placement in use, ``current``
        units resident in ``placed`` bytes, already is that (``profiling``: the placement in use is
        the profiling one, which the search's replaces)."""
        chosen = frozenset(order[:count])
        if not profiling and (count >= len(order) or (chosen == current and placed <= gpu_bytes)):
            return None  # all resident: the first placement had that choice
        self.resident = Resident(chosen, gpu_bytes)
        return self.resident

    # -- phase 3: the activation layout ---------------------------------------------------------------

    def smallest_parameter_share(self, block_policies: Sequence[str], recomputing: bool = True) -> int:
        """The GPU tier the parameters need at the least: every block's units streamed together
        (``recomputing``: any block may be recomputed), or each module's alone; and no less than
        host memory and NVMe need to hold the rest (:meth:`least_parameter_share`)."""
        if self.model is None or not self.model.sizes:
            return 0
        groups = self.working_groups(block_policies, every_block=True) if recomputing else list(self.units.together)
        return self.least_parameter_share(groups)

    def least_parameter_share(self, groups: list[list[int]]) -> int:
        """The least of the GPU tier the parameters can be placed in, ``groups`` of units used
        together: the fewest streaming buffers those groups need, where host memory and NVMe hold
        what that leaves out; else the least share whose placement they hold (bisected: a larger
        share keeps more units resident, leaving them less); under sharded states, on every rank
        (each holds its own units' states, and the ranks must place alike). The profiling placement, the layout
        that places the parameters again and the refusals that name a minimum all count with it,
        so that a budget accepted at set-up is not refused by the placement after the profiled
        steps. Where the first-use placement does not choose the homes (a plan file, a placement
        mode that fixes them), or even the whole budget is refused, the fewest buffers (the
        placement then refuses with its own numbers)."""
        model = self.units
        smallest = minimum_gpu_bytes(model.sizes, groups, self.policy.prefetch)
        if self.plan is not None or self.policy.placement not in (PlacementMode.FILL, PlacementMode.SEARCH):
            return smallest
        key = tuple(tuple(group) for group in groups)
        known = self._least_shares.get(key)
        if known is not None and known[0] is model:
            return known[1]
        least = smallest
        for sharding in _every_rank(model.sharding):  # this rank's first: the others' mostly hold at its least
            least = self._least_held(groups, least, sharding)
        self._least_shares[key] = (model, least)
        return least

    def _least_held(self, groups: list[list[int]], least: int, sharding: Optional[Sharding]) -> int:
        """The least share from ``least`` up whose first-use placement the rank ``sharding`` places
        for holds (bisected); ``least`` where even the whole budget is refused."""
        most = self.budgets.gpu
        if self._holds(groups, least, sharding) or not self._holds(groups, most, sharding):
            return least
        while most - least > DEVICE_SLOT_ALIGNMENT:  # ``least`` is refused, ``most`` held
            middle = (least + most) // 2
            least, most = (least, middle) if self._holds(groups, middle, sharding) else (middle, most)
        return most

    def _holds(self, groups: list[list[int]], gpu_bytes: int, sharding: Optional[Sharding]) -> bool:
        """Whether the first-use placement in ``gpu_bytes`` of the GPU tier fits every budget of
        the rank ``sharding`` places for."""
        return self._first_use(groups, gpu_bytes, sharding) is not None

    def _first_use(self, groups: list[list[int]], gpu_bytes: int, sharding: Optional[Sharding] = None) -> Optional[Placement]:
        """The first-use placement in ``gpu_bytes`` of the GPU tier (for the rank ``sharding``
        places for, this one's by default); None where a budget refuses it."""
        model, budgets = self.units, self.budgets
        sharding = sharding if sharding is not None else model.sharding
        try:
            return place_units(
                model.sizes, groups, gpu_bytes=gpu_bytes, host_bytes=budgets.host, nvme_bytes=budgets.nvme, state_factor=model.state_factor,
                sharding=sharding, prefetch=self.policy.prefetch, gradients_until_update=model.gradients_until_update,
                spill_gradients=model.spill_gradients, host_reserve=self.host_reserve,
            )
        except PlacementError:
            return None

    def _share_placed(self, block_policies: Sequence[str], recomputing: bool) -> tuple[int, Optional[Placement]]:
        """The parameters' smallest share (:meth:`smallest_parameter_share`) and the first-use
        placement in it, whose host memory and NVMe a layout beside it cannot have; no placement
        where the homes are fixed (their use is the placement in use's) or none fits."""
        share = self.smallest_parameter_share(block_policies, recomputing)
        if self.model is None or self.plan is not None or self.policy.placement not in (PlacementMode.FILL, PlacementMode.SEARCH):
            return share, None
        groups = self.working_groups(block_policies, every_block=True) if recomputing else list(self.units.together)
        return share, self._first_use(groups, share)

    def least_activation_peak(
        self, costs: Sequence[BlockCost], planner: str, beside: BesideBlocks = BesideBlocks(), running: Sequence[str] = (),
    ) -> int:
        """The smallest activation peak any layout the planner may choose reaches, with the bytes
        ``beside`` the blocks; ``running``: a layout the steps until the plan run whatever it
        chooses (the profiling layout: the first block kept, the others recomputed), which must
        fit too."""
        if planner == ActivationPlanner.TERAIO:  # offloads only: every block but the last leaves
            layouts: tuple[Sequence[str], ...] = ([BlockPolicy.SWAP_HOST] * (len(costs) - 1) + [BlockPolicy.KEEP],)
        else:
            layouts = (interleaved_layout(len(costs), 0, len(costs)), [BlockPolicy.CHECKPOINT_HOST] * len(costs), [BlockPolicy.SWAP_HOST] * len(costs))
        # a layout that moves blocks out needs the room the parameters' smallest share leaves in host memory and NVMe
        room = self._room_beside_smallest(len(costs))
        held = [layout for layout in layouts if room is None or _moved_out(costs, layout) <= room] or layouts[:1]
        least = min(peak_bytes(costs, layout, beside.head) for layout in held)
        return beside.in_blocks + max(least, peak_bytes(costs, running, beside.head) if running else 0)

    def _room_beside_smallest(self, blocks: int) -> Optional[int]:
        """Host memory and NVMe the parameters placed in their smallest share (any block
        recomputed) leave for activations moved out of the GPU tier; None where not known."""
        if self.model is None or len(self.model.block_units) != blocks:
            return None
        _share, placed = self._share_placed([BlockPolicy.CHECKPOINT] * blocks, True)
        if placed is None:
            return None
        return max(self.budgets.host - placed.host_bytes, 0) + (max(self.budgets.nvme - placed.nvme_bytes, 0) if self.has_nvme else 0)

    def activation_minimum_note(
        self, costs: Sequence[BlockCost], planner: str, block_policies: Sequence[str], beside: BesideBlocks = BesideBlocks(),
        running: Sequence[str] = (),
    ) -> str:
        smallest = self.smallest_parameter_share(block_policies)
        least = self.least_activation_peak(costs, planner, beside, running)
        fewest = (minimum_gpu_bytes(self.units.sizes, self.working_groups(block_policies, every_block=True), self.policy.prefetch)
                  if self.model is not None and self.model.sizes else smallest)
        held = (
            f" (not the fewest buffers, {format_bytes(fewest)}: host_memory={format_bytes(self.budgets.host)} and "
            f"nvme_memory={format_bytes(self.budgets.nvme)} hold the rest of the parameters only beside {format_bytes(smallest)} of them "
            f"in the GPU tier; more host memory or NVMe lets the activations have more of it)"
            if smallest > fewest else ""
        )
        return (
            f"With {format_bytes(smallest)} of streaming buffers for the parameters{held}{beside.note(', ')}, gpu_memory must be at least "
            f"{format_bytes(smallest + least, at_least=True)} (it is {format_bytes(self.budgets.gpu)})."
        )

    def refuse_unfitting_activations(
        self, costs: Sequence[BlockCost], planner: str, block_policies: Sequence[str], measured: str, beside: BesideBlocks = BesideBlocks(),
        running: Sequence[str] = (),
    ) -> None:
        """When no layout fits even beside the parameters' smallest share of the GPU tier (and the
        bytes ``beside`` the blocks; and ``running`` with them, :meth:`least_activation_peak`): the
        minimum gpu_memory, and how far the batch must shrink instead (activations, and the
        blocks' inputs, grow in proportion to batch size times sequence length)."""
        least = self.least_activation_peak(costs, planner, beside, running)
        left = self.gpu_beside(self.smallest_parameter_share(block_policies))
        if least <= left:
            return
        shrink = (
            f"lower the batch size (or batch size times sequence length) to at most {math.floor(1000 * left / least) / 10:.1f}% of this step's"
            if left > 0 else "lower the batch size"
        )
        raise ValueError(
            f"no layout of keep / checkpoint / swap fits the activations of {len(costs)} blocks: the smallest peak is "
            f"{least:,} bytes, {measured}. {self.activation_minimum_note(costs, planner, block_policies, beside, running)} "
            f"Raise gpu_memory to that, or {shrink}."
        )

    def first_step_buffer(self) -> int:
        """What the first step of a layout the user fixed (the step that measures it) runs the
        parameters in beyond their least share (:meth:`least_parameter_share`): one buffer, since
        code outside the step the planner never saw (a callback's gradients, a functional
        transform) may hold a unit more than the blocks' groups. The minimum a refusal names
        counts it, so that the tier it names holds that step too."""
        return max((size.nbytes for size in self.units.sizes), default=0)

    def _fixed_layout_least(self, layout: Sequence[str]) -> int:
        """The least share of the GPU tier the parameters can take beside a fixed ``layout``
        (its recomputed blocks' units together)."""
        return self.least_parameter_share(self.working_groups(layout)) if self.model is not None and self.model.sizes else 0

    def fixed_layout_minimum(self, peak: int, layout: Sequence[str]) -> int:
        """The least gpu_memory that holds a fixed layout's ``peak`` through every step, the one
        that measures it (:meth:`first_step_buffer`) too."""
        return self._fixed_layout_least(layout) + self.first_step_buffer() + peak

    @staticmethod
    def fixed_layout_peak(costs: Sequence[BlockCost], layout: Sequence[str], beside: BesideBlocks) -> int:
        """A layout the user fixed, counted in the GPU tier as a planned one is: the peak
        (:func:`peak_bytes`) of the measured ``costs``, with the bytes ``beside`` the blocks."""
        return beside.in_blocks + peak_bytes(costs, layout, beside.head)

    def refuse_unfitting_fixed_layout(self, peak: int, layout: Sequence[str], measured: str, beside: BesideBlocks, placed: int) -> None:
        """A layout the user fixed whose ``peak`` (:meth:`fixed_layout_peak`) does not fit beside
        the least share of the GPU tier the parameters can be placed in for it (their units used
        together, each recomputed block's too) is refused, with what it holds, what the tier
        leaves it, and what to do. ``placed``: the parameters' bytes in the tier as placed now
        (said, not decided on: they may be placed again in less)."""
        least = self._fixed_layout_least(layout)
        left = self.gpu_beside(least)
        if peak <= left:
            return
        counts = ", ".join(f"{layout.count(p)} {p}" for p in sorted(set(layout)))
        blocks = max(peak - beside.in_blocks - beside.head, 0)
        raise ValueError(
            f"the activation layout policy.activations fixes ({counts}, {len(layout)} blocks) holds {format_bytes(peak)} of activations "
            f"in the GPU tier at its peak ({measured}): {format_bytes(blocks)} in the blocks{beside.note(', ')}. gpu_memory="
            f"{format_bytes(self.budgets.gpu)} leaves it {format_bytes(max(left, 0))} beside the least the parameters can be placed in, "
            f"{format_bytes(least)} (as placed they take {format_bytes(placed)}). Raise gpu_memory to at least "
            f"{format_bytes(self.fixed_layout_minimum(peak, layout), at_least=True)} (the step that measures it runs them in one "
            f"buffer more), or let the planner lay the blocks out in what is left "
            f"(policy.activations='auto'), or recompute or swap more of them (policy.activations='checkpoint', 'swap_host', 'swap_nvme')."
        )

    def layout(
        self, costs: Sequence[BlockCost], links: Links, planner: str, parameter_bytes: int, host_bytes: int, block_policies: Sequence[str],
        beside: BesideBlocks = BesideBlocks(),
    ) -> tuple[ActivationPlan, Optional[int]]:
        """Every block's policy beside ``parameter_bytes`` of parameters in the GPU tier (and the
        bytes ``beside`` the blocks). When none fits there, the layout for
        the parameters' smallest share, and the GPU bytes the parameters must be placed again in
        (then ask again with what that placement uses). The smallest share is first each module's
        units alone, which serves a layout that recomputes no block; one that does needs a whole
        block's units together."""
        try:
            return self.layout_beside(costs, links, planner, parameter_bytes, host_bytes, beside), None
        except ValueError as error:
            if self.policy.name == "none":
                raise ValueError(f"{error} policy 'none' keeps every parameter in the GPU tier; use policy 'auto' to make room.") from None
        def beside_share(recomputing: bool) -> ActivationPlan:
            # the swaps take what the parameters placed in that share leave of host memory and NVMe
            share, placed = self._share_placed(block_policies, recomputing)
            room = links if placed is None else replace(links, nvme_room=max(self.budgets.nvme - placed.nvme_bytes, 0))
            left = host_bytes if placed is None else min(host_bytes, max(self.budgets.host - placed.host_bytes, 0))
            return self.layout_beside(costs, room, planner, share, left, beside)

        try:
            plan = layout_beside_smallest(beside_share)
        except ValueError as refusal:
            raise ValueError(f"{refusal} {self.activation_minimum_note(costs, planner, block_policies, beside)}") from None
        return plan, self.gpu_beside(plan.peak_bytes)

    def layout_beside(
        self, costs: Sequence[BlockCost], links: Links, planner: str, parameter_bytes: int, host_bytes: int,
        beside: BesideBlocks = BesideBlocks(),
    ) -> ActivationPlan:
        """The planner's layout in what ``parameter_bytes`` of parameters and the bytes ``beside``
        the blocks leave of the GPU tier; its peak counts the latter (the activations outside the
        blocks are held from forward into backward, beside the blocks')."""
        gpu_bytes = max(self.gpu_beside(parameter_bytes + beside.in_blocks), 0)
        plan = layout_for(planner)(costs, links, gpu_bytes=gpu_bytes, host_bytes=host_bytes, head=beside.head)
        return replace(plan, peak_bytes=plan.peak_bytes + beside.in_blocks) if beside.in_blocks else plan


def _moved_out(costs: Sequence[BlockCost], layout: Sequence[str]) -> int:
    """The bytes a layout keeps out of the GPU tier from forward to backward (host memory or NVMe)."""
    return sum(c.host_bytes(p) for c, p in zip(costs, layout))


def _on_rank(sharding: Optional[Sharding], error: PlacementError) -> PlacementError:
    """Another rank's refusal, naming that rank."""
    rank = sharding.rank if sharding is not None else 0
    return PlacementError(f"on rank {rank} (each rank holds its own units' optimizer states): {error}", error.nvme_needed, error.tier)


def _every_rank(sharding: Optional[Sharding]) -> list[Optional[Sharding]]:
    """Every rank's view of the sharded states, this rank's first (``[None]`` without sharding).
    Each rank keeps the states of its own units, so the host memory a share of the GPU tier leaves
    them differs from rank to rank; the ranks must place alike in the GPU tier all the same (its
    units' gradients are all-reduced), so a share is the least only where it holds on every rank."""
    if sharding is None:
        return [None]
    return [sharding, *(sharding.as_rank(r) for r in range(sharding.world_size) if r != sharding.rank)]
