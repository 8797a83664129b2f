"""Hugging Face's key/value caches given to a block that is recomputed in backward.

A model called with ``use_cache`` on (GPT-2's, Llama's configs default to it, in training too)
hands every block the same cache object, and each block appends its keys and values to its
layer of it. A block recomputed in backward would append them a second time: the recomputation
attends over twice the keys (eager attention then fails on its mask's shape; a prefix from PEFT's
prefix tuning would be followed by the keys twice) and the cache left to the user holds them
twice. :class:`CacheReplay` gives the recomputation each cache as the block's forward found it,
and afterwards puts back what the cache held before the recomputation, so that both see what
plain training's forward saw. (``runtime.activations.buffer_replay.BufferReplay`` does the same for the buffers of
the block's modules.)

What such a block appends to an empty layer (the cache ``use_cache`` makes for each forward) is
forgotten once its forward returns, as Hugging Face's own gradient checkpointing gives its layers
no cache: kept there, a checkpointed or swapped block's keys and values would stay in the GPU tier
for the whole step, outside the activations the plan measures (GPT-2 XL at batch 4 x 1024: 1.2
GiB). The loss and the gradients do not change; the cache the model returns lacks those layers.
A layer that held keys before the block (a prefix from prefix tuning) keeps what it is given.

Cache objects are told apart by the module that defines their class (``transformers.cache_utils``),
looked up among the modules already imported: a program that never imported it has no such cache.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

_CACHE_MODULE = "transformers.cache_utils"

State = list[tuple[object, dict[str, Any]]]


def caches_in(args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The key/value caches among a block's arguments (top level: that is how models pass them)."""
    module = sys.modules.get(_CACHE_MODULE)
    if module is None:
        return []
    return [v for v in (*args, *kwargs.values()) if isinstance(v, module.Cache)]


def _is_cache_part(value: Any) -> bool:
    return type(value).__module__ == _CACHE_MODULE


def _parts(caches: list[Any]) -> list[Any]:
    """Each cache and the cache objects it holds (its layers, an encoder-decoder cache's two)."""
    found: dict[int, Any] = {}
    pending = list(caches)
    while pending:
        item = pending.pop()
        if id(item) in found:
            continue
        if not hasattr(item, "__dict__"):
            continue  # a cache kept in slots: left as it is
        found[id(item)] = item
        for value in vars(item).values():
            members = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
            pending.extend(m for m in members if _is_cache_part(m))
    return list(found.values())


def _copied(attributes: dict[str, Any]) -> dict[str, Any]:
    """A cache object's attributes, its lists and dicts copied (their tensors shared)."""
    return {k: (type(v)(v) if isinstance(v, (list, dict)) else v) for k, v in attributes.items()}


def _state(objects: list[Any]) -> State:
    return [(o, _copied(vars(o))) for o in objects]


def _put_back(state: State) -> None:
    for item, attributes in state:
        vars(item).clear()
        vars(item).update(_copied(attributes))


def _holds_values(attributes: dict[str, Any]) -> bool:
    """A cache object's attributes hold a tensor with elements (keys or values already there)."""
    values = [v for x in attributes.values() for v in (x if isinstance(x, list) else x.values() if isinstance(x, dict) else [x])]
    return any(isinstance(v, torch.Tensor) and v.numel() > 0 for v in values)


def _differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return True
    for key, value in a.items():
        other = b[key]
        if isinstance(value, list) and isinstance(other, list):
            if len(value) != len(other) or any(x is not y for x, y in zip(value, other)):
                return True
        elif isinstance(value, dict) and isinstance(other, dict):  # a list become a dict (or back) differs below
            if len(value) != len(other) or any(value.get(k) is not other.get(k) for k in {*value, *other}):
                return True
        elif value is not other:
            return True
    return False


class CacheReplay:
    """The caches one checkpointed block's forward was given: :meth:`forward` around that forward,
    :meth:`recomputing` around each recomputation."""

    def __init__(self, caches: list[Any]) -> None:
        self._objects = _parts(caches)
        self._before: State = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        before = _state(self._objects)
        yield
        # what the block changed, as it was before: what its recomputation must start from
        self._before = [(o, attributes) for o, attributes in before if _differs(attributes, vars(o))]
        if not any(_holds_values(attributes) for _, attributes in self._before):
            _put_back(self._before)  # appended to empty layers: forgotten (the module docstring)

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        now = _state([o for o, _ in self._before])
        _put_back(self._before)
        try:
            yield
        finally:
            _put_back(now)
