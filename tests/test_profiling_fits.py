"""The profiled steps where every parameter, with its gradients and optimizer states, fits in the
GPU tier. The first placement then offloaded nothing, so no engine ran and the profiled steps ran
with every parameter in the GPU tier: their activations, not yet measured, came beside all of
them, where under an engine the parameters stream through the fewest buffers while the steps
measure (``session/sequence.py::profiling_share``). The 4-layer GPT-2 (939 KiB of parameters,
gradients and AdamW states) in a 1 MiB tier held 1.24 MiB in each profiled step. The profiled
steps now stream the parameters there too, and the plan after them places them as the search
and the layout decide (everything in the GPU tier again where that fits beside the layout)."""

from __future__ import annotations

import lightning as L

from offload_strategy import TieredStrategy
from offload_strategy.config import parse_size
from offload_strategy.estimate.live_bytes import LiveBytes
from offload_strategy.session.plans import TIMED_STEPS, WARM_UP_STEPS
from tests.helpers import assert_same_weights, train
from tests.test_offload import GPT2_4L
from tests.test_one_planning_sequence import _replayed, _run

PROFILED = WARM_UP_STEPS + TIMED_STEPS
BUDGET = "1MiB"


class HeldInTheGpuTier(L.Callback):
    """Each step's parameters' share of the GPU tier as placed, the activations its forward kept
    there (the count ``tools/gpu_memory.py`` and ``tools/tier_use.py`` give), and the most bytes
    the step's operations made and still held at once (``LiveBytes``: on this machine the
    emulated tier's stand-in for CUDA's allocated-bytes peak; the engine's GPU arena, made
    before the step, is in the parameters' share)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []
        self._live = LiveBytes()

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        self._live = LiveBytes()
        self._live.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        self._live.__exit__(None, None, None)
        saved = int(trainer.strategy.metrics()["activations/saved_bytes"])
        self.steps.append((trainer.strategy.tiered.activations.gpu_parameter_bytes(), saved, self._live.peak))


def test_the_profiled_steps_stream_the_parameters_that_all_fit_and_hold_to_the_gpu_tier(tmp_path):
    budget = parse_size(BUDGET)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, config=GPT2_4L, max_steps=PROFILED + 1)
    held = HeldInTheGpuTier()
    losses, weights, trainer = train(TieredStrategy(gpu_memory=BUDGET), tmp_path / "tiered", epochs=1, config=GPT2_4L,
                                     extra_callbacks=(held,), max_steps=PROFILED + 1)
    # every parameter with its gradient and two AdamW states fits: the first placement offloaded nothing
    assert 4 * sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters()) < budget
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert trainer.strategy.activation_plan is not None and len(held.steps) == PROFILED + 1
    for parameters, saved, live in held.steps[:PROFILED]:
        assert parameters + saved <= budget, held.steps  # 961,536 + 339,076 before
        assert parameters + live <= budget, held.steps


def test_the_estimate_s_sequence_replays_the_profiling_placement_where_everything_fits(tmp_path, monkeypatch):
    """``plan_from_profile`` (what ``estimate()`` runs) on the profile the run measured: the same
    profiling placement, and the plan the run ended with; it placed nothing for the profiled steps
    before (everything fitted) and searched only where the first placement offloaded."""
    strategy, placed = _run(tmp_path, monkeypatch, BUDGET)
    first, last = placed[0], strategy.tiered.session.in_use
    assert first is not None and first.profiling and first.placement.offloaded
    replay = _replayed(strategy, first.layout)
    assert replay.profiled.home == first.placement.home and replay.profiled.device_slots == first.placement.device_slots
    assert replay.search is not None
    assert last is not None and replay.placement.home == last.placement.home and replay.placement.device_slots == last.placement.device_slots
    assert replay.layout is not None and strategy.activation_plan is not None and replay.layout.layout == strategy.activation_plan.layout
    assert replay.gpu_for_parameters == last.gpu_for_parameters
