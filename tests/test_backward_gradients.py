"""The backward's working memory: what it holds beyond what the forward saved.

An operation's backward holds the gradient of its output and makes the gradient of its input,
each as large as what it saved, while the saved tensors are still held. The runtime and the step
model plan twice the largest tensor the forward saved beside every activation layout
(``BesideBlocks.gradients``); ``runtime/live_bytes.py`` measures what a real step holds on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_strategy.runtime.live_bytes import LiveBytes


def test_live_bytes_counts_what_operations_make_until_it_is_freed():
    """By hand: 256 floats made (1 KiB), doubled into another 1 KiB, the first freed; a view and an
    in-place write make nothing; a tensor made before is not the computation's."""
    before = torch.ones(1024)
    with LiveBytes() as live:
        a = torch.ones(256)
        assert live.bytes == 1024
        b = a * 2
        assert live.bytes == 2048
        del a
        assert (live.bytes, live.peak) == (1024, 2048)
        b[:10].add_(1)
        before.mul_(2)
        view = before[:512]
        assert live.bytes == 1024
        live.reset()
        assert live.peak == 1024
        del b
        assert live.bytes == 0
    assert view.numel() == 512


def backward_beyond_forward(model: nn.Module, forward) -> tuple[int, int]:
    """(what the backward held beyond what the forward left, twice the largest tensor the forward saved)."""
    from tools.validate_activations import backward_beyond_forward as measure

    measured, largest = measure(model, forward)
    return measured, 2 * largest


def test_cross_entropy_s_backward_makes_two_gradients_of_its_log_softmax_s_size():
    """Logits of 64 x 1,024 floats (256 KiB) from a linear head: nll_loss's backward makes the
    gradient of the log-softmax, log_softmax's the logits': 512 KiB beyond the forward, twice the
    largest tensor saved (the log-softmax), to within the 4-byte loss gradient."""
    torch.manual_seed(0)
    head = nn.Linear(64, 1024)
    x, y = torch.randn(64, 64), torch.randint(0, 1024, (64,))
    measured, planned = backward_beyond_forward(head, lambda: nn.functional.cross_entropy(head(x), y))
    assert planned == 2 * 64 * 1024 * 4
    assert planned - 16 <= measured <= planned


def test_a_convolution_s_backward_stays_within_twice_its_largest_saved_tensor():
    """A small CNN: its largest saved tensors are the convolutions' 16 x 32 x 32 x 32 outputs
    (2 MiB); the backward holds up to about two of them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    measured, planned = backward_beyond_forward(net, lambda: nn.functional.cross_entropy(net(x), y))
    assert planned == 2 * 16 * 32 * 32 * 32 * 4
    assert 0.75 * planned <= measured <= planned


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5"])
def test_each_family_s_step_needs_what_is_planned_for_its_backward(family):
    """One training step of a decoder, a masked LM and an encoder-decoder (batch 2 x 128 tokens,
    a 1,024-token vocabulary): the loss's backward is the largest, twice the log-softmax (1 MiB),
    and the estimate from shapes plans the same."""
    from tools.validate_activations import backward_gradients

    g = backward_gradients(family, batch=2, seq=128)
    assert g["planned"] == g["estimated"] == 2 * 2 * 128 * 1024 * 4
    assert 0.99 * g["planned"] <= g["measured"] <= g["planned"]


def test_the_estimate_from_shapes_frees_the_loss_s_bytes_before_the_blocks_backward():
    """Llama at 2 x 128 tokens, 1,024-token vocabulary: the log-softmax (1 MiB) is saved after the
    last block, and its two gradients are the backward's largest; a block's own largest saved
    tensor is smaller (its MLP's 688-wide hidden state, 688 KiB: gradients of 1,376 KiB). The plan
    holds the loss's bytes at the head's backward alone."""
    from tools.validate_activations import estimate

    beside = estimate("llama", 2, 128, False).beside
    assert beside.gradients == 2 * 2 * 128 * 1024 * 4
    assert beside.block_gradients == 2 * 2 * 128 * 688 * 4
    assert beside.after >= 2 * 128 * 1024 * 4
    assert beside.head == beside.after + beside.gradients - beside.block_gradients
    assert beside.in_blocks == beside.outside - beside.after + beside.block_gradients
