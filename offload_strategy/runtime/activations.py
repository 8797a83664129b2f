"""Per-block activation policies: keep a block's activations, or recompute them in backward.

The blocks are the repeated layers of a model: the longest ``ModuleList`` / ``Sequential`` whose
children are all of one class (a transformer's layers), or the modules of a class the user names.
A checkpointed block runs under non-reentrant ``torch.utils.checkpoint``: it saves its inputs only
and recomputes the rest in backward, with the RNG state of the first run (dropout matches). The
engine keeps a recomputed block's parameter units resident until their gradients are in.

A swap block (``swap_host``, ``swap_nvme``) runs its forward under the saved-tensor hooks of an
:class:`~offload_strategy.runtime.activation_swap.ActivationSwap`, which the strategy attaches once
it knows the device and the NVMe store; the interleaved layout of ProTrain §3.1.2 (swap blocks
first, checkpointed ones next, kept ones last) comes from ``planning/activations.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .activation_swap import SWAP_HOST, SWAP_NVME, ActivationSwap

KEEP, CHECKPOINT = "keep", "checkpoint"
POLICIES = (KEEP, CHECKPOINT, SWAP_HOST, SWAP_NVME)


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
        self.swap: Optional[ActivationSwap] = None  # attached by the strategy when some block swaps
        self._wrapped: list[nn.Module] = []
        for index, (block, choice) in enumerate(zip(self.blocks, self.policies)):
            if choice == CHECKPOINT:
                block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
                self._wrapped.append(block)
            elif choice in (SWAP_HOST, SWAP_NVME):
                block.forward = functools.partial(self._swapped, index, choice, block.forward)  # type: ignore[method-assign]
                self._wrapped.append(block)

    @property
    def swaps(self) -> set[str]:
        return {p for p in self.policies if p in (SWAP_HOST, SWAP_NVME)}

    def _swapped(self, index: int, destination: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self.swap is None:
            return forward(*args, **kwargs)
        with self.swap.hooks(index, destination):
            return forward(*args, **kwargs)

    def remove(self) -> None:
        for block in self._wrapped:
            block.__dict__.pop("forward", None)  # back to the class's forward
        self._wrapped = []


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # evaluation: nothing to save or recompute
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
