"""offload_strategy: train models larger than GPU memory with ``Trainer(strategy="tiered")``.

Importing the package registers the strategy names ``"tiered"`` and ``"tiered_ddp"`` with Lightning,
and ``"tiered"`` with Lightning Fabric (``L.Fabric(strategy="tiered")``).
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from .lightning.callbacks import OffloadMonitor
from .config import PRESETS, RUNTIME_HOST_ALLOWANCE, Budget, HardwareSpec, PolicyConfig, format_bytes, parse_size
from .estimate import Estimate, PresetEstimate, estimate
from .hardware import KNOWN_MACHINES, known_hardware, probe_hardware
from .runtime.params.offloaded import OffloadedParameterError
from .lightning.strategy import MemoryBudgetError, TierBudgets, TieredStrategy
from .lightning.ddp import TieredDDPStrategy
from .lightning.fabric import TieredFabricStrategy
from .lightning.names import UnknownStrategyNameError, install as _install_name_suggestions
from .construction.weights import WeightsMismatchError, load_weights

__version__ = "0.1.0"


def _register_strategies() -> None:
    # Guarded so that re-importing (reloads, notebooks, spawned workers) never raises.
    for preset in PRESETS:
        name = f"{TieredStrategy.strategy_name}_{preset}"
        if preset not in ("auto", "none") and name not in StrategyRegistry:
            StrategyRegistry.register(name, TieredStrategy, description=f"The tiered strategy with the {preset!r} policy preset.", policy=preset)
    if TieredStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            TieredStrategy.strategy_name,
            TieredStrategy,
            description="Tiers parameters, gradients, optimizer states and activations across GPU, host memory and NVMe.",
        )
    for preset in PRESETS:  # the same names under Lightning Fabric
        name = TieredFabricStrategy.strategy_name if preset == "auto" else f"{TieredFabricStrategy.strategy_name}_{preset}"
        if preset != "none" and name not in FABRIC_STRATEGIES:
            description = f"The tiered strategy under Fabric with the {preset!r} policy preset."
            FABRIC_STRATEGIES.register(name, TieredFabricStrategy, description=description, policy=preset)
    if TieredDDPStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            TieredDDPStrategy.strategy_name,
            TieredDDPStrategy,
            description="The tiered strategy on every rank of a data-parallel run, with optimizer states sharded across ranks.",
        )
    for registry in (StrategyRegistry, FABRIC_STRATEGIES):  # "tierd" -> "did you mean 'tiered'?"
        _install_name_suggestions(registry)


_register_strategies()

__all__ = [
    "KNOWN_MACHINES",
    "PRESETS",
    "RUNTIME_HOST_ALLOWANCE",
    "OffloadedParameterError",
    "Budget",
    "Estimate",
    "PresetEstimate",
    "estimate",
    "HardwareSpec",
    "MemoryBudgetError",
    "OffloadMonitor",
    "PolicyConfig",
    "TierBudgets",
    "TieredDDPStrategy",
    "TieredFabricStrategy",
    "TieredStrategy",
    "UnknownStrategyNameError",
    "WeightsMismatchError",
    "format_bytes",
    "known_hardware",
    "load_weights",
    "parse_size",
    "probe_hardware",
]
