"""During the steps the process stays within ``host_memory``, the emulated GPU tier's budget and
``RUNTIME_HOST_ALLOWANCE``: the freed memory glibc keeps of the tensors each step makes and frees
is given back once the resident set nears that bound (``hardware/probe.py::FreedHostMemory``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offload_strategy import RUNTIME_HOST_ALLOWANCE
from offload_strategy.hardware import FreedHostMemory, resident_anonymous

ROOT = Path(__file__).resolve().parents[1]


def test_freed_memory_is_given_back_only_above_the_limit():
    """Under the limit a check does nothing; above it, one trim, and none again until the
    resident set has grown past what the trim left plus the slack."""
    never = FreedHostMemory(limit=None)
    never.check()
    assert never.trims == 0
    high = FreedHostMemory(limit=resident_anonymous() + 2**40)
    high.check()
    assert high.trims == 0
    low = FreedHostMemory(limit=1)
    low.check()
    assert low.trims == 1
    low.check()  # what is live stands above the limit: trimming again would only cost
    assert low.trims == 1


@pytest.mark.slow
@pytest.mark.nvme
def test_the_check_reads_the_resident_set_through_one_descriptor_it_closes():
    import gc
    import os

    def statm_descriptors() -> set:
        # other threads (xdist, the garbage collector) open and close files meanwhile: count ours only
        found = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").endswith("/statm"):
                    found.add(name)
            except OSError:
                pass
        return found

    gc.collect()  # engines of earlier tests in this process close theirs now, not while this one counts
    before = statm_descriptors()
    freed = FreedHostMemory(limit=2**50)
    for _ in range(100):  # a check per gradient, per module: the file is opened once
        freed.check()
    mine = statm_descriptors() - before
    assert len(mine) == 1
    assert abs(freed._resident() - resident_anonymous()) < 16 * 2**20
    del freed
    gc.collect()
    assert not mine & statm_descriptors()  # others' may have closed meanwhile: ours is closed


@pytest.mark.no_race_check  # measures the resident set
def test_the_resident_set_during_the_steps_stays_within_the_bound(tmp_path):
    """A 101M-parameter GPT-2 (8 x 1024; training state 1.5 GiB, 3.4x the bound) at home on NVMe
    with 200 MiB of host memory and a 64 MiB emulated GPU tier: before, the steps grew the process
    by 1.2-1.4x the bound (freed blocks kept in the update worker's and the main thread's heaps).
    Its blocks swap to NVMe: kept, their 54 MiB of activations do not fit the tier, and are refused."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests/host_bound_job.py"), str(tmp_path), "--layers", "8", "--width", "1024",
         "--host-memory", "200MiB", "--gpu-memory", "64MiB", "--steps", "3", "--activations", "swap_nvme"],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    bound = report["host"] + report["gpu"] + RUNTIME_HOST_ALLOWANCE
    assert 16 * report["parameters"] > 3 * bound
    growth = report["peaks"]["steps"] - report["before"]
    assert growth <= bound, f"the steps grew the process by {growth / 2**20:.0f} MiB, {growth / bound:.2f}x the bound {bound / 2**20:.0f} MiB"
