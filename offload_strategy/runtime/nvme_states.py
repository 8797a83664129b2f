"""Optimizer states of the units whose home is NVMe: read before their step, written after.

Between steps the optimizer holds, for each such state tensor, a placeholder of the right shape that
owns no memory (NaN if ever read); the values live in one NVMe file per unit (10Cache §3.4.2 splits
optimizer states between CPU and NVMe the same way). The layout of a unit's states is learnt from
the tensors the optimizer creates at its first step, so any per-parameter optimizer works. Scalar
states (Adam's step count) stay in memory: they are a few bytes and the optimizer may keep them
on the CPU whatever the parameter's device.

Under ``*-true`` precisions the fp32 master of each low-precision parameter is stored with its
states (key ``None`` in the layout): it is read and written at the same times, and an update reads
and writes the low-precision copy, which is what forward fetches, beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..memory.nvme import NvmeStore
from ..planning.placement import HOST_SLOT_ALIGNMENT, align
from .units import PARAM_ALIGNMENT


@dataclass(frozen=True)
class _Entry:
    param: nn.Parameter
    key: Optional[str]  # None: the master itself
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class NvmeOptimizerStates:
    """The NVMe side of the optimizer states, unit by unit."""

    def __init__(self, store: NvmeStore) -> None:
        self.store = store
        self.layouts: dict[int, list[_Entry]] = {}
        self.sizes: dict[int, int] = {}
        self.owners: dict[int, torch.optim.Optimizer] = {}  # the optimizer holding each unit's states
        self.placeholders: dict[int, list[torch.Tensor]] = {}  # made once: dropping states allocates nothing

    @staticmethod
    def _file(unit: int) -> str:
        return f"states{unit}"

    def known(self, unit: int) -> bool:
        return unit in self.layouts

    @staticmethod
    def _tensor_states(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
        return [key for key, value in optimizer.state.get(p, {}).items() if torch.is_tensor(value) and value.dim() > 0]

    def matches(self, optimizer: torch.optim.Optimizer, unit: int, params: Sequence[nn.Parameter]) -> bool:
        """The learnt layout still holds every state tensor (an optimizer may add some at a later step)."""
        stored = {(id(e.param), e.key) for e in self.layouts[unit] if e.key is not None}
        return stored == {(id(p), key) for p in params for key in self._tensor_states(optimizer, p)}

    def learn(self, optimizer: torch.optim.Optimizer, unit: int, params: Sequence[nn.Parameter], masters: Sequence[bool] = ()) -> int:
        """Record where each non-scalar state tensor of ``params`` goes in the unit's buffer, and
        each param itself where ``masters`` says so (fp32 masters); return the buffer's size."""
        entries, offset = [], 0
        for p, stored in zip(params, masters):
            if stored:
                entries.append(_Entry(p, None, tuple(p.shape), p.dtype, offset))
                offset = align(offset + entries[-1].nbytes, PARAM_ALIGNMENT)
        for p in params:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    entries.append(_Entry(p, key, tuple(value.shape), value.dtype, offset))
                    offset = align(offset + entries[-1].nbytes, PARAM_ALIGNMENT)
        if not entries:
            # nothing to store (SGD without momentum, or no gradient yet for a module first used
            # later): the unit stays unknown, so no later update reads a file never written
            self.forget(unit)
            return 0
        self.layouts[unit] = entries
        self.sizes[unit] = align(offset, HOST_SLOT_ALIGNMENT)
        self.owners[unit] = optimizer
        self.placeholders[unit] = [torch.full((1,), float("nan"), dtype=e.dtype).expand(e.shape) for e in entries]
        return self.sizes[unit]

    def views(self, unit: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.layouts[unit]]

    def current_values(self, unit: int) -> list[torch.Tensor]:
        """What each entry of the unit's layout points at now (placeholders between steps)."""
        optimizer = self.owners[unit]
        return [e.param.data if e.key is None else optimizer.state[e.param][e.key] for e in self.layouts[unit]]

    def read(self, unit: int, buffer: torch.Tensor) -> Any:
        """Start reading the unit's states into ``buffer``; a Future."""
        return self.store.read(self._file(unit), buffer[: self.sizes[unit]])

    def load(self, unit: int, buffer: torch.Tensor, read: bool = True) -> None:
        """Read the unit's states into ``buffer`` (unless already read there) and let its optimizer use them in place."""
        if read:
            self.read(unit, buffer).result()
        optimizer = self.owners[unit]
        for entry, view in zip(self.layouts[unit], self.views(unit, buffer)):
            if entry.key is None:
                entry.param.data = view
            else:
                optimizer.state[entry.param][entry.key] = view

    def save(self, unit: int, buffer: torch.Tensor, wait: bool = True) -> Any:
        """Write the unit's states (gathered into ``buffer`` unless already there) and drop them from
        memory; with ``wait=False`` the write's Future is returned and ``buffer`` must stay untouched until it is done."""
        optimizer = self.owners[unit]
        for entry, view in zip(self.layouts[unit], self.views(unit, buffer)):
            value = entry.param.data if entry.key is None else optimizer.state[entry.param][entry.key]
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
        optimizer = self.owners[unit]
        for entry, placeholder in zip(self.layouts[unit], self.placeholders[unit]):
            if entry.key is None:
                entry.param.data = placeholder
            else:
                optimizer.state[entry.param][entry.key] = placeholder

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

    def adopt(self, optimizer: torch.optim.Optimizer, unit: int, params: Sequence[nn.Parameter], masters: Sequence[bool] = ()) -> None:
        """States ``optimizer`` holds in memory for an NVMe unit (just loaded from a checkpoint), and
        the masters ``masters`` marks: offload them."""
        if self.learn(optimizer, unit, params, masters):
            self.save(unit, torch.empty(self.sizes[unit], dtype=torch.uint8))

    def forget(self, unit: int) -> None:
        """The unit has no states on NVMe (any file it had is stale)."""
        for table in (self.layouts, self.sizes, self.owners, self.placeholders):
            table.pop(unit, None)
