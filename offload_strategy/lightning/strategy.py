"""``TieredStrategy``: the Lightning glue of the tiered runtime on one device. Lightning's hooks
are delegated to the strategy's :class:`~offload_strategy.lightning.core.TieredCore`
(``lightning/hooks.py``), which plans with the planner and runs the engine; until the engine is
attached every tensor stays on the root device, which trains exactly as Lightning's
single-device strategy does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy

from ..checkpoint.atomic import AtomicCheckpointIO
from ..config import BudgetLike, HardwareSpec, PolicyConfig, StateDictType
from ..planning.planner import TierBudgets
from .hooks import OneDevice, TieredHooks
from ..session.budgets import MemoryBudgetError
from .context import TieredOptions
from .core import OneProcess, TieredCore

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator

__all__ = ["MemoryBudgetError", "TierBudgets", "TieredStrategy"]


class TieredStrategy(TieredHooks, OneDevice, SingleDeviceStrategy):
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
    runner = "the Trainer"

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
        self.tiered.checkpoints.state_dict_type = StateDictType.coerce(state_dict_type)
        self._parallel_devices = None
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision_plugin=precision_plugin
        )
        if parallel_devices is not None:
            self.parallel_devices = parallel_devices
