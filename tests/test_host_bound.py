"""``host_memory`` bounds the process from construction to after teardown: after ``fit``, units at
home on NVMe come back into host memory only as far as the budget leaves room; the others, their
optimizer states too, stay on NVMe and are read when used, with the values plain training has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy import RUNTIME_HOST_ALLOWANCE, TieredStrategy
from offload_strategy.runtime.updates.optimizers import StatesReadOnUse
from tests.ddp_launch import assert_same_optimizer_states
from tests.helpers import assert_same_weights, tiny_data
from tests.test_recipes import Losses, Net, fit

ROOT = Path(__file__).resolve().parents[1]


class Deep(Net):
    """Net with 48 narrow blocks: many small units, so that host_memory's minimum (the buffers of
    the largest unit) holds only some of them after training."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(48))


def budgeted(root: Path) -> TieredStrategy:
    return TieredStrategy(
        policy={"placement": "nvme", "activations": "swap_nvme"}, gpu_memory="320KiB", host_memory="448KiB",
        nvme_path=str(root / "nvme"), nvme_memory="64MiB",
    )


def fit_leaving_weights(strategy: TieredStrategy, root: Path) -> tuple[list[float], Deep]:
    """``fit`` without reading the weights after it (which would bring every unit back)."""
    L.seed_everything(7, verbose=False)
    model, losses = Deep(), Losses()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, callbacks=[losses],
    )
    trainer.fit(model, datamodule=tiny_data())
    return losses.values, model


def test_after_fit_what_host_memory_cannot_hold_stays_on_nvme_and_reads_back_as_plain_training_left_it(tmp_path, caplog):
    plain_losses, plain_weights, plain = fit("auto", tmp_path / "plain", Deep)
    plain.trainer.save_checkpoint(tmp_path / "plain.ckpt")
    strategy = budgeted(tmp_path)
    with caplog.at_level("INFO"):
        losses, model = fit_leaving_weights(strategy, tmp_path / "tiered")
    assert losses == plain_losses
    said = [r.getMessage() for r in caplog.records if "after training" in r.getMessage()]
    assert len(said) == 1 and "units at home on NVMe stay there" in said[0], said
    state = model.trainer.optimizers[0].state
    assert isinstance(state, StatesReadOnUse)
    stayed = len(strategy.deferred)
    assert 0 < stayed < len(list(model.parameters()))  # some came back, the rest stayed
    assert 0 < len(state.pending) and len(state) == len(plain.trainer.optimizers[0].state)

    # a checkpoint after fit reads every parameter and state from its file: plain training's values
    model.trainer.save_checkpoint(tmp_path / "tiered.ckpt")
    mine, theirs = (torch.load(tmp_path / f"{name}.ckpt", weights_only=True) for name in ("tiered", "plain"))
    assert_same_weights(theirs["state_dict"], mine["state_dict"])
    assert_same_optimizer_states(theirs["optimizer_states"][0], mine["optimizer_states"][0])
    assert len(strategy.deferred) == 0 and len(state.pending) == 0
    assert_same_weights(plain_weights, {k: v.detach() for k, v in model.state_dict().items()})


def test_training_on_after_fit_reads_the_states_left_on_nvme(tmp_path):
    """The user's optimizer steps on after fit, in plain PyTorch: the states it reads are the
    file's, and what it writes stays, as with the states of plain training."""
    _, _, plain = fit("auto", tmp_path / "plain", Deep)
    strategy = budgeted(tmp_path)
    _, model = fit_leaving_weights(strategy, tmp_path / "tiered")
    assert len(model.trainer.optimizers[0].state.pending) > 0
    batch = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    for net in (plain, model):
        optimizer = net.trainer.optimizers[0]
        for _ in range(2):
            optimizer.zero_grad()
            net.loss(batch).backward()
            optimizer.step()
    assert_same_weights(dict(plain.named_parameters()), dict(model.named_parameters()))
    assert_same_optimizer_states(plain.trainer.optimizers[0].state_dict(), model.trainer.optimizers[0].state_dict())


@pytest.mark.slow
@pytest.mark.nvme
@pytest.mark.no_race_check  # measures the resident set
def test_the_resident_set_grows_by_at_most_the_budgets_from_construction_to_after_fit(tmp_path):
    """A 19M-parameter GPT-2 (training state 290 MiB) built in configure_model with 64 MiB of host
    memory and a 16 MiB emulated GPU tier: before, teardown read every parameter and optimizer
    state back (522 MiB of growth where 272 MiB are allowed) because they took less than half of
    the machine's memory. (24 MiB now: its recomputed blocks, whose units a recomputation holds
    together, and their activations are counted in the tier.)"""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests/host_bound_job.py"), str(tmp_path), "--host-memory", "64MiB", "--gpu-memory", "24MiB"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    bound = report["host"] + report["gpu"] + RUNTIME_HOST_ALLOWANCE
    assert 16 * report["parameters"] > bound  # the training state is beyond what may stay in memory
    growth = {phase: peak - report["before"] for phase, peak in report["peaks"].items()}
    assert set(growth) == {"construction", "setup", "steps", "teardown", "after fit"}
    assert all(g <= bound for g in growth.values()), {k: f"{v / 2**20:.0f} MiB" for k, v in growth.items()}
    assert report["deferred"] > 0 and report["states_on_nvme"] > 0


@pytest.mark.parametrize("way", ["through memory", "from the old files"])
def test_placing_again_between_steps_moves_units_on_nvme_exactly(tmp_path, monkeypatch, way):
    """The default policy places the units again after its profiled steps: the NVMe units move
    through host memory where the disk has no room for a second copy of their files, else they
    are read from the old files into their new homes (which are closed after); training and what
    fit leaves are plain training's."""
    import offload_strategy.lightning.core as strategy_module

    class DiskFills(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if way == "through memory":
                monkeypatch.setattr(strategy_module, "disk_free", lambda path: 0)

    plain_losses, plain_weights, plain = fit("auto", tmp_path / "plain", Deep)
    strategy = TieredStrategy(gpu_memory="640KiB", host_memory="448KiB", nvme_path=str(tmp_path / "nvme"), nvme_memory="64MiB")
    left: list[bool] = []
    original = strategy_module.TieredCore._left_while_placing_again
    monkeypatch.setattr(strategy_module.TieredCore, "_left_while_placing_again", lambda core, engine: left.append(original(core, engine)) or left[-1])
    losses, weights, model = fit(strategy, tmp_path / "tiered", Deep, callbacks=(DiskFills(),))
    assert left == [way == "from the old files"]  # placed again once, the way asked
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert_same_optimizer_states(plain.trainer.optimizers[0].state_dict(), model.trainer.optimizers[0].state_dict())


def test_fitting_again_after_fit_takes_the_states_left_on_nvme(tmp_path):
    """A second ``fit`` of the same trainer places the model again: the parameters and optimizer
    states left on NVMe by the first are read into the new homes, and training goes on as plain
    training does."""

    def run(strategy: Any, root: Path) -> tuple[list[float], dict[str, torch.Tensor], Any]:
        L.seed_everything(7, verbose=False)
        model, losses = Deep(), Losses()
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, callbacks=[losses],
        )
        trainer.fit(model, datamodule=tiny_data())
        left = len(getattr(trainer.optimizers[0].state, "pending", ()))
        trainer.fit_loop.epoch_loop.max_steps = 6
        trainer.fit(model, datamodule=tiny_data())
        return losses.values, {k: v.detach().clone() for k, v in model.state_dict().items()}, left

    plain_losses, plain_weights, _ = run("auto", tmp_path / "plain")
    losses, weights, left = run(budgeted(tmp_path), tmp_path / "tiered")
    assert left > 0  # the first fit left states on NVMe
    assert len(losses) == 6 and losses == plain_losses
    assert_same_weights(plain_weights, weights)
