"""Markers skip cleanly where their hardware is absent: ``gpu`` without CUDA, ``nvme`` without
room on the disk that holds the test's temporary directory. Modules with the most ``slow`` tests
run first, so that the suite's workers (``make test`` runs two, ``pytest-xdist``) finish together;
each worker, and every process its tests start, computes on one thread.

Every test runs under the emulated device's race check (``OFFLOAD_STRATEGY_RACE_CHECK``: copies
land late, a host access before the host waited for a copy raises), with a seed of its own made
from its id, so a failure reruns with the same delays; the seed is printed in the failure's
report, and every process the test starts inherits it (a fixture shared between tests runs under
the seed of the first test that makes it). A test marked ``no_race_check`` (it measures time or
memory, which the delays would distort) runs without. A seed in the environment wins
(``OFFLOAD_STRATEGY_RACE_CHECK=0`` turns the check off)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import zlib
from collections import Counter
from typing import Iterator, Optional

import pytest
import torch

# Tests that write large files need this much free space next to the temporary directory.
NVME_TEST_FREE_BYTES = 4 * 1024**3
# offload_strategy.hardware.device.RACE_CHECK_ENV, named here so that collecting the tests imports
# nothing of the package (tests/test_race_paths.py checks the two agree)
RACE_CHECK_ENV = "OFFLOAD_STRATEGY_RACE_CHECK"
RACE_CHECK_SEED = pytest.StashKey[str]()  # the test's setting, for its failure's report
RACE_CHECK_OUTSIDE = pytest.StashKey[Optional[str]]()  # the setting outside the test, restored after it


def pytest_configure(config: pytest.Config) -> None:
    # xdist (3.x) otherwise hands out the largest modules first, by test count: the few long
    # subprocess modules then came last and one worker ran them alone at the end
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker shares the cores with the others
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_MODE", "offline")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    free = shutil.disk_usage(tempfile.gettempdir()).free
    no_room = pytest.mark.skip(reason=f"needs {NVME_TEST_FREE_BYTES >> 30} GiB free for NVMe files, {free >> 30} GiB free")
    slow_tests = Counter(_module(item) for item in items if "slow" in item.keywords)
    tests = Counter(_module(item) for item in items)
    # stable: each module's order kept; among modules with as many slow tests, the larger first
    items.sort(key=lambda item: (-slow_tests[_module(item)], -tests[_module(item)]))
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "nvme" in item.keywords and free < NVME_TEST_FREE_BYTES:
            item.add_marker(no_room)


def race_check_seed(nodeid: str) -> int:
    """The test's seed: the same on every run and machine, never 0 (which turns the check off)."""
    return zlib.crc32(nodeid.encode()) % 1_000_000 + 1


def _race_check_setting(item: pytest.Item, outside: Optional[str]) -> Optional[str]:
    if item.get_closest_marker("no_race_check") is not None:
        return None
    return outside if outside is not None else str(race_check_seed(item.nodeid))


def _set_environment(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# Set around the test's set-up, not by a fixture: fixtures of a wider scope (the data-parallel
# runs that tests/test_ddp.py shares between its tests) are made before any of the test's own.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    outside = os.environ.get(RACE_CHECK_ENV)
    item.stash[RACE_CHECK_OUTSIDE] = outside
    setting = _race_check_setting(item, outside)
    item.stash[RACE_CHECK_SEED] = setting or "0"
    _set_environment(RACE_CHECK_ENV, setting)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if RACE_CHECK_OUTSIDE in item.stash:
            _set_environment(RACE_CHECK_ENV, item.stash[RACE_CHECK_OUTSIDE])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    seed = item.stash.get(RACE_CHECK_SEED, "0")
    if report.failed and seed not in ("", "0"):
        report.sections.append(("race check", f"{RACE_CHECK_ENV}={seed} (this test's own seed; set it in the environment to rerun "
                                               f"every selected test with it, or 0 to turn the check off)"))
    return report


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every module is imported now: what they made moves out of the collector's reach
    (``gc.freeze``), so that each full collection (pytest's after every test, the strategy's when
    it frees a closed engine) walks what the tests make, not torch's and Lightning's import-time
    objects: 0.2 s a collection before, microseconds after."""
    gc.collect()
    gc.freeze()

