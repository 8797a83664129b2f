"""The planning session: one phase for the run, a plan out between steps, and the core's engine
running the plan it returned."""

from __future__ import annotations

import lightning as L

from offload_strategy import TieredStrategy
from offload_strategy.session.plans import TIMED_STEPS, WARM_UP_STEPS, PlanSession, SessionPhase
from tests.helpers import train
from tests.test_offload import GPT2_4L


class _Phases(L.Callback):
    """The session's phase as each training batch starts (after the plan between steps)."""

    def __init__(self) -> None:
        self.seen: list[SessionPhase] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen.append(trainer.strategy.tiered.session.phase)


def test_the_default_policy_profiles_then_searches_and_lays_out_and_the_engine_runs_the_plan_returned(tmp_path, monkeypatch):
    strategy = TieredStrategy(gpu_memory="675KiB")
    returned: list[tuple[int, object, dict, dict]] = []
    after_step = PlanSession.after_step

    def watched(session, rules):
        plan = after_step(session, rules)
        if plan is not None:
            engine = strategy.engine
            returned.append((session.steps_done, plan, dict(plan.placement.home), dict(engine.placement.home) if engine else {}))
        return plan

    monkeypatch.setattr(PlanSession, "after_step", watched)
    phases = _Phases()
    train(strategy, tmp_path, epochs=1, max_steps=WARM_UP_STEPS + TIMED_STEPS + 2, config=GPT2_4L, extra_callbacks=(phases,))
    warm = WARM_UP_STEPS + TIMED_STEPS
    # the first steps run the profiling placement; the plan comes after the last timed step
    assert phases.seen[:warm] == [SessionPhase.PROFILING] * warm
    assert phases.seen[warm:] == [SessionPhase.LAID_OUT] * (len(phases.seen) - warm)
    assert [steps for steps, *_ in returned] == [warm]
    _, plan, homes, engine_homes = returned[0]
    session = strategy.tiered.session
    assert not plan.profiling and engine_homes == homes  # the core's engine runs the plan returned
    layout = strategy.activation_plan
    assert layout is not None and plan.layout is not None
    # the parameters' share and the activations' peak split the GPU tier
    assert plan.gpu_for_parameters == session.gpu_for_parameters(layout.peak_bytes) == strategy.budgets.gpu - layout.peak_bytes
    assert plan.placement.gpu_bytes <= plan.gpu_for_parameters
    assert plan.prediction is not None and plan.prediction > 0
    lines = session.describe(plan).splitlines()
    assert lines[0].startswith("tiered: placement (") and any(line.strip().startswith("tier ") for line in lines)
