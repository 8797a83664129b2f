"""Forwards that are not one pass of every block per backward: two forwards before one backward
(a siamese pair, a consistency loss), layers skipped at random (Hugging Face's LayerDrop, and its
like written by hand), a layer skipped on alternate steps. Each trains as plain Lightning does, to
the bit, at the smallest GPU tier the strategy names (set-up's minimum, then under the default
policy the minimum each refusal of the first training step names, every refusal before any
update), with every block checkpointed and under the default policy.

They stopped in backward with "no GPU-tier buffer ... is free": a recomputed block's units stayed
in the GPU tier until their gradients were complete, which with two graphs is only at the second
graph's backward; and the prefetcher, following the first step's order where a step skips a
layer, filled a size class with units nobody asked for, so that a small unit of the recomputed
block took a larger buffer a larger unit of the same block then found held. Under the default
policy, a profiled step that skipped a layer (the first among them) measured nothing until a
step ran every block, so the refusal naming the minimum came after three updates."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy import TieredStrategy
from offload_strategy.planning.placement import PlacementError
from offload_strategy.runtime.params.scheduler import RESYNC_WINDOW, PrefetchTable
from tests.helpers import assert_same_weights
from tests.test_recipes import Losses, Net, PlainRuns, fit

pytestmark = pytest.mark.slow  # each finds its minimum through the strategy's refusals, then trains twice

CHECKPOINT = {"placement": "host", "activations": "checkpoint"}
DEFAULT = None  # the default policy: blocks laid out from the first steps' measurements
POLICIES = {"checkpoint": CHECKPOINT, "default": DEFAULT}
STEPS = 6


class Layer(nn.Module):
    """A transformer layer's units at their sizes: four projections, two norms, two MLP matrices
    (three size classes beside the embedding's)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attention = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / math.sqrt(32), dim=-1)
        x = x + self.o(attention @ self.v(h))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class Encoder(Net):
    """An embedding tied to the head, four layers, a norm; ``skipped`` says which layers a
    training forward leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Layer() for _ in range(4))
        del self.head

    def skipped(self, index: int) -> bool:
        return False

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch[:, :-1])
        for index, block in enumerate(self.blocks):
            if not (self.training and self.skipped(index)):
                x = block(x)
        return nn.functional.linear(self.norm(x), self.embed.weight)


class TwoForwards(Encoder):
    """A siamese pair: the model run on two batches, one loss, one backward."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) + self.loss(batch.flip(0))


class ConsistencyLoss(Encoder):
    """Two forwards compared with each other, as consistency regularisation does."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        first, second = self(batch), self(batch.flip(1))
        return self.loss(batch) + nn.functional.mse_loss(first.log_softmax(-1), second.flip(1).log_softmax(-1))


class LayerDrop(Encoder):
    """Each layer left out with probability 0.4, drawn from a generator of its own (seeded), so
    plain and tiered training leave out the same layers."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = torch.Generator().manual_seed(2)

    def skipped(self, index: int) -> bool:
        return bool(torch.rand((), generator=self.draws) < 0.4)


class SkippedOnAlternateSteps(Encoder):
    """The second layer left out on every other step (the first step, which the prefetch table
    is recorded in, runs it)."""

    def skipped(self, index: int) -> bool:
        return index == 1 and self.global_step % 2 == 1


class BartLayerDrop(L.LightningModule):
    """Hugging Face's LayerDrop: a BART whose six encoder layers are each left out with
    probability 0.3 at every training forward (``encoder_layerdrop``, drawn from torch's global
    generator, which plain and tiered training seed alike)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(
            vocab_size=256, d_model=32, encoder_layers=6, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, encoder_layerdrop=0.3, decoder_layerdrop=0.0,
        )
        self.model = BartForConditionalGeneration(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[:, :8].contiguous(), labels=batch[:, 8:].contiguous()).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _bart() -> L.LightningModule:
    pytest.importorskip("transformers")
    return BartLayerDrop()


MODELS: dict[str, Callable[[], L.LightningModule]] = {
    "two-forwards": TwoForwards, "consistency-loss": ConsistencyLoss, "layerdrop": LayerDrop,
    "skipped-on-alternate-steps": SkippedOnAlternateSteps, "hf-bart-encoder-layerdrop": _bart,
}


def _named_minimum(refusal: BaseException) -> int:
    found = re.search(r"at least ([\d.]+) (KiB|MiB)", str(refusal))
    assert found is not None, f"the refusal names no gpu_memory: {refusal}"
    number, unit = found.groups()
    return int(math.ceil(float(number) * {"KiB": 1024, "MiB": 1024**2}[unit]))


def train_at_the_named_minimum(tmp_path: Path, make: Callable[[], L.LightningModule], policy: Any) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Start from a GPU tier far too small and follow the strategy's refusals, each 5% above the
    minimum it names, until a run trains; every refusal comes before any update."""
    gpu_memory = 1024
    for attempt in range(4):
        strategy = TieredStrategy(gpu_memory=gpu_memory, host_memory="1GiB", **({"policy": policy} if policy else {}))
        steps = Losses()
        try:
            losses, weights, _ = fit(strategy, tmp_path / f"tiered{attempt}", make, steps=STEPS, callbacks=(steps,))
        except (PlacementError, ValueError) as refusal:
            assert steps.values == [], f"refused after {len(steps.values)} steps: {refusal}"
            named = int(_named_minimum(refusal) * 1.05)
            assert named > gpu_memory, f"the refusal names no more than it had: {refusal}"
            gpu_memory = named
            continue
        return losses, weights, gpu_memory
    raise AssertionError(f"still refused at gpu_memory={gpu_memory}")


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> PlainRuns:
    """Plain Lightning's run of each model, once for both policies."""
    return PlainRuns(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_trains_like_plain_at_the_minimum_the_strategy_names(tmp_path, plain_runs, model, policy):
    make = MODELS[model]
    plain_losses, plain_weights, _ = plain_runs(make, steps=STEPS)
    losses, weights, _ = train_at_the_named_minimum(tmp_path, make, POLICIES[policy])
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_the_prefetch_cursor_follows_a_step_that_skips_what_the_table_holds():
    """Units used past what the table expects next (a skipped layer's worth) move the cursor
    there, so the units after them are the ones prefetched; a unit the table holds nowhere ahead
    leaves it."""
    table = PrefetchTable()
    table.start_recording()
    layers = [list(range(start, start + RESYNC_WINDOW)) for start in range(0, 4 * RESYNC_WINDOW, RESYNC_WINDOW)]
    for unit in [u for layer in layers for u in layer]:
        table.record(unit)
    table.freeze()
    table.restart()
    for unit in layers[0]:
        assert table.record(unit)
    # the second layer skipped: the third's first unit lies a whole layer ahead
    assert not table.record(layers[2][0])
    assert list(table.upcoming(2)) == layers[2][1:3]
    assert table.record(layers[2][1])
    assert not table.record(1000)  # never recorded: the cursor stays
    assert list(table.upcoming(1)) == [layers[2][2]]
