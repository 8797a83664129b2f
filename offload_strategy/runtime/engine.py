"""``TieredEngine``: binds every parameter to where it lives and moves it where it is needed.

Each parameter keeps its identity (optimizers, hooks and user code hold the same ``nn.Parameter``)
while its ``.data`` is rebound by the engine — MemFerry's shadow model:

- a persistent unit's parameters live in a fixed region of the GPU tier;
- an offloaded unit's parameters point at their home (a host-slab slot) while not resident, and at
  a GPU-tier buffer while resident; a unit at home on NVMe points at a placeholder of the right
  shape that holds no memory (``runtime/offloaded.py``).

The engine is the one object the strategy talks to. It installs the hooks and runs the step's
protocol; the work is done by collaborators that share one :class:`EngineContext` (the unit states,
the tiers' memory, the NVMe store, the step in progress), each built with what it needs, calls
going one way (docs/architecture.md):

- :class:`UnitCache` (``cache.py``): fetch, prefetch, evict, staging buffers;
- :class:`GradientPath` (``gradients.py``): gradients reaching their homes;
- :class:`UnitUpdater` (``updates.py``): per-unit updates, on the update worker during backward,
  NVMe units through :class:`NvmeUpdatePipeline`;
- :class:`GradientExchange` (``data_parallel.py``): reductions across ranks;
- :class:`Lending` (``lending.py``): true values between steps;
- :class:`StepTimer` (``timing.py``): the compute times the planner prices placements with.

Forward pre-hooks fetch the units a module uses; saved-tensor hooks replace any saved tensor that
aliases a GPU-tier buffer by a reference (unit, offset, shape, strides), re-fetched when backward
unpacks it, so a buffer can be reused between forward and backward without corrupting anything.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..hardware.device import Device
from ..memory.nvme import NvmeStore
from ..planning.placement import GPU, HOST, HOST_SLOT_ALIGNMENT, NVME, Placement, align
from ..profiling import StepProfile
from .cache import UnitCache, slot_of
from .context import EngineContext, Phase
from .clipping import clip_coefficient, total_norm
from .data_parallel import DataParallel, GradientExchange, Reduction
from .forwards import ForwardsBetweenSteps, UnitHook, outside_transforms, saved_tensors_hooks_enabled
from .gradient_buffers import GradientBuffers
from .gradients import GradientPath
from .lending import Lending
from .metrics import RequestStats
from .nvme_states import NvmeOptimizerStates
from .offloaded import mark_present, offloaded_class
from .optimizer import LOOSE, UnitOptimizers
from .recompute import RecomputeHolds
from .saved_bytes import SavedBytes
from .scheduler import PrefetchTable
from .state import UnitState, nan_placeholder
from .shared_homes import map_shared_homes
from .tiers import SharedHomes, TierMemory
from .timing import StepTimer
from .units import TransferUnit, master_dtype
from .speculation import SpeculativeUpdates
from .updates import GradientView, UnitUpdater


class _WatchedParameters(dict):
    """A module's ``_parameters``: reading a parameter as an attribute (``module.weight``) tells the
    engine, so a parameter used outside its module's forward — through the functional API, or by
    another module — is fetched like any other use (docs/architecture.md, invariants). Iteration
    (``parameters()``, ``state_dict()``) reads nothing and fetches nothing."""

    def __init__(self, original: dict, on_read: Any) -> None:
        super().__init__(original)
        self.on_read = on_read

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if value is not None:
            self.on_read(value)
        return value

    def __reduce__(self) -> Any:
        # copies and pickles of the module (EMA, checkpoints) get a plain dict, not the engine
        return (dict, (dict(self),))


def _storage_address(t: torch.Tensor) -> Optional[int]:
    """Where ``t``'s storage starts (None: a tensor without one, as a torch.func transform's wrapper)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _units_held_by(module: nn.Module, indices: list[int], states: list[UnitState]) -> set[int]:
    """Those of ``indices`` one of whose parameters ``module`` holds right now."""
    held = {id(p) for p in dict.values(module._parameters)}
    return {i for i in indices if any(id(p) in held for p in states[i].unit.params)}


@dataclass(frozen=True)
class _SavedRef:
    """A saved tensor that aliases a unit's GPU-tier buffer, re-materialised on unpack."""

    unit: int
    byte_offset: int  # from the start of the unit's buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _SavedCast:
    """A saved 16-bit cast of a streamed parameter (autocast's, under ``*-mixed``): cast again from
    the unit when backward unpacks it, so that no copy of the weight outlives the unit's eviction
    (a cast gives the same bits every time)."""

    unit: int
    position: int  # of the parameter in its unit
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in the cast's elements
    dtype: torch.dtype


SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def _refuse_dha_on_a_gpu(placement: Placement, device: Device) -> None:
    """Units computed in place at home are bound to their host homes, CPU tensors: a GPU's
    kernels cannot take them (binding device views of the pinned home has not run on a GPU)."""
    if placement.dha and not device.is_emulated:
        raise ValueError(
            f"placement.dha puts {len(placement.dha)} unit(s) (indices {sorted(placement.dha)[:8]}) in place at home, "
            f"which runs only on the emulated GPU tier: on {device.compute} their parameters would be host tensors "
            f"in GPU kernels. Give those units a home of gpu, host or nvme instead (placement.dha=frozenset())."
        )


class TieredEngine:
    """Runs a :class:`~offload_strategy.planning.placement.Placement` during training."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[TransferUnit],
        users: dict[nn.Module, list[TransferUnit]],
        placement: Placement,
        device: Device,
        nvme_path: Optional[str] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        direct_gradients: frozenset[int] = frozenset(),
        checksums: bool = True,
        fp32_masters: bool = False,
        data_parallel: Optional[DataParallel] = None,
        prefetch: bool = True,
        state_factor: float = 2.0,
        initial_value: Optional[Callable[[torch.Tensor, torch.Tensor], bool]] = None,
    ) -> None:
        self.model = model
        # writes a parameter built without memory into its home (deferred.py); False for the others
        self._initial_value = initial_value or (lambda p, target: False)
        _refuse_dha_on_a_gpu(placement, device)
        self.device = device
        self.placement = placement
        self.data_parallel = data_parallel
        states = [UnitState(unit=u, home=placement.home[u.index], master_dtypes=[master_dtype(p, fp32_masters) for p in u.params]) for u in units]
        for s in states:
            in_flight = s.home == NVME or (s.home == HOST and placement.host_gradients_in_flight) or s.unit.index in placement.gradients_sent
            s.transient_gradients = bool(placement.gradient_slots) and in_flight and bool(s.unit.trainable)
        self.states = states
        # the parameters whose gradients and optimizer states the placement planned room for
        self._planned_trainable = {id(p) for u in units for p in u.trainable}
        # id(param) -> the engine's hook receiving its gradients (None: a persistent parameter's go nowhere apart)
        self._grad_hooks: dict[int, Optional[RemovableHandle]] = {}
        self._hooks: list[Any] = []
        self._watched: list[tuple[nn.Module, dict]] = []
        self._closed = False
        self.backward_log: list[float] = []  # times of this step's backward uses of units
        # optimizer time hidden behind backward vs left after it, since the last report
        self.step_stats = {"exposed_seconds": 0.0, "update_seconds": 0.0, "steps": 0}
        self.saved = SavedBytes()  # kept for backward by the last forward (parameters excluded)
        # units whose modules ran again in a backward (a checkpoint's recomputation, this runtime's
        # or the model's own), gathered until the strategy takes them (``take_recomputed``)
        self.recomputed_units: set[int] = set()
        self.recompute_holds = RecomputeHolds(self.states, self._streamed_unit_of)
        # made by ``_build``; a ``close`` after a failed set-up finds only those it got to
        self.memory: TierMemory
        self.store: Optional[NvmeStore] = None  # the NVMe tier's files
        self.nvme_states: Optional[NvmeOptimizerStates] = None
        self.updater: UnitUpdater
        self.lending: Lending
        try:
            self._build(states, nvme_path, checksums, fp32_masters, direct_gradients, prefetch, state_factor)
            self._move_to_homes()
            self._install_hooks(users)
            for optimizer in optimizers:
                self._register_optimizer(optimizer)
        except BaseException:
            self.close(materialize=True, raise_errors=False)  # the error that stopped set-up is the one to see
            raise

    def _build(
        self, states: list[UnitState], nvme_path: Optional[str], checksums: bool, fp32_masters: bool,
        direct_gradients: frozenset[int], prefetch: bool, state_factor: float,
    ) -> None:
        """The tiers' memory, the NVMe store, and the collaborators over one context."""
        self.memory = TierMemory.allocate(states, self.placement, self.device, self._owns, self._shared_homes())
        # a staging slot goes back (to be refilled from NVMe) only once no copy out of it is queued
        self.memory.staging_pool.before_release = lambda slot, check=self.device.check_host_access: check(slot.tensor, "releases an NVMe staging slot")
        # what a saved tensor aliasing the GPU tier shares with it
        self._arena_device, self._arena_storage = self.memory.arena.device, self.memory.arena.untyped_storage().data_ptr()
        nvme_states = None
        if any(s.home == NVME for s in states):
            assert nvme_path is not None, "placement put units on NVMe without an NVMe path"
            self.store = NvmeStore(nvme_path, capacity=max(self.placement.nvme_bytes, 1), checksums=checksums)
            nvme_states = NvmeOptimizerStates(self.store)
        self.nvme_states = nvme_states
        ctx = EngineContext(
            device=self.device, placement=self.placement, states=states, memory=self.memory,
            offloaded_class=offloaded_class(self._lend_parameter), store=self.store, fp32_masters=fp32_masters,
        )
        self.ctx = ctx
        self.cache = UnitCache(ctx, prefetch)
        self.gradients = GradientPath(ctx, direct_gradients, self.data_parallel is not None, state_factor, GradientBuffers(self.memory.gradient_slots))
        self.updater = UnitUpdater(ctx, self.cache, self.gradients, nvme_states, self._owns)
        self.lending = Lending(ctx, self.cache, self.updater, nvme_states)
        self.forwards = ForwardsBetweenSteps(ctx, self.cache, self.lending, (self.pack_saved, self.unpack_saved))
        self.exchange = GradientExchange(ctx, self.data_parallel, self.gradients, self.cache) if self.data_parallel is not None else None
        self.timer = StepTimer(ctx.step, self.device, [s.unit.name for s in states], [s.unit.nbytes for s in states])
        self.speculation = SpeculativeUpdates()

    def _shared_homes(self) -> Optional[SharedHomes]:
        """What maps the host homes the machine's ranks share, where the placement shares them."""
        dp = self.data_parallel
        if dp is None or not self.placement.host_homes_shared:
            return None
        pin = self.device.compute.type == "cuda"
        return lambda nbytes, layout: map_shared_homes(nbytes, layout, dp, pin)

    def _writes_host_homes(self) -> bool:
        """Whether this process writes the host homes' first values (one rank, where ranks share them)."""
        return self.memory.shared_slab is None or self.data_parallel is None or self.data_parallel.first_on_machine

    def _owns(self, unit_index: int) -> bool:
        """Whether this process updates the unit (under sharded states: another rank may own it,
        except a persistent unit every rank updates)."""
        return self.data_parallel is None or self.data_parallel.owns(unit_index) or self.placement.replicated(unit_index)

    # -- what the strategy, the tools and the tests read --------------------------------------------

    @property
    def arena(self) -> torch.Tensor:
        return self.memory.arena

    @property
    def slab(self) -> Any:
        return self.memory.slab

    @property
    def master_region(self) -> torch.Tensor:
        return self.memory.master_region

    @property
    def home_region(self) -> torch.Tensor:
        return self.memory.home_region

    def host_bytes_held(self) -> int:
        """Host memory this process's tiers hold: its slab and fp32 masters, and its share of the
        host homes the machine's ranks share."""
        memory, dp = self.memory, self.data_parallel  # (homes are shared only under data parallelism)
        shared = memory.shared_slab.nbytes // dp.ranks_per_machine if memory.shared_slab is not None and dp is not None else 0
        return memory.slab.nbytes + memory.master_region.numel() + shared

    @property
    def update_buffers(self) -> int:
        return self.memory.update_buffers

    @property
    def pipeline(self) -> dict[str, int]:
        """NVMe updates that found their reads done ahead, and that found a write still behind."""
        pipeline = self.updater.pipeline
        return dict(pipeline.counts) if pipeline is not None else {"reads_ahead": 0, "writes_behind": 0}

    @property
    def profile(self) -> StepProfile:
        return self.timer.profile

    @property
    def last_timing(self) -> Optional[StepProfile]:
        return self.timer.last_timing

    @property
    def table(self) -> PrefetchTable:
        return self.ctx.table

    @property
    def requests(self) -> RequestStats:
        return self.ctx.requests

    @property
    def prefetch_ahead(self) -> bool:
        return self.cache.prefetch_ahead

    @property
    def direct_gradients(self) -> frozenset[int]:
        return self.gradients.direct

    @property
    def unit_optimizers(self) -> dict[int, UnitOptimizers]:
        return self.updater.optimizers

    @property
    def update_log(self) -> list[tuple[int, float, float]]:
        return self.updater.log

    def trainable_grew(self) -> bool:
        """Some parameter is trainable now that the placement planned no gradient or state for."""
        return any(p.requires_grad and id(p) not in self._planned_trainable for s in self.states for p in s.unit.params)

    # -- set-up -------------------------------------------------------------------------------------

    def _write_values(self, s: UnitState, targets: list[torch.Tensor]) -> None:
        """The unit's parameters' values into ``targets``, computed there for those built without memory."""
        for p, target in zip(s.unit.params, targets):
            if not self._initial_value(p, target):
                target.copy_(p.data)

    @torch.no_grad()
    def _move_to_homes(self) -> None:
        ctx = self.ctx
        writes_host = self._writes_host_homes()
        for s in self.states:
            if s.home == GPU:
                targets = s.unit.views(slot_of(s).tensor)
                self._write_values(s, targets)
                ctx.bind(s, targets)
                s.bound = True
            elif s.home == HOST:
                if writes_host:
                    self._write_values(s, s.home_views)
                ctx.bind(s, s.home_views)
            else:
                staging, store = self.memory.staging_pool.acquire(s.unit.nbytes), self.store
                assert store is not None, "NVMe units have the store (_build)"
                self._write_values(s, s.unit.views(staging.tensor))
                store.write(ctx.key(s), staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
                self.memory.staging_pool.release(staging)
                s.placeholders = [nan_placeholder(p, self.device.compute) for p in s.unit.params]
                ctx.bind(s, s.placeholders)
            for i, p in enumerate(s.unit.params):
                ctx.param_slot[id(p)] = (s, i)
        if self.exchange is not None:
            self.exchange.homes_written()  # where ranks share host homes, none reads them before they hold their values

    def _install_hooks(self, users: dict[nn.Module, list[TransferUnit]]) -> None:
        # Every user module is hooked, persistent ones too, so the profiled step times them all.
        # Units computed on in place at home (MemFerry's DHA, ``placement.dha``) are never fetched.
        in_place = self.placement.dha
        for module, used in users.items():
            indices = [u.index for u in used]
            fetched = [i for i in indices if self.states[i].home != GPU and i not in in_place]
            pre_hook, post_hook = self._make_pre_hook(indices, fetched)
            self._hooks.append(module.register_forward_pre_hook(pre_hook))
            self._hooks.append(module.register_forward_hook(post_hook, always_call=True))
        for s in self.states:
            for i, p in enumerate(s.unit.params):
                if p.requires_grad:
                    self._hook_gradient(s, i, p)
        # the parameters an attribute read fetches: those of streamed units
        self._streamed = {id(p): s for s in self.states if s.home != GPU and s.unit.index not in in_place for p in s.unit.params}
        for module in users:
            self._watched.append((module, module._parameters))
            module._parameters = _WatchedParameters(module._parameters, self._on_read)
        placed = set(self.ctx.param_slot)
        self._hooks.extend(self.forwards.install(m for m in self.model.modules() if any(id(p) in placed for p in m.parameters())))

    def _hook_gradient(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        on_grad = self._on_grad if s.home != GPU else self._on_persistent_grad if self.gradients.needs_persistent_hook(s, i) else None
        self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(on_grad) if on_grad is not None else None

    def _keep_gradient_hook_last(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """User code's own post-accumulate hooks on a parameter (an optimizer step fused into
        backward, GaLore's layer-wise updates, gradient statistics) see ``p.grad`` as plain training
        has it: the engine's hook, which moves the gradient home, runs after them."""
        handle, hooks = self._grad_hooks.get(id(p)), p._post_accumulate_grad_hooks
        if handle is not None and hooks and next(reversed(hooks)) != handle.id:
            handle.remove()
            self._hook_gradient(s, i, p)

    def _register_optimizer(self, facade: torch.optim.Optimizer) -> UnitOptimizers:
        unit_optimizers = self.updater.build(facade)
        unit_optimizers.on_zero_grad = self.gradients.forget
        if self.nvme_states is not None:
            updater = self.updater
            unit_optimizers._materialize = self.lending.states_materialized
            unit_optimizers.after_slot_load = updater.adopt_states
            unit_optimizers.set_master = updater.set_master
            unit_optimizers.lend_states = self.lending.lend_states
            nvme_states = self.nvme_states
            unit_optimizers.states_replaced = lambda unit_index, master: nvme_states.drop_entries(
                unit_index, unit_optimizers.slots[unit_index].inner if unit_index in unit_optimizers.slots else None, master,
            )
        return unit_optimizers

    def _ensure_unit_optimizers(self, optimizer: torch.optim.Optimizer) -> UnitOptimizers:
        if id(optimizer) not in self.updater.optimizers:
            self._register_optimizer(optimizer)
        self.sync_trainable()
        unit_optimizers = self.updater.optimizers[id(optimizer)]
        unit_optimizers.adopt_replaced_state()
        return unit_optimizers

    @torch.no_grad()
    def sync_trainable(self) -> None:
        """A trainable set that changed during training (unfreezing, ``add_param_group``):
        parameters unfrozen since set-up get a gradient home and a gradient hook, and every
        optimizer's newly added or unfrozen parameters join their unit's inner optimizer."""
        for s in self.states:
            for i, p in enumerate(s.unit.params):
                if p.requires_grad and id(p) not in self._grad_hooks:
                    self.gradients.start(s, i, p)
                    self._hook_gradient(s, i, p)
                elif p.requires_grad:
                    self._keep_gradient_hook_last(s, i, p)
        updater = self.updater
        for unit_optimizers in updater.optimizers.values():
            for p in unit_optimizers.missing():
                s, i = self.ctx.param_slot[id(p)]
                if self._owns(s.unit.index):
                    unit_optimizers.add(s.unit.index, p, updater.master_for(s, i, p))
                    updater.state_bytes.pop(s.unit.index, None)
            unit_optimizers.adopt_loose()

    # -- hooks --------------------------------------------------------------------------------------

    def _make_pre_hook(self, indices: list[int], fetched: list[int]) -> tuple[UnitHook, UnitHook]:
        step, states, cache, timer, recomputed = self.ctx.step, self.states, self.cache, self.timer, self.recomputed_units

        def pre_hook(module: nn.Module, args: Any) -> None:
            self._refuse_stale_aliases(module)
            recomputing = torch._C._current_autograd_node() is not None
            if step.phase is Phase.BACKWARD and not recomputing:
                step.phase = Phase.FORWARD  # another forward in the same step (manual optimization)
            for i in fetched:
                states[i].pins += 1
            if timer.timing is not None and step.phase is Phase.FORWARD and not recomputing:
                timer.module_starts(indices[0])
            # a torch.func transform differentiates: units whose parameters the module holds now
            # (functional_call may have swapped in others) stay for its backward
            held = _units_held_by(module, fetched, states) if not saved_tensors_hooks_enabled() else ()
            for i in fetched:
                cache.request(i)
                if i in held:
                    cache.hold(i)
                if recomputing and torch.is_grad_enabled():  # a forward that backward recomputes
                    self.recompute_holds.fetched(states[i])
                    recomputed.add(i)

        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            for i in fetched:
                states[i].pins -= 1
            self._give_back_freed()  # the module's temporaries are freed

        return UnitHook(pre_hook), UnitHook(post_hook)

    def _give_back_freed(self) -> None:
        if self.updater is not None:
            self.updater.freed.check()

    def _streamed_unit_of(self, t: torch.Tensor) -> Optional[int]:
        """The streamed unit whose GPU-tier buffer ``t`` views (None: none)."""
        if t.device != self._arena_device or _storage_address(t) != self._arena_storage:
            return None
        s = self.cache.owner(t.data_ptr())
        return s.unit.index if s is not None else None

    def _refuse_stale_aliases(self, module: nn.Module) -> None:
        """``torch.func.functional_call`` swapped tensors into ``module`` that are views of a
        streamed unit's GPU-tier copy (``p.detach()`` of parameters while their unit was there):
        other units' weights land in that buffer as the forward goes on, so computing with them
        would be wrong, silently."""
        for name, t in dict.items(module._parameters):
            if t is None or id(t) in self.ctx.param_slot or not isinstance(t, torch.Tensor) or t.device != self._arena_device:
                continue
            if _storage_address(t) == self._arena_storage and self.cache.owner(t.data_ptr()) is not None:
                raise RuntimeError(
                    f"{type(module).__name__}.{name} was given a view of a GPU-tier buffer (``p.detach()`` of a parameter strategy='tiered' "
                    f"streams, taken while its unit was in the GPU tier); other units' weights land in that buffer as the forward goes on. "
                    f"Give torch.func.functional_call the parameters themselves (``dict(model.named_parameters())``; gradients through "
                    f"torch.autograd.grad) or copies (``p.detach().clone()``)."
                )

    def _on_read(self, p: torch.Tensor) -> None:
        s = self._streamed.get(id(p))
        if s is None:
            return
        if torch._C._functorch.peek_interpreter_stack() is None:  # every attribute read of a streamed parameter: kept cheap
            self._read(s)
            return
        with outside_transforms():
            self._read(s)

    def _read(self, s: UnitState) -> None:
        if not self.ctx.step.active:
            self.lending.lend(s)
            return
        if s.resident and s.bound:
            return
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is not None:
            # a checkpointed module's own forward recomputed in backward (its hooks ran in the
            # first forward only): held like every unit of a recomputed block
            self.cache.request(s.unit.index)
            self.recompute_holds.fetched(s)
            self.recomputed_units.add(s.unit.index)
            return
        self.cache.touch(s.unit.index)

    def _lend_parameter(self, p: torch.Tensor, hands_out: bool) -> bool:
        """A parameter at a placeholder is read as a value: as if read as an attribute (between steps
        its unit is lent at home, inside a step fetched); False where that cannot be done.
        ``hands_out`` (``p.data``) inside a step: what the caller may write through it counts as
        written (a lent unit's writes are found by comparison when it is taken back)."""
        if self._closed or id(p) not in self.ctx.param_slot:
            return False
        self._on_read(p)
        if hands_out and self.ctx.step.active:
            s, i = self.ctx.param_slot[id(p)]
            s.handed_out.add(i)
        return type(p) is nn.Parameter

    def _on_grad(self, p: torch.Tensor) -> None:
        self._give_back_freed()  # autograd freed the gradients before this one: backward's large transients
        s = self.gradients.receive(p)
        if s is not None:
            self._gradients_complete(s)

    def _on_persistent_grad(self, p: torch.Tensor) -> None:
        s = self.gradients.receive_persistent(p)
        if s is not None:
            self._gradients_complete(s)

    def _gradients_complete(self, s: UnitState) -> None:
        """Every gradient of ``s`` for this backward has arrived: reduced across ranks first, where
        there are ranks; updated now, where the step allows (LoHan §IV-C)."""
        self.cache.keep_writes(s)  # written in forward (a max-norm embedding): home before an update there
        self.recompute_holds.gradients_complete(s)
        exchange = self.exchange
        ready = exchange.complete(s) if exchange is not None and exchange.mode is not None else [s]
        if self.ctx.step.update_in_backward:
            for unit in ready:
                if unit.home != GPU:
                    self.updater.submit(unit)
            return
        if self.speculation.active:
            for unit in ready:
                self.updater.speculate(unit, self.speculation)
        if self.placement.gradients_spilled:
            for unit in ready:
                if unit.transient_gradients and self.gradients.buffers.holds(unit):
                    self.updater.spill(unit)

    # -- saved tensors ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saved_tensor_hooks(self) -> Iterator[None]:
        """Active around a training step's forward; see the module docstring."""
        self.ctx.step.in_training_step = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved):
                yield
        finally:
            self.ctx.step.in_training_step = False

    @property
    def activation_bytes(self) -> int:
        """Kept for backward by the last training forward, outside the units' buffers."""
        return self.saved.bytes

    def pack_saved(self, t: torch.Tensor) -> Any:
        if t.device != self._arena_device or t.untyped_storage().data_ptr() != self._arena_storage:
            cast = self._streamed_cast(t)
            if cast is not None:
                return cast
            step = self.ctx.step
            if step.active and step.phase is Phase.FORWARD:
                self.saved.add(t)  # kept for backward (checkpointed blocks save only inputs)
            return t
        ptr = t.data_ptr()
        s = self.cache.owner(ptr)
        if s is None:
            return t  # persistent buffers never move
        return _SavedRef(s.unit.index, self.cache.owner_offset(s, ptr), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _streamed_cast(self, t: torch.Tensor) -> Optional[_SavedCast]:
        """``t`` (or the tensor it views) as a reference to the streamed parameter it is the 16-bit
        cast of, or None. Autocast casts a weight for each operation that computes in 16 bits (and
        caches the cast of a trainable one until its region exits); a saved cast would keep the
        weight's bytes in the GPU tier until backward, outside the plan."""
        if t.dtype not in SIXTEEN_BITS or not t.requires_grad:
            return None
        base = t if t._base is None else t._base
        node = base.grad_fn
        if node is None or node.name() != "ToCopyBackward0" or base.storage_offset() != 0 or not base.is_contiguous():
            return None
        where = self.ctx.param_slot.get(id(getattr(node.next_functions[0][0], "variable", None)))
        if where is None or where[0].home == GPU:
            return None
        s, i = where
        p = s.unit.params[i]
        if base.shape != p.shape or base.device != p.device or not p.is_contiguous():
            return None
        return _SavedCast(s.unit.index, i, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    def unpack_saved(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedCast):
            self._used_in_backward(packed.unit)
            self.cache.request(packed.unit)
            cast = self.states[packed.unit].unit.params[packed.position].detach().to(packed.dtype)
            return cast.as_strided(packed.shape, packed.stride, packed.storage_offset)
        if not isinstance(packed, _SavedRef):
            return packed
        self._used_in_backward(packed.unit)
        buffer = self.cache.request(packed.unit)
        typed = buffer.view(packed.dtype)
        element = typed.element_size()
        # as_strided's offset counts from the start of the storage, not of the view
        return typed.as_strided(packed.shape, packed.stride, typed.storage_offset() + packed.byte_offset // element)

    def _used_in_backward(self, unit: int) -> None:
        self.forwards.backward_starts()  # of a graph built between steps: nothing more to record
        if not self.forwards.running:
            self.ctx.step.phase = Phase.BACKWARD
            self.backward_log.append(time.perf_counter())
            self.timer.unpacked(unit)
            self.states[unit].used_in_backward = True

    # -- training-step boundaries -------------------------------------------------------------------

    @torch.inference_mode(False)
    def begin_step(
        self, profile: bool, update_in_backward: bool = False, clip_value: Optional[float] = None,
        reduce: Optional[Reduction] = None, train: bool = True, norms_wanted: bool = False, speculate: bool = False,
        speculation_room: int = 0,
    ) -> None:
        """A training (or, with ``train=False``, evaluation) step starts. ``update_in_backward``:
        its backward ends an optimizer step (no accumulation left, nothing that needs every
        gradient first), so units are updated as soon as their gradients are complete.
        ``speculate``: clipping by norm is all that keeps them from it, so host units are updated
        then anyway, taken back if the norm says so (``speculation.py``), their previous values
        kept in ``speculation_room`` host bytes.
        ``reduce``: under data parallelism, how this backward's gradients are reduced; None accumulates."""
        self.forwards.settle()
        self.lending.take_back()
        step = self.ctx.step
        step.phase = Phase.FORWARD
        self.timer.begin(train)
        step.active = True
        self.cache.new_step()
        self.saved.clear()
        step.update_in_backward = update_in_backward and len(self.updater.optimizers) == 1
        if speculate:
            self.speculation.room = speculation_room
        self.speculation.begin_step(speculate and train and len(self.updater.optimizers) == 1 and self.exchange is None)
        step.clip_value = clip_value
        step.norms_wanted = norms_wanted
        self.updater.log, self.backward_log = [], []
        if self.exchange is not None:
            self.exchange.reset(reduce)
        for s in self.states:
            s.grads_arrived = 0
            s.used_in_backward = False
            s.recompute_pinned = False
        self.recompute_holds.reset()
        if train:
            self.sync_trainable()
            for unit_optimizers in self.updater.optimizers.values():
                unit_optimizers.adopt_replaced_state()  # before backward's updates use the states
        if profile:
            self.ctx.table.start_recording()
        else:
            # no prefetch before the first forward: a unit fetched now would miss what the training
            # step writes at home before it (a constraint applied through ``p.data``)
            self.ctx.table.restart()

    def begin_backward(self) -> None:
        """The strategy's backward starts: forward's last interval (the head and the loss) ends."""
        self.sync_trainable()  # parameters unfrozen inside the training step get their gradient hooks now
        self.timer.begin_backward()

    def end_backward(self) -> None:
        """The strategy's backward returned: the last unit's backward interval ends."""
        self.timer.end_backward()

    @contextlib.contextmanager
    def gradients_exposed(self) -> Iterator[None]:
        """Offloaded parameters' gradients on their ``.grad`` for user code run right after
        backward (``on_after_backward``), as plain training leaves them: in place changes reach
        the gradients at home, a tensor put in ``.grad`` replaces its gradient, ``None`` drops it."""
        given = self.expose_gradients()
        try:
            yield
        finally:
            self.take_back_gradients(given)

    def expose_gradients(self) -> list[tuple[UnitState, int, torch.Tensor, torch.Tensor, bool]]:
        """Offloaded gradients on ``.grad`` until :meth:`take_back_gradients` (before the next
        backward, and before the step)."""
        if self.exchange is not None:
            self.exchange.wait_all()  # reduced, as DDP's backward leaves them
        given: list[tuple[UnitState, int, torch.Tensor, torch.Tensor, bool]] = []
        for s in self.states:
            direct = s.unit.index in self.gradients.direct
            for i, p in enumerate(s.unit.params):
                home = self.gradients.expose(s, i, p)
                if home is not None:
                    given.append((s, i, p, home, direct))
        return given

    def take_back_gradients(self, given: list[tuple[UnitState, int, torch.Tensor, torch.Tensor, bool]]) -> None:
        for s, i, p, home, direct in given:
            if not self.gradients.take_back_exposed(s, i, p, home) or not direct:
                p.grad = None  # a unit accumulating at home keeps its home as ``.grad`` for the next backward

    def adopt_gradients_set_by_hand(self) -> None:
        """Gradients the user's code put on ``.grad`` without a backward (``p.grad = g``: per-sample
        gradients from ``torch.func``, ``torch.autograd.grad``'s results, an estimate of its own)
        are taken in as if autograd had accumulated them, where the engine holds gradients apart
        from ``.grad`` (offloaded units, fp32 sums of 16-bit ones). Call with no gradient exposed.
        Under data parallelism they are left alone: DDP reduces no gradient set by hand either."""
        if self.exchange is not None:
            return
        for s in self.states:
            for i, p in enumerate(s.unit.params):
                if p.grad is None or not p.requires_grad:
                    continue
                if s.home == GPU:
                    if s.master_dtypes[i] != p.dtype:
                        self._on_persistent_grad(p)
                    continue
                home = s.grads[i].home
                if home is None or p.grad.data_ptr() != home.data_ptr():  # at home already: accumulated there in place
                    self._on_grad(p)

    def take_recomputed(self) -> set[int]:
        """The units recomputed in backward since the last call."""
        taken = set(self.recomputed_units)
        self.recomputed_units.clear()
        return taken

    def attach_direct_gradients(self) -> None:
        self.gradients.attach_direct()

    def evict_all(self) -> None:
        self.cache.evict_all()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, closure_result: Any = None, **kwargs: Any) -> None:
        """Update every unit where it lives with the user's optimizer, one unit at a time
        (``kwargs``: what the user passed to ``optimizer.step``, given to every unit's step)."""
        table = self.ctx.table
        recording = table.recording
        if recording:
            table.freeze()
            self.timer.profile.order = list(table.order)
        self.lending.take_back()  # read by a callback since backward (on_before_optimizer_step): written values count
        self.ctx.step.active = False
        self.ctx.step.update_in_backward = False
        started = time.perf_counter()
        try:
            if self.exchange is not None:
                self.exchange.reduce_late_units()
        finally:
            self.updater.drain()  # the updates started during backward
        self.cache.evict_all()  # parameters are about to change: copies in the GPU tier go stale
        for s in self.states:
            if s.updated:  # updated on the worker: the kept copy is stale
                self.cache.drop_host_copy(s)
        unit_optimizers = self._ensure_unit_optimizers(optimizer)
        unit_optimizers.step_kwargs = kwargs
        self._update_the_rest(unit_optimizers)
        if self.exchange is not None:
            self.exchange.share_updated_parameters()
        unit_optimizers.count_step(closure_result)
        self.timer.finish(self.updater.log, recording)
        self.step_stats["exposed_seconds"] += time.perf_counter() - started
        self.step_stats["update_seconds"] += sum(end - start for _, start, end in self.updater.log)
        self.step_stats["steps"] += 1

    def _update_the_rest(self, unit_optimizers: UnitOptimizers) -> None:
        """Every unit the worker did not update during backward, in unit order, then loose tensors.
        NVMe units that must be read from their files go to the worker's pipeline (reads ahead,
        writes behind) while the training thread updates the others, NVMe units whose parameters
        a staging buffer still holds updated there in place."""
        updater = self.updater
        pending = [s for s in self.states if s.unit.index in unit_optimizers.slots and not s.updated]
        pipelined = updater.pipeline is not None and self.exchange is None
        piped = [s for s in pending if s.home == NVME and s.host_copy is None] if pipelined else []
        updater.submit_in_order(unit_optimizers, piped)
        on_worker = {s.unit.index for s in piped}
        try:
            for s in pending:
                if s.unit.index in on_worker:
                    continue
                start = time.perf_counter()
                if s.home == GPU:
                    updater.update_persistent(unit_optimizers, s)
                else:
                    updater.update_offloaded(unit_optimizers, s)
                updater.log.append((s.unit.index, start, time.perf_counter()))
        finally:
            updater.drain()
        for s in piped:
            self.cache.drop_host_copy(s)  # updated from its file: a copy kept in a staging buffer is stale
        updater.update_loose(unit_optimizers)

    def end_manual_training_step(self) -> None:
        """Manual optimization's training step returned. What it fetched since its last optimizer
        step (forwards after that step, micro-batches it accumulates, updates its own hooks made
        in backward) goes home, as after an optimizer step; gradients stay where they wait."""
        if self.ctx.step.active:
            self.ctx.step.active = False
            self.cache.evict_all()

    def end_eval_step(self) -> None:
        """An evaluation step ended: as after a training step, every parameter points at its home,
        so that what callbacks read and write between steps (an EMA swapping weights in and out
        around validation) is the parameters' true value, not a GPU-tier copy."""
        self.ctx.step.active = False
        self.cache.evict_all()

    def end_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """After ``optimizer``'s step, taken or skipped (an fp16 overflow): its gradients start
        afresh (every gradient without ``optimizer``); another optimizer's wait for its own step."""
        self.ctx.step.active = False
        self.ctx.step.update_in_backward = False
        self.ctx.step.gradient_scale = None
        try:
            self.updater.drain()
        finally:
            if self.exchange is not None:
                self.exchange.finish()
        for s in self.states:
            s.used_in_backward = False
            s.updated = False
            s.recompute_pinned = False
        self.recompute_holds.reset()
        if optimizer is not None:
            self.gradients.forget(self._ensure_unit_optimizers(optimizer))
        else:
            self.gradients.forget_all()

    @torch.no_grad()
    def clip_norm_and_step(self, optimizer: torch.optim.Optimizer, max_norm: float, closure_result: Any = None, **kwargs: Any) -> torch.Tensor:
        """Clip ``optimizer``'s gradients by their 2-norm as Lightning's ``clip_gradients`` does
        (``torch.nn.utils.clip_grad_norm_``), bit for bit, without every gradient in memory: the
        norms of gradients waiting on NVMe were taken on their way there, and they are multiplied
        when read back for their update. Then the step. Returns the total norm."""
        unit_optimizers = self._ensure_unit_optimizers(optimizer)
        self.updater.drain()  # every gradient written out, with its norm; every speculative update done
        # under data parallelism each owner takes its units' norms, and the ranks exchange them
        inputs = self.exchange.norm_inputs if self.exchange is not None else self.gradients.norm_inputs
        norms, in_memory = inputs(unit_optimizers)
        total = total_norm(norms)
        coefficient = clip_coefficient(max_norm, total)
        # a coefficient of exactly 1 keeps every bit of the updates made ahead of it
        for index in self.speculation.settle(bool(coefficient < 1.0), unit_optimizers, self._update_copies):
            self.states[index].updated = False
        for grad in in_memory:
            grad.mul_(coefficient.to(grad.device))
        self.ctx.step.gradient_scale = coefficient
        self.step(optimizer, closure_result, **kwargs)
        return total

    def _update_copies(self, unit_index: int) -> list[torch.Tensor]:
        """The host unit's tensors its update writes beside the masters, as ``update_offloaded`` gives them."""
        s = self.states[unit_index]
        (unit_optimizers,) = self.updater.optimizers.values()
        return [s.home_views[self.ctx.param_slot[id(p)][1]] for p in unit_optimizers.slots[unit_index].params]

    @contextlib.contextmanager
    def gradient_view(
        self, optimizer: torch.optim.Optimizer, closure_result: Any = None, *, copies_for_hooks: bool = False, **kwargs: Any,
    ) -> Iterator[GradientView]:
        """Every gradient of ``optimizer``'s parameters, attached to tensors in the facade's order,
        for what needs them all at once: loss-scale unscaling and overflow checks, clipping by norm.
        Its ``step()`` runs the engine's update (so a GradScaler can skip it). ``copies_for_hooks``:
        user hooks read ``p.grad``, so gradients held in fp32 for 16-bit parameters are shown there
        as 16-bit copies (``GradientPath.expose``)."""
        unit_optimizers = self._ensure_unit_optimizers(optimizer)
        if self.exchange is not None:
            self.exchange.reduce_late_units()
        holders: list[torch.Tensor] = []
        attached: list[torch.Tensor] = []
        given: list[tuple[UnitState, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (unit, position, parameter, master, on p.grad)
        for p in unit_optimizers.order:
            self._hold_gradient(unit_optimizers, p, holders, attached, given, copies_for_hooks)
        unstepped = self._expose_unstepped() if copies_for_hooks and self.exchange is None else []

        def take_back_replaced() -> None:
            for s, i, p, master, exposed in given:
                if not self.gradients.take_back_exposed(s, i, p, exposed):
                    master.grad = None  # dropped by the hook: neither clipped nor stepped

        try:
            yield GradientView(holders, lambda: self.step(optimizer, closure_result, **kwargs), take_back_replaced)
        finally:
            for tensor in attached:
                tensor.grad = None
            self.take_back_gradients(unstepped)

    def _expose_unstepped(self) -> list[tuple[UnitState, int, torch.Tensor, torch.Tensor, bool]]:
        """Parameters no optimizer steps, their gradients (adding up since the first backward, as
        plain training leaves them) on ``.grad`` for hooks before the step where the engine holds
        them apart (at an offloaded unit's home, in fp32 beside a 16-bit parameter), as after
        backward (:meth:`expose_gradients`)."""
        stepped = {id(p) for unit_optimizers in self.updater.optimizers.values() for p in unit_optimizers.order}
        given: list[tuple[UnitState, int, torch.Tensor, torch.Tensor, bool]] = []
        for s in self.states:
            direct = s.unit.index in self.gradients.direct
            for i, p in enumerate(s.unit.params):
                if id(p) not in stepped:
                    home = self.gradients.expose(s, i, p)
                    if home is not None:
                        given.append((s, i, p, home, direct))
        return given

    def _hold_gradient(
        self, unit_optimizers: UnitOptimizers, p: torch.Tensor, holders: list, attached: list, given: list, copies: bool,
    ) -> None:
        """The tensor carrying ``p``'s gradient in a gradient view (and those given a ``.grad``)."""
        found = unit_optimizers.slot_of.get(id(p))
        if found is None:
            if self.exchange is not None and id(p) in self.ctx.param_slot:
                stand_in = self.gradients.stand_in(p)  # another rank's unit: its reduced gradient still counts
                if stand_in is not None:
                    holders.append(stand_in)
            return
        slot, position = found
        if slot.unit_index == LOOSE:
            holders.append(p)
            return
        s = self.states[slot.unit_index]
        s.wait_reductions()
        master = slot.masters[position]
        i = self.ctx.param_slot[id(p)][1]
        if s.home != GPU and s.grads[i].spilled:
            raise RuntimeError(
                f"the gradient of {s.unit.param_names[i]!r} waits on NVMe, but this step needs every "
                f"gradient in memory at once (loss scaling, or a hook before the optimizer step); set-up planned otherwise."
            )
        if s.home == GPU:
            if id(p) not in self.gradients.persistent:
                holders.append(p)
                return
            master.grad = self.gradients.persistent[id(p)]  # a 16-bit parameter's fp32 gradient, on its master
        else:
            master.grad = s.grads[i].value()
        had_none = p.grad is None
        exposed = self.gradients.expose(s, i, p, copies) if master.grad is not None else None
        if exposed is not None:  # hooks before the step read ``p.grad``
            given.append((s, i, p, master, exposed))
            if had_none:
                attached.append(p)
        holders.append(master)
        attached.append(master)

    # -- whole-model views --------------------------------------------------------------------------

    def stand_in_readers(self) -> dict[int, Callable[[], torch.Tensor]]:
        """NVMe units' placeholders -> functions reading their true values (sharded checkpoints)."""
        self.forwards.settle()
        return self.lending.stand_in_readers()

    def materialized(self, writeback: bool = False) -> contextlib.AbstractContextManager:
        """Every parameter holds its true value in a real tensor for the duration (checkpoints)."""
        self.forwards.settle()
        return self.lending.materialized(writeback)

    def close(
        self, materialize: bool = True, raise_errors: bool = True,
        leave_on_nvme: Optional[Callable[[nn.Parameter, str, Callable[[], torch.Tensor]], None]] = None,
    ) -> None:
        """Remove hooks, give every parameter a plain tensor with its true value, free all tiers.

        With ``leave_on_nvme``, NVMe units stay there: each parameter is handed to
        ``leave_on_nvme(p, name, read)`` with a function reading its value, the NVMe store stays
        open (``self.store``; its owner closes it), and the user's optimizer reads their states
        from their files when first used (``optimizer.StatesReadOnUse``). The functions hold the
        store and the units, nothing of the engine, so no tier's memory outlives the close.

        Every step runs even when one fails (threads joined, hooks removed, files and pinned
        memory freed); the first failure is then raised (``raise_errors``), so that a unit that
        could not be read back never leaves training silently with placeholder weights.
        """
        if self._closed:
            return
        self._closed = True
        # absent where set-up stopped before making them
        memory: Optional[TierMemory] = getattr(self, "memory", None)
        updater: Optional[UnitUpdater] = getattr(self, "updater", None)
        lending: Optional[Lending] = getattr(self, "lending", None)
        if lending is not None:
            lending.closed = True
        errors = updater.close() if updater is not None else []
        self._remove_hooks()
        left = frozenset(s.unit.index for s in self.states if s.home == NVME) if leave_on_nvme is not None else frozenset()
        if materialize and lending is not None and updater is not None:  # the updater is made before lending
            errors += _attempt([lending.take_back, *(lambda s=s: self._materialize_for_good(s, leave_on_nvme) for s in self.states)])
            nvme_states = self.nvme_states

            def in_memory(unit: int) -> contextlib.AbstractContextManager:
                return nvme_states.unit_in_memory(unit) if nvme_states is not None else contextlib.nullcontext()

            def readers(unit: int) -> Optional[Callable[[], dict[tuple[int, str], torch.Tensor]]]:
                return nvme_states.reader(unit) if nvme_states is not None and unit in left else None

            errors += _attempt([functools.partial(u.restore_facade, in_memory, readers) for u in updater.optimizers.values()])
        for s in self.states:
            for p in s.unit.params:  # after a failed read-back: placeholders, plain again (the failure is raised)
                if s.unit.index not in left:
                    mark_present(p)
        errors += _attempt([
            self.device.synchronize,  # no copy still reads or writes the slab when it is unregistered
            self.store.close if self.store is not None and not left else None,
            memory.slab.close if memory is not None else None,
            memory.shared_slab.close if memory is not None and memory.shared_slab is not None else None,
        ])
        if errors and raise_errors:
            raise errors[0]

    def _remove_hooks(self) -> None:
        for grad_hook in self._grad_hooks.values():
            if grad_hook is not None:
                grad_hook.remove()
        self._grad_hooks.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for module, original in self._watched:
            current = module._parameters
            original.clear()
            original.update(current)  # keeps parameters registered or replaced meanwhile
            module._parameters = original
        self._watched = []

    @torch.no_grad()
    def _in_host_tier(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views the engine's pinned slab (or the machine's shared one)."""
        slabs = [self.memory.slab, self.memory.shared_slab] if self.memory is not None else []
        return any(
            slab is not None and not slab.closed and slab.tensor.numel() > 0
            and slab.tensor.data_ptr() <= t.data_ptr() < slab.tensor.data_ptr() + slab.tensor.numel()
            for slab in slabs
        )

    def _materialize_for_good(self, s: UnitState, leave_on_nvme: Optional[Callable] = None) -> None:
        """The unit's parameters become plain tensors holding their true values (an NVMe unit's
        handed to ``leave_on_nvme`` with a reader instead, where given)."""
        if s.fetch is not None:
            self.cache.complete(s)
        for i, p in enumerate(s.unit.params):
            if s.home == GPU and s.device_slot is not None:
                p.data = p.data.clone()
            elif s.home == HOST and s.home_views:
                p.data = s.home_views[i].clone()
            if p.grad is not None and self._in_host_tier(p.grad):
                p.grad = p.grad.clone()  # a gradient at home: the slab is freed
        if s.home == NVME and self.store is not None and s.placeholders and leave_on_nvme is not None:
            s.host_copy = None  # the slab is freed: reads come from the file
            self.ctx.bind(s, s.placeholders)
            read, unit = _file_reader(self.store, self.ctx.key(s), s.unit.nbytes), s.unit
            for i, p in enumerate(s.unit.params):
                mark_present(p)
                leave_on_nvme(p, s.unit.param_names[i], lambda i=i: unit.views(read())[i].clone())
        elif s.home == NVME and self.store is not None and s.placeholders:
            self.ctx.bind(s, [v.clone() for v in s.unit.views(self.ctx.read_home(s))])

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self, reset: bool = True) -> dict[str, float]:  # counts are ints (float's subtype for mypy)
        """The figures of the metric table (docs/reference.md, "Metrics"): ``cache/*`` and ``optimizer/*_ms`` over the steps
        since the last call with ``reset`` (a logging interval), ``link/*_total`` since the start,
        the rest as they are now."""
        out = {f"cache/{k}": v for k, v in self.ctx.requests.report().items()}
        out.update(self._tier_metrics())
        out["activations/saved_bytes"] = float(self.activation_bytes)
        speculation = self.speculation.counts
        if speculation["steps"]:
            out["optimizer/speculated_units"] = int(speculation["speculated_units"])
            out["optimizer/speculation_redone_steps"] = int(speculation["redone_steps"])
            out["memory/speculation_bytes"] = float(self.speculation.held_bytes)
        steps = self.step_stats["steps"]
        if steps:
            # update: all unit updates of a step; exposed: what the step waited after backward
            out["optimizer/update_ms"] = 1e3 * self.step_stats["update_seconds"] / steps
            out["optimizer/exposed_ms"] = 1e3 * self.step_stats["exposed_seconds"] / steps
        if reset:
            self.ctx.requests.reset()
            self.step_stats = {"exposed_seconds": 0.0, "update_seconds": 0.0, "steps": 0}
        return out

    def _tier_metrics(self) -> dict[str, float]:
        memory, store, states = self.memory, self.store, self.states
        out = {
            "link/h2d_bytes_total": float(self.device.bytes_to_device),
            "link/d2h_bytes_total": float(self.device.bytes_to_host),
            "link/nvme_read_bytes_total": float(store.bytes_read if store else 0),
            "link/nvme_write_bytes_total": float(store.bytes_written if store else 0),
        }
        persistent = sum(slot_of(s).slot_bytes for s in states if s.home == GPU)
        out["tier/gpu_bytes"] = float(persistent + memory.device_pool.used_bytes)
        out["tier/gpu_peak_bytes"] = float(persistent + memory.device_pool.peak_used_bytes)
        out["tier/gpu_reserved_bytes"] = float(memory.arena.numel())
        # optimizer states (and fp32 masters kept with them) by tier: under sharded data
        # parallelism, this rank's share
        state_bytes = {home: float(sum(b for i, b in self.updater.state_bytes.items() if states[i].home == home)) for home in (GPU, HOST)}
        masters = float(memory.master_region.numel())  # fp32 masters of the host units updated here
        # homes and gradients in the slab (or this rank's share of the homes the machine's ranks
        # share), staging buffers in use, optimizer states and masters
        out["tier/host_shared_bytes"] = float(memory.shared_slab.nbytes if memory.shared_slab is not None else 0)
        fixed = self.host_bytes_held() - memory.staging_pool.capacity_bytes + state_bytes[HOST]
        out["tier/host_bytes"] = float(fixed + memory.staging_pool.used_bytes)
        out["tier/host_peak_bytes"] = float(fixed + memory.staging_pool.peak_used_bytes)
        out["tier/nvme_bytes"] = float(store.used_bytes if store else 0)
        for home in (GPU, HOST, NVME):
            out[f"units/{home}"] = sum(1 for s in states if s.home == home)
        out["units/direct_gradients"] = len(self.gradients.direct)
        buffers = self.gradients.buffers
        out["gradients/buffers_most_held"] = int(buffers.most_held)
        out["gradients/buffers_beyond_plan_total"] = int(buffers.extra)
        out["optimizer/gpu_state_bytes"] = state_bytes[GPU]
        out["optimizer/host_state_bytes"] = state_bytes[HOST]
        out["optimizer/host_master_bytes"] = masters
        out["optimizer/nvme_state_bytes"] = float(sum(self.nvme_states.sizes.values()) if self.nvme_states is not None else 0)
        return out


def _file_reader(store: NvmeStore, key: str, nbytes: int) -> Callable[[], torch.Tensor]:
    """A function reading an NVMe unit's bytes from its file into a fresh buffer (``EngineContext.read_home``
    without the engine: it holds the store alone)."""

    def read() -> torch.Tensor:
        buffer = torch.empty(align(nbytes, HOST_SLOT_ALIGNMENT), dtype=torch.uint8)
        store.read(key, buffer).result()
        return buffer

    return read


def _attempt(actions: list[Optional[Callable[[], Any]]]) -> list[BaseException]:
    """Run every action, even after one fails; the failures, in order."""
    errors: list[BaseException] = []
    for action in actions:
        if action is None:
            continue
        try:
            action()
        except Exception as error:  # kept, and raised once everything is freed
            errors.append(error)
    return errors
