"""A re-placement frees the old engine's pinned slab and GPU arena before the next engine takes its
own, on every path that places the units again: the default policy's search after its profiled
steps held the old engine in a local of the frame that asked for the re-placement, so both tiers
stayed beside the new ones until it returned (at 101M, 844 MiB of growth where 576 MiB are
allowed). Training across the search's re-placement and two forced ones stays plain training's."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from offload_strategy import TieredStrategy
from offload_strategy.lightning.core import TieredCore
from offload_strategy.runtime.tiers import TierMemory
from tests.ddp_launch import assert_same_optimizer_states
from tests.helpers import assert_same_weights
from tests.test_host_bound import Deep
from tests.test_recipes import fit


class PlaceAgainAfter(L.Callback):
    """Places the units again after the steps ``at``, in the share of the GPU tier the plan in use
    gives the parameters (as a dynamic-padding growth does)."""

    def __init__(self, at: tuple[int, ...]) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        core = trainer.strategy.tiered
        if trainer.global_step in self.at:
            core._replace_engine(core.recipe(trainer), gpu_bytes=core.session.in_use.gpu_for_parameters)


class TiersFreed:
    """At each allocation of an engine's tiers, whether every earlier engine's slab and GPU arena
    were freed already, and the bytes of every engine's slab and arena alive once it is made."""

    def __init__(self) -> None:
        self.freed: list[list[bool]] = []  # per engine: [slab freed, arena freed]
        self.sizes: list[list[int]] = []  # per engine: [slab bytes, arena bytes]
        self.seen: list[list[bool]] = []  # per allocation: every earlier engine's tiers all freed
        self.alive: list[int] = []  # per allocation: the tiers' bytes alive with the new ones

    def watch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        allocate = TierMemory.allocate

        def watched(cls: type, *args: Any, **kwargs: Any) -> TierMemory:
            self.seen.append([all(flags) for flags in self.freed])
            memory = allocate(*args, **kwargs)
            flags = [False, False]
            weakref.finalize(memory.slab.tensor.untyped_storage(), flags.__setitem__, 0, True)
            weakref.finalize(memory.arena.untyped_storage(), flags.__setitem__, 1, True)
            self.freed.append(flags)
            self.sizes.append([memory.slab.nbytes, memory.arena.numel()])
            self.alive.append(sum(size for flags, sizes in zip(self.freed, self.sizes) for freed, size in zip(flags, sizes) if not freed))
            return memory

        monkeypatch.setattr(TierMemory, "allocate", classmethod(watched))


def searched(root: Path) -> TieredStrategy:
    """The default policy: it places the units again after its profiled steps (the search)."""
    return TieredStrategy(gpu_memory="640KiB", host_memory="448KiB", nvme_path=str(root / "nvme"), nvme_memory="64MiB")


def test_every_replacement_frees_the_old_tiers_before_the_new_are_taken_and_trains_as_plain(tmp_path, monkeypatch):
    plain_losses, plain_weights, plain = fit("auto", tmp_path / "plain", Deep, steps=6)
    tiers = TiersFreed()
    tiers.watch(monkeypatch)
    searches: list[int] = []
    search = TieredCore._replace_engine
    monkeypatch.setattr(TieredCore, "_replace_engine", lambda core, *a, **k: searches.append(1) or search(core, *a, **k))
    losses, weights, model = fit(searched(tmp_path), tmp_path / "tiered", Deep, steps=6, callbacks=(PlaceAgainAfter(at=(4, 5)),))
    assert len(searches) == 3  # the search's own, then two forced
    assert len(tiers.seen) == 4
    budgets = model.trainer.strategy.budgets
    # the host's and the emulated GPU tier's memory at once: before, the new tiers beside the old
    assert max(tiers.alive) <= budgets.host + budgets.gpu, (tiers.alive, budgets)
    for earlier in tiers.seen:
        assert all(earlier), tiers.seen  # before: the search's new tiers were taken beside the old
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert_same_optimizer_states(plain.trainer.optimizers[0].state_dict(), model.trainer.optimizers[0].state_dict())
    # every engine's files went with its store, and the directory the strategy made with them
    assert not (tmp_path / "nvme").exists(), list((tmp_path / "nvme").rglob("*"))


def test_a_parameter_left_on_nvme_is_read_through_one_buffer_of_its_unit(tmp_path):
    """What reads each parameter of a unit left on NVMe (the next engine's move into its homes,
    where the units are read from the old files, and any use after ``fit``) holds the unit's
    buffer and the value it is read into, no copy between: before, a copy of the parameter's
    bytes besides, at every parameter of every unit the re-placement moved."""
    from offload_strategy.estimate.live_bytes import LiveBytes
    from offload_strategy.planning.placement import HOST_SLOT_ALIGNMENT, align
    from tests.test_host_bound import budgeted, fit_leaving_weights

    strategy = budgeted(tmp_path)
    _, model = fit_leaving_weights(strategy, tmp_path / "tiered")
    deferred = strategy.deferred
    blocks = {id(p): block for block in model.blocks for p in block.parameters()}
    weight = next(p for p in deferred.params.values() if id(p) in blocks and p.dim() == 2)
    unit_bytes = align(sum(q.numel() * q.element_size() for q in blocks[id(weight)].parameters()), HOST_SLOT_ALIGNMENT)
    with LiveBytes() as live:
        value = deferred.value(weight)
    assert value.shape == weight.shape and bool(value.isfinite().all())
    assert live.peak <= unit_bytes + value.nbytes, (live.peak, unit_bytes, value.nbytes)
