"""Buffers a block recomputed in backward changes in place.

A checkpointed block runs its forward twice: in the forward, and again in backward to rebuild its
activations. Whatever the forward writes into its modules' buffers it writes a second time there:
BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked`` took a second update,
and spectral norm's power-iteration vectors (``_u``, ``_v``) and a user's running statistic, which
the forward reads after updating them, were read by the recomputation already updated, so that
its activations, and the gradients, were not the forward's. :class:`BufferReplay` gives the
recomputation each buffer the forward wrote with the values the forward found, and puts the
block's own buffers back after it, so that their values are the forward's and the recomputation's
writes are dropped.

Which buffers a forward writes is read from their version counters, which an in-place write
moves, with one exception known: batch norm's kernel updates the running statistics without moving
theirs (``native_batch_norm`` does not declare them written), so the buffers of a batch or
instance norm module in training mode count as written whatever their counters say. Writes
through ``.data``, and a kernel of one's own that does not declare what it writes, are not seen.
Comparing values instead would see them, at the price of a device synchronization per block on a
GPU. The values before are not known until the forward has written them, so every buffer of the
block is copied before its forward, and only the copies of the written ones are kept until the
recomputation: the cost is one copy of the
block's buffers per forward (none for a block without buffers, as a Hugging Face decoder layer
is), and, held until the block's backward, the values of what it wrote (BatchNorm: two numbers per
channel and a count). The recomputation computes from a copy of those, which takes its writes: the
block's buffers themselves are never written after the forward, so a saved tensor that is one of
them keeps its version. A buffer the forward rebinds to another tensor
(``self.running = self.running * 0.9 + ...``) needs none of this: the forward's tensors are put
back around the recomputation (``activations._tensors_as``).

Not covered: a buffer that code outside the block writes after the block's forward and before its
backward, which the block reads without writing; the recomputation reads it as it is then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

Place = tuple[nn.Module, str]  # a module and the name it holds a buffer under


@dataclass
class _Buffer:
    tensor: torch.Tensor
    places: list[Place] = field(default_factory=list)  # one tensor may be registered in several modules
    written_unseen: bool = False  # by a kernel that moves no version counter (batch norm's, in training)

    def written_since(self, version: int) -> bool:
        return self.written_unseen or self.tensor._version != version


@dataclass
class _Written:
    places: list[Place]
    before: torch.Tensor  # the values the forward found


def _distinct_buffers(block: nn.Module) -> list[_Buffer]:
    """The block's buffers, each tensor once with every place that holds it; buffers that take
    gradients are left out (a copy would take their gradients; such a buffer is written in place
    only under ``no_grad`` by code that owns it)."""
    found: dict[int, _Buffer] = {}
    for module in block.modules():
        unseen = module.training and isinstance(module, _NormBase)
        for name, tensor in module._buffers.items():
            if tensor is not None and not tensor.requires_grad:
                buffer = found.setdefault(id(tensor), _Buffer(tensor))
                buffer.places.append((module, name))
                buffer.written_unseen |= unseen
    return list(found.values())


def _put(place: Place, tensor: Optional[torch.Tensor]) -> None:
    module, name = place
    if tensor is None:
        module._buffers.pop(name, None)
    else:
        module._buffers[name] = tensor


class BufferReplay:
    """One checkpointed block's forward: :meth:`forward` around that forward, :meth:`recomputing`
    around each recomputation (the same protocol as ``runtime.activations.kv_cache.CacheReplay``)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.written: list[_Written] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        buffers = _distinct_buffers(self.block)
        with torch.no_grad():
            before = [(b, b.tensor._version, b.tensor.clone()) for b in buffers]
        yield
        self.written = [_Written(b.places, copy) for b, version, copy in before if b.written_since(version)]

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        held = [(place, place[0]._buffers.get(place[1])) for w in self.written for place in w.places]
        for w in self.written:
            with torch.no_grad():
                fresh = w.before.clone()  # a later recomputation (a second backward) starts from the forward's values too
            for place in w.places:
                _put(place, fresh)
        try:
            yield
        finally:
            for place, tensor in held:
                _put(place, tensor)

    @property
    def held_bytes(self) -> int:
        """What the forward's written values hold until the recomputation."""
        return sum(w.before.numel() * w.before.element_size() for w in self.written)
