import os
import textwrap
from pathlib import Path

import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.checkpoint.atomic import AtomicCheckpointIO
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
    from tests.test_offload import beside_kept, gpt2_4l, nvme_strategy, param_bytes

    total = param_bytes(gpt2_4l)
    sizes = {}
    for name, strategy in (
        ("plain", "auto"),
        ("host", TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.5, total), host_memory="1GiB")),  # half the parameters beside the kept layout
        ("nvme", nvme_strategy(total, tmp_path / "nvme")),
    ):
        train(strategy, tmp_path / name, epochs=1, make_model=gpt2_4l, save_every_epoch=True)
        sizes[name] = next((tmp_path / name / "ckpt").glob("*.ckpt")).stat().st_size
    # the same values: within a few per cent (one storage record per tensor instead of shared ones)
    assert sizes["host"] <= 1.06 * sizes["plain"] and sizes["nvme"] <= 1.06 * sizes["plain"], sizes


def _save_then_hang(directory: Path) -> str:
    """A child process that starts saving a checkpoint into ``directory`` and stops mid-write."""
    return textwrap.dedent(f"""
        import sys, time, torch
        from offload_strategy.checkpoint import atomic as checkpoint_io

        def slow_save(obj, handle):
            handle.write(b"x" * (1 << 20))
            handle.flush()
            print("writing", flush=True)
            time.sleep(600)

        checkpoint_io.torch.save = slow_save
        checkpoint_io.AtomicCheckpointIO().save_checkpoint({{"w": torch.ones(4)}}, {str(directory / "last.ckpt")!r})
    """)


def test_a_save_killed_midway_leaves_a_partial_file_the_next_save_removes(tmp_path):
    """SIGKILL skips every cleanup: the partial file stays, and the next save into that directory
    removes it (its writer's lock is free), while a save in progress elsewhere is left alone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def start() -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-c", _save_then_hang(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "writing"
        return child

    def age(paths: list[Path], seconds: float) -> None:
        for p in paths:
            os.utime(p, (time.time() - seconds,) * 2)

    killed = start()
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    abandoned = list(tmp_path.glob(".last.ckpt.*.partial"))
    assert len(abandoned) == 1 and abandoned[0].stat().st_size >= 1 << 20
    # fresh to the next writer's own sweep, however long it takes to start (more than the 10 s a
    # partial file counts as fresh when the machine is busy): the save below is the one to remove it
    age(abandoned, -3600)
    live = start()
    try:
        in_progress = [p for p in tmp_path.glob(".last.ckpt.*.partial") if p not in abandoned]
        age(abandoned + in_progress, 60)
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(4)}, tmp_path / "last.ckpt")
        assert not abandoned[0].exists(), "the killed save's partial file is still there"
        assert all(p.exists() for p in in_progress) and len(in_progress) == 1, "a save in progress lost its file"
        assert torch.equal(torch.load(tmp_path / "last.ckpt")["w"], torch.zeros(4))
    finally:
        live.kill()
        live.wait(timeout=60)
