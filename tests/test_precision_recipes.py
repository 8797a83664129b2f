"""16-bit recipes and what follows ``fit``, each beside plain Lightning.

Under ``*-true`` the reference is plain Lightning updating fp32 masters by hand
(``test_precision.FP32MasterLM``), what every tiered placement promises; the comparison is exact.
A module pickled after ``fit`` (or before, built under the strategy) holds plain parameters with
their true values, and loads in a process that never imported offload_strategy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import offload_strategy.checkpoint.states as checkpoint_states
from offload_strategy import TieredStrategy
from offload_strategy.construction.deferred import DeferredParameter
from offload_strategy.planning.placement import PlacementError
from tests.helpers import assert_same_weights, train
from tests.plain_modules import LayersInConfigureModel
from tests.test_offload import gpt2_4l
from tests.test_precision import FP32MasterLM, Homes, tiers
from tests.test_recipes import tiered

ROOT = Path(__file__).resolve().parents[1]
LOW = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


class EngineHomes(Homes):
    """``Homes``, and nothing where no engine runs (plain training: its masters are the parameters)."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.strategy.engine is None:
            self.homes.add("no engine")
            return
        super().on_train_batch_end(trainer, pl_module, *args)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_policy_none_keeps_fp32_masters_as_every_other_placement(tmp_path, precision):
    """Under policy 'none' no engine ran, so plain Lightning's HalfPrecision stepped the 16-bit
    parameters themselves: in fp16 AdamW's epsilon rounds to 0 and a parameter whose gradient is
    zero (an unused embedding row) became 0/0, NaN from the second step, where every other
    placement updates fp32 masters and stays finite. 'none' now does what they do, every unit
    in the GPU tier."""
    reference_losses, reference_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=FP32MasterLM, precision=precision)
    homes = EngineHomes()
    strategy = TieredStrategy(policy="none", host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "none", epochs=1, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,))
    assert losses == reference_losses
    assert_same_weights(reference_weights, weights)
    assert all(torch.isfinite(w).all() and w.dtype == LOW[precision] for w in weights.values())
    assert homes.homes == {"gpu"} and homes.master_dtypes == {torch.float32}


def test_policy_none_with_fp32_masters_refuses_a_gpu_tier_that_cannot_hold_them(tmp_path):
    """'none' keeps every unit in the GPU tier: with masters that do not fit, it says how much
    the model needs there instead of offloading."""
    strategy = TieredStrategy(policy="none", gpu_memory=100_000, host_memory="1GiB")
    with pytest.raises(PlacementError, match=r"the model needs .* in the GPU tier .* but gpu_memory grants 97.66 KiB; raise gpu_memory"):
        train(strategy, tmp_path / "none", epochs=1, make_model=gpt2_4l, precision="bf16-true")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("placement", ["tiers", "resident"])
def test_clipping_by_value_under_true_precisions_matches_plain(tmp_path, precision, placement):
    """Lightning's clipping by value: the engine clips each unit's fp32 gradients as they
    complete; Lightning's default hook, called after it as plain training calls it, was given an
    optimizer whose parameters held no gradient (all of them at the engine under ``*-true``), and
    torch's clip_grad_value_ failed on the empty list in the first step."""
    clipping = dict(gradient_clip_val=0.002, gradient_clip_algorithm="value")
    reference_losses, reference_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=FP32MasterLM, precision=precision, **clipping)
    # resident: placement fill, whose profiled steps keep every unit in the GPU tier (the search's stream them)
    resident = TieredStrategy(gpu_memory="1GiB", host_memory="1GiB", policy={"name": "auto", "placement": "fill"})
    strategy = tiers(tmp_path / "nvme", precision) if placement == "tiers" else resident
    homes = Homes()
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, precision=precision, extra_callbacks=(homes,), **clipping)
    assert homes.homes == ({"gpu", "host", "nvme"} if placement == "tiers" else {"gpu"})
    assert losses == reference_losses
    assert_same_weights(reference_weights, weights)
    if placement == "resident" and precision == "bf16-true":  # the threshold clips: unclipped training ends elsewhere
        _, unclipped, _ = train("auto", tmp_path / "unclipped", epochs=1, make_model=FP32MasterLM, precision=precision)
        assert any(not torch.equal(unclipped[k], weights[k]) for k in weights)


# -- pickles of the module and the trainer --------------------------------------------------------


def fit_layers(strategy, root: Path, callbacks: tuple = ()) -> tuple[LayersInConfigureModel, L.Trainer]:
    L.seed_everything(7, verbose=False)
    model = LayersInConfigureModel()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=root, callbacks=list(callbacks))
    trainer.fit(model)
    return model, trainer


def load_elsewhere(pickled: Path, expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """``torch.load`` of the pickled module in a fresh process that never imports offload_strategy:
    its parameters are plain and equal ``expected``."""
    torch.save(expected, tmp_path / "expected.pt")
    code = (
        "import sys, torch\n"
        f"module = torch.load({str(pickled)!r}, weights_only=False)\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "imported = [m for m in sys.modules if m == 'offload_strategy' or m.startswith('offload_strategy.')]\n"
        "assert not imported, imported\n"
        "assert {type(p) for p in module.parameters()} == {torch.nn.Parameter}, {type(p) for p in module.parameters()}\n"
        "state = module.state_dict()\n"
        "assert state.keys() == expected.keys(), (state.keys(), expected.keys())\n"
        "differ = [k for k in state if not torch.equal(state[k], expected[k])]\n"
        "assert not differ, differ\n"
        "print('loaded', len(state))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"loaded {len(expected)}"


def test_lightnings_torch_save_of_the_model_and_the_trainer_after_fit(tmp_path):
    """Lightning's own test_model_torch_save under ``tiered``: the trainer held the strategy's
    record of deferred parameters, whose parameter class is made per strategy and cannot be
    pickled by name ("it's not the same object")."""
    strategy = tiered("host", tmp_path)
    model, trainer = fit_layers(strategy, tmp_path)
    path = tmp_path / "temp.pt"
    torch.save(trainer.model, path)
    torch.save(trainer, path)
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded.strategy, TieredStrategy) and loaded.strategy.policy == strategy.policy
    assert_same_weights(model.state_dict(), loaded.lightning_module.state_dict())


def test_a_module_left_on_nvme_after_fit_pickles_its_values_and_stays_there(tmp_path, monkeypatch):
    """Units too large to bring back stay on NVMe after ``fit``, as deferred parameters reading
    their files. Pickling the module read each into memory for good (the class's pickling went
    through ``.data``); it now reads each value for the pickle alone, and the pickle holds plain
    parameters with the trained values, those of plain training."""

    class HostFills(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            monkeypatch.setattr(checkpoint_states, "host_available", lambda: 2**10)

    plain, _ = fit_layers("auto", tmp_path / "plain")
    model, _ = fit_layers(tiered("nvme", tmp_path), tmp_path / "tiered", callbacks=(HostFills(),))
    assert {type(p).__name__ for p in model.parameters()} == {"DeferredParameter"}
    torch.save(model, tmp_path / "module.pt")
    assert all(isinstance(p, DeferredParameter) for p in model.parameters())  # still on NVMe
    load_elsewhere(tmp_path / "module.pt", plain.state_dict(), tmp_path)


def test_a_module_built_under_the_strategy_pickles_before_it_is_placed(tmp_path):
    """``trainer.init_module()`` under ``tiered`` records each parameter's value instead of
    making it: the pickle holds the values plain construction gives, and the module stays
    unbuilt."""
    L.seed_everything(3, verbose=False)
    plain = LayersInConfigureModel()
    plain.configure_model()
    trainer = L.Trainer(strategy=tiered("host", tmp_path), accelerator="cpu", devices=1, logger=False)
    L.seed_everything(3, verbose=False)
    with trainer.init_module():
        model = LayersInConfigureModel()
        model.configure_model()
    assert all(isinstance(p, DeferredParameter) for p in model.parameters())
    torch.save(model, tmp_path / "module.pt")
    assert all(isinstance(p, DeferredParameter) for p in model.parameters())
    load_elsewhere(tmp_path / "module.pt", plain.state_dict(), tmp_path)
