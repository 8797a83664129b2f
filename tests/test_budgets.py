"""Budgets: the memory a control group allows (v1, v2, nested), the emulated GPU tier and host
memory checked against the same memory, and one count of each budget at set-up and after the
profiled steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from offload_strategy import TieredStrategy
from offload_strategy.hardware import cgroup as cgroup_module
from offload_strategy.hardware import probe
from offload_strategy.hardware.cgroup import CgroupMemory, cgroup_memory
from offload_strategy.strategy_core import MemoryBudgetError
from tests.helpers import train

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20


def _write(directory: Path, **files: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("_", ".", 1)).write_text(f"{value}\n")


def _tree(tmp_path: Path, proc: str) -> tuple[Path, Path]:
    (tmp_path / "proc").write_text(proc)
    return tmp_path / "proc", tmp_path / "cgroup"


# -- the reader, over fake cgroup trees ----------------------------------------------------------------


def test_v2_limit_and_use(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/job\n")
    _write(root / "job", memory_max=3 * GiB, memory_current=GiB)
    _write(root / "job", memory_stat="anon 100\ninactive_file 4096\nactive_file 8192")
    group = cgroup_memory(proc, root)
    assert group == CgroupMemory(limit=3 * GiB, usage=GiB - 4096, group=root / "job")
    assert group.free == 2 * GiB + 4096


def test_v2_max_is_no_limit(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/job\n")
    _write(root / "job", memory_max="max", memory_current=GiB)
    assert cgroup_memory(proc, root) is None


def test_v2_nested_takes_the_tightest(tmp_path: Path) -> None:
    # the parent's limit is larger, but its other children hold most of it
    proc, root = _tree(tmp_path, "0::/slurm/job_7/step_0\n")
    _write(root / "slurm", memory_max=8 * GiB, memory_current=7 * GiB)
    _write(root / "slurm" / "job_7", memory_max=4 * GiB, memory_current=GiB)
    _write(root / "slurm" / "job_7" / "step_0", memory_max="max", memory_current=GiB)
    group = cgroup_memory(proc, root)
    assert group is not None and group.group == root / "slurm" and group.free == GiB


def test_v2_the_root_of_a_container(tmp_path: Path) -> None:
    # under a cgroup namespace the process's group is shown as "/" and is the mount's root
    proc, root = _tree(tmp_path, "0::/\n")
    _write(root, memory_max=3 * GiB, memory_current=GiB // 2)
    group = cgroup_memory(proc, root)
    assert group is not None and group.free == 3 * GiB - GiB // 2


def test_v1_limit_and_use(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "9:name=systemd:/\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n")
    _write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=3 * GiB, memory_usage_in_bytes=GiB)
    _write(root / "memory" / "docker" / "abc", memory_stat="cache 10\ntotal_inactive_file 1024\ninactive_file 7")
    _write(root / "memory", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=20 * GiB)
    group = cgroup_memory(proc, root)
    assert group == CgroupMemory(limit=3 * GiB, usage=GiB - 1024, group=root / "memory" / "docker" / "abc")


def test_v1_unlimited_everywhere(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/docker/abc\n")
    _write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=GiB)
    _write(root / "memory", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=GiB)
    assert cgroup_memory(proc, root) is None


def test_v1_nested_in_a_combined_mount(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "5:cpu,memory:/batch/job\n")
    _write(root / "cpu,memory" / "batch", memory_limit_in_bytes=2 * GiB, memory_usage_in_bytes=GiB)
    _write(root / "cpu,memory" / "batch" / "job", memory_limit_in_bytes=6 * GiB, memory_usage_in_bytes=GiB)
    group = cgroup_memory(proc, root)
    assert group is not None and group.limit == 2 * GiB and group.free == GiB


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path / "missing", tmp_path) is None
    proc, root = _tree(tmp_path, "0::/job\n")
    assert cgroup_memory(proc, root) is None  # nothing mounted there


def test_host_available_is_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: CgroupMemory(limit=3 * GiB, usage=GiB, group=Path("/job")))
    assert probe.host_available() <= 2 * GiB
    assert probe.host_total() <= 3 * GiB
    assert probe.probe_hardware().host_memory <= 3 * GiB


def test_a_budget_above_the_groups_room_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: CgroupMemory(limit=3 * GiB, usage=GiB, group=Path("/job")))
    with pytest.raises(MemoryBudgetError, match=r"host_memory=2\.50 GiB asks for more than is free in host memory: 2\.00 GiB free"):
        train(TieredStrategy(gpu_memory="1MiB", host_memory="2.5GiB"), tmp_path, epochs=1)


# -- the emulated GPU tier and host memory, one memory ----------------------------------------------


def test_emulated_gpu_tier_and_host_memory_checked_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: CgroupMemory(limit=23 * GiB, usage=0, group=Path("/job")))
    monkeypatch.setattr(probe.psutil, "virtual_memory", lambda: _Memory(total=24 * GiB, available=23 * GiB))
    with pytest.raises(MemoryBudgetError) as refused:
        train(TieredStrategy(gpu_memory="20GiB", host_memory="20GiB"), tmp_path, epochs=1)
    message = str(refused.value)
    assert "40.00 GiB together" in message and "23.00 GiB is available" in message
    assert "host_memory=3.00 GiB beside this gpu_memory" in message  # the fix, with its number


def test_an_unbounded_budget_takes_what_the_other_leaves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe, "cgroup_memory", lambda: None)
    monkeypatch.setattr(probe.psutil, "virtual_memory", lambda: _Memory(total=24 * GiB, available=23 * GiB))
    strategy = TieredStrategy(gpu_memory="20GiB", host_memory=None, policy="none")
    train(strategy, tmp_path, epochs=1, limit_train_batches=1)
    assert (strategy.budgets.gpu, strategy.budgets.host) == (20 * GiB, 3 * GiB)


class _Memory:
    def __init__(self, total: int, available: int) -> None:
        self.total, self.available = total, available


# -- a job in a real child cgroup --------------------------------------------------------------------


def _own_memory_group() -> Optional[tuple[Path, str]]:
    """This process's memory cgroup directory and the name of its limit file, where both are there."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = cgroup_module._memory_hierarchy(lines, cgroup_module.CGROUP_ROOT)
    if found is None:
        return None
    _mount, group, layout = found
    return (group, layout.limit) if (group / layout.limit).exists() else None


def test_a_job_in_a_real_child_cgroup(tmp_path: Path) -> None:
    own = _own_memory_group()
    if own is None:
        pytest.skip("no memory cgroup to make a child in")
    parent, limit_file = own
    child = parent / f"offload-test-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a child cgroup under {parent}: {error}")
    limit = 2 * GiB
    try:
        try:
            (child / limit_file).write_text(str(limit))
        except OSError as error:
            pytest.skip(f"cannot set a memory limit in {child}: {error}")
        job = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "cgroup_job.py"), str(tmp_path), str(limit)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=lambda: (child / "cgroup.procs").write_text("0"),
        )
        out, err = job.communicate(timeout=300)
    finally:
        child.rmdir()
    assert job.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["limit"] == limit
    assert 0 < result["available"] < limit
    assert result["granted"] < limit  # host_memory=None: what the group leaves, not the machine
    assert "asks for more than is free in host memory" in result["over_limit"]
    assert len(result["losses"]) > 0
