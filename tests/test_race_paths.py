"""The suite runs every test under the emulated device's race check (tests/conftest.py), each with
its own seed, and what it found in the runtime's paths."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from offload_strategy import TieredStrategy
from offload_strategy.hardware.device import RACE_CHECK_ENV, EmulatedDevice, RaceCheck
from offload_strategy.runtime.params.scheduler import PrefetchTable
from tests import conftest
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_offload import beside_kept, gpt2_4l, param_bytes
from tests.test_race_check import Checked


def test_each_test_and_the_processes_it_starts_run_under_its_own_seed(request):
    if request.node.stash[conftest.RACE_CHECK_OUTSIDE] is not None:
        pytest.skip(f"{RACE_CHECK_ENV} is set outside the suite, for every test")
    assert conftest.RACE_CHECK_ENV == RACE_CHECK_ENV
    seed = str(conftest.race_check_seed(request.node.nodeid))
    assert seed != "0" and seed == str(conftest.race_check_seed(request.node.nodeid))
    assert os.environ[RACE_CHECK_ENV] == seed
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{RACE_CHECK_ENV}'])"], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == seed


@pytest.mark.no_race_check
def test_a_test_that_measures_time_or_memory_runs_without_it():
    assert RACE_CHECK_ENV not in os.environ


def test_a_prefetch_stays_within_its_micro_batch():
    """The profiled step of two micro-batches records both; each later micro-batch starts at the
    top, and at the end of its part nothing is expected: the next forward is the next step's,
    after the updates."""
    table = PrefetchTable()
    table.start_recording()
    for unit in (0, 1, 2, 1, 0):  # forward, then backward
        table.record(unit)
    table.restart()  # the second micro-batch
    for unit in (0, 1, 2, 1, 0):
        table.record(unit)
    table.freeze()
    table.restart()
    assert list(table.upcoming(8)) == [0, 1, 2, 1, 0]
    for unit in (0, 1, 2, 1):
        table.record(unit)
    assert list(table.upcoming(8)) == [0]
    table.record(0)
    assert list(table.upcoming(8)) == []
    assert table.next_use(1) == 0  # eviction still sees the whole step (the next part, a repeated 0 recorded once)


def test_accumulated_host_units_are_not_fetched_for_a_forward_after_their_update(tmp_path, monkeypatch):
    """Gradient accumulation, every unit streamed from host memory, updated at home during the
    last micro-batch's backward. The prefetch table of the profiled step holds both micro-batches,
    so the last backward's prefetches reached into the next micro-batch's forward: the copy out
    of a unit's home was queued while the update wrote the home (on CUDA: the copy still queued;
    here: the race check raised at the update). Training is plain Lightning's, bit for bit."""
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2_4l, accumulate_grad_batches=2)
    monkeypatch.setenv(RACE_CHECK_ENV, "5")
    total, checked = param_bytes(gpt2_4l), Checked()
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory="1GiB")
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, accumulate_grad_batches=2,
                                     extra_callbacks=(checked,))
    assert checked.race_checked and trainer.strategy.metrics()["units/host"] > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_a_late_copy_lands_at_once_when_something_waits_for_it():
    """The suite pays for the late landings only where nothing waits: a wait for a copy, or for a
    later copy on its link, lands it at once, and so does closing the device."""
    with EmulatedDevice(1 << 20, race_check=RaceCheck(max_delay_s=60.0, seed=2)) as device:  # both delays drawn: over 28 s
        source, first, second = torch.arange(64, dtype=torch.uint8), device.allocate(64).zero_(), device.allocate(64).zero_()
        start = time.perf_counter()
        events = [device.copy_to_device(first, source), device.copy_to_device(second, source)]
        time.sleep(0.05)
        assert not any(e.done() for e in events) and first.sum() == 0  # late
        device.host_wait(events[1])
        assert all(e.done() for e in events) and torch.equal(first, source) and torch.equal(second, source)
        device.copy_to_host(torch.empty(64, dtype=torch.uint8), first)  # left for close() to land
    assert time.perf_counter() - start < 10.0
