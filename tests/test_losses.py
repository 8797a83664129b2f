"""The causal LM loss computed a chunk of tokens at a time (``offload_strategy.losses``): by hand,
against Hugging Face's own loss, and trained under ``tiered`` beside plain Lightning."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from offload_strategy.demos import CausalLM
from offload_strategy import TieredStrategy
from offload_strategy.losses import chunked_causal_lm_loss, default_chunk_tokens
from tests.helpers import TINY_GPT2, assert_same_weights, train


def _hand_case() -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    # Hidden states (1, 0) and (0, 1) (the last position predicts nothing); a head of three
    # tokens whose logits are (0, 0, 0) for the first and (ln 2, 0, 0) for the second.
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    head = nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0, math.log(2)], [0.0, 0.0], [0.0, 0.0]]))
    return hidden, head, torch.tensor([[1, 0, 2]])


@pytest.mark.parametrize("chunk", [1, 2, None])
def test_the_loss_by_hand(chunk):
    # Token 0 from (0, 0, 0): -ln(1/3) = ln 3; token 2 from (ln 2, 0, 0), softmax (1/2, 1/4, 1/4):
    # -ln(1/4) = ln 4. The mean: ln 12 / 2. With token 2 left out (-100): ln 3.
    hidden, head, labels = _hand_case()
    assert chunked_causal_lm_loss(hidden, head, labels, chunk).item() == pytest.approx(math.log(12) / 2, rel=1e-6)
    assert chunked_causal_lm_loss(hidden, head, torch.tensor([[1, 0, -100]]), chunk).item() == pytest.approx(math.log(3), rel=1e-6)


def test_chunks_are_sized_so_their_logits_are_no_larger_than_the_hidden_states():
    # 1,000 tokens of 64 wide over 256 tokens of vocabulary: 250 tokens' logits (250 x 256) are the
    # 1,000 x 64 hidden states' size; never more tokens than there are; never fewer than 128 (a
    # width of 256 over GPT-2's 50,257 would give 5 of 1,020), unless there are fewer
    assert default_chunk_tokens(1000, 64, 256) == 250
    assert default_chunk_tokens(10, 4096, 256) == 10
    assert default_chunk_tokens(1020, 256, 50257) == 128 and default_chunk_tokens(3, 1, 50257) == 3


def test_bad_input_says_what_to_give():
    hidden, head, labels = _hand_case()
    with pytest.raises(ValueError, match=r"hidden_states \(1, 3, 2\) and labels \(1, 2\) do not match"):
        chunked_causal_lm_loss(hidden, head, labels[:, :2])
    with pytest.raises(ValueError, match="chunk_tokens=0: give at least one token"):
        chunked_causal_lm_loss(hidden, head, labels, 0)
    with pytest.raises(ValueError, match="does not say its vocabulary size"):
        chunked_causal_lm_loss(hidden, nn.Sequential(head), labels)
    with pytest.raises(ValueError, match="loss_chunk_tokens=0: give a positive number"):
        CausalLM(family="gpt2", config=TINY_GPT2, loss_chunk_tokens=0)
    with pytest.raises(ValueError, match="would leave out the router's auxiliary loss"):
        CausalLM(family="mixtral", config={"output_router_logits": True}, loss_chunk_tokens="auto")


TINY_LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("family, chunk", [("gpt2", 7), ("gpt2", "auto"), ("llama", 5)])
def test_it_is_hugging_faces_loss_to_rounding(family, chunk):
    """GPT-2 (its head tied to the embedding) and Llama (an untied head after an RMSNorm) on 4 x
    16 tokens: the loss and every gradient as the model's own loss gives them, to float rounding
    (the sums run chunk by chunk)."""
    torch.manual_seed(0)
    config = TINY_GPT2 if family == "gpt2" else TINY_LLAMA
    own, chunked = (CausalLM(family=family, config=config, loss_chunk_tokens=c) for c in (None, chunk))
    own.configure_model()
    chunked.configure_model()
    chunked.model.load_state_dict(own.model.state_dict())
    batch = torch.randint(0, 256, (4, 16))
    losses = []
    for module in (own, chunked):
        loss = module._loss(batch)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(own.model.named_parameters(), chunked.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_trains_under_tiered_as_under_plain_lightning(tmp_path):
    """The chunked loss calls the tied head once per chunk in forward and again in backward: with
    every unit streamed through a 1 MiB GPU tier from host memory or NVMe, and under the default
    policy (whose profiled steps measure what the forward keeps), training is bit-identical to
    plain Lightning's, and the plan holds less beside the blocks than with the model's own loss."""

    def model(chunk):
        return lambda: CausalLM(family="gpt2", config=TINY_GPT2, lr=1e-2, warmup_steps=2, loss_chunk_tokens=chunk)

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", make_model=model(7))
    for placement in ("host", "nvme"):
        nvme = {"nvme_path": str(tmp_path / "nvme"), "nvme_memory": "1GiB"} if placement == "nvme" else {}
        streamed = TieredStrategy(policy={"placement": placement, "activations": "keep"}, gpu_memory="1MiB", host_memory="1GiB", **nvme)
        losses, weights, _ = train(streamed, tmp_path / placement, make_model=model(7))
        assert losses == plain_losses, placement
        assert_same_weights(plain_weights, weights)
    peaks = {}
    for chunk in (7, None):
        losses, weights, trainer = train(TieredStrategy(gpu_memory="4MiB", host_memory="1GiB"), tmp_path / f"default{chunk}", make_model=model(chunk))
        peaks[chunk] = trainer.strategy.metrics()["activations/predicted_peak_bytes"]
        if chunk == 7:
            assert losses == plain_losses
            assert_same_weights(plain_weights, weights)
    # the model's own loss keeps the fp32 log-softmax of its 64 tokens' logits (64 x 256 x 4 bytes:
    # 64 KiB) for backward, and the plan leaves room for two tensors of that size for the backward,
    # where with chunks the largest saved tensor is a block's (64 x 128 x 4: 32 KiB): 128 KiB more
    assert peaks[None] - peaks[7] >= 64 * 1024 + 2 * (64 - 32) * 1024, peaks
