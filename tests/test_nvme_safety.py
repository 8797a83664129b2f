"""A machine shared with other users, checkpoints from elsewhere, and disks that fail.

The NVMe path is refused where another user could redirect the run's files; the run's files are
opened relative to its held directory, never through a link; a sharded checkpoint's metadata and
values build only what ``torch.distributed.checkpoint`` writes; checkpoint names up to the file
system's limit save and load; an I/O error names the file and what failed.
"""

from __future__ import annotations

import errno
import os
import pickle
import stat
from pathlib import Path

import lightning as L
import pytest
import torch

from offload_strategy.checkpoint.atomic import AtomicCheckpointIO
from offload_strategy.memory.nvme import PAGE, NvmeStore, NvmeUnsafePathError
from offload_strategy.runtime import shared_homes
from offload_strategy.checkpoint.sharded import ShardedCheckpoint, UnsafeCheckpointError, consolidate, write_sharded
from tests.helpers import train
from tests.test_recipes import Net, fit, tiered

OTHER_UID = 54321


def _owned_by_another_user(path: Path) -> None:
    try:
        os.chown(path, OTHER_UID, OTHER_UID)
    except PermissionError:
        pytest.skip("changing a directory's owner needs root")


# -- the NVMe path ------------------------------------------------------------------------------


def test_an_nvme_path_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    _owned_by_another_user(theirs)
    with pytest.raises(NvmeUnsafePathError, match=rf"{theirs} belongs to another user \(uid {OTHER_UID}\).*mkdir -m 700"):
        NvmeStore(theirs, capacity=1 << 20)
    # also a directory the store would create under it
    with pytest.raises(NvmeUnsafePathError, match=f"{theirs} belongs to another user"):
        NvmeStore(theirs / "mine" / "nvme", capacity=1 << 20)
    assert list(theirs.iterdir()) == [], "something was created in another user's directory"


def test_an_nvme_path_others_may_write_needs_the_sticky_bit(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(NvmeUnsafePathError, match=r"can be written by other users \(mode 777\) and has no sticky bit.*chmod \+t"):
        NvmeStore(shared / "nvme", capacity=1 << 20)
    assert not (shared / "nvme").exists()
    os.chmod(shared, 0o1777)  # /tmp's mode: others cannot rename what is this user's
    with NvmeStore(shared / "nvme", capacity=1 << 20) as store:
        store.write("x", torch.ones(PAGE, dtype=torch.uint8)).result()
    # the directories it made are this user's alone
    assert stat.S_IMODE((shared / "nvme").stat().st_mode) == 0o700


def test_the_strategy_refuses_an_unsafe_nvme_path_at_set_up(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    strategy = tiered("nvme", shared)  # nvme_path = shared/nvme
    with pytest.raises(NvmeUnsafePathError, match="no sticky bit"):
        fit(strategy, tmp_path / "run", Net, steps=1)
    assert list(shared.iterdir()) == [], "the NVMe path was made before it was refused"


def test_a_renamed_run_directory_and_a_planted_link_are_never_followed(tmp_path):
    """Another user (here simulated) renames the run's directory and puts a link to a directory
    of theirs in its place: the run's files keep going to its own directory."""
    attacker = tmp_path / "attacker"
    attacker.mkdir()
    with NvmeStore(tmp_path / "nvme", capacity=1 << 20) as store:
        first = torch.arange(PAGE, dtype=torch.int32).view(torch.uint8)[:PAGE]
        store.write("a", first).result()
        moved = store.path.with_name(store.path.name + ".moved")
        os.rename(store.path, moved)
        os.symlink(attacker, store.path)
        second = torch.full((PAGE,), 3, dtype=torch.uint8)
        store.write("b", second).result()
        out = torch.empty(PAGE, dtype=torch.uint8)
        store.read("b", out).result()
        assert torch.equal(out, second)
        store.read("a", out).result()
        assert torch.equal(out, first)
        assert list(attacker.iterdir()) == [], "the run wrote into the directory the link points at"
        assert sorted(p.name for p in moved.iterdir()) == ["00000000.bin", "00000001.bin", "owner.lock"]
    assert list(moved.iterdir()) == [] and list(attacker.iterdir()) == [], "close() removed files through the link, or left its own"


def test_a_link_planted_as_a_run_file_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not overwrite")
    with NvmeStore(tmp_path / "nvme", capacity=1 << 20) as store:
        os.symlink(victim, store.path / "00000000.bin")  # the name the next key's file takes
        error = store.write("k", torch.ones(PAGE, dtype=torch.uint8)).exception(timeout=10)
        assert isinstance(error, OSError) and error.errno == errno.ELOOP
        assert str(store.path / "00000000.bin") in str(error)
    assert victim.read_bytes() == b"do not overwrite"


# -- sharded checkpoints from elsewhere ------------------------------------------------------------


class RunsCode:
    """What a malicious pickle carries: unpickling it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _hand_made(path: Path) -> Path:
    state = {
        "epoch": 1, "global_step": 2, "state_dict": {"w": torch.arange(6.0).view(2, 3)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(2, 3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
    }
    write_sharded(state, path)
    return path


def test_a_sharded_checkpoint_whose_metadata_runs_code_is_refused(tmp_path):
    checkpoint = _hand_made(tmp_path / "c.ckpt")
    marker = tmp_path / "ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata asks to build posix\.mkdir.*refused"):
        ShardedCheckpoint(checkpoint)
    with pytest.raises(UnsafeCheckpointError):
        consolidate(checkpoint)
    assert not marker.exists(), "the checkpoint's code ran"


def test_a_sharded_checkpoint_value_that_runs_code_is_refused(tmp_path):
    """A value DCP keeps as bytes (an optimizer's learning rate) replaced by a pickle that runs
    code: loaded under weights_only, as a single-file checkpoint's values are."""
    checkpoint = _hand_made(tmp_path / "c.ckpt")
    marker = tmp_path / "ran"
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # this test's own, trusted
    (index, info), = [(i, v) for i, v in metadata.storage_data.items() if i.fqn == "optimizer_0.param_groups.0.lr"]
    payload = checkpoint / info.relative_path
    torch.save(RunsCode(marker), payload)
    metadata.storage_data[index] = type(info)(info.relative_path, 0, payload.stat().st_size)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError):
        ShardedCheckpoint(checkpoint).optimizer_state(0)
    assert not marker.exists(), "the checkpoint's code ran"
    assert ShardedCheckpoint(checkpoint).read([("model", "w")])[("model", "w")].sum() == 15  # the tensors still read


def test_resuming_from_a_sharded_checkpoint_whose_metadata_runs_code_is_refused(tmp_path):
    from tests.test_sharded_checkpoint import sharded

    train(sharded(tmp_path / "a"), tmp_path / "part", stop_after_epochs=1, save_every_epoch=True)
    checkpoint = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    marker = tmp_path / "ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError):
        train(sharded(tmp_path / "b"), tmp_path / "resumed", resume=checkpoint)
    assert not marker.exists(), "the checkpoint's code ran"


def test_consolidate_loads_plain_data_only_unless_trusted(tmp_path):
    from offload_strategy.cli import main

    marker = tmp_path / "ran"
    single = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hparams": RunsCode(marker)}, single)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        main(["consolidate", str(single), str(tmp_path / "out"), "--sharded"])
    assert not marker.exists(), "the checkpoint's code ran"
    checkpoint = _hand_made(tmp_path / "c.ckpt")
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError):
        main(["consolidate", str(checkpoint), str(tmp_path / "out.ckpt")])
    assert not marker.exists(), "the checkpoint's code ran"
    assert main(["consolidate", str(_hand_made(tmp_path / "good.ckpt")), str(tmp_path / "good-single.ckpt")]) == 0  # a plain one converts


# -- checkpoint names and I/O errors ---------------------------------------------------------------


def test_a_checkpoint_name_at_the_file_system_limit_saves_and_loads(tmp_path):
    name = "x" * 245 + ".ckpt"  # 250 characters: valid on Linux, written by plain Lightning
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.arange(4.0)}, tmp_path / name)
    assert torch.equal(io.load_checkpoint(tmp_path / name)["w"], torch.arange(4.0))
    write_sharded({"state_dict": {"w": torch.arange(3.0)}}, tmp_path / ("y" * 250))
    assert torch.equal(consolidate(tmp_path / ("y" * 250))["state_dict"]["w"], torch.arange(3.0))
    assert sorted(len(p.name) for p in tmp_path.iterdir()) == [250, 250], "a partial file was left"


def test_the_strategy_saves_a_checkpoint_with_a_250_character_name(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import tiny_data

    name = "n" * 245
    checkpoints = tmp_path / "ckpt"
    trainer = L.Trainer(
        strategy=tiered("nvme", tmp_path), accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, filename=name)],
    )
    trainer.fit(Net(), datamodule=tiny_data())
    (saved,) = checkpoints.iterdir()
    assert saved.name == name + ".ckpt" and torch.load(saved, weights_only=True)["global_step"] == 2


def _input_output_error(*args, **kwargs):
    """A disk that fails: what os.fsync, torch.load or os.preadv raise then."""
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_an_io_error_while_saving_names_the_checkpoint_and_the_operation(tmp_path, monkeypatch):
    import offload_strategy.checkpoint.atomic as checkpoint_io

    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, target)
    monkeypatch.setattr(checkpoint_io.os, "fsync", _input_output_error)
    with pytest.raises(OSError, match=rf"checkpoint {target}: could not fsync \(flush to disk\) \(through the temporary file .*\.partial\): "
                                      r"Input/output error\. .*check the device") as raised:
        io.save_checkpoint({"step": 2}, target)
    assert raised.value.errno == errno.EIO
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a partial file was left"


def test_an_io_error_while_loading_names_the_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, target)
    monkeypatch.setattr(torch, "load", _input_output_error)
    with pytest.raises(OSError, match=rf"checkpoint {target}: could not read: Input/output error"):
        io.load_checkpoint(target)


def test_an_nvme_io_error_names_the_file_and_the_operation(tmp_path, monkeypatch):
    from offload_strategy.memory import nvme

    with NvmeStore(tmp_path, capacity=1 << 20) as store:
        store.write("k", torch.ones(PAGE, dtype=torch.uint8)).result()
        monkeypatch.setattr(nvme.os, "preadv", _input_output_error)
        error = store.read("k", torch.empty(PAGE, dtype=torch.uint8)).exception(timeout=10)
        assert isinstance(error, OSError) and error.errno == errno.EIO
        assert f"NVMe read of key 'k' (4.00 KiB) in {store.path / '00000000.bin'} failed: Input/output error" in str(error)


def test_a_read_only_shared_memory_says_why(monkeypatch):
    from types import SimpleNamespace

    directory = Path("/dev/shm")
    if not directory.is_dir():
        pytest.skip("no /dev/shm")
    monkeypatch.setattr(shared_homes.os, "statvfs", lambda path: SimpleNamespace(f_flag=os.ST_RDONLY))
    reason = shared_homes.shared_memory_unavailable(directory)
    assert "/dev/shm is mounted read-only" in reason and "--tmpfs /dev/shm" in reason
    assert not shared_homes.shared_memory_available(directory)


def test_a_missing_shared_memory_says_why(tmp_path):
    assert "does not exist" in shared_homes.shared_memory_unavailable(tmp_path / "none")
    assert shared_homes.shared_memory_unavailable(tmp_path) == ""


def test_a_read_after_a_failed_write_gives_the_write_s_error(tmp_path, monkeypatch):
    """What a failed write left in the file is no value: the key's next read fails with the
    write's error (a full disk, say), not with a checksum mismatch over the bytes it left."""
    from offload_strategy.memory import nvme

    with NvmeStore(tmp_path, capacity=1 << 20) as store:
        store.write("k", torch.ones(PAGE, dtype=torch.uint8)).result()
        with monkeypatch.context() as patched:
            patched.setattr(nvme.os, "pwritev", _input_output_error)
            patched.setattr(nvme.os, "pwrite", _input_output_error)
            assert isinstance(store.write("k", torch.full((PAGE,), 2, dtype=torch.uint8)).exception(timeout=10), OSError)
        error = store.read("k", torch.empty(PAGE, dtype=torch.uint8)).exception(timeout=10)
        assert isinstance(error, OSError) and error.errno == errno.EIO
        assert "NVMe write of key 'k'" in str(error)
        store.write("k", torch.full((PAGE,), 3, dtype=torch.uint8)).result()  # written again: a value once more
        out = torch.empty(PAGE, dtype=torch.uint8)
        store.read("k", out).result()
        assert bool((out == 3).all())
