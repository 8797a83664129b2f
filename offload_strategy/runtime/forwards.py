"""Module forwards outside the steps: user code that runs the model between steps (a callback
generating samples at an epoch's end, logging predictions on a fixed batch) computes as an
evaluation step does, with every unit it uses fetched into the GPU tier, and once its outermost
forward returns every parameter points at its home again, as between steps. Without this such a
forward found its parameters at their homes, in host memory: on a GPU, tensors on the wrong device.
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
        if self.depth == 0 and not step.active and not step.in_training_step:
            self.lending.take_back()  # what user code wrote between steps goes home first
            step.active = True
            self.running = True
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.running:
            self.running = False
            self.ctx.step.active = False
            self.cache.evict_all()
