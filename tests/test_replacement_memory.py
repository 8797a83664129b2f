"""A re-placement frees the old engine's GPU arena and pinned slab before the new engine
allocates its own: nothing but a full collection freed them (the saved-tensor hooks still named
the old engine, and its reference cycles held the rest), so a GPU held two arenas at once."""

from __future__ import annotations

import gc
import weakref

import lightning as L

from offload_strategy import TieredStrategy
from offload_strategy.lightning.core import TieredCore
from tests.helpers import PARAMETERS_ONLY, train


class _ReplaceAtSteps(L.Callback):
    """Places the parameters again after steps 2 and 3 (as a dynamic-padding growth does)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        core = trainer.strategy.tiered
        if trainer.global_step in (2, 3):
            core._replace_engine(core.recipe(trainer), gpu_bytes=core.context.budgets.gpu)


def test_a_replacement_frees_the_old_arena_and_slab_before_allocating(tmp_path, monkeypatch):
    freed: list[list[bool]] = []  # per engine built: [arena freed, slab freed, engine gone]
    engines: list[weakref.ref] = []
    seen_at_build: list[list[list[bool]]] = []
    build = TieredCore._build_engine

    def watched(self, *args, **kwargs):
        seen_at_build.append([list(f) for f in freed])
        engine = build(self, *args, **kwargs)
        if engine is not None:
            flags = [False, False, False]
            weakref.finalize(engine.memory.arena.untyped_storage(), flags.__setitem__, 0, True)
            weakref.finalize(engine.memory.slab.tensor.untyped_storage(), flags.__setitem__, 1, True)
            weakref.finalize(engine, flags.__setitem__, 2, True)
            freed.append(flags)
            engines.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(TieredCore, "_build_engine", watched)
    strategy = TieredStrategy(gpu_memory="80KiB", host_memory="1GiB", policy=PARAMETERS_ONLY)
    enabled = gc.isenabled()
    gc.disable()  # only what the re-placement itself frees counts
    try:
        train(strategy, tmp_path, epochs=1, max_steps=5, extra_callbacks=(_ReplaceAtSteps(),))
    finally:
        if enabled:
            gc.enable()
    assert len(seen_at_build) == 3 and len(freed) == 3
    # at each re-placement, every earlier engine's arena and slab are gone already
    assert seen_at_build[1] == [[True, True, True]]
    assert seen_at_build[2] == [[True, True, True], [True, True, True]]
