"""``TieredCore``: what every tiered strategy does, as one object the Lightning strategy holds
(``TieredStrategy``, ``TieredDDPStrategy``) and delegates its hooks to, instead of a mixin.

It validates what the user asked for, resolves the memory budgets of each tier against what is
free, asks the planner for each plan and hands it to the engine, runs the training step's protocol
around the engine, writes checkpoints with true values and exposes the metrics the engine reports.
What data parallelism changes is a :class:`Ranks` collaborator (``OneProcess`` here,
``strategy_ddp.DataParallelRanks`` there). The core holds no placement logic: the planner decides,
the runtime engine carries it out. Until the engine is attached every tensor stays on the root
device, which trains exactly as Lightning's single-device strategy does.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_debug

from .config import BlockPolicy, Budget, HardwareSpec, PolicyConfig, StateDictType, Tier, format_bytes
from .deferred import DeferredParameters
from .hardware import cuda_gpu_margin, disk_free, gpu_free, host_available, process_peak_rss, release_freed_host_memory, resolve_hardware
from .hardware.device import make_device
from .memory.nvme import make_private_directory
from .planning.activations import RECOMPUTED, BesideBlocks, BlockCost
from .planning.auto import AutoPlan
from .planning.cost_model import Machine, StepPrediction, costs_from_timing, machine_from_spec, outside_units, simulate_step
from .planning.memferry import gradient_offload_plan
from .planning.placement import GPU, HOST, NVME, Placement, PlacementError, UnitSize
from .planning.plan_file import PlanFile, PlannedUnit, check_plan, load_plan, prediction_record, save_plan
from .planning.planner import ModelUnits, Planner, PlanPhase, TierBudgets
from .planning.sharding import Sharding
from .profiling import StepProfile, fastest_timing
from .runtime.activations import find_blocks
from .runtime.data_parallel import DataParallel, Reduction
from .memory.nvme import NvmeStore
from .runtime.engine import TieredEngine
from .runtime.optimizer import StatesReadOnUse, compact, measured_state_factor
from .runtime.out_of_memory import PlannedUse, out_of_memory_explained
from .runtime.units import build_units, master_dtype, merge_into_chunks
from .sharded_checkpoint import LazyState, Readers, ShardedCheckpoint, is_sharded_checkpoint, write_sharded
from .strategy_activations import ActivationControl
from .strategy_context import LightningState, TieredContext, TieredOptions
from .strategy_prediction import PredictionCheck
from .strategy_recipe import Recipe, Rules
from .strategy_step import tiered_optimizer_step

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Precision plugins whose semantics the tiered runtime reproduces: 32-true, 64-true,
# 16/bf16-mixed and 16/bf16-true. Others (bitsandbytes, Transformer Engine, ...) change the module
# or the step in ways the runtime would silently undo.
_SUPPORTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)

# Steps before the ones the planner prices: the first use of every buffer and kernel makes the
# first step slower than the rest by an amount that varies from run to run (docs/benchmarks.md).
WARM_UP_STEPS = 1
# Warm steps whose least times, unit by unit and block by block, price the plan: a neighbour
# process busy during one of them does not change it.
TIMED_STEPS = 2

# Optimizer state bytes per parameter byte, for budgeting before the first step creates them.
_STATE_FACTORS = {"SGD": 1.0, "Adagrad": 1.0, "RMSprop": 1.0, "Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adadelta": 2.0}


class MemoryBudgetError(ValueError):
    """A tier budget asks for more than the tier has free."""


def check_precision(plugin: Optional[Precision]) -> Optional[Precision]:
    """The precision plugin, if the tiered runtime reproduces its semantics."""
    if plugin is not None and type(plugin) not in _SUPPORTED_PRECISION:
        raise ValueError(
            f"strategy='tiered' does not support the precision plugin {type(plugin).__name__}; "
            f"use precision='32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
        )
    return plugin


def nvme_reserve(free: int) -> int:
    """Disk space an NVMe budget of "all that is free" (or a fraction of it) leaves unused."""
    # a file system spends a few blocks per file beyond its bytes: 1 MiB, or 0.1% of a large disk,
    # never more than an eighth of a small one
    return min(free // 8, max(1024**2, free // 1000))


def master_dtype_size(p: torch.Tensor, fp32_masters: bool) -> int:
    """Bytes per element of a parameter's gradient, master and states."""
    return torch.empty((), dtype=master_dtype(p, fp32_masters)).element_size()


def optimizer_state_factor(optimizers: list[torch.optim.Optimizer]) -> float:
    """Bytes of optimizer state per trainable parameter byte: what one step of each optimizer's
    class keeps on a stand-in (``measured_state_factor``: AdamW with ``amsgrad`` 3), never less than
    the class's usual count (2 for Adam; unknown classes 2)."""
    return max((max(_STATE_FACTORS.get(type(o).__name__, 2.0), measured_state_factor(o) or 0.0) for o in optimizers), default=0.0)


class Ranks(Protocol):
    """What data parallelism changes in the core (``OneProcess``: nothing)."""

    engine_when_all_fits: bool  # the engine runs even when every unit fits in the GPU tier

    def data_parallel(self, sizes: list[UnitSize]) -> Optional[DataParallel]:
        """The ranks the engine reduces gradients across; None on one device."""

    def sharding(self, sizes: list[UnitSize], gradients_sent: bool) -> Optional[Sharding]:
        """Which rank keeps each unit's optimizer states; None: this process keeps them all.
        ``gradients_sent``: every backward reduces to the owners (the recipe allows it)."""

    def same_on_every_rank(self, choice: Any) -> Any:
        """A planning decision taken from measurements: under data parallelism, rank 0's for all."""

    def largest_on_every_rank(self, value: int) -> int:
        """The largest of every rank's ``value`` (each rank's batch may differ)."""

    def gradient_reduction(self, accumulating: bool, needs_all_gradients: bool) -> Optional[Reduction]:
        """How this backward's gradients are reduced across ranks (see ``GradientExchange``)."""

    def share_budgets(self, granted: TierBudgets, requested: tuple[Budget, Budget, Budget]) -> TierBudgets:
        """Each process's budgets from what the tiers have free."""

    def measure_links(self) -> None:
        """At set-up, on every process: what the ranks' collectives move (nothing on one device)."""

    def machine(self, links: Machine) -> Machine:
        """The step model's machine: ``links`` with the ranks and their collectives."""

    def link_metrics(self) -> dict[str, float]:
        """What ``measure_links`` measured, as metrics."""

    def every_ranks_states(self, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizers' state dicts with every rank's units in them, for placing the model again
        (the units' owners may change with the placement)."""


class OneProcess:
    """One device, one process: nothing is reduced or shared."""

    engine_when_all_fits = False

    def data_parallel(self, sizes: list[UnitSize]) -> Optional[DataParallel]:
        return None

    def sharding(self, sizes: list[UnitSize], gradients_sent: bool) -> Optional[Sharding]:
        return None

    def same_on_every_rank(self, choice: Any) -> Any:
        return choice

    def largest_on_every_rank(self, value: int) -> int:
        return value

    def gradient_reduction(self, accumulating: bool, needs_all_gradients: bool) -> Optional[Reduction]:
        return None

    def share_budgets(self, granted: TierBudgets, requested: tuple[Budget, Budget, Budget]) -> TierBudgets:
        return granted

    def measure_links(self) -> None:
        return None

    def machine(self, links: Machine) -> Machine:
        return links

    def link_metrics(self) -> dict[str, float]:
        return {}

    def every_ranks_states(self, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return states


class TieredCore:
    """The tiered logic a Lightning strategy delegates to: budgets, planning, the engine's
    lifecycle, the training step, the optimizer step and checkpoints gathered from every tier."""

    def __init__(self, options: TieredOptions, lightning: LightningState, ranks: Ranks) -> None:
        self.options = options
        self.ranks = ranks
        self.context = TieredContext(options, lightning, hardware=options.hardware if isinstance(options.hardware, HardwareSpec) else None)
        self.activations = ActivationControl(self.context, ranks.largest_on_every_rank)
        self.removed_stale_nvme: list[Path] = []  # swap directories of killed runs this run removed
        self._plan: Optional[PlanFile] = None
        self._optimizer_stepped = False
        self._said_updates_wait = False  # the run has been told once that updates wait for backward's end
        self._profiled = False
        self._final_engine_metrics: Optional[dict[str, float]] = None
        self._created_directories: list[Path] = []
        # parameters of models built under this strategy, recorded instead of held (deferred.py)
        self.deferred = DeferredParameters()
        self.state_dict_type = StateDictType.FULL  # the single-process strategy chooses (data-parallel: full)
        self._stand_ins: Optional[Readers] = None  # the sharded checkpoint being built: NVMe values, read when written
        self.prediction = PredictionCheck()
        self._steps_done = 0  # training steps whose optimizers stepped, counted as the next begins
        self._timed: list[StepProfile] = []  # the warm steps' unit times, before planning
        self._fitted_trainable: Optional[set[int]] = None  # the parameters that fitted the GPU tier without an engine
        self._recomputed_known: set[int] = set()  # blocks seen recomputed by the model itself, as the planner knows them

    def __reduce__(self) -> Any:
        # A pickle of the strategy (``torch.save(trainer)``, as Lightning's own tests do) holds its
        # options, as before a run: what a run made (the engine's threads and files, the blocks'
        # weak references, a parameter class made per strategy) has no meaning elsewhere.
        return (_core_with_options, (type(self), self.options, self.lightning, self.ranks, self.state_dict_type))

    # -- what the strategy exposes ------------------------------------------------------------------

    @property
    def lightning(self) -> LightningState:
        return self.context.lightning

    @property
    def policy(self) -> PolicyConfig:
        return self.options.policy

    @property
    def hardware(self) -> Optional[HardwareSpec]:
        return self.context.hardware

    @property
    def budgets(self) -> Optional[TierBudgets]:
        return self.context.budgets

    @property
    def planner(self) -> Optional[Planner]:
        return self.context.planner

    @property
    def engine(self) -> Optional[TieredEngine]:
        return self.context.engine

    @property
    def placement_search(self) -> Optional[AutoPlan]:
        """What ``placement="search"`` chose, with its prediction (None before or without it)."""
        return self.planner.search_result if self.planner is not None else None

    def recipe(self, trainer: "pl.Trainer") -> Recipe:
        """What the trainer's recipe allows (``Rules``; Fabric's strategy has rules of its own)."""
        lightning = self.lightning
        return Recipe(trainer, lightning.precision_plugin, self.policy, lightning.world_size, len(lightning.optimizers))

    # -- lifecycle ----------------------------------------------------------------------------------

    def runs_an_engine(self) -> bool:
        """Every policy but ``none`` places the model through an engine; ``none`` too under the
        ``*-true`` 16-bit precisions, with every unit in the GPU tier, for the fp32 masters the
        other placements update: without them the same recipe trained otherwise under ``none``
        (a 16-bit AdamW's epsilon is 0 in fp16, and a parameter with a zero gradient became NaN)."""
        return self.policy.name != "none" or self.keeps_fp32_masters()

    def keeps_fp32_masters(self) -> bool:
        return isinstance(self.lightning.precision_plugin, (HalfPrecision, FabricHalfPrecision))

    def places_parameters_itself(self) -> bool:
        """On a GPU, parameters are created in host memory and placed by the engine, so that a model
        larger than the GPU never has to fit there whole."""
        return self.runs_an_engine() and self.lightning.root_device.type == "cuda"

    @contextlib.contextmanager
    def tensor_init_context(self, plain: Callable[[], contextlib.AbstractContextManager[None]], empty_init: Optional[bool]) -> Iterator[None]:
        """Models built here (``configure_model``, ``trainer.init_module()``) take no memory for
        their parameters: each is computed in its home once placed, to the bit what plain
        construction gives (deferred.py)."""
        root = self.lightning.root_device
        # initialisation draws where plain construction would: on a GPU root, from the GPU's generator
        building = self.deferred.recording(root if root.type == "cuda" else torch.device("cpu")) if self.policy.name != "none" else contextlib.nullcontext()
        if not self.places_parameters_itself():
            with building, plain():
                yield
            return
        with building, _EmptyInit(enabled=bool(empty_init)), self.lightning.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self, plain: Callable[[], None]) -> None:
        model = self.lightning.model
        assert model is not None
        if not self.places_parameters_itself() and not len(self.deferred):
            return plain()
        # buffers now; parameters once the engine has placed them (or computed where they run: on a
        # host root, the others are there already)
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(self.lightning.root_device)

    def setup(self, trainer: "pl.Trainer", plain: Callable[["pl.Trainer"], None]) -> None:
        self.resolve()
        if self.lightning.lightning_module is not None:
            self.deferred.adopt(self.lightning.lightning_module)
        plain(trainer)
        self.place_module(self.recipe(trainer))
        _refuse_weight_averaging_on_nvme(trainer, self.engine)
        plugin = trainer.precision_plugin
        plugin.clip_gradients = functools.partial(self.clip_gradients, type(plugin).clip_gradients.__get__(plugin))  # type: ignore[method-assign]

    def clip_gradients(self, plain: Callable[..., None], optimizer: Any, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        """Lightning's ``clip_gradients`` (the precision plugin's) called by the training step's own
        code under manual optimization: it clips the engine's gradients where they are held, fp32
        sums of 16-bit parameters included (as the automatic step clips them, with no 16-bit
        copies), through a gradient view; the automatic step gives it that view already."""
        engine = self.engine
        if engine is None or self.context.module.automatic_optimization or not clip_val or clip_val <= 0:
            return plain(optimizer, clip_val, gradient_clip_algorithm)  # the automatic step clips through its own view
        exposed = engine.exposure.exposed
        self.before_users_step()
        with engine.gradient_view(getattr(optimizer, "optimizer", optimizer)) as gradients:
            plain(gradients, clip_val, gradient_clip_algorithm)
        if exposed:
            engine.exposure.expose()  # the step's code may read the clipped gradients
        return None

    def resolve(self) -> None:
        """The hardware (probed when "auto") and each tier's budget, before anything is placed."""
        context = self.context
        if context.hardware is None:
            context.hardware = resolve_hardware(self.options.hardware)
        context.budgets = self.resolve_budgets()
        self.ranks.measure_links()
        root = self.lightning.root_device
        if root.type == "cuda":
            torch.cuda.reset_peak_memory_stats(root)

    def place_module(self, recipe: Rules) -> None:
        """The module's blocks, the planner and, unless the policy is ``none``, the engine with the
        first placement: every loop offloads (fit, and evaluation on its own, forward only)."""
        context, module, root = self.context, self.context.module, self.lightning.root_device
        assert context.budgets is not None
        plan_file = self.options.plan_file
        self._plan = load_plan(plan_file) if plan_file is not None else None
        activations = self.policy.activations
        if self._plan is not None and self._plan.activations is not None:
            blocks = len(find_blocks(module, self.policy.block_class))
            check_plan(self._plan, [u.name for u in self._plan.units], [u.nbytes for u in self._plan.units], blocks)  # blocks only, here
            activations = self._plan.activations
        self.activations.start(module, activations if activations is not None else "keep")
        context.planner = Planner(self.policy, context.budgets, self.options.nvme_path is not None, self._plan, self._refuse_a_full_disk)
        if self.runs_an_engine():
            _refuse_lazy_parameters(module)
            context.engine = self._build_engine(recipe)
        self.deferred.materialize_all(root)  # nothing placed them (it all fits): computed where they run
        if context.engine is None and self.places_parameters_itself():
            module.to(root)
        self.activations.use_saved_tensor_hooks()
        self.activations.attach_swap_if_needed()

    def _trainable_grew(self) -> bool:
        """Some parameter is trainable now that the placement in use planned no gradient or state for."""
        if self.engine is not None:
            return self.engine.trainable_grew()
        fitted = self._fitted_trainable
        return fitted is not None and any(p.requires_grad and id(p) not in fitted for p in self.context.module.parameters())

    def _replace_engine(
        self, recipe: Rules, gpu_bytes: int, block_policies: Optional[Sequence[str]] = None, may_fit: bool = False,
    ) -> None:
        """Place the parameters again with ``gpu_bytes`` of the GPU tier, between two steps
        (``block_policies``: the layout they will run beside, the one in place by default;
        ``may_fit``: everything may still fit, and no engine is needed)."""
        optimizers = self.lightning.optimizers
        # standard, exact: they move through these; with sharded states, each rank's units' too
        states = self.ranks.every_ranks_states([optimizer.state_dict() for optimizer in optimizers])
        self._timed = []  # another engine's units
        left = self._close_engine(leave=self._left_while_placing_again)
        self._free_closed_engine()
        self.context.engine = self._build_engine(recipe, gpu_bytes=gpu_bytes, block_policies=block_policies)
        if self.context.engine is None and not may_fit:
            raise RuntimeError(f"placing the parameters in {format_bytes(gpu_bytes)} of the GPU tier offloaded nothing")
        if left is not None:
            self.deferred.materialize_all(self.lightning.root_device)  # none when the new engine placed them all
            left.store.close()
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(state)
        del states
        release_freed_host_memory()  # the states just moved through memory
        self.activations.use_saved_tensor_hooks()
        self.activations.reattach_swap()  # it copied through the old engine's device, now closed

    def _left_while_placing_again(self, engine: TieredEngine) -> bool:
        """NVMe units are read from the old files into their new homes (which holds the old files
        and the new ones on the disk meanwhile) where the disk has room for both or they would take
        more than half of the host memory available; else they move through host memory."""
        free = disk_free(str(self.options.nvme_path)) if self.options.nvme_path is not None else 0
        return free - nvme_reserve(free) >= engine.placement.nvme_bytes or _nvme_state_bytes(engine) > _half_host_available()

    def _free_closed_engine(self) -> None:
        """The closed engine's GPU arena and pinned slab freed before the next engine allocates
        its own: the saved-tensor hooks stop naming the old engine, and a collection frees what
        its reference cycles (its parameters' class, its components' bound methods) still hold;
        on CUDA the caching allocator gives the arena back."""
        self.activations.use_saved_tensor_hooks()  # without an engine: the counting hooks
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _model_units(self, recipe: Rules, units: list[Any], users: Any, fp32_masters: bool) -> ModelUnits:
        """What the planner knows of the model's units: sizes (no gradients or states without
        training), the units used together, the blocks' units, and the recipe's gradient rules."""
        # Under *-true precisions gradients and states are in fp32 beside an fp32 master of each
        # parameter, and each 16-bit gradient lands in an area of the unit's size before widening.
        sizes = [
            UnitSize(
                u.index, u.nbytes, sum(p.numel() * master_dtype_size(p, fp32_masters) for p in u.trainable) if recipe.training else 0,
                landing_bytes=u.nbytes if recipe.training and fp32_masters and u.trainable else 0,
            )
            for u in units
        ]
        inside = [{id(m) for m in block.modules()} for block in self.activations.blocks]
        block_units = [sorted({u.index for module, used in users.items() if id(module) in ids for u in used}) for ids in inside]
        wait_on_nvme = recipe.gradients_wait_on_nvme()
        return ModelUnits(
            sizes=sizes, names=[u.name for u in units],
            co_resident=[[u.index for u in used] for used in users.values()], block_units=block_units,
            recomputed_by_model=self._recomputed_groups(users, block_units),
            state_factor=optimizer_state_factor(self.lightning.optimizers) + (1.0 if fp32_masters else 0.0),  # the masters
            sharding=self.ranks.sharding(sizes, recipe.training and recipe.every_backward_reduces_to_owners()),
            gradients_until_update=recipe.training and (recipe.every_step_updates_in_backward() or wait_on_nvme),
            spill_gradients=recipe.training and wait_on_nvme, work=[_work(u) for u in units], tensors=[len(u.trainable) for u in units],
        )

    def _build_engine(
        self, recipe: Rules, gpu_bytes: Optional[int] = None, block_policies: Optional[Sequence[str]] = None,
    ) -> Optional[TieredEngine]:
        """Place every unit within the budgets (``gpu_bytes``: the part of the GPU tier parameters
        may use, all of it by default; ``block_policies``: the activation layout whose recomputed
        blocks need their units together, the one in place by default); None when everything fits
        in the GPU tier."""
        budgets, planner, model = self.context.budgets, self.context.planner, self.context.module
        assert budgets is not None and planner is not None
        units, users = build_units(model)
        if self.policy.chunk_size:
            units, users = merge_into_chunks(units, users, int(self.policy.chunk_size))
        fp32_masters = self.keeps_fp32_masters()
        planner.model = self._model_units(recipe, units, users, fp32_masters)
        policies = self.activations.policies if block_policies is None else block_policies
        together = planner.working_groups(policies) if recipe.training else list(planner.model.co_resident)  # no recompute without gradients
        gpu_bytes = budgets.gpu if gpu_bytes is None else gpu_bytes
        placement = planner.place(planner.model, gpu_bytes, together, activations_auto=self.activations.auto)
        # under *-true 16-bit precisions the engine keeps fp32 masters even with nothing offloaded:
        # without it the same recipe trained with or without masters depending on gpu_memory
        if not placement.offloaded and not self.ranks.engine_when_all_fits and not fp32_masters:
            rank_zero_info(self._everything_fits(placement, gpu_bytes, recipe))
            self._fitted_trainable = {id(p) for p in model.parameters() if p.requires_grad}
            return None
        placement = self._profiling_placement(placement, recipe, together, gpu_bytes)
        _refuse_compiled_modules(model)
        _refuse_sparse_gradients(model, units, placement)
        return self._start_engine(units, users, placement, planner.model.sizes, fp32_masters, recipe)

    def _profiling_placement(self, placement: Placement, recipe: Rules, together: list[list[int]], gpu_bytes: int) -> Placement:
        """Until the first steps have measured the blocks' activations, the parameters stream
        through the fewest buffers their modules need, and the activations have the rest of the
        GPU tier: ProTrain §3.2 profiles under the most memory-saving configuration. The first-use
        placement would fill the tier with buffers and resident units, and the profiled steps'
        activations, measured beside them, would overrun it (on a GPU, out of memory in the first
        step). The search after those steps places the parameters for what they measured."""
        planner = self.planner
        assert planner is not None
        planner.profiling_placement = False
        if not (recipe.training and placement.offloaded and planner.searching and planner.phase is PlanPhase.INITIAL
                and self.activations.measuring and self.activations.blocks):
            return placement
        if any(not size.trainable_bytes for size in planner.units.sizes):
            # a unit with nothing to train that the model's own checkpointing recomputes stays in the
            # GPU tier until the step ends (``RecomputeHolds`` lets go only this runtime's blocks'), and
            # a model's own checkpointing may show itself only in its first backward: the fewest
            # buffers might not hold them (a frozen base under adapters, a finetuning callback's frozen layers)
            return placement
        smallest = planner.least_parameter_share(together)  # what host memory and NVMe can hold the rest of
        if smallest >= placement.gpu_bytes:
            return placement
        try:
            frugal = planner.place(planner.units, smallest, together, activations_auto=True)
        except PlacementError:  # host memory may need some units resident: the first-use placement, then
            planner.place(planner.units, gpu_bytes, together, activations_auto=True)
            return placement
        planner.profiling_placement = True
        planner.gpu_given = gpu_bytes  # what the parameters may take once the activations are known
        return frugal

    def _everything_fits(self, placement: Placement, gpu_bytes: int, recipe: Rules) -> str:
        said = (
            f"tiered: everything fits in the GPU tier ({format_bytes(placement.gpu_bytes)} of parameters, gradients and optimizer "
            f"states in gpu_memory={format_bytes(gpu_bytes)}): nothing is offloaded, training runs as on a single device"
        )
        blocks = f" Blocks: {self.activations.described_blocks}."
        if recipe.training and self.activations.auto and self.activations.blocks:
            # the activations are not known yet: a user told "nothing is offloaded" and then shown
            # every unit in host memory after the first step took the two lines for a contradiction
            return said + (
                ", unless the activations the first training step measures do not fit beside them"
                " (then the units are placed again, and a line says where)." + blocks
            )
        return said + "." + blocks

    def _start_engine(
        self, units: list[Any], users: Any, placement: Placement, sizes: list[UnitSize], fp32_masters: bool, recipe: Rules
    ) -> TieredEngine:
        budgets, planner, lightning = self.context.budgets, self.context.planner, self.lightning
        assert budgets is not None and planner is not None and planner.model is not None
        device = make_device(lightning.root_device, capacity=budgets.gpu, spec=self.hardware, throttle=self.policy.throttle)
        nvme_path = self.options.nvme_path
        try:
            engine = TieredEngine(
                self.context.module, units, users, placement, device, nvme_path=str(nvme_path) if nvme_path else None,
                optimizers=lightning.optimizers, direct_gradients=self._direct_gradients(sizes, placement, device.is_emulated),
                checksums=self.policy.checksums, fp32_masters=fp32_masters, data_parallel=self.ranks.data_parallel(sizes),
                prefetch=self.policy.prefetch, state_factor=planner.model.state_factor, initial_value=self.deferred.fill,
            )
        except BaseException:
            device.close()
            raise
        self._profiled = False
        self._share_optimizer_attributes()
        rank_zero_info(self._describe_placement(engine))
        self._say_when_updates_wait(recipe, engine)
        if engine.store is not None:
            self.removed_stale_nvme = list(engine.store.removed_stale)
        return engine

    def _describe_placement(self, engine: TieredEngine) -> str:
        """A few short lines: a table of units and bytes per tier, where gradients and optimizer
        states live, the blocks and (unless the activation layout's own line will say it) their layout."""
        tiers: dict[str, list[int]] = {}
        for state in engine.states:
            count = tiers.setdefault(str(state.home), [0, 0])
            count[0] += 1
            count[1] += state.unit.nbytes
        title = "tiered: placement (a unit: parameters that move between tiers as one; optimizer states with their unit's parameters)"
        planner = self.planner
        if planner is not None and planner.profiling_placement:
            title = (f"tiered: placement while the first {WARM_UP_STEPS + TIMED_STEPS} steps measure the activations (fewest buffers: "
                     f"{format_bytes(engine.placement.gpu_bytes)} of gpu_memory={format_bytes(planner.budgets.gpu)})")
        lines = [title, *placement_table(tiers)]
        lines.append(f"tiered: gradients {self._where_gradients_live(engine, tiers)}")
        lines.append(f"tiered: blocks: {self.activations.described_blocks}{self._layout_note()}")
        return "\n".join(lines)

    @staticmethod
    def _where_gradients_live(engine: TieredEngine, tiers: dict[str, list[int]]) -> str:
        placement = engine.placement
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

    def _say_when_updates_wait(self, recipe: Rules, engine: TieredEngine) -> None:
        """Once per run: what keeps the updates from overlapping backward (LoHan §IV-C) is the recipe's."""
        if self._said_updates_wait or not recipe.training or not recipe.needs_all_gradients():
            return
        self._said_updates_wait = True
        why = recipe.why_updates_wait()
        on_nvme = ("NVMe units' gradients waiting on NVMe meanwhile; the units read from disk are updated on the update worker's "
                   "pipeline while the training thread updates the others")
        nvme_waits = recipe.gradients_wait_on_nvme() and any(s.home == NVME for s in engine.states)
        if recipe.updates_may_run_ahead_of_clipping() and any(s.home == HOST for s in engine.states):
            rest = f"; the other offloaded units after backward, {on_nvme}" if nvme_waits else ""
            rank_zero_info(
                f"tiered: {why} before any update: units in host memory are updated during backward all the same, their previous "
                f"values kept in what the host budget leaves, and updated again after backward on steps whose norm exceeds "
                f"gradient_clip_val (the optimizer/speculation_* metrics count them; a step after one that clipped updates after "
                f"backward){rest}."
            )
            return
        on_nvme = f"offloaded units are updated after backward, {on_nvme}"
        kept = ("the gradients of the units this rank owns kept in host memory (the others' sent on to their owners)"
                if engine.placement.gradients_sent else "their gradients kept in host memory")
        where = on_nvme if nvme_waits else f"offloaded units are updated after backward, {kept}"
        rank_zero_info(f"tiered: {why} before any update, so updates cannot overlap backward: {where}.")

    def _share_optimizer_attributes(self) -> None:
        """Lightning's wrappers find the optimizer's methods on its class before the instance:
        the ``zero_grad`` the engine put in place (or took back) must reach ``self.optimizers()[k]``
        too (``state`` and other instance attributes are looked up on the optimizer itself)."""
        for wrapper in self.lightning._lightning_optimizers:
            if "zero_grad" in wrapper.optimizer.__dict__:
                wrapper.__dict__["zero_grad"] = wrapper.optimizer.zero_grad
            else:
                wrapper.__dict__.pop("zero_grad", None)

    def _refuse_a_full_disk(self, error: PlacementError) -> None:
        """NVMe fell short where its budget is what the disk has free: say the disk is full."""
        nvme_path, nvme_memory = self.options.nvme_path, self.options.nvme_memory
        if not error.nvme_needed or nvme_path is None or nvme_memory.bytes is not None:
            return
        if self.budgets is not None and self.budgets.nvme >= error.nvme_needed:
            return
        free = disk_free(str(nvme_path))
        raise PlacementError(
            f"{format_bytes(error.nvme_needed)} of parameters and optimizer states must go to NVMe, but the file system "
            f"under nvme_path={str(nvme_path)!r} has only {format_bytes(free)} free (nvme_memory="
            f"{'None' if nvme_memory.fraction is None else nvme_memory.fraction} grants what is free, less a reserve "
            f"of {format_bytes(nvme_reserve(free))}): free space there, point nvme_path at a larger disk, or raise host_memory.",
            nvme_needed=error.nvme_needed,
        ) from None

    def _search_placement(self, recipe: Rules) -> None:
        """``placement="search"``, after the profiled first step: the planner's search (jointly with
        the activation layout under ``activations="auto"``); the fastest is put in place between
        two steps (the optimizer states move through their state dicts, exactly)."""
        engine, planner = self.engine, self.planner
        assert engine is not None and planner is not None
        timing = fastest_timing(self._timed) if self._timed else engine.timer.last_timing or engine.timer.profile
        if not timing.order:  # first use in forward of every unit, resident ones included
            timing = replace(timing, order=list(engine.timer.profile.order))
        activations = self.activations
        joint = activations.joint_search
        machine = self.ranks.machine(machine_from_spec(self.hardware, nvme=self.options.nvme_path is not None))
        try:
            plan, order = planner.search(
                timing, [bool(s.unit.trainable) for s in engine.states], machine,
                # on the emulated tier every offloaded gradient is written at home (_direct_gradients): no copy on the link
                direct_gradients=engine.device.is_emulated and not self.policy.gradient_reserve,
                blocks=activations.block_costs() if joint else (), links=activations.links() if joint else None,
                activation_host_bytes=activations.host_left(),
                beside=self._beside() if joint else BesideBlocks(),
            )
        except PlacementError as error:
            # the search's smallest split is conservative; the first-use placement (and the
            # activation planner's own fallback) may still fit
            rank_zero_info(f"tiered: placement search found no split of the GPU tier, keeping the first-use placement: {error}")
            return
        count = self.ranks.same_on_every_rank(plan.parameters.persistent)  # measured times differ between ranks
        layout = self.ranks.same_on_every_rank(plan.activations)
        activations.searched = layout
        rank_zero_info(searched_placement_line(count, len(engine.states), plan.parameters.buffers, plan.seconds))
        self.prediction.planned(plan.seconds, "placement search")
        # rank 0's layout: each rank's own search may have chosen another, with another peak
        resident = planner.keep_resident(replace(plan, activations=layout), order, count, {s.unit.index for s in engine.states if s.home == GPU})
        if resident is not None:  # beside the layout searched with it, not the profiling step's
            self._replace_engine(recipe, gpu_bytes=resident.gpu_bytes, block_policies=layout.layout if layout is not None else None,
                                 may_fit=planner.profiling_placement)

    def _beside(self) -> BesideBlocks:
        """The most activations a profiled forward kept outside the blocks, and the most backward
        gradients, on any rank."""
        # scaled to a max_batch before the ranks agree: each rank scales from its own profiled batches
        measured, largest = self.activations.measured_beside.scaled(self.activations.growth), self.ranks.largest_on_every_rank
        return BesideBlocks(*(largest(n) for n in measured.fields()))

    def _plan_activations(self, recipe: Rules, costs: Optional[list[BlockCost]] = None, beside: Optional[BesideBlocks] = None) -> None:
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
        parameter_bytes = activations.choose_layout(costs, beside)
        if parameter_bytes is not None:
            budgets = self.context.budgets
            assert budgets is not None
            measured = "of the largest batch so far" if grown else "measured in the first training steps"
            rank_zero_info(
                f"tiered: the activations {measured} do not fit beside the parameters' current share of "
                f"gpu_memory={format_bytes(budgets.gpu)}: the parameters are placed again in {format_bytes(parameter_bytes)} of it, "
                f"the rest is the activations'."
            )
            assert activations.plan is not None
            self._replace_engine(recipe, gpu_bytes=parameter_bytes, block_policies=activations.plan.layout)  # the layout it was shared with
            activations.choose_layout_beside(costs)
        activations.apply_layout()
        assert activations.plan is not None
        if self.planner is not None and self.planner.profiling_placement and self.engine is not None:
            # no search replaced the profiling placement: the parameters take what the layout leaves
            assert self.context.budgets is not None
            self._replace_engine(recipe, gpu_bytes=self.context.budgets.gpu - activations.plan.peak_bytes, may_fit=True)
        if activations.plan is not activations.searched:  # the search priced its layout with the parameters' traffic
            self.prediction.planned(activations.plan.seconds, "activation layout")

    # -- plans --------------------------------------------------------------------------------------

    def dump_plan(self, path: Union[str, Path]) -> Path:
        """Write what this run decided (every unit's home, every block's activation policy) as a
        plan file that ``plan_file=`` runs again without planning. Call it after setup."""
        module = self.lightning.lightning_module
        if self.budgets is None or module is None:
            raise RuntimeError("dump_plan needs a strategy that has been set up; call it from a callback (on_train_start or later).")
        model = self.planner.model if self.planner is not None else None
        if model is None:  # nothing was placed (policy 'none'): every unit in the GPU tier
            units, _ = build_units(module)
            names, nbytes, homes = [u.name for u in units], [u.nbytes for u in units], [GPU] * len(units)
        else:
            names, nbytes = model.names, [u.nbytes for u in model.sizes]
            homes = [Tier(self.engine.placement.home[u.index]) if self.engine is not None else GPU for u in model.sizes]
        prediction = self.predicted_step()
        plan = PlanFile(
            units=tuple(PlannedUnit(n, b, h, *self._explain_unit(i, h)) for i, (n, b, h) in enumerate(zip(names, nbytes, homes))),
            activations=tuple(self.activations.policies) if self.activations.blocks else None,
            budgets={"gpu": self.budgets.gpu, "host": self.budgets.host, "nvme": self.budgets.nvme},
            prediction=None if prediction is None else prediction_record(prediction),
        )
        return save_plan(plan, path)

    def _explain_unit(self, index: int, home: str) -> tuple[str, Optional[str], Optional[str]]:
        """A unit's compute mode, where its gradient is produced and where its optimizer states live."""
        engine = self.engine
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

    def predicted_step(self, timing: Optional[StepProfile] = None) -> Optional[StepPrediction]:
        """The step model's prediction (planning/cost_model.py) for the placement in use, from the
        compute times of ``timing`` (default: the engine's last timed training step); None before
        a step has been timed or without an engine (nothing offloaded)."""
        engine = self.engine
        timing = timing if timing is not None else engine.timer.last_timing if engine is not None else None
        if engine is None or timing is None or self.planner is None or self.planner.model is None:
            return None
        model = self.planner.model
        sizes = {u.index: u for u in model.sizes}
        owns = model.sharding.owns if model.sharding is not None else None
        costs = costs_from_timing(
            timing, [bool(s.unit.trainable) for s in engine.states], {i: u.reduced_bytes for i, u in sizes.items()}, owns, model.tensors,
        )
        state_factor = self.planner.model.state_factor
        order = list(dict.fromkeys(timing.order)) + [i for i in range(len(engine.states)) if i not in timing.order]
        units = [
            replace(
                costs[i], home=engine.states[i].home, direct_gradient=i in engine.gradients.direct,
                state_bytes=int(sizes[i].trainable_bytes * state_factor) if engine.states[i].home == NVME and i in sizes else 0,
            )
            for i in order
        ]
        machine = self.ranks.machine(machine_from_spec(self.hardware, nvme=self.options.nvme_path is not None))
        return simulate_step([*units, outside_units(timing)], engine.placement.device_slots, machine, engine.placement.host_copies)

    def _direct_gradients(self, sizes: list[UnitSize], placement: Placement, emulated: bool) -> frozenset[int]:
        """Offloaded units whose gradients are written straight into host memory (GO-MemFerry)."""
        if not emulated:
            return frozenset()  # the CUDA path (GradientPath.attach_direct through views of the homes) has not run on a GPU yet
        reserve = self.policy.gradient_reserve or 0.0
        offloaded = [u for u in sizes if placement.home[u.index] != GPU and u.trainable_bytes]
        bandwidth = machine_from_spec(self.hardware, nvme=False).d2h
        kept = gradient_offload_plan(
            [u.trainable_bytes for u in offloaded], [u.trainable_bytes / bandwidth for u in offloaded], [0.0] * len(offloaded), reserve
        )
        return frozenset(u.index for k, u in enumerate(offloaded) if k not in kept)

    # -- the training step --------------------------------------------------------------------------

    def _plan_between_steps(self, recipe: Rules) -> None:
        """Between two optimizer steps' worth of batches no gradient is waiting at home, so the
        parameters may be placed again: the placement search, the activation layout, and a new
        placement when a finetuning callback unfroze parameters."""
        planner, stepped = self.planner, self._optimizer_stepped
        assert planner is not None
        self._optimizer_stepped = False  # a second call before the next step decides nothing
        self._steps_done += stepped  # batches whose optimizers stepped, however many optimizers
        if stepped:
            self._keep_timing()
        warm = stepped and self._steps_done >= WARM_UP_STEPS + TIMED_STEPS
        self._note_blocks_the_model_recomputes()
        if planner.searching and planner.phase is PlanPhase.INITIAL and warm and self.engine is not None:
            self._search_placement(recipe)
        if self.activations.profiled and warm:
            self._plan_activations(recipe)
        grown = self.activations.take_grown_costs()
        if grown is not None:  # a batch outgrew every layout beside the parameters as placed
            self._plan_activations(recipe, *grown)
        engine = self.engine
        # without an engine gradients wait in plain tensors until the step: placed only after it
        if self._trainable_grew() and (stepped or (engine is not None and not self._profiled)):
            rank_zero_info("tiered: parameters became trainable; placing the model again with their gradients and optimizer states")
            gpu_bytes = planner.gpu_given if engine is not None else self.budgets.gpu if self.budgets is not None else None
            assert gpu_bytes is not None  # the engine's placement, or the budget the first placement had
            self._replace_engine(recipe, gpu_bytes=gpu_bytes, may_fit=engine is None)
        engine = self.engine
        if stepped and engine is not None and {id(o) for o in self.lightning.optimizers} != set(engine.updater.optimizers):
            # a callback gave the trainer other optimizers (``trainer.optimizers = [...]``): their
            # states may take another size, and the old ones' units must not step again
            rank_zero_info("tiered: the trainer's optimizers were replaced; placing the model again with the new ones' states")
            assert planner.gpu_given is not None  # the engine's placement
            self._replace_engine(recipe, gpu_bytes=planner.gpu_given)
        if warm and self.prediction.predicted_seconds is None:
            self._predict_fixed_placement()

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
        planner, engine = self.planner, self.engine
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
        planner.model = replace(model, recomputed_by_model=groups)
        rank_zero_info(f"tiered: the model recomputes {len(groups)} of its layers in backward itself (its own activation checkpointing): "
                       f"plans keep each one's units together")

    def _keep_timing(self) -> None:
        """After each step before planning: the blocks are timed again (the warm steps' times,
        not the first's, the least of them kept), and each warm step's unit times kept."""
        done, engine = self._steps_done, self.engine
        if WARM_UP_STEPS <= done < WARM_UP_STEPS + TIMED_STEPS:
            self.activations.measure_blocks_again(keep_fastest=done > WARM_UP_STEPS)
        if WARM_UP_STEPS < done <= WARM_UP_STEPS + TIMED_STEPS and engine is not None and engine.timer.last_timing is not None:
            self._timed.append(engine.timer.last_timing)

    def _predict_fixed_placement(self) -> None:
        """A placement nothing searched is predicted once, by the step model on the first step's
        compute times, so that its error is reported as a search's is."""
        predicted = self.predicted_step() if self.engine is not None else None
        if predicted is not None:
            self.prediction.planned(predicted.seconds, "step model")

    def training_step(self, run: Callable[[], Any], recipe: Optional[Rules] = None, batch: Any = None) -> Any:
        """A training step's forward (``run``) of ``batch``, between the planner's decisions and the
        engine's step protocol; ``recipe``: the rules of a caller without a Trainer (Fabric)."""
        rules: Rules = recipe if recipe is not None else self.recipe(self.context.module.trainer)
        self.take_back_exposed()  # before the engine may be replaced
        self._plan_between_steps(rules)
        self.activations.note_batch(batch)  # after the plan: a batch the layout is planned with is a profiled step's
        self.prediction.step_begins()
        self.activations.begin_block_forward()
        try:
            with self._out_of_memory_explained():
                return self._run_training_step(run, rules, manual=recipe is None and not self.context.module.automatic_optimization)
        finally:
            self.activations.end_training_step()

    def _out_of_memory_explained(self) -> contextlib.AbstractContextManager:
        return out_of_memory_explained(self._planned_use, self.lightning.root_device)

    def _planned_use(self) -> Optional[PlannedUse]:
        """The GPU tier as the plan holds it now (None before the budgets are granted)."""
        if self.budgets is None:
            return None
        plan = self.activations.plan
        return PlannedUse(self.budgets.gpu, self.activations.gpu_parameter_bytes(), plan.peak_bytes if plan is not None else None, self.activations.beside)

    def _run_training_step(self, run: Callable[[], Any], rules: Rules, manual: bool) -> Any:
        engine = self.engine
        if engine is None:
            with _torch_func_explained(), self.activations.counting_saved():
                return run()
        speculate = rules.updates_may_run_ahead_of_clipping()
        if speculate:
            assert self.budgets is not None  # what the plan and the activations' swaps leave of the host budget
            engine.speculation.room = self.budgets.host - engine.placement.host_bytes - self.activations.host_swap_bytes()
        engine.begin_step(
            profile=not self._profiled, update_in_backward=rules.updates_can_start_in_backward(), clip_value=rules.clip_value(),
            reduce=self.ranks.gradient_reduction(rules.accumulating(), not rules.reductions_may_go_to_owners()), norms_wanted=self._clips_norm_first(rules),
            speculate=speculate,
        )
        self._profiled = True
        try:
            with _torch_func_explained(), engine.saved_tensor_hooks():
                result = run()
        finally:
            self.take_back_exposed()  # manual optimization's backward without a step leaves them to the next
        if manual:
            engine.end_manual_training_step()
        return result

    def _clips_norm_first(self, recipe: Rules) -> bool:
        """This step's clipping by norm is the engine's (gradients may wait on NVMe, or units were
        updated before it, speculatively)."""
        engine = self.engine
        if engine is None or not recipe.clips_by_norm():
            return False
        # where updates may run ahead of clipping, every step's norm decides whether the next does;
        # under data parallelism the reductions went to the owners, who alone hold the gradients
        sharded = engine.exchange is not None and recipe.reductions_may_go_to_owners()
        return engine.placement.gradients_spilled or recipe.updates_may_run_ahead_of_clipping() or sharded

    def eval_step(self, run: Callable[[], Any]) -> Any:
        engine = self.engine
        if engine is not None:
            # Evaluation runs the forward part of the profiled order: prefetch along it too.
            engine.begin_step(profile=False, train=False)
        try:
            return run()
        finally:
            if engine is not None:
                engine.end_eval_step()

    def pre_backward(self, hooks_after: bool = False) -> None:
        """``hooks_after``: code runs right after this backward (``on_after_backward``, from the
        precision plugin's ``post_backward``) and sees the gradients there."""
        self.activations.note_forward_saved()
        self.activations.refuse_unfitting()
        self.take_back_exposed()  # autograd adds to what the user left there
        if self.engine is not None:
            self.engine.attach_direct_gradients()
            self.engine.begin_backward()
            if hooks_after:
                self._expose_gradients_to_hooks_after(self.engine, self.lightning.precision_plugin)

    @staticmethod
    def _expose_gradients_to_hooks_after(engine: TieredEngine, plugin: Any) -> None:
        """Lightning's ``Strategy.backward`` runs the hooks in the plugin's ``post_backward``, after
        autograd and before the strategy's own: for that one call, offloaded gradients sit on their
        parameters' ``.grad`` (``GradientExposure.during``)."""
        original = type(plugin).post_backward.__get__(plugin)

        def post_backward(tensor: torch.Tensor, module: Any) -> Any:
            plugin.__dict__.pop("post_backward", None)
            with engine.exposure.during():
                return original(tensor, module)

        plugin.post_backward = post_backward

    def post_backward(self, expose: bool = False) -> None:
        """``expose``: the user's own code runs between this backward and the step (manual
        optimization, a Fabric loop) and may read, clip or replace gradients there, as after
        plain backward: until the next backward, step or training step, offloaded gradients are
        on their parameters' ``.grad`` (``GradientExposure.expose``)."""
        self.lightning.precision_plugin.__dict__.pop("post_backward", None)  # a backward that failed left it
        engine = self.engine
        if engine is not None:
            engine.end_backward()
            if expose:
                engine.exposure.expose()  # reduced first under data parallelism, as DDP's backward leaves them

    def take_back_exposed(self) -> None:
        """What the user's code did to exposed gradients reaches the engine's (see :meth:`post_backward`)."""
        if self.engine is not None:
            self.engine.exposure.take_back()

    def before_users_step(self) -> None:
        """Right before an optimizer step or clipping the user's code asked for (manual
        optimization, Fabric): exposed gradients taken back, and gradients the code put on
        ``.grad`` without a backward taken in."""
        self.take_back_exposed()
        if self.engine is not None:
            self.engine.gradient_hooks.adopt_set_by_hand()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any, plain: Callable[..., Any], **kwargs: Any) -> Any:
        module = model or self.context.module
        if self.context.module.automatic_optimization:
            # The closure is the training step: a plan made inside it would leave this step to
            # the optimizer chosen before it (a first engine's units stepped by the plain one).
            self._plan_between_steps(self.recipe(self.context.module.trainer))
        if self.engine is None:
            with self._out_of_memory_explained():
                result = plain(optimizer, closure, model, **kwargs)
        else:
            with self._out_of_memory_explained():
                closure_result = closure()  # forward and backward
            if not self.context.module.automatic_optimization:
                self.before_users_step()
            engine, recipe = self.engine, self.recipe(module.trainer)
            assert engine is not None
            result = tiered_optimizer_step(engine, recipe, self._clips_norm_first(recipe), optimizer, closure_result, module, **kwargs)
        self._stepped()
        return result

    def _stepped(self) -> None:
        self._optimizer_stepped = True  # no gradient is pending until the next forward
        report = self.prediction.step_ends()
        if report is not None:  # a check of the step model, not a decision: for those who ask for it
            rank_zero_debug(report)

    def step_optimizer(self, optimizer: torch.optim.Optimizer, plain: Callable[[], Any], **kwargs: Any) -> Any:
        """``optimizer``'s step over every unit where it lives, for a loop that ran forward and
        backward itself (Fabric's): nothing runs between backward and the step here."""
        self.before_users_step()
        engine = self.engine
        if engine is None:
            result = plain()
        else:
            try:
                result = engine.step(optimizer, **kwargs)
            finally:
                engine.end_step(optimizer)
        self._stepped()
        return result

    # -- checkpoints: the true state from every tier -----------------------------------------------

    def lightning_module_state_dict(self, plain: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        engine = self.engine
        # the checkpoint being built is sharded: values on NVMe stay there until written
        self._stand_ins = (engine.stand_in_readers() if engine is not None else {}) if self._writes_sharded() else None
        if engine is None:
            return plain()
        module = self.context.module
        if self._stand_ins is not None:
            # plain detached aliases of the placeholders: detaching an offloaded parameter the
            # usual way would lend (read) its unit, gathering the model after all
            with torch._C.DisableTorchFunctionSubclass():
                state = module.state_dict()
            return type(state)((k, compact(v)) for k, v in state.items())
        # Views of where each value lives, as plain training returns views of its parameters: no
        # second copy of the model, except for units on NVMe, which are read into fresh buffers.
        # Each over only its own bytes, so that a checkpoint does not carry whole slabs.
        with engine.materialized():
            state = module.state_dict()
        return type(state)((k, compact(v)) for k, v in state.items())

    def optimizer_state(self, optimizer: torch.optim.Optimizer, plain: Callable[[torch.optim.Optimizer], dict[str, Any]]) -> dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if self._stand_ins is not None and self.engine is not None and id(inner) in self.engine.updater.optimizers:
            return self.engine.updater.optimizers[id(inner)].state_dict(contextlib.nullcontext)  # NVMe units' states as stand-ins
        return plain(optimizer)

    def _writes_sharded(self) -> bool:
        """The next checkpoint is a directory written tensor by tensor (docs/guide.md, "Checkpoints")."""
        if self.state_dict_type is StateDictType.AUTO:
            return self.engine is not None and _nvme_state_bytes(self.engine) > _half_host_available()
        return self.state_dict_type is StateDictType.SHARDED

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any], plain: Callable[..., None]) -> None:
        readers, self._stand_ins = self._stand_ins, None
        if readers is None:
            return plain(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("a sharded checkpoint takes no storage_options: it is written by torch.distributed.checkpoint, not by the CheckpointIO plugin.")
        if self.lightning.is_global_zero:
            write_sharded(checkpoint, filepath, readers)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: Optional[bool], plain: Callable[..., dict[str, Any]], read: Callable[..., Any]
    ) -> dict[str, Any]:
        """``read``: the checkpoint IO's reader of the sharded checkpoint's metadata file."""
        if not is_sharded_checkpoint(checkpoint_path):
            return plain(checkpoint_path, weights_only=weights_only)
        # the model's and optimizers' tensors are read when loaded into their places, the rest now
        source = ShardedCheckpoint(checkpoint_path, weights_only)
        checkpoint = source.meta(lambda path: read(path, weights_only=weights_only))
        checkpoint["state_dict"] = source.model_state()
        if source.optimizer_count():
            checkpoint["optimizer_states"] = [source.optimizer_state(i) for i in range(source.optimizer_count())]
        return checkpoint

    @contextlib.contextmanager
    def gathered_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Every parameter holds its true value in a real tensor for the duration, as DeepSpeed's
        ``GatheredParameters`` and FSDP's ``summon_full_params`` give them: for callbacks that
        read weights between steps (a weight-norm logger, an EMA), where units at home on NVMe
        otherwise show placeholders. With ``writeback=True`` what the block writes into the
        parameters is kept (an averaging callback copying weights in, a manual load); the
        optimizer's fp32 masters then start from the written values."""
        if self.engine is None:
            yield
            return
        with self.engine.materialized(writeback=writeback):
            yield

    def load_model_state_dict(self, checkpoint: Any, strict: bool, plain: Callable[..., None]) -> None:
        state = checkpoint["state_dict"]
        engine = self.engine
        with engine.materialized(writeback=True) if engine is not None else contextlib.nullcontext():
            if not isinstance(state, LazyState):
                return plain(checkpoint, strict=strict)
            # parameters built without memory are read when placed, the others in place now
            state.checkpoint.load_model(
                self.context.module, strict, defer=lambda p: engine is None and p in self.deferred, set_source=self.deferred.set_source
            )

    def load_optimizer_state_dict(self, checkpoint: Any, plain: Callable[[Any], None]) -> None:
        """The optimizers' states from a checkpoint. With an engine each unit's go where the unit
        lives (NVMe units' to their files); Lightning's own load would then move every state to
        the GPU, reading NVMe units' into memory on the way."""
        if self.engine is None:
            return plain(checkpoint)
        for optimizer, state in zip(self.lightning.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
        return None

    def teardown(self, plain: Callable[[], None]) -> None:
        """``plain``: the base strategy's teardown, run after the engine's close with the states
        left on NVMe out of sight (it moves every optimizer state to the CPU, which would read
        them all back)."""
        self.take_back_exposed()  # never left on ``.grad`` over memory the engine frees
        self.lightning.precision_plugin.__dict__.pop("clip_gradients", None)
        self.activations.close()
        try:
            left = self._close_engine()
            if left is not None:
                self._settle_after_training(left, failing=sys.exc_info()[0] is not None)
        finally:
            _remove_if_empty(self._created_directories)
        release_freed_host_memory()  # what training freed leaves the process with it
        with contextlib.ExitStack() as unread:
            for optimizer in self.lightning.optimizers:
                if isinstance(optimizer.state, StatesReadOnUse):
                    unread.enter_context(optimizer.state.unread())
            plain()

    def _close_engine(self, leave: Callable[[TieredEngine], bool] = lambda engine: True) -> Optional[_LeftOnNvme]:
        """Parameters back to plain tensors with their true values, every tier freed, but the
        units at home on NVMe where ``leave(engine)``: those stay there, read when used; what
        stays, if any."""
        engine = self.context.engine
        if engine is None:
            return None
        self.context.engine = None
        self._final_engine_metrics = engine.metrics()  # what metrics() reports once the run is over
        units = _units_on_nvme(engine)
        left = _LeftOnNvme(engine.store, units, self._room_after_training(engine)) if engine.store is not None and units and leave(engine) else None
        try:
            # while training's own failure propagates (teardown inside Lightning's handler),
            # that failure is the one to see; otherwise a failure to read back is raised
            engine.close(materialize=True, raise_errors=sys.exc_info()[0] is None, leave_on_nvme=self.deferred.defer_read if left else None)
        finally:
            engine.device.close()
            self._share_optimizer_attributes()
        return left

    def _settle_after_training(self, left: _LeftOnNvme, failing: bool = False) -> None:
        """Once the tiers' memory is gone, the units left on NVMe that fit come back (``_bring_back``);
        the others stay there, their store open while anything reads from it, and a line says so.
        ``failing``: training's own failure propagates; where a unit cannot be read back then (a
        write the failure cut short), that failure is the one to see and the files go."""
        gc.collect()  # the engine's cycles, and the tiers' memory with them, before anything is read back
        try:
            stay = self._bring_back(left.units, left.room)
        except Exception:
            left.store.close()
            if failing:
                return
            raise
        if not stay:
            left.store.close()
            return
        weakref.finalize(self, left.store.close)  # the parameters and states left there read from it
        nbytes = sum(size for _, size in stay)
        rank_zero_info(
            f"tiered: after training, {len(stay)} of the {len(left.units)} units at home on NVMe stay there ({format_bytes(nbytes)} of "
            f"parameters and optimizer states beyond the {format_bytes(left.room)} that host_memory and the host memory available leave "
            f"after the units in memory): each parameter, and its optimizer states, is read from its file when first used "
            f"(optimizer.state_dict(), a checkpoint, more training) and held from then on."
        )

    def _room_after_training(self, engine: TieredEngine) -> int:
        """Host memory that units at home on NVMe may take after training: the host budget (and
        the emulated GPU tier's, host memory too) less what the units in those tiers bring back,
        within half of what the machine has available."""
        budgets = self.budgets
        if budgets is None:
            return 0
        emulated = self.lightning.root_device.type != "cuda"
        homes = (HOST, GPU) if emulated else (HOST,)
        states = engine.updater.state_bytes if engine.updater is not None else {}
        held = sum(int(s.unit.nbytes) + states.get(s.unit.index, 0) for s in engine.states if s.home in homes)
        return max(min(budgets.host + (budgets.gpu if emulated else 0) - held, _half_host_available()), 0)

    def _bring_back(self, on_nvme: list[tuple[list[torch.nn.Parameter], int]], room: int) -> list[tuple[list[torch.nn.Parameter], int]]:
        """Units left on NVMe read back into memory, parameters and optimizer states, in order,
        as long as they fit in ``room``; the ones that stay."""
        stay: list[tuple[list[torch.nn.Parameter], int]] = []
        for params, size in on_nvme:
            if size > room or stay:  # in order: what comes back is a prefix, what stays the rest
                stay.append((params, size))
                continue
            room -= size
            for p in params:
                if p in self.deferred:
                    self.deferred.materialize(p)
                for optimizer in self.lightning.optimizers:
                    if p in optimizer.state:
                        optimizer.state[p]  # noqa: B018 (read from its file, then held)
        return stay

    def resolve_budgets(self) -> TierBudgets:
        """Grant each tier its budget, refusing up front any that asks for more than is free. On a
        machine without a GPU the emulated GPU tier lives in host memory: the two are checked
        together against the same memory (``_share_emulated``)."""
        options, root = self.options, self.lightning.root_device
        if options.nvme_path is not None:
            self._created_directories = _check_writable_directory(options.nvme_path) or self._created_directories
        requested = {"gpu_memory": options.gpu_memory, "host_memory": options.host_memory, "nvme_memory": options.nvme_memory}
        free = {
            "gpu_memory": gpu_free(root),
            "host_memory": host_available(),
            "nvme_memory": disk_free(str(options.nvme_path)) if options.nvme_path else 0,
        }
        where = {
            "gpu_memory": f"{root} ({cuda_gpu_margin(root).describe()})" if root.type == "cuda" else "the emulated GPU tier (host memory)",
            "host_memory": "host memory",
            "nvme_memory": str(options.nvme_path),
        }
        granted = {}
        for name, budget in requested.items():
            granted[name] = budget.resolve(free[name])
            if name == "nvme_memory" and budget.bytes is None:
                # measured once here for every NVMe store of the run; the reserve covers what the
                # file system spends beyond the bytes written (blocks, metadata, lock files)
                granted[name] = max(budget.resolve(free[name] - nvme_reserve(free[name])), 0)
            if budget.bytes is not None and budget.bytes > free[name]:
                raise MemoryBudgetError(
                    f"{name}={format_bytes(budget.bytes)} asks for more than is free in {where[name]}: "
                    f"{format_bytes(free[name])} free. Lower {name}, give a fraction such as 0.9, "
                    f"or leave it None to use all that is free."
                )
        if root.type != "cuda":
            granted["gpu_memory"], granted["host_memory"] = _share_emulated(options.gpu_memory, options.host_memory, free["host_memory"])
        budgets = TierBudgets(gpu=granted["gpu_memory"], host=granted["host_memory"], nvme=granted["nvme_memory"])
        return self.ranks.share_budgets(budgets, (options.gpu_memory, options.host_memory, options.nvme_memory))

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Numbers the strategy reports (docs/reference.md, "Metrics"), read by
        :class:`~offload_strategy.OffloadMonitor`; after ``fit`` the engine's figures are those
        of the run's last step. ``reset=False`` reads the per-interval figures without starting
        a new interval (the progress bar does)."""
        out: dict[str, float] = {}
        if self.budgets is not None:
            out["budget/gpu_bytes"] = float(self.budgets.gpu)
            out["budget/host_bytes"] = float(self.budgets.host)
            out["budget/nvme_bytes"] = float(self.budgets.nvme)
        root = self.lightning.root_device
        if root.type == "cuda":
            out["memory/gpu_peak_bytes"] = float(torch.cuda.max_memory_allocated(root))
        out["memory/process_peak_rss_bytes"] = float(process_peak_rss())
        engine_metrics = self.engine.metrics(reset) if self.engine is not None else self._final_engine_metrics
        if engine_metrics is not None:  # after fit: the run's last figures
            out.update(engine_metrics)
            out["memory/nvme_bytes"] = out["tier/nvme_bytes"]
        else:
            out["memory/nvme_bytes"] = 0.0
        out.update(self.activations.metrics())
        out.update(self.prediction.metrics())
        out.update(self.ranks.link_metrics())
        return out


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


def _core_with_options(cls: type[TieredCore], options: TieredOptions, lightning: LightningState, ranks: Ranks, state_dict_type: Any) -> TieredCore:
    core = cls(options, lightning, ranks)
    core.state_dict_type = state_dict_type
    return core


def _work(unit: Any) -> tuple:
    """What makes two units do the same work in a step (``ModelUnits.work``)."""
    return tuple((tuple(p.shape), str(p.dtype), p.requires_grad) for p in unit.params)


def _nvme_state_bytes(engine: TieredEngine) -> int:
    """Parameters and optimizer states at home on NVMe."""
    on_nvme = sum(s.unit.nbytes for s in engine.states if s.home == NVME)
    return on_nvme + (sum(engine.nvme_states.sizes.values()) if engine.nvme_states is not None else 0)


def _share_emulated(gpu: Budget, host: Budget, available: int) -> tuple[int, int]:
    """The emulated GPU tier's budget and host memory's, from the same ``available`` host memory:
    two bounded budgets (bytes or fractions) must fit in it together; one left None takes what
    the other leaves; both None, each may use all of it (one pool: the planner fills the GPU tier
    first and host memory holds what does not fit there)."""
    gpu_bytes, host_bytes = gpu.resolve(available), host.resolve(available)
    bounded_gpu, bounded_host = gpu.bytes is not None or gpu.fraction is not None, host.bytes is not None or host.fraction is not None
    if bounded_gpu and bounded_host and gpu_bytes + host_bytes > available:
        raise MemoryBudgetError(
            f"gpu_memory={gpu} ({format_bytes(gpu_bytes)}) and host_memory={host} ({format_bytes(host_bytes)}) ask for "
            f"{format_bytes(gpu_bytes + host_bytes)} together, but there is no GPU: the GPU tier is emulated in the same host memory, "
            f"of which {format_bytes(available)} is available. Lower them so that together they are at most {format_bytes(available)} "
            f"(host_memory={format_bytes(max(available - gpu_bytes, 0))} beside this gpu_memory), or leave host_memory None to take "
            f"what gpu_memory leaves."
        )
    if bounded_gpu and not bounded_host:
        host_bytes = max(available - gpu_bytes, 0)
    elif bounded_host and not bounded_gpu:
        gpu_bytes = max(available - host_bytes, 0)
    return gpu_bytes, host_bytes


@dataclass(frozen=True)
class _LeftOnNvme:
    """Units an engine's close left on NVMe, the store they read from, and the host memory the
    budget leaves them after the units in memory (``TieredCore._room_after_training``)."""

    store: NvmeStore
    units: list[tuple[list[torch.nn.Parameter], int]]
    room: int


def _units_on_nvme(engine: TieredEngine) -> list[tuple[list[torch.nn.Parameter], int]]:
    """Each unit at home on NVMe: its parameters, and their bytes with the optimizer states' in its file."""
    sizes = engine.nvme_states.sizes if engine.nvme_states is not None else {}
    return [(list(s.unit.params), s.unit.nbytes + sizes.get(s.unit.index, 0)) for s in engine.states if s.home == NVME]


def _half_host_available() -> int:
    """What NVMe-resident state may take in host memory before it stays on NVMe after fit and
    checkpoints of it are sharded (``state_dict_type="auto"``)."""
    return host_available() // 2


def _refuse_lazy_parameters(model: torch.nn.Module) -> None:
    lazy = [name for name, p in model.named_parameters() if isinstance(p, torch.nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"{len(lazy)} parameters are not materialized yet ({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}: lazily "
            f"initialized modules such as nn.LazyLinear), and strategy='tiered' places parameters by their sizes before the first "
            f"step. Run one forward on an example batch before fit (in __init__ or configure_model), or give the modules their "
            f"input sizes (nn.Linear(in_features, out_features))."
        )


def _refuse_compiled_modules(model: torch.nn.Module) -> None:
    """torch.compile guards on the parameters' storages, which offloading swaps at every fetch:
    a compiled module would recompile at each one or fail inside the compiler."""
    compiled = [
        name or "the LightningModule"
        for name, module in model.named_modules()
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None
    ]
    if compiled or getattr(model, "_compiler_ctx", None):
        where = ", ".join(compiled[:3]) if compiled else "the LightningModule"
        raise ValueError(
            f"torch.compile was applied to {where}, whose parameters are offloaded: compiled code guards on the parameters' "
            f"storages, which the strategy swaps between tiers at every fetch, so it would recompile at each one or fail. "
            f"Compile only code that owns no parameters (attention or activation functions), raise gpu_memory so that nothing "
            f"is offloaded, or leave the model uncompiled."
        )


def _refuse_sparse_gradients(model: torch.nn.Module, units: list[Any], placement: Placement) -> None:
    """An embedding with ``sparse=True`` gives sparse gradients, which an offloaded unit's dense
    gradient home cannot hold; its optimizer (``SparseAdam``) would then fail at the first step."""
    offloaded = {id(p) for u in units if placement.home[u.index] != GPU for p in u.params}
    sparse = [name for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
              and module.weight.requires_grad and id(module.weight) in offloaded]
    if sparse:
        raise ValueError(
            f"{sparse[0]!r} is an embedding with sparse=True whose weight is offloaded ({len(sparse)} such module(s)): its gradients are "
            f"sparse, and an offloaded unit's gradients are kept in a dense buffer at its home, so SparseAdam would refuse them. Set "
            f"sparse=False (with a dense optimizer such as Adam), or raise gpu_memory so that the embedding stays in the GPU tier."
        )


def _refuse_weight_averaging_on_nvme(trainer: "pl.Trainer", engine: Optional[TieredEngine]) -> None:
    """Lightning's weight-averaging callbacks read and write every parameter between steps, where
    units at home on NVMe hold placeholders."""
    averaging = [type(c).__name__ for c in getattr(trainer, "callbacks", []) if isinstance(c, StochasticWeightAveraging)]
    if averaging and engine is not None and any(s.home == NVME for s in engine.states):
        raise ValueError(
            f"{averaging[0]} reads and writes every parameter between steps, but {sum(s.home == NVME for s in engine.states)} "
            f"units live on NVMe, where between steps their parameters are placeholders. Give host_memory enough room for "
            f"every unit (or no nvme_path), or average the weights in your own callback inside "
            f"`with trainer.strategy.gathered_parameters(writeback=True):`."
        )


def _check_writable_directory(path: Path) -> list[Path]:
    """Create ``path`` if needed (0700, and only where no other user could redirect what is made
    there: ``make_private_directory``) and make sure files can be written there, before training
    starts; the directories it created, deepest first (removed again at teardown if left empty)."""
    created = []
    missing = path
    while not missing.exists() and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    try:
        make_private_directory(path)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".offload-write-test-"):
            pass
    except OSError as error:
        raise ValueError(
            f"nvme_path={str(path)!r} cannot hold the NVMe tier's files: {error.strerror or error}. "
            f"Give a directory this process can create files in, or nvme_path=None for no NVMe tier."
        ) from None
    return created


def _remove_if_empty(directories: list[Path]) -> None:
    """Directories the strategy created, deepest first: each goes if nothing else was put there."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


class Delegated:
    """An attribute of a tiered strategy that lives on its core: ``strategy.engine`` is
    ``strategy.tiered.engine``, ``strategy.activation_plan`` is ``strategy.tiered.activations.plan``."""

    def __init__(self, path: str) -> None:
        self.path = path.split(".")
        owner: Any = TieredCore
        for part in self.path:  # the core's documentation, where it has one
            owner = getattr(owner, part, None)
        self.__doc__ = getattr(owner, "__doc__", None) if callable(owner) or isinstance(owner, property) else None

    def _holder(self, strategy: Any) -> Any:
        holder = strategy.tiered
        for part in self.path[:-1]:
            holder = getattr(holder, part)
        return holder

    def __get__(self, strategy: Any, owner: Optional[type] = None) -> Any:
        if strategy is None:
            return self
        return getattr(self._holder(strategy), self.path[-1])

    def __set__(self, strategy: Any, value: Any) -> None:
        setattr(self._holder(strategy), self.path[-1], value)


# What a tiered strategy exposes of its core: its name on the strategy, its path on the core.
PUBLIC = {
    "policy": "policy", "hardware": "hardware", "budgets": "budgets", "planner": "planner", "engine": "engine",
    "deferred": "deferred", "state_dict_type": "state_dict_type", "removed_stale_nvme": "removed_stale_nvme",
    "gpu_memory": "options.gpu_memory", "host_memory": "options.host_memory", "nvme_memory": "options.nvme_memory",
    "nvme_path": "options.nvme_path", "plan_file": "options.plan_file", "placement_search": "placement_search",
    "activation_plan": "activations.plan", "activation_costs": "activations.costs", "activation_links": "activations.plan_links",
    "metrics": "metrics", "dump_plan": "dump_plan", "predicted_step": "predicted_step", "gathered_parameters": "gathered_parameters",
    "resolve_budgets": "resolve_budgets",
}


def exposes_core(cls: type) -> type:
    """Class decorator: the strategy's public tiered attributes, each read from ``self.tiered``."""
    for name, path in PUBLIC.items():
        setattr(cls, name, Delegated(path))
    return cls


@contextlib.contextmanager
def _torch_func_explained() -> Iterator[None]:
    """``torch.func``'s transforms that differentiate refuse to start under saved-tensor hooks,
    and a training step's forward runs under the strategy's: say so, and what works instead."""
    try:
        yield
    except RuntimeError as error:
        if "torch.func" not in str(error) or "saved tensor hooks" not in str(error):
            raise
        raise RuntimeError(
            "torch.func.grad (or vjp, jacrev, hessian) was called inside a training step, and strategy='tiered' runs the "
            "step's forward under saved-tensor hooks (they fetch offloaded parameters back for backward and count the "
            "activations the blocks keep), which torch.func refuses. Inside the training step use torch.autograd.grad "
            "(with torch.func.functional_call for other weights, as MAML does; per-sample gradients one sample at a time); "
            "torch.func's transforms work outside the training step (validation, callbacks)."
        ) from error
