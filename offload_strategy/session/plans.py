"""``PlanSession``: profile -> plan -> engine, as one object the strategies' core asks.

The core builds one session. The session counts the warm-up and timed steps, keeps the run's
one phase (:class:`SessionPhase`), knows the model's units, splits the GPU tier between the
parameters and the activations (:meth:`PlanSession.gpu_for_parameters`), holds the activation
control and gives the planner its inputs. The core tells it when a step ended
(:meth:`PlanSession.step_ended`) and, between two steps, asks it (:meth:`PlanSession.after_step`);
it answers with the :class:`Plan` now in place, or None where nothing changed.

Placing the parameters again needs the old engine closed first (its parameters go back to plain
tensors, then the new units are made), so the session asks the core for it through the ``replace``
callable it is given, and the core calls back :meth:`PlanSession.plan_placement`. One call may
place twice: the search's placement, then a layout that does not fit beside it.

Torch-side, no Lightning: messages for the user go through ``say``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from ..config import BlockPolicy, PolicyConfig, Tier, format_bytes
from ..planning.activations import RECOMPUTED, BesideBlocks, BlockCost
from ..planning.cost_model import Machine, StepPrediction, costs_from_timing, machine_from_spec, outside_units, simulate_step
from ..planning.searches.access_modes import gradient_offload_plan
from ..planning.placement import GPU, HOST, NVME, Placement, PlacementError, UnitSize
from ..planning.plan_file import PlanFile, PlannedUnit, check_plan, prediction_record
from ..planning.planner import ModelUnits, Planner
from ..planning.sharding import Sharding
from ..planning.profile import StepProfile, fastest_timing
from ..runtime.activations.policies import find_blocks
from ..runtime.updates.optimizers import measured_state_factor
from ..runtime.out_of_memory import PlannedUse
from ..runtime.units import build_units, master_dtype, merge_into_chunks
from . import sequence
from .activations import ActivationControl, SessionContext
from .prediction import PredictionCheck

if TYPE_CHECKING:
    pass

# Steps before the ones the planner prices: the first use of every buffer and kernel makes the
# first step slower than the rest by an amount that varies from run to run (docs/benchmarks.md).
WARM_UP_STEPS = 1
# Warm steps whose least times, unit by unit and block by block, price the plan: a neighbour
# process busy during one of them does not change it.
TIMED_STEPS = 2

# Optimizer state bytes per parameter byte, for budgeting before the first step creates them.
_STATE_FACTORS = {"SGD": 1.0, "Adagrad": 1.0, "RMSprop": 1.0, "Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adadelta": 2.0}


def master_dtype_size(p: torch.Tensor, fp32_masters: bool) -> int:
    """Bytes per element of a parameter's gradient, master and states."""
    return torch.empty((), dtype=master_dtype(p, fp32_masters)).element_size()


def optimizer_state_factor(optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """Bytes of optimizer state per trainable parameter byte: what one step of each optimizer's
    class keeps on a stand-in (``measured_state_factor``: AdamW with ``amsgrad`` 3), never less than
    the class's usual count (2 for Adam; unknown classes 2)."""
    return max((max(_STATE_FACTORS.get(type(o).__name__, 2.0), measured_state_factor(o) or 0.0) for o in optimizers), default=0.0)


class SessionPhase(enum.Enum):
    """Where the run is in profile -> plan (the placement in use says whether it is the profiling one)."""

    INITIAL = "nothing placed yet"
    PROFILING = "placed; the first steps are measured"
    SEARCHED = "the placement searched"
    LAID_OUT = "the activations laid out"


class PlanningRules(Protocol):
    """What the session asks of the recipe (the strategies' ``Rules``)."""

    @property
    def training(self) -> bool: ...
    def gradients_wait_on_nvme(self) -> bool: ...
    def every_backward_reduces_to_owners(self) -> bool: ...
    def every_step_updates_in_backward(self) -> bool: ...
    def needs_all_gradients(self) -> bool: ...
    def why_updates_wait(self) -> str: ...
    def updates_may_run_ahead_of_clipping(self) -> bool: ...


class PlanningRanks(Protocol):
    """What the session asks of data parallelism (the strategies' ``Ranks``)."""

    engine_when_all_fits: bool
    share_host_homes: bool  # the ranks of a machine map one copy of the host homes

    def sharding(self, sizes: list[UnitSize], gradients_sent: bool) -> Optional[Sharding]: ...
    def same_on_every_rank(self, choice: Any) -> Any: ...
    def largest_on_every_rank(self, value: int) -> int: ...
    def check_same_on_every_rank(self, what: str, choice: Hashable) -> None: ...
    def machine(self, links: Machine) -> Machine: ...


# ``replace(rules, gpu_bytes, block_policies, may_fit)``: the core closes its engine and builds
# the next one from ``plan_placement`` (``may_fit``: everything may fit, no engine needed); the
# rules are the ones the core gave ``after_step`` (its own, fuller type)
Replace = Callable[[Any, int, Optional[Sequence[str]], bool], None]


@dataclass(frozen=True)
class Plan:
    """A placement to run: every unit's home, the activation layout it is placed beside, the
    parameters' share of the GPU tier, and the prediction that chose it (seconds; None where
    nothing priced it yet); with the units and module users the engine binds."""

    placement: Placement
    layout: Optional[tuple[str, ...]]
    gpu_for_parameters: int
    prediction: Optional[float]
    model: ModelUnits
    units: list[Any]
    users: Any
    direct_gradients: frozenset[int]
    profiling: bool = False  # the fewest buffers, while the first steps measure the activations


class PlanSession:
    """See the module docstring."""

    def __init__(
        self, context: SessionContext, ranks: PlanningRanks, say: Callable[[str], None], replace_engine: Replace,
        explain_nvme_shortfall: Callable[[PlacementError], None] = lambda error: None, before_planning: Callable[[], None] = lambda: None,
    ) -> None:
        self.context = context
        self._before_planning = before_planning  # once, when the profiled steps are done (the GPU tier's margin measured)
        self.ranks = ranks
        self.say = say
        self._replace = replace_engine
        self._explain_nvme_shortfall = explain_nvme_shortfall
        self.activations = ActivationControl(context, ranks.largest_on_every_rank, say)
        self.prediction = PredictionCheck()
        self.phase = SessionPhase.INITIAL
        self.in_use: Optional[Plan] = None  # the plan the engine runs
        self.plan_file: Optional[PlanFile] = None
        self.steps_done = 0  # training steps whose optimizers stepped, counted as the next begins
        self._stepped = False  # an optimizer stepped since the last plan
        self._order_profiled = False  # the engine in use has profiled its first step's order
        self._timed: list[StepProfile] = []  # the warm steps' unit times, before planning
        self._fitted_trainable: Optional[set[int]] = None  # the parameters that fitted the GPU tier without an engine
        self._recomputed_known: set[int] = set()  # blocks seen recomputed by the model itself, as the planner knows them
        self._said_updates_wait = False  # the run has been told once that updates wait for backward's end
        self._fp32_masters = False
        self.profile: Optional[sequence.Profile] = None  # what the search and the layout were planned from

    @property
    def planner(self) -> Optional[Planner]:
        return self.context.planner

    @property
    def policy(self) -> PolicyConfig:
        return self.context.policy

    @property
    def profiling_placement(self) -> bool:
        """The placement in use streams every unit through the fewest buffers while the first steps measure."""
        return self.in_use is not None and self.in_use.profiling

    # -- set-up -------------------------------------------------------------------------------------

    def start(self, module: torch.nn.Module, plan_file: Optional[PlanFile], fp32_masters: bool) -> None:
        """The module's blocks and their first policies, and the planner (before the first placement)."""
        context = self.context
        assert context.budgets is not None
        self.plan_file, self._fp32_masters = plan_file, fp32_masters
        activations = self.policy.activations
        if plan_file is not None and plan_file.activations is not None:
            blocks = len(find_blocks(module, self.policy.block_class))
            check_plan(plan_file, [u.name for u in plan_file.units], [u.nbytes for u in plan_file.units], blocks)  # blocks only, here
            activations = plan_file.activations
        self.activations.start(module, activations if activations is not None else "keep")
        context.planner = Planner(self.policy, context.budgets, context.nvme_path is not None, plan_file, self._explain_nvme_shortfall)

    # -- the GPU tier's split ---------------------------------------------------------------------------

    def gpu_for_parameters(self, activation_peak: int) -> int:
        """The part of the GPU tier the parameters, their gradients and states may take beside
        ``activation_peak`` bytes of activations (the layout's peak, with what is beside the blocks)."""
        planner = self.planner
        assert planner is not None
        return planner.gpu_beside(activation_peak)

    # -- placements ---------------------------------------------------------------------------------

    def model_units(self, rules: PlanningRules, units: list[Any], users: Any) -> ModelUnits:
        """What the planner knows of the model's units: sizes (no gradients or states without
        training), the units used together, the blocks' units, and the recipe's gradient rules."""
        fp32_masters = self._fp32_masters
        # Under *-true precisions gradients and states are in fp32 beside an fp32 master of each
        # parameter, and each 16-bit gradient lands in an area of the unit's size before widening.
        sizes = [
            UnitSize(
                u.index, u.nbytes, sum(p.numel() * master_dtype_size(p, fp32_masters) for p in u.trainable) if rules.training else 0,
                landing_bytes=u.nbytes if rules.training and fp32_masters and u.trainable else 0,
            )
            for u in units
        ]
        inside = [{id(m) for m in block.modules()} for block in self.activations.blocks]
        block_units = [sorted({u.index for module, used in users.items() if id(module) in ids for u in used}) for ids in inside]
        wait_on_nvme = rules.gradients_wait_on_nvme()
        return ModelUnits(
            sizes=sizes, names=[u.name for u in units],
            co_resident=[[u.index for u in used] for used in users.values()], block_units=block_units,
            recomputed_by_model=self._recomputed_groups(users, block_units),
            state_factor=optimizer_state_factor(self.context.optimizers) + (1.0 if fp32_masters else 0.0),  # the masters
            sharding=self.ranks.sharding(sizes, rules.training and rules.every_backward_reduces_to_owners()),
            gradients_until_update=rules.training and (rules.every_step_updates_in_backward() or wait_on_nvme),
            spill_gradients=rules.training and wait_on_nvme, work=[_work(u) for u in units], tensors=[len(u.trainable) for u in units],
        )

    def plan_placement(self, rules: PlanningRules, gpu_bytes: Optional[int] = None, block_policies: Optional[Sequence[str]] = None) -> Optional[Plan]:
        """Every unit's home within the budgets (``gpu_bytes``: the part of the GPU tier parameters
        may use, all of it by default; ``block_policies``: the activation layout whose recomputed
        blocks need their units together, the one in place by default); None when everything fits
        in the GPU tier. The plan returned is the one in use once the core has built its engine."""
        budgets, planner, module = self.context.budgets, self.context.planner, self.context.module
        assert budgets is not None and planner is not None
        units, users = build_units(module)
        if self.policy.chunk_size:
            units, users = merge_into_chunks(units, users, int(self.policy.chunk_size))
        model = self.model_units(rules, units, users)
        policies = self.activations.policies if block_policies is None else block_policies
        together = planner.working_groups(policies, model=model) if rules.training else list(model.co_resident)  # no recompute without gradients
        gpu_bytes = budgets.gpu if gpu_bytes is None else gpu_bytes
        placement = planner.place(model, gpu_bytes, together, activations_auto=self.activations.auto)
        # before the everything-fits case: the profiled steps' activations, not measured yet, come beside the parameters
        placement, profiling = self._profiling_placement(placement, rules, together, gpu_bytes)
        # under *-true 16-bit precisions the engine keeps fp32 masters even with nothing offloaded:
        # without it the same recipe trained with or without masters depending on gpu_memory
        if not placement.offloaded and not self.ranks.engine_when_all_fits and not self._fp32_masters:
            self.say(self._everything_fits(placement, gpu_bytes, rules))
            self._fitted_trainable = {id(p) for p in module.parameters() if p.requires_grad}
            self.in_use = None
            return None
        self._check_ranks_place_alike(placement)
        plan = Plan(placement, tuple(policies), gpu_bytes, None, model, units, users,
                    self._direct_gradients(model.sizes, placement), profiling=profiling)
        self.in_use, self._order_profiled = plan, False
        if self.phase is SessionPhase.INITIAL:
            self.phase = SessionPhase.PROFILING
        return plan

    def _profiling_placement(self, placement: Placement, rules: PlanningRules, together: list[list[int]], gpu_bytes: int) -> tuple[Placement, bool]:
        """Until the first steps have measured the blocks' activations, the parameters stream
        through the fewest buffers their modules need, and the activations have the rest of the
        GPU tier: ProTrain §3.2 profiles under the most memory-saving configuration. The first-use
        placement would fill the tier with buffers and resident units, and the profiled steps'
        activations, measured beside them, would overrun it (on a GPU, out of memory in the first
        step). The search after those steps places the parameters for what they measured.
        Returns the placement and whether it is the profiling one."""
        planner = self.planner
        assert planner is not None
        activations = self.activations
        # a layout the user fixed is measured in the first training forward as it runs: until then
        # the parameters take their least share too, and the session places them after it
        observed = activations.observing
        measuring = activations.measuring or observed
        if not (rules.training and self.phase in (SessionPhase.INITIAL, SessionPhase.PROFILING) and measuring and activations.blocks):
            return placement, False
        return sequence.profiling_share(planner, placement, together, gpu_bytes, placed_after=observed)

    def _check_ranks_place_alike(self, placement: Placement) -> None:
        """Under data parallelism every rank must keep the same units in the GPU tier (their
        gradients are all-reduced, the others' reduced to their owners), and the same in host
        memory where the ranks share its homes: a rank that placed otherwise would wait in a
        collective the others never enter. Where they differ, every rank fails here instead."""
        self.ranks.check_same_on_every_rank("the units in the GPU tier", tuple(sorted(i for i, h in placement.home.items() if h == GPU)))
        if placement.host_homes_shared:
            self.ranks.check_same_on_every_rank("the units homed in shared host memory", tuple(sorted(i for i, h in placement.home.items() if h == HOST)))

    def _direct_gradients(self, sizes: list[UnitSize], placement: Placement) -> frozenset[int]:
        """Offloaded units whose gradients are written straight into host memory (GO-MemFerry)."""
        if self.context.root_device.type == "cuda":
            return frozenset()  # the CUDA path (GradientPath.attach_direct through views of the homes) has not run on a GPU yet
        reserve = self.policy.gradient_reserve or 0.0
        offloaded = [u for u in sizes if placement.home[u.index] != GPU and u.trainable_bytes]
        bandwidth = machine_from_spec(self.context.hardware, nvme=False).d2h
        kept = gradient_offload_plan(
            [u.trainable_bytes for u in offloaded], [u.trainable_bytes / bandwidth for u in offloaded], [0.0] * len(offloaded), reserve
        )
        return frozenset(u.index for k, u in enumerate(offloaded) if k not in kept)

    def takes_order_profile(self) -> bool:
        """The engine in use profiles its first training step's order (once per engine)."""
        first, self._order_profiled = not self._order_profiled, True
        return first

    def trainable_grew(self) -> bool:
        """Some parameter is trainable now that the placement in use planned no gradient or state for."""
        engine = self.context.engine
        if engine is not None:
            return engine.trainable_grew()
        fitted = self._fitted_trainable
        return fitted is not None and any(p.requires_grad and id(p) not in fitted for p in self.context.module.parameters())

    # -- between steps ------------------------------------------------------------------------------

    def step_ended(self) -> None:
        """An optimizer stepped: no gradient is pending until the next forward."""
        self._stepped = True

    def after_step(self, rules: PlanningRules) -> Optional[Plan]:
        """Between two optimizer steps' worth of batches no gradient is waiting at home, so the
        parameters may be placed again: the placement search, the activation layout, and a new
        placement when a finetuning callback unfroze parameters. The plan now in use where it
        changed, else None."""
        before, stepped = self.in_use, self._stepped
        self._stepped = False  # a second call before the next step decides nothing
        self.steps_done += stepped  # batches whose optimizers stepped, however many optimizers
        if stepped:
            self._keep_timing()
        warm = stepped and self.steps_done >= WARM_UP_STEPS + TIMED_STEPS
        if warm and self.steps_done == WARM_UP_STEPS + TIMED_STEPS:
            self._before_planning()
        self._note_blocks_the_model_recomputes()
        if stepped:  # no gradient waits at home
            self._place_beside_fixed_layout(rules)
        self._plan_when_warm(rules, warm)
        self._place_again_when_asked(rules, stepped)
        if warm and self.prediction.predicted_seconds is None:
            self._predict_fixed_placement()
        return self.in_use if self.in_use is not before else None

    def _place_beside_fixed_layout(self, rules: PlanningRules) -> None:
        """A layout the user fixed, measured by the first training forward: the parameters, in
        their least share while it measured (``_profiling_placement``) or in more than its peak
        leaves, are placed again in what it leaves (as for a layout the planner chose; the
        optimizer states move exactly)."""
        peak = self.activations.take_fixed_peak()
        budgets = self.context.budgets
        if peak is None or budgets is None:
            return
        share = self.gpu_for_parameters(peak)
        if self.profiling_placement:
            self.say(f"tiered: the activation layout policy.activations fixes holds {format_bytes(peak)} of gpu_memory={format_bytes(budgets.gpu)} "
                     f"at its peak (measured in the first training step): the parameters are placed again in the {format_bytes(share)} it leaves.")
        elif self.activations.gpu_parameter_bytes() > share:
            self.say(
                f"tiered: the activation layout policy.activations fixes holds {format_bytes(peak)} of the GPU tier at its peak (measured "
                f"in the first training step), more than the parameters leave of gpu_memory={format_bytes(budgets.gpu)}: they are "
                f"placed again in {format_bytes(share)} of it."
            )
        else:
            return
        # from the least share, everything may fit again beside the layout: no engine then
        self._replace(rules, share, None, self.profiling_placement or self.context.engine is None)

    def _plan_when_warm(self, rules: PlanningRules, warm: bool) -> None:
        planner = self.planner
        assert planner is not None
        if planner.searching and self.phase is SessionPhase.PROFILING and warm and self.context.engine is not None:
            self._search_placement(rules)
        if self.activations.profiled and warm:
            self._plan_activations(rules)
        grown = self.activations.take_grown_costs()
        if grown is not None:  # a batch outgrew every layout beside the parameters as placed
            self._plan_activations(rules, *grown)

    def _place_again_when_asked(self, rules: PlanningRules, stepped: bool) -> None:
        """A finetuning callback's unfrozen parameters, or optimizers a callback replaced."""
        # no local names the engine in use: placing again frees it before the next one allocates
        placed, budgets = self.context.engine is not None, self.context.budgets
        assert budgets is not None
        # without an engine gradients wait in plain tensors until the step: placed only after it
        if self.trainable_grew() and (stepped or (placed and not self._order_profiled)):
            self.say("tiered: parameters became trainable; placing the model again with their gradients and optimizer states")
            share = self.in_use.gpu_for_parameters if placed and self.in_use is not None else budgets.gpu
            self._replace(rules, share, None, not placed)
        if stepped and self._optimizers_replaced():
            # a callback gave the trainer other optimizers (``trainer.optimizers = [...]``): their
            # states may take another size, and the old ones' units must not step again
            self.say("tiered: the trainer's optimizers were replaced; placing the model again with the new ones' states")
            assert self.in_use is not None  # the engine's placement
            self._replace(rules, self.in_use.gpu_for_parameters, None, False)

    def _optimizers_replaced(self) -> bool:
        """A callback gave the trainer optimizers other than those the engine in use updates."""
        engine = self.context.engine
        return engine is not None and {id(o) for o in self.context.optimizers} != set(engine.updater.optimizers)

    def _search_placement(self, rules: PlanningRules) -> None:
        """``placement="search"``, after the profiled first step: the planner's search (jointly with
        the activation layout under ``activations="auto"``); the fastest is put in place between
        two steps (the optimizer states move through their state dicts, exactly)."""
        # the search's frame is gone when placing again starts: a local naming the engine in use
        # would keep its tiers (the pinned slab, the GPU tier) past the collection that frees them
        searched = self._search(rules)
        if searched is None:
            return
        seconds, gpu_bytes, layout = searched
        self._replace(rules, gpu_bytes, layout, self.profiling_placement)
        self._priced(seconds)

    def _search(self, rules: PlanningRules) -> Optional[tuple[float, int, Optional[Sequence[str]]]]:
        """The search's placement: its predicted seconds, its share of the GPU tier and the layout
        searched with it; None where the profiling placement stays."""
        engine, planner = self.context.engine, self.planner
        assert engine is not None and planner is not None and self.in_use is not None
        self.phase = SessionPhase.SEARCHED
        timing = fastest_timing(self._timed) if self._timed else engine.timer.last_timing or engine.timer.profile
        if not timing.order:  # first use in forward of every unit, resident ones included
            timing = replace(timing, order=list(engine.timer.profile.order))
        activations = self.activations
        joint = activations.joint_search
        # a layout the user fixed takes its measured peak of the tier, beside which the search places the parameters
        fixed = BesideBlocks(outside=activations.fixed.peak_bytes) if activations.fixed is not None else BesideBlocks()
        # on the emulated tier every offloaded gradient is written at home (_direct_gradients): no copy on the link
        trainable, direct = [bool(s.unit.trainable) for s in engine.states], engine.device.is_emulated and not self.policy.gradient_reserve
        profiled = activations.profiled
        # what the search prices (Planner.search: Planner.priced, then search_priced), kept for a replay (sequence.plan_from_profile)
        self.profile = sequence.Profile(*planner.priced(timing, trainable, direct), activations.block_costs() if profiled else [],
                                        self._beside() if profiled else BesideBlocks())
        try:
            plan, order = planner.search(
                timing, trainable, self._machine(), direct_gradients=direct, blocks=self.profile.blocks if joint else (),
                links=activations.links() if joint else None, activation_host_bytes=activations.host_left(),
                beside=self.profile.beside if joint else fixed,
            )
        except PlacementError as error:
            # the search's smallest split is conservative; the first-use placement (and the
            # activation planner's own fallback) may still fit
            self.say(f"tiered: placement search found no split of the GPU tier, keeping the first-use placement: {error}")
            return None
        count = self.ranks.same_on_every_rank(plan.parameters.persistent)  # measured times differ between ranks
        layout = self.ranks.same_on_every_rank(plan.activations)
        activations.searched_with_placement(layout)
        self.say(searched_placement_line(count, len(engine.states), plan.parameters.buffers, plan.seconds))
        self.prediction.planned(plan.seconds, "placement search")
        # rank 0's layout: each rank's own search may have chosen another, with another peak
        kept = layout if layout is not None else activations.fixed
        resident = sequence.searched_share(planner, order, count, kept, self.in_use.placement, self.profiling_placement)
        if resident is None:
            return None
        # beside the layout searched with it, not the profiling step's
        return plan.seconds, resident.gpu_bytes, layout.layout if layout is not None else None

    def _beside(self) -> BesideBlocks:
        """The most activations a profiled forward kept outside the blocks, and the most backward
        gradients, on any rank."""
        # scaled to a max_batch before the ranks agree: each rank scales from its own profiled batches
        measured, largest = self.activations.measured_beside.scaled(self.activations.growth), self.ranks.largest_on_every_rank
        return BesideBlocks(*(largest(n) for n in measured.fields()))

    def _plan_activations(self, rules: PlanningRules, costs: Optional[list[BlockCost]] = None, beside: Optional[BesideBlocks] = None) -> None:
        """``activations="auto"``, after the profiling step: the planner chooses every block's
        policy and it is put in place. When no layout fits beside the parameters' share of the GPU
        tier, the parameters are placed again in the share the planner names (the optimizer states
        move through their standard state dicts, exactly) and the layout is chosen for what remains.
        ``costs``, ``beside``: the blocks' costs and the bytes beside them scaled to a larger batch
        than the profiled ones."""
        activations, grown = self.activations, costs is not None
        if costs is None or beside is None:
            costs = self.ranks.same_on_every_rank(activations.block_costs())  # measured times differ between ranks
            beside = self._beside()
        self.phase = SessionPhase.LAID_OUT
        # the profile the plan comes from, for a replay on it (sequence.plan_from_profile)
        self.profile = sequence.Profile([], {}, costs, beside) if self.profile is None else replace(self.profile, blocks=costs, beside=beside)
        parameter_bytes = activations.choose_layout(costs, beside, lend_spare_staging=self.profiling_placement)
        if parameter_bytes is not None:
            budgets = self.context.budgets
            assert budgets is not None and activations.plan is not None
            measured = "of the largest batch so far" if grown else "measured in the first training steps"
            self.say(
                f"tiered: the activations {measured} do not fit beside the parameters' current share of "
                f"gpu_memory={format_bytes(budgets.gpu)}: the parameters are placed again in {format_bytes(parameter_bytes)} of it, "
                f"the rest is the activations'."
            )
            self._replace(rules, parameter_bytes, activations.plan.layout, False)  # the layout it was shared with
            activations.choose_layout_beside(costs)
        activations.apply_layout()
        assert activations.plan is not None
        if self.profiling_placement and self.context.engine is not None:
            # no search replaced the profiling placement: the parameters take what the layout leaves
            self._replace(rules, self.gpu_for_parameters(activations.plan.peak_bytes), None, True)
        if activations.plan is not activations.searched:  # the search priced its layout with the parameters' traffic
            self.prediction.planned(activations.plan.seconds, "activation layout")
            self._priced(activations.plan.seconds)

    def _priced(self, seconds: float) -> None:
        """The plan in use with the prediction that chose it."""
        if self.in_use is not None and self.in_use.prediction is None:
            self.in_use = replace(self.in_use, prediction=seconds)

    def _recomputed_groups(self, users: Any, block_units: list[list[int]]) -> tuple[tuple[int, ...], ...]:
        """The units of each layer the model recomputes in backward itself (its own activation
        checkpointing): Hugging Face's layers whose ``gradient_checkpointing`` flag is set (a T5's
        decoder layers too, which are not the blocks found), and the blocks seen recomputed."""
        groups = {tuple(block_units[i]) for i in self._recomputed_known}
        for layer in self.context.module.modules():
            if getattr(layer, "gradient_checkpointing", False) is True and any(c.__name__ == "GradientCheckpointingLayer" for c in type(layer).__mro__):
                inside = {id(m) for m in layer.modules()}
                groups.add(tuple(sorted({u.index for module, used in users.items() if id(module) in inside for u in used})))
        return tuple(sorted(g for g in groups if g))

    def _note_blocks_the_model_recomputes(self) -> None:
        """Blocks whose units ran again in the last backward though this runtime kept their
        activations: the model's own checkpoint recomputed them, and uses each one's units together
        then, so the plans to come keep room for them (the engine in place held them already,
        through the step that showed it)."""
        planner, engine = self.planner, self.context.engine
        if planner is None or planner.model is None or engine is None:
            return
        recomputed, model = engine.take_recomputed(), planner.model
        seen = {i for i, (units, policy) in enumerate(zip(model.block_units, self.activations.policies))
                if policy not in RECOMPUTED and recomputed.intersection(units)}
        new = sorted(i for i in seen - self._recomputed_known if tuple(model.block_units[i]) not in model.recomputed_by_model)
        self._recomputed_known |= seen
        if not new:
            return
        groups = tuple(sorted({*model.recomputed_by_model, *(tuple(model.block_units[i]) for i in new)}))
        planner.note_recomputed_by_model(groups)
        self.say(f"tiered: the model recomputes {len(groups)} of its layers in backward itself (its own activation checkpointing): "
                 f"plans keep each one's units together")

    def _keep_timing(self) -> None:
        """After each step before planning: the blocks are timed again (the warm steps' times,
        not the first's, the least of them kept), and each warm step's unit times kept."""
        done, engine = self.steps_done, self.context.engine
        if WARM_UP_STEPS <= done < WARM_UP_STEPS + TIMED_STEPS:
            self.activations.measure_blocks_again(keep_fastest=done > WARM_UP_STEPS)
        if WARM_UP_STEPS < done <= WARM_UP_STEPS + TIMED_STEPS and engine is not None and engine.timer.last_timing is not None:
            self._timed.append(engine.timer.last_timing)

    def forget_timing(self) -> None:
        """Another engine's units: the warm steps' times kept so far are not theirs."""
        self._timed = []

    def _predict_fixed_placement(self) -> None:
        """A placement nothing searched is predicted once, by the step model on the first step's
        compute times, so that its error is reported as a search's is."""
        predicted = self.predicted_step() if self.context.engine is not None else None
        if predicted is not None:
            self.prediction.planned(predicted.seconds, "step model")
            self._priced(predicted.seconds)

    # -- what the plans predict -------------------------------------------------------------------------

    def _machine(self) -> Machine:
        return self.ranks.machine(machine_from_spec(self.context.hardware, nvme=self.context.nvme_path is not None))

    def predicted_step(self, timing: Optional[StepProfile] = None) -> Optional[StepPrediction]:
        """The step model's prediction (planning/cost_model.py) for the placement in use, from the
        compute times of ``timing`` (default: the engine's last timed training step); None before
        a step has been timed or without an engine (nothing offloaded)."""
        engine = self.context.engine
        timing = timing if timing is not None else engine.timer.last_timing if engine is not None else None
        if engine is None or timing is None or self.planner is None or self.planner.model is None:
            return None
        model = self.planner.model
        sizes = {u.index: u for u in model.sizes}
        owns = model.sharding.owns if model.sharding is not None else None
        costs = costs_from_timing(
            timing, [bool(s.unit.trainable) for s in engine.states], {i: u.reduced_bytes for i, u in sizes.items()}, owns, model.tensors,
        )
        order = list(dict.fromkeys(timing.order)) + [i for i in range(len(engine.states)) if i not in timing.order]
        units = [
            replace(
                costs[i], home=engine.states[i].home, direct_gradient=i in engine.gradients.direct,
                state_bytes=int(sizes[i].trainable_bytes * model.state_factor) if engine.states[i].home == NVME and i in sizes else 0,
            )
            for i in order
        ]
        return simulate_step([*units, outside_units(timing)], engine.placement.device_slots, self._machine(), engine.placement.host_copies)

    def planned_use(self) -> Optional[PlannedUse]:
        """The GPU tier as the plan holds it now (None before the budgets are granted)."""
        budgets = self.context.budgets
        if budgets is None:
            return None
        plan = self.activations.plan if self.activations.plan is not None else self.activations.fixed
        return PlannedUse(budgets.gpu, self.activations.gpu_parameter_bytes(), plan.peak_bytes if plan is not None else None, self.activations.beside)

    # -- the plan as a file -------------------------------------------------------------------------

    def plan_as_file(self) -> PlanFile:
        """What this run decided (every unit's home, every block's activation policy), as a plan file."""
        budgets, module, engine = self.context.budgets, self.context.module, self.context.engine
        assert budgets is not None
        model = self.planner.model if self.planner is not None else None
        if model is None:  # nothing was placed (policy 'none'): every unit in the GPU tier
            units, _ = build_units(module)
            names, nbytes, homes = [u.name for u in units], [u.nbytes for u in units], [GPU] * len(units)
        else:
            names, nbytes = model.names, [u.nbytes for u in model.sizes]
            homes = [Tier(engine.placement.home[u.index]) if engine is not None else GPU for u in model.sizes]
        prediction = self.predicted_step()
        return PlanFile(
            units=tuple(PlannedUnit(n, b, h, *self._explain_unit(i, h)) for i, (n, b, h) in enumerate(zip(names, nbytes, homes))),
            activations=tuple(self.activations.policies) if self.activations.blocks else None,
            budgets={"gpu": budgets.gpu, "host": budgets.host, "nvme": budgets.nvme},
            prediction=None if prediction is None else prediction_record(prediction),
        )

    def _explain_unit(self, index: int, home: str) -> tuple[str, Optional[str], Optional[str]]:
        """A unit's compute mode, where its gradient is produced and where its optimizer states live."""
        engine = self.context.engine
        if engine is not None:
            trainable = bool(engine.states[index].unit.trainable)
        else:
            trainable = any(p.requires_grad for p in self.context.module.parameters())
        if home == GPU:
            mode, gradient = "resident", "gpu"
        else:
            assert engine is not None
            mode = "in_place" if index in engine.placement.dha else "streamed"
            gradient = "direct" if index in engine.gradients.direct else "copied"
        return mode, gradient if trainable else None, home if trainable else None

    # -- what the log says of a plan ----------------------------------------------------------------------

    def describe(self, plan: Plan) -> str:
        """A few short lines: a table of units and bytes per tier, where gradients and optimizer
        states live, the blocks and (unless the activation layout's own line will say it) their layout."""
        tiers: dict[str, list[int]] = {}
        for unit in plan.model.sizes:
            count = tiers.setdefault(str(plan.placement.home[unit.index]), [0, 0])
            count[0] += 1
            count[1] += unit.nbytes
        title = "tiered: placement (a unit: parameters that move between tiers as one; optimizer states with their unit's parameters)"
        budgets = self.context.budgets
        if plan.profiling and budgets is not None:
            steps = "step measures" if self.activations.observing else f"{WARM_UP_STEPS + TIMED_STEPS} steps measure"
            title = (f"tiered: placement while the first {steps} the activations (fewest buffers: "
                     f"{format_bytes(plan.placement.gpu_bytes)} of gpu_memory={format_bytes(budgets.gpu)})")
        lines = [title, *placement_table(tiers)]
        lines.append(f"tiered: gradients {_where_gradients_live(plan.placement, tiers)}")
        lines.append(f"tiered: blocks: {self.activations.described_blocks}{self._layout_note()}")
        return "\n".join(lines)

    def _layout_note(self) -> str:
        """The blocks' activation policies where no later line says them: under ``activations="auto"``
        the layout is chosen after the measured steps and its own line ("activation layout") gives it."""
        activations = self.activations
        if activations.searched is not None:  # placed again for the searched layout, which its own line gives
            return ""
        if activations.measuring:
            return f"; their activations are laid out after the first {WARM_UP_STEPS + TIMED_STEPS} steps (a line says how)"
        if activations.auto:
            return ""
        policies = activations.policies if activations.blocks else []
        return "; activations per block: " + (" ".join(BlockPolicy(p).letter for p in policies) if policies else "no repeated blocks")

    def _everything_fits(self, placement: Placement, gpu_bytes: int, rules: PlanningRules) -> str:
        budgets = self.context.budgets
        assert budgets is not None
        share = "" if gpu_bytes >= budgets.gpu else f"the {format_bytes(gpu_bytes)} the activations leave of "
        said = (
            f"tiered: everything fits in the GPU tier ({format_bytes(placement.gpu_bytes)} of parameters, gradients and optimizer "
            f"states in {share}gpu_memory={format_bytes(budgets.gpu)}): nothing is offloaded, training runs as on a single device"
        )
        blocks = f" Blocks: {self.activations.described_blocks}."
        measured = self.phase not in (SessionPhase.INITIAL, SessionPhase.PROFILING)  # placed beside the layout the profiled steps chose
        if rules.training and self.activations.auto and self.activations.blocks and not measured:
            # the activations are not known yet: a user told "nothing is offloaded" and then shown
            # every unit in host memory after the first step took the two lines for a contradiction
            return said + (
                ", unless the activations the first training step measures do not fit beside them"
                " (then the units are placed again, and a line says where)." + blocks
            )
        return said + "." + blocks

    def say_when_updates_wait(self, rules: PlanningRules, plan: Plan) -> None:
        """Once per run: what keeps the updates from overlapping backward (LoHan §IV-C) is the recipe's."""
        if self._said_updates_wait or not rules.training or not rules.needs_all_gradients():
            return
        self._said_updates_wait = True
        why, homes = rules.why_updates_wait(), set(plan.placement.home.values())
        on_nvme = ("NVMe units' gradients waiting on NVMe meanwhile; the units read from disk are updated on the update worker's "
                   "pipeline while the training thread updates the others")
        nvme_waits = rules.gradients_wait_on_nvme() and NVME in homes
        if rules.updates_may_run_ahead_of_clipping() and HOST in homes:
            rest = f"; the other offloaded units after backward, {on_nvme}" if nvme_waits else ""
            self.say(
                f"tiered: {why} before any update: units in host memory are updated during backward all the same, their previous "
                f"values kept in what the host budget leaves, and updated again after backward on steps whose norm exceeds "
                f"gradient_clip_val (the optimizer/speculation_* metrics count them; a step after one that clipped updates after "
                f"backward){rest}."
            )
            return
        on_nvme = f"offloaded units are updated after backward, {on_nvme}"
        kept = ("the gradients of the units this rank owns kept in host memory (the others' sent on to their owners)"
                if plan.placement.gradients_sent else "their gradients kept in host memory")
        where = on_nvme if nvme_waits else f"offloaded units are updated after backward, {kept}"
        self.say(f"tiered: {why} before any update, so updates cannot overlap backward: {where}.")


def _work(unit: Any) -> tuple[Hashable, ...]:
    """What makes two units do the same work in a step (``ModelUnits.work``)."""
    return tuple((tuple(p.shape), str(p.dtype), p.requires_grad) for p in unit.params)


def _where_gradients_live(placement: Placement, tiers: dict[str, list[int]]) -> str:
    if placement.gradients_sent:
        own = "only until updated, through the same buffers" if placement.host_gradients_in_flight else "at home"
        return (f"of the {len(placement.gradients_sent)} offloaded units other ranks own only until sent to them, through "
                f"{sum(placement.gradient_slots.values())} host buffers; the others' {own}")
    if placement.host_gradients_in_flight:
        return f"only in flight, through {sum(placement.gradient_slots.values())} host buffers (no room for a home each)"
    if placement.gradient_slots:
        gradients = f"NVMe units' through {sum(placement.gradient_slots.values())} host buffers" + (
            ", waiting on NVMe for the step when they must" if placement.gradients_spilled else "")
        return gradients + (", the others' at home" if any(t != NVME for t in tiers if t != GPU) else "")
    return "at each offloaded unit's home in host memory" if placement.offloaded else "in the GPU tier"


def placement_table(tiers: dict[str, list[int]]) -> list[str]:
    """``tier | units | bytes`` rows, one per tier that holds a unit (``tiers``: tier -> [units, bytes])."""
    order = sorted(tiers, key=lambda tier: (GPU, HOST, NVME).index(tier) if tier in (GPU, HOST, NVME) else 3)
    rows = [("tier", "units", "bytes")] + [(tier, str(tiers[tier][0]), format_bytes(tiers[tier][1])) for tier in order]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [f"  {a:<{widths[0]}} | {b:>{widths[1]}} | {c:>{widths[2]}}" for a, b, c in rows]


def searched_placement_line(resident: int, units: int, buffers: int, seconds: float) -> str:
    """The search's choice in plain terms: the predicted step is what it chose by, so it is said."""
    if resident == units:
        kept = f"all {units} units stay in the GPU tier"
    elif resident == 0:
        kept = f"all {units} units copied in when used, through {buffers} GPU buffers"
    else:
        kept = f"{resident} of {units} units kept in the GPU tier, {units - resident} copied in through {buffers} buffers"
    return f"tiered: placement search (fastest predicted step {seconds * 1e3:.1f} ms): {kept}"
