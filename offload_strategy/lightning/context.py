"""What the parts of a tiered strategy share (docs/architecture.md, "Strategy").

A Lightning strategy (``TieredStrategy``, ``TieredDDPStrategy``) holds one
:class:`~offload_strategy.lightning.core.TieredCore`; the core and its activation control share one
:class:`TieredContext`: the validated options, read-only access to the Lightning state the strategy
holds (module, optimizers, device, precision), and what set-up made (budgets, planner, engine).
Calls go one way: strategy → core → activation control, planner, engine; nothing below calls up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch

from ..config import Budget, BudgetLike, HardwareSpec, PolicyConfig
from ..hardware import known_hardware, resolve_hardware
from ..session.activations import batch_elements

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision

    from ..hardware.device import CopyStreams
    from ..planning.planner import Planner, TierBudgets
    from ..runtime.engine import TieredEngine


class LightningState(Protocol):
    """What the core reads of the Lightning strategy holding it (Lightning sets these after
    construction: the module at ``connect``, the optimizers at set-up, the device and precision
    through its connector)."""

    @property
    def lightning_module(self) -> Optional["pl.LightningModule"]: ...
    @property
    def model(self) -> Optional[torch.nn.Module]: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def precision_plugin(self) -> "Precision": ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...

    optimizers: list[torch.optim.Optimizer]
    _lightning_optimizers: list[Any]


@dataclass(frozen=True)
class TieredOptions:
    """The tiered strategy's arguments, validated."""

    policy: PolicyConfig
    hardware: Union[str, HardwareSpec]  # "auto" is probed at set-up
    gpu_memory: Budget
    host_memory: Budget
    nvme_memory: Budget
    nvme_path: Optional[Path]
    plan_file: Optional[Path]
    # the tensor elements of the longest training batch the user named (``max_batch``): the
    # activation layout is planned for it from the first plan on; None: for the batches seen
    max_batch_elements: Optional[int] = None

    @classmethod
    def parse(
        cls,
        policy: Union[str, PolicyConfig, dict[str, Any]],
        hardware: Union[str, HardwareSpec, dict[str, Any]],
        gpu_memory: BudgetLike,
        host_memory: BudgetLike,
        nvme_path: Optional[Union[str, Path]],
        nvme_memory: BudgetLike,
        plan_file: Optional[Union[str, Path]],
        max_batch: Any = None,
    ) -> "TieredOptions":
        # "auto" is probed at setup, not here: probing CUDA in the constructor would initialise it
        # in a process that may still fork workers.
        if isinstance(hardware, str) and hardware != "auto":
            hardware = known_hardware(hardware)
        elif not isinstance(hardware, str):
            hardware = resolve_hardware(hardware)
        path = _validate_nvme_path(nvme_path)
        if path is None and nvme_memory is not None:
            raise ValueError(f"nvme_memory={nvme_memory!r} was given without nvme_path: name a directory for the NVMe tier.")
        return cls(
            policy=PolicyConfig.coerce(policy), hardware=hardware, gpu_memory=Budget.parse(gpu_memory, "gpu_memory"),
            host_memory=Budget.parse(host_memory, "host_memory"), nvme_memory=Budget.parse(nvme_memory, "nvme_memory"),
            nvme_path=path, plan_file=_validate_plan_file(plan_file), max_batch_elements=_max_batch_elements(max_batch),
        )


def _max_batch_elements(max_batch: Any) -> Optional[int]:
    if max_batch is None:
        return None
    elements = batch_elements(max_batch)
    if elements <= 0:
        raise ValueError(
            f"max_batch={type(max_batch).__name__} holds no tensor: give the longest training batch as the dataloader yields it "
            f"(its tensors, or a dict or tuple of them, at the largest batch size and sequence length the run will see)."
        )
    return elements


@dataclass
class TieredContext:
    """Shared by the core, its planning session and its ``CheckpointStates``; the core and the
    session assign its fields, the checkpoint states only read them."""

    options: TieredOptions
    lightning: LightningState
    hardware: Optional[HardwareSpec] = None  # resolved at set-up when "auto"
    budgets: Optional["TierBudgets"] = None
    planner: Optional["Planner"] = None
    engine: Optional["TieredEngine"] = None
    # the copy streams every device of the run copies on (made at set-up, closed at teardown):
    # each engine a re-placement builds takes the same pair (hardware/device.py)
    copy_streams: Optional["CopyStreams"] = None

    @property
    def policy(self) -> PolicyConfig:
        return self.options.policy

    @property
    def nvme_path(self) -> Optional[Path]:
        return self.options.nvme_path

    @property
    def root_device(self) -> torch.device:
        return self.lightning.root_device

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.lightning.optimizers

    @property
    def max_batch_elements(self) -> Optional[int]:
        return self.options.max_batch_elements

    @property
    def module(self) -> "pl.LightningModule":
        """The LightningModule being trained (the Trainer connects it before set-up)."""
        module = self.lightning.lightning_module
        if module is None:
            raise RuntimeError("the tiered strategy has no LightningModule yet: the Trainer connects one before set-up.")
        return module


def one_device(devices: Optional[list[Any]], loop: str) -> Optional[list[torch.device]]:
    """The devices Lightning's connector gives a one-device tiered strategy (``loop``: "Trainer"
    or "Fabric", where ``devices=1`` is set)."""
    if devices is not None and len(devices) > 1:
        raise ValueError(f"strategy='tiered' trains on one device, but {len(devices)} were given ({devices}); set devices=1 on {loop}.")
    return [torch.device(d) for d in devices] if devices is not None else None


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
        raise ValueError(f"plan_file={str(path)!r} is not a file; dump a plan with strategy.dump_plan(path) after set-up "
                         "(or `offload-strategy plan --out PATH`) and pass its path.")
    return resolved
