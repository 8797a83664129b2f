"""The GPU tier as a cache of units: fetch on demand, prefetch along the profiled order (10Cache
Alg. 3), evict by next use (Belady over the prefetch table), and the NVMe staging buffers units
pass through (with the copies they keep, 10Cache Alg. 4).

Correctness never depends on the prefetch table (docs/architecture.md, invariants): a unit that is
not resident when needed is fetched synchronously and counted as a miss.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ...hardware.device import Event
from ...memory import Slot
from ...memory.dha import can_view, device_view
from ...planning.placement import GPU, HOST, HOST_SLOT_ALIGNMENT, align
from ..context import EngineContext, Phase
from ..metrics import HIT, LATE_HIT, MISS
from .offloaded import mark_offloaded, mark_present
from ..state import Fetch, UnitState, nan_placeholder

# How many table entries ahead the scheduler looks for units to prefetch.
PREFETCH_LOOKAHEAD = 16
# Units used most recently in backward are never evicted: an autograd node may still hold views
# of their buffers while it unpacks its other saved tensors.
RECENT_GUARD = 2
# Units fetched because a parameter was read outside its module's forward stay resident while
# this many other such units are fetched after them.
TOUCHED_GUARD = 4


class Protection(enum.Enum):
    """What keeps a resident unit that no module uses from eviction when a buffer is needed."""

    ALL = "all"  # its gradients are still coming, backward used it last, or it was read as an attribute
    LANDING = "landing"  # as ALL, once the own class's copies still landing have landed
    RECENT = "recent"  # only backward's last use: a node may still hold views of its buffer
    NONE = "none"  # nothing: when nothing else can make room


def slot_of(s: UnitState) -> Slot:
    """The unit's GPU-tier buffer, where it has one: a persistent unit's from set-up on, a streamed
    unit's from the start of its fetch until its eviction."""
    assert s.device_slot is not None, f"unit {s.unit.name!r} ({s.home}) has no GPU-tier buffer here"
    return s.device_slot


class UnitCache:
    """Which offloaded units are resident in the GPU tier's streaming buffers, and why.

    The cache owns each unit's residency and bindings: its GPU-tier slot and fetch, its kept host
    copy, its pins, what its parameters point at and what user code wrote through them
    (``UnitState.device_slot``, ``fetch``, ``host_copy``, ``host_copy_read``, ``pins``, ``bound``,
    ``bound_to``, ``bound_versions``, ``written``, ``handed_out``, ``placeholders``). The other
    collaborators change them only through its methods (``bind``, ``pin``, ``evict``, ...)."""

    def __init__(self, ctx: EngineContext, prefetch: bool = True) -> None:
        self.ctx = ctx
        self.prefetch_ahead = prefetch  # False: each unit is fetched when a module asks for it
        self.recent: deque[int] = deque(maxlen=RECENT_GUARD)
        self.touched: deque[int] = deque(maxlen=TOUCHED_GUARD)  # units fetched by an attribute read
        self.stalled_seconds = 0.0  # the training thread's waits for units, over the run
        memory = ctx.memory
        persistent = [s for s in ctx.states if s.home == GPU]
        for s in persistent:
            s.device_slot = memory.persistent_slots[s.unit.index]  # resident for good
        # Address of every GPU-tier buffer, to find which unit a saved tensor aliases by bisection.
        self.slot_starts = sorted([slot_of(s).tensor.data_ptr() for s in persistent] + [x.tensor.data_ptr() for x in memory.device_pool.slots])
        self.slot_owner: dict[int, UnitState] = {slot_of(s).tensor.data_ptr(): s for s in persistent}
        self.on_device_views: set[int] = set()  # host units evicted inside this step, pointing at views of their homes
        self.held: set[int] = set()  # units a torch.func transform's backward reads (see hold)

    def hold(self, index: int) -> None:
        """Inside a ``torch.func`` transform that differentiates (``grad``, ``vjp``, ``jacrev``:
        saved-tensor hooks are off there), a unit a module used stays in the GPU tier until every
        unit goes home: the transform's backward reads the parameters as they were saved, not
        through the engine."""
        if index not in self.held:
            self.held.add(index)
            self.pin(index)

    def pin(self, index: int) -> None:
        """A module using unit ``index`` runs: the unit is not evicted until :meth:`unpin`."""
        self.ctx.states[index].pins += 1

    def unpin(self, index: int) -> None:
        self.ctx.states[index].pins -= 1

    def handed_out(self, s: UnitState, position: int) -> None:
        """User code took the ``.data`` of the parameter at ``position`` inside a step: what it
        writes through it counts as written (:meth:`keep_writes`)."""
        s.handed_out.add(position)

    def new_step(self) -> None:
        self.recent.clear()
        self.touched.clear()

    def owner(self, ptr: int) -> Optional[UnitState]:
        """The streamed unit whose GPU-tier buffer holds address ``ptr`` (None: persistent or none)."""
        start = self.slot_starts[bisect.bisect_right(self.slot_starts, ptr) - 1]
        s = self.slot_owner.get(start)
        if s is None or s.home == GPU or ptr >= start + slot_of(s).slot_bytes:  # a streamed owner: fetched, not yet evicted
            return None
        return s

    def owner_offset(self, s: UnitState, ptr: int) -> int:
        return ptr - slot_of(s).tensor.data_ptr()

    # Views made under inference mode (evaluation loops) would be inference tensors, which training
    # could not update in place later: the cache makes all of its views outside it.
    @torch.inference_mode(False)
    def request(self, index: int) -> torch.Tensor:
        """Make unit ``index`` resident in the GPU tier and bind its parameters there."""
        ctx = self.ctx
        s = ctx.states[index]
        active = ctx.step.active
        if active and s.bound_to:
            _refuse_rebinding_inside_a_step(s, ctx.rebound(s))
        if s.home == GPU:
            return slot_of(s).tensor
        if active and not ctx.table.record(index):
            ctx.requests.out_of_order += 1
        kind, waited = self._make_resident(s, active)
        ctx.requests.add(kind, waited)
        self.stalled_seconds += waited
        if not s.bound:
            if self.note_writes(s) and s.home == HOST:  # written at home after this copy was fetched
                slot_of(s).tensor[: s.unit.nbytes].copy_(ctx.home_bytes(s))
            self.bind(s, s.unit.views(slot_of(s).tensor))
            s.bound = True
        if not self.recent or self.recent[-1] != index:
            self.recent.append(index)
        if active:
            self._prefetch_beside(s)
        return slot_of(s).tensor

    def _make_resident(self, s: UnitState, active: bool) -> tuple[str, float]:
        """The unit's copy in the GPU tier, waited for: how it was found there, and the wait."""
        if s.resident:
            return HIT, 0.0
        if s.fetch is not None:
            kind = LATE_HIT if not _fetch_done(s.fetch) else HIT
            return kind, self.complete(s)
        start = time.perf_counter()
        self._start_fetch(s, evict=True)
        if active:
            self._prefetch_beside(s)  # the next units' copies start now, not once this one has landed
        self.complete(s)
        return MISS, time.perf_counter() - start

    def _prefetch_beside(self, s: UnitState) -> None:
        self.pin(s.unit.index)  # what is prefetched now must not push out what was just asked for
        try:
            self.prefetch()
        finally:
            self.unpin(s.unit.index)

    def touch(self, index: int) -> None:
        """A read outside a hooked forward: fetch now, and keep the unit while a few others come
        and go (the caller is about to compute with it)."""
        self.touched.append(index)
        self.request(index)

    def prefetch(self) -> None:
        """10Cache Alg. 3: bring the next units of the table into free buffers, asynchronously."""
        self._progress_nvme()
        if not self.prefetch_ahead:
            return
        ctx = self.ctx
        for index in ctx.table.upcoming(PREFETCH_LOOKAHEAD):
            s = ctx.states[index]
            if s.home == GPU or s.device_slot is not None:
                continue
            size = ctx.memory.own_class(s.unit.nbytes)
            if not ctx.memory.device_pool.free_slots(size) and not self._evict_farther_than(index, size):
                break
            if not self._start_fetch(s, evict=False):
                break

    def _evict_farther_than(self, index: int, size: int) -> bool:
        """Evict a unit of buffer size ``size`` needed later than ``index`` (Belady), never one in use."""
        table = self.ctx.table
        distance = table.next_use(index)
        victim = table.farthest([i for i in self.evictable(Protection.ALL) if slot_of(self.ctx.states[i]).slot_bytes == size])
        victim_distance = table.next_use(victim) if victim is not None else None
        if victim is None or (victim_distance is not None and distance is not None and victim_distance <= distance):
            return False
        self.evict(victim)
        return True

    def _start_fetch(self, s: UnitState, evict: bool) -> bool:
        # A prefetch only takes a free buffer of the unit's own size class: parking a small unit in
        # a large buffer would leave a large unit nowhere to go.
        ctx = self.ctx
        pool = ctx.memory.device_pool
        size = ctx.memory.own_class(s.unit.nbytes)
        slot = pool.acquire(size) if pool.free_slots(size) else None
        if slot is None and evict:
            slot = self._evict_for(s.unit.nbytes)
            if slot is None:
                in_use = [x.unit.name for x in ctx.states if x.pins > 0 or x.recompute_pinned]
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
            fetch.event = s.home_read = ctx.device.copy_to_device(slot.tensor[:n], ctx.home_bytes(s))
        elif s.host_copy is not None:
            # The copy kept in host memory is current: no NVMe read (10Cache Alg. 4).
            fetch.event = s.host_copy_read = ctx.device.copy_to_device(slot.tensor[:n], s.host_copy.tensor[:n])
            ctx.requests.nvme_reads_avoided += 1
        else:
            staging = self.staging(n, wait=evict, keep=s)
            if staging is None:  # no staging buffer free: leave it for an on-demand fetch
                pool.release(slot)
                return False
            fetch.staging = staging
            store = ctx.store
            assert store is not None, "an NVMe unit implies the NVMe store"
            fetch.nvme = store.read(ctx.key(s), staging.tensor[: align(n, HOST_SLOT_ALIGNMENT)])
        s.device_slot, s.fetch = slot, fetch
        self.slot_owner[slot.tensor.data_ptr()] = s
        return True

    def complete(self, s: UnitState) -> float:
        """Wait for the unit's fetch to finish; returns seconds this thread was blocked."""
        fetch = s.fetch
        # callers complete a fetch they found, or the one ``_start_fetch(evict=True)`` started
        assert fetch is not None, f"unit {s.unit.name!r} has no fetch in flight"
        start = time.perf_counter()
        if fetch.nvme is not None:
            fetch.nvme.result()
            fetch.event = self.ctx.device.copy_to_device(fetch.slot.tensor[: s.unit.nbytes], _staging_of(fetch).tensor[: s.unit.nbytes])
            fetch.nvme = None
        assert fetch.event is not None, "a fetch's copy into the GPU tier starts with it, or once its NVMe read landed (above)"
        self._wait_timed(fetch.event)
        if fetch.staging is not None:
            s.host_copy = fetch.staging  # keep it: backward and the optimizer step need the unit again
            s.host_copy_read = fetch.event  # until the host waits for it, the slot stays as it is
        s.fetch = None
        return time.perf_counter() - start

    def _wait_timed(self, event: Event) -> None:
        """Order compute after a unit's copy; in a timed step, with marks either side of the wait."""
        device, marks = self.ctx.device, self.ctx.step.stall_marks
        before = device.mark_time() if marks is not None else None
        device.wait(event)
        if marks is not None and before is not None:
            marks.append((before, device.mark_time()))

    def staging(self, nbytes: int, wait: bool, keep: Optional[UnitState] = None) -> Optional[Slot]:
        """A free staging buffer, dropping the kept host copy needed farthest ahead (never ``keep``'s) if none is free."""
        pool = self.ctx.memory.staging_pool
        slot = pool.try_acquire(nbytes)
        while slot is None:
            victim = self._copy_to_drop(nbytes, wait, keep)
            if victim is not None:
                self.drop_host_copy(victim)
            elif wait and any(x.fetch is not None and x.fetch.staging is not None for x in self.ctx.states):
                self.drain_staging()
            else:
                return None
            slot = pool.try_acquire(nbytes)
        return slot

    def _copy_to_drop(self, nbytes: int, wait: bool, keep: Optional[UnitState]) -> Optional[UnitState]:
        ctx = self.ctx
        kept = [x.unit.index for x in ctx.states if x.host_copy is not None and x.fetch is None and x is not keep and x.host_copy.slot_bytes >= nbytes]
        farthest = ctx.table.farthest(kept)  # None only where ``kept`` is empty
        victim = ctx.states[farthest] if farthest is not None else None
        if victim is not None and not wait and keep is not None:
            # a prefetch may only displace a copy needed later than the unit it brings in
            theirs, ours = ctx.table.next_use(victim.unit.index), ctx.table.next_use(keep.unit.index)
            if theirs is not None and (ours is None or theirs <= ours):
                return None
        return victim

    def drop_host_copy(self, s: UnitState) -> None:
        if s.host_copy is not None:
            self.settle_host_copy(s)
            self.ctx.memory.staging_pool.release(s.host_copy)
            s.host_copy = None

    def forget_host_copy(self, s: UnitState) -> None:
        """The slab the kept copy lives in is freed (the engine closes): reads come from the file."""
        s.host_copy = None

    def host_copy_for_update(self, s: UnitState) -> Slot:
        """The NVMe unit's kept host copy, read from NVMe first if there is none, for an update in
        place there (nothing still copies out of it)."""
        ctx = self.ctx
        if s.host_copy is None:
            staging = self.staging(s.unit.nbytes, wait=True)
            if staging is None:
                raise RuntimeError(f"no NVMe staging buffer is free for unit {s.unit.name!r}; raise host_memory.")
            store = ctx.store
            assert store is not None, "NVMe units have the store"
            store.read(ctx.key(s), staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
            s.host_copy = staging
        self.settle_host_copy(s)
        ctx.device.check_host_access(s.host_copy.tensor, "updates an NVMe unit in its kept staging copy")
        return s.host_copy

    def drain_staging(self) -> None:
        for s in self.ctx.states:
            if s.fetch is not None and s.fetch.staging is not None:
                self.complete(s)

    def _progress_nvme(self) -> None:
        """Start the host → GPU copy of NVMe reads that have landed."""
        device = self.ctx.device
        for s in self.ctx.states:
            fetch = s.fetch
            if fetch is not None and fetch.nvme is not None and fetch.nvme.done():
                fetch.nvme.result()
                fetch.nvme = None
                fetch.event = device.copy_to_device(fetch.slot.tensor[: s.unit.nbytes], _staging_of(fetch).tensor[: s.unit.nbytes])

    def evictable(self, level: "Protection") -> list[int]:
        """Resident offloaded units not in use, less those ``level`` still protects (see
        :class:`Protection`)."""
        backward = self.ctx.step.phase is Phase.BACKWARD
        out = []
        for s in self.ctx.states:
            if s.home == GPU or not s.resident or s.pins > 0 or s.recompute_pinned:
                continue
            recent = backward and s.unit.index in self.recent
            if level is not Protection.NONE and recent:
                continue
            # read as an attribute outside a forward: kept while there is room, never at the cost
            # of a module that needs a buffer now (the placement's minimum does not count them)
            touched = s.unit.index in self.touched
            waiting_for_grads = s.used_in_backward and s.grads_arrived < len(s.unit.trainable)
            if level is Protection.ALL and (touched or waiting_for_grads):
                continue
            out.append(s.unit.index)
        return out

    def _evict_for(self, nbytes: int) -> Optional[Slot]:
        """A buffer for ``nbytes``, in the unit's own size class while anything there can be freed,
        since a unit parked in a larger buffer may hold it while a larger unit of the same module
        or recomputed block needs it, which the placement's minimum does not count: a free one,
        else by evicting the unit needed farthest ahead that nothing protects, else one whose
        copy is still landing (a prefetch along an order this step does not follow), else one
        kept for its gradients; only then a larger class, and last anything not in use."""
        ctx = self.ctx
        sizes = [c for c in ctx.memory.class_sizes if c >= nbytes]
        own, larger = sizes[:1], sizes[1:]
        while True:
            order = ((own, Protection.ALL), (own, Protection.LANDING), (own, Protection.RECENT), (larger, Protection.ALL), (sizes, Protection.NONE))
            for classes, level in order:
                slot = self._free_or_evict(classes, level)
                if slot is not None:
                    return slot
            if not any(x.fetch is not None for x in ctx.states):
                return None
            self.drain_prefetches()  # units in flight become evictable once they land

    def _free_or_evict(self, classes: list[int], level: "Protection") -> Optional[Slot]:
        ctx = self.ctx
        pool = ctx.memory.device_pool
        for size in classes:
            protected = level
            if level is Protection.LANDING:
                landing = [x for x in ctx.states if x.fetch is not None and slot_of(x).slot_bytes == size]
                if not landing:
                    continue
                for x in landing:  # fetches nobody has asked for yet: they land, then may go
                    self.complete(x)
                protected = Protection.ALL
            if pool.free_slots(size):
                return pool.acquire(size)
            victim = ctx.table.farthest([i for i in self.evictable(protected) if slot_of(ctx.states[i]).slot_bytes == size])
            if victim is not None:
                self.evict(victim)
                return pool.acquire(size)
        return None

    def drain_prefetches(self) -> None:
        for s in self.ctx.states:
            if s.fetch is not None:
                self.complete(s)

    def evict(self, index: int) -> None:
        s = self.ctx.states[index]
        if s.fetch is not None:
            self.complete(s)
        self.keep_writes(s)
        self.bind(s, self._away(s))
        s.bound = False
        slot = slot_of(s)  # evicted: resident (its fetch completed above)
        del self.slot_owner[slot.tensor.data_ptr()]
        self.ctx.memory.device_pool.release(slot)
        s.device_slot = None
        # autocast keeps the 16-bit cast of every trainable weight until its region exits: the
        # evicted unit's would stay in the GPU tier (this thread's cache; the others' casts are
        # made again when next used, with the same bits)
        torch.clear_autocast_cache()

    @torch.no_grad()
    def keep_writes(self, s: UnitState) -> None:
        """User code wrote the unit's GPU-tier copy in place (:meth:`note_writes`): its
        values go home now, before its eviction or an update at home would lose them. So does a
        copy whose ``.data`` user code took (writes through it leave no trace)."""
        written = self.note_writes(s) or bool(s.handed_out)
        s.written |= s.handed_out
        s.handed_out = set()
        if not (written and s.bound and s.device_slot is not None and s.home != GPU):
            return
        nbytes = s.unit.nbytes
        copy = s.device_slot.tensor[:nbytes]
        if s.home == HOST:
            self.ctx.home_bytes(s).copy_(copy)
            return
        buffer = torch.empty(align(nbytes, HOST_SLOT_ALIGNMENT), dtype=torch.uint8)
        buffer[:nbytes].copy_(copy)
        self.write_home(s, buffer)

    def take_written(self, s: UnitState) -> set[int]:
        """Positions of the unit's parameters user code wrote in place since its last update (for
        that update, which starts afresh)."""
        self.note_writes(s)
        positions, s.written = s.written, set()
        return positions

    def evict_all(self) -> None:
        for index in self.held:
            self.unpin(index)
        self.held.clear()
        for s in self.ctx.states:
            if s.home != GPU and s.device_slot is not None:
                self.evict(s.unit.index)
        for index in sorted(self.on_device_views):
            s = self.ctx.states[index]
            if s.device_slot is None:
                self.bind(s, s.home_views)
        self.on_device_views.clear()

    def bind(self, s: UnitState, tensors: Sequence[torch.Tensor]) -> None:
        """Point the unit's parameters at ``tensors`` (its placeholders: marked offloaded)."""
        self.note_writes(s)
        away = bool(s.placeholders) and tensors is s.placeholders
        for p, name, t in zip(s.unit.params, s.unit.param_names, tensors):
            mark_present(p)
            p.data = t
            if away:
                mark_offloaded(p, self.ctx.offloaded_class, name)
        s.bound_to = list(tensors)
        s.bound_versions = [p._version for p in s.unit.params]

    @staticmethod
    def note_writes(s: UnitState) -> bool:
        """Whether user code wrote one of the unit's parameters in place since the engine pointed it
        (``nn.Embedding(max_norm=...)`` renormalises its weight in every forward; a constraint
        applied under ``torch.no_grad()`` inside the training step). Such writes move the
        parameter's version counter; they are recorded in ``s.written`` so that fp32 masters kept
        apart take the written values before the next update. A write through ``p.data`` moves no
        counter and is not seen."""
        if len(s.bound_versions) != len(s.unit.params):
            return False
        written = {i for i, (p, v) in enumerate(zip(s.unit.params, s.bound_versions)) if p._version != v}
        if written:
            s.written |= written
            s.bound_versions = [p._version for p in s.unit.params]
        return bool(written)

    def settle_host_copy(self, s: UnitState) -> None:
        """The host waits for the last copy out of the unit's kept staging copy into the GPU tier:
        a device-side wait ordered only compute after it, so on CUDA it may still be queued, and
        releasing, refilling or writing the slot now would change what it copies."""
        if s.host_copy_read is not None:
            self.ctx.device.host_wait(s.host_copy_read)
            s.host_copy_read = None

    def settle_home(self, s: UnitState) -> None:
        """The host waits for the last copy out of a host unit's home into the GPU tier before it
        writes the home: a unit fetched ahead and evicted unused (a skipped layer, a prefetch the
        step did not reach) had only a device-side wait, so on CUDA the copy may still be queued."""
        if s.home_read is not None:
            self.ctx.device.host_wait(s.home_read)
            s.home_read = None

    def write_home(self, s: UnitState, buffer: torch.Tensor) -> None:
        """An NVMe unit's new bytes go home (and to its kept host copy)."""
        store = self.ctx.store
        assert store is not None, "NVMe units have the store"
        store.write(self.ctx.key(s), buffer).result()
        if s.host_copy is not None:
            self.settle_host_copy(s)
            self.ctx.device.check_host_access(s.host_copy.tensor, "writes an NVMe unit's kept staging copy")
            s.host_copy.tensor[: buffer.numel()].copy_(buffer)

    @torch.no_grad()
    def move_to_homes(
        self, write_values: Callable[[UnitState, list[torch.Tensor]], None], write_host_values: Callable[[UnitState, list[torch.Tensor]], None],
    ) -> None:
        """Set-up: each unit's values written at its home (``write_values``: into the tensors
        given; host homes through ``write_host_values``, which where another rank writes shared
        homes writes nothing), its parameters pointed there (an NVMe unit's at placeholders of
        the right shape holding no memory)."""
        ctx = self.ctx
        for s in ctx.states:
            if s.home == GPU:
                targets = s.unit.views(slot_of(s).tensor)
                write_values(s, targets)
                self.bind(s, targets)
                s.bound = True
            elif s.home == HOST:
                write_host_values(s, s.home_views)
                self.bind(s, s.home_views)
            else:
                self._write_to_nvme(s, write_values)
            for i, p in enumerate(s.unit.params):
                ctx.param_slot[id(p)] = (s, i)

    def _write_to_nvme(self, s: UnitState, write_values: Callable[[UnitState, list[torch.Tensor]], None]) -> None:
        ctx = self.ctx
        staging = ctx.memory.staging_pool.acquire(s.unit.nbytes)
        write_values(s, s.unit.views(staging.tensor))
        store = ctx.store
        assert store is not None, "NVMe units have the store"
        store.write(ctx.key(s), staging.tensor[: align(s.unit.nbytes, HOST_SLOT_ALIGNMENT)]).result()
        ctx.memory.staging_pool.release(staging)
        s.placeholders = [nan_placeholder(p, ctx.device.compute) for p in s.unit.params]
        self.bind(s, s.placeholders)

    def _away(self, s: UnitState) -> list[torch.Tensor]:
        """What an evicted unit's parameters point at: NVMe units at placeholders, host units at
        their homes, except inside a step on a GPU. There PyTorch drops a parameter's gradient
        accumulator when its ``.data`` moves to another device, and a parameter used twice in one
        graph (a tied embedding, evicted between its uses) would get two accumulators, each of which
        completes the unit: an update on part of the gradient. So there they point at views of their
        homes from the GPU (direct host access): the same values, on the same device."""
        if s.home != HOST:
            return s.placeholders
        compute = self.ctx.device.compute
        if not self.ctx.step.active or compute.type != "cuda" or not all(can_view(v, compute) for v in s.home_views):
            return s.home_views
        self.on_device_views.add(s.unit.index)
        return [device_view(v, compute) for v in s.home_views]


def _fetch_done(fetch: Fetch) -> bool:
    return (fetch.nvme is None or fetch.nvme.done()) and fetch.event is not None and fetch.event.done()


def _staging_of(fetch: Fetch) -> Slot:
    """The staging buffer an NVMe read in flight lands in (``_start_fetch`` sets both together)."""
    assert fetch.staging is not None, "an NVMe read lands in a staging buffer"
    return fetch.staging


def _refuse_rebinding_inside_a_step(s: UnitState, rebound: dict[int, torch.Tensor]) -> None:
    """A parameter given a tensor of its own inside a training step: the step has already placed
    the unit (its fetch, its update), so the new value would be lost or overwritten."""
    if rebound:
        names = ", ".join(repr(s.unit.param_names[i]) for i in rebound)
        raise RuntimeError(
            f"parameter {names} was given a new tensor (`.data = ...`) inside a training step, where the tiered strategy "
            f"has already placed its unit, so the new value would not be the one trained. Write the value in place "
            f"(`with torch.no_grad(): p.copy_(value)`), or replace `.data` between steps (a callback's "
            f"`on_train_batch_end` or `on_train_batch_start`), where the value is adopted."
        )
