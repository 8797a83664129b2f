"""The gradient path: gradients of offloaded units reach their homes in host memory as autograd
produces them — copied from the GPU tier, or accumulated there directly (GO-MemFerry §IV-D) — and
16-bit gradients of persistent units accumulate in fp32 beside them. It says when a unit's
gradients are complete; what happens then (a reduction, an update) is the engine's to decide.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from ...hardware.device import Device, Event
from ...memory.dha import can_view, device_view
from ...planning.placement import GPU, HOST_SLOT_ALIGNMENT, NVME, align
from ..context import EngineContext
from .clipping import tensor_norms
from .buffers import GradientBuffers, gradient_bytes
from ..updates.optimizers import LOOSE, UnitOptimizers
from ..state import Landing, UnitState, one_element
from ..units import PARAM_ALIGNMENT, master_dtype
from ..updates.worker import Pending, UpdateWorker
from .staging import AccumulationStaging


def clip_by_value(grads: Iterable[Optional[torch.Tensor]], clip_value: Optional[float]) -> None:
    """Clipping by value, element by element (as ``torch.nn.utils.clip_grad_value_``): exact when
    applied unit by unit."""
    if clip_value is None:
        return
    for g in grads:
        if g is not None:
            g.clamp_(min=-clip_value, max=clip_value)


@dataclass(eq=False)
class GradientRecord:
    """One parameter's gradient at an offloaded unit's home, in its master's dtype."""

    home: Optional[torch.Tensor] = None  # None while the parameter is frozen
    # fp32 masters: where the 16-bit gradient lands (pinned, the copy is async) before widening
    landing: Optional[torch.Tensor] = None
    fresh: bool = False  # ``home`` holds this accumulation's gradient
    event: Optional[Event] = None  # the copy from the GPU tier into ``home`` in flight
    # the update worker's task completing ``home``: what landed apart (a later micro-batch's
    # gradient, a 16-bit one) added or widened into it once its copy has landed
    settling: Optional[Pending] = None
    # this accumulation's gradient waits on NVMe for its update (runtime/grads/path.py, ``spill``), and its
    # norm, taken on the way for clipping by norm
    spilled: bool = False
    norm: Optional[torch.Tensor] = None

    def wait(self) -> None:
        """``home`` holds this accumulation's gradient: its copies have landed, and the worker has
        added or widened into it what landed apart."""
        if self.settling is not None:
            self.settling.wait()
            self.settling = None
        if self.event is not None:
            self.event.wait()
            self.event = None

    def value(self) -> Optional[torch.Tensor]:
        """This accumulation's gradient once landed; None if there is none."""
        self.wait()
        return self.home if self.fresh else None

    def bind(self, home: Optional[torch.Tensor], landing: Optional[torch.Tensor]) -> None:
        """The record points at a buffer's place for its gradient (and 16-bit landing), empty."""
        self.wait()
        self.home, self.landing = home, landing
        self.fresh = False

    def unbind(self) -> None:
        """The buffer it pointed into goes back: no gradient, nowhere to hold one."""
        self.wait()
        self.home, self.landing, self.fresh = None, None, False

    def forget(self) -> None:
        """A new accumulation starts: this one's gradient (in memory or on NVMe) is gone."""
        self.wait()
        self.fresh, self.spilled, self.norm = False, False, None


def _settle(device: Device, earlier: Optional[Event], copied: Event, home: torch.Tensor, landed: torch.Tensor, how: Landing) -> None:
    """On the update worker: ``landed`` (a gradient copied out of the GPU tier apart from its
    home) added into ``home``, or widened into it, once the copies into both have landed."""
    if earlier is not None:
        earlier.wait()
    copied.wait()
    device.check_host_access(home, "adds or widens a gradient at home")
    if how is Landing.ADD:
        home.add_(landed)
    else:
        home.copy_(landed)


def bind_gradients(s: UnitState, buffer: torch.Tensor) -> None:
    """The unit's gradient records point into ``buffer`` (trainable parameters only), empty."""
    size = align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT)
    homes = s.unit.typed_views(buffer[:size], s.master_dtypes)
    landings = s.unit.views(buffer[size : size + align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]) if s.widened else [None] * len(homes)
    for record, home, landing, dtype, p in zip(s.grads, homes, landings, s.master_dtypes, s.unit.params):
        record.bind(home if p.requires_grad else None, landing if landing is not None and dtype != p.dtype else None)


class GradientPath:
    """Owns each offloaded unit's gradient records (``UnitState.grads``) and counts their arrivals
    (``UnitState.grads_arrived``): no other module changes them."""

    def __init__(
        self, ctx: EngineContext, direct_gradients: frozenset[int], data_parallel: bool, state_factor: float, buffers: GradientBuffers,
        worker: UpdateWorker,
    ) -> None:
        self.ctx = ctx
        self.worker = worker  # adds and widens what lands apart from a home (``_settle``)
        # offloaded units whose gradients autograd writes straight into their host buffers; a
        # gradient bound for an fp32 master is not the parameter's dtype, so it is copied; one
        # that takes a buffer only when its first gradient arrives has none to write into before
        self.direct = frozenset(
            i for i in direct_gradients if ctx.states[i].home != GPU and not ctx.states[i].widened and not ctx.states[i].transient_gradients
        )
        self.buffers = buffers
        self.counts_persistent = data_parallel  # every persistent gradient is counted for its reduction
        self.state_factor = state_factor  # optimizer-state bytes per master byte, for states the placement did not plan
        self.persistent: dict[int, torch.Tensor] = {}  # id(param) -> fp32 gradient of a 16-bit persistent parameter
        # unit index -> the gradient home of a unit wholly frozen at set-up, from the pinned overflow (``_late_home``)
        self.late_homes: dict[int, torch.Tensor] = {}
        for s in ctx.states:
            if s.home != GPU:
                s.grads = [GradientRecord() for _ in s.unit.params]
                home = ctx.memory.gradient_homes.get(s.unit.index)
                if home is not None:
                    bind_gradients(s, home)
        largest = max((p.numel() * d.itemsize for s in ctx.states if s.home != GPU for p, d in zip(s.unit.params, s.master_dtypes)), default=0)
        self.staging = AccumulationStaging(largest, pin=ctx.device.compute.type == "cuda", numa_node=ctx.device.numa_node)
        self.staging.worker_failed = lambda: worker.failed

    def new_backward(self) -> None:
        """A step starts: no unit's gradients have arrived in its backward yet."""
        for s in self.ctx.states:
            s.grads_arrived = 0

    def needs_persistent_hook(self, s: UnitState, i: int) -> bool:
        """A persistent parameter whose gradients the path receives: a 16-bit one (accumulated in
        fp32), or any under data parallelism (counted for its reduction)."""
        return s.master_dtypes[i] != s.unit.params[i].dtype or self.counts_persistent

    def receive(self, p: torch.Tensor) -> Optional[UnitState]:
        """An offloaded parameter's gradient was accumulated: move it home. Returns the unit when
        this completes its gradients for the backward."""
        s, i = self.ctx.param_slot[id(p)]
        record = s.grads[i]
        if s.transient_gradients and p.grad is not None:
            self.take_buffer(s)
        grad, home = p.grad, record.home
        if grad is None or home is None:
            return None
        if s.unit.index in self.direct and grad.data_ptr() == home.data_ptr():
            record.fresh = True  # accumulated in place, at home
            record.event = self.ctx.device.compute_done()  # by a kernel the host must wait for before reading (emulated: done)
        elif home.dtype != grad.dtype:  # an fp32 master's gradient: moved in 16 bits, widened (and accumulated) in fp32
            self._land_widened(record, home, grad)
        elif record.fresh:  # a later micro-batch's: added at home on the worker
            self._land_apart(record, home, grad)
        else:
            record.event = self.ctx.device.copy_to_host(home, grad)
            record.fresh = True
        if grad.data_ptr() != home.data_ptr():
            p.grad = None
        s.grads_arrived += 1
        if s.grads_arrived < len(s.unit.trainable):
            return None
        return s

    def _land_widened(self, record: GradientRecord, home: torch.Tensor, grad: torch.Tensor) -> None:
        """A 16-bit gradient copied into its landing area, widened (or added) into ``home`` in
        fp32 on the worker once landed."""
        landing = record.landing
        assert landing is not None, "a parameter with an fp32 master has a landing area (runtime/grads/buffers.py)"
        record.wait()  # the landing area is read until the last micro-batch's widening: done long ago
        copied = self.ctx.device.copy_to_host(landing, grad)
        how = Landing.ADD if record.fresh else Landing.COPY
        device = self.ctx.device
        record.settling = self.worker.submit(lambda: _settle(device, None, copied, home, landing, how))
        record.fresh = True

    def _land_apart(self, record: GradientRecord, home: torch.Tensor, grad: torch.Tensor) -> None:
        """A later micro-batch's gradient copied into staging pieces, each added at home on the
        worker once landed (after the copy into ``home`` still in flight): autograd's thread only
        queues them, and waits only where every piece is in use."""
        device, staging = self.ctx.device, self.staging
        source, target = grad.detach().reshape(-1), home.view(-1)
        step = staging.elements_per_piece(home.dtype)
        earlier, record.event = record.event, None
        for start in range(0, target.numel(), step):
            n = min(step, target.numel() - start)
            piece = staging.acquire()
            landed = piece[: n * home.dtype.itemsize].view(home.dtype)
            copied = device.copy_to_host(landed, source[start : start + n])
            part = target[start : start + n]

            def add(earlier: Optional[Event] = earlier, copied: Event = copied, part: torch.Tensor = part,
                    landed: torch.Tensor = landed, piece: torch.Tensor = piece) -> None:
                try:
                    _settle(device, earlier, copied, part, landed, Landing.ADD)
                finally:
                    staging.release(piece)

            record.settling = self.worker.submit(add)  # in order: the last one done, every one is
            earlier = None  # the first waits for it, and the others run after the first

    def take_buffer(self, s: UnitState) -> None:
        """A buffer for a unit whose gradients pass through one, holding what it accumulated so far
        (gradients of earlier micro-batches waiting on NVMe are read back to be added to)."""
        self.buffers.wait_settled(s)  # not while its gradients are being written out
        if self.buffers.holds(s):
            return
        for sent in self.buffers.reclaimable():
            self.release_buffer(sent)
        bind_gradients(s, self.buffers.acquire(s))
        self._read_spilled(s)

    def release_buffer(self, s: UnitState) -> None:
        """The unit's gradients are consumed (updated, sent, or forgotten): its records let go of
        its buffer, which goes back."""
        self.buffers.stop_sending(s)  # the collective still reads the buffer until it ends
        for record in s.grads:
            record.unbind()
        self.buffers.release(s)

    def _read_spilled(self, s: UnitState) -> None:
        if not any(r.spilled for r in s.grads):
            return
        size, store = align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT), self.ctx.store
        assert store is not None, "gradients wait on NVMe only beside units living there (the store)"
        store.read(self.ctx.gradient_key(s), self.buffers.buffer_of(s)[:size]).result()
        for record in s.grads:
            if record.spilled:
                record.fresh, record.spilled, record.norm = True, False, None

    def spill(self, s: UnitState) -> None:
        """Worker: the unit's complete gradients leave their buffer for NVMe, where they wait for
        the next micro-batch or the update; their norms are taken on the way when clipping by norm
        follows (as ``clip_grad_norm_`` takes them, runtime/grads/clipping.py)."""
        fresh = [record.value() for record in s.grads]
        if self.ctx.step.norms_wanted:
            present = [g for g in fresh if g is not None]
            norms = iter(tensor_norms(present))
            for record, g in zip(s.grads, fresh):
                record.norm = next(norms) if g is not None else None
        size, store = align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT), self.ctx.store
        assert store is not None, "gradients wait on NVMe only beside units living there (the store)"
        store.write(self.ctx.gradient_key(s), self.buffers.buffer_of(s)[:size]).result()
        for record, g in zip(s.grads, fresh):
            record.spilled = g is not None
        self.release_buffer(s)

    def restore(self, s: UnitState) -> None:
        """Before its update: a unit's gradients waiting on NVMe back in a buffer, multiplied by
        clipping's coefficient where clipping by norm set one."""
        if not any(r.spilled for r in s.grads):
            return
        self.take_buffer(s)
        scale = self.ctx.step.gradient_scale
        if scale is not None:
            for record in s.grads:
                if record.fresh:
                    assert record.home is not None, "a fresh gradient is at its home"
                    record.home.mul_(scale.to(record.home.device))

    def norm_inputs(self, unit_optimizers: UnitOptimizers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For clipping by norm: each gradient's norm in the facade's order (the order a gradient
        view holds them), and the gradients in memory, to be multiplied in place; gradients
        waiting on NVMe are multiplied when read back for their update."""
        norms: list[Optional[torch.Tensor]] = []
        in_memory: list[torch.Tensor] = []
        for p in unit_optimizers.order:
            found = unit_optimizers.slot_of.get(id(p))
            if found is None:
                continue
            grad, norm = self.gradient_or_norm(found[0].unit_index, p)
            if grad is not None:
                in_memory.append(grad)
                norms.append(None)
            elif norm is not None:
                norms.append(norm)
        computed = iter(tensor_norms(in_memory))
        return [norm if norm is not None else next(computed) for norm in norms], in_memory

    def gradient_or_norm(self, unit_index: int, p: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``p``'s gradient where it is in memory, else its norm taken on its way to NVMe."""
        if unit_index == LOOSE:
            return p.grad, None
        s, i = self.ctx.param_slot[id(p)]
        if s.home == GPU:
            return self.persistent.get(id(p), p.grad), None
        record = s.grads[i]
        if record.spilled:
            if record.norm is None:
                raise RuntimeError(f"the gradient of {s.unit.param_names[i]!r} is on NVMe without its norm; clipping by norm cannot go on.")
            return None, record.norm
        return record.value(), None

    def receive_persistent(self, p: torch.Tensor) -> Optional[UnitState]:
        """A persistent parameter's gradient: a 16-bit one widened and accumulated in fp32 in the
        GPU tier. Returns the unit when, under data parallelism, this completes its gradients."""
        if p.grad is None:
            return None
        s, i = self.ctx.param_slot[id(p)]
        if s.master_dtypes[i] != p.dtype:
            total = self.persistent.get(id(p))
            if total is None:
                self.persistent[id(p)] = p.grad.to(torch.float32)
            else:
                total.add_(p.grad)
            p.grad = None
        if not self.counts_persistent:
            return None
        s.grads_arrived += 1
        return s if s.grads_arrived == len(s.unit.trainable) else None

    @torch.no_grad()
    def attach_direct(self) -> None:
        """Right before backward — after Lightning's ``zero_grad`` — make each direct unit's host
        buffer its parameter's ``.grad``, so autograd accumulates into it in place (GO-MemFerry);
        zeroed when a new accumulation starts."""
        compute = self.ctx.device.compute
        for index in self.direct:
            s = self.ctx.states[index]
            for record, p in zip(s.grads, s.unit.params):
                if record.home is None or not can_view(record.home, compute):
                    continue  # its gradients are copied home instead
                if not record.fresh:
                    record.home.zero_()
                # autograd adds on the GPU, so the gradient must be a GPU tensor: a view over the
                # pinned home whose writes cross the link (MemFerry's direct host access)
                p.grad = device_view(record.home, compute)

    def unit_gradients(self, s: UnitState) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The unit's gradients for this step, at the place where its update reads them, each with
        a tensor of its parameter's 16-bit dtype to reduce it in (None: reduced as it is). A
        16-bit parameter's gradient is reduced in 16 bits, as DDP reduces it, though accumulated
        in fp32 for its master: an offloaded one's in its landing area, a persistent one's in a
        copy made now."""
        if s.home == GPU:
            out: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
            for p in s.unit.trainable:
                widened = self.persistent.get(id(p))
                if widened is not None:
                    out.append((widened, torch.empty_like(widened, dtype=p.dtype)))
                elif p.grad is not None:
                    out.append((p.grad, None))
            return out
        pairs: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        for record, p in zip(s.grads, s.unit.params):
            if p.requires_grad and record.home is not None and record.fresh:
                record.wait()  # the copy from the GPU tier has landed (and been widened)
                pairs.append((record.home, record.landing))
        return pairs

    def held(self, s: UnitState, i: int, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Where the parameter's gradient so far is held apart from ``p.grad``: at an offloaded
        unit's home, or in fp32 beside a persistent 16-bit parameter (None: nowhere apart)."""
        if s.home == GPU:
            return self.persistent.get(id(p))
        record = s.grads[i]
        if record.home is None or not record.fresh or record.spilled:
            return None
        record.wait()
        return record.home

    def written_on_device(self, s: UnitState, i: int) -> None:
        """GPU kernels wrote an offloaded gradient at home through a view of it: its update waits for them."""
        s.grads[i].event = self.ctx.device.compute_done()

    def drop(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """The parameter's gradient is gone (set to None by user code): neither clipped nor stepped."""
        if s.home == GPU:
            self.persistent.pop(id(p), None)
        else:
            s.grads[i].fresh = False

    def for_update(self, s: UnitState, positions: list[int]) -> list[Optional[torch.Tensor]]:
        """An offloaded unit's gradients once complete (reduced, landed), clipped by value where asked."""
        s.wait_reductions()
        grads = [s.grads[i].value() for i in positions]
        clip_by_value(grads, self.ctx.step.clip_value)
        return grads

    def has_gradient(self, s: UnitState, i: int, p: torch.Tensor) -> bool:
        if s.home == GPU:
            return id(p) in self.persistent or p.grad is not None
        return s.grads[i].home is not None and s.grads[i].fresh

    def zero(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """A parameter unused on this rank but used on another: it contributes zeros."""
        if s.home == GPU:
            if s.master_dtypes[i] != p.dtype:
                self.persistent[id(p)] = torch.zeros(p.shape, dtype=s.master_dtypes[i], device=p.device)
            else:
                p.grad = torch.zeros_like(p)
        elif (home := s.grads[i].home) is not None:
            s.grads[i].wait()
            home.zero_()
            s.grads[i].fresh = True

    def gradient_kind(self, p: torch.Tensor) -> tuple[torch.dtype, torch.device]:
        """The dtype and device ``p``'s gradient has here (its master's dtype; the GPU tier for a
        persistent unit, host memory for an offloaded one), as its norm would have them."""
        s, i = self.ctx.param_slot[id(p)]
        return s.master_dtypes[i], p.device if s.home == GPU else torch.device("cpu")

    def stand_in(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Another rank's unit under sharded states: a tensor of the gradient's shape carrying the
        reduced gradient, so that it counts towards the norm and the overflow check."""
        s, i = self.ctx.param_slot[id(p)]
        s.wait_reductions()
        grad = self.persistent.get(id(p), p.grad) if s.home == GPU else s.grads[i].value()
        if grad is None:
            return None
        stand_in = one_element(0.0, grad.shape, grad.dtype, grad.device)
        stand_in.grad = grad
        return stand_in

    def forget(self, unit_optimizers: UnitOptimizers) -> None:
        """The facade's ``zero_grad`` (or its step's end): its parameters' gradients start afresh;
        other optimizers' gradients stay, as in plain training."""
        for p in unit_optimizers.order:
            self.persistent.pop(id(p), None)
            found = self.ctx.param_slot.get(id(p))
            if found is None or found[0].home == GPU:
                continue
            s, i = found
            s.grads[i].forget()
            self.done_with(s)

    def forget_all(self) -> None:
        self.persistent.clear()
        for s in self.ctx.states:
            for record in s.grads:
                record.forget()
            self.done_with(s)

    def done_with(self, s: UnitState) -> None:
        """A unit's gradients are consumed: a transient buffer goes back once none is fresh (one
        of a parameter no optimizer steps stays, off the worker)."""
        if not (s.transient_gradients and self.buffers.holds(s)):
            return
        if any(r.fresh for r in s.grads):
            self.buffers.settled(s)
        else:
            self.release_buffer(s)

    def consumed(self, s: UnitState, positions: list[int]) -> None:
        """An update used the gradients at ``positions``: they start afresh, and a transient buffer
        goes back once none is fresh."""
        for i in positions:
            s.grads[i].fresh = False
        self.done_with(s)

    def start(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """A parameter became trainable during training: its gradient home (pinned, see
        :meth:`_late_home`), and a gradient autograd already left in ``.grad`` moved there."""
        if master_dtype(p, self.ctx.fp32_masters) != s.master_dtypes[i]:
            raise RuntimeError(
                f"parameter {s.unit.param_names[i]!r} became trainable during training, but under this precision it needs an "
                f"fp32 master that set-up did not plan for a frozen parameter. Unfreeze it before fit, or use a '*-mixed' "
                f"precision (parameters stay fp32)."
            )
        if s.home == GPU:
            return
        record = s.grads[i]
        if record.home is None:
            self._late_home(s, i, p)
        if p.grad is not None:
            if s.transient_gradients:
                self.take_buffer(s)  # binds the record
            home = record.home
            assert home is not None, "a late gradient home was bound above, or with the unit's buffer"
            record.wait()
            if record.fresh:
                home.add_(p.grad.to(home.device))
            else:
                home.copy_(p.grad)
            record.fresh = True
            p.grad = None

    def _late_home(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """Where a parameter unfrozen since set-up keeps its gradient, in pinned memory as every
        planned gradient is (a copy into pageable memory would wait for everything queued on the
        GPU): its place in the unit's gradient memory, which the plan lays out for every
        parameter (the slab's gradient home of a unit partly trainable at set-up, or the buffer a
        transient unit holds: else bound when it takes one); for a unit wholly frozen at set-up, a
        home of its own from the pinned overflow, within the host budget (``overflow.py``)."""
        index = s.unit.index
        if s.transient_gradients:
            region = self.buffers.buffer_of(s) if self.buffers.holds(s) else None
        else:
            region = self.ctx.memory.gradient_homes.get(index, self.late_homes.get(index))
            if region is None:
                what = f"the gradients of unit {s.unit.name!r}, unfrozen after set-up,"
                region = self.late_homes[index] = self.buffers.overflow.take(gradient_bytes(s), what)
        if region is not None:
            size = align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT)
            record = s.grads[i]
            record.bind(s.unit.typed_views(region[:size], s.master_dtypes)[i], None)
        if s.home == NVME:  # room for the optimizer states the placement did not plan for a frozen parameter
            nbytes, store = p.numel() * s.master_dtypes[i].itemsize, self.ctx.store
            assert store is not None, "NVMe units have the store"
            store.capacity += align(int(nbytes * self.state_factor) + len(s.unit.params) * PARAM_ALIGNMENT, HOST_SLOT_ALIGNMENT)
