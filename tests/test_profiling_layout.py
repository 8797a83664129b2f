"""The profiling steps' layout keeps the block it measures: kept, its activations are held while
every block after it is recomputed in backward, two blocks' activations at once, where every
layout searched after it holds one. Where that does not fit beside the parameters' smallest share
of the GPU tier and the measured block swapped to host memory does, the profiling steps swap it
(``session/sequence.py::profiling_layout``, ``ActivationPolicies.move_measured_out``): a budget
the searched layout holds is no longer refused by the steps that measure it."""

from __future__ import annotations

import lightning as L
import pytest

from offload_strategy import TieredStrategy
from offload_strategy.config import PolicyConfig, parse_size
from offload_strategy.estimate import simulate as sim
from offload_strategy.estimate.budgets import plan_on_shapes
from offload_strategy.hardware.specs import known_hardware
from offload_strategy.planning.activations import peak_bytes
from offload_strategy.planning.planner import TierBudgets
from offload_strategy.session.plans import TIMED_STEPS, WARM_UP_STEPS
from tests.helpers import assert_same_weights, train
from tests.test_analytic_profile import gpt2
from tests.test_offload import GPT2_4L


class ProfiledSteps(L.Callback):
    """Each step's block policies and the bytes it swapped to host memory."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[str], float]] = []

    def on_train_batch_end(self, trainer, *args):
        metrics = trainer.strategy.metrics()
        self.steps.append(([str(p) for p in trainer.strategy.tiered.activations.policies], metrics.get("activations/swapped_host_bytes", 0.0)))


@pytest.mark.slow
def test_the_profiling_steps_swap_the_measured_block_where_kept_it_would_not_fit_and_train_as_plain_lightning(tmp_path):
    """The 4-layer GPT-2 in a 600 KiB GPU tier: the profiling layout (the first block kept, the
    others recomputed, their inputs from host memory or not) peaked above what the parameters'
    smallest share leaves, and the run was refused in its first step (the search's layout, every
    block swapped, fits). The measured block now goes to host memory
    after its forward in the profiled steps, and training is plain training's to the bit."""
    steps = WARM_UP_STEPS + TIMED_STEPS + 1  # the profiled steps and one under the plan
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, config=GPT2_4L, max_steps=steps)
    seen = ProfiledSteps()
    losses, weights, trainer = train(TieredStrategy(gpu_memory="600KiB"), tmp_path / "tiered", epochs=1, config=GPT2_4L, extra_callbacks=(seen,),
                                     max_steps=steps)
    profiled = seen.steps[: WARM_UP_STEPS + TIMED_STEPS]
    assert all(policies[0] == "swap_host" for policies, _ in profiled), seen.steps
    assert all(swapped > 0 for _, swapped in profiled), seen.steps  # the measured block's activations, moved out after its forward
    assert trainer.strategy.activation_plan is not None and len(losses) == steps
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_the_estimate_accepts_the_gpu_tier_the_searched_layout_fits():
    """The tiny GPT-2 at batch 4 x 64 under ``bf16-true`` (each block saves 4.07 MB, its input
    131 KB): kept first, the profiling layout peaks at 8.40 MB at the last block's recompute,
    over an 8 MiB GPU tier whose search lays the blocks out in 5.78 MB (C C C K), and the
    estimate's sequence, as the run's, refused 8 MiB. With the measured block swapped the
    profiling layout peaks at one block's activations and the inputs, and 8 MiB is planned."""
    rtx4090 = known_hardware("rtx4090")
    model = gpt2(rtx4090, 4, 64, loss_chunk_tokens="auto")
    kept = ["keep"] + ["checkpoint"] * 3
    assert peak_bytes(model.blocks, kept) > parse_size("8MiB") > peak_bytes(model.blocks, ["swap_host"] + ["checkpoint"] * 3)
    planned = plan_on_shapes(model, PolicyConfig.coerce("auto"), TierBudgets(parse_size("8MiB"), parse_size("1GiB"), 0), sim.machine_of(rtx4090, 0))
    assert planned.layout is not None and planned.layout.peak_bytes <= parse_size("8MiB") - planned.gpu_for_parameters
