"""Module forwards while no step is active: user code that runs the model between steps (a
callback generating samples at an epoch's end, logging predictions on a fixed batch), and, under
manual optimization, the training step's forwards after an optimizer step. They compute as a
step does, with every unit they use fetched into the GPU tier, after what user code wrote meanwhile
went home. Between steps, once the outermost forward returns every parameter points at its home
again; inside the training step the step goes on until the next optimizer step. Without this such
forwards found their parameters lent at their homes, in host memory: on a GPU, tensors on the
wrong device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.utils.hooks import RemovableHandle

from .cache import UnitCache
from ..context import EngineContext
from .lending import Lending
from ..activations.saved_tensors import SavedTensors


def outside_transforms() -> contextlib.AbstractContextManager:
    """Where a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``) runs the model, the
    engine's own work (copies into the GPU tier, pointing parameters at them) runs outside it, as
    plain eager code: inside a ``grad`` transform an in-place copy into a buffer is refused, and
    ``p.data = t`` leaves the parameter broken once the transform returns (the process then
    crashes at the next rebinding)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return contextlib.nullcontext()
    return temporarily_clear_interpreter_stack()


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks apply now (a ``torch.func`` transform that differentiates disables them)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]  # in torch, not in its stubs


class UnitHook:
    """A module hook of the engine. A copy of the module (an EMA's ``deepcopy``) gets a hook that
    does nothing: the copy's parameters are its own, not the engine's."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def __call__(self, *args: Any) -> Any:
        if torch._C._functorch.peek_interpreter_stack() is None:  # no transform: the usual case, nothing to enter
            return self.call(*args)
        with outside_transforms():
            return self.call(*args)

    def __deepcopy__(self, memo: dict) -> Any:
        return _no_hook


def _no_hook(*args: Any) -> None:
    return None


class ForwardsBetweenSteps:
    """Counts the forwards of modules holding placed parameters (see the module docstring).

    Such a forward may build a graph that user code differentiates after it returned (a callback's
    saliency map, input gradients): tensors it saves that alias a unit's GPU-tier copy are saved
    through the same hooks as a training step's (:meth:`saved_hooks`), and that backward fetches
    the units again, which go home once it ends."""

    def __init__(self, ctx: EngineContext, cache: UnitCache, lending: Lending, saved: SavedTensors) -> None:
        self.ctx, self.cache, self.lending, self.saved = ctx, cache, lending, saved
        self.depth = 0  # forwards of hooked modules in progress
        self.running = False  # the outermost of them (or a backward of their graph) started between steps
        self._saving: Optional[contextlib.AbstractContextManager] = None

    def install(self, modules: Iterable[nn.Module]) -> list[RemovableHandle]:
        """Hook ``modules`` (every module holding a parameter the engine places), before the
        engine's own hooks run and after they ran."""
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(UnitHook(self.enter), prepend=True))
            handles.append(module.register_forward_hook(UnitHook(self.leave), always_call=True))
        return handles

    def enter(self, module: nn.Module, args: Any) -> None:
        step = self.ctx.step
        if not step.active:
            self.lending.take_back()  # what user code wrote meanwhile goes home first
            step.activate()
            self.running = self.depth == 0 and not step.in_training_step
        if self.depth == 0 and _builds_a_graph_outside_the_training_step(step.in_training_step):
            self._saving = torch.autograd.graph.saved_tensors_hooks(*self.saved_hooks())
            self._saving.__enter__()
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        if self.running and saved_tensors_hooks_enabled():
            self._end()
        # else a torch.func transform differentiates once the function it runs returns, with
        # the copies the forward used (held in the GPU tier): the next engine call ends it

    def saved_hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """The saved-tensor hooks of a training step's forward and of a graph built between steps."""
        return self.saved.pack, self.unpack

    def unpack(self, packed: Any) -> torch.Tensor:
        if self.saved.unit_of(packed) is not None:
            self.backward_starts()  # of a graph built between steps: nothing more to record
        return self.saved.unpack(packed, in_step=not self.running)

    def settle(self) -> None:
        """Before a step, or a read of every parameter: forwards between steps left nothing in the GPU tier."""
        if self.running and self.depth == 0:
            self._end()

    def backward_starts(self) -> None:
        """A backward between steps needs a unit's copy (see the class docstring)."""
        if self.ctx.step.active:
            return
        self.lending.take_back()
        self.ctx.step.activate()
        self.running = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end)  # runs as this backward ends

    def _end(self) -> None:
        self.running = False
        self.ctx.step.deactivate()
        self.cache.evict_all()


def _builds_a_graph_outside_the_training_step(in_training_step: bool) -> bool:
    """A forward between steps or in an evaluation step that records for a backward (the training
    step's forward saves through the engine's hooks already; a backward's recomputation saves
    through the checkpoint's; a torch.func transform that differentiates takes none)."""
    if in_training_step or not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
        return False
    return saved_tensors_hooks_enabled()
