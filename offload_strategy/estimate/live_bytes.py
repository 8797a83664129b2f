"""The bytes of tensors a computation makes and still holds, and their peak.

On a GPU, ``torch.cuda.max_memory_allocated`` tells what a step needed at its worst moment. A
machine without one has no such counter for host memory, so :class:`LiveBytes` keeps it for the
operations run under it: each new storage an operation returns is counted until it is freed
(PyTorch keeps one Python object per storage while the storage lives, so a finalizer on it fires
when the memory goes back). Storages that existed before (parameters, buffers written in place)
are not counted: the count is the computation's own, what a plan must leave room for beside the
parameters. Only operations on the thread that entered it are seen.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime.activations.saved_bytes import SavedBytes


class LiveBytes(TorchDispatchMode):
    """See the module docstring. ``bytes`` is held now, ``peak`` the most since entering (or ``reset``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.peak = 0
        self._held: dict[int, int] = {}  # the storages counted, by address

    def reset(self) -> None:
        self.peak = self.bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t, known)
        return out

    def _count(self, t: torch.Tensor, known: set[int]) -> None:
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address in known or address in self._held or storage.nbytes() == 0:
            return  # written in place, a view of an input, or counted already
        self._held[address] = storage.nbytes()
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(storage, self._freed, address)

    def _freed(self, address: int) -> None:
        self.bytes -= self._held.pop(address, 0)


def backward_beyond_forward(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(the most the backward of ``forward()``'s loss held beyond what the forward left, the
    largest tensor the forward saved), each parameter's gradient taken away as it is made, as the
    runtime moves it to its home. What the tests and ``tools/validate_activations.py`` hold against
    the room the plans keep for backward (twice the largest saved tensor, ``BesideBlocks.gradients``)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    saved = SavedBytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in parameters:
            saved.add(t)
        return t

    with LiveBytes() as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        left = live.bytes
        live.reset()
        loss.backward()
    return live.peak - left, saved.largest
