"""Pretrained weights from local files, read one tensor at a time.

``load_weights(module, path)`` fills a module's parameters and buffers from a Hugging Face model
directory (``model.safetensors``, or shards with ``model.safetensors.index.json``; the
``pytorch_model.bin`` forms too) or a single ``.safetensors`` / torch file. Names are matched with
``module.state_dict()``'s, strictly by default, as ``load_state_dict`` does; every name and shape
is checked before anything is written.

Under ``tiered``, call it where the model is built (``configure_model``): parameters built without
memory (``construction/deferred.py``) are then not computed at all but read from the file straight into their
homes when placed, so loading takes one tensor of host memory at a time, not the model. Anywhere
else (plain Lightning, a model built outside the strategy) each tensor is copied into its
parameter now, so the same line works with any strategy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch import nn

from .deferred import DeferredParameter
from ..runtime.params.offloaded import OffloadedParameter

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")
_SHOWN = 8  # names listed in an error before "and N more"


class WeightsMismatchError(ValueError):
    """The files and the module disagree on names or shapes."""


@dataclass(frozen=True)
class _Stored:
    """One tensor in a file: its shape, and how to read it."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


def load_weights(module: nn.Module, path: Union[str, Path], *, strict: bool = True) -> dict[str, list[str]]:
    """Fill ``module``'s parameters and buffers from the weights at ``path`` (see the module
    docstring). Returns the names left as they were (``missing``) and the file's names the module
    does not have (``unexpected``); with ``strict`` (the default) either is an error."""
    stored = _index(Path(path).expanduser())
    targets = _targets(module)
    names = _match(module, stored, targets)
    missing = [n for n, (_, aliases) in targets.items() if not any(a in names for a in aliases)]
    unexpected = sorted(set(stored) - set(names.values()))
    if strict and (missing or unexpected):
        raise WeightsMismatchError(
            f"the weights at {str(path)!r} do not match {type(module).__name__}: {_listed('missing', missing)}"
            f"{'; ' if missing and unexpected else ''}{_listed('unexpected', unexpected)}. Pass the module whose state_dict() "
            f"names the files use (the Hugging Face model, not the LightningModule holding it), or strict=False to load what matches."
        )
    wrong = [
        f"{own}: {tuple(stored[key].shape)} in the file, {tuple(targets[own][0].shape)} in the module"
        for own, key in names.items() if tuple(stored[key].shape) != tuple(targets[own][0].shape)
    ]
    if wrong:
        raise WeightsMismatchError(f"{len(wrong)} tensors have other shapes in {str(path)!r} than in the module: {'; '.join(wrong[:_SHOWN])}")
    for own, key in names.items():
        _fill(targets[own][0], stored[key].read, own)
    return {"missing": missing, "unexpected": unexpected}


def _targets(module: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[str, ...]]]:
    """Each tensor of the state dict once, under its first name, with every name it has (tied
    parameters are loaded from whichever name the file holds)."""
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers(remove_duplicate=False):
        if name in persistent:
            aliases.setdefault(id(b), []).append(name)
            tensors[id(b)] = b
    return {names[0]: (tensors[key], tuple(names)) for key, names in aliases.items()}


def _match(module: nn.Module, stored: dict[str, _Stored], targets: dict[str, tuple[torch.Tensor, tuple[str, ...]]]) -> dict[str, str]:
    """Own name -> the file's name, trying each alias, and a Hugging Face base-model prefix
    (``transformer.``) added or removed, as ``from_pretrained`` does."""
    prefix = getattr(module, "base_model_prefix", "")
    names: dict[str, str] = {}
    for own, (_, aliases) in targets.items():
        for alias in aliases:
            candidates = [alias]
            if prefix:
                candidates += [f"{prefix}.{alias}", alias[len(prefix) + 1:] if alias.startswith(prefix + ".") else alias]
            key = next((c for c in candidates if c in stored), None)
            if key is not None:
                names[own] = key
                break
    return names


@torch.no_grad()
def _fill(target: torch.Tensor, read: Callable[[], torch.Tensor], name: str) -> None:
    if isinstance(target, DeferredParameter) and target in type(target).registry:
        type(target).registry.set_source(target, read)  # read into its home when placed
    elif isinstance(target, OffloadedParameter):
        raise RuntimeError(
            f"load_weights: parameter {name!r} is already placed by the strategy (at home on NVMe). Load weights where the "
            f"model is built (configure_model), or inside `with trainer.strategy.gathered_parameters(writeback=True):`."
        )
    else:
        target.copy_(read())


def _index(path: Path) -> dict[str, _Stored]:
    """Every tensor name in the files at ``path``, read lazily."""
    if path.is_dir():
        for name in _INDEXES:
            if (path / name).is_file():
                weight_map = json.loads((path / name).read_text())["weight_map"]
                out: dict[str, _Stored] = {}
                for shard in sorted(set(weight_map.values())):
                    out.update(_file(path / shard))
                return out
        for name in _SINGLE:
            if (path / name).is_file():
                return _file(path / name)
        raise FileNotFoundError(
            f"{str(path)!r} holds no weights: expected one of {', '.join(_INDEXES + _SINGLE)} (a Hugging Face model directory)."
        )
    if not path.is_file():
        raise FileNotFoundError(f"no weights at {str(path)!r}: give a .safetensors or torch file, or a Hugging Face model directory.")
    return _file(path)


def _file(path: Path) -> dict[str, _Stored]:
    if path.suffix == ".safetensors":
        return dict(_safetensors(path))
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # pages read only when used
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning checkpoint
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} holds a {type(state).__name__}, not a state dict of tensors.")
    return {k: _Stored(tuple(v.shape), _holding(v)) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _holding(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A reader of a tensor at hand (one ``torch.load`` mapped)."""
    return lambda: t


def _safetensors(path: Path) -> Iterator[tuple[str, _Stored]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            shape = tuple(f.get_slice(key).get_shape())
            yield key, _Stored(shape, _reader(path, key))


def _reader(path: Path, key: str) -> Callable[[], torch.Tensor]:
    def read() -> Any:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)

    return read


def _listed(what: str, names: list[str]) -> str:
    if not names:
        return ""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{len(names)} {what} ({', '.join(names[:_SHOWN])}{more})"
