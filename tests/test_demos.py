"""offload_strategy.demos: the model the tests, the tools and the Hydra job train."""

from __future__ import annotations

import pytest
import torch

from offload_strategy.demos import CausalLM, gpt2_config


def test_model_flops_per_token_by_hand():
    """PaLM's count, which tools/compare_peers.py reports as model TFLOP/s: 6 x parameters, plus
    12 x layers x width x sequence for the attention scores."""
    model = CausalLM(family="gpt2", config=gpt2_config(layers=2, width=64))
    with torch.device("meta"):
        model.configure_model()
    parameters = sum(p.numel() for p in model.parameters())
    assert model.flops_per_token(16) == 6 * parameters + 12 * 2 * 64 * 16
    assert model.flops_per_token(16, backward=False) == 2 * parameters + 4 * 2 * 64 * 16


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match="model family 'gpt5' is not known; choose one of gpt2, opt, llama"):
        CausalLM(family="gpt5", config={})
