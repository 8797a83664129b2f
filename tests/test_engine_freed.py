"""Placing the units again between steps frees the engine it replaces before it returns: its
tiers (the pinned slab, the emulated GPU tier) are no part of the steps after it. The engine's
parts refer to each other, so only a collection frees it, and placing again makes one
(``TieredCore._free_closed_engine``); a local that still named the engine in the frame that asked
for the placement kept it through that collection, and then until the interpreter's next full
collection: at 101M parameters the 4th step and teardown held the profiling engine's 210 MiB
slab and 65 MiB GPU tier beside the new engine's (1.26x and 1.20x of the bound,
docs/benchmarks.md, "The steps and teardown after placing again")."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import pytest

from offload_strategy import TieredStrategy
from offload_strategy.lightning.core import TieredCore
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


@pytest.mark.parametrize("make, callbacks", [(UnfreezeInStep, ()), (Net, (SwitchToSgd(),))], ids=["unfrozen", "optimizers replaced"])
def test_the_engine_replaced_for_new_parameters_or_optimizers_is_freed(tmp_path, monkeypatch, make, callbacks):
    alive = engines_left_after_placing_again(monkeypatch, lambda: fit(tiered("host", tmp_path), tmp_path / "run", make, steps=4, callbacks=callbacks))
    assert alive == [False]
