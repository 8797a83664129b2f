"""``TieredStrategy``: the Lightning glue. Validates what the user asked for, resolves the memory
budgets of each tier against what is free, and exposes the metrics the engine reports.

The strategy holds no placement logic: the planner decides, the runtime engine carries it out.
Until the engine is attached every tensor stays on the root device, which trains exactly as
Lightning's single-device strategy does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from .config import Budget, BudgetLike, HardwareSpec, PolicyConfig, format_bytes
from .hardware import disk_free, gpu_free, host_available, known_hardware, process_peak_rss, resolve_hardware

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator

# Precision plugins whose semantics the tiered runtime reproduces: 32-true, 16/bf16-mixed and
# 16/bf16-true. Others (64-true, bitsandbytes, Transformer Engine, ...) change the module or
# the step in ways the runtime would silently undo.
_SUPPORTED_PRECISION = (Precision, MixedPrecision, HalfPrecision)


class MemoryBudgetError(ValueError):
    """A tier budget asks for more than the tier has free."""


@dataclass(frozen=True)
class TierBudgets:
    """Bytes the strategy may use in each tier, resolved against what was free at setup."""

    gpu: int
    host: int
    nvme: int


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
        plan_file: a JSON plan (as dumped by ``tools/plan.py``) to run instead of planning.
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
        accelerator: Optional["Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self.policy = PolicyConfig.coerce(policy)
        # "auto" is probed at setup, not here: probing CUDA in the constructor would initialise it
        # in a process that may still fork workers.
        if isinstance(hardware, str) and hardware != "auto":
            hardware = known_hardware(hardware)
        elif not isinstance(hardware, str):
            hardware = resolve_hardware(hardware)
        self._hardware_request = hardware
        self.hardware: Optional[HardwareSpec] = hardware if isinstance(hardware, HardwareSpec) else None
        self.gpu_memory = Budget.parse(gpu_memory, "gpu_memory")
        self.host_memory = Budget.parse(host_memory, "host_memory")
        self.nvme_memory = Budget.parse(nvme_memory, "nvme_memory")
        self.nvme_path = _validate_nvme_path(nvme_path)
        if self.nvme_path is None and nvme_memory is not None:
            raise ValueError(f"nvme_memory={nvme_memory!r} was given without nvme_path: name a directory for the NVMe tier.")
        self.plan_file = _validate_plan_file(plan_file)
        self.budgets: Optional[TierBudgets] = None
        self._parallel_devices: Optional[list[torch.device]] = None
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if parallel_devices is not None:
            self.parallel_devices = parallel_devices

    # -- devices and precision: Lightning's connector sets these after construction ----------------

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        if devices is not None and len(devices) > 1:
            raise ValueError(
                f"strategy='tiered' trains on one device, but {len(devices)} were given ({devices}); "
                f"set devices=1 on the Trainer."
            )
        self._parallel_devices = [torch.device(d) for d in devices] if devices is not None else None

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
        if plugin is not None and type(plugin) not in _SUPPORTED_PRECISION:
            raise ValueError(
                f"strategy='tiered' does not support the precision plugin {type(plugin).__name__}; "
                f"use precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
            )
        self._precision_plugin = plugin

    # -- lifecycle ----------------------------------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if self.hardware is None:
            self.hardware = resolve_hardware(self._hardware_request)
        self.budgets = self.resolve_budgets()
        if self.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.root_device)
        super().setup(trainer)

    def resolve_budgets(self) -> TierBudgets:
        """Grant each tier its budget, refusing up front any that asks for more than is free."""
        free = {
            "gpu_memory": gpu_free(self.root_device),
            "host_memory": host_available(),
            "nvme_memory": disk_free(str(self.nvme_path)) if self.nvme_path else 0,
        }
        where = {
            "gpu_memory": str(self.root_device) if self.root_device.type == "cuda" else "the emulated GPU tier (host memory)",
            "host_memory": "host memory",
            "nvme_memory": str(self.nvme_path),
        }
        granted = {}
        for name, budget in (("gpu_memory", self.gpu_memory), ("host_memory", self.host_memory), ("nvme_memory", self.nvme_memory)):
            granted[name] = budget.resolve(free[name])
            if budget.bytes is not None and budget.bytes > free[name]:
                raise MemoryBudgetError(
                    f"{name}={format_bytes(budget.bytes)} asks for more than is free in {where[name]}: "
                    f"{format_bytes(free[name])} free. Lower {name}, give a fraction such as 0.9, "
                    f"or leave it None to use all that is free."
                )
        return TierBudgets(gpu=granted["gpu_memory"], host=granted["host_memory"], nvme=granted["nvme_memory"])

    # -- metrics ------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Numbers the strategy reports, read by :class:`~offload_strategy.OffloadMonitor`."""
        out: dict[str, float] = {}
        if self.budgets is not None:
            out["budget/gpu_bytes"] = float(self.budgets.gpu)
            out["budget/host_bytes"] = float(self.budgets.host)
            out["budget/nvme_bytes"] = float(self.budgets.nvme)
        if self.root_device.type == "cuda":
            out["memory/gpu_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.root_device))
        out["memory/host_peak_bytes"] = float(process_peak_rss())
        out["memory/nvme_bytes"] = 0.0  # nothing is written to the NVMe tier until the engine places tensors there
        return out


def _validate_nvme_path(path: Optional[Union[str, Path]]) -> Optional[Path]:
    if path is None:
        return None
    if not isinstance(path, (str, Path)) or str(path).strip() == "":
        raise ValueError(f"nvme_path={path!r} is not a directory path.")
    resolved = Path(path).expanduser().absolute()
    if resolved.exists() and not resolved.is_dir():
        raise ValueError(f"nvme_path={str(path)!r} exists and is not a directory; name a directory (it is created if missing).")
    return resolved


def _validate_plan_file(path: Optional[Union[str, Path]]) -> Optional[Path]:
    if path is None:
        return None
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise ValueError(f"plan_file={str(path)!r} is not a file; dump a plan with tools/plan.py and pass its path.")
    return resolved
