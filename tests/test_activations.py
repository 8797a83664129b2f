"""Per-block activation policies: checkpointed blocks recompute in backward and train exactly like
plain training (dropout included), alone and with offloaded parameters, and keep fewer bytes."""

from __future__ import annotations

import lightning as L
import pytest
from torch import nn

from experiments.models import CausalLM
from offload_strategy import TieredStrategy
from offload_strategy.runtime.activations import ActivationPolicies, find_blocks
from tests.helpers import assert_same_weights, train
from tests.test_offload import GPT2_4L, param_bytes

WITH_DROPOUT = {**GPT2_4L, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


def gpt2() -> CausalLM:
    return CausalLM(family="gpt2", config=WITH_DROPOUT, lr=1e-2, warmup_steps=2)


class Saved(L.Callback):
    def __init__(self) -> None:
        self.bytes = []

    def on_train_batch_end(self, trainer, *args):
        self.bytes.append(trainer.strategy.metrics()["activations/saved_bytes"])


def test_blocks_are_found():
    model = gpt2()
    model.configure_model()
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["GPT2Block"] * 4
    assert find_blocks(model, "GPT2MLP") == [b.mlp for b in blocks]
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert find_blocks(flat) == []
    with pytest.raises(ValueError, match="needs repeated blocks, but the model has none"):
        ActivationPolicies(flat, "checkpoint")
    with pytest.raises(ValueError, match="lists 3 block policies but the model has 4 blocks"):
        ActivationPolicies(model, ["keep", "checkpoint", "keep"])
    with pytest.raises(ValueError, match=r"\['swap_sideways'\] is not a block policy"):
        ActivationPolicies(model, "swap_sideways")


@pytest.mark.parametrize("activations", ["checkpoint", ("checkpoint", "keep", "checkpoint", "keep")], ids=["all", "mixed"])
@pytest.mark.parametrize("offload", [False, True], ids=["in-gpu-tier", "offloaded"])
def test_checkpointed_blocks_match_plain_training(tmp_path, activations, offload):
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    budget = dict(gpu_memory=int(0.5 * total), host_memory="1GiB") if offload else {}
    strategy = TieredStrategy(policy={"name": "auto", "activations": activations}, **budget)
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert not any("forward" in vars(b) for b in find_blocks(trainer.lightning_module)), "the policies were not taken off"


def test_checkpointing_keeps_fewer_activation_bytes(tmp_path):
    total = param_bytes(gpt2)
    saved = {}
    for activations in ("keep", "checkpoint"):
        seen = Saved()
        strategy = TieredStrategy(gpu_memory=int(0.5 * total), host_memory="1GiB", policy={"name": "auto", "activations": activations})
        train(strategy, tmp_path / activations, epochs=1, make_model=gpt2, extra_callbacks=(seen,))
        saved[activations] = seen.bytes[-1]
    assert 0 < saved["checkpoint"] < saved["keep"] / 3, saved
