"""A re-placement frees the old engine's GPU arena and pinned slab before the new engine
allocates its own: nothing but a full collection freed them (the saved-tensor hooks still named
the old engine, and its reference cycles held the rest), so a GPU held two arenas at once."""

from __future__ import annotations

import gc
import weakref

import lightning as L

from offload_strategy import TieredStrategy
from offload_strategy.lightning.core import TieredCore
from offload_strategy.planning.placement import GPU, HOST
from tests.ddp_job import kept_peak
from tests.helpers import PARAMETERS_ONLY, train

KEPT_PEAK = kept_peak(2)  # the default model's kept layout's peak in the GPU tier, measured in the first step


class _ReplaceAtSteps(L.Callback):
    """Places the parameters again after steps 2 and 3 (as a dynamic-padding growth does)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        core = trainer.strategy.tiered
        if trainer.global_step in (2, 3):
            core._replace_engine(core.recipe(trainer), gpu_bytes=core.session.in_use.gpu_for_parameters)  # beside the kept layout


def test_a_replacement_frees_the_old_arena_and_slab_before_allocating(tmp_path, monkeypatch):
    """Also: every engine copies on the run's two copy streams (tests/test_copy_streams.py), here
    the emulated device's two copy threads, not two new ones per engine. Four engines: the first
    step's (everything fits the whole tier, not beside the kept layout it measures: the parameters
    stream through their least share meanwhile), the one placed beside the layout after it, and
    one after each of steps 2 and 3."""
    freed: list[list[bool]] = []  # per engine built: [arena freed, slab freed, engine gone]
    engines: list[weakref.ref] = []
    seen_at_build: list[list[list[bool]]] = []
    copy_threads: list[tuple] = []  # per engine built: its device's copy threads and streams
    build = TieredCore._build_engine

    def watched(self, *args, **kwargs):
        seen_at_build.append([list(f) for f in freed])
        engine = build(self, *args, **kwargs)
        if engine is not None:
            copy_threads.append((*(link.thread for link in engine.device._links.values()), engine.device.streams))
            flags = [False, False, False]
            weakref.finalize(engine.memory.arena.untyped_storage(), flags.__setitem__, 0, True)
            weakref.finalize(engine.memory.slab.tensor.untyped_storage(), flags.__setitem__, 1, True)
            weakref.finalize(engine, flags.__setitem__, 2, True)
            freed.append(flags)
            engines.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(TieredCore, "_build_engine", watched)
    strategy = TieredStrategy(gpu_memory=80 * 1024 + KEPT_PEAK, host_memory="1GiB", policy=PARAMETERS_ONLY)
    enabled = gc.isenabled()
    gc.disable()  # only what the re-placement itself frees counts
    try:
        train(strategy, tmp_path, epochs=1, max_steps=5, extra_callbacks=(_ReplaceAtSteps(),))
    finally:
        if enabled:
            gc.enable()
    assert len(seen_at_build) == 4 and len(freed) == 4
    # at each re-placement, every earlier engine's arena and slab are gone already
    for built, seen in enumerate(seen_at_build):
        assert seen == [[True, True, True]] * built, built
    assert len(copy_threads) == 4 and all(threads == copy_threads[0] for threads in copy_threads[1:])
    streams = copy_threads[0][-1]
    assert streams.closed and not any(t.is_alive() for t in copy_threads[0][:-1])  # the run's teardown closed them


def test_persistent_units_keep_their_gpu_tier_memory_when_the_engine_closes(tmp_path):
    """After ``fit`` (and at a re-placement) the persistent units' parameters keep the memory they
    had in the GPU tier, each over a storage of its own bytes, and the streaming buffers are
    freed: before, every persistent unit was first cloned beside the whole GPU tier (on a GPU, on
    the GPU), one full extra copy of the persistent units at once."""
    where: dict[int, int] = {}  # id(parameter) -> its address in the GPU tier during training
    arena_freed: list[bool] = []

    class Watch(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            engine = trainer.strategy.tiered.engine
            for s in engine.states:
                if s.home == GPU:
                    where.update((id(p), p.data_ptr()) for p in s.unit.params)
            weakref.finalize(engine.memory.arena.untyped_storage(), arena_freed.append, True)

    strategy = TieredStrategy(gpu_memory=200 * 1024 + KEPT_PEAK, host_memory="1GiB", policy=PARAMETERS_ONLY)  # some units persistent
    _, _, trainer = train(strategy, tmp_path, epochs=1, max_steps=2, extra_callbacks=(Watch(),))
    gc.collect()
    persistent = [p for p in trainer.lightning_module.parameters() if id(p) in where]
    assert persistent and len(persistent) < len(list(trainer.lightning_module.parameters()))
    for p in persistent:
        assert p.data_ptr() == where[id(p)]  # moved, not copied
        assert p.untyped_storage().nbytes() == p.nbytes  # a checkpoint of it writes its own bytes only
    assert arena_freed == [True]


def test_a_released_part_of_the_slab_leaves_the_resident_set_and_nothing_else_changes():
    from offload_strategy.hardware.resident import proc_status
    from offload_strategy.memory.slab import PAGE_BYTES, HostSlab

    slab = HostSlab(64 * 2**20 + 3 * PAGE_BYTES, pin=False)
    slab.tensor.fill_(7)
    before = proc_status("RssAnon")
    view = slab.tensor[PAGE_BYTES // 2 : PAGE_BYTES // 2 + 64 * 2**20 + PAGE_BYTES]  # whole pages inside: 64 MiB
    assert slab.release(view) == 64 * 2**20
    assert before - proc_status("RssAnon") >= 48 * 2**20
    assert int(slab.tensor[PAGE_BYTES : PAGE_BYTES + 64 * 2**20].sum()) == 0
    assert bool((slab.tensor[: PAGE_BYTES] == 7).all()) and bool((slab.tensor[PAGE_BYTES + 64 * 2**20 :] == 7).all())
    slab.close()


def test_host_homes_leave_the_slab_unit_by_unit_when_the_engine_closes(tmp_path, monkeypatch):
    """Each host unit's home is copied out and its pages given back before the next unit's: the
    slab and all the copies were in memory at once before."""
    from offload_strategy.memory.slab import PAGE_BYTES, HostSlab

    released: list[int] = []
    release = HostSlab.release
    monkeypatch.setattr(HostSlab, "release", lambda slab, view: released.append(release(slab, view)) or released[-1])
    homes: list[int] = []
    seen: weakref.WeakSet = weakref.WeakSet()  # the engines whose homes are counted (the first step's, then the one placed after it)

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # (an engine placed again between steps is built in the step)
            engine = trainer.strategy.tiered.engine
            if engine is not None and engine not in seen:
                seen.add(engine)
                # each home starts on a page: its whole pages go
                homes.extend(s.unit.nbytes // PAGE_BYTES * PAGE_BYTES for s in engine.states if s.home == HOST)

    strategy = TieredStrategy(gpu_memory=80 * 1024 + KEPT_PEAK, host_memory="1GiB", policy=PARAMETERS_ONLY)
    train(strategy, tmp_path, epochs=1, max_steps=2, extra_callbacks=(Watch(),))
    assert len(seen) == 0 and len(homes) > 10 and sum(homes) > 0  # both engines closed and gone
    assert sorted(released) == sorted(homes)
