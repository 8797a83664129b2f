import os

import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.checkpoint_io import AtomicCheckpointIO
from tests.helpers import PARAMETERS_ONLY, train


def test_save_replaces_whole_files_and_keeps_default_permissions(tmp_path):
    io = AtomicCheckpointIO()
    target = tmp_path / "deep" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.arange(4.0)}, target)
    io.save_checkpoint({"step": 2, "w": torch.arange(8.0)}, target)
    loaded = torch.load(target, weights_only=True)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.arange(8.0))
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)
    before = target.read_bytes()

    def broken_save(obj, handle, *args, **kwargs):
        handle.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a partial file was left behind"


def test_the_strategy_writes_checkpoints_atomically(tmp_path):
    _, _, trainer = train(TieredStrategy(), tmp_path, epochs=1, save_every_epoch=True)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    saved = list((tmp_path / "ckpt").iterdir())
    assert [p.name for p in saved] == ["epoch=0.ckpt"] and torch.load(saved[0], weights_only=True)["global_step"] > 0


def test_checkpoints_hold_each_value_once_not_the_slabs_it_lives_in(tmp_path):
    """Parameters and states view shared slabs (homes, masters, NVMe buffers); torch.save writes
    whole storages, so the strategy hands it views over exactly their own bytes."""
    from tests.test_offload import gpt2_4l, nvme_strategy, param_bytes

    total = param_bytes(gpt2_4l)
    sizes = {}
    for name, strategy in (
        ("plain", "auto"),
        ("host", TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.5 * total), host_memory="1GiB")),
        ("nvme", nvme_strategy(total, tmp_path / "nvme")),
    ):
        train(strategy, tmp_path / name, epochs=1, make_model=gpt2_4l, save_every_epoch=True)
        sizes[name] = next((tmp_path / name / "ckpt").glob("*.ckpt")).stat().st_size
    # the same values: within a few per cent (one storage record per tensor instead of shared ones)
    assert sizes["host"] <= 1.06 * sizes["plain"] and sizes["nvme"] <= 1.06 * sizes["plain"], sizes
