"""LightningModules whose module imports only torch and Lightning: their pickles load in a process
that never imported offload_strategy (tests/test_precision_recipes.py)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn


class LayersInConfigureModel(BoringModel):
    """Lightning's BoringModel with three layers built in ``configure_model`` (under ``tiered``,
    deferred until placed) and AdamW, so that each layer is a unit and has optimizer states."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if not hasattr(self, "layer"):
            self.layer = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def configure_optimizers(self):
        import torch

        return torch.optim.AdamW(self.parameters(), lr=1e-2)
