"""A kept layout's measured peak under ``*-mixed``: autocast's 16-bit casts of streamed weights are
saved as references to their units and cast again in backward, so they hold nothing in the GPU
tier and the first forward's count of the layout leaves them out (it counted them: 48 casts of
128 KiB made a 6 MiB peak the run never held, and a GPU tier that trained before was refused)."""

from __future__ import annotations

import lightning as L

from offload_strategy import TieredStrategy
from tests.helpers import train
from tests.test_autocast_casts import WEIGHT_BYTES, DeepMLP


class FixedPeak(L.Callback):
    """The kept layout's peak as the first training forward measured it."""

    def __init__(self) -> None:
        self.peak: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        fixed = trainer.strategy.tiered.activations.fixed
        assert fixed is not None, "the first training forward measured the layout"
        self.peak = fixed.peak_bytes


def _peak(tmp_path, precision: str) -> int:
    probe = FixedPeak()
    strategy = TieredStrategy(gpu_memory=WEIGHT_BYTES // 5, host_memory=8 * WEIGHT_BYTES, policy={"name": "auto", "placement": "host", "activations": "keep"})
    train(strategy, tmp_path, epochs=1, precision=precision, make_model=DeepMLP, max_steps=1, extra_callbacks=(probe,))
    assert probe.peak is not None
    return probe.peak


def test_a_kept_layout_under_bf16_mixed_counts_no_cast_of_a_streamed_weight(tmp_path):
    full = _peak(tmp_path / "fp32", "32-true")
    mixed = _peak(tmp_path / "bf16", "bf16-mixed")
    # the same activations, in bf16 where autocast computes in it: never more than fp32's
    assert 0 < mixed <= full, (mixed, full)


class MeasuredBlock(L.Callback):
    """The measured block's saved bytes, as the planner's profile of the first training step has them."""

    def __init__(self) -> None:
        self.saved: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if self.saved is None:
            policies = trainer.strategy.tiered.activations.policies_in_use
            assert policies is not None and policies.profiled, "the first training step measured the blocks"
            self.saved = policies.block_costs()[0].activation_bytes


def _measured(tmp_path, precision: str) -> int:
    probe = MeasuredBlock()
    strategy = TieredStrategy(gpu_memory=WEIGHT_BYTES // 5, host_memory=8 * WEIGHT_BYTES, policy={"name": "auto", "placement": "host"})
    train(strategy, tmp_path, epochs=1, precision=precision, make_model=DeepMLP, max_steps=1, extra_callbacks=(probe,))
    assert probe.saved is not None
    return probe.saved


def test_the_planner_s_measured_block_under_bf16_mixed_counts_no_cast_of_a_streamed_weight(tmp_path):
    """The profile the auto layout is planned from counts as an observed layout does (it counted
    each layer's 128 KiB cast of its weight beside its 4 KiB input)."""
    full = _measured(tmp_path / "fp32", "32-true")
    mixed = _measured(tmp_path / "bf16", "bf16-mixed")
    assert 0 < mixed <= full, (mixed, full)
