"""The hooks that receive each trainable parameter's gradient as autograd accumulates it
(``register_post_accumulate_grad_hook``), and what a unit's complete gradients start: its
reduction across ranks, its update during backward (LoHan §IV-C), a speculative update under
clipping by norm, or its gradients' way to NVMe.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.hooks import RemovableHandle

from ...planning.placement import GPU
from ..params.cache import UnitCache
from ..context import EngineContext
from .exchange import GradientExchange
from .path import GradientPath
from ..params.recompute import RecomputeHolds
from ..updates.speculation import SpeculativeUpdates
from ..state import UnitState
from ..updates.updater import UnitUpdater


class GradientHooks:
    """See the module docstring."""

    def __init__(
        self, ctx: EngineContext, cache: UnitCache, gradients: GradientPath, updater: UnitUpdater, recompute_holds: RecomputeHolds,
        exchange: Optional[GradientExchange], speculation: SpeculativeUpdates,
    ) -> None:
        self.ctx, self.cache, self.gradients, self.updater = ctx, cache, gradients, updater
        self.recompute_holds, self.exchange, self.speculation = recompute_holds, exchange, speculation
        # id(param) -> the hook receiving its gradients (None: a persistent parameter's go nowhere apart)
        self.handles: dict[int, Optional[RemovableHandle]] = {}

    def install(self) -> None:
        for s in self.ctx.states:
            for i, p in enumerate(s.unit.params):
                if p.requires_grad:
                    self.hook(s, i, p)

    def sync(self) -> None:
        """Parameters unfrozen since set-up get a gradient home and a hook; the others keep theirs last."""
        for s in self.ctx.states:
            for i, p in enumerate(s.unit.params):
                if p.requires_grad and id(p) not in self.handles:
                    self.gradients.start(s, i, p)
                    self.hook(s, i, p)
                elif p.requires_grad:
                    self.keep_last(s, i, p)

    def remove(self) -> None:
        for handle in self.handles.values():
            if handle is not None:
                handle.remove()
        self.handles.clear()

    def hook(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        on_grad = self._on_grad if s.home != GPU else self._on_persistent_grad if self.gradients.needs_persistent_hook(s, i) else None
        self.handles[id(p)] = p.register_post_accumulate_grad_hook(on_grad) if on_grad is not None else None

    def keep_last(self, s: UnitState, i: int, p: torch.Tensor) -> None:
        """User code's own post-accumulate hooks on a parameter (an optimizer step fused into
        backward, GaLore's layer-wise updates, gradient statistics) see ``p.grad`` as plain training
        has it: the engine's hook, which moves the gradient home, runs after them."""
        handle, hooks = self.handles.get(id(p)), p._post_accumulate_grad_hooks
        if handle is not None and hooks and next(reversed(hooks)) != handle.id:
            handle.remove()
            self.hook(s, i, p)

    def _on_grad(self, p: torch.Tensor) -> None:
        self.updater.freed.check()  # autograd freed the gradients before this one: backward's large transients
        s = self.gradients.receive(p)
        if s is not None:
            self._gradients_complete(s)

    def _on_persistent_grad(self, p: torch.Tensor) -> None:
        s = self.gradients.receive_persistent(p)
        if s is not None:
            self._gradients_complete(s)

    def _gradients_complete(self, s: UnitState) -> None:
        """Every gradient of ``s`` for this backward has arrived: reduced across ranks first, where
        there are ranks; updated now, where the step allows (LoHan §IV-C)."""
        self.cache.keep_writes(s)  # written in forward (a max-norm embedding): home before an update there
        self.recompute_holds.gradients_complete(s)
        exchange = self.exchange
        ready = exchange.complete(s) if exchange is not None and exchange.mode is not None else [s]
        if self.ctx.step.update_in_backward:
            for unit in ready:
                if unit.home != GPU:
                    self.updater.submit(unit)
            return
        if self.speculation.active:
            for unit in ready:
                self.updater.speculate(unit, self.speculation)
        if self.ctx.placement.gradients_spilled:
            for unit in ready:
                if unit.transient_gradients and self.gradients.buffers.holds(unit):
                    self.updater.spill(unit)

    def adopt_set_by_hand(self) -> None:
        """Gradients the user's code put on ``.grad`` without a backward (``p.grad = g``: per-sample
        gradients from ``torch.func``, ``torch.autograd.grad``'s results, an estimate of its own)
        are taken in as if autograd had accumulated them, where the engine holds gradients apart
        from ``.grad`` (offloaded units, fp32 sums of 16-bit ones). Call with no gradient exposed.
        Under data parallelism they are left alone: DDP reduces no gradient set by hand either."""
        if self.exchange is not None:
            return
        for s in self.ctx.states:
            for i, p in enumerate(s.unit.params):
                if p.grad is None or not p.requires_grad:
                    continue
                if s.home == GPU:
                    if s.master_dtypes[i] != p.dtype:
                        self._on_persistent_grad(p)
                    continue
                home = s.grads[i].home
                if home is None or p.grad.data_ptr() != home.data_ptr():  # at home already: accumulated there in place
                    self._on_grad(p)
