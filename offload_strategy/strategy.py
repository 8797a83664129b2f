"""``TieredStrategy``: the Lightning glue. Validates what the user asked for, resolves the memory
budgets of each tier against what is free, and exposes the metrics the engine reports.

The strategy holds no placement logic: the planner decides, the runtime engine carries it out.
Until the engine is attached every tensor stays on the root device, which trains exactly as
Lightning's single-device strategy does.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from .checkpoint_io import AtomicCheckpointIO
from .config import BlockPolicy, Budget, BudgetLike, HardwareSpec, PolicyConfig, StateDictType, format_bytes
from .deferred import DeferredParameters
from .hardware import disk_free, gpu_free, host_available, known_hardware, process_peak_rss, resolve_hardware
from .hardware.device import Device, make_device
from .memory.nvme import NvmeStore
from .planning.activations import ActivationPlan, BlockCost, Links
from .planning.auto import AutoPlan
from .planning.cost_model import StepPrediction, costs_from_timing, machine_from_spec, outside_units, simulate_step
from .planning.memferry import gradient_offload_plan
from .planning.placement import GPU, NVME, Placement, PlacementError, UnitSize
from .planning.planner import ModelUnits, Planner, PlanPhase, TierBudgets
from .planning.plan_file import PlanFile, PlannedUnit, check_plan, load_plan, prediction_record, save_plan
from .profiling import StepProfile
from .runtime.activations import ActivationPolicies, find_blocks
from .runtime.data_parallel import DataParallel, Reduction
from .runtime.engine import TieredEngine
from .runtime.optimizer import compact
from .runtime.units import build_units, master_dtype, merge_into_chunks
from .sharded_checkpoint import LazyState, Readers, ShardedCheckpoint, is_sharded_checkpoint, write_sharded
from .strategy_activations import ActivationControl

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator

# Precision plugins whose semantics the tiered runtime reproduces: 32-true, 16/bf16-mixed and
# 16/bf16-true. Others (64-true, bitsandbytes, Transformer Engine, ...) change the module or
# the step in ways the runtime would silently undo.
_SUPPORTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def nvme_reserve(free: int) -> int:
    """Disk space an NVMe budget of "all that is free" (or a fraction of it) leaves unused."""
    # a file system spends a few blocks per file beyond its bytes: 1 MiB, or 0.1% of a large disk,
    # never more than an eighth of a small one
    return min(free // 8, max(1024**2, free // 1000))


# Optimizer state bytes per parameter byte, for budgeting before the first step creates them.
_STATE_FACTORS = {"SGD": 1.0, "Adagrad": 1.0, "RMSprop": 1.0, "Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adadelta": 2.0}


def master_dtype_size(p: torch.Tensor, fp32_masters: bool) -> int:
    """Bytes per element of a parameter's gradient, master and states."""
    return torch.empty((), dtype=master_dtype(p, fp32_masters)).element_size()


def optimizer_state_factor(optimizers: list[torch.optim.Optimizer]) -> float:
    """Bytes of optimizer state per trainable parameter byte (2 for Adam, unknown ones count 2)."""
    return max((_STATE_FACTORS.get(type(o).__name__, 2.0) for o in optimizers), default=0.0)


class MemoryBudgetError(ValueError):
    """A tier budget asks for more than the tier has free."""


class TieredMixin(ActivationControl):
    """The tiered logic every tiered strategy shares, mixed in before a Lightning strategy
    (single-device or DDP): budgets, planning, the engine's lifecycle, the training step, the
    optimizer step and checkpoints gathered from every tier."""

    def _init_tiered(
        self,
        policy: Union[str, PolicyConfig, dict[str, Any]],
        hardware: Union[str, HardwareSpec, dict[str, Any]],
        gpu_memory: BudgetLike,
        host_memory: BudgetLike,
        nvme_path: Optional[Union[str, Path]],
        nvme_memory: BudgetLike,
        plan_file: Optional[Union[str, Path]],
    ) -> None:
        self.policy = PolicyConfig.coerce(policy)
        # "auto" is probed at setup, not here: probing CUDA in the constructor would initialise it
        # in a process that may still fork workers.
        if isinstance(hardware, str) and hardware != "auto":
            hardware = known_hardware(hardware)
        elif not isinstance(hardware, str):
            hardware = resolve_hardware(hardware)
        self._hardware_request = hardware
        self.hardware: Optional[HardwareSpec] = hardware if isinstance(hardware, HardwareSpec) else None
        self.gpu_memory = Budget.parse(gpu_memory, "gpu_memory")
        self.host_memory = Budget.parse(host_memory, "host_memory")
        self.nvme_memory = Budget.parse(nvme_memory, "nvme_memory")
        self.nvme_path = _validate_nvme_path(nvme_path)
        if self.nvme_path is None and nvme_memory is not None:
            raise ValueError(f"nvme_memory={nvme_memory!r} was given without nvme_path: name a directory for the NVMe tier.")
        self.plan_file = _validate_plan_file(plan_file)
        self.budgets: Optional[TierBudgets] = None
        self.engine: Optional[TieredEngine] = None
        self.removed_stale_nvme: list[Path] = []  # swap directories of killed runs this run removed
        self._activations: Optional[ActivationPolicies] = None
        self._swap_store: Optional[NvmeStore] = None
        self.activation_plan: Optional[ActivationPlan] = None  # what activations="auto" chose
        self.activation_costs: list[BlockCost] = []  # ... from these block costs
        self.activation_links: Optional[Links] = None  # ... and these links
        self.planner: Optional[Planner] = None  # made at setup, once the budgets are known
        self._plan: Optional[PlanFile] = None
        self._saved_bytes = 0
        self._optimizer_stepped = False
        self._said_updates_wait = False  # the run has been told once that updates wait for backward's end
        self._swap_device: Optional[Device] = None
        self._profiled = False
        # parameters of models built under this strategy, recorded instead of held (deferred.py)
        self.deferred = DeferredParameters()
        self.state_dict_type = StateDictType.FULL  # the single-process strategy chooses (data-parallel: full)
        self._stand_ins: Optional[Readers] = None  # the sharded checkpoint being built: NVMe values, read when written

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None and type(plugin) not in _SUPPORTED_PRECISION:
            raise ValueError(
                f"strategy='tiered' does not support the precision plugin {type(plugin).__name__}; "
                f"use precision='32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
            )
        self._precision_plugin = plugin

    # -- lifecycle ----------------------------------------------------------------------------------

    def _places_parameters_itself(self) -> bool:
        """On a GPU, parameters are created in host memory and placed by the engine, so that a model
        larger than the GPU never has to fit there whole."""
        return self.policy.name != "none" and self.root_device.type == "cuda"

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """Models built here (``configure_model``, ``trainer.init_module()``) take no memory for
        their parameters: each is computed in its home once placed, to the bit what plain
        construction gives (deferred.py)."""
        building = self.deferred.recording() if self.policy.name != "none" else contextlib.nullcontext()
        if not self._places_parameters_itself():
            with building, super().tensor_init_context(empty_init):
                yield
            return
        with building, _EmptyInit(enabled=bool(empty_init)), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self._places_parameters_itself() and not len(self.deferred):
            return super().model_to_device()
        # buffers now; parameters once the engine has placed them (or computed where they run: on a
        # host root, the others are there already)
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(self.root_device)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if self.hardware is None:
            self.hardware = resolve_hardware(self._hardware_request)
        self.budgets = self.resolve_budgets()
        if self.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.root_device)
        if self.lightning_module is not None:
            self.deferred.adopt(self.lightning_module)
        super().setup(trainer)
        self._plan = load_plan(self.plan_file) if self.plan_file is not None else None
        activations = self.policy.activations
        if self._plan is not None and self._plan.activations is not None:
            blocks = len(find_blocks(self.lightning_module, self.policy.block_class))
            check_plan(self._plan, [u.name for u in self._plan.units], [u.nbytes for u in self._plan.units], blocks)  # blocks only, here
            activations = self._plan.activations
        self._activations = ActivationPolicies(self.lightning_module, activations, self.policy.block_class)
        self.planner = Planner(self.policy, self.budgets, self.nvme_path is not None, self._plan, self._refuse_a_full_disk)
        if self.policy.name != "none":
            _refuse_lazy_parameters(self.lightning_module)
            # every loop offloads: fit, and validate / test / predict on their own (forward only)
            self.engine = self._build_engine(trainer)
            _refuse_weight_averaging_on_nvme(trainer, self.engine)
        self.deferred.materialize_all(self.root_device)  # nothing placed them (it all fits): computed where they run
        if self.engine is None and self._places_parameters_itself():
            self.model.to(self.root_device)
        self._use_saved_tensor_hooks()
        if self._activations.swaps:
            self._attach_swap()

    def _replace_engine(self, trainer: "pl.Trainer", gpu_bytes: int) -> None:
        """Place the parameters again with ``gpu_bytes`` of the GPU tier, between two steps."""
        states = [optimizer.state_dict() for optimizer in self.optimizers]  # standard, exact: they move through these
        self._close_engine()
        self.engine = self._build_engine(trainer, gpu_bytes=gpu_bytes)
        if self.engine is None:
            raise RuntimeError(f"placing the parameters in {format_bytes(gpu_bytes)} of the GPU tier offloaded nothing")
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)
        self._use_saved_tensor_hooks()
        if self._activations is not None and self._activations.swap is not None:
            self._detach_swap()  # it copied through the old engine's device, now closed
            self._attach_swap()

    def _build_engine(self, trainer: "pl.Trainer", gpu_bytes: Optional[int] = None) -> Optional[TieredEngine]:
        """Place every unit within the budgets (``gpu_bytes``: the part of the GPU tier parameters
        may use, all of it by default); None when everything fits in the GPU tier."""
        assert self.budgets is not None and self.lightning_module is not None and self.planner is not None
        model = self.lightning_module
        units, users = build_units(model)
        if self.policy.chunk_size:
            units, users = merge_into_chunks(units, users, int(self.policy.chunk_size))
        # Without training there are no gradients or optimizer states to place. Under *-true
        # precisions gradients and states are in fp32 beside an fp32 master of each parameter,
        # and each 16-bit gradient lands in a buffer of half a master's size before widening.
        fp32_masters = isinstance(self.precision_plugin, HalfPrecision)
        sizes = [
            UnitSize(u.index, u.nbytes, sum(p.numel() * master_dtype_size(p, fp32_masters) for p in u.trainable) if trainer.training else 0)
            for u in units
        ]
        blocks = self._activations.blocks if self._activations is not None else []
        inside = [{id(m) for m in block.modules()} for block in blocks]
        planner = self.planner
        wait_on_nvme = self._gradients_wait_on_nvme(trainer)
        planner.model = ModelUnits(
            sizes=sizes, names=[u.name for u in units], co_resident=[[u.index for u in used] for used in users.values()],
            block_units=[sorted({u.index for module, used in users.items() if id(module) in ids for u in used}) for ids in inside],
            state_factor=optimizer_state_factor(self.optimizers) + (1.5 if fp32_masters else 0.0), owned=self._units_with_states_here(sizes),
            gradients_until_update=trainer.training and (self._every_step_updates_in_backward(trainer) or wait_on_nvme),
            spill_gradients=trainer.training and wait_on_nvme,
        )
        policies = self._activations.policies if self._activations is not None else []
        together = planner.working_groups(policies) if trainer.training else list(planner.model.co_resident)  # no recompute without gradients
        gpu_bytes = self.budgets.gpu if gpu_bytes is None else gpu_bytes
        placement = planner.place(planner.model, gpu_bytes, together, activations_auto=self._activations is not None and self._activations.auto)
        if not placement.offloaded and not self._engine_when_all_fits():
            rank_zero_info(
                f"tiered: everything fits in the GPU tier ({format_bytes(placement.gpu_bytes)} of parameters, gradients and optimizer "
                f"states in gpu_memory={format_bytes(gpu_bytes)}): nothing is offloaded, training runs as on a single device."
            )
            return None
        _refuse_compiled_modules(model)
        return self._start_engine(units, users, placement, sizes, fp32_masters)

    def _start_engine(self, units: list[Any], users: Any, placement: Placement, sizes: list[UnitSize], fp32_masters: bool) -> TieredEngine:
        assert self.budgets is not None
        device = make_device(self.root_device, capacity=self.budgets.gpu, spec=self.hardware, throttle=self.policy.throttle)
        try:
            engine = TieredEngine(
                self.lightning_module, units, users, placement, device, nvme_path=str(self.nvme_path) if self.nvme_path else None,
                optimizers=self.optimizers, direct_gradients=self._direct_gradients(sizes, placement, device.is_emulated),
                checksums=self.policy.checksums, fp32_masters=fp32_masters, data_parallel=self._data_parallel(sizes),
                prefetch=self.policy.prefetch, state_factor=self.planner.model.state_factor, initial_value=self.deferred.fill,
            )
        except BaseException:
            device.close()
            raise
        self._profiled = False
        self._share_optimizer_attributes()
        rank_zero_info(self._describe_placement(engine))
        self._say_when_updates_wait(self.lightning_module.trainer)
        if engine.store is not None:
            self.removed_stale_nvme = list(engine.store.removed_stale)
        return engine

    def _describe_placement(self, engine: TieredEngine) -> str:
        """One line: units and bytes per tier, where gradients and optimizer states live, the blocks' activations."""
        tiers: dict[str, list[int]] = {}
        for state in engine.states:
            count = tiers.setdefault(str(state.home), [0, 0])
            count[0] += 1
            count[1] += state.unit.nbytes
        units = ", ".join(f"{tier} {n} ({format_bytes(nbytes)})" for tier, (n, nbytes) in tiers.items())
        placement = engine.placement
        if placement.gradient_slots:
            gradients = f"NVMe units' through {sum(placement.gradient_slots.values())} host buffers" + (
                ", waiting on NVMe for the step when they must" if placement.gradients_spilled else "")
            gradients += ", the others' at home" if any(t != NVME for t in tiers if t != GPU) else ""
        else:
            gradients = "at each offloaded unit's home in host memory" if placement.offloaded else "in the GPU tier"
        policies = self._activations.policies if self._activations is not None and self._activations.blocks else []
        layout = " ".join(BlockPolicy(p).letter for p in policies) if policies else "no repeated blocks"
        return (f"tiered: units (parameters) per tier: {units}; gradients {gradients}; optimizer states with their unit's parameters; "
                f"activations per block: {layout}")

    def _say_when_updates_wait(self, trainer: "pl.Trainer") -> None:
        """Once per run: what keeps the updates from overlapping backward (LoHan §IV-C) is the recipe's."""
        if self._said_updates_wait or not trainer.training or not self._needs_all_gradients(trainer):
            return
        self._said_updates_wait = True
        why = "clipping by norm needs every gradient" if self._clips_by_norm(trainer) else "loss scaling or a hook before the step reads every gradient"
        on_nvme = ("offloaded units are updated after backward, NVMe units' gradients waiting on NVMe meanwhile; the units read from "
                   "disk are updated on the update worker's pipeline while the training thread updates the others")
        where = on_nvme if self._gradients_wait_on_nvme(trainer) else "offloaded units are updated after backward, their gradients kept in host memory"

        rank_zero_info(f"tiered: {why} before any update, so updates cannot overlap backward: {where}.")

    def _share_optimizer_attributes(self) -> None:
        """Lightning's wrappers find the optimizer's methods on its class before the instance:
        the ``zero_grad`` the engine put in place (or took back) must reach ``self.optimizers()[k]``
        too (``state`` and other instance attributes are looked up on the optimizer itself)."""
        for wrapper in self._lightning_optimizers:
            if "zero_grad" in wrapper.optimizer.__dict__:
                wrapper.__dict__["zero_grad"] = wrapper.optimizer.zero_grad
            else:
                wrapper.__dict__.pop("zero_grad", None)

    def _refuse_a_full_disk(self, error: PlacementError) -> None:
        """NVMe fell short where its budget is what the disk has free: say the disk is full."""
        if not error.nvme_needed or self.nvme_path is None or self.nvme_memory.bytes is not None:
            return
        if self.budgets is not None and self.budgets.nvme >= error.nvme_needed:
            return
        free = disk_free(str(self.nvme_path))
        raise PlacementError(
            f"{format_bytes(error.nvme_needed)} of parameters and optimizer states must go to NVMe, but the file system "
            f"under nvme_path={str(self.nvme_path)!r} has only {format_bytes(free)} free (nvme_memory="
            f"{'None' if self.nvme_memory.fraction is None else self.nvme_memory.fraction} grants what is free, less a reserve "
            f"of {format_bytes(nvme_reserve(free))}): free space there, point nvme_path at a larger disk, or raise host_memory.",
            nvme_needed=error.nvme_needed,
        ) from None

    def _search_placement(self, trainer: "pl.Trainer") -> None:
        """``placement="search"``, after the profiled first step: the planner's search (jointly with
        the activation layout under ``activations="auto"``); the fastest is put in place between
        two steps (the optimizer states move through their state dicts, exactly)."""
        engine = self.engine
        assert engine is not None and self.planner is not None
        timing = engine.last_timing or engine.profile
        if not timing.order:  # first use in forward of every unit, resident ones included
            timing = replace(timing, order=list(engine.profile.order))
        activations = self._activations
        joint = activations is not None and activations.planner == "auto" and activations.profile is not None and activations.profiled
        try:
            plan, order = self.planner.search(
                timing, [bool(s.unit.trainable) for s in engine.states], machine_from_spec(self.hardware, nvme=self.nvme_path is not None),
                # on the emulated tier every offloaded gradient is written at home (_direct_gradients): no copy on the link
                direct_gradients=engine.device.is_emulated and not self.policy.gradient_reserve,
                blocks=activations.block_costs() if joint else (), links=self._activation_links() if joint else None,
                activation_host_bytes=self._host_left(),
            )
        except PlacementError as error:
            # the search's smallest split is conservative; the first-use placement (and the
            # activation planner's own fallback) may still fit
            rank_zero_info(f"tiered: placement search found no split of the GPU tier, keeping the first-use placement: {error}")
            return
        count = self._same_on_every_rank(plan.parameters.persistent)  # measured times differ between ranks
        rank_zero_info(
            f"tiered: placement search keeps the first {count} units resident with {plan.parameters.buffers} streaming buffers, "
            f"predicted {plan.seconds * 1e3:.1f} ms per step"
        )
        resident = self.planner.keep_resident(plan, order, count, {s.unit.index for s in engine.states if s.home == GPU})
        if resident is not None:
            self._replace_engine(trainer, gpu_bytes=resident.gpu_bytes)

    @property
    def placement_search(self) -> Optional[AutoPlan]:
        """What ``placement="search"`` chose, with its prediction (None before or without it)."""
        return self.planner.search_result if self.planner is not None else None

    # -- what a data-parallel strategy changes ------------------------------------------------------

    def _engine_when_all_fits(self) -> bool:
        """Whether the engine runs even when every unit fits in the GPU tier."""
        return False

    def _data_parallel(self, sizes: list[UnitSize]) -> Optional[DataParallel]:
        """The ranks the engine reduces gradients across; None on one device."""
        return None

    def _units_with_states_here(self, sizes: list[UnitSize]) -> Optional[set[int]]:
        """The units whose optimizer states this process keeps; None: all of them."""
        return None

    def _same_on_every_rank(self, choice: Any) -> Any:
        """A planning decision taken from measurements: under data parallelism, rank 0's for all."""
        return choice

    def _gradient_reduction(self, trainer: "pl.Trainer") -> Optional[Reduction]:
        """How this backward's gradients are reduced across ranks (see ``GradientExchange``)."""
        return None

    def dump_plan(self, path: Union[str, Path]) -> Path:
        """Write what this run decided (every unit's home, every block's activation policy) as a
        plan file that ``plan_file=`` runs again without planning. Call it after setup."""
        if self.budgets is None or self.lightning_module is None:
            raise RuntimeError("dump_plan needs a strategy that has been set up; call it from a callback (on_train_start or later).")
        model = self.planner.model if self.planner is not None else None
        if model is None:  # nothing was placed (policy 'none'): every unit in the GPU tier
            units, _ = build_units(self.lightning_module)
            names, nbytes, homes = [u.name for u in units], [u.nbytes for u in units], [GPU] * len(units)
        else:
            names, nbytes = model.names, [u.nbytes for u in model.sizes]
            homes = [self.engine.placement.home[u.index] if self.engine is not None else GPU for u in model.sizes]
        blocks = self._activations is not None and bool(self._activations.blocks)
        prediction = self.predicted_step()
        plan = PlanFile(
            units=tuple(PlannedUnit(n, b, h, *self._explain_unit(i, h)) for i, (n, b, h) in enumerate(zip(names, nbytes, homes))),
            activations=tuple(self._activations.policies) if blocks else None,
            budgets={"gpu": self.budgets.gpu, "host": self.budgets.host, "nvme": self.budgets.nvme},
            prediction=None if prediction is None else prediction_record(prediction),
        )
        return save_plan(plan, path)

    def _explain_unit(self, index: int, home: str) -> tuple[str, Optional[str], Optional[str]]:
        """A unit's compute mode, where its gradient is produced and where its optimizer states live."""
        engine = self.engine
        trainable = engine.states[index].unit.trainable if engine is not None else any(p.requires_grad for p in self.lightning_module.parameters())
        if home == GPU:
            mode, gradient = "resident", "gpu"
        else:
            mode = "in_place" if index in engine.placement.dha else "streamed"
            gradient = "direct" if index in engine.direct_gradients else "copied"
        return mode, gradient if trainable else None, home if trainable else None

    def predicted_step(self, timing: Optional[StepProfile] = None) -> Optional[StepPrediction]:
        """The step model's prediction (planning/cost_model.py) for the placement in use, from the
        compute times of ``timing`` (default: the engine's last timed training step); None before
        a step has been timed or without an engine (nothing offloaded)."""
        engine = self.engine
        timing = timing if timing is not None else engine.last_timing if engine is not None else None
        if engine is None or timing is None:
            return None
        costs = costs_from_timing(timing, [bool(s.unit.trainable) for s in engine.states])
        sizes = {u.index: u for u in self.planner.model.sizes}
        state_factor = self.planner.model.state_factor
        order = list(dict.fromkeys(timing.order)) + [i for i in range(len(engine.states)) if i not in timing.order]
        units = [
            replace(
                costs[i], home=engine.states[i].home, direct_gradient=i in engine.direct_gradients,
                state_bytes=int(sizes[i].trainable_bytes * state_factor) if engine.states[i].home == NVME and i in sizes else 0,
            )
            for i in order
        ]
        machine = machine_from_spec(self.hardware, nvme=self.nvme_path is not None)
        return simulate_step([*units, outside_units(timing)], engine.placement.device_slots, machine)

    def _direct_gradients(self, sizes: list[UnitSize], placement: Placement, emulated: bool) -> frozenset[int]:
        """Offloaded units whose gradients are written straight into host memory (GO-MemFerry)."""
        reserve = self.policy.gradient_reserve
        if not emulated:
            return frozenset()  # direct writes from a CUDA device need host views it does not map yet
        reserve = 0.0 if reserve is None else reserve
        offloaded = [u for u in sizes if placement.home[u.index] != GPU and u.trainable_bytes]
        bandwidth = machine_from_spec(self.hardware, nvme=False).d2h
        kept = gradient_offload_plan(
            [u.trainable_bytes for u in offloaded], [u.trainable_bytes / bandwidth for u in offloaded], [0.0] * len(offloaded), reserve
        )
        return frozenset(u.index for k, u in enumerate(offloaded) if k not in kept)

    # -- the training step --------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        planner = self.planner
        if planner.searching and planner.phase is PlanPhase.INITIAL and self._optimizer_stepped and self.engine is not None:
            self._search_placement(self.lightning_module.trainer)
        activations = self._activations
        if activations is not None and activations.profile is not None and activations.profiled and self._optimizer_stepped:
            # between two optimizer steps' worth of batches: no gradient is waiting at home, so
            # the parameters may be placed again (every optimizer of the last batch has stepped)
            self._plan_activations(self.lightning_module.trainer)
        engine = self.engine
        if engine is not None and engine.trainable_grew() and (self._optimizer_stepped or not self._profiled):
            # parameters were unfrozen (a finetuning callback) and no gradient is pending: place
            # the model again with their gradients and states planned, states moved exactly
            rank_zero_info("tiered: parameters became trainable; placing the model again with their gradients and optimizer states")
            self._replace_engine(self.lightning_module.trainer, gpu_bytes=planner.gpu_given)
        self._optimizer_stepped = False
        self._begin_block_forward()
        if self.engine is None:
            if self._activations is None or not self._activations.blocks:
                return super().training_step(*args, **kwargs)
            self._saved_bytes = 0  # what this forward keeps for backward, as the engine counts it
            with torch.autograd.graph.saved_tensors_hooks(*self._activations.outer):
                return super().training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        by_value = trainer.gradient_clip_val if trainer.gradient_clip_algorithm == "value" and not _gradient_hooks(trainer) else None
        self.engine.begin_step(
            profile=not self._profiled, update_in_backward=self._updates_can_start_in_backward(trainer), clip_value=by_value,
            reduce=self._gradient_reduction(trainer), norms_wanted=self._clips_norm_first(trainer),
        )
        self._profiled = True
        with self.engine.saved_tensor_hooks():
            return super().training_step(*args, **kwargs)

    def _updates_can_start_in_backward(self, trainer: "pl.Trainer") -> bool:
        """True when this step's backward is the last before the optimizer step and nothing must see
        every gradient first (loss-scale overflow checks, clipping by norm): then each unit is
        updated as soon as its gradients are complete."""
        if not self.policy.update_during_backward or is_overridden("optimizer_step", trainer.lightning_module):
            return False  # a module's own optimizer_step may skip the step or pass it arguments
        if not trainer.lightning_module.automatic_optimization or self._needs_all_gradients(trainer):
            return False
        return not trainer.fit_loop._should_accumulate()

    def _every_step_updates_in_backward(self, trainer: "pl.Trainer") -> bool:
        """Known at set-up: every step's backward updates each unit as its gradients complete, so
        a gradient lives only until its unit's update (one process, one optimizer, no
        accumulation, nothing that needs every gradient first)."""
        single = self._one_automatic_step(trainer) and trainer.accumulate_grad_batches == 1
        return single and self.policy.update_during_backward and not self._needs_all_gradients(trainer)

    def _one_automatic_step(self, trainer: "pl.Trainer") -> bool:
        """One process, one optimizer, stepped by Lightning's automatic optimization and its own ``optimizer_step``."""
        module = trainer.lightning_module
        single = self.world_size == 1 and len(self.optimizers) == 1 and module.automatic_optimization
        return single and not is_overridden("optimizer_step", module)

    def _gradients_wait_on_nvme(self, trainer: "pl.Trainer") -> bool:
        """Known at set-up: what keeps units from updating as their gradients complete is only
        accumulation over micro-batches or Lightning's own clipping by norm (one process, one
        optimizer, nothing else that looks at every gradient). Then NVMe units' gradients pass
        through a few host buffers on to NVMe and wait there, their norms taken on the way,
        instead of a host gradient home each."""
        if not self._one_automatic_step(trainer) or getattr(self.precision_plugin, "scaler", None) is not None or _gradient_hooks(trainer):
            return False
        clips_otherwise = trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value" and not self._clips_by_norm(trainer)
        if clips_otherwise:  # a precision plugin of its own clips by norm over every gradient
            return False
        return self._clips_by_norm(trainer) or trainer.accumulate_grad_batches > 1 or _accumulation_scheduled(trainer)

    def _clips_by_norm(self, trainer: "pl.Trainer") -> bool:
        """Lightning's own clipping by norm (``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters)."""
        plugin = type(self.precision_plugin)
        standard = plugin.clip_grad_by_norm is Precision.clip_grad_by_norm and plugin.main_params is Precision.main_params
        by_norm = trainer.gradient_clip_algorithm in (None, "norm")  # Lightning's default is the norm
        return standard and by_norm and bool(trainer.gradient_clip_val) and trainer.gradient_clip_val > 0

    def _clips_norm_first(self, trainer: "pl.Trainer") -> bool:
        """This step's clipping by norm is the engine's (gradients may wait on NVMe)."""
        return self.engine is not None and self.engine.placement.gradients_spilled and self._clips_by_norm(trainer)

    def _needs_all_gradients(self, trainer: "pl.Trainer") -> bool:
        """Loss scaling, clipping by norm, and user code that looks at the gradients before the
        step (``on_before_optimizer_step`` in the module or a callback, its own
        ``configure_gradient_clipping``) see every gradient, and the weights not yet updated."""
        scaled = getattr(self.precision_plugin, "scaler", None) is not None
        return scaled or bool(trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value") or _gradient_hooks(trainer)

    def _eval_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            # Evaluation runs the forward part of the profiled order: prefetch along it too.
            self.engine.begin_step(profile=False, train=False)
        try:
            return step(*args, **kwargs)
        finally:
            if self.engine is not None:
                self.engine.end_eval_step()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().predict_step, *args, **kwargs)

    @override
    # Lightning's own ``Strategy.backward`` runs, between these two: code that patches or spies on
    # it (Lightning's test suite counts backward calls that way) sees every backward.
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self._refuse_activations_that_cannot_fit()
        if self.engine is not None:
            self.engine.attach_direct_gradients()
            self.engine.begin_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.end_backward()
        super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = self._optimizer_step(optimizer, closure, model, **kwargs)
        self._optimizer_stepped = True  # no gradient is pending until the next forward
        return result

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The strategy owns the step: the precision plugin's own step would update every parameter
        # at once, where they do not all live. What it does around the step is done here in the
        # same order: unscale, hooks, clipping, step (skipped on fp16 overflow), scaler update.
        model = model or self.lightning_module
        trainer = model.trainer
        closure_result = closure()
        try:
            if self._clips_norm_first(trainer):
                self._before_optimizer_step(trainer, optimizer)
                self.engine.clip_norm_and_step(optimizer, float(trainer.gradient_clip_val), closure_result, **kwargs)
                return closure_result
            if not self._needs_all_gradients(trainer):
                self._before_optimizer_step(trainer, optimizer)
                if model.automatic_optimization:
                    # Lightning's default hook, called as plain training calls it: it clips nothing
                    # here (by value is idempotent, and the engine already clipped each unit)
                    self._configure_gradient_clipping(trainer, optimizer)
                self.engine.step(optimizer, closure_result, **kwargs)
                return closure_result
            scaler = getattr(self.precision_plugin, "scaler", None)
            with self.engine.gradient_view(optimizer, closure_result, **kwargs) as gradients:
                if scaler is not None:
                    scaler.unscale_(gradients)
                self._before_optimizer_step(trainer, optimizer)
                if model.automatic_optimization:  # as Lightning's precision plugins do: the module's hook clips
                    self._configure_gradient_clipping(trainer, gradients)
                if scaler is None:
                    gradients.step()
                elif closure_result is not None or not model.automatic_optimization:
                    scaler.step(gradients)
                    scaler.update()
            return closure_result
        finally:
            self.engine.end_step(optimizer)

    @staticmethod
    def _configure_gradient_clipping(trainer: "pl.Trainer", optimizer: Any) -> None:
        call._call_lightning_module_hook(
            trainer, "configure_gradient_clipping", optimizer,
            gradient_clip_val=trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        )

    @staticmethod
    def _before_optimizer_step(trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> None:
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)

    # -- checkpoints: the true state from every tier -----------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # the checkpoint being built is sharded: values on NVMe stay there until written
        self._stand_ins = (self.engine.stand_in_readers() if self.engine is not None else {}) if self._writes_sharded() else None
        if self.engine is None:
            return super().lightning_module_state_dict()
        if self._stand_ins is not None:
            # plain detached aliases of the placeholders: detaching an offloaded parameter the
            # usual way would lend (read) its unit, gathering the model after all
            with torch._C.DisableTorchFunctionSubclass():
                state = self.lightning_module.state_dict()
            return type(state)((k, compact(v)) for k, v in state.items())
        # Views of where each value lives, as plain training returns views of its parameters: no
        # second copy of the model, except for units on NVMe, which are read into fresh buffers.
        # Each over only its own bytes, so that a checkpoint does not carry whole slabs.
        with self.engine.materialized():
            state = self.lightning_module.state_dict()
        return type(state)((k, compact(v)) for k, v in state.items())

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if self._stand_ins is not None and self.engine is not None and id(inner) in self.engine.unit_optimizers:
            return self.engine.unit_optimizers[id(inner)].state_dict(contextlib.nullcontext)  # NVMe units' states as stand-ins
        return super().optimizer_state(optimizer)

    def _writes_sharded(self) -> bool:
        """The next checkpoint is a directory written tensor by tensor (README, "Checkpoints")."""
        if self.state_dict_type is StateDictType.AUTO:
            return self.engine is not None and _nvme_state_bytes(self.engine) > _half_host_available()
        return self.state_dict_type is StateDictType.SHARDED

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        readers, self._stand_ins = self._stand_ins, None
        if readers is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("a sharded checkpoint takes no storage_options: it is written by torch.distributed.checkpoint, not by the CheckpointIO plugin.")
        if self.is_global_zero:
            write_sharded(checkpoint, filepath, readers)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # the model's and optimizers' tensors are read when loaded into their places, the rest now
        source = ShardedCheckpoint(checkpoint_path)
        checkpoint = source.meta(lambda path: self.checkpoint_io.load_checkpoint(path, weights_only=weights_only))
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

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        with self.engine.materialized(writeback=True) if self.engine is not None else contextlib.nullcontext():
            if not isinstance(state, LazyState):
                return super().load_model_state_dict(checkpoint, strict=strict)
            # parameters built without memory are read when placed, the others in place now
            state.checkpoint.load_model(
                self.lightning_module, strict, defer=lambda p: self.engine is None and p in self.deferred, set_source=self.deferred.set_source
            )

    @override
    def teardown(self) -> None:
        self._close_activations()
        try:
            self._close_engine()
        finally:
            _remove_if_empty(getattr(self, "_created_directories", []))
        super().teardown()

    def _close_engine(self) -> None:
        """Parameters back to plain tensors with their true values, every tier freed."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            self._final_engine_metrics = engine.metrics()  # what metrics() reports once the run is over
            leave = self._too_large_to_bring_back(engine)
            try:
                # while training's own failure propagates (teardown inside Lightning's handler),
                # that failure is the one to see; otherwise a failure to read back is raised
                engine.close(materialize=True, raise_errors=sys.exc_info()[0] is None, leave_on_nvme=self.deferred.defer_read if leave else None)
            finally:
                engine.device.close()
                self._share_optimizer_attributes()
            if leave and engine.store is not None:
                weakref.finalize(self, engine.store.close)  # the parameters left there read from it

    def _too_large_to_bring_back(self, engine: TieredEngine) -> bool:
        """What lives on NVMe (parameters and optimizer states) would take more than half of the
        host memory available: after training it stays there, each parameter read when used."""
        on_nvme = [s for s in engine.states if s.home == NVME]
        nbytes = _nvme_state_bytes(engine)
        if not on_nvme or nbytes <= _half_host_available():
            return False
        rank_zero_warn(
            f"tiered: after training, the {len(on_nvme)} units at home on NVMe stay there ({format_bytes(nbytes)} of parameters and "
            f"optimizer states, more than half of the {format_bytes(host_available())} of host memory available): each parameter is "
            f"read from its file when used, and their optimizer states are not brought back into the optimizer. Save checkpoints "
            f"during training to keep the optimizer's states."
        )
        return True

    def resolve_budgets(self) -> TierBudgets:
        """Grant each tier its budget, refusing up front any that asks for more than is free."""
        if self.nvme_path is not None:
            self._created_directories = _check_writable_directory(self.nvme_path) or getattr(self, "_created_directories", [])
        free = {
            "gpu_memory": gpu_free(self.root_device),
            "host_memory": host_available(),
            "nvme_memory": disk_free(str(self.nvme_path)) if self.nvme_path else 0,
        }
        where = {
            "gpu_memory": str(self.root_device) if self.root_device.type == "cuda" else "the emulated GPU tier (host memory)",
            "host_memory": "host memory",
            "nvme_memory": str(self.nvme_path),
        }
        granted = {}
        for name, budget in (("gpu_memory", self.gpu_memory), ("host_memory", self.host_memory), ("nvme_memory", self.nvme_memory)):
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
        return TierBudgets(gpu=granted["gpu_memory"], host=granted["host_memory"], nvme=granted["nvme_memory"])

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Numbers the strategy reports, read by :class:`~offload_strategy.OffloadMonitor`; after
        ``fit`` the engine's figures are those of the run's last step."""
        out: dict[str, float] = {}
        if self.budgets is not None:
            out["budget/gpu_bytes"] = float(self.budgets.gpu)
            out["budget/host_bytes"] = float(self.budgets.host)
            out["budget/nvme_bytes"] = float(self.budgets.nvme)
        if self.root_device.type == "cuda":
            out["memory/gpu_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.root_device))
        out["memory/host_peak_bytes"] = float(process_peak_rss())
        engine_metrics = self.engine.metrics() if self.engine is not None else getattr(self, "_final_engine_metrics", None)
        if engine_metrics is not None:  # after fit: the run's last figures
            out.update(engine_metrics)
            out["memory/nvme_bytes"] = out["tier/nvme_bytes"]
        else:
            out["memory/nvme_bytes"] = 0.0
        out.update(self._activation_metrics())
        return out


class TieredStrategy(TieredMixin, SingleDeviceStrategy):
    """Train models larger than GPU memory by tiering tensors across GPU, host memory and NVMe.

    Args:
        policy: ``"auto"`` (the planner chooses every placement), ``"none"`` (everything stays in
            the GPU tier), a :class:`~offload_strategy.config.PolicyConfig` or a mapping of its fields.
        hardware: ``"auto"`` probes this machine; a known machine name (``"h100_80g"``,
            ``"rtx4090"``, ...), a :class:`~offload_strategy.config.HardwareSpec` or a mapping.
        gpu_memory, host_memory, nvme_memory: the budget of each tier: bytes, a size such as
            ``"16GiB"``, or a fraction of what is free (``0.9`` or ``"90%"``); ``None`` means all
            that is free. On a machine without a GPU, ``gpu_memory`` is the capacity of the
            emulated GPU tier.
        nvme_path: a directory for the NVMe tier; ``None`` means no NVMe tier.
        plan_file: a JSON plan (as written by ``tools/plan.py`` or :meth:`dump_plan`) to run
            instead of planning: every unit's home and every block's activation policy. A plan
            made for another model is refused with the first difference.
        state_dict_type: how checkpoints are written, in the words of Lightning's FSDP strategy:
            ``"full"`` (one file, as plain Lightning writes), ``"sharded"`` (a directory written
            tensor by tensor, never the whole model in memory), or ``"auto"``: sharded when the
            parameters and optimizer states at home on NVMe exceed half the host memory
            available, one file otherwise. Both kinds load with ``ckpt_path``.
    """

    strategy_name = "tiered"

    def __init__(
        self,
        policy: Union[str, PolicyConfig, dict[str, Any]] = "auto",
        hardware: Union[str, HardwareSpec, dict[str, Any]] = "auto",
        gpu_memory: BudgetLike = None,
        host_memory: BudgetLike = None,
        nvme_path: Optional[Union[str, Path]] = None,
        nvme_memory: BudgetLike = None,
        plan_file: Optional[Union[str, Path]] = None,
        *,
        state_dict_type: Union[str, StateDictType] = StateDictType.AUTO,
        accelerator: Optional["Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self._init_tiered(policy, hardware, gpu_memory, host_memory, nvme_path, nvme_memory, plan_file)
        self.state_dict_type = StateDictType.coerce(state_dict_type)
        self._parallel_devices: Optional[list[torch.device]] = None
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision_plugin=precision_plugin
        )
        if parallel_devices is not None:
            self.parallel_devices = parallel_devices

    # -- devices and precision: Lightning's connector sets these after construction ----------------

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        if devices is not None and len(devices) > 1:
            raise ValueError(
                f"strategy='tiered' trains on one device, but {len(devices)} were given ({devices}); "
                f"set devices=1 on the Trainer."
            )
        self._parallel_devices = [torch.device(d) for d in devices] if devices is not None else None

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else torch.device("cpu")


def _nvme_state_bytes(engine: TieredEngine) -> int:
    """Parameters and optimizer states at home on NVMe."""
    on_nvme = sum(s.unit.nbytes for s in engine.states if s.home == NVME)
    return on_nvme + (sum(engine.nvme_states.sizes.values()) if engine.nvme_states is not None else 0)


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


def _refuse_weight_averaging_on_nvme(trainer: "pl.Trainer", engine: Optional[TieredEngine]) -> None:
    """Lightning's weight-averaging callbacks read and write every parameter between steps, where
    units at home on NVMe hold placeholders."""
    averaging = [type(c).__name__ for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]
    if averaging and engine is not None and any(s.home == NVME for s in engine.states):
        raise ValueError(
            f"{averaging[0]} reads and writes every parameter between steps, but {sum(s.home == NVME for s in engine.states)} "
            f"units live on NVMe, where between steps their parameters are placeholders. Give host_memory enough room for "
            f"every unit (or no nvme_path), or average the weights in your own callback inside "
            f"`with trainer.strategy.gathered_parameters(writeback=True):`."
        )


def _accumulation_scheduled(trainer: "pl.Trainer") -> bool:
    return any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks)


def _gradient_hooks(trainer: "pl.Trainer") -> bool:
    """User code runs between backward and the step: it must see plain training's gradients and weights."""
    module = trainer.lightning_module
    overridden = is_overridden("configure_gradient_clipping", module) or is_overridden("on_before_optimizer_step", module)
    return overridden or any(is_overridden("on_before_optimizer_step", callback, Callback) for callback in trainer.callbacks)


def _validate_nvme_path(path: Optional[Union[str, Path]]) -> Optional[Path]:
    if path is None:
        return None
    if not isinstance(path, (str, Path)) or str(path).strip() == "":
        raise ValueError(f"nvme_path={path!r} is not a directory path.")
    resolved = Path(path).expanduser().absolute()
    if resolved.exists() and not resolved.is_dir():
        raise ValueError(f"nvme_path={str(path)!r} exists and is not a directory; name a directory (it is created if missing).")
    return resolved


def _check_writable_directory(path: Path) -> list[Path]:
    """Create ``path`` if needed and make sure files can be written there, before training starts;
    the directories it created, deepest first (removed again at teardown if left empty)."""
    created = []
    missing = path
    while not missing.exists() and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
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


def _validate_plan_file(path: Optional[Union[str, Path]]) -> Optional[Path]:
    if path is None:
        return None
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise ValueError(f"plan_file={str(path)!r} is not a file; dump a plan with tools/plan.py and pass its path.")
    return resolved
