"""The running strategy and the what-if simulator share one planning sequence: the profile a run
measured, planned again without an engine (``sequence.plan_from_profile``, what the simulator and
the estimate run on the shapes' profile), gives the plan the run ended with."""

from __future__ import annotations

import pytest

from offload_strategy import TieredStrategy
from offload_strategy.planning.planner import Planner
from offload_strategy.session import sequence
from offload_strategy.session.plans import TIMED_STEPS, WARM_UP_STEPS, PlanSession
from tests.helpers import train
from tests.test_offload import GPT2_4L


def _run(tmp_path, monkeypatch, gpu_memory: str, policy: str = "auto"):
    """A small CPU fit (the default policy unless told); the plans the session placed, in order."""
    strategy = TieredStrategy(gpu_memory=gpu_memory, policy=policy)
    placed = []
    plan_placement = PlanSession.plan_placement

    def watched(session, rules, gpu_bytes=None, block_policies=None):
        plan = plan_placement(session, rules, gpu_bytes, block_policies)
        placed.append(plan)
        return plan

    monkeypatch.setattr(PlanSession, "plan_placement", watched)
    train(strategy, tmp_path, epochs=1, max_steps=WARM_UP_STEPS + TIMED_STEPS + 1, config=GPT2_4L)
    return strategy, placed


def _replayed(strategy, profiled_layout):
    """The sequence on the profile the run measured, with a planner of its own (nothing the run's planner learnt)."""
    session = strategy.tiered.session
    run_planner = session.planner
    assert session.profile is not None and run_planner is not None and run_planner.model is not None
    planner = Planner(run_planner.policy, run_planner.budgets, run_planner.has_nvme)
    return sequence.plan_from_profile(planner, run_planner.model, session.profile, profiled_layout, str(run_planner.policy.activations),
                                      session._machine())


def _homes(placement) -> tuple[int, int, int]:
    return tuple(sum(home == tier for home in placement.home.values()) for tier in ("gpu", "host", "nvme"))


@pytest.mark.parametrize(
    ("gpu_memory", "policy", "resident"),
    [
        ("675KiB", "auto", 0),  # the search streams every unit
        ("800KiB", "auto", 6),  # ... keeps some resident
        ("800KiB", "teraio", 9),  # no search: the layout does not fit beside the first-use placement, the parameters are placed again
    ],
)
def test_the_profile_a_run_measured_planned_without_an_engine_gives_the_plan_the_run_ended_with(tmp_path, monkeypatch, gpu_memory, policy, resident):
    strategy, placed = _run(tmp_path, monkeypatch, gpu_memory, policy)
    first, last = placed[0], strategy.tiered.session.in_use
    assert last is not None and not last.profiling
    assert first.profiling == (policy == "auto")
    replay = _replayed(strategy, first.layout)
    # the placement the profiled steps ran, and the one the run ended with: every home and every buffer
    assert replay.profiled.home == first.placement.home and replay.profiled.device_slots == first.placement.device_slots
    assert replay.placement.home == last.placement.home
    assert replay.placement.device_slots == last.placement.device_slots
    assert replay.placement.host_copies == last.placement.host_copies
    assert _homes(last.placement)[0] == resident
    # the layout and the parameters' share of the GPU tier
    assert replay.layout is not None and strategy.activation_plan is not None
    assert replay.layout.layout == strategy.activation_plan.layout and last.layout == replay.layout.layout
    assert replay.layout.peak_bytes == strategy.activation_plan.peak_bytes
    assert replay.gpu_for_parameters == last.gpu_for_parameters
    # the run placed twice (the profiled steps', then the plan's): the replay followed the same decisions
    assert len(placed) == 2 and placed[-1].placement == last.placement and first.placement != last.placement
