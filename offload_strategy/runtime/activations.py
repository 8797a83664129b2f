"""Per-block activation policies: keep a block's activations, or recompute them in backward.

The blocks are the repeated layers of a model: the longest ``ModuleList`` / ``Sequential`` whose
children are all of one class (a transformer's layers), or the modules of a class the user names.
A checkpointed block runs under non-reentrant ``torch.utils.checkpoint``: it saves its inputs only
and recomputes the rest in backward, with the RNG state of the first run (dropout matches). The
engine keeps a recomputed block's parameter units resident until their gradients are in.

Swapping activations to host memory or NVMe, and choosing the policy per block from the cost model
(ProTrain §3.1.2's interleaving, LoHan Alg. 1), build on this.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

KEEP, CHECKPOINT = "keep", "checkpoint"
POLICIES = (KEEP, CHECKPOINT)


def find_blocks(model: nn.Module, block_class: Optional[str] = None) -> list[nn.Module]:
    """The model's repeated blocks, in order; [] when it has none."""
    if block_class is not None:
        return [m for m in model.modules() if type(m).__name__ == block_class]
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters()):
                if len(children) > len(best):
                    best = children
    return best


def resolve_policies(blocks: Sequence[nn.Module], policy: Union[str, Sequence[str]]) -> list[str]:
    """One policy per block, from one name for all or a list with one per block."""
    per_block = [policy] * len(blocks) if isinstance(policy, str) else list(policy)
    if len(per_block) != len(blocks):
        raise ValueError(f"policy.activations lists {len(per_block)} block policies but the model has {len(blocks)} blocks; give one per block or one name for all.")
    unknown = sorted({p for p in per_block if p not in POLICIES})
    if unknown:
        raise ValueError(f"policy.activations={unknown} is not a block policy; choose from {', '.join(POLICIES)}.")
    return per_block


class ActivationPolicies:
    """Applies block policies to a model and takes them off again."""

    def __init__(self, model: nn.Module, policy: Union[str, Sequence[str]], block_class: Optional[str] = None) -> None:
        self.blocks = find_blocks(model, block_class)
        if not self.blocks and (not isinstance(policy, str) or policy != KEEP):
            where = f"of class {block_class!r}" if block_class else "(no ModuleList or Sequential of modules of one class)"
            raise ValueError(f"policy.activations={policy!r} needs repeated blocks, but the model has none {where}; name them with policy.block_class.")
        self.policies = resolve_policies(self.blocks, policy)
        self._wrapped: list[nn.Module] = []
        for block, choice in zip(self.blocks, self.policies):
            if choice == CHECKPOINT:
                block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
                self._wrapped.append(block)

    def remove(self) -> None:
        for block in self._wrapped:
            block.__dict__.pop("forward", None)  # back to the class's forward
        self._wrapped = []


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # evaluation: nothing to save or recompute
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
