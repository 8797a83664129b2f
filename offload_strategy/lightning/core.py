"""``TieredCore``: what every tiered strategy does, as one object the Lightning strategy holds
(``TieredStrategy``, ``TieredDDPStrategy``) and delegates its hooks to, instead of a mixin.

It validates what the user asked for, resolves the memory budgets of each tier against what is
free, asks the planner for each plan and hands it to the engine, runs the training step's protocol
around the engine and exposes the metrics the engine reports; checkpoints with true values, and
the units left on NVMe after training, are its ``CheckpointStates``' (``checkpoint/states.py``).
What data parallelism changes is a :class:`Ranks` collaborator (``OneProcess`` here,
``lightning.ddp.DataParallelRanks`` there). The core holds no placement logic: the planner decides,
the runtime engine carries it out. Until the engine is attached every tensor stays on the root
device, which trains exactly as Lightning's single-device strategy does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_debug

from ..checkpoint.states import CheckpointStates, LeftOnNvme, half_host_available, nvme_state_bytes, units_on_nvme
from ..config import RUNTIME_HOST_ALLOWANCE, Budget, HardwareSpec, PolicyConfig, format_bytes
from ..construction.deferred import DeferredParameters
from ..hardware import cuda_gpu_margin, disk_free, process_peak_rss, release_freed_host_memory, resident_anonymous, resolve_hardware
from ..hardware.device import Device, make_copy_streams, make_device
from ..memory.nvme import make_private_directory
from ..planning.auto import AutoPlan
from ..planning.cost_model import Machine, StepPrediction
from ..planning.placement import GPU, NVME, Placement, PlacementError, UnitSize
from ..planning.plan_file import load_plan, save_plan
from ..planning.planner import Planner, TierBudgets
from ..planning.sharding import Sharding
from ..planning.profile import StepProfile
from ..runtime.grads.exchange import DataParallel, Reduction
from ..runtime.engine import TieredEngine
from ..runtime.updates.optimizers import StatesReadOnUse
from ..runtime.out_of_memory import out_of_memory_explained
from ..session.activations import ActivationControl
from ..session.budgets import gpu_after_profiling, nvme_reserve, refuse_a_full_disk, resolve_budgets
from ..session.plans import Plan, PlanSession
from .context import LightningState, TieredContext, TieredOptions
from ..session.prediction import PredictionCheck
from .precision import user_precision
from .recipe import Recipe, Rules

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Precision plugins whose semantics the tiered runtime reproduces: 32-true, 64-true,
# 16/bf16-mixed and 16/bf16-true. Others (bitsandbytes, Transformer Engine, ...) change the module
# or the step in ways the runtime would silently undo.
_SUPPORTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)

def check_precision(plugin: Optional[Precision]) -> Optional[Precision]:
    """The precision plugin, if the tiered runtime reproduces its semantics."""
    if plugin is not None and type(plugin) not in _SUPPORTED_PRECISION:
        raise ValueError(
            f"strategy='tiered' does not support the precision plugin {type(plugin).__name__}; "
            f"use precision='32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
        )
    return plugin


class Ranks(Protocol):
    """What data parallelism changes in the core (``OneProcess``: nothing)."""

    engine_when_all_fits: bool  # the engine runs even when every unit fits in the GPU tier
    share_host_homes: bool  # the ranks of a machine map one copy of the host homes

    def data_parallel(self, sizes: list[UnitSize]) -> Optional[DataParallel]:
        """The ranks the engine reduces gradients across; None on one device."""

    def sharding(self, sizes: list[UnitSize], gradients_sent: bool) -> Optional[Sharding]:
        """Which rank keeps each unit's optimizer states; None: this process keeps them all.
        ``gradients_sent``: every backward reduces to the owners (the recipe allows it)."""

    def same_on_every_rank(self, choice: Any) -> Any:
        """A planning decision taken from measurements: under data parallelism, rank 0's for all."""

    def largest_on_every_rank(self, value: int) -> int:
        """The largest of every rank's ``value`` (each rank's batch may differ)."""

    def check_same_on_every_rank(self, what: str, choice: Hashable) -> None:
        """A decision every rank must take alike, taken by each alone: an error on every rank,
        naming each rank's ``choice``, where any differs (``what``: the decision, in words)."""

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

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], engine: Optional[TieredEngine]) -> None:
        """The units placed again (``engine``, the new one): ``optimizer`` loads the state dict this
        process's old engine handed over, with what the new placement needs of other ranks' units."""


class OneProcess:
    """One device, one process: nothing is reduced or shared."""

    engine_when_all_fits = False
    share_host_homes = False

    def data_parallel(self, sizes: list[UnitSize]) -> Optional[DataParallel]:
        return None

    def sharding(self, sizes: list[UnitSize], gradients_sent: bool) -> Optional[Sharding]:
        return None

    def same_on_every_rank(self, choice: Any) -> Any:
        return choice

    def largest_on_every_rank(self, value: int) -> int:
        return value

    def check_same_on_every_rank(self, what: str, choice: Hashable) -> None:
        return None

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

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], engine: Optional[TieredEngine]) -> None:
        optimizer.load_state_dict(state)


class TieredCore:
    """The tiered logic a Lightning strategy delegates to: budgets, planning, the engine's
    lifecycle, the training step and the optimizer step (checkpoints: ``self.checkpoints``)."""

    def __init__(self, options: TieredOptions, lightning: LightningState, ranks: Ranks) -> None:
        self.options = options
        self.ranks = ranks
        self.context = TieredContext(options, lightning, hardware=options.hardware if isinstance(options.hardware, HardwareSpec) else None)
        self.session = PlanSession(self.context, ranks, rank_zero_info, self._replace_engine, self._refuse_a_full_disk, self._settle_gpu_margin)
        self.removed_stale_nvme: list[Path] = []  # swap directories of killed runs this run removed
        self._resident_before = 0  # the anonymous resident set at set-up (resolve)
        self._final_engine_metrics: Optional[dict[str, float]] = None
        self._created_directories: list[Path] = []
        self._batch_ends_with_backward = False  # the training step's batch takes no optimizer step (it accumulates)
        # parameters of models built under this strategy, recorded instead of held (construction/deferred.py)
        self.deferred = DeferredParameters()
        self.checkpoints = CheckpointStates(self.context, self.deferred)  # checkpoints, and the units on NVMe after training

    def __reduce__(self) -> Any:
        # A pickle of the strategy (``torch.save(trainer)``, as Lightning's own tests do) holds its
        # options, as before a run: what a run made (the engine's threads and files, the blocks'
        # weak references, a parameter class made per strategy) has no meaning elsewhere.
        return (_core_with_options, (type(self), self.options, self.lightning, self.ranks, self.checkpoints.state_dict_type))

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
    def activations(self) -> ActivationControl:
        return self.session.activations

    @property
    def prediction(self) -> PredictionCheck:
        return self.session.prediction

    @property
    def placement_search(self) -> Optional[AutoPlan]:
        """What ``placement="search"`` chose, with its prediction (None before or without it)."""
        return self.planner.search_result if self.planner is not None else None

    def recipe(self, trainer: "pl.Trainer") -> Recipe:
        """What the trainer's recipe allows (``Rules``; Fabric's strategy has rules of its own)."""
        lightning = self.lightning
        return Recipe(trainer, user_precision(lightning.precision_plugin), self.policy, lightning.world_size, len(lightning.optimizers))

    # -- lifecycle ----------------------------------------------------------------------------------

    def runs_an_engine(self) -> bool:
        """Every policy but ``none`` places the model through an engine; ``none`` too under the
        ``*-true`` 16-bit precisions, with every unit in the GPU tier, for the fp32 masters the
        other placements update: without them the same recipe trained otherwise under ``none``
        (a 16-bit AdamW's epsilon is 0 in fp16, and a parameter with a zero gradient became NaN)."""
        return self.policy.name != "none" or self.keeps_fp32_masters()

    def keeps_fp32_masters(self) -> bool:
        return isinstance(user_precision(self.lightning.precision_plugin), (HalfPrecision, FabricHalfPrecision))

    def places_parameters_itself(self) -> bool:
        """On a GPU, parameters are created in host memory and placed by the engine, so that a model
        larger than the GPU never has to fit there whole."""
        return self.runs_an_engine() and self.lightning.root_device.type == "cuda"

    @contextlib.contextmanager
    def tensor_init_context(self, plain: Callable[[], contextlib.AbstractContextManager[None]], empty_init: Optional[bool]) -> Iterator[None]:
        """Models built here (``configure_model``, ``trainer.init_module()``) take no memory for
        their parameters: each is computed in its home once placed, to the bit what plain
        construction gives (construction/deferred.py)."""
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

    def clip_gradients(self, plain: Callable[..., None], optimizer: Any, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        """Lightning's ``clip_gradients`` (``plain``, the user's precision plugin's, called through
        ``TieredPrecision``) called by the training step's own code under manual optimization: it clips the engine's gradients where they are held, fp32
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
        # the first collective first: NCCL's buffers, made by it, are no part of what is free
        self.ranks.measure_links()
        context.budgets = self.resolve_budgets()
        release_freed_host_memory()  # what construction freed is no part of what the process holds
        self._resident_before = resident_anonymous()  # what the budgets bound is the growth beyond it
        root = self.lightning.root_device
        if root.type == "cuda":
            torch.cuda.reset_peak_memory_stats(root)
        if context.copy_streams is None or context.copy_streams.closed:  # one pair for every engine of the run
            context.copy_streams = make_copy_streams(root, spec=context.hardware, throttle=self.policy.throttle)

    def place_module(self, recipe: Rules) -> None:
        """The module's blocks, the planner and, unless the policy is ``none``, the engine with the
        first placement: every loop offloads (fit, and evaluation on its own, forward only)."""
        context, module, root = self.context, self.context.module, self.lightning.root_device
        plan_file = self.options.plan_file
        self.session.start(module, load_plan(plan_file) if plan_file is not None else None, self.keeps_fp32_masters())
        if self.runs_an_engine():
            _refuse_lazy_parameters(module)
            context.engine = self._build_engine(recipe)
        self.deferred.materialize_all(root)  # nothing placed them (it all fits): computed where they run
        if context.engine is None and self.places_parameters_itself():
            module.to(root)
        self.activations.use_saved_tensor_hooks()
        self.activations.attach_swap_if_needed()

    def _replace_engine(
        self, recipe: Rules, gpu_bytes: int, block_policies: Optional[Sequence[str]] = None, may_fit: bool = False,
    ) -> None:
        """Place the parameters again with ``gpu_bytes`` of the GPU tier, between two steps
        (``block_policies``: the layout they will run beside, the one in place by default;
        ``may_fit``: everything may still fit, and no engine is needed)."""
        optimizers = self.lightning.optimizers
        self.session.forget_timing()  # another engine's units
        left, handed = self._close_engine(leave=self._left_while_placing_again, hand_over=frozenset(map(id, optimizers)))
        try:
            # exact, in the engine's format; those of units left on NVMe are read from the old files
            # as the new engine takes them, one unit at a time; with sharded states, each rank's own
            states = [handed[id(o)] if id(o) in handed else o.state_dict() for o in optimizers]
            self._free_closed_engine()
            self.context.engine = self._build_engine(recipe, gpu_bytes=gpu_bytes, block_policies=block_policies)
            if self.context.engine is None and not may_fit:
                raise RuntimeError(f"placing the parameters in {format_bytes(gpu_bytes)} of the GPU tier offloaded nothing")
            if left is not None:
                self.deferred.materialize_all(self.lightning.root_device)  # none when the new engine placed them all
            for optimizer, state in zip(optimizers, states):
                self.ranks.load_optimizer_state(optimizer, state, self.context.engine)
            del states
        finally:
            if left is not None:
                left.store.close()
        release_freed_host_memory()  # what passed through memory
        self.activations.use_saved_tensor_hooks()
        self.activations.reattach_swap()  # it copied through the old engine's device, now closed

    def _left_while_placing_again(self, engine: TieredEngine) -> bool:
        """NVMe units are read from the old files into their new homes (which holds the old files
        and the new ones on the disk meanwhile) where the disk has room for both or they would take
        more than half of the host memory available; else they move through host memory."""
        free = disk_free(str(self.options.nvme_path)) if self.options.nvme_path is not None else 0
        return free - nvme_reserve(free) >= engine.placement.nvme_bytes or nvme_state_bytes(engine) > half_host_available()

    def _free_closed_engine(self) -> None:
        """The closed engine's GPU arena and pinned slab freed before the next engine allocates
        its own: the saved-tensor hooks stop naming the old engine, and a collection frees what
        its reference cycles (its parameters' class, its components' bound methods) still hold;
        on CUDA the caching allocator gives the arena back. What the steps freed and glibc kept
        goes back to the system too, before the next engine takes its budgets' worth."""
        self.activations.use_saved_tensor_hooks()  # without an engine: the counting hooks
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        release_freed_host_memory()

    def _build_engine(
        self, recipe: Rules, gpu_bytes: Optional[int] = None, block_policies: Optional[Sequence[str]] = None,
    ) -> Optional[TieredEngine]:
        """The engine for the session's plan of every unit's home (``gpu_bytes``, ``block_policies``:
        see ``PlanSession.plan_placement``); None when everything fits in the GPU tier."""
        plan = self.session.plan_placement(recipe, gpu_bytes, block_policies)
        if plan is None:
            return None
        _refuse_compiled_modules(self.context.module)
        _refuse_sparse_gradients(self.context.module, plan.units, plan.placement)
        return self._start_engine(plan, recipe)

    def _start_engine(self, plan: Plan, recipe: Rules) -> TieredEngine:
        budgets, lightning = self.context.budgets, self.lightning
        assert budgets is not None
        device = make_device(
            lightning.root_device, capacity=budgets.gpu, spec=self.hardware, throttle=self.policy.throttle, streams=self.context.copy_streams,
        )
        nvme_path, sizes = self.options.nvme_path, plan.model.sizes
        try:
            engine = TieredEngine(
                self.context.module, plan.units, plan.users, plan.placement, device, nvme_path=str(nvme_path) if nvme_path else None,
                optimizers=lightning.optimizers, direct_gradients=plan.direct_gradients,
                checksums=self.policy.checksums, fp32_masters=self.keeps_fp32_masters(), data_parallel=self.ranks.data_parallel(sizes),
                prefetch=self.policy.prefetch, state_factor=plan.model.state_factor, initial_value=self.deferred.fill,
                freed_limit=self._freed_memory_limit(device), value_written_elsewhere=self.deferred.written_elsewhere,
            )
        except BaseException:
            device.close()
            raise
        # gradients the placement did not plan (late-unfrozen parameters' homes) take pinned memory within the host budget
        placed, speculation = engine.placement.host_bytes, engine.speculation  # not the engine: no cycle through it
        engine.gradients.buffers.overflow.room = lambda: self._host_room(placed) - speculation.held_bytes
        self._share_optimizer_attributes()
        rank_zero_info(self.session.describe(plan))
        self.session.say_when_updates_wait(recipe, plan)
        if engine.store is not None:
            self.removed_stale_nvme = list(engine.store.removed_stale)
        return engine

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
        refuse_a_full_disk(error, self.options.nvme_path, self.options.nvme_memory, self.budgets)

    # -- plans --------------------------------------------------------------------------------------

    def dump_plan(self, path: Union[str, Path]) -> Path:
        """Write what this run decided (every unit's home, every block's activation policy) as a
        plan file that ``plan_file=`` runs again without planning. Call it after setup."""
        if self.budgets is None or self.lightning.lightning_module is None:
            raise RuntimeError("dump_plan needs a strategy that has been set up; call it from a callback (on_train_start or later).")
        return save_plan(self.session.plan_as_file(), path)

    def predicted_step(self, timing: Optional[StepProfile] = None) -> Optional[StepPrediction]:
        """The step model's prediction for the placement in use (``PlanSession.predicted_step``)."""
        return self.session.predicted_step(timing)

    # -- the training step --------------------------------------------------------------------------

    def training_step(self, run: Callable[[], Any], recipe: Optional[Rules] = None, batch: Any = None) -> Any:
        """A training step's forward (``run``) of ``batch``, between the planner's decisions and the
        engine's step protocol; ``recipe``: the rules of a caller without a Trainer (Fabric)."""
        rules: Rules = recipe if recipe is not None else self.recipe(self.context.module.trainer)
        self.take_back_exposed()  # before the engine may be replaced
        self._batch_ends_with_backward = rules.accumulating()
        self.session.after_step(rules)
        self.activations.note_batch(batch)  # after the plan: a batch the layout is planned with is a profiled step's
        self.prediction.step_begins()
        self.activations.begin_block_forward()
        try:
            with self.explaining_out_of_memory():
                return self._run_training_step(run, rules, manual=recipe is None and not self.context.module.automatic_optimization)
        finally:
            self.activations.end_training_step()

    def explaining_out_of_memory(self) -> contextlib.AbstractContextManager:
        return out_of_memory_explained(self.session.planned_use, self.lightning.root_device)

    def _run_training_step(self, run: Callable[[], Any], rules: Rules, manual: bool) -> Any:
        engine = self.engine
        if engine is None:
            with _torch_func_explained(), self.activations.counting_saved():
                return run()
        speculate = rules.updates_may_run_ahead_of_clipping()
        room = self._host_room(engine.placement.host_bytes) if speculate else 0
        engine.begin_step(
            profile=self.session.takes_order_profile(), update_in_backward=rules.updates_can_start_in_backward(), clip_value=rules.clip_value(),
            reduce=self.ranks.gradient_reduction(rules.accumulating(), not rules.reductions_may_go_to_owners()), norms_wanted=self.clips_norm_first(rules),
            speculate=speculate, speculation_room=room,
        )
        try:
            with _torch_func_explained(), engine.saved_tensor_hooks():
                result = run()
        finally:
            self.take_back_exposed()  # manual optimization's backward without a step leaves them to the next
        if manual:
            engine.end_manual_training_step()
        return result

    def clips_norm_first(self, recipe: Rules) -> bool:
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

    def pre_backward(self) -> None:
        self.activations.note_forward_saved()
        self.activations.refuse_unfitting()
        self.take_back_exposed()  # autograd adds to what the user left there
        if self.engine is not None:
            self.engine.attach_direct_gradients()
            self.engine.begin_backward()

    def post_backward(self, expose: bool = False) -> None:
        """``expose``: the user's own code runs between this backward and the step (manual
        optimization, a Fabric loop) and may read, clip or replace gradients there, as after
        plain backward: until the next backward, step or training step, offloaded gradients are
        on their parameters' ``.grad`` (``TieredEngine.expose_gradients``)."""
        engine = self.engine
        if engine is not None:
            engine.end_backward()
            if expose:
                engine.exposure.expose()  # reduced first under data parallelism, as DDP's backward leaves them
            if expose or self._batch_ends_with_backward:  # user code runs next (the batch's end, or its own step)
                engine.fence_host_memory()

    def _host_room(self, placed_host_bytes: int) -> int:
        """What the host budget leaves beside a placement's host bytes and the activations' swaps,
        which speculative updates' saved values and gradients the placement did not plan share."""
        assert self.budgets is not None
        return self.budgets.host - placed_host_bytes - self.activations.host_swap_bytes()

    def _freed_memory_limit(self, device: Device) -> int:
        """The resident set above which the steps (and the move of the values into an engine's
        homes) give freed memory back: what the process held at set-up, the host budget, the
        emulated GPU tier's and a quarter of the runtime's allowance: the rest is for what is made
        between two checks (a unit's gradients in backward while the worker updates another) and
        what a trim leaves above the limit (``FREED_MEMORY_SLACK``)."""
        assert self.context.budgets is not None
        budgets = self.context.budgets
        emulated = budgets.gpu if device.is_emulated else 0
        return self._resident_before + budgets.host + emulated + RUNTIME_HOST_ALLOWANCE // 4

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
        """``plain``: Lightning's step, through the precision plugin (``TieredPrecision``, which
        steps every unit where it lives)."""
        if self.context.module.automatic_optimization:
            # The closure is the training step: a plan made inside it would leave this step to
            # the optimizer chosen before it (a first engine's units stepped by the plain one).
            self.session.after_step(self.recipe(self.context.module.trainer))
        result = plain(optimizer, closure, model, **kwargs)
        self._stepped()
        return result

    def _stepped(self) -> None:
        self.session.step_ended()  # no gradient is pending until the next forward
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

    def teardown(self, plain: Callable[[], None]) -> None:
        """``plain``: the base strategy's teardown, run after the engine's close with the states
        left on NVMe out of sight (it moves every optimizer state to the CPU, which would read
        them all back)."""
        self.take_back_exposed()  # never left on ``.grad`` over memory the engine frees
        self.activations.close()
        try:
            left, _ = self._close_engine()
            if left is not None:
                self.checkpoints.settle_after_training(left, failing=sys.exc_info()[0] is not None)
                left.store.release_buffers()  # the store stays open for the units left on NVMe
        finally:
            _remove_if_empty(self._created_directories)
            self._close_copy_streams()
        release_freed_host_memory()  # what training freed leaves the process with it
        with contextlib.ExitStack() as unread:
            for optimizer in self.lightning.optimizers:
                if isinstance(optimizer.state, StatesReadOnUse):
                    unread.enter_context(optimizer.state.unread())
            plain()

    def _close_copy_streams(self) -> None:
        """Once no device copies on them: the engine's and the swap's are closed."""
        streams, self.context.copy_streams = self.context.copy_streams, None
        if streams is not None:
            streams.close()

    def _close_engine(
        self, leave: Callable[[TieredEngine], bool] = lambda engine: True, hand_over: frozenset[int] = frozenset(),
    ) -> tuple[Optional[LeftOnNvme], dict[int, dict[str, Any]]]:
        """Parameters back to plain tensors with their true values, every tier freed, but the
        units at home on NVMe where ``leave(engine)``: those stay there, read when used; what
        stays, if any, and the states of the optimizers whose ids ``hand_over`` names, for the
        next engine (``TieredEngine.close``), by the optimizer's id."""
        engine = self.context.engine
        if engine is None:
            return None, {}
        self.context.engine = None
        self._final_engine_metrics = engine.metrics()  # what metrics() reports once the run is over
        units = units_on_nvme(engine)
        room = self.checkpoints.room_after_training(engine)
        left = LeftOnNvme(engine.store, units, room, engine.updater.freed) if engine.store is not None and units and leave(engine) else None
        try:
            # while training's own failure propagates (teardown inside Lightning's handler),
            # that failure is the one to see; otherwise a failure to read back is raised
            engine.close(
                materialize=True, raise_errors=sys.exc_info()[0] is None, leave_on_nvme=self.deferred.defer_read if left else None, hand_over=hand_over,
            )
        finally:
            engine.device.close()
            self._share_optimizer_attributes()
        return left, engine.handed_over

    def _settle_gpu_margin(self) -> None:
        """Once the profiled steps are done, before their plan: a GPU tier of "all that is free"
        checked against what the device's allocator reserved beyond its allocations over them
        (``session/budgets.py::gpu_after_profiling``; the largest of every rank's), the budget line said."""
        engine, budgets, planner = self.context.engine, self.context.budgets, self.context.planner
        if engine is None or budgets is None or planner is None or self.options.gpu_memory != Budget():
            return
        root = self.lightning.root_device
        kept = cuda_gpu_margin(root).share if root.type == "cuda" else 0
        measured = self.ranks.largest_on_every_rank(engine.device.reserved_beyond_allocated())
        gpu, line = gpu_after_profiling(budgets.gpu, kept, measured, str(root) if root.type == "cuda" else "the emulated GPU tier")
        self.context.budgets = dataclasses.replace(budgets, gpu=gpu)
        planner.settle_gpu_budget(gpu)
        rank_zero_info(line)

    def resolve_budgets(self) -> TierBudgets:
        """Each tier's budget against what is free (``session/budgets.py``), the NVMe directory made."""
        options = self.options
        if options.nvme_path is not None:
            self._created_directories = _check_writable_directory(options.nvme_path) or self._created_directories
        requested = (options.gpu_memory, options.host_memory, options.nvme_memory)
        return resolve_budgets(requested, options.nvme_path, self.lightning.root_device, self.ranks.share_budgets)

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


def _core_with_options(cls: type[TieredCore], options: TieredOptions, lightning: LightningState, ranks: Ranks, state_dict_type: Any) -> TieredCore:
    core = cls(options, lightning, ranks)
    core.checkpoints.state_dict_type = state_dict_type
    return core


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
