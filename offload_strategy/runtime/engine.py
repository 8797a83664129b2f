"""``TieredEngine``: binds every parameter to where it lives and moves it where it is needed.

Each parameter keeps its identity (optimizers, hooks and user code hold the same ``nn.Parameter``)
while its ``.data`` is rebound by the engine — MemFerry's shadow model:

- a persistent unit's parameters live in a fixed region of the GPU tier;
- an offloaded unit's parameters point at their home (a host-slab slot) while not resident, and at
  a GPU-tier buffer while resident; a unit at home on NVMe points at a placeholder of the right
  shape that holds no memory and is NaN if ever read.

Forward pre-hooks fetch the units a module uses; saved-tensor hooks replace any saved tensor that
aliases a GPU-tier buffer by a reference (unit, offset, shape, strides), re-fetched when backward
unpacks it, so a buffer can be reused between forward and backward without corrupting anything.
Gradients and updates are the other half of the engine, in ``updates.py``: gradients reach their
host buffers as autograd produces them, and each unit is updated where it lives by the user's
optimizer applied per unit (``optimizer.py``), during backward when it can be.

Correctness never depends on the prefetch table (docs/architecture.md, invariants): a unit that is not
resident when needed is fetched synchronously and counted as a miss.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..hardware.device import Device
from ..memory import HostSlab, SizeClass, Slot, SlotPool
from ..memory.nvme import NvmeStore
from ..planning.placement import (
    DEVICE_SLOT_ALIGNMENT,
    GPU,
    HOST,
    HOST_SLOT_ALIGNMENT,
    NVME,
    NVME_STAGING_BUFFERS,
    UPDATE_STAGING_BUFFERS,
    Placement,
    align,
)
from ..profiling import StepProfile
from .metrics import HIT, LATE_HIT, MISS, RequestStats
from .nvme_states import NvmeOptimizerStates
from .optimizer import UnitOptimizers
from .scheduler import PrefetchTable
from .offloaded import mark_offloaded, mark_present, offloaded_class
from .state import Fetch, UnitState, nan_placeholder
from .units import TransferUnit, master_dtype
from .data_parallel import DataParallel, GradientExchange
from .updates import UnitUpdates
from .worker import UpdateWorker

# How many table entries ahead the scheduler looks for units to prefetch.
PREFETCH_LOOKAHEAD = 16
# Units used most recently in backward are never evicted: an autograd node may still hold views
# of their buffers while it unpacks its other saved tensors.
RECENT_GUARD = 2
# Units fetched because a parameter was read outside its module's forward stay resident while
# this many other such units are fetched after them.
TOUCHED_GUARD = 4


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


class _UnitHook:
    """A module hook of the engine. A copy of the module (an EMA's ``deepcopy``) gets a hook that
    does nothing: the copy's parameters are its own, not the engine's."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def __deepcopy__(self, memo: dict) -> Any:
        return _no_hook


def _no_hook(*args: Any) -> None:
    return None


@dataclass(frozen=True)
class _SavedRef:
    """A saved tensor that aliases a unit's GPU-tier buffer, re-materialised on unpack."""

    unit: int
    byte_offset: int  # from the start of the unit's buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class TieredEngine(UnitUpdates, GradientExchange):
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
        checksums: bool = False,
        fp32_masters: bool = False,
        data_parallel: Optional[DataParallel] = None,
        prefetch: bool = True,
        state_factor: float = 2.0,
    ) -> None:
        self.model = model
        self.state_factor = state_factor  # optimizer-state bytes per master byte, for states the placement did not plan
        self.prefetch_ahead = prefetch  # False: each unit is fetched when a module asks for it
        self.data_parallel = data_parallel
        self.device = device
        self.placement = placement
        self.fp32_masters = fp32_masters
        self.states = [
            UnitState(unit=u, home=placement.home[u.index], master_dtypes=[master_dtype(p, fp32_masters) for p in u.params]) for u in units
        ]
        self._grad_hooked: set[int] = set()  # id(param) of every parameter whose gradients the engine receives
        # the parameters whose gradients and optimizer states the placement planned room for
        self._planned_trainable = {id(p) for u in units for p in u.trainable}
        # offloaded units whose gradients autograd writes straight into their host buffers; a
        # gradient bound for an fp32 master is not the parameter's dtype, so it is copied
        self.direct_gradients = frozenset(i for i in direct_gradients if self.states[i].home != GPU and not self.states[i].widened)
        self.table = PrefetchTable()
        self.requests = RequestStats()
        self.profile = StepProfile(unit_names=[u.name for u in units], unit_bytes=[u.nbytes for u in units])
        # Compute times of every training step, waits for units left out (what the step model
        # needs is compute, not the stalls of the placement that happened to run): ``timing`` is
        # the step in progress, ``last_timing`` the last one whose optimizer step ran.
        self.timing: Optional[StepProfile] = None
        self.last_timing: Optional[StepProfile] = None
        self._stalled = 0.0  # seconds the training thread has waited for units, cumulative
        # where the backward interval being timed began: (unit or None before the first unit, time, stalled)
        self._backward_mark: Optional[tuple[Optional[int], float, float]] = None
        self._forward_mark: Optional[tuple[Optional[int], float, float]] = None
        self._state_bytes: dict[int, int] = {}  # optimizer state bytes of each host-homed unit
        self.nvme_states: Optional[NvmeOptimizerStates] = None
        self.unit_optimizers: dict[int, UnitOptimizers] = {}  # id(facade) -> its per-unit optimizers
        self._persistent_grads: dict[int, torch.Tensor] = {}  # id(param) -> fp32 gradient of a 16-bit persistent parameter
        self._idle_masters: dict[int, torch.Tensor] = {}  # id(master) of an NVMe unit -> its placeholder between updates
        self._param_slot: dict[int, tuple[UnitState, int]] = {}
        self._hooks: list[Any] = []
        self._recent: deque[int] = deque(maxlen=RECENT_GUARD)
        self._touched: deque[int] = deque(maxlen=TOUCHED_GUARD)  # units fetched by an attribute read
        # units read as an attribute between steps: unit -> (host buffer bound, its value when lent) for NVMe, None for host
        self._offloaded = offloaded_class(self._lend_parameter)  # the class of parameters at placeholders
        self._lent: dict[int, Optional[tuple[torch.Tensor, torch.Tensor]]] = {}
        # NVMe units whose optimizer states were read through the user's optimizer between steps: unit -> (buffer, its value when lent)
        self._lent_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._phase = "forward"
        self._active = False  # inside a training step: the prefetch table applies
        self._update_in_backward = False  # this backward ends a step: update units as their gradients complete
        self.clip_value: Optional[float] = None  # gradient clipping by value, applied per unit
        self.worker = UpdateWorker()
        self.update_log: list[tuple[int, float, float]] = []  # (unit, start, end) of this step's updates
        # NVMe updates on the worker: reads issued when a unit's gradients complete, writes left
        # in flight while the next unit updates (unit -> (parameters, states, reads); [(writes, buffers)])
        self._reads_ahead: dict[int, tuple[Slot, Optional[Slot], list[Any]]] = {}
        self._writes_behind: deque[tuple[list[Any], list[Slot]]] = deque()
        self._pipeline_lock = threading.Lock()  # the update pool and the reads ahead, shared with the worker
        self.pipeline = {"reads_ahead": 0, "writes_behind": 0}
        self.backward_log: list[float] = []  # times of this step's backward uses of units
        # optimizer time hidden behind backward vs left after it, since the last report
        self.step_stats = {"exposed_seconds": 0.0, "update_seconds": 0.0, "steps": 0}
        self.activation_bytes = 0  # saved for backward by the last forward (parameters excluded)
        self.store: Optional[NvmeStore] = None
        self._closed = False
        self._reset_reductions(None)
        try:
            self._allocate(nvme_path, checksums)
            self._move_to_homes()
            self._install_hooks(users)
            for optimizer in optimizers:
                self.unit_optimizers[id(optimizer)] = self._unit_optimizers(optimizer)
        except BaseException:
            self.close(materialize=True, raise_errors=False)  # the error that stopped set-up is the one to see
            raise

    def trainable_grew(self) -> bool:
        """Some parameter is trainable now that the placement planned no gradient or state for."""
        return any(p.requires_grad and id(p) not in self._planned_trainable for s in self.states for p in s.unit.params)

    # -- set-up -------------------------------------------------------------------------------------

    def _allocate(self, nvme_path: Optional[str], checksums: bool) -> None:
        persistent = [s for s in self.states if s.home == GPU]
        persistent_bytes = sum(align(s.unit.nbytes, DEVICE_SLOT_ALIGNMENT) for s in persistent)
        stream_classes = sorted(self.placement.device_slots.items(), reverse=True)
        stream_classes_sc = [SizeClass(slot_bytes=b, count=c) for b, c in stream_classes]
        stream_bytes = SlotPool.required_bytes(stream_classes_sc, DEVICE_SLOT_ALIGNMENT) if stream_classes_sc else 0
        self.arena = self.device.allocate(persistent_bytes + stream_bytes)
        offset = 0
        for s in persistent:
            size = align(s.unit.nbytes, DEVICE_SLOT_ALIGNMENT)
            s.device_slot = Slot(slot_bytes=size, offset=offset, tensor=self.arena[offset : offset + size])
            offset += size
        self.device_pool = SlotPool(self.arena[offset:], stream_classes_sc, alignment=DEVICE_SLOT_ALIGNMENT, name="GPU tier")
        self._class_sizes = sorted(c.slot_bytes for c in stream_classes_sc)
        # Address of every GPU-tier buffer, to find which unit a saved tensor aliases by bisection.
        self._slot_starts = sorted([s.device_slot.tensor.data_ptr() for s in persistent] + [x.tensor.data_ptr() for x in self.device_pool.slots])
        self._slot_owner: dict[int, UnitState] = {s.device_slot.tensor.data_ptr(): s for s in persistent}

        offloaded = [s for s in self.states if s.home != GPU]
        home_bytes = sum(align(s.unit.nbytes, HOST_SLOT_ALIGNMENT) for s in offloaded if s.home == HOST)
        grad_bytes = sum(align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT) for s in offloaded if s.unit.trainable)
        grad_bytes += sum(align(s.unit.nbytes, HOST_SLOT_ALIGNMENT) for s in offloaded if s.widened)  # 16-bit landing areas
        staging_classes = [SizeClass(slot_bytes=b, count=c) for b, c in sorted(self.placement.staging_slots.items(), reverse=True)]
        staging_bytes = SlotPool.required_bytes(staging_classes, HOST_SLOT_ALIGNMENT) if staging_classes else 0
        # The update worker's own staging buffers, so it never shares one with the fetch path.
        # Two at least (parameters and states of the unit being updated). Of the buffers the
        # planner added beyond the minimum, half (up to four) let the worker read the next NVMe
        # unit and write the last one back while it updates this one (LoHan Fig. 3b); the others
        # keep NVMe units in host memory between forward and backward.
        spare = max(staging_classes[0].count - NVME_STAGING_BUFFERS, 0) if staging_classes else 0
        self.update_buffers = UPDATE_STAGING_BUFFERS + min(2 * UPDATE_STAGING_BUFFERS, spare - spare // 2)
        update_classes = [SizeClass(slot_bytes=c.slot_bytes, count=self.update_buffers) for c in staging_classes[:1]]
        staging_classes = [SizeClass(c.slot_bytes, c.count - (self.update_buffers if k == 0 else 0)) for k, c in enumerate(staging_classes)]
        self.slab = HostSlab(home_bytes + grad_bytes + staging_bytes, pin=self.device.compute.type == "cuda")
        host = self.slab.tensor
        offset = 0
        for s in offloaded:
            size = align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)
            if s.home == HOST:
                s.home_views = s.unit.views(host[offset : offset + size])
                offset += size
        for s in offloaded:
            if s.unit.trainable:
                size = align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT)
                views = s.unit.typed_views(host[offset : offset + size], s.master_dtypes)
                s.grad_views = [v if p.requires_grad else None for v, p in zip(views, s.unit.params)]
                offset += size
            else:
                s.grad_views = [None] * len(s.unit.params)
            s.grad_landing = [None] * len(s.unit.params)
            if s.widened:
                size = align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)
                views = s.unit.views(host[offset : offset + size])
                s.grad_landing = [v if d != p.dtype else None for v, d, p in zip(views, s.master_dtypes, s.unit.params)]
                offset += size
            s.grad_fresh = [False] * len(s.unit.params)
            s.grad_events = [None] * len(s.unit.params)
            s.grad_pending = [None] * len(s.unit.params)
        update_bytes = SlotPool.required_bytes(update_classes, HOST_SLOT_ALIGNMENT) if update_classes else 0
        self.update_pool = SlotPool(host[offset : offset + update_bytes], update_classes, alignment=HOST_SLOT_ALIGNMENT, name="NVMe update")
        self.staging_pool = SlotPool(host[offset + update_bytes :], staging_classes, alignment=HOST_SLOT_ALIGNMENT, name="NVMe staging")
        # fp32 masters of host-homed low-precision units: never transferred, so not pinned
        widened = [s for s in offloaded if s.home == HOST and s.widened]
        sizes = [align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT) for s in widened]
        self.master_region = torch.empty(sum(sizes), dtype=torch.uint8)
        offset = 0
        for s, size in zip(widened, sizes):
            views = s.unit.typed_views(self.master_region[offset : offset + size], s.master_dtypes)
            s.master_views = [v if d != p.dtype else None for v, d, p in zip(views, s.master_dtypes, s.unit.params)]
            offset += size
        if any(s.home == NVME for s in self.states):
            assert nvme_path is not None, "placement put units on NVMe without an NVMe path"
            self.store = NvmeStore(nvme_path, capacity=max(self.placement.nvme_bytes, 1), checksums=checksums)
            self.nvme_states = NvmeOptimizerStates(self.store)

    def _move_to_homes(self) -> None:
        with torch.no_grad():
            for s in self.states:
                values = [p.data for p in s.unit.params]
                if s.home == GPU:
                    targets = s.unit.views(s.device_slot.tensor)
                    for t, v in zip(targets, values):
                        t.copy_(v)
                    self._bind(s, targets)
                    s.bound = True
                elif s.home == HOST:
                    for t, v in zip(s.home_views, values):
                        t.copy_(v)
                    self._bind(s, s.home_views)
                else:
                    staging = self.staging_pool.acquire(s.unit.nbytes)
                    for t, v in zip(s.unit.views(staging.tensor), values):
                        t.copy_(v)
                    self.store.write(self._key(s), staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
                    self.staging_pool.release(staging)
                    s.placeholders = [nan_placeholder(p, self.device.compute) for p in s.unit.params]
                    self._bind(s, s.placeholders)
                for i, p in enumerate(s.unit.params):
                    self._param_slot[id(p)] = (s, i)

    def _install_hooks(self, users: dict[nn.Module, list[TransferUnit]]) -> None:
        for module, used in users.items():
            # Every user module is hooked, persistent ones too, so the profiled step times them all.
            indices = [u.index for u in used]
            fetched = [i for i in indices if self.states[i].home != GPU and i not in self.placement.dha]
            pre_hook = self._make_pre_hook(indices, fetched)
            self._hooks.append(module.register_forward_pre_hook(pre_hook))
            self._hooks.append(module.register_forward_hook(pre_hook.post_hook, always_call=True))
        for s in self.states:
            if s.home == GPU:
                # a 16-bit persistent parameter's gradients accumulate in fp32, as offloaded ones do
                # at home; under data parallelism every persistent gradient is counted for its reduction
                for p, dtype in zip(s.unit.params, s.master_dtypes):
                    if p.requires_grad and (dtype != p.dtype or self.data_parallel is not None):
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._on_persistent_grad))
                self._grad_hooked.update(id(p) for p in s.unit.trainable)
                continue
            for p in s.unit.trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
                self._grad_hooked.add(id(p))
        self._watched: list[tuple[nn.Module, dict]] = []
        for module in users:
            self._watched.append((module, module._parameters))
            module._parameters = _WatchedParameters(module._parameters, self._on_read)

    def _on_read(self, p: torch.Tensor) -> None:
        found = self._param_slot.get(id(p))
        if found is None:
            return
        s = found[0]
        if s.home == GPU or s.unit.index in self.placement.dha:
            return
        if not self._active:
            self._lend(s)
            return
        if s.resident and s.bound:
            return
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is not None:
            # a checkpointed module's own forward recomputed in backward (its hooks ran in the
            # first forward only): held like every unit of a recomputed block
            self.request(s.unit.index)
            s.recompute_pinned = True
            return
        # A read outside a hooked forward: fetch now, and keep the unit while a few others come
        # and go (the caller is about to compute with it).
        self._touched.append(s.unit.index)
        self.request(s.unit.index)

    # -- parameters read and written between steps ---------------------------------------------------

    def _lend_parameter(self, p: torch.Tensor) -> bool:
        """A parameter at a placeholder is read as a value: as if read as an attribute (between steps
        its unit is lent at home, inside a step fetched); False where that cannot be done."""
        if self._closed or id(p) not in self._param_slot:
            return False
        self._on_read(p)
        return type(p) is nn.Parameter

    @torch.no_grad()
    def _lend(self, s: UnitState) -> None:
        """A parameter read as an attribute between steps (a callback, a logger) holds its true value
        at home, where what the caller writes is kept: host units are bound there already; an NVMe
        unit is read into a host buffer until the next step (or checkpoint) takes it back."""
        index = s.unit.index
        if index in self._lent:
            return
        if s.device_slot is not None:
            self.evict(index)  # a GPU-tier copy would take writes that never reach home
        if s.home == HOST:
            self._lent[index] = None
            return
        buffer = self._read_home(s)
        self._bind(s, s.unit.views(buffer))
        self._lent[index] = (buffer, buffer.clone())

    def _read_home(self, s: UnitState) -> torch.Tensor:
        """A fresh host buffer holding an NVMe unit's bytes (from its kept copy, or from disk)."""
        buffer = torch.empty(align(s.unit.nbytes, HOST_SLOT_ALIGNMENT), dtype=torch.uint8)
        if s.host_copy is not None:
            buffer.copy_(s.host_copy.tensor[: buffer.numel()])
        else:
            self.store.read(self._key(s), buffer).result()
        return buffer

    @torch.no_grad()
    def _lend_states(self, unit_index: int) -> None:
        """An NVMe unit's optimizer states read through the user's optimizer (``optimizer.state``)
        between steps: read into host memory until the next step takes them back (written home
        if changed). Inside a step they are the update's own."""
        states = self.nvme_states
        if self._active or self._closed or states is None or not states.known(unit_index) or unit_index in self._lent_states:
            return
        if self.states[unit_index].home != NVME:
            return
        buffer = torch.empty(states.sizes[unit_index], dtype=torch.uint8)
        states.load(unit_index, buffer)
        self._lent_states[unit_index] = (buffer, buffer.clone())

    @contextlib.contextmanager
    def _states_materialized(self) -> Iterator[None]:
        """Every NVMe unit's optimizer states in memory (a checkpoint), after lent ones went home."""
        self._take_back()
        with self.nvme_states.materialized():
            yield

    @torch.no_grad()
    def _take_back(self) -> None:
        """Units lent between steps return: what was written goes home, fp32 masters kept apart
        from a written 16-bit parameter take its new value, NVMe units point at placeholders again."""
        lent_states, self._lent_states = self._lent_states, {}
        for index, (buffer, before) in lent_states.items():
            if torch.equal(buffer, before):
                self.nvme_states.drop(index)
            else:
                self.nvme_states.save(index, buffer)
        lent, self._lent = self._lent, {}
        for index, held in lent.items():
            s = self.states[index]
            if held is None:
                written = [m is not None and not torch.equal(h, m.to(h.dtype)) for h, m in zip(s.home_views, s.master_views)]
            else:
                buffer, before = held
                written = [not torch.equal(a, b) for a, b in zip(s.unit.views(buffer), s.unit.views(before))]
                if any(written):
                    self.store.write(self._key(s), buffer).result()
                    if s.host_copy is not None:
                        s.host_copy.tensor[: buffer.numel()].copy_(buffer)
                self._bind(s, s.placeholders)
            self._masters_from_parameters({id(p) for p, w in zip(s.unit.params, written) if w})

    @staticmethod
    def _key(s: UnitState) -> str:
        return f"unit{s.unit.index}"

    def _bind(self, s: UnitState, tensors: Sequence[torch.Tensor]) -> None:
        away = bool(s.placeholders) and tensors is s.placeholders
        for p, name, t in zip(s.unit.params, s.unit.param_names, tensors):
            mark_present(p)
            p.data = t
            if away:
                mark_offloaded(p, self._offloaded, name)

    # -- residency ----------------------------------------------------------------------------------

    def _make_pre_hook(self, indices: list[int], fetched: list[int]) -> "_UnitHook":
        def pre_hook(module: nn.Module, args: Any) -> None:
            if self._phase == "backward" and torch._C._current_autograd_node() is None:
                self._phase = "forward"  # another forward in the same step (manual optimization)
            for i in fetched:
                self.states[i].pins += 1
            if self.timing is not None and self._phase == "forward" and torch._C._current_autograd_node() is None:
                self._mark_forward(indices[0])
            for i in fetched:
                self.request(i)
                if torch.is_grad_enabled() and torch._C._current_autograd_node() is not None:
                    self.states[i].recompute_pinned = True  # a forward that backward recomputes

        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            for i in fetched:
                self.states[i].pins -= 1

        hook = _UnitHook(pre_hook)
        hook.post_hook = _UnitHook(post_hook)  # type: ignore[attr-defined]
        return hook

    # Views made under inference mode (evaluation loops) would be inference tensors, which training
    # could not update in place later: the engine makes all of its views outside it.
    @torch.inference_mode(False)
    def request(self, index: int) -> torch.Tensor:
        """Make unit ``index`` resident in the GPU tier and bind its parameters there."""
        s = self.states[index]
        if s.home == GPU:
            return s.device_slot.tensor
        if self._active and not self.table.record(index):
            self.requests.out_of_order += 1
        if s.resident:
            kind, waited = HIT, 0.0
        elif s.fetch is not None:
            kind = LATE_HIT if not self._fetch_done(s.fetch) else HIT
            waited = self._complete(s)
        else:
            kind = MISS
            start = time.perf_counter()
            self._start_fetch(s, evict=True)
            self._complete(s)
            waited = time.perf_counter() - start
        self.requests.add(kind, waited)
        self._stalled += waited
        if not s.bound:
            self._bind(s, s.unit.views(s.device_slot.tensor))
            s.bound = True
        if not self._recent or self._recent[-1] != index:
            self._recent.append(index)
        if self._active:
            s.pins += 1  # what is prefetched now must not push out what was just asked for
            try:
                self._prefetch()
            finally:
                s.pins -= 1
        return s.device_slot.tensor

    @staticmethod
    def _fetch_done(fetch: Fetch) -> bool:
        return (fetch.nvme is None or fetch.nvme.done()) and fetch.event is not None and fetch.event.done()

    def _own_class(self, nbytes: int) -> int:
        """The smallest buffer size that holds ``nbytes``: where a unit of that size belongs."""
        return self._class_sizes[bisect.bisect_left(self._class_sizes, nbytes)]

    def _start_fetch(self, s: UnitState, evict: bool) -> bool:
        # A prefetch only takes a free buffer of the unit's own size class: parking a small unit in
        # a large buffer would leave a large unit nowhere to go.
        size = self._own_class(s.unit.nbytes)
        slot = self.device_pool.acquire(size) if self.device_pool.free_slots(size) else None
        if slot is None and evict:
            slot = self._evict_for(s.unit.nbytes)
            if slot is None:
                in_use = [x.unit.name for x in self.states if x.pins > 0 or x.recompute_pinned]
                raise RuntimeError(
                    f"no GPU-tier buffer of {s.unit.nbytes} bytes is free for unit {s.unit.name!r}: every buffer holds a unit "
                    f"in use ({', '.join(in_use) or 'none'}). The modules in use (with activation checkpointing: every module of "
                    f"the recomputed block) need more than gpu_memory holds; raise gpu_memory."
                )
        if slot is None:
            return False
        fetch = Fetch(slot=slot)
        n = s.unit.nbytes
        if s.home == HOST:
            fetch.event = self.device.copy_to_device(slot.tensor[:n], self._home_bytes(s))
        elif s.host_copy is not None:
            # The copy kept in host memory is current: no NVMe read (10Cache Alg. 4).
            fetch.event = self.device.copy_to_device(slot.tensor[:n], s.host_copy.tensor[:n])
            self.requests.nvme_reads_avoided += 1
        else:
            staging = self._staging(n, wait=evict, keep=s)
            if staging is None:  # no staging buffer free: leave it for an on-demand fetch
                self.device_pool.release(slot)
                return False
            fetch.staging = staging
            fetch.nvme = self.store.read(self._key(s), staging.tensor[: align(n, HOST_SLOT_ALIGNMENT)])
        s.device_slot, s.fetch = slot, fetch
        self._slot_owner[slot.tensor.data_ptr()] = s
        return True

    def _home_bytes(self, s: UnitState) -> torch.Tensor:
        first = s.home_views[0]
        # The home views are consecutive inside one slab slot: copy the whole unit at once.
        start = first.data_ptr() - self.slab.tensor.data_ptr()
        return self.slab.tensor[start : start + s.unit.nbytes]

    def _complete(self, s: UnitState) -> float:
        """Wait for the unit's fetch to finish; returns seconds this thread was blocked."""
        fetch = s.fetch
        start = time.perf_counter()
        if fetch.nvme is not None:
            fetch.nvme.result()
            fetch.event = self.device.copy_to_device(fetch.slot.tensor[: s.unit.nbytes], fetch.staging.tensor[: s.unit.nbytes])
            fetch.nvme = None
        self.device.wait(fetch.event)
        if fetch.staging is not None:
            s.host_copy = fetch.staging  # keep it: backward and the optimizer step need the unit again
        s.fetch = None
        return time.perf_counter() - start

    def _staging(self, nbytes: int, wait: bool, keep: Optional[UnitState] = None) -> Optional[Slot]:
        """A free staging buffer, dropping the kept host copy needed farthest ahead (never ``keep``'s) if none is free."""
        slot = self.staging_pool.try_acquire(nbytes)
        while slot is None:
            kept = [
                x.unit.index
                for x in self.states
                if x.host_copy is not None and x.fetch is None and x is not keep and x.host_copy.slot_bytes >= nbytes
            ]
            victim = self.states[self.table.farthest(kept)] if kept else None
            if victim is not None and not wait and keep is not None:
                # a prefetch may only displace a copy needed later than the unit it brings in
                theirs, ours = self.table.next_use(victim.unit.index), self.table.next_use(keep.unit.index)
                if theirs is not None and (ours is None or theirs <= ours):
                    victim = None
            if victim is not None:
                self.staging_pool.release(victim.host_copy)
                victim.host_copy = None
            elif wait and any(x.fetch is not None and x.fetch.staging is not None for x in self.states):
                self._drain_staging()
            else:
                return None
            slot = self.staging_pool.try_acquire(nbytes)
        return slot

    def _drain_staging(self) -> None:
        for s in self.states:
            if s.fetch is not None and s.fetch.staging is not None:
                self._complete(s)

    def _progress_nvme(self) -> None:
        """Start the host → GPU copy of NVMe reads that have landed."""
        for s in self.states:
            fetch = s.fetch
            if fetch is not None and fetch.nvme is not None and fetch.nvme.done():
                fetch.nvme.result()
                fetch.nvme = None
                fetch.event = self.device.copy_to_device(fetch.slot.tensor[: s.unit.nbytes], fetch.staging.tensor[: s.unit.nbytes])

    def _evictable(self, hard: bool) -> list[int]:
        """Resident offloaded units not in use. Soft protection (units whose gradients are still
        coming, units backward used last) is dropped when nothing else can make room."""
        out = []
        for s in self.states:
            if s.home == GPU or not s.resident or s.pins > 0 or s.recompute_pinned:
                continue
            # read as an attribute outside a forward: kept while there is room, never at the cost
            # of a module that needs a buffer now (the placement's minimum does not count them)
            touched = s.unit.index in self._touched
            waiting_for_grads = s.used_in_backward and s.grads_arrived < len(s.unit.trainable)
            if not hard and (touched or waiting_for_grads or (self._phase == "backward" and s.unit.index in self._recent)):
                continue
            out.append(s.unit.index)
        return out

    def _evict_for(self, nbytes: int) -> Optional[Slot]:
        """A buffer for ``nbytes``: a free one, else by evicting the unit needed farthest ahead,
        trying the unit's own size class before larger ones, and units no one still waits for
        (gradients, a recent backward use) before any other."""
        sizes = [c for c in self._class_sizes if c >= nbytes]
        while True:
            for hard in (False, True):
                for size in sizes:
                    if self.device_pool.free_slots(size):
                        return self.device_pool.acquire(size)
                    victims = [i for i in self._evictable(hard) if self.states[i].device_slot.slot_bytes == size]
                    if victims:
                        self.evict(self.table.farthest(victims))
                        return self.device_pool.acquire(size)
            if not any(x.fetch is not None for x in self.states):
                return None
            self._drain_prefetches()  # units in flight become evictable once they land

    def _drain_prefetches(self) -> None:
        for s in self.states:
            if s.fetch is not None:
                self._complete(s)

    def evict(self, index: int) -> None:
        s = self.states[index]
        if s.fetch is not None:
            self._complete(s)
        self._bind(s, s.home_views if s.home == HOST else s.placeholders)
        s.bound = False
        del self._slot_owner[s.device_slot.tensor.data_ptr()]
        self.device_pool.release(s.device_slot)
        s.device_slot = None

    def _prefetch(self) -> None:
        """10Cache Alg. 3: bring the next units of the table into free buffers, asynchronously."""
        self._progress_nvme()
        if not self.prefetch_ahead:
            return
        for index in self.table.upcoming(PREFETCH_LOOKAHEAD):
            s = self.states[index]
            if s.home == GPU or s.device_slot is not None:
                continue
            size = self._own_class(s.unit.nbytes)
            if not self.device_pool.free_slots(size):
                # Evict only a unit needed later than this one (Belady), never one in use.
                distance = self.table.next_use(index)
                victims = [i for i in self._evictable(hard=False) if self.states[i].device_slot.slot_bytes == size]
                victim = self.table.farthest(victims)
                victim_distance = self.table.next_use(victim) if victim is not None else None
                if victim is None or (victim_distance is not None and distance is not None and victim_distance <= distance):
                    break
                self.evict(victim)
            if not self._start_fetch(s, evict=False):
                break

    # -- saved tensors ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saved_tensor_hooks(self) -> Iterator[None]:
        """Active around a training step's forward; see the module docstring."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.arena.device or t.untyped_storage().data_ptr() != self.arena.untyped_storage().data_ptr():
            if self._active and self._phase == "forward":
                self.activation_bytes += t.numel() * t.element_size()  # kept for backward (checkpointed blocks save only inputs)
            return t
        ptr = t.data_ptr()
        start = self._slot_starts[bisect.bisect_right(self._slot_starts, ptr) - 1]
        s = self._slot_owner.get(start)
        if s is None or s.home == GPU or ptr >= start + s.device_slot.slot_bytes:
            return t  # persistent buffers never move
        return _SavedRef(s.unit.index, ptr - start, tuple(t.shape), tuple(t.stride()), t.dtype)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedRef):
            return packed
        self._phase = "backward"
        self.backward_log.append(time.perf_counter())
        mark = self._backward_mark
        if self.timing is not None and (mark is None or mark[0] != packed.unit):
            # a unit's backward runs from its first saved tensor to the next unit's (its fetch
            # wait, below, is left out); persistent units' backward falls in these intervals
            self._close_backward_interval()
            self._backward_mark = (packed.unit, time.perf_counter(), self._stalled)
        buffer = self.request(packed.unit)
        s = self.states[packed.unit]
        s.used_in_backward = True
        typed = buffer.view(packed.dtype)
        element = typed.element_size()
        # as_strided's offset counts from the start of the storage, not of the view
        return typed.as_strided(packed.shape, packed.stride, typed.storage_offset() + packed.byte_offset // element)

    # -- training-step boundaries -------------------------------------------------------------------

    @torch.inference_mode(False)
    def begin_step(
        self, profile: bool, update_in_backward: bool = False, clip_value: Optional[float] = None, reduce: Optional[str] = None, train: bool = True,
    ) -> None:
        """A training (or, with ``train=False``, evaluation) step starts. ``update_in_backward``:
        its backward ends an optimizer step (no accumulation left, nothing that needs every
        gradient first), so units are updated as soon as their gradients are complete.
        ``reduce``: under data parallelism, how this backward's gradients are reduced (see
        ``GradientExchange``); None accumulates."""
        self._take_back()
        self._phase = "forward"
        self.timing = StepProfile(unit_names=self.profile.unit_names, unit_bytes=self.profile.unit_bytes) if train else None
        self._backward_mark = None
        self._forward_mark = (None, time.perf_counter(), self._stalled)
        self._active = True
        self._recent.clear()
        self._touched.clear()
        self.activation_bytes = 0
        self._update_in_backward = update_in_backward and len(self.unit_optimizers) == 1
        self.clip_value = clip_value
        self.update_log, self.backward_log = [], []
        self._reset_reductions(reduce)
        for s in self.states:
            s.grads_arrived = 0
            s.used_in_backward = False
            s.recompute_pinned = False
        if train:
            self.sync_trainable()
        if profile:
            self.table.start_recording()
        else:
            self.table.restart()
            self._prefetch()

    def begin_backward(self) -> None:
        """The strategy's backward starts: forward's last interval (the head and the loss) ends."""
        self.sync_trainable()  # parameters unfrozen inside the training step get their gradient hooks now
        timing, mark = self.timing, self._forward_mark
        if timing is None or mark is None:
            return
        now = time.perf_counter()
        timing.outside_forward_seconds += now - mark[1] - (self._stalled - mark[2])
        self._forward_mark = None
        self._backward_mark = (None, now, self._stalled)

    def _mark_forward(self, unit: int) -> None:
        """A module using ``unit`` starts: what ran since the last such start (the module before
        and the functional code after it, which hooks miss; ProTrain §3.2's inter-operator view)
        is that module's unit's compute, waits for units left out."""
        timing, mark = self.timing, self._forward_mark
        now = time.perf_counter()
        if timing is not None and mark is not None:
            previous, since, stalled = mark
            elapsed = now - since - (self._stalled - stalled)
            if previous is None:
                timing.outside_forward_seconds += elapsed
            else:
                timing.forward_seconds[previous] = timing.forward_seconds.get(previous, 0.0) + elapsed
            if unit not in timing.forward_seconds:
                timing.order.append(unit)
                timing.forward_seconds[unit] = 0.0
        self._forward_mark = (unit, now, self._stalled)

    def end_backward(self) -> None:
        """The strategy's backward returned: the last unit's backward interval ends."""
        if self.timing is not None:
            self._close_backward_interval()
            self._backward_mark = None

    def _close_backward_interval(self) -> None:
        mark, timing = self._backward_mark, self.timing
        if mark is None or timing is None:
            return
        unit, since, stalled = mark
        elapsed = time.perf_counter() - since - (self._stalled - stalled)
        if unit is None:  # the loss and the units kept in the GPU tier at the end of the model
            timing.outside_backward_seconds += elapsed
        else:
            timing.backward_seconds[unit] = timing.backward_seconds.get(unit, 0.0) + elapsed

    def evict_all(self) -> None:
        for s in self.states:
            if s.home != GPU and s.device_slot is not None:
                self.evict(s.unit.index)

    # -- whole-model views --------------------------------------------------------------------------

    @contextlib.contextmanager
    def materialized(self, writeback: bool = False) -> Iterator[None]:
        """Every parameter holds its true value in a real tensor for the duration (checkpoints)."""
        self._take_back()
        self.evict_all()
        self._drain_staging()
        # Fresh buffers, not staging ones: every NVMe unit is bound at once, and staging buffers
        # are fewer than units.
        loaded: list[tuple[UnitState, torch.Tensor]] = []
        for s in self.states:
            if s.home != NVME:
                continue
            buffer = self._read_home(s)
            self._bind(s, s.unit.views(buffer))
            loaded.append((s, buffer))
        try:
            yield
        finally:
            if writeback:
                self._masters_from_parameters()
            for s, buffer in loaded:
                if writeback:
                    self.store.write(self._key(s), buffer).result()
                    if s.host_copy is not None:
                        s.host_copy.tensor[: buffer.numel()].copy_(buffer)
                self._bind(s, s.placeholders)

    def _masters_from_parameters(self, written: Optional[set[int]] = None) -> None:
        """Parameters (``written``: those ids; None: all) were written from outside the step: fp32
        masters kept apart from them take the written values before their next update (masters
        that are the parameters need nothing)."""
        for unit_optimizers in self.unit_optimizers.values():
            for slot in unit_optimizers.slots.values():
                unit_optimizers.stale.update(
                    id(m) for position, m in enumerate(slot.masters)
                    if slot.widened(position) and (written is None or id(slot.params[position]) in written)
                )

    def close(self, materialize: bool = True, raise_errors: bool = True) -> None:
        """Remove hooks, give every parameter a plain tensor with its true value, free all tiers.

        Every step runs even when one fails (threads joined, hooks removed, files and pinned
        memory freed); the first failure is then raised (``raise_errors``), so that a unit that
        could not be read back never leaves training silently with placeholder weights.
        """
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []

        def attempt(action: Any, *args: Any) -> None:
            try:
                action(*args)
            except Exception as error:  # kept, and raised once everything is freed
                errors.append(error)

        if hasattr(self, "worker"):
            attempt(self.worker.drain)
            attempt(self._finish_pipeline)
            self.worker.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for module, original in getattr(self, "_watched", []):
            current = module._parameters
            original.clear()
            original.update(current)  # keeps parameters registered or replaced meanwhile
            module._parameters = original
        self._watched = []
        if materialize:
            attempt(self._take_back)
            for s in getattr(self, "states", []):
                attempt(self._materialize_for_good, s)
            for unit_optimizers in self.unit_optimizers.values():
                attempt(unit_optimizers.restore_facade, self.nvme_states.materialized if self.nvme_states else contextlib.nullcontext)
        for s in getattr(self, "states", []):
            for p in s.unit.params:  # after a failed read-back: placeholders, plain again (the failure is raised)
                mark_present(p)
        if self.store is not None:
            attempt(self.store.close)
        if getattr(self, "slab", None) is not None:
            attempt(self.slab.close)
        if errors and raise_errors:
            raise errors[0]

    @torch.no_grad()
    def _materialize_for_good(self, s: UnitState) -> None:
        """The unit's parameters become plain tensors holding their true values."""
        if s.fetch is not None:
            self._complete(s)
        for i, p in enumerate(s.unit.params):
            if s.home == GPU and s.device_slot is not None:
                p.data = p.data.clone()
            elif s.home == HOST and s.home_views:
                p.data = s.home_views[i].clone()
        if s.home == NVME and self.store is not None and s.placeholders:
            self._bind(s, [v.clone() for v in s.unit.views(self._read_home(s))])

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        out = {f"cache/{k}": v for k, v in self.requests.report().items()}
        self.requests.reset()
        out["link/h2d_bytes"] = float(self.device.bytes_to_device)
        out["link/d2h_bytes"] = float(self.device.bytes_to_host)
        out["link/nvme_read_bytes"] = float(self.store.bytes_read if self.store else 0)
        out["link/nvme_write_bytes"] = float(self.store.bytes_written if self.store else 0)
        persistent = sum(s.device_slot.slot_bytes for s in self.states if s.home == GPU)
        out["tier/gpu_bytes"] = float(persistent + self.device_pool.used_bytes)
        out["tier/gpu_peak_bytes"] = float(persistent + self.device_pool.peak_used_bytes)
        out["tier/gpu_capacity_bytes"] = float(self.arena.numel())
        # homes and gradients in the slab, staging buffers in use, and optimizer states
        fixed = self.slab.nbytes - self.staging_pool.capacity_bytes + sum(self._state_bytes.values())
        out["tier/host_bytes"] = float(fixed + self.staging_pool.used_bytes)
        out["tier/host_peak_bytes"] = float(fixed + self.staging_pool.peak_used_bytes)
        out["tier/nvme_bytes"] = float(self.store.used_bytes if self.store else 0)
        for home in (GPU, HOST, NVME):
            out[f"units/{home}"] = float(sum(1 for s in self.states if s.home == home))
        out["units/direct_gradients"] = float(len(self.direct_gradients))
        # optimizer states (and fp32 masters kept with them) by tier: under sharded data
        # parallelism, this rank's share
        for home in (GPU, HOST):
            out[f"optimizer/{home}_state_bytes"] = float(sum(b for i, b in self._state_bytes.items() if self.states[i].home == home))
        out["optimizer/nvme_state_bytes"] = float(sum(self.nvme_states.sizes.values()) if self.nvme_states is not None else 0)
        out["activations/saved_bytes"] = float(self.activation_bytes)
        steps = self.step_stats["steps"]
        if steps:
            # update: all unit updates of a step; exposed: what the step waited after backward
            out["optimizer/update_ms"] = 1e3 * self.step_stats["update_seconds"] / steps
            out["optimizer/exposed_ms"] = 1e3 * self.step_stats["exposed_seconds"] / steps
        self.step_stats = {"exposed_seconds": 0.0, "update_seconds": 0.0, "steps": 0}
        return out
