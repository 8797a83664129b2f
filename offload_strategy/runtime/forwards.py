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

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .cache import UnitCache
from .context import EngineContext
from .lending import Lending


class UnitHook:
    """A module hook of the engine. A copy of the module (an EMA's ``deepcopy``) gets a hook that
    does nothing: the copy's parameters are its own, not the engine's."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def __deepcopy__(self, memo: dict) -> Any:
        return _no_hook


def _no_hook(*args: Any) -> None:
    return None


class ForwardsBetweenSteps:
    """Counts the forwards of modules holding placed parameters (see the module docstring)."""

    def __init__(self, ctx: EngineContext, cache: UnitCache, lending: Lending) -> None:
        self.ctx, self.cache, self.lending = ctx, cache, lending
        self.depth = 0  # forwards of hooked modules in progress
        self.running = False  # the outermost of them started between steps

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
            step.active = True
            self.running = self.depth == 0 and not step.in_training_step
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.running:
            self.running = False
            self.ctx.step.active = False
            self.cache.evict_all()
