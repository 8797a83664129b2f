"""On a CUDA GPU: parameters are created in host memory, placed by the engine, and training matches
plain Lightning on the same GPU. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from offload_strategy import TieredStrategy
from tests.helpers import PARAMETERS_ONLY, train
from tests.test_offload import gpt2_4l, param_bytes

pytestmark = pytest.mark.gpu


def test_offloaded_training_on_a_gpu_matches_plain(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    recorded = {}

    class Where(__import__("lightning").Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            recorded["homes"] = {s.home for s in engine.states}
            recorded["arena"] = engine.arena.device.type

    losses, weights, _ = train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.3 * total), host_memory="1GiB"), tmp_path / "tiered", epochs=2,
                               make_model=gpt2_4l, accelerator="gpu", extra_callbacks=(Where(),))
    assert recorded["arena"] == "cuda" and "host" in recorded["homes"]
    # cuBLAS may pick other kernels for other memory layouts: equal to within float32 rounding
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name in plain_weights:
        torch.testing.assert_close(weights[name].cpu(), plain_weights[name].cpu(), rtol=1e-4, atol=1e-5)


def test_the_default_policy_on_a_gpu_searches_a_plan_and_matches_plain(tmp_path):
    """The joint search on a real GPU tier: activations now live in it, so the budget (twice the
    parameters) holds parameters and the blocks' layout together."""
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    strategy = TieredStrategy(gpu_memory=2 * total, host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2_4l, accelerator="gpu")
    assert strategy.activation_plan is not None
    assert strategy.tiered.activations.gpu_parameter_bytes() + strategy.activation_plan.peak_bytes <= 2 * total
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name in plain_weights:
        torch.testing.assert_close(weights[name].cpu(), plain_weights[name].cpu(), rtol=1e-4, atol=1e-5)
