"""The profiled steps where every parameter, with its gradients and optimizer states, fits in the
GPU tier. The first placement then offloaded nothing, so no engine ran and the profiled steps ran
with every parameter in the GPU tier: their activations, not yet measured, came beside all of
them, where under an engine the parameters stream through the fewest buffers while the steps
measure (``session/sequence.py::profiling_share``). The 4-layer GPT-2 (939 KiB of parameters,
gradients and AdamW states) in a 1 MiB tier held 1.24 MiB in each profiled step. The profiled
steps now stream the parameters there too, and the plan after them places them as the search
and the layout decide (everything in the GPU tier again where that fits beside the layout). So
too the first step of a layout the user fixes, which measures it; where a unit has nothing to
train, or host memory cannot hold the streamed units, the first steps keep every parameter in
the tier as before."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest

from offload_strategy import TieredStrategy
from offload_strategy.config import parse_size
from offload_strategy.estimate.live_bytes import LiveBytes
from offload_strategy.session.plans import TIMED_STEPS, WARM_UP_STEPS
from tests.helpers import assert_same_weights, train
from tests.test_activation_budget import Stack, fit
from tests.test_fixed_layout_budget import Backwards
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


# -- a layout the user fixes ----------------------------------------------------------------------------
# Its first training forward measures it (``ActivationPolicies.observe``) while the parameters run
# in their least share (``PlanSession._profiling_placement``), and after it they are placed in what
# its peak leaves (``PlanSession._place_beside_fixed_layout``). Where every parameter fitted the
# tier, no engine ran that step: the layout came beside all of them.

# the Stack's parameters, gradients and AdamW states: 4,236,364 bytes
ALL_FIT = 4608 * 1024  # ... beside which the 8 kept blocks at batch 100 (1.20 MiB at their peak) do not
WITH_ROOM = 6656 * 1024  # ... beside which they fit at batch 8 (98 KiB)


class Steps(L.Callback):
    """Each step: the parameters' share of the GPU tier, a fixed layout's measured peak (None
    under a planner's layout), and whether an engine ran it (none: every parameter in the tier)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, Optional[int], bool]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        tiered = trainer.strategy.tiered
        fixed = tiered.activations.fixed
        self.steps.append((tiered.activations.gpu_parameter_bytes(), fixed.peak_bytes if fixed is not None else None, tiered.engine is not None))


def _all_bytes(model: L.LightningModule) -> int:
    """Parameters, gradients and AdamW's two states, in fp32."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def _fixed(tmp_path: Path, layout: Any, gpu_memory: int, batch: int, host_memory: str = "256MiB", make: type = Stack) -> list[tuple[int, Any, bool]]:
    """The Stack under ``layout`` and the default placement search, four steps, beside plain
    Lightning's run: the same losses and weights. Each step's ``Steps``."""
    plain = fit("auto", tmp_path / "plain", batch=batch, steps=4, make=make)
    steps = Steps()
    strategy = TieredStrategy(policy={"activations": layout}, gpu_memory=gpu_memory, host_memory=host_memory)
    tiered = fit(strategy, tmp_path / "tiered", batch=batch, steps=4, callbacks=(steps,), make=make)
    assert tiered.losses == plain.losses
    assert_same_weights(plain.state_dict(), tiered.state_dict())
    assert _all_bytes(tiered) <= gpu_memory, "every parameter with its gradients and states fits the tier at set-up"
    assert len(steps.steps) == 4
    return steps.steps


def test_a_fixed_layout_s_first_step_streams_parameters_that_all_fit_and_holds_to_the_gpu_tier(tmp_path: Path, caplog) -> None:
    """Eight kept blocks at batch 100 beside every parameter: the first step held 4.04 MiB of
    parameters, gradients and states and the layout's 1.20 MiB in a 4.50 MiB tier. It now runs
    the parameters in their least share, and after it they are placed in what the layout leaves."""
    (first, peak, _), *later = steps = _fixed(tmp_path, "keep", ALL_FIT, batch=100)
    assert peak is not None and first + peak <= ALL_FIT, steps  # 4,236,364 + 1,255,200 before
    assert all(first < parameters and parameters + peak <= ALL_FIT for parameters, _, _ in later), steps
    assert all(engine for _, _, engine in steps), steps
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered: the activation layout policy.activations fixes")]
    assert len(said) == 1 and "placed again in the" in said[0], said


@pytest.mark.parametrize("layout", ["keep", ["checkpoint", "keep", "swap_host", "keep", "checkpoint", "keep", "keep", "keep"]])
def test_a_fixed_layout_that_fits_beside_every_parameter_has_them_all_back_without_an_engine(tmp_path: Path, layout: Any) -> None:
    """Measured in the least share, the layout (98 KiB at batch 8 kept) leaves room for every
    parameter: they are all placed back in the GPU tier, with no engine, after the first step."""
    (first, peak, _), *later = steps = _fixed(tmp_path, layout, WITH_ROOM, batch=8)
    assert peak is not None and first + peak <= WITH_ROOM and first < WITH_ROOM // 4, steps
    assert [engine for _, _, engine in steps] == [True, False, False, False], steps
    assert all(parameters + peak <= WITH_ROOM and parameters >= _all_bytes(Stack()) for parameters, _, _ in later), steps


class FrozenFirstBlock(Stack):
    """A unit with nothing to train: the fewest buffers might not hold what the model keeps of it
    (``sequence.profiling_share``), so the first step keeps every unit where it fits."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[0].requires_grad_(False)


@pytest.mark.parametrize(("layout", "make", "host_memory"), [
    ("keep", FrozenFirstBlock, "256MiB"),
    ("auto", FrozenFirstBlock, "256MiB"),
    ("keep", Stack, "64KiB"),  # host memory cannot hold the streamed units: no least share below all of them
    ("auto", Stack, "64KiB"),
])
def test_the_first_steps_keep_every_parameter_where_none_can_stream(tmp_path: Path, layout: str, make: type, host_memory: str) -> None:
    """No engine, as before: the layout measured beside every parameter (where it did not fit
    beside them, it is refused before any update, as the least share is every parameter)."""
    steps = _fixed(tmp_path, layout, WITH_ROOM, batch=8, host_memory=host_memory, make=make)
    assert not any(engine for _, _, engine in steps), steps


def test_a_fixed_layout_that_cannot_fit_beside_the_least_share_is_refused_before_any_update(tmp_path: Path) -> None:
    """Eight kept blocks at batch 400 (4.8 MiB) beside even the fewest buffers pass 4.50 MiB:
    refused before backward with the numbers, the forward that measured them run beside the
    parameters' least share (before, beside all 4.04 MiB of them)."""
    backwards = Backwards()
    strategy = TieredStrategy(policy={"activations": "keep"}, gpu_memory=ALL_FIT, host_memory="256MiB")
    with pytest.raises(ValueError, match=r"the activation layout policy.activations fixes \(8 keep, 8 blocks\) holds") as refused:
        fit(strategy, tmp_path, batch=400, steps=2, callbacks=(backwards,))
    assert backwards.count == 0, "a backward ran before the refusal"
    message = str(refused.value)
    number, unit = re.search(r"as placed they take ([\d.]+) (KiB|MiB)", message).groups()
    placed = float(number) * {"KiB": 1024, "MiB": 2**20}[unit]
    assert placed < _all_bytes(Stack()) / 4, message
    assert "gpu_memory to at least" in message, message
