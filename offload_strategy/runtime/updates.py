"""How the engine updates units: gradients reaching their host buffers, the user's optimizer
applied per unit where each unit lives, on a worker during backward or after it.

``UnitUpdates`` is the update half of :class:`~offload_strategy.runtime.engine.TieredEngine`: it
works on the engine's unit states, pools, NVMe store and worker, and owns no state of its own.
Gradients of offloaded units reach their host buffers as autograd produces them — copied from the
GPU tier, or accumulated there directly (GO-MemFerry §IV-D). Each unit is updated as soon as its
gradients are complete while backward goes on (LoHan §IV-C, active gradient offloading), or after
backward when something needs every gradient first (clipping by norm, fp16 loss scaling).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch

from ..memory import Slot
from ..planning.placement import GPU, HOST, HOST_SLOT_ALIGNMENT, NVME, align
from .optimizer import LOOSE, UnitOptimizers, grads_on
from .state import UnitState
from .units import PARAM_ALIGNMENT, master_dtype


class GradientView:
    """Parameters with their gradients attached, shaped like an optimizer for torch's GradScaler
    and clipping utilities; ``step()`` runs the engine's update."""

    def __init__(self, params: list[torch.Tensor], step: Any) -> None:
        self.param_groups = [{"params": params}]
        self._step = step

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._step()


class UnitUpdates:
    """Mixed into the engine: see the module docstring."""

    def _on_grad(self, p: torch.Tensor) -> None:
        s, i = self._param_slot[id(p)]
        grad, home = p.grad, s.grad_views[i]
        if grad is None or home is None:
            return
        if s.unit.index in self.direct_gradients and grad.data_ptr() == home.data_ptr():
            s.grad_fresh[i] = True  # already accumulated in place, at home
        elif home.dtype != grad.dtype:  # an fp32 master's gradient: moved in 16 bits, widened (and accumulated) in fp32
            self._wait_grad(s, i)
            s.grad_events[i] = self.device.copy_to_host(s.grad_landing[i], grad)
            s.grad_pending[i] = "add" if s.grad_fresh[i] else "copy"
            s.grad_fresh[i] = True
        elif s.grad_fresh[i]:
            self._wait_grad(s, i)
            home.add_(grad.to(home.device))
        else:
            s.grad_events[i] = self.device.copy_to_host(home, grad)
            s.grad_fresh[i] = True
        if grad.data_ptr() != home.data_ptr():
            p.grad = None
        s.grads_arrived += 1
        if s.grads_arrived < len(s.unit.trainable):
            return
        s.recompute_pinned = False
        if self._reduce_mode is not None:  # reduced across ranks first; the update follows it
            self._unit_gradients_complete(s)
        elif self._update_in_backward and s.home != GPU:
            self._submit_update(s)

    def _on_persistent_grad(self, p: torch.Tensor) -> None:
        """A persistent parameter's gradient: a 16-bit one widened and accumulated in fp32 in the
        GPU tier; under data parallelism, counted towards its unit's reduction."""
        if p.grad is None:
            return
        s, i = self._param_slot[id(p)]
        if s.master_dtypes[i] != p.dtype:
            total = self._persistent_grads.get(id(p))
            if total is None:
                self._persistent_grads[id(p)] = p.grad.to(torch.float32)
            else:
                total.add_(p.grad)
            p.grad = None
        if self._reduce_mode is not None:
            s.grads_arrived += 1
            if s.grads_arrived == len(s.unit.trainable):
                self._unit_gradients_complete(s)

    def _submit_update(self, s: UnitState) -> None:
        """LoHan §IV-C: update the unit on the worker now, while backward goes on with the others."""
        (unit_optimizers,) = self.unit_optimizers.values()
        if s.unit.index not in unit_optimizers.slots:
            return
        s.updated = True
        if s.home == NVME:
            self._start_reads(s)

        def update() -> None:
            start = time.perf_counter()
            self._update_offloaded(unit_optimizers, s, on_worker=True)
            self.update_log.append((s.unit.index, start, time.perf_counter()))

        self.worker.submit(update)

    # -- the NVMe update pipeline (LoHan Fig. 3b): read unit i+1, update unit i, write unit i-1 --------

    def _start_reads(self, s: UnitState) -> None:
        """Training thread, as the unit's gradients complete: read its parameters and states from
        NVMe now, while the worker is busy with the units before it. One unit ahead, with buffers
        that are free; a worker that runs short takes them back (``_update_buffer``)."""
        if self._reads_ahead:
            return
        size = self.update_pool.classes[0].slot_bytes
        known = self.nvme_states.known(s.unit.index)
        # under the lock, so that the worker never sees these buffers taken but not yet listed
        with self._pipeline_lock:
            if self.update_pool.free_slots(size) < (2 if known else 1):
                return
            params = self.update_pool.try_acquire(s.unit.nbytes)
            states = self.update_pool.try_acquire(self.nvme_states.sizes[s.unit.index]) if known and params is not None else None
            if params is None or (known and states is None):
                for got in (params, states):
                    if got is not None:
                        self.update_pool.release(got)
                return
            reads = [self.store.read(self._key(s), params.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)])]
            if states is not None:
                reads.append(self.nvme_states.read(s.unit.index, states.tensor))
            self._reads_ahead[s.unit.index] = (params, states, reads)

    def _update_buffer(self, nbytes: int) -> Slot:
        """Worker thread: a free update buffer, waiting for the oldest write behind if there is none,
        else taking back the buffers of a read ahead (that unit will then read for itself)."""
        while True:
            with self._pipeline_lock:
                slot = self.update_pool.try_acquire(nbytes)
                if slot is not None:
                    return slot
                taken = None
                if not self._writes_behind:
                    if not self._reads_ahead:
                        return self.update_pool.acquire(nbytes)  # raises with the numbers
                    _, taken = self._reads_ahead.popitem()
            if taken is None:
                self._reap_writes(block=True, one=True)
                continue
            params, states, reads = taken
            for r in reads:
                r.exception()
            # released and taken in one hold, so that a new read ahead cannot take them in between
            with self._pipeline_lock:
                self.update_pool.release(params)
                if states is not None:
                    self.update_pool.release(states)
                slot = self.update_pool.try_acquire(nbytes)
                if slot is not None:
                    return slot

    def _reap_writes(self, block: bool, one: bool = False) -> None:
        """Release the buffers of finished writes (waiting for them with ``block``). Only the
        worker, or the training thread once the worker is idle, calls this."""
        while self._writes_behind:
            writes, buffers = self._writes_behind[0]
            if not block and not all(w.done() for w in writes):
                return
            self._writes_behind.popleft()
            for w in writes:
                w.result()  # a failed write (a full disk) fails the update
            for buffer in buffers:
                self.update_pool.release(buffer)
            if one:
                return

    def _finish_pipeline(self) -> None:
        """Training thread, worker idle: every write done, every unused read released."""
        try:
            self._reap_writes(block=True)
        finally:
            for params, states, reads in self._reads_ahead.values():
                for r in reads:
                    r.exception()
                self.update_pool.release(params)
                if states is not None:
                    self.update_pool.release(states)
            self._reads_ahead.clear()

    def _wait_grad(self, s: UnitState, i: int) -> None:
        event = s.grad_events[i]
        if event is not None:
            event.wait()
            s.grad_events[i] = None
        if s.grad_pending[i] is not None:
            if s.grad_pending[i] == "add":
                s.grad_views[i].add_(s.grad_landing[i])
            else:
                s.grad_views[i].copy_(s.grad_landing[i])
            s.grad_pending[i] = None

    @torch.no_grad()
    def attach_direct_gradients(self) -> None:
        """Right before backward — after Lightning's ``zero_grad`` — make each direct unit's host
        buffer its parameter's ``.grad``, so autograd accumulates into it in place (GO-MemFerry);
        zeroed when a new accumulation starts."""
        for index in self.direct_gradients:
            s = self.states[index]
            for i, p in enumerate(s.unit.params):
                home = s.grad_views[i]
                if home is None:
                    continue
                if not s.grad_fresh[i]:
                    home.zero_()
                p.grad = home

    def _unit_optimizers(self, facade: torch.optim.Optimizer) -> UnitOptimizers:
        """Per-unit optimizers of ``facade``, over master tensors at each unit's home."""
        units = []
        for s in self.states:
            trainable = [(i, p) for i, p in enumerate(s.unit.params) if p.requires_grad]
            if not trainable or not self._keeps_states(s):
                continue
            units.append((s.unit.index, [p for _, p in trainable], [self._master_for(s, i, p) for i, p in trainable]))
        unit_optimizers = UnitOptimizers(facade, units, managed=set(self._param_slot))
        for index, slot in unit_optimizers.slots.items():
            if self.states[index].home == NVME:  # the master's first value is on NVMe with the parameter
                unit_optimizers.stale.update(id(m) for position, m in enumerate(slot.masters) if slot.widened(position))
        unit_optimizers.on_zero_grad = self._forget_gradients
        if self.nvme_states is not None:
            unit_optimizers._materialize = self._states_materialized
            unit_optimizers.after_load = lambda: self._adopt_states(unit_optimizers)
            unit_optimizers.set_master = self._set_master
            unit_optimizers.lend_states = self._lend_states
        return unit_optimizers

    def _keeps_states(self, s: UnitState) -> bool:
        """Whether this process updates the unit (under sharded states: another rank may own it)."""
        return self.data_parallel is None or self.data_parallel.owns(s.unit.index)

    def _master_for(self, s: UnitState, i: int, p: torch.Tensor) -> torch.Tensor:
        """What the inner optimizer updates for parameter ``i`` of ``s``."""
        if s.home == GPU:  # fp32 masters of a persistent unit stay in the GPU tier with its states
            return p if s.master_dtypes[i] == p.dtype else p.detach().to(s.master_dtypes[i], copy=True)
        if s.home == HOST:
            if s.master_dtypes[i] == p.dtype:
                return s.home_views[i].view(p.shape)
            s.master_views[i].copy_(s.home_views[i])
            return s.master_views[i]
        # NVMe: bound to the unit's host copy (or its stored master) for each update, to a placeholder between
        idle = torch.full((1,), float("nan"), dtype=s.master_dtypes[i]).expand(p.shape)
        master = idle.view(idle.shape)
        self._idle_masters[id(master)] = idle
        return master

    # -- a trainable set that changes during training (unfreezing, add_param_group) ----------------

    @torch.no_grad()
    def sync_trainable(self) -> None:
        """Parameters unfrozen since set-up get a gradient home and a gradient hook, and every
        optimizer's newly added or unfrozen parameters join their unit's inner optimizer; a
        gradient autograd already left in ``.grad`` (unfrozen inside a training step, before
        the hook existed) moves home."""
        for s in self.states:
            for i, p in enumerate(s.unit.params):
                if p.requires_grad and id(p) not in self._grad_hooked:
                    self._start_gradients(s, i, p)
        for unit_optimizers in self.unit_optimizers.values():
            for p in unit_optimizers.missing():
                s, i = self._param_slot[id(p)]
                if self._keeps_states(s):
                    unit_optimizers.add(s.unit.index, p, self._master_for(s, i, p))
                    self._state_bytes.pop(s.unit.index, None)
            unit_optimizers.adopt_loose()

    def _start_gradients(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        if master_dtype(p, self.fp32_masters) != s.master_dtypes[i]:
            raise RuntimeError(
                f"parameter {s.unit.param_names[i]!r} became trainable during training, but under this precision it needs an "
                f"fp32 master that set-up did not plan for a frozen parameter. Unfreeze it before fit, or use a '*-mixed' "
                f"precision (parameters stay fp32)."
            )
        if s.home == GPU:
            if s.master_dtypes[i] != p.dtype or self.data_parallel is not None:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_persistent_grad))
            self._grad_hooked.add(id(p))
            return
        if s.grad_views[i] is None:  # frozen at set-up: its gradient home is made now, outside the slab
            s.grad_views[i] = torch.zeros(p.shape, dtype=s.master_dtypes[i])
            if s.home == NVME:  # room for the optimizer states the placement did not plan for a frozen parameter
                nbytes = s.grad_views[i].numel() * s.grad_views[i].element_size()
                self.store.capacity += align(int(nbytes * self.state_factor) + len(s.unit.params) * PARAM_ALIGNMENT, HOST_SLOT_ALIGNMENT)
        self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._grad_hooked.add(id(p))
        if p.grad is not None:
            self._wait_grad(s, i)
            if s.grad_fresh[i]:
                s.grad_views[i].add_(p.grad.to(s.grad_views[i].device))
            else:
                s.grad_views[i].copy_(p.grad)
            s.grad_fresh[i] = True
            p.grad = None

    def _forget_gradients(self, unit_optimizers: UnitOptimizers) -> None:
        """The facade's ``zero_grad`` (or its step's end): its parameters' gradients start afresh;
        other optimizers' gradients stay, as in plain training."""
        for p in unit_optimizers.order:
            self._persistent_grads.pop(id(p), None)
            found = self._param_slot.get(id(p))
            if found is None or found[0].home == GPU:
                continue
            s, i = found
            self._wait_grad(s, i)
            s.grad_fresh[i] = False

    def _set_master(self, master: torch.Tensor, value: torch.Tensor) -> None:
        if id(master) in self._idle_masters:  # an NVMe unit's: held until ``_adopt_states`` offloads it
            master.data = value.clone()
        else:
            master.copy_(value)

    def _adopt_states(self, unit_optimizers: UnitOptimizers) -> None:
        """States just loaded from a checkpoint: those of NVMe units go to NVMe, with their masters."""
        for index, slot in unit_optimizers.slots.items():
            if self.states[index].home == NVME:
                widened = [slot.widened(position) for position in range(len(slot.masters))]
                self.nvme_states.adopt(slot.inner, index, slot.masters, widened)
                for master in slot.masters:
                    master.data = self._idle_masters[id(master)]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, closure_result: Any = None, **kwargs: Any) -> None:
        """Update every unit where it lives with the user's optimizer, one unit at a time
        (``kwargs``: what the user passed to ``optimizer.step``, given to every unit's step)."""
        recording = self.table.recording
        if recording:
            self.table.freeze()
            self.profile.order = list(self.table.order)
        self._take_back()  # read by a callback since backward (on_before_optimizer_step): written values count
        self._active = False
        self._update_in_backward = False
        started = time.perf_counter()
        try:
            self._reduce_late_units()
            self.worker.drain()  # the updates started during backward
        finally:
            self._finish_pipeline()
        self.evict_all()  # parameters are about to change: copies in the GPU tier go stale
        for s in self.states:
            if s.updated and s.host_copy is not None:  # updated on the worker: the kept copy is stale
                self.staging_pool.release(s.host_copy)
                s.host_copy = None
        unit_optimizers = self._ensure_unit_optimizers(optimizer)
        unit_optimizers.step_kwargs = kwargs
        for s in self.states:
            if s.unit.index not in unit_optimizers.slots or s.updated:
                continue
            start = time.perf_counter()
            if s.home == GPU:
                self._update_persistent(unit_optimizers, s)
            else:
                self._update_offloaded(unit_optimizers, s)
            self.update_log.append((s.unit.index, start, time.perf_counter()))
        self._update_loose(unit_optimizers)
        self._share_updated_parameters()
        unit_optimizers.count_step(closure_result)
        self._finish_timing(recording)
        self.step_stats["exposed_seconds"] += time.perf_counter() - started
        self.step_stats["update_seconds"] += sum(end - start for _, start, end in self.update_log)
        self.step_stats["steps"] += 1

    def _finish_timing(self, profiled: bool) -> None:
        """Keep this step's compute and update times; the profiled step's are its profile's."""
        timing, self.timing = self.timing, None
        if timing is None:
            return
        for index, start, end in self.update_log:
            timing.update_seconds[index] = timing.update_seconds.get(index, 0.0) + end - start
        self.last_timing = timing
        if profiled:
            self.profile.forward_seconds = dict(timing.forward_seconds)
            self.profile.backward_seconds = dict(timing.backward_seconds)
            self.profile.update_seconds = dict(timing.update_seconds)
            self.profile.outside_forward_seconds = timing.outside_forward_seconds
            self.profile.outside_backward_seconds = timing.outside_backward_seconds

    def end_eval_step(self) -> None:
        """An evaluation step ended: as after a training step, every parameter points at its home,
        so that what callbacks read and write between steps (an EMA swapping weights in and out
        around validation) is the parameters' true value, not a GPU-tier copy."""
        self._active = False
        self.evict_all()

    def end_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """After ``optimizer``'s step, taken or skipped (an fp16 overflow): its gradients start
        afresh (every gradient without ``optimizer``); another optimizer's wait for its own step."""
        self._active = False
        self._update_in_backward = False
        try:
            self.worker.drain()
        finally:
            self._finish_pipeline()
            self._finish_reductions()
        for s in self.states:
            s.used_in_backward = False
            s.updated = False
            s.recompute_pinned = False
        if optimizer is not None:
            self._forget_gradients(self._ensure_unit_optimizers(optimizer))
            return
        self._persistent_grads.clear()
        for s in self.states:
            for i in range(len(s.grad_fresh)):
                self._wait_grad(s, i)
                s.grad_fresh[i] = False

    @contextlib.contextmanager
    def gradient_view(self, optimizer: torch.optim.Optimizer, closure_result: Any = None, **kwargs: Any) -> Iterator["GradientView"]:
        """Every gradient of ``optimizer``'s parameters, attached to tensors in the facade's order,
        for what needs them all at once: loss-scale unscaling and overflow checks, clipping by norm.
        Its ``step()`` runs the engine's update (so a GradScaler can skip it)."""
        unit_optimizers = self._ensure_unit_optimizers(optimizer)
        self._reduce_late_units()
        holders, attached = [], []
        for p in unit_optimizers.order:
            found = unit_optimizers.slot_of.get(id(p))
            if found is None:
                if self.data_parallel is not None and id(p) in self._param_slot:
                    # another rank's unit under sharded states: its reduced gradient still counts
                    # towards the norm and the overflow check, on a stand-in of its shape
                    stand_in = self._gradient_stand_in(p)
                    if stand_in is not None:
                        holders.append(stand_in)
                continue
            slot, position = found
            if slot.unit_index == LOOSE:
                holders.append(p)
                continue
            s = self.states[slot.unit_index]
            self._wait_reduction(s)
            if s.home == GPU:
                if id(p) in self._persistent_grads:  # a 16-bit parameter's fp32 gradient, on its master
                    master = slot.masters[position]
                    master.grad = self._persistent_grads[id(p)]
                    holders.append(master)
                    attached.append(master)
                else:
                    holders.append(p)
                continue
            i = self._param_slot[id(p)][1]
            self._wait_grad(s, i)
            master = slot.masters[position]
            master.grad = s.grad_views[i] if s.grad_fresh[i] else None
            holders.append(master)
            attached.append(master)
            if master.grad is not None and p.grad is None and (p.device, p.dtype) == (master.grad.device, master.grad.dtype):
                p.grad = master.grad  # hooks before the step read ``p.grad`` as in plain training
                attached.append(p)
        try:
            yield GradientView(holders, lambda: self.step(optimizer, closure_result, **kwargs))
        finally:
            for tensor in attached:
                tensor.grad = None

    def _gradient_stand_in(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        s, i = self._param_slot[id(p)]
        self._wait_reduction(s)
        if s.home == GPU:
            grad = self._persistent_grads.get(id(p), p.grad)
        else:
            self._wait_grad(s, i)
            grad = s.grad_views[i] if s.grad_fresh[i] else None
        if grad is None:
            return None
        stand_in = torch.empty((1,), dtype=grad.dtype, device=grad.device).expand(grad.shape)
        stand_in.grad = grad
        return stand_in

    def _ensure_unit_optimizers(self, optimizer: torch.optim.Optimizer) -> UnitOptimizers:
        if id(optimizer) not in self.unit_optimizers:
            self.unit_optimizers[id(optimizer)] = self._unit_optimizers(optimizer)
        self.sync_trainable()
        return self.unit_optimizers[id(optimizer)]

    def _update_loose(self, unit_optimizers: UnitOptimizers) -> None:
        """Tensors the optimizer holds that the model does not register: updated where they are."""
        loose = unit_optimizers.loose
        if loose is None:
            return
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(loose.params, self.clip_value)
        unit_optimizers.step(LOOSE)

    def _update_persistent(self, unit_optimizers: UnitOptimizers, s: UnitState) -> None:
        """Update a unit whose parameters, states and masters stay in the GPU tier."""
        slot = unit_optimizers.slots[s.unit.index]
        self._wait_reduction(s)
        if not s.widened:
            if self.clip_value is not None:
                torch.nn.utils.clip_grad_value_(slot.params, self.clip_value)
            unit_optimizers.step(s.unit.index)
            return
        grads = [self._persistent_grads.get(id(p)) if slot.widened(k) else p.grad for k, p in enumerate(slot.params)]
        if self.clip_value is not None:
            for g in grads:
                if g is not None:
                    g.clamp_(-self.clip_value, self.clip_value)
        self._update_masters(unit_optimizers, slot, grads, [p.data for p in slot.params])

    @staticmethod
    def _update_masters(unit_optimizers: UnitOptimizers, slot: Any, grads: list, copies: list[torch.Tensor]) -> None:
        """One unit's update on its masters; ``copies`` are the tensors forward computes with (the
        masters themselves, or the low-precision copies of fp32 masters, refreshed after)."""
        for position, master in enumerate(slot.masters):
            if id(master) in unit_optimizers.stale:
                master.copy_(copies[position])
                unit_optimizers.stale.discard(id(master))
        with grads_on(slot.masters, grads):
            unit_optimizers.step(slot.unit_index)
        for position, master in enumerate(slot.masters):
            if slot.widened(position) and grads[position] is not None:
                copies[position].copy_(master)

    def _update_offloaded(self, unit_optimizers: UnitOptimizers, s: UnitState, on_worker: bool = False) -> None:
        """Update one offloaded unit at home: stage it, step it, write it back. On the worker
        (during backward) an NVMe unit goes through the worker's own two staging buffers, so the
        fetch path is never touched."""
        slot = unit_optimizers.slots[s.unit.index]
        positions = [self._param_slot[id(p)][1] for p in slot.params]
        grads = self._gradients_for_update(s, positions)
        staged = None
        if on_worker:
            with self._pipeline_lock:
                staged = self._reads_ahead.pop(s.unit.index, None)
        if s.home == NVME:
            known = self.nvme_states.known(s.unit.index)
            params, states, copies = self._stage_nvme(s, slot, positions, staged, known, on_worker)
        else:
            copies = [s.home_views[i] for i in positions]
        self._update_masters(unit_optimizers, slot, grads, copies)
        for i in positions:
            s.grad_fresh[i] = False
        if s.home == NVME:
            self._write_back_nvme(s, slot, params, states, known, on_worker)
        elif s.unit.index not in self._state_bytes:
            self._state_bytes[s.unit.index] = sum(
                t.numel() * t.element_size() for m in slot.masters for t in slot.inner.state.get(m, {}).values() if torch.is_tensor(t)
            )

    def _gradients_for_update(self, s: UnitState, positions: list[int]) -> list[Optional[torch.Tensor]]:
        """The unit's gradients once complete (reduced, landed), clipped by value where asked."""
        self._wait_reduction(s)
        for i in positions:
            self._wait_grad(s, i)
        grads = [s.grad_views[i] if s.grad_fresh[i] else None for i in positions]
        if self.clip_value is not None:  # clipping by value is per element: per unit is exact
            for g in grads:
                if g is not None:
                    g.clamp_(-self.clip_value, self.clip_value)
        return grads

    def _stage_nvme(
        self, s: UnitState, slot: Any, positions: list[int], staged: Any, known: bool, on_worker: bool,
    ) -> tuple[Slot, Optional[Slot], list[torch.Tensor]]:
        """An NVMe unit's parameters (and its states, once stored) in host buffers, its masters
        bound to them: (parameter buffer, state buffer or None, the parameters' views)."""
        states: Optional[Slot] = None
        if on_worker:
            if self._writes_behind and not all(w.done() for w in self._writes_behind[-1][0]):
                self.pipeline["writes_behind"] += 1  # the last unit is still being written
            self._reap_writes(block=False)
        if staged is not None:
            params, states, reads = staged
            for r in reads:
                r.result()
            self.pipeline["reads_ahead"] += 1
        elif on_worker:
            params = self._update_buffer(s.unit.nbytes)
            self.store.read(self._key(s), params.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
        else:
            params = self._host_copy(s)
        views = s.unit.views(params.tensor)
        copies = [views[i] for i in positions]
        for position, (master, copy) in enumerate(zip(slot.masters, copies)):
            # an fp32 master is read with the states; before it was ever stored, it starts from the copy
            master.data = torch.empty(copy.shape, dtype=master.dtype) if slot.widened(position) else copy
        if known and states is not None:  # read ahead with the parameters
            self.nvme_states.load(s.unit.index, states.tensor, read=False)
        elif known:
            size = self.nvme_states.sizes[s.unit.index]
            states = self._update_buffer(size) if on_worker else self._state_buffer(s, size)
            self.nvme_states.load(s.unit.index, states.tensor)
        return params, states, copies

    def _write_back_nvme(self, s: UnitState, slot: Any, params: Slot, states: Optional[Slot], known: bool, on_worker: bool) -> None:
        """The updated parameters and states of an NVMe unit go home: behind the next unit's
        update on the worker, at once otherwise; the masters point at their placeholders again."""
        widened = [slot.widened(position) for position in range(len(slot.masters))]
        if not known or not self.nvme_states.matches(slot.inner, s.unit.index, slot.masters):
            if states is not None:  # the optimizer added states: own the loaded ones, then a larger buffer
                for master, wide in zip(slot.masters, widened):
                    if wide:
                        master.data = master.data.clone()
                self._own_states(slot.inner, slot.masters)
                (self.update_pool if on_worker else self.staging_pool).release(states)
                states = None
            if self.nvme_states.learn(slot.inner, s.unit.index, slot.masters, widened):
                size = self.nvme_states.sizes[s.unit.index]
                states = self._update_buffer(size) if on_worker else self._state_buffer(s, size)
        writes = []
        if states is not None:
            writes.append(self.nvme_states.save(s.unit.index, states.tensor, wait=not on_worker))
        writes.append(self.store.write(self._key(s), params.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]))
        for master in slot.masters:
            master.data = self._idle_masters[id(master)]
        if on_worker:  # written behind: the next unit's update does not wait for it
            self._writes_behind.append((writes, [params] + ([states] if states is not None else [])))
            return
        for w in writes:
            w.result()
        if states is not None:
            self.staging_pool.release(states)

    @staticmethod
    def _own_states(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
        for m in masters:
            for key, value in optimizer.state.get(m, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    optimizer.state[m][key] = value.clone()

    def _state_buffer(self, s: UnitState, nbytes: int) -> Slot:
        slot = self._staging(nbytes, wait=True, keep=s)
        if slot is None:
            raise RuntimeError(
                f"unit {s.unit.name!r} has {nbytes} bytes of optimizer state, more than an NVMe staging buffer holds "
                f"({max(self.placement.staging_slots)} bytes): this optimizer keeps more state per parameter than planned for. "
                f"Raise host_memory so that fewer units live on NVMe."
            )
        return slot

    def _host_copy(self, s: UnitState) -> Slot:
        """The NVMe unit's kept host copy, read from NVMe first if there is none."""
        if s.host_copy is None:
            staging = self._staging(s.unit.nbytes, wait=True)
            if staging is None:
                raise RuntimeError(f"no NVMe staging buffer is free for unit {s.unit.name!r}; raise host_memory.")
            self.store.read(self._key(s), staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
            s.host_copy = staging
        return s.host_copy
