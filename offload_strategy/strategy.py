"""``TieredStrategy``: the Lightning glue of the tiered runtime on one device. Lightning's hooks
are delegated to the strategy's :class:`~offload_strategy.strategy_core.TieredCore`, which plans
with the planner and runs the engine; until the engine is attached every tensor stays on the root
device, which trains exactly as Lightning's single-device strategy does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from .checkpoint_io import AtomicCheckpointIO
from .config import BudgetLike, HardwareSpec, PolicyConfig, StateDictType
from .planning.planner import TierBudgets
from .strategy_context import TieredOptions, one_device
from .session.budgets import MemoryBudgetError
from .strategy_core import OneProcess, TieredCore, check_precision, exposes_core
from .strategy_recipe import reads_gradients_after_backward

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator

__all__ = ["MemoryBudgetError", "TierBudgets", "TieredStrategy"]


@exposes_core
class TieredStrategy(SingleDeviceStrategy):
    """Train models larger than GPU memory by tiering tensors across GPU, host memory and NVMe.

    Args:
        policy: ``"auto"`` (the planner chooses every placement), ``"none"`` (everything stays in
            the GPU tier), a :class:`~offload_strategy.config.PolicyConfig` or a mapping of its fields.
        hardware: ``"auto"`` probes this machine; a known machine name (``"h100_80g"``,
            ``"rtx4090"``, ...), a :class:`~offload_strategy.config.HardwareSpec` or a mapping.
        gpu_memory, host_memory, nvme_memory: the budget of each tier: bytes, a size such as
            ``"16GiB"``, or a fraction of what is free (``0.9`` or ``"90%"``); ``None`` means all
            that is free. On a machine without a GPU, ``gpu_memory`` is the capacity of the
            emulated GPU tier.
        nvme_path: a directory for the NVMe tier; ``None`` means no NVMe tier.
        plan_file: a JSON plan (as written by :meth:`dump_plan`) to run
            instead of planning: every unit's home and every block's activation policy. A plan
            made for another model is refused with the first difference.
        state_dict_type: how checkpoints are written, in the words of Lightning's FSDP strategy:
            ``"full"`` (one file, as plain Lightning writes), ``"sharded"`` (a directory written
            tensor by tensor, never the whole model in memory), or ``"auto"``: sharded when the
            parameters and optimizer states at home on NVMe exceed half the host memory
            available, one file otherwise. Both kinds load with ``ckpt_path``.
        max_batch: the longest training batch the run will see, as the dataloader yields it (a
            tensor, or a dict, tuple or list of them: under dynamic padding, one collated at the
            longest sequence length and the largest batch size; under Fabric, the inputs of the
            model's forward, ``(args, kwargs)``). The activation layout chosen
            after the profiled steps is planned for it, the measured activations scaled by its
            tensor elements over the smallest profiled batch's, so the plan holds for every batch
            up to it from the first step: a run it cannot hold is refused in the first training
            step, before any update, and a batch larger than it is refused. ``None``: the layout
            is planned for the batches profiled, and a larger batch later is laid out again as its
            first block is called (or, where no layout fits it, refused then). Without it, put the
            longest batch first to have it profiled.
    """


    strategy_name = "tiered"

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
        state_dict_type: Union[str, StateDictType] = StateDictType.AUTO,
        max_batch: Any = None,
        accelerator: Optional["Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        options = TieredOptions.parse(policy, hardware, gpu_memory, host_memory, nvme_path, nvme_memory, plan_file, max_batch)
        self.tiered = TieredCore(options, self, OneProcess())
        self.tiered.state_dict_type = StateDictType.coerce(state_dict_type)
        self._parallel_devices: Optional[list[torch.device]] = None
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision_plugin=precision_plugin
        )
        if parallel_devices is not None:
            self.parallel_devices = parallel_devices

    # -- devices and precision: Lightning's connector sets these after construction ----------------

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        self._parallel_devices = one_device(devices, "the Trainer")

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else torch.device("cpu")

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = check_precision(plugin)

    # -- Lightning's hooks, delegated to the core ------------------------------------------------------

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        with self.tiered.tensor_init_context(lambda: super(TieredStrategy, self).tensor_init_context(empty_init), empty_init):
            yield

    @override
    def model_to_device(self) -> None:
        self.tiered.model_to_device(super().model_to_device)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.tiered.setup(trainer, super().setup)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        return self.tiered.training_step(lambda: super(TieredStrategy, self).training_step(*args, **kwargs), batch=batch)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered.eval_step(lambda: super(TieredStrategy, self).validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered.eval_step(lambda: super(TieredStrategy, self).test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered.eval_step(lambda: super(TieredStrategy, self).predict_step(*args, **kwargs))

    # Lightning's own ``Strategy.backward`` runs between these two: code that patches or spies on
    # it (Lightning's test suite counts backward calls that way) sees every backward.
    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        module = self.lightning_module
        assert module is not None
        self.tiered.pre_backward(hooks_after=reads_gradients_after_backward(module.trainer))

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
        return self.tiered.lightning_module_state_dict(super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.tiered.optimizer_state(optimizer, super().optimizer_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.tiered.save_checkpoint(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.tiered.load_checkpoint(checkpoint_path, weights_only, super().load_checkpoint, self.checkpoint_io.load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self.tiered.load_model_state_dict(checkpoint, strict, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.tiered.load_optimizer_state_dict(checkpoint, super().load_optimizer_state_dict)

    @override
    def teardown(self) -> None:
        self.tiered.teardown(super().teardown)
