"""More shapes of models, trained with offloaded parameters against plain Lightning (fp32, bit for bit)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy import TieredStrategy
from tests.helpers import assert_same_weights, train
from tests.test_offload import Recorder, param_bytes


class ConvNet(L.LightningModule):
    """Token ids as a 1-D signal: embedding, convolutions with batch norm, pooling, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.convs = nn.Sequential(
            nn.Conv1d(16, 32, 3, padding=1), nn.BatchNorm1d(32), nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1), nn.BatchNorm1d(32), nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1), nn.BatchNorm1d(32), nn.ReLU(),
        )
        self.head = nn.Linear(32, 256)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[:, :-1]).transpose(1, 2)
        x = self.convs(x).mean(dim=2)
        return nn.functional.cross_entropy(self.head(x), batch[:, -1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Branching(L.LightningModule):
    """Which branch runs depends on the step, and one parameter is used only every third step, so
    its gradient is missing in the others."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.left = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        self.right = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.rare = nn.Parameter(torch.zeros(32))
        self.head = nn.Linear(32, 256)
        self.calls = 0

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[:, :-1]).mean(dim=1)
        x = self.left(x) if self.calls % 2 == 0 else self.right(x)
        if self.calls % 3 == 0:
            x = x + self.rare
        self.calls += 1
        return nn.functional.cross_entropy(self.head(x), batch[:, -1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("make, fraction", [(ConvNet, 0.9), (Branching, 0.85)], ids=["convnet", "branching"])
def test_matches_plain_training(tmp_path, make, fraction):
    total = param_bytes(make)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=3, make_model=make)
    recorder = Recorder()
    losses, weights, _ = train(TieredStrategy(gpu_memory=int(fraction * total), host_memory="1GiB"), tmp_path / "tiered", epochs=3,
                               make_model=make, extra_callbacks=(recorder,))
    assert recorder.homes["host"] > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)  # includes batch-norm statistics
