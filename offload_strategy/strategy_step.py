"""The optimizer step when the engine holds the parameters: what Lightning's precision plugins do
around ``optimizer.step`` (unscale, the hooks before the step, clipping, the step, skipped on
fp16 overflow, the scaler's update), in the same order, over units that do not all live in one
place. The plugin's own step would update every parameter at once, where they do not all live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer import call

from .runtime.engine import TieredEngine
from .strategy_recipe import Recipe, gradient_hooks

if TYPE_CHECKING:
    import lightning.pytorch as pl


def tiered_optimizer_step(
    engine: TieredEngine, recipe: Recipe, clips_norm_first: bool, optimizer: torch.optim.Optimizer, closure_result: Any, model: "pl.LightningModule",
    **kwargs: Any,
) -> Any:
    """Step ``optimizer`` over every unit after the closure (forward and backward) ran, as plain
    training does; ``clips_norm_first``: the engine clips by norm from the norms it took as
    gradients completed (some of them waiting on NVMe)."""
    trainer = model.trainer
    try:
        if clips_norm_first:
            _before_optimizer_step(trainer, optimizer)
            engine.clip_norm_and_step(optimizer, float(trainer.gradient_clip_val or 0.0), closure_result, **kwargs)
            return closure_result
        if not recipe.needs_all_gradients():
            _before_optimizer_step(trainer, optimizer)
            if model.automatic_optimization and _holds_a_gradient(optimizer):
                # Lightning's default hook, called as plain training calls it: it clips nothing
                # here (by value is idempotent, and the engine already clipped each unit). With
                # every gradient at the engine (the fp32 sums of *-true) there is nothing to give
                # it, and torch's clip_grad_value_ fails on an empty list.
                _configure_gradient_clipping(trainer, optimizer)
            engine.step(optimizer, closure_result, **kwargs)
            return closure_result
        _step_over_every_gradient(engine, recipe, optimizer, closure_result, model, **kwargs)
        return closure_result
    finally:
        engine.end_step(optimizer)


def _step_over_every_gradient(
    engine: TieredEngine, recipe: Recipe, optimizer: torch.optim.Optimizer, closure_result: Any, model: "pl.LightningModule", **kwargs: Any
) -> None:
    """Loss scaling, clipping by norm or user hooks see every gradient at once: through the
    engine's view of them, then the step over every unit."""
    trainer = model.trainer
    scaler = getattr(recipe.precision, "scaler", None)
    with engine.gradient_view(optimizer, closure_result, copies_for_hooks=gradient_hooks(trainer), **kwargs) as gradients:
        if scaler is not None:
            scaler.unscale_(gradients)
        _before_optimizer_step(trainer, optimizer)
        gradients.take_back_replaced()
        if model.automatic_optimization:  # as Lightning's precision plugins do: the module's hook clips
            _configure_gradient_clipping(trainer, gradients)
        if scaler is None:
            gradients.step()
        elif closure_result is not None or not model.automatic_optimization:
            scaler.step(gradients)
            scaler.update()


def _holds_a_gradient(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _configure_gradient_clipping(trainer: "pl.Trainer", optimizer: Any) -> None:
    call._call_lightning_module_hook(
        trainer, "configure_gradient_clipping", optimizer,
        gradient_clip_val=trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm,
    )


def _before_optimizer_step(trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> None:
    call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
