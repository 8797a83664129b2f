"""The memory a control group lets this process have: its limit less its use, read from the files
the kernel keeps (Docker, Kubernetes and SLURM run jobs in such groups, and the OOM killer acts at
the group's limit, whatever the machine has free).

cgroup v1 keeps ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` under the memory
controller's mount; v2 keeps ``memory.max`` (``max``: no limit) and ``memory.current`` in one
hierarchy. Groups nest and every ancestor's limit applies, so the hierarchy is walked from this
process's group (``/proc/self/cgroup``) up to the mount's root, and the tightest room is taken.
The file cache a group holds counts in its use but is given back under pressure: its inactive
part (``inactive_file`` in ``memory.stat``, ``total_inactive_file`` under v1) is not counted as used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class _Layout:
    """Where one cgroup version keeps a group's limit, use and statistics."""

    limit: str
    usage: str
    inactive_file: str


_V1 = _Layout("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_V2 = _Layout("memory.max", "memory.current", "inactive_file")


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit over this process's control group and its ancestors."""

    limit: int  # bytes
    usage: int  # bytes the group holds, its inactive file cache left out
    group: Path  # the directory of the group whose limit is tightest

    @property
    def free(self) -> int:
        return max(self.limit - self.usage, 0)


def cgroup_memory(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> Optional[CgroupMemory]:
    """The memory limit and use of the tightest group this process is in; None where no group
    sets a limit (or the files cannot be read: not Linux, no cgroup mounted)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found = _memory_hierarchy(lines, root)
    if found is None:
        return None
    mount, group, layout = found
    tightest: Optional[CgroupMemory] = None
    for directory in _up_to(mount, group):
        level = _read_level(directory, layout)
        if level is not None and (tightest is None or level.free < tightest.free):
            tightest = level
    return tightest


def _memory_hierarchy(lines: list[str], root: Path) -> Optional[tuple[Path, Path, _Layout]]:
    """The memory controller's mount, this process's group under it, and the version's file names:
    a v1 line naming the controller ("4:memory:/path") first, else v2's ("0::/path")."""
    v2: Optional[str] = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            mount = root / controllers if (root / controllers).is_dir() else root / "memory"
            return mount, _group(mount, path), _V1
        if hierarchy == "0" and not controllers:
            v2 = path
    if v2 is None:
        return None
    return root, _group(root, v2), _V2


def _group(mount: Path, path: str) -> Path:
    """The group's directory under the mount; the mount itself where the path is not there (a
    container whose cgroup namespace shows its own group as the root)."""
    directory = mount / path.lstrip("/")
    return directory if directory.is_dir() else mount


def _up_to(mount: Path, group: Path) -> list[Path]:
    """The group's directory and each ancestor up to the mount, the mount included."""
    directories = [group]
    while directories[-1] != mount and mount in directories[-1].parents:
        directories.append(directories[-1].parent)
    return directories


def _read_level(directory: Path, layout: _Layout) -> Optional[CgroupMemory]:
    """One group's limit and use; None where it sets no limit or its files are not there."""
    try:
        limit_text = (directory / layout.limit).read_text().strip()
        usage = int((directory / layout.usage).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit_text == "max":
        return None
    limit = int(limit_text)
    if limit >= _V1_UNLIMITED:
        return None
    return CgroupMemory(limit=limit, usage=max(usage - _inactive_file(directory, layout), 0), group=directory)


def _inactive_file(directory: Path, layout: _Layout) -> int:
    """The group's file cache not in active use (reclaimed before the group is out of memory)."""
    try:
        text = (directory / "memory.stat").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == layout.inactive_file:
            return int(value)
    return 0
