"""A unit's update in host memory, its large parameters a chunk at a time.

torch's per-element optimizers make temporaries as large as the parameter they step: the
single-tensor AdamW that plain training runs on the CPU makes ``exp_avg_sq.sqrt()`` and its
quotient, two of them alive at once, 200 MiB for the 100 MiB MLP weight of a GPT-2 at width
2560, held beside the budgets by no plan (``docs/benchmarks.md``, "The optimizer's temporaries a
chunk at a time"). Their update of an element reads only that element of the parameter, its
gradient and its states, and per-parameter scalars (the step count), so stepping views of
``UPDATE_CHUNK_BYTES`` of the parameter one after another, each with the same scalars, computes
the same bits with temporaries of a chunk's size (within ``RUNTIME_HOST_ALLOWANCE``).

A parameter's first step makes its states: each state the optimizer makes like a chunk is made
whole, like the parameter (through any outer mode: ``StatesMadeInBuffer`` places it in the unit's
states buffer as an unchunked step would), and the chunk gets its slice (``_WholeStates``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .nvme_states import MADE_LIKE

# The most bytes of a parameter one inner step updates in host memory: AdamW's two temporaries of
# a chunk, 16 MiB, are what its update holds beyond the states and masters the plan counts.
UPDATE_CHUNK_BYTES = 8 * 2**20

# A chunk holds a whole number of the widest vector registers' elements, so that each chunk's
# kernels run on the same lanes as the whole parameter's.
_CHUNK_ALIGNMENT = 64

# torch's optimizers whose update of an element reads that element alone (of the parameter, its
# gradient and its per-element states) and per-parameter scalars; exact classes, not subclasses,
# whose step may read more.
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam,
)


def chunk_elements(p: torch.Tensor, chunk_bytes: int) -> int:
    """The elements of ``p`` one chunk holds: 0 where ``p`` is stepped whole (it fits in a chunk,
    or it is not a dense, contiguous, real tensor with such a gradient)."""
    per = max(_CHUNK_ALIGNMENT, chunk_bytes // p.element_size() // _CHUNK_ALIGNMENT * _CHUNK_ALIGNMENT)
    g = p.grad
    if p.numel() <= per or g is None or g.is_sparse or p.is_complex() or not (p.is_contiguous() and g.is_contiguous()):
        return 0
    return per


def step_in_chunks(optimizer: torch.optim.Optimizer, chunk_bytes: int, **kwargs: Any) -> None:
    """``optimizer.step(**kwargs)``, each parameter larger than ``chunk_bytes`` stepped a chunk at a
    time, the others alone, in the order the optimizer steps them (its states are made in that
    order); one step of the whole where the class is not per-element or nothing is that large."""
    groups = optimizer.param_groups
    if type(optimizer) not in ELEMENTWISE or any(g.get("differentiable") for g in groups) or not any(
        chunk_elements(p, chunk_bytes) for g in groups for p in g["params"]
    ):
        optimizer.step(**kwargs)
        return
    saved = [g["params"] for g in groups]
    try:
        for index, params in enumerate(saved):
            for p in params:
                if p.grad is None:
                    continue
                per = chunk_elements(p, chunk_bytes)
                if per:
                    _step_chunks(optimizer, index, p, per, kwargs)
                else:
                    _step_alone(optimizer, index, p, kwargs)
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params


def _step_alone(optimizer: torch.optim.Optimizer, group: int, p: torch.Tensor, kwargs: dict) -> None:
    """One step of ``optimizer`` over ``p`` alone (in its group ``group``, with its settings)."""
    for index, g in enumerate(optimizer.param_groups):
        g["params"] = [p] if index == group else []
    optimizer.step(**kwargs)


def _step_chunks(optimizer: torch.optim.Optimizer, group: int, p: torch.Tensor, per: int, kwargs: dict) -> None:
    """Step ``p`` ``per`` elements at a time: each chunk a view of the parameter with its gradient's
    view and its states' views, scalar states copied from the step's start; the last chunk's
    scalars are the step's."""
    state: dict = optimizer.state.get(p, {})
    whole = {k: v for k, v in state.items() if _per_element(v)}
    scalars = {k: v for k, v in state.items() if not _per_element(v)}
    flat, grad = p.detach().view(-1), p.grad.view(-1)  # type: ignore[union-attr]
    made = _WholeStates(p) if not state else None
    last: dict = {}
    for lo in range(0, p.numel(), per):
        hi = min(lo + per, p.numel())
        chunk = flat[lo:hi]
        chunk.grad = grad[lo:hi]
        if state:
            optimizer.state[chunk] = {**{k: v.view(-1)[lo:hi] for k, v in whole.items()}, **{k: _copy(v) for k, v in scalars.items()}}
        with made.chunk(chunk) if made is not None else contextlib.nullcontext():
            _step_alone(optimizer, group, chunk, kwargs)
        last = optimizer.state.pop(chunk, {})
        chunk.grad = None
        _gather(p, last, whole, made, lo, hi)
    settled = {k: whole[k] if _per_element(v) else _settle(scalars.get(k), v) for k, v in last.items()}
    if state:
        state.update(settled)  # the same dict: what reads the unit's states holds it
    else:
        optimizer.state[p] = settled


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _settle(before: Any, after: Any) -> Any:
    """A scalar state after the step: in the tensor the state held, where it held one."""
    if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.shape == after.shape and before.dtype == after.dtype:
        return before.copy_(after)
    return after


def _gather(p: torch.Tensor, chunk_state: dict, whole: dict, made: Optional["_WholeStates"], lo: int, hi: int) -> None:
    """Each per-element state of a chunk lands in its slice of the whole state: where the step
    updated the views it was given (or made it in its slice), nothing moves; else it is copied."""
    for key, value in chunk_state.items():
        if not _per_element(value):
            continue
        if key not in whole:
            whole[key] = made.whole_of(value) if made is not None else None
            if whole[key] is None:  # made otherwise than like the chunk: a whole state of its own
                whole[key] = torch.empty_like(p, dtype=value.dtype)
        target = whole[key].view(-1)[lo:hi]
        if target.data_ptr() != value.data_ptr():
            target.copy_(value.view(-1))


class _WholeStates(TorchDispatchMode):
    """Active through the chunks of a parameter's first step: the n-th tensor the optimizer makes
    like a chunk (``MADE_LIKE``: ``zeros_like``, ``clone``, ...) is the slice of the n-th whole
    state, made like the parameter at the first chunk (by the modes outside this one, so a
    states buffer takes it where an unchunked step would have made it), filled as the op fills."""

    def __init__(self, p: torch.Tensor) -> None:
        super().__init__()
        self.p = p
        self.wholes: list[torch.Tensor] = []
        self.lo = 0
        self.size = 0
        self.index = 0

    @contextlib.contextmanager
    def chunk(self, chunk: torch.Tensor) -> Any:
        self.lo = int(chunk.storage_offset() - self.p.storage_offset())
        self.size = chunk.numel()
        self.index = 0
        with self:
            yield

    def whole_of(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole state whose slice ``value`` is, if this mode made it."""
        for whole in self.wholes:
            if whole.view(-1)[self.lo : self.lo + self.size].data_ptr() == value.data_ptr() and whole.dtype == value.dtype:
                return whole
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        fill = MADE_LIKE.get(func)
        source = args[0] if args else None
        if fill is None or not isinstance(source, torch.Tensor) or source.shape != (self.size,):
            return func(*args, **kwargs)
        meta = func(source.to("meta"), *args[1:], **{**kwargs, "device": "meta"} if func is not torch.ops.aten.clone.default else kwargs)
        if meta.shape != source.shape:
            return func(*args, **kwargs)
        if self.index == len(self.wholes):
            self.wholes.append(torch.empty_like(self.p, dtype=meta.dtype))  # through the outer modes: where the state belongs
        out = self.wholes[self.index].view(-1)[self.lo : self.lo + self.size]
        self.index += 1
        fill(out, args, kwargs)
        return out
