"""The models the command line prices, built without memory for their weights: a Hugging Face
``config.json`` on disk (a causal language model with random weights, built on the meta device:
nothing is fetched), or, in a checkout of the repository with the ``experiments`` extra installed, a
job of its Hydra configs (``conf/``) named by overrides such as ``model=llama_7b hardware=rtx4090``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

# the repository's Hydra configs, beside the package in a checkout (not in the wheel)
CONF = Path(__file__).resolve().parents[2] / "conf"
NO_HYDRA = ("give a Hugging Face config.json instead (a path to the file or its directory), or install the experiments extra "
            "(pip install -e '.[experiments]') in a checkout of the repository, whose conf/ names the models")


@dataclass(frozen=True)
class ModelSource:
    """What the command line was given: a ``config.json`` (``path``), or Hydra overrides of the
    repository's job (a bare name ``llama_7b`` stands for ``model=llama_7b``)."""

    path: Optional[Path]
    overrides: tuple[str, ...] = ()

    @property
    def hydra(self) -> bool:
        return self.path is None


def model_source(items: Sequence[str]) -> ModelSource:
    """The source the positional arguments name: a ``config.json`` or its directory, or Hydra overrides."""
    files = [item for item in items if "=" not in item and (item.endswith(".json") or Path(item).is_dir())]
    if not files:
        return ModelSource(None, tuple(item if "=" in item else f"model={item}" for item in items))
    if len(items) > 1:
        raise SystemExit(f"{' '.join(items)}: give either one config.json or Hydra overrides (model=..., data.batch_size=...), not both.")
    path = Path(files[0])
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; give a Hugging Face config.json, or a model config name of {CONF / 'model'}.")
    return ModelSource(path)


def compose(overrides: Sequence[str], hydra_config: bool = False) -> Any:
    """The repository's Hydra job with ``overrides`` (its logger off); a clear refusal where Hydra
    or the configs are not at hand."""
    try:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
    except ImportError:
        raise SystemExit(f"Hydra overrides ({' '.join(overrides) or 'the default job'}) need Hydra, which is not installed: {NO_HYDRA}.") from None
    if not (CONF / "config.yaml").is_file():
        raise SystemExit(f"Hydra overrides ({' '.join(overrides) or 'the default job'}) need the repository's configs, not found at {CONF}: {NO_HYDRA}.")
    _check_model(overrides)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hydra_compose(config_name="config", overrides=[*overrides, "logger=none"], return_hydra_config=hydra_config)


def _check_model(overrides: Sequence[str]) -> None:
    known = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    for item in overrides:
        name = item.removeprefix("model=")
        if item.startswith("model=") and name not in known:
            raise SystemExit(f"{name!r} is neither a config.json nor a model config of {CONF / 'model'} ({', '.join(known) or 'none found'}).")


def instantiate(node: Any, **kwargs: Any) -> Any:
    """Hydra's ``instantiate`` of a composed job's node (``compose`` has checked Hydra is there)."""
    from hydra.utils import instantiate as hydra_instantiate

    return hydra_instantiate(node, **kwargs)


class CausalLM(nn.Module):
    """A causal language model whose forward on token ids gives its loss."""

    def __init__(self, model: nn.Module, name: str = "") -> None:
        super().__init__()
        self.model = model
        self.name = name or type(model).__name__

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
        return loss


def causal_lm(path: Path, device: str = "meta") -> CausalLM:
    """The causal language model ``path`` (a Hugging Face ``config.json``) describes, with random
    weights on ``device`` (the meta device: nothing allocated)."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"{path}: building a model from a Hugging Face config needs transformers (pip install transformers).") from None
    fields = json.loads(path.read_text())
    kind = fields.pop("model_type", None)
    if kind is None:
        raise SystemExit(f"{path} names no model_type: give a Hugging Face model's config.json.")
    config = transformers.AutoConfig.for_model(kind, **fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return CausalLM(model, name=f"{kind} ({path.parent.name or path.stem})")
