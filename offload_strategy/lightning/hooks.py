"""What the tiered strategies share, written once: the attributes they expose of their core
(``TieredAttributes``, for the Trainer's strategies and Fabric's), the Trainer strategies' hooks,
each delegated to the core with Lightning's own as the plain case (``TieredHooks``), and the
single-device strategies' one device (``OneDevice``). None of them holds state: everything lives
on the core, ``self.tiered``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from ..config import Budget, HardwareSpec, PolicyConfig, StateDictType
from .context import one_device
from .core import check_precision
from .precision import TieredPrecision, user_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ..construction.deferred import DeferredParameters
    from ..planning.activations import ActivationPlan, BlockCost, Links
    from ..planning.auto import AutoPlan
    from ..planning.cost_model import StepPrediction
    from ..planning.planner import Planner, TierBudgets
    from ..planning.profile import StepProfile
    from ..runtime.engine import TieredEngine
    from .core import TieredCore


class TieredAttributes:
    """A tiered strategy's public attributes, each read from its core (``self.tiered``)."""

    tiered: "TieredCore"

    @property
    def policy(self) -> PolicyConfig:
        return self.tiered.policy

    @property
    def hardware(self) -> Optional[HardwareSpec]:
        return self.tiered.hardware

    @property
    def budgets(self) -> Optional["TierBudgets"]:
        """Each tier's budget in bytes, resolved at set-up."""
        return self.tiered.budgets

    @property
    def planner(self) -> Optional["Planner"]:
        return self.tiered.planner

    @property
    def engine(self) -> Optional["TieredEngine"]:
        return self.tiered.engine

    @property
    def deferred(self) -> "DeferredParameters":
        return self.tiered.deferred

    @property
    def state_dict_type(self) -> StateDictType:
        return self.tiered.checkpoints.state_dict_type

    @property
    def removed_stale_nvme(self) -> list[Path]:
        """Swap directories of killed runs this run removed."""
        return self.tiered.removed_stale_nvme

    @property
    def gpu_memory(self) -> Budget:
        return self.tiered.options.gpu_memory

    @property
    def host_memory(self) -> Budget:
        return self.tiered.options.host_memory

    @property
    def nvme_memory(self) -> Budget:
        return self.tiered.options.nvme_memory

    @property
    def nvme_path(self) -> Optional[Path]:
        return self.tiered.options.nvme_path

    @property
    def plan_file(self) -> Optional[Path]:
        return self.tiered.options.plan_file

    @property
    def placement_search(self) -> Optional["AutoPlan"]:
        """What ``placement="search"`` chose, with its prediction (None before or without it)."""
        return self.tiered.placement_search

    @property
    def activation_plan(self) -> Optional["ActivationPlan"]:
        """What ``activations="auto"`` chose."""
        return self.tiered.activations.plan

    @property
    def activation_costs(self) -> list["BlockCost"]:
        """The block costs the activation plan was made from."""
        return self.tiered.activations.costs

    @property
    def activation_links(self) -> Optional["Links"]:
        """The links the activation plan was made with."""
        return self.tiered.activations.plan_links

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """See :meth:`TieredCore.metrics <offload_strategy.lightning.core.TieredCore.metrics>`."""
        return self.tiered.metrics(reset)

    def dump_plan(self, path: Union[str, Path]) -> Path:
        """See :meth:`TieredCore.dump_plan <offload_strategy.lightning.core.TieredCore.dump_plan>`."""
        return self.tiered.dump_plan(path)

    def predicted_step(self, timing: Optional["StepProfile"] = None) -> Optional["StepPrediction"]:
        """See :meth:`TieredCore.predicted_step <offload_strategy.lightning.core.TieredCore.predicted_step>`."""
        return self.tiered.predicted_step(timing)

    def gathered_parameters(self, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """See :meth:`CheckpointStates.gathered_parameters <offload_strategy.checkpoint.states.CheckpointStates.gathered_parameters>`."""
        return self.tiered.checkpoints.gathered_parameters(writeback)

    def resolve_budgets(self) -> "TierBudgets":
        """See :meth:`TieredCore.resolve_budgets <offload_strategy.lightning.core.TieredCore.resolve_budgets>`."""
        return self.tiered.resolve_budgets()


class OneDevice:
    """The single-device strategies' device, which Lightning's and Fabric's connectors set after
    construction: one device at most (``one_device``), the CPU until then."""

    runner: ClassVar[str]  # who hands the devices in, for the error message
    _parallel_devices: Optional[list[torch.device]] = None

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        self._parallel_devices = one_device(devices, self.runner)

    @property
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else torch.device("cpu")


class TieredHooks(TieredAttributes, Strategy):
    """Lightning's hooks of the Trainer's tiered strategies, each delegated to the core, with the
    Lightning strategy's own (the next class in the strategy's order) as the plain case."""

    @property
    @override
    def precision_plugin(self) -> TieredPrecision:
        plugin = self._precision_plugin
        if plugin is None:  # none handed in yet: Lightning's default, as Strategy's getter gives it
            return TieredPrecision(Precision(), self.tiered)
        assert isinstance(plugin, TieredPrecision)  # the setter wraps every plugin
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # None stays None: Lightning's connector takes a plugin set on the strategy for the user's choice
        if plugin is not None:
            plugin = TieredPrecision(check_precision(user_precision(plugin)) or Precision(), self.tiered)
        self._precision_plugin = plugin

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        with self.tiered.tensor_init_context(functools.partial(super().tensor_init_context, empty_init), empty_init):
            yield

    @override
    def model_to_device(self) -> None:
        self.tiered.model_to_device(super().model_to_device)  # type: ignore[safe-super]  # the Lightning strategy's, next in order

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.tiered.setup(trainer, super().setup)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        return self.tiered.training_step(functools.partial(super().training_step, *args, **kwargs), batch=batch)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered.eval_step(functools.partial(super().validation_step, *args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered.eval_step(functools.partial(super().test_step, *args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered.eval_step(functools.partial(super().predict_step, *args, **kwargs))

    # Lightning's own ``Strategy.backward`` runs between these two: code that patches or spies on
    # it (Lightning's test suite counts backward calls that way) sees every backward.
    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self.tiered.pre_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        module = self.lightning_module
        assert module is not None
        self.tiered.post_backward(expose=not module.automatic_optimization)  # the training step's own code reads them next
        super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self.tiered.optimizer_step(optimizer, closure, model, super().optimizer_step, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.tiered.checkpoints.lightning_module_state_dict(super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.tiered.checkpoints.optimizer_state(optimizer, super().optimizer_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.tiered.checkpoints.save_checkpoint(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.tiered.checkpoints.load_checkpoint(checkpoint_path, weights_only, super().load_checkpoint, self.checkpoint_io.load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self.tiered.checkpoints.load_model_state_dict(checkpoint, strict, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.tiered.checkpoints.load_optimizer_state_dict(checkpoint, super().load_optimizer_state_dict)

    @override
    def teardown(self) -> None:
        self.tiered.teardown(super().teardown)
