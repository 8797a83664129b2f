"""Data that rots on the NVMe tier is an error naming the file, with checksums on by default.

Each case damages the files of one kind of data mid-run (parameters, optimizer states, gradients
spilled to wait for the step, swapped activations) in one of three ways (a flipped bit, a zeroed
block, two files of the same size swapped) and expects ``fit`` to stop with
:class:`NvmeChecksumError` naming a damaged file, before any value read from it is used; a
checkpoint due after the damage is never written.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from offload_strategy import PolicyConfig
from offload_strategy.memory.nvme import PAGE, NvmeChecksumError, NvmeStore
from offload_strategy.checkpoint.sharded import consolidate
from tests.helpers import tiny_data
from tests.test_recipes import Net, fit, tiered


def flip_bit(files: list[Path]) -> list[Path]:
    with open(files[0], "r+b") as handle:
        handle.seek(5)
        byte = handle.read(1)
        handle.seek(5)
        handle.write(bytes([byte[0] ^ 0x10]))
    return files[:1]


def zero_block(files: list[Path]) -> list[Path]:
    with open(files[0], "r+b") as handle:
        handle.write(bytes(min(PAGE, files[0].stat().st_size)))
    return files[:1]


def swap_two(files: list[Path]) -> list[Path]:
    """Two files of the same size exchange names (a file system that mixed up two inodes)."""
    by_size: dict[int, list[Path]] = {}
    for f in files:
        by_size.setdefault(f.stat().st_size, []).append(f)
    a, b = next(group for group in by_size.values() if len(group) >= 2)[:2]
    aside = a.with_name("aside")
    os.rename(a, aside)
    os.rename(b, a)
    os.rename(aside, b)
    return [a, b]


DAMAGES = {"bit_flip": flip_bit, "zeroed_block": zero_block, "swapped": swap_two}


def _files(store: NvmeStore, keep: Callable[[str], bool]) -> list[Path]:
    """The files of the keys ``keep`` selects, whose contents differ from one another."""
    files = [entry.file for key, entry in sorted(store._entries.items()) if keep(key) and entry.file.exists()]
    assert files, "nothing of this kind on NVMe to damage"
    return files


class Damage(L.Callback):
    """Damages the files of one kind once, at the first call of ``hook`` where ``when(batch_idx)``."""

    def __init__(self, hook: str, kind: Callable[[str], bool], damage: Callable[[list[Path]], list[Path]],
                 store: Callable[[Any], NvmeStore], when: Callable[[int], bool] = lambda i: i == 1) -> None:
        self.kind, self.damage, self.store, self.when = kind, damage, store, when
        self.damaged: list[Path] = []
        setattr(self, hook, self._maybe)

    def _maybe(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        batch_idx = args[-1] if args and isinstance(args[-1], int) else trainer.global_step
        if not self.damaged and self.when(batch_idx):
            store = settled(trainer, self.store(trainer))
            self.damaged = self.damage(_files(store, self.kind))


def settled(trainer: L.Trainer, store: NvmeStore) -> NvmeStore:
    """``store`` once every write submitted so far has reached its file (damage done while a
    write is in flight could be overwritten by it): the update worker's tasks done, then every I/O
    thread of the store met at a barrier (each took it after the chunks queued before it)."""
    engine = trainer.strategy.engine
    if engine is not None:
        engine.updater.worker.drain()
    workers = store._pool._max_workers
    barrier = threading.Barrier(workers)
    for met in [store._pool.submit(barrier.wait) for _ in range(workers)]:
        met.result()
    return store


def engine_store(trainer: L.Trainer) -> NvmeStore:
    return trainer.strategy.engine.store


def swap_store(trainer: L.Trainer) -> NvmeStore:
    return trainer.strategy.tiered.activations.swap_store


def is_parameters(key: str) -> bool:
    return key.startswith("unit") and not key.endswith(".grad")


def is_states(key: str) -> bool:
    return key.startswith("states")


def is_gradients(key: str) -> bool:
    return key.endswith(".grad")


# what each kind needs: the policy, the Trainer's settings, the hook the files are damaged at
KINDS: dict[str, tuple[dict, dict, Callable[[], Damage]]] = {
    # before the second step's forward fetches the units
    "parameters": ({}, {}, lambda damage: Damage("on_train_batch_start", is_parameters, damage, engine_store)),
    # after the first step's updates wrote them, before the second step's read them
    "optimizer_states": ({}, {}, lambda damage: Damage("on_train_batch_start", is_states, damage, engine_store)),
    # accumulation: the first micro-batch's gradients wait on NVMe until the second adds to them
    "spilled_gradients": ({}, {"accumulate_grad_batches": 2},
                          lambda damage: Damage("on_train_batch_start", is_gradients, damage, engine_store)),
    # between forward and backward, while the blocks' activations wait on NVMe
    "swapped_activations": ({"activations": "swap_nvme"}, {},
                            lambda damage: Damage("on_before_backward", lambda key: True, damage, swap_store, when=lambda step: True)),
}


def _checksum_error(raised: BaseException) -> Optional[NvmeChecksumError]:
    """The checksum error that stopped the run, however it was passed on."""
    seen: Optional[BaseException] = raised
    while seen is not None:
        if isinstance(seen, NvmeChecksumError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_nvme_files_stop_the_run_naming_the_file(tmp_path, kind, damage):
    policy, trainer_kwargs, make = KINDS[kind]
    callback = make(DAMAGES[damage])
    with pytest.raises(BaseException) as raised:
        fit(tiered("nvme", tmp_path, **policy), tmp_path / "run", Net, steps=4, callbacks=(callback,), **trainer_kwargs)
    assert callback.damaged, "the run ended before the files were damaged"
    error = _checksum_error(raised.value)
    assert error is not None, f"not a checksum error: {raised.value!r}"
    assert "came back different from what was written" in str(error)
    assert any(str(f) in str(error) for f in callback.damaged), f"{error} names none of {callback.damaged}"


class DamageAtSecondEpochEnd(L.Callback):
    """A parameter file damaged at the end of the second epoch, before its checkpoint is saved
    (Lightning runs ModelCheckpoint after the other callbacks)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            flip_bit(_files(settled(trainer, engine_store(trainer)), is_parameters))


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_checkpoint_due_after_the_damage_is_never_written(tmp_path, state_dict_type):
    """A single file gathers the true values before it is written; a sharded checkpoint reads
    each NVMe value as its writer reaches it: either way the damaged read stops the save."""
    from tests.test_sharded_checkpoint import sharded

    checkpoints = tmp_path / "ckpt"
    every_epoch = ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1)
    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(
        strategy=sharded(tmp_path, "nvme", state_dict_type), accelerator="cpu", devices=1, max_epochs=3, limit_train_batches=3, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "run",
        callbacks=[every_epoch, DamageAtSecondEpochEnd()],
    )
    with pytest.raises(BaseException) as raised:
        trainer.fit(Net(), datamodule=tiny_data())
    assert _checksum_error(raised.value) is not None, repr(raised.value)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0.ckpt"], "the damaged state was saved"
    if state_dict_type == "sharded":
        state = consolidate(checkpoints / "epoch=0.ckpt")["state_dict"]
    else:
        state = torch.load(checkpoints / "epoch=0.ckpt", weights_only=True)["state_dict"]
    assert state and all(torch.isfinite(v).all() for v in state.values())


def test_checksums_are_on_by_default_and_false_turns_them_off(tmp_path):
    assert PolicyConfig().checksums is True
    data = torch.arange(3 * PAGE, dtype=torch.uint8)
    for checksums in (True, False):
        with NvmeStore(tmp_path / str(checksums), capacity=1 << 20, **({} if checksums else {"checksums": False})) as store:
            store.write("x", data).result()
            flip_bit([store._entries["x"].file])
            out = torch.empty_like(data)
            if checksums:
                with pytest.raises(NvmeChecksumError, match=str(store._entries["x"].file)):
                    store.read("x", out).result()
            else:
                store.read("x", out).result()  # nothing checks: the damage comes back
                assert not torch.equal(out, data)


def test_an_older_write_of_the_same_file_put_back_is_caught(tmp_path):
    """A stale copy of a file (a snapshot restored, a write the disk lost) holds data that was
    once right for its key: what is checked is the key's last write."""
    with NvmeStore(tmp_path, capacity=1 << 20) as store:
        store.write("x", torch.full((PAGE,), 1, dtype=torch.uint8)).result()
        file = store._entries["x"].file
        old = file.read_bytes()
        store.write("x", torch.full((PAGE,), 2, dtype=torch.uint8)).result()
        file.write_bytes(old)
        with pytest.raises(NvmeChecksumError, match=str(file)):
            store.read("x", torch.empty(PAGE, dtype=torch.uint8)).result()
