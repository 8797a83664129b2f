"""``TieredPrecision``: the precision plugin of the Trainer's tiered strategies.

It wraps the plugin Lightning's connector hands in (``32-true``, ``16-mixed``, ``bf16-true``, ...)
and keeps its scaler, dtype, autocast and module conversion by delegation, as Lightning's FSDP and
DeepSpeed strategies use plugins of their own. It owns the step's order where the engine holds
the parameters: the closure (forward and backward), unscaling, the hooks before the step and
clipping (Lightning's ``_after_closure``), then the update of each unit where it lives, skipped
on a 16-bit overflow, then the scaler's update. The plugin's own step would update every
parameter at once, where they do not all live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from ..runtime.engine import TieredEngine
from .recipe import Recipe, gradient_hooks, reads_gradients_after_backward

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .core import TieredCore


@dataclass(frozen=True)
class _Clipping:
    """What Lightning's clipping hook (``configure_gradient_clipping``) gets in this step:
    ``view``, every gradient where it is held (replacements made by the hooks before it taken
    back first); else the optimizer, if ``module_clips``."""

    module_clips: bool
    view: Any = None


class TieredPrecision(Precision):
    """``plugin`` (the user's precision) with the tiered runtime's step: see the module docstring.
    ``core``: the strategy's core, which holds the engine."""

    def __init__(self, plugin: Precision, core: "TieredCore") -> None:
        self.plugin = plugin
        self.precision = plugin.precision  # "32-true", "bf16-mixed", ...: what the Trainer reports
        self._core = core
        self._clipping: Optional[_Clipping] = None

    # -- what the wrapped plugin is -----------------------------------------------------------------

    @property
    def scaler(self) -> Optional["torch.amp.GradScaler"]:
        return getattr(self.plugin, "scaler", None)

    @override
    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple[Module, list[Optimizer], list[Any]]:
        return self.plugin.connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: Module) -> Module:
        return self.plugin.convert_module(module)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return self.plugin.tensor_init_context()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.plugin.module_init_context()

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        # Lightning's train/val/test/predict step contexts are this one (none of the plugins wrapped overrides them)
        return self.plugin.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.plugin.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.plugin.convert_output(data)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        return self.plugin.pre_backward(tensor, module)

    @override
    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.plugin.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        return self.plugin.main_params(optimizer)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.plugin.unscale_gradients(optimizer)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.plugin.clip_grad_by_value(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.plugin.clip_grad_by_norm(optimizer, clip_val)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.plugin.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.plugin.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The plugin's state under its own class's name (Lightning stored it under this class's),
        so that a checkpoint is the one plain training writes and loads."""
        state = checkpoint.pop(type(self).__qualname__, None)
        if state is not None:
            checkpoint[type(self.plugin).__qualname__] = state
        self.plugin.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.plugin.on_load_checkpoint(checkpoint)
        name = type(self.plugin).__qualname__
        if name in checkpoint:
            self.plugin.load_state_dict(checkpoint[name])

    @override
    def teardown(self) -> None:
        self.plugin.teardown()

    # -- backward, clipping and the step ------------------------------------------------------------

    @override
    def post_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        """The plugin's, which runs ``on_after_backward``: the hooks see offloaded gradients on
        their parameters' ``.grad`` for this one call (``GradientExposure.during``)."""
        engine = self._core.engine
        if engine is None or not reads_gradients_after_backward(module.trainer):
            return self.plugin.post_backward(tensor, module)
        with engine.exposure.during():
            return self.plugin.post_backward(tensor, module)

    @override
    def clip_gradients(
        self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM
    ) -> None:
        """The plugin's clipping; under manual optimization, of the engine's gradients where
        they are held (``TieredCore.clip_gradients``)."""
        self._core.clip_gradients(self.plugin.clip_gradients, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        """The plugin's step where no engine runs; else the closure, then the step of every unit."""
        core = self._core
        if core.engine is None:
            with core.explaining_out_of_memory():
                return self.plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        with core.explaining_out_of_memory():
            closure_result = closure()  # forward and backward
        if not model.automatic_optimization:
            core.before_users_step()
        engine = core.engine
        assert engine is not None
        try:
            self._step_units(engine, optimizer, model, closure_result, **kwargs)
        finally:
            engine.end_step(optimizer)
        return closure_result

    def _step_units(self, engine: TieredEngine, optimizer: Optimizer, model: "pl.LightningModule", closure_result: Any, **kwargs: Any) -> None:
        recipe = self._core.recipe(model.trainer)
        if self._core.clips_norm_first(recipe):
            # the engine clips by norm from the norms it took as gradients completed (some wait on NVMe)
            with self._clipped(_Clipping(module_clips=False)):
                self._after_closure(model, optimizer)
            engine.clip_norm_and_step(optimizer, float(model.trainer.gradient_clip_val or 0.0), closure_result, **kwargs)
        elif not recipe.needs_all_gradients():
            # Lightning's default clipping hook clips nothing here (by value is idempotent, the engine
            # clipped each unit already); with every gradient at the engine (the fp32 sums of
            # *-true) there is nothing to give it, and torch's clip_grad_value_ fails on an empty list
            with self._clipped(_Clipping(module_clips=_holds_a_gradient(optimizer))):
                self._after_closure(model, optimizer)
            engine.step(optimizer, closure_result, **kwargs)
        else:
            self._step_over_every_gradient(engine, recipe, optimizer, model, closure_result, **kwargs)

    def _step_over_every_gradient(
        self, engine: TieredEngine, recipe: Recipe, optimizer: Optimizer, model: "pl.LightningModule", closure_result: Any, **kwargs: Any
    ) -> None:
        """Loss scaling, clipping by norm or user hooks see every gradient at once: through the
        engine's view of them, then the step over every unit."""
        scaler = self.scaler
        with engine.gradient_view(optimizer, closure_result, copies_for_hooks=gradient_hooks(model.trainer), **kwargs) as gradients:
            if scaler is not None:
                scaler.unscale_(gradients)  # type: ignore[arg-type]  # the view steps as an optimizer does
            with self._clipped(_Clipping(module_clips=True, view=gradients)):
                self._after_closure(model, optimizer)
            if scaler is None:
                gradients.step()
            elif closure_result is not None or not model.automatic_optimization:
                scaler.step(gradients)  # type: ignore[arg-type]
                scaler.update()

    @contextlib.contextmanager
    def _clipped(self, clipping: _Clipping) -> Iterator[None]:
        self._clipping = clipping
        try:
            yield
        finally:
            self._clipping = None

    @override
    def _clip_gradients(
        self, model: Union["pl.LightningModule", Module], optimizer: Any, clip_val: Optional[Union[int, float]] = None,
        gradient_clip_algorithm: Optional[GradClipAlgorithmType] = None,
    ) -> None:
        """Lightning's call of the clipping hook after the hooks before the step, with what this
        step gives it (``_Clipping``)."""
        clipping = self._clipping
        if clipping is not None and clipping.view is not None:
            clipping.view.take_back_replaced()  # gradients the hooks replaced, before clipping reads them
            optimizer = clipping.view
        elif clipping is not None and not clipping.module_clips:
            return None
        return super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)


def user_precision(plugin: Precision) -> Precision:
    """The precision the user chose, under the tiered plugin that wraps it."""
    return plugin.plugin if isinstance(plugin, TieredPrecision) else plugin


def _holds_a_gradient(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
