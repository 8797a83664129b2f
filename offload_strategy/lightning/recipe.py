"""What the user's recipe allows the engine to do, read from the trainer, the module and the
precision plugin: whether units may be updated as backward completes their gradients (LoHan
§IV-C), whether gradients must wait for every other one (clipping by norm, loss scaling, hooks
that read them), and whether those that wait may wait on NVMe.

Pure functions of Lightning's objects; the strategy's core asks them at set-up and every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..config import PolicyConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl


class Rules(Protocol):
    """What the core asks of a recipe: ``Recipe`` reads a Lightning Trainer's, Fabric's strategy
    answers for loops it cannot see (``lightning.fabric.FabricRules``)."""

    @property
    def training(self) -> bool:
        """Gradients and optimizer states are to be planned (a fit, not evaluation alone)."""

    def needs_all_gradients(self) -> bool: ...
    def clips_by_norm(self) -> bool: ...
    def clip_value(self) -> Optional[float]: ...
    def every_step_updates_in_backward(self) -> bool: ...
    def updates_can_start_in_backward(self) -> bool: ...
    def gradients_wait_on_nvme(self) -> bool: ...
    def every_backward_reduces_to_owners(self) -> bool: ...
    def reductions_may_go_to_owners(self) -> bool: ...
    def updates_may_run_ahead_of_clipping(self) -> bool: ...
    def accumulating(self) -> bool: ...
    def why_updates_wait(self) -> str: ...


@dataclass(frozen=True)
class Recipe:
    """The trainer's recipe as the tiered runtime needs to know it."""

    trainer: "pl.Trainer"
    precision: Precision
    policy: PolicyConfig
    world_size: int
    optimizer_count: int

    @property
    def training(self) -> bool:
        return bool(self.trainer.training)

    @property
    def scales_loss(self) -> bool:
        return getattr(self.precision, "scaler", None) is not None

    def needs_all_gradients(self) -> bool:
        """Loss scaling, clipping by norm, and user code that looks at the gradients before the
        step (``on_before_optimizer_step`` in the module or a callback, its own
        ``configure_gradient_clipping``) see every gradient, and the weights not yet updated."""
        trainer = self.trainer
        return self.scales_loss or bool(trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value") or gradient_hooks(trainer)

    def reductions_may_go_to_owners(self) -> bool:
        """Under sharded data parallelism, nothing needs every reduced gradient on every rank but
        Lightning's own clipping by norm, which the engine takes from each gradient's norm, the
        owners' norms exchanged between the ranks (no loss scaling, no hook that reads gradients).
        Never under manual optimization: a backward may follow another before the step, and each
        rank's gradients must then hold the earlier reductions, as DDP leaves them."""
        if not self.trainer.lightning_module.automatic_optimization:
            return False
        if not self.needs_all_gradients():
            return True
        return self.clips_by_norm() and not self.scales_loss and not gradient_hooks(self.trainer)

    def clips_by_norm(self) -> bool:
        """Lightning's own clipping by norm (``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters)."""
        plugin = type(self.precision)
        standard = plugin.clip_grad_by_norm is Precision.clip_grad_by_norm and plugin.main_params is Precision.main_params
        by_norm = self.trainer.gradient_clip_algorithm in (None, "norm")  # Lightning's default is the norm
        value = self.trainer.gradient_clip_val
        return standard and by_norm and value is not None and value > 0

    def clip_value(self) -> Optional[float]:
        """The threshold of clipping by value, when the engine clips each unit as it completes."""
        trainer = self.trainer
        return trainer.gradient_clip_val if trainer.gradient_clip_algorithm == "value" and not gradient_hooks(trainer) else None

    def one_automatic_step(self) -> bool:
        """One process, one optimizer, stepped by Lightning's automatic optimization and its own ``optimizer_step``."""
        module = self.trainer.lightning_module
        single = self.world_size == 1 and self.optimizer_count == 1 and module.automatic_optimization
        return single and not is_overridden("optimizer_step", module)

    def every_step_updates_in_backward(self) -> bool:
        """Known at set-up: every step's backward updates each unit as its gradients complete, so
        a gradient lives only until its unit's update (one optimizer, no accumulation, nothing
        that needs every gradient first; under data parallelism, once its reduction is in)."""
        single = self.one_automatic_step() and self.trainer.accumulate_grad_batches == 1
        ranks = self.world_size > 1 and self.every_backward_reduces_to_owners()
        return (single or ranks) and self.policy.update_during_backward and not self.needs_all_gradients()

    def updates_can_start_in_backward(self) -> bool:
        """True when this step's backward is the last before the optimizer step and nothing must see
        every gradient first (loss-scale overflow checks, clipping by norm): then each unit is
        updated as soon as its gradients are complete."""
        module = self.trainer.lightning_module
        if not self.policy.update_during_backward or is_overridden("optimizer_step", module):
            return False  # a module's own optimizer_step may skip the step or pass it arguments
        if not module.automatic_optimization or self.needs_all_gradients():
            return False
        return not self.trainer.fit_loop._should_accumulate()

    def every_backward_reduces_to_owners(self) -> bool:
        """Known at set-up: under data parallelism every backward's gradients are reduced to their
        units' owners alone (one optimizer stepped by automatic optimization and Lightning's own
        ``optimizer_step``, no accumulation, nothing but Lightning's clipping by norm needs every
        gradient), so a rank needs the gradients of the units it does not own only until sent."""
        module = self.trainer.lightning_module
        plain = self.optimizer_count == 1 and module.automatic_optimization and not is_overridden("optimizer_step", module)
        scheduled = any(isinstance(c, GradientAccumulationScheduler) for c in _callbacks(self.trainer))
        once = self.trainer.accumulate_grad_batches == 1 and not scheduled
        return self.world_size > 1 and plain and once and self.reductions_may_go_to_owners()

    def updates_may_run_ahead_of_clipping(self) -> bool:
        """Lightning's own clipping by norm is all that keeps this backward's units from being
        updated as their gradients complete (one process, one optimizer stepped by automatic
        optimization, the last backward before the step, no loss scaling, nothing that reads the
        gradients or weights before the step): they may be updated then, speculatively
        (``runtime/updates/speculation.py``)."""
        module = self.trainer.lightning_module
        if not self.policy.update_during_backward or not self.one_automatic_step() or not self.clips_by_norm():
            return False
        if self.scales_loss or gradient_hooks(self.trainer):
            return False
        return not self.trainer.fit_loop._should_accumulate() and module.automatic_optimization

    def accumulating(self) -> bool:
        """This backward is not the last before the optimizer step (as DDP's no_sync)."""
        return bool(self.trainer.lightning_module.automatic_optimization and self.trainer.fit_loop._should_accumulate())

    def why_updates_wait(self) -> str:
        return "clipping by norm needs every gradient" if self.clips_by_norm() else "loss scaling or a hook before the step reads every gradient"

    def gradients_wait_on_nvme(self) -> bool:
        """Known at set-up: what keeps units from updating as their gradients complete is only
        accumulation over micro-batches or Lightning's own clipping by norm (one process, one
        optimizer, nothing else that looks at every gradient). Then NVMe units' gradients pass
        through a few host buffers on to NVMe and wait there, their norms taken on the way,
        instead of a host gradient home each."""
        trainer = self.trainer
        if not self.one_automatic_step() or self.scales_loss or gradient_hooks(trainer):
            return False
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value" and not self.clips_by_norm():
            return False  # a precision plugin of its own clips by norm over every gradient
        scheduled = any(isinstance(c, GradientAccumulationScheduler) for c in _callbacks(trainer))
        return self.clips_by_norm() or trainer.accumulate_grad_batches > 1 or scheduled


def gradient_hooks(trainer: "pl.Trainer") -> bool:
    """User code runs between backward and the step: it must see plain training's gradients and weights."""
    module = trainer.lightning_module
    overridden = is_overridden("configure_gradient_clipping", module) or is_overridden("on_before_optimizer_step", module)
    hooks = ("on_before_optimizer_step", "on_after_backward")
    return overridden or reads_gradients_after_backward(trainer) or any(is_overridden(h, c, Callback) for h in hooks for c in _callbacks(trainer))


def reads_gradients_after_backward(trainer: "pl.Trainer") -> bool:
    """``on_after_backward`` in the module or a callback: it sees (and may change) the gradients."""
    hooked = any(is_overridden("on_after_backward", callback, Callback) for callback in _callbacks(trainer))
    return hooked or is_overridden("on_after_backward", trainer.lightning_module)


def _callbacks(trainer: "pl.Trainer") -> list[Callback]:
    return list(getattr(trainer, "callbacks", []))  # a property Lightning sets up after construction
