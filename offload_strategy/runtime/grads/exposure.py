"""Gradients shown to user code on ``.grad`` where the engine holds them apart (at an offloaded
unit's home, in fp32 beside a 16-bit parameter), and taken back after, as plain training leaves
them: in place changes reach the gradients at home, a tensor put in ``.grad`` replaces its
gradient, ``None`` drops it.

Three occasions: right after backward for hooks there (``on_after_backward``: :meth:`during`);
between backward and the step for the user's own code (manual optimization, Fabric: :meth:`expose`
until :meth:`take_back`); and a gradient view of every gradient at once for the step's hooks,
clipping and loss scaling (:meth:`view`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...memory.dha import can_view, device_view
from ...planning.placement import GPU
from ..context import EngineContext
from .exchange import GradientExchange
from .path import GradientPath
from ..updates.optimizers import LOOSE, UnitOptimizers
from ..state import UnitState
from ..updates.updater import UnitUpdater


@dataclass(frozen=True)
class Shown:
    """A gradient on ``p.grad`` for user code: ``shown`` is what was put there."""

    unit: UnitState
    position: int
    param: torch.Tensor
    shown: torch.Tensor
    direct: bool = False  # the unit accumulates at home in place: its home stays ``.grad``


@dataclass
class _View:
    """What a gradient view holds while user code runs with it."""

    holders: list[torch.Tensor]  # one per parameter with a gradient, in the facade's order
    attached: list[torch.Tensor]  # tensors given a ``.grad`` for the view, cleared after
    given: list[tuple[Shown, torch.Tensor]]  # (shown on the parameter, the master carrying it)


class GradientExposure:
    """See the module docstring."""

    def __init__(self, ctx: EngineContext, gradients: GradientPath, updater: UnitUpdater, exchange: Optional[GradientExchange]) -> None:
        self.ctx, self.gradients, self.updater, self.exchange = ctx, gradients, updater, exchange
        self.given: list[Shown] = []  # on ``.grad`` until :meth:`take_back`

    @property
    def exposed(self) -> bool:
        return bool(self.given)

    def expose(self) -> None:
        """Offloaded gradients on ``.grad`` for the user's code until :meth:`take_back` (before
        the next backward, and before the step); reduced first under data parallelism, as DDP's
        backward leaves them."""
        self.take_back()
        self.given = self._show_all()

    def take_back(self) -> None:
        given, self.given = self.given, []
        self._take_back(given)

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        """For user code run right after backward (``on_after_backward``)."""
        given = self._show_all()
        try:
            yield
        finally:
            self._take_back(given)

    def _show_all(self, stepped: frozenset[int] = frozenset()) -> list[Shown]:
        """Every gradient held apart (less those of parameters in ``stepped``, by id) on ``.grad``."""
        if self.exchange is not None:
            self.exchange.wait_all()
        given = []
        for s in self.ctx.states:
            direct = s.unit.index in self.gradients.direct
            for i, p in enumerate(s.unit.params):
                if id(p) in stepped:
                    continue
                shown = self.show(s, i, p)
                if shown is not None:
                    given.append(Shown(s, i, p, shown, direct))
        return given

    def _take_back(self, given: list[Shown]) -> None:
        for g in given:
            if not self.take_back_one(g.unit, g.position, g.param, g.shown) or not g.direct:
                g.param.grad = None  # a unit accumulating at home keeps its home as ``.grad`` for the next backward

    @contextlib.contextmanager
    def view(self, unit_optimizers: UnitOptimizers, copies_for_hooks: bool) -> Iterator[tuple[list[torch.Tensor], Callable[[], None]]]:
        """Every gradient of the optimizer's parameters attached to tensors in the facade's order
        (``holders``), with what takes back the gradients hooks replaced on ``.grad``.
        ``copies_for_hooks``: user hooks read ``p.grad``, so gradients held in fp32 for 16-bit
        parameters are shown there as 16-bit copies, and parameters no optimizer steps show theirs
        too."""
        if self.exchange is not None:
            self.exchange.reduce_late_units()
        held = _View([], [], [])
        for p in unit_optimizers.order:
            self._hold(unit_optimizers, p, held, copies_for_hooks)
        unstepped = self._show_unstepped() if copies_for_hooks and self.exchange is None else []

        def take_back_replaced() -> None:
            for shown, master in held.given:
                if not self.take_back_one(shown.unit, shown.position, shown.param, shown.shown):
                    master.grad = None  # dropped by the hook: neither clipped nor stepped

        try:
            yield held.holders, take_back_replaced
        finally:
            for tensor in held.attached:
                tensor.grad = None
            self._take_back(unstepped)

    def _show_unstepped(self) -> list[Shown]:
        """Parameters no optimizer steps, their gradients (adding up since the first backward, as
        plain training leaves them) on ``.grad`` for hooks before the step."""
        stepped = frozenset(id(p) for unit_optimizers in self.updater.optimizers.values() for p in unit_optimizers.order)
        return self._show_all(stepped)

    def _hold(self, unit_optimizers: UnitOptimizers, p: torch.Tensor, held: _View, copies: bool) -> None:
        """The tensor carrying ``p``'s gradient in a gradient view (and those given a ``.grad``)."""
        found = unit_optimizers.slot_of.get(id(p))
        if found is None:
            if self.exchange is not None and id(p) in self.ctx.param_slot:
                stand_in = self.gradients.stand_in(p)  # another rank's unit: its reduced gradient still counts
                if stand_in is not None:
                    held.holders.append(stand_in)
            return
        slot, position = found
        if slot.unit_index == LOOSE:
            held.holders.append(p)
            return
        s = self.ctx.states[slot.unit_index]
        s.wait_reductions()
        master = slot.masters[position]
        i = self.ctx.param_slot[id(p)][1]
        _refuse_spilled(s, i)
        if s.home == GPU:
            if id(p) not in self.gradients.persistent:
                held.holders.append(p)
                return
            master.grad = self.gradients.persistent[id(p)]  # a 16-bit parameter's fp32 gradient, on its master
        else:
            master.grad = s.grads[i].value()
        had_none = p.grad is None
        shown = self.show(s, i, p, copies) if master.grad is not None else None
        if shown is not None:  # hooks before the step read ``p.grad``
            held.given.append((Shown(s, i, p, shown), master))
            if had_none:
                held.attached.append(p)
        held.holders.append(master)
        held.attached.append(master)

    # -- one parameter ------------------------------------------------------------------------------

    def show(self, s: UnitState, i: int, p: torch.Tensor, copy: bool = True) -> Optional[torch.Tensor]:
        """A parameter's gradient so far, on ``p.grad`` for user code between backward and the
        step (None where it cannot be: none yet, on NVMe). A gradient accumulated in place at home
        is there already; one at home in pinned host memory while the parameter is on the GPU is
        shown as a view of it from the GPU (writes cross the link). A 16-bit parameter's gradient
        accumulated in fp32 for its master is shown (``copy``) as a copy in the parameter's dtype,
        as plain training has it (:meth:`_narrowed`); what user code writes to the copy is taken
        back (:meth:`take_back_one`)."""
        held = self.gradients.held(s, i, p)
        if held is None or not p.requires_grad:
            return None
        if p.grad is not None:
            return held if p.grad.data_ptr() == held.data_ptr() else None
        if held.dtype != p.dtype:
            held = self._narrowed(s, i, p, held) if copy else None
            if held is None:
                return None
        if held.device != p.device:
            if not can_view(held, p.device):
                return None
            held = device_view(held, p.device)
        p.grad = held
        return p.grad

    def _narrowed(self, s: UnitState, i: int, p: torch.Tensor, held: torch.Tensor) -> Optional[torch.Tensor]:
        """An fp32 gradient in its 16-bit parameter's dtype: beside it where the fp32 one is on its
        device, else in the unit's 16-bit landing area at home, idle once the gradient has landed
        (a GPU copy would take memory the plan does not hold; None where there is no such area)."""
        if held.device == p.device:
            return held.to(p.dtype)
        landing = s.grads[i].landing if s.home != GPU else None
        if landing is None:
            return None
        landing.copy_(held)
        return landing

    def take_back_one(self, s: UnitState, i: int, p: torch.Tensor, exposed: torch.Tensor) -> bool:
        """User code had ``p.grad`` (``exposed``, by :meth:`show`): a tensor it put there instead
        is what the gradient is now, a 16-bit copy it changed in place is written back, and
        ``None`` drops the gradient, as in plain training. Returns whether the parameter still has
        a gradient."""
        held = self.gradients.held(s, i, p)
        current = p.grad
        if current is None or held is None:
            self.gradients.drop(s, i, p)
            return False
        if exposed.device != held.device and s.home != GPU:
            self.gradients.written_on_device(s, i)  # GPU kernels wrote home through the view: the update waits for them
        if current.data_ptr() != exposed.data_ptr():
            if current.shape != held.shape:
                raise ValueError(
                    f"the gradient of {s.unit.param_names[i]!r} was replaced by a tensor of shape {tuple(current.shape)}, "
                    f"where the parameter has shape {tuple(held.shape)}."
                )
            held.copy_(current)
            p.grad = exposed if exposed.data_ptr() == held.data_ptr() else None
        elif exposed.dtype != held.dtype:
            shown = exposed
            if exposed.device != held.device:  # a view of the landing area: read there once the GPU's writes are done
                record = s.grads[i]
                record.wait()
                assert record.landing is not None  # what was shown is a view of it
                shown = record.landing
            if not torch.equal(shown, held.to(shown.dtype)):
                held.copy_(shown)  # changed in place: its 16-bit values, as plain training would step
        return True


def _refuse_spilled(s: UnitState, i: int) -> None:
    if s.home != GPU and s.grads[i].spilled:
        raise RuntimeError(
            f"the gradient of {s.unit.param_names[i]!r} waits on NVMe, but this step needs every "
            f"gradient in memory at once (loss scaling, or a hook before the optimizer step); set-up planned otherwise."
        )
