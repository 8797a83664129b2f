"""Models held out from the estimate's design, to check it against: a tiny Llama and a GPT-2 built
with ``transformers`` from config with random weights, and a small CNN (no repeated blocks); one
batch of each (``tests/test_estimate.py``, ``tools/estimate_check.py``)."""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch
from torch import nn


class HuggingFaceLM(L.LightningModule):
    """A causal language model of transformers, built from its config with random weights."""

    def __init__(self, kind: str = "llama") -> None:
        super().__init__()
        import transformers

        config: Any
        if kind == "llama":
            config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            self.model: Any = transformers.LlamaForCausalLM(config)
        else:
            config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
            self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SmallCNN(L.LightningModule):
    """A small convolutional classifier (no repeated blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.cross_entropy(self.net(inputs), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


HELD_OUT: dict[str, Callable[[], L.LightningModule]] = {"llama": lambda: HuggingFaceLM("llama"), "gpt2": lambda: HuggingFaceLM("gpt2"),
                                                        "cnn": SmallCNN}


def example_batch(name: str, seed: int = 0) -> Any:
    """One batch of the held-out model ``name``."""
    generator = torch.Generator().manual_seed(seed)
    if name == "cnn":
        return torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    return torch.randint(0, 512, (4, 32), generator=generator)
