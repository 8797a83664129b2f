"""``tiered`` trains exactly as Lightning's default strategy: same losses, same weights (fp32, CPU)."""

import torch

from offload_strategy import TieredStrategy
from tests.helpers import BATCHES_PER_EPOCH, assert_same_weights, train


def test_same_losses_and_weights_as_plain_lightning(tmp_path):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2)
    tiered_losses, tiered_weights, trainer = train("tiered", tmp_path / "tiered", epochs=2)
    assert isinstance(trainer.strategy, TieredStrategy)
    assert len(plain_losses) == 2 * BATCHES_PER_EPOCH >= 10
    assert tiered_losses == plain_losses  # bit-identical
    assert_same_weights(plain_weights, tiered_weights)
    assert plain_losses[-1] < plain_losses[0]  # it did train


def test_resume_from_checkpoint_continues_identically(tmp_path):
    full_losses, full_weights, _ = train("tiered", tmp_path / "full", epochs=2)
    first_losses, _, _ = train("tiered", tmp_path / "part", epochs=2, stop_after_epochs=1, save_every_epoch=True)
    checkpoint = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    assert checkpoint.is_file()
    resumed_losses, resumed_weights, trainer = train("tiered", tmp_path / "resumed", epochs=2, resume=checkpoint, seed=999)
    assert trainer.global_step == 2 * BATCHES_PER_EPOCH
    assert first_losses + resumed_losses == full_losses
    assert_same_weights(full_weights, resumed_weights)


def test_checkpoint_moves_between_tiered_and_plain(tmp_path):
    full_losses, full_weights, _ = train("auto", tmp_path / "full", epochs=2)
    train("tiered", tmp_path / "part", epochs=2, stop_after_epochs=1, save_every_epoch=True)
    checkpoint = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    state = torch.load(checkpoint, weights_only=True)
    assert state["optimizer_states"][0]["state"], "the optimizer state was saved"
    resumed_losses, resumed_weights, _ = train("auto", tmp_path / "resumed", epochs=2, resume=checkpoint)
    assert resumed_losses == full_losses[BATCHES_PER_EPOCH:]
    assert_same_weights(full_weights, resumed_weights)
