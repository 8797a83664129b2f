"""Pretrained weights read from local files into their homes, one tensor at a time: the same
values as ``from_pretrained``, the same training as plain Lightning."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from offload_strategy.demos import CausalLM
from offload_strategy import WeightsMismatchError, load_weights
from offload_strategy.construction.deferred import DeferredParameters
from tests.helpers import TINY_GPT2
from tests.test_recipes import assert_like_plain


def pretrained(directory: Path, seed: int = 3, shard: str = "40KB") -> Path:
    """A Hugging Face directory of sharded safetensors, written here (no hub)."""
    torch.manual_seed(seed)
    GPT2LMHeadModel(GPT2Config(**TINY_GPT2)).save_pretrained(directory, max_shard_size=shard)
    return directory


def test_a_sharded_directory_loads_the_same_values_as_from_pretrained(tmp_path):
    path = pretrained(tmp_path / "hf")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    reference = GPT2LMHeadModel.from_pretrained(path)
    registry = DeferredParameters()
    with registry.recording():
        torch.manual_seed(0)  # other values than the files'
        model = GPT2LMHeadModel(GPT2Config(**TINY_GPT2))
    registry.adopt(model)
    load_weights(model, path)
    assert len(registry) == len(list(model.parameters()))  # still deferred: read when placed
    registry.materialize_all()
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, loaded from the one name the files hold


def test_a_plain_model_is_filled_now(tmp_path):
    path = pretrained(tmp_path / "hf", shard="10MB")
    model = GPT2LMHeadModel(GPT2Config(**TINY_GPT2))
    load_weights(model, path / "model.safetensors")
    reference = GPT2LMHeadModel.from_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_torch_files_and_lightning_checkpoints_load(tmp_path):
    source = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    torch.save(source.state_dict(), tmp_path / "w.pt")
    torch.save({"state_dict": source.state_dict(), "epoch": 1}, tmp_path / "l.ckpt")
    for name in ("w.pt", "l.ckpt"):
        target = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
        load_weights(target, tmp_path / name)
        assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_names_and_shapes_that_disagree_are_refused_before_anything_is_written(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    save_file({"0.weight": torch.ones(3, 4), "0.bias": torch.ones(3), "extra": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(WeightsMismatchError, match=r"2 missing \(1.weight, 1.bias\); 1 unexpected \(extra\)"):
        load_weights(model, tmp_path / "a.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    report = load_weights(model, tmp_path / "a.safetensors", strict=False)
    assert report == {"missing": ["1.weight", "1.bias"], "unexpected": ["extra"]}
    assert torch.equal(model[0].weight, torch.ones(3, 4))
    save_file({"0.weight": torch.ones(4, 4), "0.bias": torch.ones(3)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(WeightsMismatchError, match=r"0.weight: \(4, 4\) in the file, \(3, 4\) in the module"):
        load_weights(model, tmp_path / "b.safetensors", strict=False)
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        load_weights(model, tmp_path)


class FineTune(CausalLM):
    """A GPT-2 fine-tuned from a local directory, loaded where it is built."""

    weights: Path

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            load_weights(self.model, self.weights)


class FirstWeights(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_fine_tuning_from_a_directory_trains_like_plain_lightning(tmp_path, placement):
    FineTune.weights = pretrained(tmp_path / "hf")
    start = FirstWeights()

    def make() -> L.LightningModule:
        return FineTune(family="gpt2", config=TINY_GPT2, lr=1e-2)

    assert_like_plain(tmp_path, placement, make, callbacks=lambda: (start,))
    reference = GPT2LMHeadModel.from_pretrained(FineTune.weights).state_dict()
    # the tiered run (the callback's last) started from the files' values
    assert start.weights.keys() == reference.keys()
    assert all(torch.equal(start.weights[k], reference[k]) for k in reference)
