"""What the runtime frees leaves the process within the bound after the steps. Placing the units
again between steps frees the engine it replaces before it returns: its
tiers (the pinned slab, the emulated GPU tier) are no part of the steps after it. The engine's
parts refer to each other, so only a collection frees it, and placing again makes one
(``TieredCore._free_closed_engine``); a local that still named the engine in the frame that asked
for the placement kept it through that collection, and then until the interpreter's next full
collection: at 101M parameters the 4th step and teardown held the profiling engine's 210 MiB
slab and 65 MiB GPU tier beside the new engine's (1.26x and 1.20x of the bound,
docs/benchmarks.md, "The steps and teardown after placing again"). The units read back after
training are checked against the steps' limit, one by one."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import lightning as L
import pytest
from torch import nn

from offload_strategy import TieredStrategy
from offload_strategy.lightning.core import TieredCore
from tests.helpers import tiny_data
from tests.test_recipes import Net, SwitchToSgd, UnfreezeInStep, fit, tiered


def engines_left_after_placing_again(monkeypatch: pytest.MonkeyPatch, run: Callable[[], Any]) -> list[bool]:
    """For each placement between steps of ``run()``: whether the engine it replaced is still
    alive when it returns. Automatic collections are off meanwhile, as a long run's full ones
    are rare: only the collections the strategy makes count."""
    place_again = TieredCore._replace_engine
    alive: list[bool] = []

    def watched(core: TieredCore, *args: Any, **kwargs: Any) -> None:
        old = weakref.ref(core.context.engine) if core.context.engine is not None else None
        place_again(core, *args, **kwargs)
        if old is not None:
            alive.append(old() is not None)

    monkeypatch.setattr(TieredCore, "_replace_engine", watched)
    gc.collect()
    gc.disable()
    try:
        run()
    finally:
        gc.enable()
    return alive


def test_the_engine_the_search_replaces_is_freed_while_placing_again(tmp_path, monkeypatch):
    # the default policy: its search places the units again after the profiled steps
    alive = engines_left_after_placing_again(monkeypatch, lambda: fit(TieredStrategy(gpu_memory="310KiB"), tmp_path, Net, steps=5))
    assert alive == [False]


# the optimizers replaced after the placement beside the kept layout measured in the first step; the
# parameters unfrozen in that step placed again once, beside it
@pytest.mark.parametrize("make, callbacks, placements", [(UnfreezeInStep, (), 1), (Net, (SwitchToSgd(),), 2)], ids=["unfrozen", "optimizers replaced"])
def test_the_engine_replaced_for_new_parameters_or_optimizers_is_freed(tmp_path, monkeypatch, make, callbacks, placements):
    alive = engines_left_after_placing_again(monkeypatch, lambda: fit(tiered("host", tmp_path), tmp_path / "run", make, steps=4, callbacks=callbacks))
    assert alive == [False] * placements


class Wide(Net):
    """Net with eight 1024-wide blocks: each unit's parameters and AdamW states (12 MiB) are more
    than what a trim leaves room for before the next (``FREED_MEMORY_SLACK``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 1024)
        self.blocks = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(8))
        self.norm = nn.LayerNorm(1024)
        self.head = nn.Linear(1024, 256)


class KeepsTheLimit(L.Callback):
    """At the last step's end, a limit under what the process holds: every check past the slack gives back."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.freed = trainer.strategy.engine.updater.freed
        self.freed.limit = 1
        self.trims = self.freed.trims


@pytest.mark.no_race_check  # trims follow the resident set
def test_each_unit_read_back_after_training_is_checked_against_the_limit(tmp_path):
    """The units at home on NVMe that host_memory holds after training are read back one by one
    into buffers that are then freed (at 303M, 170 MiB of them were resident at teardown's end):
    their reads start from freed memory given back, and each is checked against the steps' limit."""
    strategy = TieredStrategy(
        policy={"placement": "nvme", "activations": "keep"}, gpu_memory="24MiB", host_memory="56MiB",
        nvme_path=str(tmp_path / "nvme"), nvme_memory="1GiB",
    )
    limit, model = KeepsTheLimit(), Wide()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path, callbacks=[limit],
    )
    trainer.fit(model, datamodule=tiny_data())  # the weights left unread after it: a read brings a unit back
    back = [b for b in model.blocks if b.weight not in strategy.deferred]
    assert 2 <= len(back) < len(model.blocks)  # some blocks came back, the rest stayed on NVMe
    assert limit.freed.trims - limit.trims > len(back)  # one before the reads, one after each
