"""The bytes a forward keeps for backward, counted as memory holds them.

Autograd saves one tensor for several operations (``log_softmax``'s output for its own backward
and for ``nll_loss``'s: cross-entropy's largest tensor twice), and views of one output (a fused
projection split into query, key and value). Summing every saved tensor counts such memory again;
summing whole storages counts all of a large buffer a block saved a slice of. :class:`SavedBytes`
counts each distinct view once, and never more than its storage holds. It also keeps the largest
tensor saved: the backward's gradients at their largest are twice its size (``BesideBlocks``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class _Storage:
    first: "weakref.ref[torch.Tensor]"  # a saved tensor on it: while it lives, so does the storage at this address
    limit: int  # the storage's bytes
    counted: int = 0
    views: set[tuple] = field(default_factory=set)


class SavedBytes:
    """See the module docstring. ``add`` each saved tensor; ``bytes`` is the total so far,
    ``largest`` the largest tensor."""

    def __init__(self) -> None:
        self.bytes = 0
        self.largest = 0
        self._storages: dict[int, _Storage] = {}

    def clear(self) -> None:
        self.bytes = self.largest = 0
        self._storages.clear()

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        address = storage.data_ptr()
        held = self._storages.get(address)
        first = held.first() if held is not None else None
        if held is None or first is None or first.untyped_storage().data_ptr() != address:
            # a new storage, or one freed (a swapped block's tensor copied out) and its address reused
            held = _Storage(weakref.ref(t), storage.nbytes())
            self._storages[address] = held
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in held.views:
            return
        held.views.add(view)
        size = min(t.numel() * t.element_size(), held.limit)
        self.largest = max(self.largest, size)
        added = min(size, held.limit - held.counted)
        held.counted += added
        self.bytes += added
