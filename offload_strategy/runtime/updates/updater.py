"""How units are updated: the user's optimizer applied per unit where each unit lives (its inner
optimizer over the unit's masters, ``runtime/updates/optimizers.py``), on the worker during backward as each
unit's gradients complete (LoHan §IV-C, active gradient offloading), or on the training thread
after backward when something needs every gradient first (clipping by norm, fp16 loss scaling).

An update is three steps: stage (an NVMe unit's parameters and states into host buffers, its
masters bound to them), step (the inner optimizer on the masters, 16-bit copies refreshed), and
write back (an NVMe unit's parameters and states go home; behind the next update on the worker).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Optional

import torch

from ...hardware import FreedHostMemory
from ...memory import Slot
from ...planning.placement import GPU, HOST, HOST_SLOT_ALIGNMENT, NVME, align
from ..params.cache import UnitCache
from ..context import EngineContext
from ..grads.path import GradientPath, clip_by_value
from .chunks import UPDATE_CHUNK_BYTES
from .nvme_pipeline import NvmeUpdatePipeline
from .nvme_states import NvmeOptimizerStates, StatesMadeInBuffer, next_offset
from .optimizers import LOOSE, UnitOptimizers, UnitSlot, grads_on, host_implementation
from .speculation import SpeculativeUpdates
from ..state import UnitState, one_element
from ..units import PARAM_ALIGNMENT
from .worker import UpdateWorker


class GradientView:
    """Parameters with their gradients attached, shaped like an optimizer for torch's GradScaler
    and clipping utilities; ``step()`` runs the engine's update."""

    def __init__(self, params: list[torch.Tensor], step: Callable[[], None], take_back_replaced: Callable[[], None] = lambda: None) -> None:
        self.param_groups = [{"params": params}]
        self._step = step
        # after hooks that may have put tensors of their own in ``p.grad`` (or None): those count
        self.take_back_replaced = take_back_replaced

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._step()


class UnitUpdater:
    def __init__(
        self, ctx: EngineContext, cache: UnitCache, gradients: GradientPath, nvme_states: Optional[NvmeOptimizerStates],
        owned: frozenset[int], worker: UpdateWorker,
    ) -> None:
        self.ctx, self.cache, self.gradients = ctx, cache, gradients
        self.nvme_states = nvme_states
        self.pipeline = NvmeUpdatePipeline(ctx, nvme_states) if nvme_states is not None else None
        self.owned = owned  # the units this process updates (under sharded states another rank may)
        self.worker = worker  # the gradient path queues its adds on it too, ahead of the updates that read them
        gradients.buffers.worker_failed = lambda: self.worker.failed
        self.optimizers: dict[int, UnitOptimizers] = {}  # id(facade) -> its per-unit optimizers
        self.state_bytes: dict[int, int] = {}  # optimizer state bytes of each unit updated here, once known
        self.idle_masters: dict[int, torch.Tensor] = {}  # id(master) of an NVMe unit -> its placeholder between updates
        self.log: list[tuple[int, float, float]] = []  # (unit, start, end) of this step's updates
        self.freed = FreedHostMemory()  # its limit set by the strategy from the budgets

    # -- masters ----------------------------------------------------------------------------------

    def build(self, facade: torch.optim.Optimizer) -> UnitOptimizers:
        """Per-unit optimizers of ``facade``, over master tensors at each unit's home."""
        units = []
        for s in self.ctx.states:
            trainable = [(i, p) for i, p in enumerate(s.unit.params) if p.requires_grad]
            if not trainable or s.unit.index not in self.owned:
                continue
            units.append((s.unit.index, [p for _, p in trainable], [self.master_for(s, i, p) for i, p in trainable]))
        host = host_implementation(facade, exact=self.ctx.device.is_emulated)
        unit_optimizers = UnitOptimizers(facade, units, managed=set(self.ctx.param_slot), host_settings=host)
        for index, slot in unit_optimizers.slots.items():
            if self.ctx.states[index].home == NVME:  # the master's first value is on NVMe with the parameter
                unit_optimizers.stale.update(id(m) for position, m in enumerate(slot.masters) if slot.widened(position))
        self.optimizers[id(facade)] = unit_optimizers
        return unit_optimizers

    def master_for(self, s: UnitState, i: int, p: torch.Tensor) -> torch.Tensor:
        """What the inner optimizer updates for parameter ``i`` of ``s``."""
        if s.home == GPU:  # fp32 masters of a persistent unit stay in the GPU tier with its states
            return p if s.master_dtypes[i] == p.dtype else p.detach().to(s.master_dtypes[i], copy=True)
        if s.home == HOST:
            if s.master_dtypes[i] == p.dtype:
                return s.home_views[i].view(p.shape)
            master = s.master_views[i]
            assert master is not None, "a host unit updated here has an fp32 master per widened parameter (tiers.py)"
            return master.copy_(s.home_views[i])
        # NVMe: bound to the unit's host copy (or its stored master) for each update, to a placeholder between
        idle = one_element(float("nan"), p.shape, s.master_dtypes[i])
        master = idle.view(idle.shape)
        self.idle_masters[id(master)] = idle
        return master

    def _take_written(self, s: UnitState) -> frozenset[int]:
        """Ids of the unit's parameters user code wrote in place since its last update."""
        return frozenset(id(s.unit.params[i]) for i in self.cache.take_written(s))

    def mark_masters_stale(self, written: Optional[set[int]] = None) -> None:
        """Parameters (``written``: those ids; None: all) were written from outside the step: fp32
        masters kept apart from them take the written values before their next update (masters
        that are the parameters need nothing)."""
        for unit_optimizers in self.optimizers.values():
            for slot in unit_optimizers.slots.values():
                unit_optimizers.stale.update(
                    id(m) for position, m in enumerate(slot.masters)
                    if slot.widened(position) and (written is None or id(slot.params[position]) in written)
                )

    def set_master(self, master: torch.Tensor, value: torch.Tensor) -> None:
        if id(master) in self.idle_masters:  # an NVMe unit's: held until ``adopt_states`` offloads it
            master.data = value.clone()
        else:
            master.copy_(value)

    def adopt_states(self, slot: UnitSlot) -> None:
        """A unit's states just loaded from a checkpoint (or handed over by the engine placed
        before): an NVMe unit's go to NVMe, with its masters; what passed through memory for them
        is given back where the process is over its budgets (read and freed unit by unit, it
        would stay in glibc's heaps: 370 MiB at 100M parameters, docs/benchmarks.md)."""
        if slot.unit_index != LOOSE and self.ctx.states[slot.unit_index].home == NVME:
            widened = [slot.widened(position) for position in range(len(slot.masters))]
            self._nvme()[0].adopt(slot.inner, slot.unit_index, slot.masters, widened)
            for master in slot.masters:
                master.data = self.idle_masters[id(master)]
        self.freed.check()

    def pipeline_counts(self) -> dict[str, int]:
        """NVMe updates that found their reads done ahead, and that found a write still behind."""
        return dict(self.pipeline.counts) if self.pipeline is not None else {"reads_ahead": 0, "writes_behind": 0}

    # -- update state: ``UnitState.updated`` is the updater's alone --------------------------------

    def step_ended(self) -> None:
        """The optimizer step is over: no unit counts as updated in the next."""
        for s in self.ctx.states:
            s.updated = False

    def redo(self, indices: list[int]) -> None:
        """Updates made ahead were taken back (``runtime/updates/speculation.py``): those units update again."""
        for index in indices:
            self.ctx.states[index].updated = False

    # -- during backward, on the worker -----------------------------------------------------------

    def submit(self, s: UnitState) -> None:
        """LoHan §IV-C: update the unit on the worker now, while backward goes on with the others."""
        (unit_optimizers,) = self.optimizers.values()
        self.freed.check()  # backward freed this unit's activations and gradients
        if s.unit.index not in unit_optimizers.slots:
            return
        s.updated = True
        self.gradients.buffers.submitted_for_update(s)
        if s.home == NVME:
            self._nvme()[1].start_reads(s)

        def update() -> None:
            start = time.perf_counter()
            self.update_offloaded(unit_optimizers, s, on_worker=True)
            self.log.append((s.unit.index, start, time.perf_counter()))

        self.worker.submit(update)

    def speculate(self, s: UnitState, speculation: SpeculativeUpdates) -> None:
        """Under clipping by norm: update a host unit now, its previous values kept aside
        (``runtime/updates/speculation.py``), when there is room for them; otherwise after backward."""
        (unit_optimizers,) = self.optimizers.values()
        slot = unit_optimizers.slots.get(s.unit.index)
        if slot is None or s.home != HOST or not speculation.reserve(s.unit.index, self._previous_bytes(s, slot)):
            return
        s.updated = True

        def update() -> None:
            start = time.perf_counter()
            self.update_offloaded(unit_optimizers, s, on_worker=True, speculation=speculation)
            self.log.append((s.unit.index, start, time.perf_counter()))

        self.worker.submit(update)

    def _previous_bytes(self, s: UnitState, slot: UnitSlot) -> int:
        """What a unit's previous values take: masters, 16-bit copies, optimizer states (before
        the optimizer created them, the planned bytes per master byte)."""
        masters = sum(m.numel() * m.element_size() for m in slot.masters)
        copies = sum(p.numel() * p.element_size() for k, p in enumerate(slot.params) if slot.widened(k))
        states = self.state_bytes.get(s.unit.index, int(masters * self.gradients.state_factor))
        return masters + copies + states

    def submit_in_order(self, unit_optimizers: UnitOptimizers, units: list[UnitState]) -> None:
        """After backward: NVMe units updated on the worker in this order, each update starting
        the next unit's reads once it has taken its own (LoHan Fig. 3b: read i+1, update i,
        write i-1 behind)."""
        if not units:
            return
        self._nvme()[1].start_reads(units[0])  # the units are NVMe units
        for s, following in zip(units, [*units[1:], None]):
            s.updated = True

            def update(s: UnitState = s, following: Optional[UnitState] = following) -> None:
                start = time.perf_counter()
                self.update_offloaded(unit_optimizers, s, on_worker=True, read_next=following)
                self.log.append((s.unit.index, start, time.perf_counter()))

            self.worker.submit(update)

    def spill(self, s: UnitState) -> None:
        """The unit's complete gradients wait for the update on NVMe (written on the worker while
        backward goes on), not in one of the few gradient buffers."""
        self.gradients.buffers.submitted_for_update(s)
        self.worker.submit(lambda: self.gradients.spill(s))

    def drain(self) -> None:
        """Every update submitted has run; every NVMe write is done, every unused read released."""
        try:
            self.worker.drain()
        finally:
            if self.pipeline is not None:
                self.pipeline.finish()

    def _nvme(self) -> tuple[NvmeOptimizerStates, NvmeUpdatePipeline]:
        """The optimizer states' files and the update pipeline, made where units live on NVMe (for their updates only)."""
        assert self.nvme_states is not None and self.pipeline is not None, "NVMe units imply NVMe states and their pipeline"
        return self.nvme_states, self.pipeline

    def close(self) -> list[BaseException]:
        errors: list[BaseException] = []
        for action in [self.worker.drain] + ([self.pipeline.finish] if self.pipeline is not None else []):
            try:
                action()
            except Exception as error:  # returned to the engine's close, raised once all is freed
                errors.append(error)
        self.worker.close()
        return errors

    def update_the_rest(self, unit_optimizers: UnitOptimizers, pipelined: bool) -> None:
        """Every unit the worker did not update during backward, in unit order, then loose tensors.
        NVMe units that must be read from their files go to the worker's pipeline (reads ahead,
        writes behind) while the training thread updates the others, NVMe units whose parameters
        a staging buffer still holds updated there in place (``pipelined``: NVMe updates may go
        through the pipeline; not under data parallelism)."""
        updater = self
        pending = [s for s in self.ctx.states if s.unit.index in unit_optimizers.slots and not s.updated]
        pipelined = updater.pipeline is not None and pipelined
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

    def update_copies(self, unit_index: int) -> list[torch.Tensor]:
        """The host unit's tensors its update writes beside the masters, as ``update_offloaded`` gives them."""
        s = self.ctx.states[unit_index]
        (unit_optimizers,) = self.optimizers.values()
        return [s.home_views[self.ctx.param_slot[id(p)][1]] for p in unit_optimizers.slots[unit_index].params]

    # -- one unit's update ------------------------------------------------------------------------

    def update_loose(self, unit_optimizers: UnitOptimizers) -> None:
        """Tensors the optimizer holds that the model does not register: updated where they are."""
        loose = unit_optimizers.loose
        if loose is None:
            return
        clip_by_value([p.grad for p in loose.params], self.ctx.step.clip_value)
        unit_optimizers.step(LOOSE)

    def update_persistent(self, unit_optimizers: UnitOptimizers, s: UnitState) -> None:
        """Update a unit whose parameters, states and masters stay in the GPU tier."""
        slot = unit_optimizers.slots[s.unit.index]
        s.wait_reductions()
        written = self._take_written(s)
        if not s.widened:
            clip_by_value([p.grad for p in slot.params], self.ctx.step.clip_value)
            unit_optimizers.step(s.unit.index)
        else:
            persistent = self.gradients.persistent
            grads = [persistent.get(id(p)) if slot.widened(k) else p.grad for k, p in enumerate(slot.params)]
            clip_by_value(grads, self.ctx.step.clip_value)
            _step_masters(unit_optimizers, slot, grads, [p.data for p in slot.params], written=written)
        self._remember_state_bytes(s, slot)

    def update_offloaded(
        self, unit_optimizers: UnitOptimizers, s: UnitState, on_worker: bool = False, read_next: Optional[UnitState] = None,
        speculation: Optional[SpeculativeUpdates] = None,
    ) -> None:
        """Update one offloaded unit at home: stage it, step it, write it back (``read_next``: an
        NVMe unit whose reads start once this one's are taken; ``speculation``: its previous values
        are kept, and its gradient stays, until the step's norm is known)."""
        slot = unit_optimizers.slots[s.unit.index]
        positions = [self.ctx.param_slot[id(p)][1] for p in slot.params]
        if s.home == NVME:
            nvme_states, pipeline = self._nvme()
            staged = pipeline.take_reads(s.unit.index) if on_worker else None
            if read_next is not None:
                pipeline.start_reads(read_next)
        self.gradients.restore(s)
        grads = self.gradients.for_update(s, positions)
        written = self._take_written(s)
        made: ContextManager[Any] = contextlib.nullcontext()
        if s.home == NVME:
            known = nvme_states.known(s.unit.index)
            params, states, copies, made = self._stage_nvme(s, slot, positions, staged, known, on_worker)
        else:
            copies = [s.home_views[i] for i in positions]
            self.cache.settle_home(s)
            self.ctx.device.check_host_access(self.ctx.home_bytes(s), "updates a host unit at home")
        if speculation is not None:
            _step_masters(
                unit_optimizers, slot, grads, copies, before=lambda: speculation.save(slot, copies), written=written, chunk_bytes=UPDATE_CHUNK_BYTES,
            )
            self._remember_state_bytes(s, slot)
            return
        self.freed.check()  # before the step makes its temporaries
        with made:  # a first step of an NVMe unit: its new states made in their buffer
            _step_masters(unit_optimizers, slot, grads, copies, written=written, chunk_bytes=UPDATE_CHUNK_BYTES)
        self.gradients.consumed(s, positions)
        if s.home == NVME:
            self._write_back_nvme(s, slot, params, states, known, on_worker)
        else:
            self._remember_state_bytes(s, slot)
        self.freed.check()  # the optimizer's temporaries are freed

    def _remember_state_bytes(self, s: UnitState, slot: UnitSlot) -> None:
        """A unit whose states stay in memory: their bytes, once its optimizer has created them
        (NVMe units' are counted by their packed files)."""
        if s.unit.index not in self.state_bytes:
            self.state_bytes[s.unit.index] = _state_bytes(slot)

    def _stage_nvme(
        self, s: UnitState, slot: UnitSlot, positions: list[int], staged: Any, known: bool, on_worker: bool,
    ) -> tuple[Slot, Optional[Slot], list[torch.Tensor], ContextManager[Any]]:
        """An NVMe unit's parameters (and its states, once stored) in host buffers, its masters
        bound to them: (parameter buffer, state buffer or None, the parameters' views, what the
        step runs under: at the unit's first step, its states made in the state buffer)."""
        states: Optional[Slot] = None
        nvme_states, pipeline = self._nvme()
        if on_worker:
            pipeline.before_update()
        if staged is not None:
            params, states, reads = staged
            for r in reads:
                r.result()
            pipeline.counts["reads_ahead"] += 1
        elif on_worker:
            params = pipeline.buffer(s.unit.nbytes)
            nvme_states.store.read(self.ctx.key(s), params.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
        else:
            params = self.cache.host_copy_for_update(s)
        views = s.unit.views(params.tensor)
        copies = [views[i] for i in positions]
        for position, (master, copy) in enumerate(zip(slot.masters, copies)):
            if not slot.widened(position):
                master.data = copy
        if known and states is not None:  # read ahead with the parameters
            nvme_states.load(s.unit.index, states.tensor, read=False)
        elif known:
            size = nvme_states.sizes[s.unit.index]
            states = pipeline.buffer(size) if on_worker else self._state_buffer(s, size)
            nvme_states.load(s.unit.index, states.tensor)
        else:
            states = self._first_state_buffer(s, slot, on_worker)
        start = self._own_unstored_masters(slot, copies, states.tensor if states is not None and not known else None)
        if known or states is None:
            return params, states, copies, contextlib.nullcontext()
        return params, states, copies, StatesMadeInBuffer(states.tensor, start)

    def _first_state_buffer(self, s: UnitState, slot: UnitSlot, on_worker: bool) -> Optional[Slot]:
        """A unit's first update: the buffer its states will be stored from, taken before the step
        so that the optimizer makes them there (``StatesMadeInBuffer``), of the bytes planned for
        them (the masters' bytes times the optimizer's state bytes per byte, fp32 masters beside),
        at most the largest buffer; None where none are planned."""
        masters = sum(m.numel() * m.element_size() for m in slot.masters)
        widened = sum(m.numel() * m.element_size() for position, m in enumerate(slot.masters) if slot.widened(position))
        planned = int(masters * self.gradients.state_factor) + widened
        if planned == 0:
            return None
        nvme_states, pipeline = self._nvme()
        largest = pipeline.pool.classes[0].slot_bytes if on_worker else max(self.ctx.placement.staging_slots)
        size = min(align(planned + len(slot.masters) * 2 * PARAM_ALIGNMENT, HOST_SLOT_ALIGNMENT), largest)
        return pipeline.buffer(size) if on_worker else self._state_buffer(s, size)

    def _own_unstored_masters(self, slot: UnitSlot, copies: list[torch.Tensor], buffer: Optional[torch.Tensor] = None) -> int:
        """An fp32 master is read with the states, into their buffer; one never stored yet (still
        its placeholder) starts from the copy, in memory of its own (made only then: not at every
        update, which put the unit's size in fp32 through the allocator each time): at a unit's
        first update, at its place in the states' ``buffer`` where it fits. Returns where the
        states start after the masters in that layout."""
        offset = 0
        for position, (master, copy) in enumerate(zip(slot.masters, copies)):
            if not slot.widened(position):
                continue
            nbytes = copy.numel() * master.element_size()
            if master.data_ptr() == self.idle_masters[id(master)].data_ptr():
                if buffer is not None and offset + nbytes <= buffer.numel():
                    master.data = buffer[offset : offset + nbytes].view(master.dtype).view(copy.shape)
                else:
                    master.data = torch.empty(copy.shape, dtype=master.dtype)
            offset = next_offset(offset, nbytes)
        return offset

    def _write_back_nvme(self, s: UnitState, slot: UnitSlot, params: Slot, states: Optional[Slot], known: bool, on_worker: bool) -> None:
        """The updated parameters and states of an NVMe unit go home: behind the next unit's
        update on the worker, at once otherwise; the masters point at their placeholders again."""
        nvme_states, pipeline = self._nvme()
        if not known and states is not None:
            states = self._keep_made_states(s, slot, states, on_worker)
        elif not known or not nvme_states.matches(slot.inner, s.unit.index, slot.masters):
            states = self._relayout_states(s, slot, states, on_worker)
        writes = []
        if states is not None:
            writes.append(nvme_states.save(s.unit.index, states.tensor, wait=not on_worker))
        writes.append(nvme_states.store.write(self.ctx.key(s), params.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]))
        for master in slot.masters:
            master.data = self.idle_masters[id(master)]
        if on_worker:  # written behind: the next unit's update does not wait for it
            pipeline.write_behind(writes, [params] + ([states] if states is not None else []))
            return
        for w in writes:
            w.result()
        if states is not None:
            self.ctx.memory.staging_pool.release(states)

    def _keep_made_states(self, s: UnitState, slot: UnitSlot, states: Slot, on_worker: bool) -> Optional[Slot]:
        """A unit's first update made its states in ``states`` (``StatesMadeInBuffer``): their
        layout is learnt; where every one is at its place there, the buffer is kept as it is,
        else each takes a copy of its own and they are laid out as after any new state."""
        nvme_states, pipeline = self._nvme()
        widened = [slot.widened(position) for position in range(len(slot.masters))]
        if nvme_states.learn(slot.inner, s.unit.index, slot.masters, widened) and nvme_states.in_place(s.unit.index, states.tensor):
            return states
        nvme_states.own(s.unit.index)  # made elsewhere in part: the buffer goes back, their values stay
        (pipeline.pool if on_worker else self.ctx.memory.staging_pool).release(states)
        return self._relayout_states(s, slot, None, on_worker)

    def _relayout_states(self, s: UnitState, slot: UnitSlot, states: Optional[Slot], on_worker: bool) -> Optional[Slot]:
        """The optimizer created (or added) states: their layout is learnt, and a buffer of the new
        size holds them."""
        nvme_states, pipeline = self._nvme()
        widened = [slot.widened(position) for position in range(len(slot.masters))]
        if states is not None:  # the optimizer added states: own the loaded ones, then a larger buffer
            nvme_states.own(s.unit.index)
            (pipeline.pool if on_worker else self.ctx.memory.staging_pool).release(states)
            states = None
        if nvme_states.learn(slot.inner, s.unit.index, slot.masters, widened):
            size = nvme_states.sizes[s.unit.index]
            states = pipeline.buffer(size) if on_worker else self._state_buffer(s, size)
        return states

    def _state_buffer(self, s: UnitState, nbytes: int) -> Slot:
        slot = self.cache.staging(nbytes, wait=True, keep=s)
        if slot is None:
            raise RuntimeError(
                f"unit {s.unit.name!r} has {nbytes} bytes of optimizer state, more than an NVMe staging buffer holds "
                f"({max(self.ctx.placement.staging_slots)} bytes): this optimizer keeps more state per parameter than planned for. "
                f"Raise host_memory so that fewer units live on NVMe."
            )
        return slot


def _step_masters(
    unit_optimizers: UnitOptimizers, slot: UnitSlot, grads: list, copies: list[torch.Tensor], before: Optional[Callable[[], None]] = None,
    written: frozenset[int] = frozenset(), chunk_bytes: int = 0,
) -> None:
    """One unit's inner step on its masters; ``copies`` are the tensors forward computes with (the
    masters themselves, or the 16-bit copies of fp32 masters, refreshed after); ``before``: called
    with the masters current, right before the step. ``written``: ids of parameters user code wrote
    in place inside the step; an fp32 master takes a written copy's values where they changed it.
    ``chunk_bytes``: larger masters are stepped a chunk at a time (an update in host memory)."""
    for position, master in enumerate(slot.masters):
        if id(master) in unit_optimizers.stale or (id(slot.params[position]) in written and _changed(copies[position], master)):
            master.copy_(copies[position])
            unit_optimizers.stale.discard(id(master))
    if before is not None:
        before()
    with grads_on(slot.masters, grads):
        unit_optimizers.step(slot.unit_index, chunk_bytes)
    for position, master in enumerate(slot.masters):
        if slot.widened(position) and grads[position] is not None:
            copies[position].copy_(master)


def _changed(copy: torch.Tensor, master: torch.Tensor) -> bool:
    """A 16-bit copy no longer holds its fp32 master's value (a write that changed nothing leaves
    the master its precision)."""
    return copy.dtype != master.dtype and not torch.equal(copy, master.to(copy.dtype))


def _state_bytes(slot: UnitSlot) -> int:
    return sum(t.numel() * t.element_size() for m in slot.masters for t in slot.inner.state.get(m, {}).values() if torch.is_tensor(t))
