"""Markers skip cleanly where their hardware is absent: ``gpu`` without CUDA, ``nvme`` without
room on the disk that holds the test's temporary directory. Modules with the most ``slow`` tests
run first, so that the suite's workers (``make test`` runs two, ``pytest-xdist``) finish together;
each worker, and every process its tests start, computes on one thread."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import pytest
import torch

# Tests that write large files need this much free space next to the temporary directory.
NVME_TEST_FREE_BYTES = 4 * 1024**3


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
