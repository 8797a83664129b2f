"""Optimizer states of the units whose home is NVMe: read before their step, written after.

Between steps the optimizer holds, for each such state tensor, a placeholder of the right shape that
owns no memory (NaN if ever read); the values live in one NVMe file per unit (10Cache §3.4.2 splits
optimizer states between CPU and NVMe the same way). The layout of a unit's states is learnt from
the tensors the optimizer creates at its first step, so any per-parameter optimizer works. Scalar
states (Adam's step count) stay in memory: they are a few bytes and the optimizer may keep them
on the CPU whatever the parameter's device.

A unit whose parameters several optimizers hold (Muon for the weight matrices, AdamW for the
biases) keeps every optimizer's states in its one file, each entry knowing its optimizer: an
update of one loads and writes the others' unchanged.

Under ``*-true`` precisions the fp32 master of each low-precision parameter is stored with its
states (key ``None`` in the layout): it is read and written at the same times, and an update reads
and writes the low-precision copy, which is what forward fetches, beside it.

A unit's first step makes its states where they will be stored (``StatesMadeInBuffer``): in a
staging buffer host_memory counts, not as fresh tensors of the heap packed into one after the step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...memory.nvme import NvmeStore
from ...planning.placement import HOST_SLOT_ALIGNMENT, align
from ..state import one_element
from ..units import PARAM_ALIGNMENT


@dataclass(frozen=True)
class _Entry:
    optimizer: torch.optim.Optimizer
    param: torch.Tensor  # a master (the parameter itself, or its fp32 copy)
    key: Optional[str]  # None: the master itself
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()

    def value(self) -> torch.Tensor:
        return self.param.data if self.key is None else self.optimizer.state[self.param][self.key]

    def set(self, value: torch.Tensor) -> None:
        if self.key is None:
            self.param.data = value
        else:
            self.optimizer.state[self.param][self.key] = value


def next_offset(offset: int, nbytes: int) -> int:
    """Where the entry after one of ``nbytes`` at ``offset`` starts in a unit's states buffer."""
    return align(offset + nbytes, PARAM_ALIGNMENT)


_aten = torch.ops.aten
# ops that make a tensor shaped like their input: how optimizers create their states (Adam's
# ``zeros_like``, SGD's momentum a ``clone`` of the gradient); -> what fills the new tensor
MADE_LIKE: dict[Any, Callable[[torch.Tensor, tuple, dict], Any]] = {
    _aten.zeros_like.default: lambda out, args, kwargs: out.zero_(),
    _aten.ones_like.default: lambda out, args, kwargs: out.fill_(1),
    _aten.full_like.default: lambda out, args, kwargs: out.fill_(args[1]),
    _aten.empty_like.default: lambda out, args, kwargs: None,
    _aten.clone.default: lambda out, args, kwargs: out.copy_(args[0]),
}


class StatesMadeInBuffer(TorchDispatchMode):
    """Active on the updating thread through a unit's first optimizer step: the tensors the
    optimizer makes like its parameters (``MADE_LIKE``) are made in ``buffer`` from ``start``
    on, one after another as :meth:`NvmeOptimizerStates.learn` lays states out, so the step's new
    states take no memory beyond the buffer (before, they were heap tensors as large as twice the
    unit under Adam, alive beside the buffer they were then copied into). A tensor made otherwise,
    one not contiguous, or one the buffer has no room left for is made as usual; the layout copies
    it in after the step (:meth:`NvmeOptimizerStates.in_place`)."""

    def __init__(self, buffer: torch.Tensor, start: int = 0) -> None:
        super().__init__()
        self.buffer = buffer
        self.offset = start
        self.made = 0  # tensors made in the buffer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        fill = MADE_LIKE.get(func)
        out = self._place(func, args, kwargs) if fill is not None else None
        if fill is None or out is None:
            return func(*args, **kwargs)
        fill(out, args, kwargs)
        return out

    def _place(self, func: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """A view of the buffer shaped as ``func`` would make its result; None where it cannot be."""
        source = args[0] if args else None
        if not isinstance(source, torch.Tensor) or source.device.type != "cpu" or source.dim() == 0:
            return None
        if kwargs.get("device") not in (None, torch.device("cpu"), "cpu") or kwargs.get("pin_memory"):
            return None
        meta = func(source.to("meta"), *args[1:], **{**kwargs, "device": "meta"} if func is not _aten.clone.default else kwargs)
        nbytes = meta.numel() * meta.element_size()
        if not meta.is_contiguous() or self.offset + nbytes > self.buffer.numel():
            return None
        out = self.buffer[self.offset : self.offset + nbytes].view(meta.dtype).view(meta.shape)
        self.offset = next_offset(self.offset, nbytes)
        self.made += 1
        return out


class NvmeOptimizerStates:
    """The NVMe side of the optimizer states, unit by unit."""

    def __init__(self, store: NvmeStore) -> None:
        self.store = store
        self.layouts: dict[int, list[_Entry]] = {}
        self.sizes: dict[int, int] = {}
        self.placeholders: dict[int, list[torch.Tensor]] = {}  # made once: dropping states allocates nothing
        self.loaded: set[int] = set()  # units whose entries hold their values in memory, not placeholders

    @staticmethod
    def _file(unit: int) -> str:
        return f"states{unit}"

    def known(self, unit: int) -> bool:
        return unit in self.layouts

    @staticmethod
    def _tensor_states(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
        return [key for key, value in optimizer.state.get(p, {}).items() if torch.is_tensor(value) and value.dim() > 0]

    def matches(self, optimizer: torch.optim.Optimizer, unit: int, params: Sequence[torch.Tensor]) -> bool:
        """The learnt layout still holds every state tensor (an optimizer may add some at a later step)."""
        stored = {(id(e.param), e.key) for e in self.layouts[unit] if e.key is not None and e.optimizer is optimizer}
        return stored == {(id(p), key) for p in params for key in self._tensor_states(optimizer, p)}

    def learn(self, optimizer: torch.optim.Optimizer, unit: int, params: Sequence[torch.Tensor], masters: Sequence[bool] = ()) -> int:
        """Record where each non-scalar state tensor of ``params`` goes in the unit's buffer, and
        each param itself where ``masters`` says so (fp32 masters), after the entries of other
        optimizers holding parameters of the unit; return the buffer's size."""
        others = self._others_in_memory(optimizer, unit)
        entries, offset = [], 0
        for e in others:
            entries.append(replace(e, offset=offset))
            offset = next_offset(offset, e.nbytes)
        for p, stored in zip(params, masters):
            if stored:
                entries.append(_Entry(optimizer, p, None, tuple(p.shape), p.dtype, offset))
                offset = next_offset(offset, entries[-1].nbytes)
        for p in params:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    entries.append(_Entry(optimizer, p, key, tuple(value.shape), value.dtype, offset))
                    offset = next_offset(offset, entries[-1].nbytes)
        if not entries:
            # nothing to store (SGD without momentum, or no gradient yet for a module first used
            # later): the unit stays unknown, so no later update reads a file never written
            self.forget(unit)
            return 0
        self.layouts[unit] = entries
        self.sizes[unit] = align(offset, HOST_SLOT_ALIGNMENT)
        self.placeholders[unit] = [one_element(float("nan"), e.shape, e.dtype) for e in entries]
        self.loaded.add(unit)
        return self.sizes[unit]

    def _others_in_memory(self, optimizer: torch.optim.Optimizer, unit: int) -> list[_Entry]:
        """The unit's entries of other optimizers, each holding a tensor of its own (a copy of a
        loaded one, else the file's value), so that a new layout keeps them."""
        others = [e for e in self.layouts.get(unit, []) if e.optimizer is not optimizer]
        if not others:
            return []
        if unit in self.loaded:
            values = [e.value().clone() for e in others]
        else:
            buffer = torch.empty(self.sizes[unit], dtype=torch.uint8)
            self.read(unit, buffer).result()
            stored = dict(zip(map(id, self.layouts[unit]), self.views(unit, buffer)))
            values = [stored[id(e)] for e in others]
        for e, value in zip(others, values):
            e.set(value)
        return others

    def own(self, unit: int) -> None:
        """Every entry of a loaded unit holds a copy of its own, so that the buffer it was loaded
        into can go back before the unit's states are laid out again."""
        if unit in self.loaded:
            for entry in self.layouts[unit]:
                entry.set(entry.value().clone())

    def in_place(self, unit: int, buffer: torch.Tensor) -> bool:
        """Every entry of the unit's layout holds its value at its place in ``buffer`` already
        (made there by ``StatesMadeInBuffer``): saving it copies nothing."""
        if self.sizes[unit] > buffer.numel():
            return False
        return all(e.value().data_ptr() == view.data_ptr() for e, view in zip(self.layouts[unit], self.views(unit, buffer)))

    def views(self, unit: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.layouts[unit]]

    def current_values(self, unit: int) -> list[torch.Tensor]:
        """What each entry of the unit's layout points at now (placeholders between steps)."""
        return [e.value() for e in self.layouts[unit]]

    def read(self, unit: int, buffer: torch.Tensor) -> Any:
        """Start reading the unit's states into ``buffer``; a Future."""
        return self.store.read(self._file(unit), buffer[: self.sizes[unit]])

    def load(self, unit: int, buffer: torch.Tensor, read: bool = True) -> None:
        """Read the unit's states into ``buffer`` (unless already read there) and let its optimizer use them in place."""
        if read:
            self.read(unit, buffer).result()
        for entry, view in zip(self.layouts[unit], self.views(unit, buffer)):
            entry.set(view)
        self.loaded.add(unit)

    def save(self, unit: int, buffer: torch.Tensor, wait: bool = True) -> Any:
        """Write the unit's states (gathered into ``buffer`` unless already there) and drop them from
        memory; with ``wait=False`` the write's Future is returned and ``buffer`` must stay untouched until it is done."""
        for entry, view in zip(self.layouts[unit], self.views(unit, buffer)):
            value = entry.value()
            if value.data_ptr() != view.data_ptr():
                view.copy_(value)
        written = self.store.write(self._file(unit), buffer[: self.sizes[unit]])
        self._drop(unit)
        if wait:
            written.result()
        return written

    def drop(self, unit: int) -> None:
        """The unit's states, unchanged since loaded, leave memory (placeholders again)."""
        self._drop(unit)

    def _drop(self, unit: int) -> None:
        for entry, placeholder in zip(self.layouts[unit], self.placeholders[unit]):
            entry.set(placeholder)
        self.loaded.discard(unit)

    @contextlib.contextmanager
    def unit_in_memory(self, unit: int) -> Iterator[None]:
        """The unit's offloaded states (if it has any) are real tensors of their own for the
        duration: one unit's at a time, so that bringing states back never holds two copies of more."""
        if unit not in self.layouts or unit in self.loaded:
            yield
            return
        self.load(unit, torch.empty(self.sizes[unit], dtype=torch.uint8))
        try:
            yield
        finally:
            self._drop(unit)

    def reader(self, unit: int) -> Optional[Callable[[], dict[tuple[int, Optional[str]], torch.Tensor]]]:
        """A function reading the unit's states from its file, each into a tensor of its own, keyed
        by (id of the master, state's key); None where the unit has none on NVMe. It holds the
        store and the layout's places, nothing of the engine, so that what reads after training
        keeps no tier's memory alive."""
        if unit not in self.layouts or unit in self.loaded:
            return None
        return _file_reader(self.store, self._file(unit), self.sizes[unit], [e for e in self.layouts[unit] if e.key is not None])

    def hand_over(self) -> dict[tuple[int, int], Callable[[], dict[tuple[int, Optional[str]], torch.Tensor]]]:
        """For the engine that places the units next: for each unit whose states are on NVMe and
        each optimizer with entries there, keyed by (unit, id of the optimizer), a function reading
        that optimizer's entries from the unit's file, each into a tensor of its own (a master
        under the key None). The file is deleted once every optimizer's entries have been read, so
        the old store gives back its disk unit by unit as the next engine takes them. The
        functions hold the store, nothing of the engine."""
        readers = {}
        for unit, layout in self.layouts.items():
            if unit in self.loaded:
                continue
            optimizers = {id(e.optimizer): e.optimizer for e in layout}
            release = _Countdown(len(optimizers), functools.partial(self.store.delete, self._file(unit)))
            for key, optimizer in optimizers.items():
                entries = [e for e in layout if e.optimizer is optimizer]
                readers[(unit, key)] = _file_reader(self.store, self._file(unit), self.sizes[unit], entries, release.count)
        return readers

    @contextlib.contextmanager
    def materialized(self, skip: frozenset[int] = frozenset()) -> Iterator[None]:
        """Every offloaded state (but the units ``skip``) is a real tensor of its own for the duration (checkpoints)."""
        units = [unit for unit in self.layouts if unit not in skip]
        for unit in units:
            self.load(unit, torch.empty(self.sizes[unit], dtype=torch.uint8))
        try:
            yield
        finally:
            for unit in units:
                self._drop(unit)

    def adopt(self, optimizer: torch.optim.Optimizer, unit: int, params: Sequence[torch.Tensor], masters: Sequence[bool] = ()) -> None:
        """States ``optimizer`` holds in memory for an NVMe unit (just loaded from a checkpoint), and
        the masters ``masters`` marks: offload them."""
        if self.learn(optimizer, unit, params, masters):
            self.save(unit, torch.empty(self.sizes[unit], dtype=torch.uint8))

    def drop_entries(self, unit: int, optimizer: Optional[torch.optim.Optimizer], param: torch.Tensor) -> None:
        """User code removed or replaced ``param``'s states in ``optimizer`` (``optimizer.state.clear()``,
        a fresh dict): the file no longer holds them, and the unit's next update lays its states
        out again with what the optimizer then holds. An fp32 master kept with them stays."""
        layout = self.layouts.get(unit)
        if layout is None or optimizer is None:
            return
        keep = [k for k, e in enumerate(layout) if e.key is None or e.optimizer is not optimizer or e.param is not param]
        if not keep:
            self.forget(unit)
        elif len(keep) < len(layout):
            self.layouts[unit] = [layout[k] for k in keep]
            self.placeholders[unit] = [self.placeholders[unit][k] for k in keep]

    def forget(self, unit: int) -> None:
        """The unit has no states on NVMe (any file it had is stale)."""
        for table in (self.layouts, self.sizes, self.placeholders):
            table.pop(unit, None)
        self.loaded.discard(unit)


def _file_reader(
    store: NvmeStore, name: str, size: int, entries: Sequence[_Entry], after: Callable[[], None] = lambda: None,
) -> Callable[[], dict[tuple[int, Optional[str]], torch.Tensor]]:
    """A function reading ``entries`` from the file ``name`` of ``size`` bytes, each into a tensor
    of its own keyed by (id of its master, its key), then calling ``after``."""
    places = [(id(e.param), e.key, e.offset, e.nbytes, e.dtype, e.shape) for e in entries]

    def read() -> dict[tuple[int, Optional[str]], torch.Tensor]:
        buffer = torch.empty(size, dtype=torch.uint8)
        store.read(name, buffer).result()
        values = {(param, key): buffer[offset : offset + nbytes].view(dtype).view(shape).clone() for param, key, offset, nbytes, dtype, shape in places}
        after()
        return values

    return read


class _Countdown:
    """Calls ``then`` at the ``times``-th call of :meth:`count`."""

    def __init__(self, times: int, then: Callable[[], None]) -> None:
        self.left, self.then = times, then

    def count(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.then()
