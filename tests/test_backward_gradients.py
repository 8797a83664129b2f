"""The backward's working memory: what it holds beyond what the forward saved.

An operation's backward holds the gradient of its output and makes the gradient of its input,
each as large as what it saved, while the saved tensors are still held. The runtime and the step
model plan twice the largest tensor the forward saved beside every activation layout
(``BesideBlocks.gradients``); ``estimate/live_bytes.py`` measures what a real step holds on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from offload_strategy.demos import build_causal_lm
from offload_strategy.hardware import known_hardware
from offload_strategy.estimate.analytic import analytic_compute
from offload_strategy.runtime.activations.policies import find_blocks
from offload_strategy.estimate.live_bytes import LiveBytes
from offload_strategy.estimate.live_bytes import backward_beyond_forward as measure

ROOT = Path(__file__).resolve().parent.parent


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


def tables(stdout: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """tools/validate_activations.py's two tables, each row's cells by family."""
    first, second = stdout.split("the backward beyond what the forward left")
    return tuple({row[0]: row for row in (line.strip("| ").split(" | ") for line in part.splitlines() if line.startswith("| "))
                  if row[0] not in ("family", "---|---")} for part in (first, second))  # type: ignore[return-value]


def test_the_validation_tool_finds_the_activation_estimate_close_and_each_family_s_backward_as_planned():
    """tools/validate_activations.py as a user runs it, batch 2 x 128 tokens, a 1,024-token vocabulary.
    What the meta-device estimate says a block saves is within 10% of a real forward on the CPU, each
    storage counted once both ways (before: Llama +30%, OPT +50%, shared storages counted again), for
    causal LMs, BERT's masked LM and T5's encoder. One training step of a decoder, a masked LM and an
    encoder-decoder: the loss's backward is the largest, twice the log-softmax (1 MiB), and the
    estimate from shapes plans the same."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tools/validate_activations.py"), "--families", "gpt2", "llama", "opt", "bert", "t5",
                           "--batch", "2", "--seq", "128"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved, backward = tables(done.stdout)
    assert set(saved) == set(backward) == {"gpt2", "llama", "opt", "bert", "t5"}, done.stdout
    errors = {family: float(row[-1].rstrip("%")) / 100 for family, row in saved.items()}
    assert all(abs(error) < 0.10 for error in errors.values()), errors
    planned = 2 * 2 * 128 * 1024 * 4
    for family in ("gpt2", "bert", "t5"):
        _, largest, measured, plan, _, estimated = (int(cell.replace(",", "")) if "," in cell else cell for cell in backward[family])
        assert plan == estimated == planned == 2 * largest, backward[family]
        assert 0.99 * plan <= measured <= plan, backward[family]


def test_the_estimate_from_shapes_frees_the_loss_s_bytes_before_the_blocks_backward():
    """Llama at 2 x 128 tokens, 1,024-token vocabulary: the log-softmax (1 MiB) is saved after the
    last block, and its two gradients are the backward's largest; a block's own largest saved
    tensor is smaller (its MLP's 688-wide hidden state, 688 KiB: gradients of 1,376 KiB). The plan
    holds the loss's bytes at the head's backward alone."""
    config = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=1024)
    with torch.device("meta"):
        model = build_causal_lm("llama", config)
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    beside = analytic_compute(model, find_blocks(model), lambda: model(input_ids=ids, labels=ids).loss, known_hardware("rtx4090")).beside
    assert beside.gradients == 2 * 2 * 128 * 1024 * 4
    assert beside.block_gradients == 2 * 2 * 128 * 688 * 4
    assert beside.after >= 2 * 128 * 1024 * 4
    assert beside.head == beside.after + beside.gradients - beside.block_gradients
    assert beside.in_blocks == beside.outside - beside.after + beside.block_gradients
