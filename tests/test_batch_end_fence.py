"""Host memory is fenced when a batch ends: no copy still reads or writes a host home when the
training loop hands the parameters to user code (``on_train_batch_end``, ``on_validation_batch_end``:
an EMA, ``load_state_dict``, a weight constraint). On CUDA a device-side wait orders compute only,
so a copy out of a home can still be queued when the host goes on; the race check keeps those
books on the CPU (``OFFLOAD_STRATEGY_RACE_CHECK``) and raises when a callback touches such a home."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.hardware.device import RACE_CHECK_ENV
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_offload import beside_kept, gpt2_4l, param_bytes
from tests.test_race_check import kept_peak_frozen


class WritesAtBatchEnd(L.Callback):
    """Shrinks one weight at every batch's end (a weight constraint), as user code may. With the
    strategy's engine in place it first asks the race check whether a copy may still use any
    host home (the check only sees what it is asked about)."""

    def __init__(self, forward_first: bool = False) -> None:
        self.checked = 0
        self.forward_first = forward_first  # a forward between steps first (samples, a metric): its fetches read homes

    def _touch(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        check = engine.device.check_host_access if engine is not None else None
        if engine is not None:
            assert engine.device.race_check is not None
            for s in engine.states:  # before any parameter is read (inside an accumulation a read fetches its unit)
                for home in s.home_views:
                    check(home, "writes a parameter at home in a callback at batch end")
                    self.checked += 1
        with torch.no_grad():
            if self.forward_first:
                pl_module.model(torch.zeros(2, 8, dtype=torch.long))
            weight = pl_module.model.transformer.h[0].mlp.c_fc.weight  # between steps: lent to this code, its home
            if check is not None and self.forward_first:
                check(weight, "writes a parameter lent after a forward between steps")
            weight.mul_(0.999)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self._touch(trainer, pl_module)

    def on_validation_batch_end(self, trainer, pl_module, *args) -> None:
        self._touch(trainer, pl_module)


def _frozen_blocks() -> L.LightningModule:
    """A LoRA base's case: the blocks' units get no gradient, so no gradient copy orders their
    copies into the GPU tier for the host."""
    model = gpt2_4l()
    model.configure_model()
    model.model.transformer.h[1:].requires_grad_(False)
    return model


@pytest.mark.parametrize(("accumulate", "forward_first"), [(1, False), pytest.param(2, False, marks=pytest.mark.slow), pytest.param(1, True, marks=pytest.mark.slow)],
                         ids=["step", "accumulate", "lent_after_a_forward"])
def test_a_callback_writes_host_homes_at_batch_end_after_every_copy_out_of_them(tmp_path, monkeypatch, accumulate, forward_first):
    """Frozen host units' copies into the GPU tier were waited for on the device only: at the end
    of a step, of a micro-batch that accumulates and of a validation batch they could still be
    queued, and a forward between steps left its own when it lent a home. Training with the
    callback's writes is plain Lightning's, bit for bit."""
    kwargs = dict(epochs=1, make_model=_frozen_blocks, accumulate_grad_batches=accumulate, limit_val_batches=1, limit_train_batches=3)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", extra_callbacks=(WritesAtBatchEnd(forward_first),), **kwargs)
    monkeypatch.setenv(RACE_CHECK_ENV, "5")
    total, writes = param_bytes(gpt2_4l), WritesAtBatchEnd(forward_first)
    strategy = TieredStrategy(policy={**PARAMETERS_ONLY, "placement": "host"}, gpu_memory=beside_kept(0.3, total, kept_peak_frozen(3)),
                              host_memory=int(6 * total))
    losses, weights, _ = train(strategy, tmp_path / "tiered", extra_callbacks=(writes,), **kwargs)
    assert writes.checked > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
