"""Block discovery finds the layers that train: the outermost list of layers (a decoder layer's
per-head norms are inside it), the student's over a frozen teacher's, one layer applied several
times (ALBERT), and a list of layers of several classes (Jamba). Each trains as plain Lightning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy.runtime.activations.policies import ActivationPolicies, find_blocks
from tests.helpers import assert_same_weights
from tests.test_recipes import fit, tiered

transformers = pytest.importorskip("transformers")


class HuggingFace(L.LightningModule):
    """A Hugging Face model with random tiny weights, trained on its own loss of the tokens."""

    def __init__(self, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = make()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        ids = batch[:, :-1].contiguous()
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def stablelm() -> HuggingFace:
    config = transformers.StableLmConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, qk_layernorm=True, max_position_embeddings=64)
    return HuggingFace(lambda: transformers.StableLmForCausalLM(config))


def albert() -> HuggingFace:
    # dropout on: each call's recomputation must replay that call's random numbers
    config = transformers.AlbertConfig(vocab_size=256, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1)
    return HuggingFace(lambda: transformers.AlbertForMaskedLM(config))


def jamba() -> HuggingFace:
    config = transformers.JambaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, max_position_embeddings=64,
    )
    return HuggingFace(lambda: transformers.JambaForCausalLM(config))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Distillation(L.LightningModule):
    """A frozen teacher of six layers, a student of three learning its outputs and the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.teacher = nn.ModuleList(Layer() for _ in range(6))
        self.student = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(32, 256)
        self.embed.requires_grad_(False)
        self.teacher.requires_grad_(False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch[:, :-1])
        target, y = x, x
        for layer in self.teacher:
            target = layer(target)
        for layer in self.student:
            y = layer(y)
        logits = self.head(y)
        tokens = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        return tokens + nn.functional.mse_loss(y, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class Seen(L.Callback):
    """What the strategy's activation control holds at the last step."""

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        control = trainer.strategy.tiered.activations
        self.blocks, self.calls = list(control.blocks), list(control.policies_in_use.calls)
        self.costs, self.plan = list(control.costs), control.plan
        self.per_call = control.policies_in_use.per_call_input_bytes(self.costs)
        self.metrics = trainer.strategy.metrics()


def assert_trains_like_plain(tmp_path: Path, make: Callable[[], L.LightningModule], activations: str) -> Seen:
    """Losses and weights bit-identical to plain Lightning with every unit in host memory."""
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", make, steps=4)
    policy = {"activations": activations} if activations != "default" else {"activations": "auto"}
    seen = Seen()
    losses, weights, _ = fit(tiered("host", tmp_path, **policy), tmp_path / "tiered", make, steps=4, callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    return seen


def test_the_decoder_layers_over_their_per_head_norms():
    model = stablelm()
    layers = model.model.model.layers
    norms = layers[0].self_attn.q_layernorm.norms
    assert len(norms) > len(layers)  # the per-head norms are the longer list
    assert find_blocks(model) == list(layers)
    assert ActivationPolicies(model, "checkpoint").description == "model.model.layers (2 × StableLmDecoderLayer)"


@pytest.mark.parametrize("activations", ["checkpoint", "default"])
def test_stablelm_with_per_head_norms_trains_like_plain(tmp_path, activations, caplog):
    with caplog.at_level(logging.INFO):
        seen = assert_trains_like_plain(tmp_path, stablelm, activations)
    assert "blocks: model.model.layers (2 × StableLmDecoderLayer)" in caplog.text
    assert [type(b).__name__ for b in seen.blocks] == ["StableLmDecoderLayer"] * 2


def test_the_student_over_a_deeper_frozen_teacher():
    model = Distillation()
    assert find_blocks(model) == list(model.student)


@pytest.mark.parametrize("activations", ["checkpoint", "default"])
def test_distillation_trains_like_plain(tmp_path, activations):
    seen = assert_trains_like_plain(tmp_path, Distillation, activations)
    assert len(seen.blocks) == 3 and all(p.requires_grad for b in seen.blocks for p in b.parameters())


def test_one_layer_applied_several_times_is_the_block():
    model = albert()
    groups = model.model.albert.encoder.albert_layer_groups
    assert find_blocks(model) == [groups[0]]
    policies = ActivationPolicies(model, "checkpoint")
    ids = torch.randint(0, 256, (2, 8))
    policies.begin_forward()
    model.model(input_ids=ids, labels=ids).loss.backward()
    assert policies.calls == [3]  # one block, called once per hidden layer
    assert policies.description == "model.albert.encoder.albert_layer_groups (1 × AlbertLayerGroup), called 3 times per forward (each call under its block's policy)"
    assert policies.recomputed_flops == 3 * policies.block_flops


@pytest.mark.parametrize("activations", ["checkpoint", "default"])
def test_albert_trains_like_plain(tmp_path, activations):
    seen = assert_trains_like_plain(tmp_path, albert, activations)
    assert [type(b).__name__ for b in seen.blocks] == ["AlbertLayerGroup"] and seen.calls == [3]
    if activations == "checkpoint":
        assert seen.metrics["activations/recomputed_flops"] > 0
    else:  # the planner priced the block as the runtime runs it: all three calls
        assert seen.plan is not None and len(seen.costs) == 1
        assert seen.costs[0].input_bytes == 3 * seen.per_call[0] > 0


def test_a_list_of_layers_of_several_classes():
    model = jamba()
    layers = model.model.model.layers
    assert len({type(layer) for layer in layers}) == 2
    assert find_blocks(model) == list(layers)
    assert find_blocks(model, "JambaMambaDecoderLayer") == [layer for layer in layers if type(layer).__name__ == "JambaMambaDecoderLayer"]


def test_jamba_trains_like_plain_with_its_layers_checkpointed(tmp_path):
    seen = assert_trains_like_plain(tmp_path, jamba, "checkpoint")
    assert len(seen.blocks) == 4 and len({type(b) for b in seen.blocks}) == 2


def test_a_sequential_of_weight_normed_layers():
    # each parametrized module gets a class of its own: the layers are still of one class
    layers = nn.Sequential(*(torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)) for _ in range(3)))
    assert len({type(layer) for layer in layers}) == 3
    assert find_blocks(nn.ModuleDict({"layers": layers})) == list(layers)
