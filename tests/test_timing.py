"""The compute times the engine measures every training step, and what the step model makes of them."""

from __future__ import annotations

import time

import pytest
from lightning.pytorch.callbacks import Callback

from offload_strategy import TieredStrategy
from offload_strategy.planning.cost_model import GPU, costs_from_timing, outside_units
from offload_strategy.planning.profile import StepProfile, mean_timing
from tests.helpers import PARAMETERS_ONLY, train


def _timing(**kwargs) -> StepProfile:
    return StepProfile(unit_names=["a", "b", "c"], unit_bytes=[100, 200, 300], **kwargs)


def test_mean_timing_averages_unit_by_unit():
    one = _timing(order=[0, 1, 2], forward_seconds={0: 1.0, 1: 2.0}, backward_seconds={1: 4.0}, update_seconds={1: 1.0}, outside_forward_seconds=1.0)
    two = _timing(order=[0, 1, 2], forward_seconds={0: 3.0, 2: 2.0}, backward_seconds={1: 2.0}, update_seconds={1: 3.0}, outside_forward_seconds=3.0)
    mean = mean_timing([one, two])
    assert mean.forward_seconds == {0: 2.0, 1: 1.0, 2: 1.0}  # a unit a step did not time counts 0 there
    assert mean.backward_seconds == {1: 3.0} and mean.update_seconds == {1: 2.0}
    assert mean.outside_forward_seconds == 2.0 and mean.order == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one"):
        mean_timing([])


def test_costs_from_a_timed_step():
    # unit 1 was offloaded (a backward interval of its own, an update of 200 bytes in 2 s);
    # units 0 and 2 were in the GPU tier, their backward inside unit 1's interval
    timing = _timing(forward_seconds={0: 1.0, 1: 2.0, 2: 3.0}, backward_seconds={1: 9.0}, update_seconds={1: 2.0},
                     outside_forward_seconds=0.5, outside_backward_seconds=0.25)
    costs = costs_from_timing(timing, trainable=[True, True, False])
    assert [costs[i].backward_seconds for i in range(3)] == [0.0, 9.0, 0.0]  # the measured total, once
    assert costs[0].update_seconds == pytest.approx(1.0)  # 100 bytes at the measured 0.01 s per byte
    assert costs[2].update_seconds == 0.0 and costs[2].gradient_bytes == 0  # frozen
    assert costs[1].gradient_bytes == 200
    outside = outside_units(timing)
    assert (outside.nbytes, outside.home, outside.forward_seconds, outside.backward_seconds) == (0, GPU, 0.5, 0.25)
    # no backward interval at all (nothing offloaded): backward taken as twice forward
    untimed = costs_from_timing(_timing(forward_seconds={0: 1.0}), trainable=[True, True, True])
    assert untimed[0].backward_seconds == 2.0 and untimed[1].backward_seconds == 0.0


class _Timings(Callback):
    def __init__(self) -> None:
        self.timings: list[StepProfile] = []
        self.steps: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        if engine is None and trainer.global_step == 1:
            return  # the first step's tier holds the kept layout's room too: offloading starts after it
        self.steps.append(time.perf_counter() - self._start)
        self.timings.append(engine.timer.last_timing)
        self.homes = [s.home for s in engine.states]
        self.trainable = [bool(s.unit.trainable) for s in engine.states]


# the kept layout's peak in the GPU tier at the tiny GPT-2's batch, measured in the first training step
KEPT_PEAK = 676_484


def _timed_run(tmp_path, link_gbps):
    hardware = {"name": "throttled", "gpu": "emulated", "gpu_memory": "1GiB", "gpu_bf16_tflops": None, "gpu_fp16_tflops": None, "h2d_gbps": link_gbps, "d2h_gbps": link_gbps,
                "host_memory": "16GiB", "cpu_cores": 2}
    strategy = TieredStrategy(gpu_memory=80 * 1024 + KEPT_PEAK, host_memory="1GiB", hardware=hardware, policy={**PARAMETERS_ONLY, "throttle": link_gbps is not None})
    probe = _Timings()
    train(strategy, tmp_path, epochs=1, extra_callbacks=(probe,), max_steps=5)
    assert any(home != GPU for home in probe.homes)
    return probe


@pytest.mark.no_race_check  # compares step and compute times
def test_the_engine_times_compute_without_the_waits_for_units(tmp_path):
    # a link slow enough that every step waits ~0.1 s or more for its units
    slow = _timed_run(tmp_path / "slow", 0.0005)
    fast = _timed_run(tmp_path / "fast", None)
    waits = min(slow.steps[1:]) - min(fast.steps[1:])  # from the third step: the first placed again beside the kept layout is the second
    assert waits > 0.1

    def compute(t: StepProfile) -> float:
        return sum(t.forward_seconds.values()) + sum(t.backward_seconds.values()) + t.outside_forward_seconds + t.outside_backward_seconds

    slow_compute = min(compute(t) for t in slow.timings[1:])
    fast_compute = min(compute(t) for t in fast.timings[1:])
    assert slow_compute - fast_compute < 0.3 * waits, (slow_compute, fast_compute, waits)
    timing = slow.timings[-1]
    assert sorted(timing.order) == list(range(len(slow.homes)))  # every unit, persistent ones too, in the order used
    offloaded = {i for i, home in enumerate(slow.homes) if home != GPU}
    assert set(timing.backward_seconds) <= offloaded and timing.backward_seconds
    assert set(timing.update_seconds) == {i for i, t in enumerate(slow.trainable) if t}
    assert timing.outside_forward_seconds > 0 and timing.outside_backward_seconds > 0
