"""Placing the units again between steps moves the optimizer states from the old engine to the
new one a unit at a time: those of units on NVMe are read from the old files as the new engine
takes them, so beyond what the new engine keeps, at most a few units' states are in host memory
at once (before, every state was read into memory as one state dict first: 2.3 GiB at 303M
parameters). Training across the move stays plain training's, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from offload_strategy import TieredStrategy
from offload_strategy.estimate.live_bytes import LiveBytes
from offload_strategy.memory.nvme import NvmeStore
from tests.ddp_launch import assert_same_optimizer_states
from tests.helpers import assert_same_weights
from tests.test_host_bound import Deep
from tests.test_recipes import fit


class PlaceAgain(L.Callback):
    """Places the units again after the steps ``at``; records, per placement, the bytes of
    tensors made during it that were alive at once beyond what it left alive (``LiveBytes``),
    and the optimizer states the old engine held on NVMe."""

    def __init__(self, at: tuple[int, ...] = (2, 3)) -> None:
        self.at = at
        self.transient: list[int] = []
        self.on_nvme: list[tuple[int, int]] = []  # (all units' state bytes, the largest unit's)
        self.files: list[int] = []  # the old engine's units with states on NVMe

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        core = trainer.strategy.tiered
        if trainer.global_step not in self.at:
            return
        sizes = core.engine.nvme_states.sizes if core.engine.nvme_states is not None else {}
        self.on_nvme.append((sum(sizes.values()), max(sizes.values(), default=0)))
        self.files.append(len(sizes))
        with LiveBytes() as live:
            core._replace_engine(core.recipe(trainer), gpu_bytes=core.context.budgets.gpu)
        self.transient.append(live.peak - live.bytes)


def on_nvme(root: Path, host_memory: str = "448KiB") -> TieredStrategy:
    return TieredStrategy(
        # the blocks swapped to NVMe: kept, their activations would not fit the tier beside the buffers
        policy={"placement": "nvme", "activations": "swap_nvme"}, gpu_memory="320KiB", host_memory=host_memory,
        nvme_path=str(root / "nvme"), nvme_memory="64MiB",
    )


def test_placing_again_holds_a_few_units_states_at_once_and_trains_as_plain(tmp_path, monkeypatch):
    plain_losses, plain_weights, plain = fit("auto", tmp_path / "plain", Deep, steps=4)
    events: list[str] = []  # the old store gives back each unit's file once read, before it closes
    delete, close = NvmeStore.delete, NvmeStore.close
    monkeypatch.setattr(NvmeStore, "delete", lambda store, key: events.append(key) or delete(store, key))
    monkeypatch.setattr(NvmeStore, "close", lambda store: events.append("close") or close(store))
    moves = PlaceAgain()
    losses, weights, model = fit(on_nvme(tmp_path), tmp_path / "tiered", Deep, steps=4, callbacks=(moves,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert_same_optimizer_states(plain.trainer.optimizers[0].state_dict(), model.trainer.optimizers[0].state_dict())
    assert len(moves.transient) == 2
    for (total, largest), transient in zip(moves.on_nvme, moves.transient):
        assert total > 6 * largest  # the states are several times what a few units hold
        # the new engine holds one unit's states read from the old file, its own copy and the
        # buffer it writes them from: before, every unit's states were in memory at once
        assert transient <= 3 * largest, (transient, total, largest)
    first_close = events.index("close")
    assert sum(key.startswith("states") for key in events[:first_close]) == moves.files[0] > 40


def test_fp32_masters_on_nvme_move_with_their_states(tmp_path):
    """Under bf16-true each NVMe unit's file holds its fp32 masters beside the states: placed
    again, training goes on from them exactly as without the moves (a master lost would
    restart from the 16-bit parameter)."""
    _, still, _ = fit(on_nvme(tmp_path / "still", "1MiB"), tmp_path / "still-run", Deep, steps=4, precision="bf16-true")
    moves = PlaceAgain(at=(2,))
    _, moved, _ = fit(on_nvme(tmp_path / "moved", "1MiB"), tmp_path / "moved-run", Deep, steps=4, callbacks=(moves,), precision="bf16-true")
    assert len(moves.transient) == 1 and all(total > 0 for total, _ in moves.on_nvme)
    assert_same_weights(still, moved)
    assert all(v.dtype == torch.bfloat16 for k, v in moved.items() if k.endswith("weight"))
