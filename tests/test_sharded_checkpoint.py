"""Sharded checkpoints: a directory written tensor by tensor from every tier, loaded into homes,
swapped in atomically, convertible to the single file plain Lightning reads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import offload_strategy.checkpoint.states as states_module
from offload_strategy import TieredStrategy
from offload_strategy.runtime.params.lending import Lending
from offload_strategy.runtime.updates.nvme_states import NvmeOptimizerStates
from offload_strategy.checkpoint.sharded import ShardedCheckpoint, consolidate, is_sharded_checkpoint, write_sharded
from tests.helpers import assert_same_weights, train

ROOT = Path(__file__).resolve().parents[1]


def sharded(root: Path, placement: str = "nvme", state_dict_type: str = "sharded") -> TieredStrategy:
    """Every unit streamed through a 1 MiB GPU tier from host memory or NVMe; sharded checkpoints."""
    return TieredStrategy(
        policy={"placement": placement, "activations": "keep"}, gpu_memory="1MiB", host_memory="1GiB",
        nvme_path=str(root / "nvme"), nvme_memory="1GiB", state_dict_type=state_dict_type,
    )


@pytest.fixture
def never_gathered(monkeypatch):
    """Fails a checkpoint save that brings NVMe units or their optimizer states into memory other
    than one at a time as they are written."""
    saving: list[bool] = []
    save = L.Trainer.save_checkpoint

    def tracked_save(self, *args, **kwargs):
        saving.append(True)
        try:
            return save(self, *args, **kwargs)
        finally:
            saving.pop()

    def refuse(original):
        def materialized(self, *args, **kwargs):
            assert not saving, "a sharded checkpoint gathered the model"
            return original(self, *args, **kwargs)
        return materialized

    monkeypatch.setattr(L.Trainer, "save_checkpoint", tracked_save)
    monkeypatch.setattr(Lending, "materialized", refuse(Lending.materialized))
    monkeypatch.setattr(Lending, "lend", refuse(Lending.lend))  # a unit read for a detach or a state
    monkeypatch.setattr(Lending, "lend_states", refuse(Lending.lend_states))
    monkeypatch.setattr(NvmeOptimizerStates, "materialized", refuse(NvmeOptimizerStates.materialized))


@pytest.mark.parametrize("placement", ["nvme", "host"])
def test_a_sharded_checkpoint_resumes_bit_identically(tmp_path, placement, never_gathered):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain")
    train(sharded(tmp_path / "a", placement), tmp_path / "part", stop_after_epochs=1, save_every_epoch=True)
    checkpoint = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    assert is_sharded_checkpoint(checkpoint)
    assert not [p for p in checkpoint.parent.iterdir() if p.name.startswith(".")]  # no partial left
    # each value once, as Lightning's keys name them: parameters, AdamW's states, loops, callbacks
    source = ShardedCheckpoint(checkpoint)
    assert set(source.model_state()) == set(plain_weights)
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(source.optimizer_state(0)["state"][0])
    assert source.meta()["epoch"] == 0 and "loops" in source.meta()

    resumed, weights, _ = train(sharded(tmp_path / "b", placement), tmp_path / "resumed", resume=checkpoint)
    assert resumed == plain_losses[len(plain_losses) - len(resumed) :]
    assert_same_weights(plain_weights, weights)


def test_consolidated_checkpoints_move_to_plain_lightning_and_back(tmp_path):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain")
    train(sharded(tmp_path / "a"), tmp_path / "part", stop_after_epochs=1, save_every_epoch=True)
    directory = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    single = tmp_path / "single.ckpt"
    run = subprocess.run([sys.executable, "-m", "offload_strategy", "consolidate", str(directory), str(single)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert single.is_file()
    resumed, weights, _ = train("auto", tmp_path / "plain-resumed", resume=single)  # plain Lightning reads it
    assert resumed == plain_losses[len(plain_losses) - len(resumed) :]
    assert_same_weights(plain_weights, weights)

    back = tmp_path / "back.ckpt"
    run = subprocess.run([sys.executable, "-m", "offload_strategy", "consolidate", str(single), str(back), "--sharded"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    resumed, weights, _ = train(sharded(tmp_path / "b"), tmp_path / "tiered-resumed", resume=back)
    assert resumed == plain_losses[len(plain_losses) - len(resumed) :]
    assert_same_weights(plain_weights, weights)


def test_write_and_read_back_a_hand_made_checkpoint(tmp_path):
    state = {
        "epoch": 3, "global_step": 40, "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 3}}}},
        "state_dict": {"a.weight": torch.arange(6.0).view(2, 3), "0.bias": torch.ones(2, dtype=torch.bfloat16)},
        "optimizer_states": [{
            "state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.full((2, 3), 0.5)}, 1: {"momentum_buffer": torch.zeros(2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}, {"lr": 0.2, "betas": (0.8, 0.9), "params": [1]}],
        }],
        "lr_schedulers": [],
    }
    write_sharded(state, tmp_path / "c.ckpt")
    back = consolidate(tmp_path / "c.ckpt")
    assert back.keys() == state.keys()
    assert back["loops"] == state["loops"] and back["lr_schedulers"] == []
    for name, value in state["state_dict"].items():
        assert torch.equal(back["state_dict"][name], value) and back["state_dict"][name].dtype == value.dtype
    optimizer = back["optimizer_states"][0]
    assert optimizer["param_groups"] == state["optimizer_states"][0]["param_groups"]
    assert sorted(optimizer["state"]) == [0, 1]  # keyed by parameter index again, as torch loads them
    assert torch.equal(optimizer["state"][0]["exp_avg"], torch.full((2, 3), 0.5))


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    write_sharded({"state_dict": {"w": torch.ones(4)}, "epoch": 0}, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    stand_in = torch.zeros(1).expand(4)

    def broken() -> torch.Tensor:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_sharded({"state_dict": {"w": stand_in}, "epoch": 1}, target, {stand_in.untyped_storage().data_ptr(): broken})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]

    # a writer killed mid-save leaves its partial directory: the next save removes it
    abandoned = tmp_path / ".last.ckpt.abcd1234.partial"
    abandoned.mkdir()
    (abandoned / "__0_0.distcp").write_bytes(b"half")
    old = time.time() - 60
    os.utime(abandoned, (old, old))
    write_sharded({"state_dict": {"w": torch.full((4,), 2.0)}, "epoch": 2}, target)
    assert not abandoned.exists()
    assert consolidate(target)["epoch"] == 2

    # a file and a directory replace each other whole
    from offload_strategy.checkpoint.atomic import AtomicCheckpointIO

    AtomicCheckpointIO().save_checkpoint({"epoch": 3}, target)
    assert target.is_file()
    write_sharded({"state_dict": {"w": torch.ones(4)}, "epoch": 4}, target)
    assert is_sharded_checkpoint(target)


def test_auto_shards_only_what_would_not_fit_in_host_memory(tmp_path, monkeypatch):
    train(sharded(tmp_path / "a", state_dict_type="auto"), tmp_path / "fits", epochs=1, save_every_epoch=True)
    assert (tmp_path / "fits" / "ckpt" / "epoch=0.ckpt").is_file()

    class HostFills(L.Callback):
        """Once placed, what is on NVMe would no longer fit in half the host memory."""

        def on_train_start(self, trainer, pl_module) -> None:
            monkeypatch.setattr(states_module, "host_available", lambda: 2**10)

    train(sharded(tmp_path / "b", state_dict_type="auto"), tmp_path / "large", epochs=1, save_every_epoch=True, extra_callbacks=(HostFills(),))
    assert is_sharded_checkpoint(tmp_path / "large" / "ckpt" / "epoch=0.ckpt")


def test_bad_state_dict_types_and_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"state_dict_type='shards': choose one of 'full', 'sharded', 'auto'"):
        TieredStrategy(state_dict_type="shards")
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint directory"):
        ShardedCheckpoint(tmp_path)
    from offload_strategy.checkpoint.atomic import AtomicCheckpointIO

    write_sharded({"state_dict": {"w": torch.ones(1)}}, tmp_path / "d.ckpt")
    with pytest.raises(IsADirectoryError, match="offload-strategy consolidate"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "d.ckpt")


def test_bf16_true_masters_on_nvme_resume_exactly_from_a_sharded_checkpoint(tmp_path, never_gathered):
    """fp32 masters of NVMe units live with their states between updates: written from there."""
    full_losses, full_weights, _ = train(sharded(tmp_path / "full"), tmp_path / "full", precision="bf16-true")
    train(sharded(tmp_path / "a"), tmp_path / "a", stop_after_epochs=1, save_every_epoch=True, precision="bf16-true")
    checkpoint = tmp_path / "a" / "ckpt" / "epoch=0.ckpt"
    masters = [state["master"] for state in consolidate(checkpoint)["optimizer_states"][0]["state"].values()]
    assert masters and all(m.dtype == torch.float32 and torch.isfinite(m).all() for m in masters)
    losses, weights, _ = train(sharded(tmp_path / "b"), tmp_path / "b", resume=checkpoint, precision="bf16-true")
    assert losses == full_losses[len(full_losses) - len(losses) :]
    assert_same_weights(full_weights, weights)


def test_two_optimizers_resume_exactly_from_a_sharded_checkpoint(tmp_path, never_gathered):
    from tests.test_recipes import TwoOptimizers as Manual

    class TwoOptimizers(Manual):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return {"loss": self.last_loss.detach()}  # for the helper's loss recorder

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", make_model=TwoOptimizers)
    train(sharded(tmp_path / "a"), tmp_path / "a", stop_after_epochs=1, save_every_epoch=True, make_model=TwoOptimizers)
    checkpoint = tmp_path / "a" / "ckpt" / "epoch=0.ckpt"
    assert ShardedCheckpoint(checkpoint).optimizer_count() == 2
    losses, weights, _ = train(sharded(tmp_path / "b"), tmp_path / "b", resume=checkpoint, make_model=TwoOptimizers)
    assert losses == plain_losses[len(plain_losses) - len(losses) :]
    assert_same_weights(plain_weights, weights)
