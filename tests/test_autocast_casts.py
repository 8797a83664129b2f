"""Autocast's 16-bit casts of streamed weights under ``*-mixed``: none is kept past its unit's
eviction, neither among the tensors saved for backward nor in autocast's cast cache, and training
stays plain Lightning's bit for bit. Lightning's Trainer enters autocast with its cache off;
Lightning Fabric, and code entering ``torch.autocast`` itself, with it on."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy import TieredStrategy
from offload_strategy.estimate.live_bytes import LiveBytes
from tests.helpers import assert_same_weights, train

WIDTH, LAYERS = 256, 48
WEIGHT_BYTES = LAYERS * WIDTH * WIDTH * 4  # the fp32 weights of the linear layers


class DeepMLP(L.LightningModule):
    """48 linear layers; each training forward records how much the tensors it holds grew between
    the first layer's start and the last one's (``LiveBytes``: what a GPU's allocated bytes count)."""

    def __init__(self, cached_autocast: bool = False) -> None:
        super().__init__()
        self.cached_autocast = cached_autocast  # the forward under torch.autocast with its cast cache, as Fabric enters it
        self.embed = nn.Embedding(256, WIDTH)
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        for layer in self.layers:  # outputs of the inputs' scale through all 48
            nn.init.normal_(layer.weight, std=WIDTH**-0.5)
        self.growth: list[int] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        marks: list[int] = []
        hooks = [layer.register_forward_pre_hook(lambda *_: marks.append(live.bytes)) for layer in (self.layers[0], self.layers[-1])]
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.cached_autocast else contextlib.nullcontext()
        with LiveBytes() as live, autocast:
            out = self.layers(self.embed(batch).mean(1))
        for hook in hooks:
            hook.remove()
        self.growth.append(marks[1] - marks[0])
        return out.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _streamed() -> TieredStrategy:
    """Every unit at home in host memory, streamed through a GPU tier of a fifth of the weights."""
    return TieredStrategy(gpu_memory=WEIGHT_BYTES // 5, host_memory=8 * WEIGHT_BYTES, policy={"name": "auto", "placement": "host", "activations": "keep"})


def _run(strategy, precision, tmp_path):
    made: list[DeepMLP] = []
    cached = precision == "cached-autocast"
    make = lambda: made.append(DeepMLP(cached)) or made[0]  # noqa: E731
    losses, weights, trainer = train(strategy, tmp_path, epochs=1, precision="32-true" if cached else precision, make_model=make, max_steps=3)
    return losses, weights, max(made[0].growth), trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "cached-autocast", "32-true"])
def test_a_streamed_forward_keeps_no_16_bit_copy_of_the_weights(tmp_path, precision):
    """Under bf16-mixed, plain Lightning's forward holds a bf16 copy of every weight (each linear
    layer saves its weight's cast for backward; with the cast cache on, the cache holds them too):
    half the fp32 bytes. Streamed, the forward holds less than a quarter (it held half: the saved
    casts until backward, and the cache each trainable weight's cast past its eviction); 32-true as
    plain, and every case trains as plain Lightning does, bit for bit."""
    plain_losses, plain_weights, plain_growth, _ = _run("auto", precision, tmp_path / "plain")
    losses, weights, growth, trainer = _run(_streamed(), precision, tmp_path / "tiered")
    metrics = trainer.strategy.metrics()
    assert metrics["units/gpu"] == 0 and metrics["units/host"] == LAYERS + 1, metrics
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    if precision != "32-true":
        assert plain_growth > 0.45 * WEIGHT_BYTES  # the measurement sees the casts where they are held
        assert growth < WEIGHT_BYTES / 4, f"the forward grew by {growth / WEIGHT_BYTES:.2f} of the fp32 weights"
    else:
        assert growth == plain_growth
