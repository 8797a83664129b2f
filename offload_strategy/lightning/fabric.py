"""``TieredFabricStrategy``: the tiered runtime under Lightning Fabric, ``L.Fabric(strategy="tiered")``.

Fabric's loop is the user's own: forward, ``fabric.backward``, perhaps ``fabric.clip_gradients``
or another backward (accumulation), ``optimizer.step()``. The strategy cannot see which, so it
plans for all of them: every gradient is kept until the step and the units are updated after
backward (as DeepSpeed's and FSDP's offloaded steps are). The same :class:`TieredCore` as the
Trainer's strategy plans, places and runs the engine; this module only adapts Fabric's hooks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from torch import nn
from typing_extensions import override

from ..checkpoint.atomic import AtomicCheckpointIO
from ..config import BudgetLike, HardwareSpec, PolicyConfig
from .hooks import OneDevice, TieredAttributes
from .context import TieredOptions
from .core import OneProcess, TieredCore

if TYPE_CHECKING:
    from lightning.fabric.accelerators import Accelerator
    from torch.optim.lr_scheduler import _LRScheduler

__all__ = ["FabricRules", "TieredFabricStrategy"]

_SUPPORTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


@dataclass(frozen=True)
class FabricRules:
    """The recipe's rules under Fabric (``lightning.recipe.Rules``): the loop between
    ``fabric.backward`` and ``optimizer.step()`` is the user's, so every gradient waits for the step."""

    training: bool

    def needs_all_gradients(self) -> bool:
        return True

    def clips_by_norm(self) -> bool:
        return False  # fabric.clip_gradients clips through the engine's view of every gradient

    def clip_value(self) -> Optional[float]:
        return None

    def every_step_updates_in_backward(self) -> bool:
        return False

    def updates_can_start_in_backward(self) -> bool:
        return False

    def gradients_wait_on_nvme(self) -> bool:
        return False

    def accumulating(self) -> bool:
        return False

    def every_backward_reduces_to_owners(self) -> bool:
        return False  # the loop may accumulate over several fabric.backward calls

    def reductions_may_go_to_owners(self) -> bool:
        return False  # the loop may read every gradient (fabric.clip_gradients, its own code)

    def updates_may_run_ahead_of_clipping(self) -> bool:
        return False  # the loop clips when it chooses to (fabric.clip_gradients), if at all

    def why_updates_wait(self) -> str:
        return "Fabric's loop may clip, read or accumulate gradients between fabric.backward and optimizer.step"


class _FabricState:
    """What the core reads of a Lightning strategy (``LightningState``), from the Fabric strategy
    and the module and optimizers it was given at set-up."""

    def __init__(self, strategy: "TieredFabricStrategy") -> None:
        self._strategy = strategy
        self.module: Optional[nn.Module] = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._lightning_optimizers: list[Any] = []  # Fabric's wrappers are made after set-up

    @property
    def lightning_module(self) -> Any:
        return self.module

    @property
    def model(self) -> Optional[nn.Module]:
        return self.module

    @property
    def root_device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def precision_plugin(self) -> Any:
        return self._strategy.precision

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return True


class _TieredModule(nn.Module):
    """What ``fabric.setup`` returns inside its own wrapper: each forward is a training step of
    the core (with gradients enabled) or an evaluation step (without)."""

    def __init__(self, module: nn.Module, forward: Callable[[Callable[[], Any], Any], Any]) -> None:
        super().__init__()
        self.module = module
        self._tiered_forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._tiered_forward(lambda: self.module(*args, **kwargs), (args, kwargs))  # the inputs: the batch max_batch bounds


def _user_module(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, _TieredModule) else module


class TieredFabricStrategy(TieredAttributes, OneDevice, SingleDeviceStrategy):
    """The tiered strategy for Lightning Fabric on one device: ``L.Fabric(strategy="tiered")`` or
    ``L.Fabric(strategy=TieredFabricStrategy(policy="zero_offload", gpu_memory="16GiB"))``.

    Arguments as :class:`~offload_strategy.TieredStrategy` (checkpoints are one file, as Fabric's
    own ``fabric.save`` writes). Set the model up with its optimizers in one call,
    ``model, optimizer = fabric.setup(model, optimizer)``: the optimizer states are placed with
    their parameters. After the loop, ``fabric.strategy.teardown()`` gives every parameter its
    trained value in a plain tensor and frees the tiers (Fabric has no end of training to do it).
    """

    strategy_name = "tiered"
    runner = "Fabric"

    def __init__(
        self,
        policy: Union[str, PolicyConfig, dict[str, Any]] = "auto",
        hardware: Union[str, HardwareSpec, dict[str, Any]] = "auto",
        gpu_memory: BudgetLike = None,
        host_memory: BudgetLike = None,
        nvme_path: Optional[Union[str, Path]] = None,
        nvme_memory: BudgetLike = None,
        plan_file: Optional[Union[str, Path]] = None,
        *,
        accelerator: Optional["Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        max_batch: Any = None,
    ) -> None:
        options = TieredOptions.parse(policy, hardware, gpu_memory, host_memory, nvme_path, nvme_memory, plan_file, max_batch)
        self._state = _FabricState(self)
        self.tiered = TieredCore(options, self._state, OneProcess())
        self._rules = FabricRules(training=False)
        self._placed: Optional[nn.Module] = None
        self._parallel_devices = None
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision=precision)
        if parallel_devices is not None:
            self.parallel_devices = parallel_devices

    # -- precision: Fabric's connector sets it after construction ----------------------------------

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = _check_precision(precision)

    # -- building and setting up the model --------------------------------------------------------

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        return self.tiered.tensor_init_context(lambda: super(TieredFabricStrategy, self).module_init_context(empty_init), empty_init)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        self._refuse_a_second_model(module)
        self._state.module = module
        self.tiered.model_to_device(lambda: super(TieredFabricStrategy, self).module_to_device(module))

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Optional["_LRScheduler"] = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Optional["_LRScheduler"]]:
        return self._place(module, optimizers), optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model set up without optimizers is placed for evaluation (forward only)."""
        return self._place(module, [])

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise RuntimeError(
            "strategy='tiered' places each optimizer's states with their parameters, so the model and its optimizers are set up "
            "together: `model, optimizer = fabric.setup(model, optimizer)` instead of fabric.setup_module and fabric.setup_optimizers."
        )

    def _refuse_a_second_model(self, module: nn.Module) -> None:
        if self._placed is not None and self._placed is not module:
            raise RuntimeError(
                "strategy='tiered' under Fabric tiers one model, and one was set up already; set both up as one module "
                "(an nn.ModuleDict of them) with all their optimizers in one fabric.setup call, or use one Fabric per model."
            )

    def _place(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> nn.Module:
        self._refuse_a_second_model(module)
        self._placed = module
        self._state.module, self._state.optimizers = module, list(optimizers)
        self._rules = FabricRules(training=bool(optimizers))
        self.tiered.resolve()
        self.tiered.deferred.adopt(module)
        self.tiered.place_module(self._rules)
        return _TieredModule(module, self._forward)

    def _forward(self, run: Callable[[], Any], inputs: Any = None) -> Any:
        if torch.is_grad_enabled() and self._rules.training:
            return self.tiered.training_step(run, self._rules, batch=inputs)
        return self.tiered.eval_step(run)

    # -- the step ---------------------------------------------------------------------------------

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self.tiered.pre_backward()
        super().backward(tensor, module, *args, **kwargs)
        self.tiered.post_backward(expose=True)  # the user's loop may read or change gradients before the step

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None and self.tiered.engine is not None:
            raise RuntimeError(
                "strategy='tiered' steps each unit of the model where it lives, and an optimizer closure (LBFGS) would run "
                "forward and backward again for each; use an optimizer stepped without a closure."
            )
        return self.tiered.step_optimizer(optimizer, lambda: super(TieredFabricStrategy, self).optimizer_step(optimizer, **kwargs))

    @override
    def clip_gradients_norm(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.tiered.before_users_step()
        engine = self.tiered.engine
        if engine is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)  # a no-op: the precisions that scale are refused
        with engine.gradient_view(optimizer) as gradients:  # in place, at every gradient's home
            return torch.nn.utils.clip_grad_norm_(gradients.params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: Union[float, int]) -> None:
        self.tiered.before_users_step()
        engine = self.tiered.engine
        if engine is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        with engine.gradient_view(optimizer) as gradients:
            torch.nn.utils.clip_grad_value_(gradients.params, clip_val)
        return None

    # -- checkpoints and the end ----------------------------------------------------------------------

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        user = _user_module(module)
        return self.tiered.checkpoints.lightning_module_state_dict(user.state_dict)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        user = _user_module(module)
        self.tiered.checkpoints.load_model_state_dict(
            {"state_dict": state_dict}, strict, lambda checkpoint, strict: user.load_state_dict(checkpoint["state_dict"], strict=strict)
        )

    @override
    def teardown(self) -> None:
        self.tiered.teardown(super().teardown)


def _check_precision(precision: Optional[Precision]) -> Optional[Precision]:
    if precision is None:
        return None
    if type(precision) not in _SUPPORTED_PRECISION:
        raise ValueError(
            f"strategy='tiered' does not support the precision plugin {type(precision).__name__}; "
            f"use precision='32-true', '64-true', 'bf16-mixed', 'bf16-true' or '16-true'."
        )
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(
            "strategy='tiered' under Fabric does not support precision='16-mixed': its gradient scaler unscales and steps one "
            "optimizer object, where the tiered runtime updates each unit where it lives; use 'bf16-mixed' (no scaler), "
            "'bf16-true' or '16-true', or the Trainer's strategy, which supports '16-mixed'."
        )
    return precision
