"""A causal language model's loss computed a chunk of tokens at a time, so that the logits over
the whole vocabulary never exist at once.

A Hugging Face causal LM widens its logits to fp32 for the loss, over every token of the batch:
with GPT's 50,257-token vocabulary, a 13B model at batch 32 x 1024 keeps 6.1 GiB of fp32 logits
(beside 3.1 GiB in 16 bits) for backward, and the loss's backward makes two more of that size.
On a 24 GB card that leaves no room for the blocks. Here each chunk of tokens goes through the
output head and the cross-entropy under activation checkpointing: forward keeps only the hidden
states, and backward recomputes one chunk's logits at a time (as torchtune's chunked
cross-entropy and Liger-Kernel's fused linear cross-entropy avoid the whole logits). The price
is one more pass of the head's product, 2 x tokens x hidden x vocabulary FLOPs.

The loss is Hugging Face's (labels shifted by one, ``ignore_index`` left out, the mean over the
tokens counted) to rounding: the sum runs chunk by chunk, so the last bits can differ.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # Hugging Face's label for tokens the loss leaves out
# fewer tokens a chunk make the head's products too small to run well: a GPT-2 of width 256 ran its
# step 7-9x slower on the CPU at 5 tokens a chunk than with its own loss, 1.1-1.2x at 128 (tools/bench_loss.py)
MIN_CHUNK_TOKENS = 128


def default_chunk_tokens(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk such that a chunk's fp32 logits are no larger than the fp32 hidden states
    of all ``tokens`` (then the chunk's backward, its logits and their gradient, stays within what
    any plan already holds for a backward: twice the largest tensor the forward saves), but at
    least ``MIN_CHUNK_TOKENS`` (narrow models, whose logits are small anyway) and at most all."""
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, tokens * hidden_size // max(1, vocab_size))))


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk_tokens: Optional[int] = None, ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The mean next-token cross-entropy of ``head(hidden_states)`` against ``labels``, a chunk
    of ``chunk_tokens`` tokens at a time (default :func:`default_chunk_tokens`).

    Args:
        hidden_states: ``[batch, seq, hidden]``, the model's last hidden states (before the head).
        head: the output head (``model.get_output_embeddings()``), called once per chunk in
            forward and again in backward.
        labels: ``[batch, seq]`` token ids; position t is predicted from position t - 1, and
            ``ignore_index`` marks tokens left out.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[:2] != labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and labels {tuple(labels.shape)} do not match: give the last hidden "
            f"states as [batch, seq, hidden] and the labels as [batch, seq]."
        )
    hidden = hidden_states[:, :-1].reshape(-1, hidden_states.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    if chunk_tokens is None:
        vocab = getattr(head, "out_features", None)
        if vocab is None:
            raise ValueError(f"the head {type(head).__name__} does not say its vocabulary size (out_features); give chunk_tokens.")
        chunk_tokens = default_chunk_tokens(targets.numel(), hidden.shape[-1], vocab)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: give at least one token per chunk.")
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss, head, hidden[piece], targets[piece], ignore_index, use_reentrant=False)
    return total / (targets != ignore_index).sum()
