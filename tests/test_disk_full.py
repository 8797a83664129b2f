"""A disk that fills up mid-run: a clear error, nothing left behind, the last checkpoint intact.

Where this process may mount file systems (root in a container), the NVMe tier lives on a real
1 MiB-sized tmpfs that a callback fills just before the first update writes optimizer states;
elsewhere the store's writes are made to fail with the same ``ENOSPC``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.memory import nvme as nvme_module
from tests.helpers import PARAMETERS_ONLY, train
from tests.test_offload import gpt2_4l, nvme_gpu_memory, nvme_strategy, param_bytes


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[bool]:
    """A tmpfs of ``size`` at ``path``; yields False (and a plain directory) where mounting is not allowed."""
    path.mkdir(parents=True)
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


class FillDisk(L.Callback):
    """Right before the first backward (whose updates write states to NVMe for the first time)."""

    def __init__(self, directory: Path, real: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.directory, self.real, self.monkeypatch = directory, real, monkeypatch

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.real:
            with open(self.directory / "filler", "wb") as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
        else:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            self.monkeypatch.setattr(nvme_module.os, "pwritev", full)


def test_nvme_writes_on_a_full_disk_fail_clearly_and_leave_nothing(tmp_path, monkeypatch):
    total = param_bytes(gpt2_4l)
    disk = tmp_path / "disk"
    with small_filesystem(disk, "2m") as real:
        nvme = disk / "nvme"
        # the NVMe budget is all that is free on the small disk; the first update writes states (every
        # unit homed on NVMe from set-up: the kept layout fits beside the streaming buffers, nothing is placed again)
        policy = {**PARAMETERS_ONLY, "placement": "nvme"}
        strategy = TieredStrategy(policy=policy, gpu_memory=nvme_gpu_memory(total), host_memory=int(4.2 * total), nvme_path=nvme)
        with pytest.raises(OSError, match=r"NVMe write of key '.*' \(.*\) in .* failed: No space left on device\. The disk is full: free space or lower the NVMe budget\."):
            train(strategy, tmp_path / "run", epochs=1, make_model=gpt2_4l, extra_callbacks=(FillDisk(disk, real, monkeypatch),))
        assert strategy.engine is None
        assert not nvme.exists() or not any(nvme.iterdir()), f"the failed run left NVMe files behind: {sorted(str(p) for p in nvme.rglob('*'))}"


class FillAfterFirstEpoch(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            FillDisk(self.directory, True, None).on_before_backward(trainer, pl_module, None)


def test_a_checkpoint_that_meets_a_full_disk_keeps_the_previous_one(tmp_path):
    total = param_bytes(gpt2_4l)
    disk = tmp_path / "disk"
    with small_filesystem(disk, "4m") as real:
        if not real:
            pytest.skip("mounting a small file system needs root; test_checkpoint_io simulates the failed write instead")
        strategy = nvme_strategy(total, tmp_path / "nvme")
        with pytest.raises(OSError, match="No space left on device"):
            train(strategy, disk / "run", epochs=2, save_every_epoch=True, make_model=gpt2_4l, extra_callbacks=(FillAfterFirstEpoch(disk),))
        checkpoints = sorted(p.name for p in (disk / "run" / "ckpt").iterdir())
        assert checkpoints == ["epoch=0.ckpt"], "a partial file was left, or the previous checkpoint is gone"
        (disk / "filler").unlink()
        state = torch.load(disk / "run" / "ckpt" / "epoch=0.ckpt", weights_only=True)
        assert state["global_step"] == 6 and state["optimizer_states"][0]["state"]
        losses, _, _ = train(nvme_strategy(total, tmp_path / "nvme-b"), tmp_path / "b", epochs=2, resume=disk / "run" / "ckpt" / "epoch=0.ckpt", make_model=gpt2_4l)
        assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))


def _free_space_of(monkeypatch, path: Path, size: int) -> None:
    """Where no file system can be mounted: ``path`` reports ``size`` less what lies under it."""
    import offload_strategy.memory.nvme as nvme
    import offload_strategy.session.budgets as budgets
    import offload_strategy.lightning.core as strategy

    def free(_: object) -> int:
        used = sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())
        return max(size - used, 0)

    monkeypatch.setattr(nvme, "disk_free", free)
    monkeypatch.setattr(strategy, "disk_free", free)
    monkeypatch.setattr(budgets, "disk_free", free)


def test_all_that_is_free_is_measured_once_for_every_nvme_store(tmp_path, monkeypatch):
    """``nvme_memory=None`` with parameters and swapped activations on NVMe: the free space is
    measured once, less a reserve, and shared by both stores (the activations' store used to
    demand it all again after the parameters' files had taken some)."""
    from tests.test_recipes import Validated, fit

    root = tmp_path / "nvme"
    with small_filesystem(root, "96m") as mounted:
        if not mounted:
            _free_space_of(monkeypatch, root, 96 * 1024**2)
        strategy = TieredStrategy(
            policy={"placement": "nvme", "activations": "swap_nvme"}, gpu_memory="1MiB", host_memory="1GiB", nvme_path=str(root),
        )
        plain_losses, _, _ = fit("auto", tmp_path / "plain", Validated, steps=3)
        losses, _, _ = fit(strategy, tmp_path / "tiered", Validated, steps=3)
    assert losses == plain_losses
    assert 0 < strategy.budgets.nvme <= 95 * 1024**2


def test_a_full_disk_is_named_as_full_with_the_numbers(tmp_path, monkeypatch):
    from offload_strategy.planning.placement import PlacementError

    root = tmp_path / "nvme"
    with small_filesystem(root, "1m") as mounted:
        if mounted:
            with contextlib.suppress(OSError):
                (root / "filler").write_bytes(b"\0" * (1 << 20))
        else:
            _free_space_of(monkeypatch, root, 0)
        strategy = TieredStrategy(policy={"placement": "fill", "activations": "keep"}, gpu_memory="64KiB", host_memory="64KiB", nvme_path=str(root))
        with pytest.raises(PlacementError, match=r"must go to NVMe, but the file system under nvme_path=.* has only [\d.]+ (B|KiB) free.*point nvme_path at a larger disk"):
            train(strategy, tmp_path / "run", epochs=1)
