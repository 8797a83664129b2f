import importlib
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import offload_strategy
from offload_strategy import TieredStrategy


def test_fresh_interpreter_registers_tiered_on_import():
    code = (
        "import lightning as L\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'tiered' not in StrategyRegistry, 'registered before import'\n"
        "import offload_strategy\n"
        "t = L.Trainer(strategy='tiered', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.root_device)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "TieredStrategy cpu"


def test_unknown_strategy_name_still_fails():
    with pytest.raises(ValueError, match="tierd"):
        L.Trainer(strategy="tierd", accelerator="cpu", devices=1, logger=False)


def test_registration_is_idempotent():
    importlib.reload(offload_strategy)
    offload_strategy._register_strategies()
    assert StrategyRegistry["tiered"]["strategy"].__name__ == "TieredStrategy"


def test_instance_gets_root_device_from_trainer():
    strategy = TieredStrategy(policy="none")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy is strategy
    assert strategy.parallel_devices == [strategy.root_device]
    assert strategy.root_device.type == "cpu"


def test_refuses_several_devices():
    with pytest.raises(ValueError, match="one device, but 2 were given"):
        L.Trainer(strategy="tiered", accelerator="cpu", devices=2, logger=False)


def test_refuses_unsupported_precision():
    from lightning.pytorch.plugins.precision import FSDPPrecision

    with pytest.raises(ValueError, match="FSDPPrecision.*use precision='32-true', '64-true'"):
        TieredStrategy().precision_plugin = FSDPPrecision("32-true")


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "bf16-true"])
def test_accepts_supported_precision(precision):
    trainer = L.Trainer(strategy="tiered", accelerator="cpu", devices=1, precision=precision, logger=False)
    assert isinstance(trainer.strategy, TieredStrategy)
