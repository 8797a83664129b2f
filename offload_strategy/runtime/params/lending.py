"""Parameters and optimizer states read or written by user code between steps (a callback, a
logger, an EMA, a checkpoint): they hold their true values at home, where writes are kept. Host
units are bound there already; an NVMe unit is *lent* — read into a host buffer until the next
step, optimizer step or checkpoint takes it back, and written home if it changed. A tensor user
code gives a parameter (``p.data = t``) counts as a write of its values there.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Callable, Optional

import torch

from ...memory.nvme import NvmeStore
from ...planning.placement import GPU, HOST, HOST_SLOT_ALIGNMENT, NVME, align
from .cache import UnitCache
from ..context import EngineContext
from ..updates.nvme_states import NvmeOptimizerStates
from .offloaded import mark_present
from ..updates.optimizers import compact
from ..state import UnitState
from ..updates.updater import UnitUpdater


class Lending:
    def __init__(self, ctx: EngineContext, cache: UnitCache, updater: UnitUpdater, nvme_states: Optional[NvmeOptimizerStates]) -> None:
        self.ctx, self.cache, self.updater, self.nvme_states = ctx, cache, updater, nvme_states
        # unit -> (host buffer bound, its value when lent) for NVMe, None for host
        self.lent: dict[int, Optional[tuple[torch.Tensor, torch.Tensor]]] = {}
        # NVMe units whose optimizer states were read through the user's optimizer: unit -> (buffer, its value when lent)
        self.lent_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.closed = False

    @torch.no_grad()
    def lend(self, s: UnitState) -> None:
        """The unit holds its true values at home until taken back (see the module docstring);
        parameters the user gave tensors of their own meanwhile keep those values."""
        rebound = self._take_rebound(s)
        if s.unit.index not in self.lent:
            self._lend(s)
        self._write_rebound(s, rebound)

    def _lend(self, s: UnitState) -> None:
        index = s.unit.index
        if s.device_slot is not None:
            self.cache.evict(index)  # a GPU-tier copy would take writes that never reach home
        if s.home == HOST:
            # the home itself goes to user code: no copy issued since the batch's fence (a forward
            # between steps fetched it) may still read it when user code writes it
            self.ctx.device.synchronize()
            self.lent[index] = None
            return
        buffer = self.ctx.read_home(s)
        self.cache.bind(s, s.unit.views(buffer))
        self.lent[index] = (buffer, buffer.clone())

    @torch.no_grad()
    def lend_states(self, unit_index: int) -> None:
        """An NVMe unit's optimizer states read through the user's optimizer (``optimizer.state``)
        between steps. Inside a step they are the update's own."""
        states = self.nvme_states
        if self.ctx.step.active or self.closed or states is None or not states.known(unit_index) or unit_index in self.lent_states:
            return
        if self.ctx.states[unit_index].home != NVME:
            return
        buffer = torch.empty(states.sizes[unit_index], dtype=torch.uint8)
        states.load(unit_index, buffer)
        self.lent_states[unit_index] = (buffer, buffer.clone())

    @contextlib.contextmanager
    def states_materialized(self) -> Iterator[None]:
        """Every NVMe unit's optimizer states in memory (a checkpoint), after lent ones went home."""
        self.take_back()
        assert self.nvme_states is not None, "set as the optimizers' ``_materialize`` only beside NVMe states (engine)"
        with self.nvme_states.materialized():
            yield

    @torch.no_grad()
    def adopt_rebound(self) -> None:
        """Parameters user code gave tensors of their own (``p.data = t``: a re-initialisation, a
        max-norm constraint, ``ModelPruning``'s reset to the initial weights) hold those values
        where the engine keeps the parameter, as if written in place, and point there again; a
        tensor of another shape or dtype is refused."""
        for s in self.ctx.states:
            if s.home == GPU:
                self._write_rebound(s, self._take_rebound(s))
            elif self.ctx.rebound(s):
                self.lend(s)

    def _take_rebound(self, s: UnitState) -> dict[int, torch.Tensor]:
        """The tensors the user gave the unit's parameters; the parameters point where the engine
        had them again, so that moving the unit moves them."""
        rebound = self.ctx.rebound(s)
        for i, value in rebound.items():
            _check_rebound(s, i, value)
        if rebound:
            self.cache.bind(s, s.bound_to)
        return rebound

    def _write_rebound(self, s: UnitState, rebound: dict[int, torch.Tensor]) -> None:
        for i, value in rebound.items():
            s.bound_to[i].copy_(value)
            if _shares_memory_with_another_tensor(value):
                warnings.warn(
                    f"parameter {s.unit.param_names[i]!r} was given a tensor (`.data = ...`) whose memory another live tensor "
                    f"shares. The tiered strategy takes its values, but the parameter does not go on sharing that memory as "
                    f"it would in plain training, so later writes to either no longer show in the other. Lightning's "
                    f"`ModelPruning` with `use_lottery_ticket_hypothesis=True` relies on this sharing from its second reset on "
                    f"(docs/compatibility.md).",
                    stacklevel=2,
                )
        if rebound:
            self.updater.mark_masters_stale({id(s.unit.params[i]) for i in rebound})

    @torch.no_grad()
    def take_back(self) -> None:
        """Units lent between steps return: what was written goes home, fp32 masters kept apart
        from a written 16-bit parameter take its new value, NVMe units point at placeholders again."""
        self.adopt_rebound()
        lent_states, self.lent_states = self.lent_states, {}
        for index, (buffer, before) in lent_states.items():
            states = self.nvme_states
            assert states is not None, "only NVMe states are lent (lend_states)"
            if not states.known(index):
                continue  # user code removed every state the unit kept there
            if torch.equal(buffer, before):
                states.drop(index)
            else:
                states.save(index, buffer)
        lent, self.lent = self.lent, {}
        for index, held in lent.items():
            s = self.ctx.states[index]
            if held is None:
                written = [m is not None and not torch.equal(h, m.to(h.dtype)) for h, m in zip(s.home_views, s.master_views)]
            else:
                buffer, before = held
                written = [not torch.equal(a, b) for a, b in zip(s.unit.views(buffer), s.unit.views(before))]
                if any(written):
                    self.cache.write_home(s, buffer)
                self.cache.bind(s, s.placeholders)
            self.updater.mark_masters_stale({id(p) for p, w in zip(s.unit.params, written) if w})

    @torch.no_grad()
    def stand_in_readers(self) -> dict[int, Callable[[], torch.Tensor]]:
        """For a checkpoint written tensor by tensor: each placeholder that an NVMe unit's
        parameter or optimizer state points at (by its storage's address) -> a function reading
        that value from disk. One unit's values are held at a time, so reading them in the
        state dict's order reads each unit once."""
        self.take_back()
        self.cache.evict_all()
        self.cache.drain_staging()  # every write behind is on disk
        held = _OneUnit()
        readers: dict[int, Callable[[], torch.Tensor]] = {}
        for s in self.ctx.states:
            if s.home != NVME:
                continue
            for position, placeholder in enumerate(s.placeholders):
                readers[storage_address(placeholder)] = functools.partial(held.parameter, self.ctx, s, position)
            states = self.nvme_states
            if states is not None and states.known(s.unit.index):
                for position, current in enumerate(states.current_values(s.unit.index)):
                    readers[storage_address(current)] = functools.partial(held.state, states, s.unit.index, position)
        return readers

    @contextlib.contextmanager
    def materialized(self, writeback: bool = False) -> Iterator[None]:
        """Every parameter holds its true value in a real tensor for the duration (checkpoints)."""
        self.take_back()
        self.cache.evict_all()
        self.cache.drain_staging()
        # Fresh buffers, not staging ones: every NVMe unit is bound at once, and staging buffers
        # are fewer than units.
        loaded: list[tuple[UnitState, torch.Tensor]] = []
        for s in self.ctx.states:
            if s.home != NVME:
                continue
            buffer = self.ctx.read_home(s)
            self.cache.bind(s, s.unit.views(buffer))
            loaded.append((s, buffer))
        try:
            yield
        finally:
            if writeback:
                self.updater.mark_masters_stale()
            for s, buffer in loaded:
                if writeback:
                    self.cache.write_home(s, buffer)
                self.cache.bind(s, s.placeholders)

    @torch.no_grad()
    def _in_host_tier(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views the engine's pinned slab (or the machine's shared one)."""
        slabs = [self.ctx.memory.slab, self.ctx.memory.shared_slab] if self.ctx.memory is not None else []
        return any(
            slab is not None and not slab.closed and slab.tensor.numel() > 0
            and slab.tensor.data_ptr() <= t.data_ptr() < slab.tensor.data_ptr() + slab.tensor.numel()
            for slab in slabs
        )

    def materialize_for_good(self, s: UnitState, leave_on_nvme: Optional[Callable] = None) -> None:
        """The unit's parameters become plain tensors holding their true values (an NVMe unit's
        handed to ``leave_on_nvme`` with a reader instead, where given). A persistent unit's keep
        their memory, no copy: the persistent units' region of the GPU tier is theirs from now on
        (each parameter over a storage of its own bytes, as ``compact`` makes it)."""
        if s.fetch is not None:
            self.cache.complete(s)
        for i, p in enumerate(s.unit.params):
            if s.home == GPU and s.device_slot is not None:
                p.data = compact(p.data)
            elif s.home == HOST and s.home_views:
                p.data = s.home_views[i].clone()
            if p.grad is not None and self._in_host_tier(p.grad):
                p.grad = p.grad.clone()  # a gradient at home: the slab is freed
        if s.home == HOST and s.home_views and self.ctx.memory is not None:
            self.ctx.memory.release_home(s)  # copied out: its pages go now, not with the slab
        if s.home == NVME and self.ctx.store is not None and s.placeholders and leave_on_nvme is not None:
            self.cache.forget_host_copy(s)  # the slab is freed: reads come from the file
            self.cache.bind(s, s.placeholders)
            read, unit = _file_reader(self.ctx.store, self.ctx.key(s), s.unit.nbytes), s.unit
            for i, p in enumerate(s.unit.params):
                mark_present(p)
                # a view of the unit's buffer, no copy of its own: the reader's caller copies it where
                # it goes (``Recipe.compute_into``: the next engine's home, or a tensor of its own)
                leave_on_nvme(p, s.unit.param_names[i], lambda i=i: unit.views(read())[i])
        elif s.home == NVME and self.ctx.store is not None and s.placeholders:
            self.cache.bind(s, [v.clone() for v in s.unit.views(self.ctx.read_home(s))])


def storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _OneUnit:
    """The last NVMe unit read for a checkpoint: the views of its parameters or of its states."""

    def __init__(self) -> None:
        self.key: Optional[tuple[str, int]] = None
        self.views: list[torch.Tensor] = []

    def _load(self, key: tuple[str, int], read: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        if self.key != key:
            self.key, self.views = None, []  # the last one goes before the next is read
            self.views, self.key = read(), key
        return self.views

    def parameter(self, ctx: EngineContext, s: UnitState, position: int) -> torch.Tensor:
        return compact(self._load(("parameters", s.unit.index), lambda: s.unit.views(ctx.read_home(s)))[position])

    def state(self, states: NvmeOptimizerStates, unit: int, position: int) -> torch.Tensor:
        def read() -> list[torch.Tensor]:
            buffer = torch.empty(states.sizes[unit], dtype=torch.uint8)
            states.read(unit, buffer).result()
            return states.views(unit, buffer)

        return compact(self._load(("states", unit), read)[position])


def _check_rebound(s: UnitState, position: int, value: torch.Tensor) -> None:
    bound = s.bound_to[position]
    if value.shape != bound.shape or value.dtype != bound.dtype:
        raise ValueError(
            f"parameter {s.unit.param_names[position]!r} was given a tensor of shape {tuple(value.shape)} and {value.dtype} "
            f"(`.data = ...`) where it has shape {tuple(bound.shape)} and {bound.dtype}; the tiered strategy keeps each "
            f"parameter's shape and dtype for the whole run. Write values in place (`with torch.no_grad(): p.copy_(value)`), "
            f"or change the model's shapes before `trainer.fit`."
        )


def _shares_memory_with_another_tensor(value: torch.Tensor) -> bool:
    """``value``'s storage is held by more than ``value`` itself (and the storage object asked);
    False where this torch cannot say."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(value.untyped_storage()._cdata) > 2


def _file_reader(store: NvmeStore, key: str, nbytes: int) -> Callable[[], torch.Tensor]:
    """A function reading an NVMe unit's bytes from its file into a fresh buffer (``EngineContext.read_home``
    without the engine: it holds the store alone)."""

    def read() -> torch.Tensor:
        buffer = torch.empty(align(nbytes, HOST_SLOT_ALIGNMENT), dtype=torch.uint8)
        store.read(key, buffer).result()
        return buffer

    return read
