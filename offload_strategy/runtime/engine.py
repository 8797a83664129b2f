"""``TieredEngine``: binds every parameter to where it lives and moves it where it is needed.

Each parameter keeps its identity (optimizers, hooks and user code hold the same ``nn.Parameter``)
while its ``.data`` is rebound by the engine — MemFerry's shadow model:

- a persistent unit's parameters live in a fixed region of the GPU tier;
- an offloaded unit's parameters point at their home (a host-slab slot) while not resident, and at
  a GPU-tier buffer while resident; a unit at home on NVMe points at a placeholder of the right
  shape that holds no memory (``runtime/params/offloaded.py``).

The engine is the one object the strategy talks to. It builds the collaborators, runs the step's
protocol and the lifecycle; the work is done by collaborators that share one
:class:`EngineContext` (the unit states, the tiers' memory, the NVMe store, the step in progress),
each built with what it needs, calls going one way (docs/architecture.md, where a table says which
collaborator owns which field of a unit's state):

- :class:`UnitCache` (``runtime/params/cache.py``): fetch, prefetch, evict, bindings, staging buffers;
- :class:`GradientPath` (``runtime/grads/path.py``): gradients reaching their homes;
- :class:`UnitUpdater` (``runtime/updates/updater.py``): per-unit updates, on the update worker during backward,
  NVMe units through :class:`NvmeUpdatePipeline`;
- :class:`GradientExchange` (``runtime/grads/exchange.py``): reductions across ranks;
- :class:`Lending` (``runtime/params/lending.py``): true values between steps;
- :class:`StepTimer` (``timing.py``): the compute times the planner prices placements with;
- :class:`ModuleHooks` (``runtime/params/hooks.py``), :class:`GradientHooks` (``runtime/grads/hooks.py``) and
  :class:`SavedTensors` (``runtime/activations/saved_tensors.py``): the hooks through which the model reaches the engine;
- :class:`GradientExposure` (``runtime/grads/exposure.py``): gradients shown to user code on ``.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..hardware.device import Device
from ..memory.nvme import NvmeStore
from ..planning.placement import HOST, NVME, Placement
from .params.cache import UnitCache
from .context import EngineContext
from .grads.clipping import clip_coefficient, total_norm
from .grads.exchange import DataParallel, GradientExchange, Reduction
from .params.forwards import ForwardsBetweenSteps
from .grads.buffers import GradientBuffers
from .grads.exposure import GradientExposure
from .grads.overflow import GradientOverflow
from .activations.saved_tensors import SavedTensors
from .params.hooks import ModuleHooks
from .grads.hooks import GradientHooks
from .grads.path import GradientPath
from .engine_metrics import tier_metrics
from .params.lending import Lending
from .updates.nvme_states import NvmeOptimizerStates
from .params.offloaded import mark_present, offloaded_class
from .updates.optimizers import StatesReader, UnitOptimizers, UnitSlot
from .params.recompute import RecomputeHolds
from .state import UnitState
from .shared_homes import map_shared_homes
from .tiers import SharedHomes, TierMemory, refuse_dha_on_a_gpu
from .timing import StepTimer
from .units import TransferUnit, master_dtype
from .updates.speculation import SpeculativeUpdates
from .updates.updater import GradientView, UnitUpdater
from .updates.worker import UpdateWorker


class TieredEngine:
    """Runs a :class:`~offload_strategy.planning.placement.Placement` during training."""

    # built by ``_build``; a set-up that failed before closes with those it made (``_built``)
    memory: TierMemory
    updater: UnitUpdater
    lending: Lending
    hooks: ModuleHooks
    gradient_hooks: GradientHooks

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
        freed_limit: Optional[int] = None,
        value_written_elsewhere: Optional[Callable[[torch.Tensor], bool]] = None,
    ) -> None:
        """``freed_limit``: the resident set above which freed memory is given back (``FreedHostMemory``),
        from the move of the values into their homes on."""
        self.model = model
        # writes a parameter built without memory (or left to be read from the last engine's
        # files) into its home (construction/deferred.py); False for the others
        self._initial_value = initial_value or (lambda p, target: False)
        # such a parameter's value another rank writes into the host home it shares: dropped here
        self._value_written_elsewhere = value_written_elsewhere or (lambda p: False)
        refuse_dha_on_a_gpu(placement, device)
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
        self._closed = False
        self.handed_over: dict[int, dict[str, Any]] = {}  # id(optimizer) -> its state dict for the next engine (close)
        # optimizer time hidden behind backward vs left after it, since the last report
        self.step_stats = {"exposed_seconds": 0.0, "update_seconds": 0.0, "steps": 0}
        self.store: Optional[NvmeStore] = None  # the NVMe tier's files
        self.nvme_states: Optional[NvmeOptimizerStates] = None
        try:
            self._build(states, nvme_path, checksums, fp32_masters, direct_gradients, prefetch, state_factor)
            self.updater.freed.limit = freed_limit
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
        # the units this process updates (under sharded states another rank may own one, except a
        # persistent unit every rank updates)
        owned = frozenset(s.unit.index for s in states if self._owns(s.unit.index))
        self.memory = TierMemory.allocate(states, self.placement, self.device, owned.__contains__, self._shared_homes())
        # a staging slot goes back (to be refilled from NVMe) only once no copy out of it is queued
        self.memory.staging_pool.before_release = lambda slot, check=self.device.check_host_access: check(slot.tensor, "releases an NVMe staging slot")
        nvme_states = None
        if any(s.home == NVME for s in states):
            assert nvme_path is not None, "placement put units on NVMe without an NVMe path"
            self.store = NvmeStore(nvme_path, capacity=max(self.placement.nvme_bytes, 1), checksums=checksums)
            nvme_states = NvmeOptimizerStates(self.store)
        self.nvme_states = nvme_states
        ctx = EngineContext(
            device=self.device, placement=self.placement, states=states, memory=self.memory,
            store=self.store, fp32_masters=fp32_masters,
        )
        self.ctx = ctx
        self.cache = UnitCache(ctx, prefetch)
        worker = UpdateWorker()  # the updates, and the host's share of the gradients' way home
        # gradients the placement did not plan (late-unfrozen parameters, buffers beyond the pool) in pinned memory too
        buffers = GradientBuffers(self.memory.gradient_slots, GradientOverflow(pin=self.device.compute.type == "cuda", numa_node=self.device.numa_node))
        self.gradients = GradientPath(ctx, direct_gradients, self.data_parallel is not None, state_factor, buffers, worker)
        self.updater = UnitUpdater(ctx, self.cache, self.gradients, nvme_states, owned, worker)
        self.lending = Lending(ctx, self.cache, self.updater, nvme_states)
        self.timer = StepTimer(ctx.step, self.device, [s.unit.name for s in states], [s.unit.nbytes for s in states])
        self.saved_tensors = SavedTensors(ctx, self.cache, self.timer)
        self.recompute_holds = RecomputeHolds(states, self.saved_tensors.streamed_unit_of)
        self.forwards = ForwardsBetweenSteps(ctx, self.cache, self.lending, self.saved_tensors)
        self.hooks = ModuleHooks(ctx, self.cache, self.lending, self.timer, self.recompute_holds, self.saved_tensors, self.forwards,
                                 self.updater.freed)
        # a parameter at an NVMe placeholder read as a value is read as an attribute is (runtime/params/offloaded.py)
        ctx.offloaded_class = offloaded_class(self.hooks.lend_parameter)
        self.exchange = GradientExchange(ctx, self.data_parallel, self.gradients, self.cache) if self.data_parallel is not None else None
        self.exposure = GradientExposure(ctx, self.gradients, self.updater, self.exchange)
        self.speculation = SpeculativeUpdates()
        self.gradient_hooks = GradientHooks(ctx, self.cache, self.gradients, self.updater, self.recompute_holds, self.exchange, self.speculation)

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

    # -- what the strategy reads (the tools and the tests read the collaborators: cache, memory, timer, updater...)

    def host_bytes_held(self) -> int:
        """Host memory this process's tiers hold: its slab and fp32 masters, its share of the
        host homes the machine's ranks share, and the pinned overflow's gradients the placement
        did not plan (``runtime/grads/overflow.py``)."""
        memory = self.memory
        dp = self.data_parallel
        shared = memory.shared_slab.nbytes // dp.ranks_per_machine if memory.shared_slab is not None and dp is not None else 0
        return memory.slab.nbytes + memory.master_region.numel() + shared + self.gradients.buffers.overflow.nbytes

    def trainable_grew(self) -> bool:
        """Some parameter is trainable now that the placement planned no gradient or state for."""
        return any(p.requires_grad and id(p) not in self._planned_trainable for s in self.states for p in s.unit.params)

    # -- set-up -------------------------------------------------------------------------------------

    def _write_values(self, s: UnitState, targets: list[torch.Tensor]) -> None:
        """The unit's parameters' values into ``targets``, computed there for those built without memory."""
        for p, target in zip(s.unit.params, targets):
            if not self._initial_value(p, target):
                target.copy_(p.data)
        # what reading or computing the values made and freed (a unit read from the old engine's
        # files, at a re-placement) goes back before the next unit's, where over the budgets
        self.updater.freed.check()

    def _written_elsewhere(self, s: UnitState, targets: list[torch.Tensor]) -> None:
        """The unit's host home is shared and another rank writes its values: a parameter whose
        value is still to be computed or read is not, here. Left pending, it would be given a
        tensor of its own once the engine is built, off the home, and the engine would take that
        for a value user code gave it and refresh the owner's fp32 masters from the 16-bit values
        (a bf16 ulp off training with a copy each, where a unit left on NVMe by the last
        placement joins the shared homes)."""
        for p in s.unit.params:
            self._value_written_elsewhere(p)

    def _move_to_homes(self) -> None:
        writes = self._writes_host_homes()
        self.cache.move_to_homes(self._write_values, self._write_values if writes else self._written_elsewhere)
        if self.exchange is not None:
            self.exchange.homes_written()  # where ranks share host homes, none reads them before they hold their values

    def _install_hooks(self, users: dict[nn.Module, list[TransferUnit]]) -> None:
        self.gradient_hooks.install()
        placed = set(self.ctx.param_slot)
        self.hooks.install(users, (m for m in self.model.modules() if any(id(p) in placed for p in m.parameters())))

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
        self.gradient_hooks.sync()
        updater = self.updater
        for unit_optimizers in updater.optimizers.values():
            for p in unit_optimizers.missing():
                s, i = self.ctx.param_slot[id(p)]
                if s.unit.index in updater.owned:
                    unit_optimizers.add(s.unit.index, p, updater.master_for(s, i, p))
                    updater.state_bytes.pop(s.unit.index, None)
            unit_optimizers.adopt_loose()

    # -- saved tensors ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saved_tensor_hooks(self) -> Iterator[None]:
        """Active around a training step's forward; see the module docstring."""
        self.ctx.step.training_step_code(True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self.forwards.saved_hooks()):
                yield
        finally:
            self.ctx.step.training_step_code(False)

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
        then anyway, taken back if the norm says so (``runtime/updates/speculation.py``), their previous values
        kept in ``speculation_room`` host bytes.
        ``reduce``: under data parallelism, how this backward's gradients are reduced; None accumulates."""
        self.forwards.settle()
        self.lending.take_back()
        self.timer.begin(train)
        self.ctx.step.begin(update_in_backward and len(self.updater.optimizers) == 1, clip_value, norms_wanted)
        self.cache.new_step()
        self.saved_tensors.new_step()
        self.speculation.begin_step(speculate and train and len(self.updater.optimizers) == 1 and self.exchange is None)
        self.updater.log = []
        if self.exchange is not None:
            self.exchange.reset(reduce)
        self.gradients.new_backward()
        self.recompute_holds.reset()
        if train:
            self.sync_trainable()
            for unit_optimizers in self.updater.optimizers.values():
                unit_optimizers.adopt_replaced_state()  # before backward's updates use the states
        if speculate:  # less what gradients the placement did not plan hold of the same room (made by the sync)
            self.speculation.room = max(speculation_room - self.gradients.buffers.overflow.nbytes, 0)
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

    def take_recomputed(self) -> set[int]:
        """The units recomputed in backward since the last call."""
        return self.hooks.take_recomputed()

    def attach_direct_gradients(self) -> None:
        self.gradients.attach_direct()

    def evict_all(self) -> None:
        self.cache.evict_all()

    def fence_host_memory(self) -> None:
        """The host waits for every copy issued so far, before user code may write host memory:
        a batch's end (callbacks: an EMA, ``load_state_dict``, a weight constraint) or a home lent
        to it. A device-side wait orders compute only (CUDA), so a copy out of a home (a frozen
        unit's fetch, which no gradient's copy orders) may still be queued when the step ends."""
        self.device.synchronize()

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
        self.ctx.step.updates_begin()
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
        self.updater.update_the_rest(unit_optimizers, pipelined=self.exchange is None)
        if self.exchange is not None:
            self.exchange.share_updated_parameters()
        unit_optimizers.count_step(closure_result)
        self.timer.finish(self.updater.log, recording)
        self.step_stats["exposed_seconds"] += time.perf_counter() - started
        self.step_stats["update_seconds"] += sum(end - start for _, start, end in self.updater.log)
        self.step_stats["steps"] += 1

    def end_manual_training_step(self) -> None:
        """Manual optimization's training step returned. What it fetched since its last optimizer
        step (forwards after that step, micro-batches it accumulates, updates its own hooks made
        in backward) goes home, as after an optimizer step; gradients stay where they wait."""
        if self.ctx.step.active:
            self.ctx.step.deactivate()
            self.cache.evict_all()
        self.fence_host_memory()

    def end_eval_step(self) -> None:
        """An evaluation step ended: as after a training step, every parameter points at its home,
        so that what callbacks read and write between steps (an EMA swapping weights in and out
        around validation) is the parameters' true value, not a GPU-tier copy."""
        self.ctx.step.deactivate()
        self.cache.evict_all()
        self.fence_host_memory()

    def end_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """After ``optimizer``'s step, taken or skipped (an fp16 overflow): its gradients start
        afresh (every gradient without ``optimizer``); another optimizer's wait for its own step."""
        self.ctx.step.optimizer_step_ended()
        try:
            self.updater.drain()
        finally:
            if self.exchange is not None:
                self.exchange.finish()
        self.updater.step_ended()
        self.saved_tensors.step_ended()
        self.recompute_holds.reset()
        if optimizer is not None:
            self.gradients.forget(self._ensure_unit_optimizers(optimizer))
        else:
            self.gradients.forget_all()
        self.fence_host_memory()

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
        self.updater.redo(self.speculation.settle(bool(coefficient < 1.0), unit_optimizers, self.updater.update_copies))
        for grad in in_memory:
            grad.mul_(coefficient.to(grad.device))
        self.ctx.step.scale_gradients(coefficient)
        self.step(optimizer, closure_result, **kwargs)
        return total

    @contextlib.contextmanager
    def gradient_view(
        self, optimizer: torch.optim.Optimizer, closure_result: Any = None, *, copies_for_hooks: bool = False, **kwargs: Any,
    ) -> Iterator[GradientView]:
        """Every gradient of ``optimizer``'s parameters, attached to tensors in the facade's order,
        for what needs them all at once: loss-scale unscaling and overflow checks, clipping by norm.
        Its ``step()`` runs the engine's update (so a GradScaler can skip it). ``copies_for_hooks``:
        user hooks read ``p.grad`` (``GradientExposure.view``)."""
        unit_optimizers = self._ensure_unit_optimizers(optimizer)
        with self.exposure.view(unit_optimizers, copies_for_hooks) as (holders, take_back_replaced):
            yield GradientView(holders, lambda: self.step(optimizer, closure_result, **kwargs), take_back_replaced)

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
        hand_over: frozenset[int] = frozenset(),
    ) -> None:
        """Remove hooks, give every parameter a plain tensor with its true value, free all tiers.

        With ``leave_on_nvme``, NVMe units stay there: each parameter is handed to
        ``leave_on_nvme(p, name, read)`` with a function reading its value, the NVMe store stays
        open (``self.store``; its owner closes it), and the user's optimizer reads their states
        from their files when first used (``optimizer.StatesReadOnUse``). The functions hold the
        store and the units, nothing of the engine, so no tier's memory outlives the close.

        ``hand_over`` (the units are placed again): the ids of the user's optimizers left plain
        and empty, ``handed_over`` mapping each id to its state dict for the next engine
        (``UnitOptimizers.hand_over``): the states in memory as they are, those of NVMe units
        left there read from their files as the next engine takes them, the others' read now.
        Any other optimizer gets its states back in memory.

        Every step runs even when one fails (threads joined, hooks removed, files and pinned
        memory freed); the first failure is then raised (``raise_errors``), so that a unit that
        could not be read back never leaves training silently with placeholder weights.
        """
        if self._closed:
            return
        self._closed = True
        hooks, lending, updater, gradients = self._built("hooks"), self._built("lending"), self._built("updater"), self._built("gradients")
        for closing in (hooks, lending):
            if closing is not None:
                closing.closed = True  # nothing is fetched or lent any more
        errors = updater.close() if updater is not None else []
        exchange = self._built("exchange")
        if exchange is not None:
            exchange.close()
        self._remove_hooks()
        left = frozenset(s.unit.index for s in self.states if s.home == NVME) if leave_on_nvme is not None else frozenset()
        if materialize and lending is not None:
            errors += self._materialize_all(leave_on_nvme, left, hand_over)
        for s in self.states:
            for p in s.unit.params:  # after a failed read-back: placeholders, plain again (the failure is raised)
                if s.unit.index not in left:
                    mark_present(p)
        memory = self._built("memory")
        errors += _attempt([
            self.device.synchronize,  # no copy still reads or writes the slab when it is unregistered
            self.store.close if self.store is not None and not left else None,
            memory.slab.close if memory is not None else None,
            gradients.staging.close if gradients is not None else None,
            gradients.buffers.overflow.close if gradients is not None else None,
            memory.shared_slab.close if memory is not None and memory.shared_slab is not None else None,
        ])
        if errors and raise_errors:
            raise errors[0]

    def _materialize_all(self, leave_on_nvme: Optional[Callable], left: frozenset[int], hand_over: frozenset[int] = frozenset()) -> list[BaseException]:
        """Every parameter its true value for good (those ``left`` on NVMe handed to ``leave_on_nvme``),
        and the user's optimizers their states back (those ``hand_over`` names: handed over); the failures."""
        errors = _attempt([self.lending.take_back, *(lambda s=s: self.lending.materialize_for_good(s, leave_on_nvme) for s in self.states)])
        if hand_over:
            errors += _attempt([functools.partial(self._hand_over, left, hand_over)])
            left = frozenset()  # the others' states come back now: the old files go once the units are placed again
        nvme_states = self.nvme_states

        def in_memory(unit: int) -> contextlib.AbstractContextManager:
            return nvme_states.unit_in_memory(unit) if nvme_states is not None else contextlib.nullcontext()

        def readers(unit: int) -> Optional[StatesReader]:
            return nvme_states.reader(unit) if nvme_states is not None and unit in left else None

        restored = [u for key, u in self.updater.optimizers.items() if key not in hand_over]
        return errors + _attempt([functools.partial(u.restore_facade, in_memory, readers) for u in restored])

    def _hand_over(self, left: frozenset[int], handing: frozenset[int]) -> None:
        """The states of the optimizers ``handing`` names, for the next engine (``close(hand_over=...)``)."""
        nvme_states = self.nvme_states
        readers = nvme_states.hand_over() if nvme_states is not None else {}
        if nvme_states is not None:
            for unit in list(nvme_states.loaded):
                nvme_states.own(unit)  # in memory, not in the file: handed over as they are

        def reader(slot: UnitSlot) -> Optional[StatesReader]:
            return readers.get((slot.unit_index, id(slot.inner)))

        def now(unit: int) -> bool:
            return unit not in left  # its file closes with this engine

        self.handed_over = {key: u.hand_over(reader, now) for key, u in self.updater.optimizers.items() if key in handing}

    def _remove_hooks(self) -> None:
        for hooks in (self._built("gradient_hooks"), self._built("hooks")):
            if hooks is not None:
                hooks.remove()

    def _built(self, name: str) -> Any:
        """The collaborator ``name``, or None where set-up failed before making it."""
        return getattr(self, name, None)

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self, reset: bool = True) -> dict[str, float]:  # counts are ints (float's subtype for mypy)
        """The figures of the metric table (docs/reference.md, "Metrics"): ``cache/*`` and ``optimizer/*_ms`` over the steps
        since the last call with ``reset`` (a logging interval), ``link/*_total`` since the start,
        the rest as they are now."""
        out = {f"cache/{k}": v for k, v in self.ctx.requests.report().items()}
        out.update(tier_metrics(self))
        out["activations/saved_bytes"] = float(self.saved_tensors.bytes.bytes)
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
