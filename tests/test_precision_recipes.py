"""16-bit recipes and what follows ``fit``, each beside plain Lightning.

Under ``*-true`` the reference is plain Lightning updating fp32 masters by hand
(``test_precision.FP32MasterLM``), what every tiered placement promises; the comparison is exact.
A module pickled after ``fit`` (or before, built under the strategy) holds plain parameters with
their true values, and loads in a process that never imported offload_strategy.
"""

from __future__ import annotations

import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.planning.placement import PlacementError
from tests.helpers import assert_same_weights, train
from tests.test_offload import gpt2_4l
from tests.test_precision import FP32MasterLM, Homes, tiers

LOW = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


class EngineHomes(Homes):
    """``Homes``, and nothing where no engine runs (plain training: its masters are the parameters)."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.strategy.engine is None:
            self.homes.add("no engine")
            return
        super().on_train_batch_end(trainer, pl_module, *args)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_policy_none_keeps_fp32_masters_as_every_other_placement(tmp_path, precision):
    """Under policy 'none' no engine ran, so plain Lightning's HalfPrecision stepped the 16-bit
    parameters themselves: in fp16 AdamW's epsilon rounds to 0 and a parameter whose gradient is
    zero (an unused embedding row) became 0/0, NaN from the second step, where every other
    placement updates fp32 masters and stays finite. 'none' now does what they do, every unit
    in the GPU tier."""
    reference_losses, reference_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=FP32MasterLM, precision=precision)
    homes = EngineHomes()
    strategy = TieredStrategy(policy="none", host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "none", epochs=1, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,))
    assert losses == reference_losses
    assert_same_weights(reference_weights, weights)
    assert all(torch.isfinite(w).all() and w.dtype == LOW[precision] for w in weights.values())
    assert homes.homes == {"gpu"} and homes.master_dtypes == {torch.float32}


def test_policy_none_with_fp32_masters_refuses_a_gpu_tier_that_cannot_hold_them(tmp_path):
    """'none' keeps every unit in the GPU tier: with masters that do not fit, it says how much
    the model needs there instead of offloading."""
    strategy = TieredStrategy(policy="none", gpu_memory=100_000, host_memory="1GiB")
    with pytest.raises(PlacementError, match=r"the model needs .* in the GPU tier .* but gpu_memory grants 97.66 KiB; raise gpu_memory"):
        train(strategy, tmp_path / "none", epochs=1, make_model=gpt2_4l, precision="bf16-true")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("placement", ["tiers", "resident"])
def test_clipping_by_value_under_true_precisions_matches_plain(tmp_path, precision, placement):
    """Lightning's clipping by value: the engine clips each unit's fp32 gradients as they
    complete; Lightning's default hook, called after it as plain training calls it, was given an
    optimizer whose parameters held no gradient (all of them at the engine under ``*-true``), and
    torch's clip_grad_value_ failed on the empty list in the first step."""
    clipping = dict(gradient_clip_val=0.002, gradient_clip_algorithm="value")
    reference_losses, reference_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=FP32MasterLM, precision=precision, **clipping)
    strategy = tiers(tmp_path / "nvme") if placement == "tiers" else TieredStrategy(gpu_memory="1GiB", host_memory="1GiB")
    homes = Homes()
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,), **clipping)
    assert homes.homes == ({"gpu", "host", "nvme"} if placement == "tiers" else {"gpu"})
    assert losses == reference_losses
    assert_same_weights(reference_weights, weights)
    if placement == "resident" and precision == "bf16-true":  # the threshold clips: unclipped training ends elsewhere
        _, unclipped, _ = train("auto", tmp_path / "unclipped", epochs=1, make_model=FP32MasterLM, precision=precision)
        assert any(not torch.equal(unclipped[k], weights[k]) for k in weights)
