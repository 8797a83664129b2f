"""Host homes as one copy per machine: the data-parallel ranks of one machine map the same memory
for the parameters of the units homed in host memory, instead of a copy each.

With sharded optimizer states each unit's owner writes its update there, and the other ranks see
it once a barrier says every owner has written: on one machine no parameters are broadcast for
those units, and host memory holds their parameters once rather than once per rank (ZeRO-3's
saving for host memory, without gathers: ranks of one machine share it already). On several
machines each machine holds its own copy, and the owner sends its update to one rank of every
other machine: the ranks with its local index, one process group per local index (ZeRO++'s
hierarchical partitioning, hpZ, keeps a copy per machine the same way), so host memory holds the
parameters once per machine and the network carries each update to each other machine once.

The memory is a file in ``/dev/shm`` (tmpfs): the machine's first rank creates it and reserves
its pages (``posix_fallocate``, so that a full ``/dev/shm`` is an error now, with the numbers,
rather than a bus error mid-run, on every rank of every machine), every rank of the machine maps
it, and the first rank removes the name once all have mapped it. A run killed before that (a
SIGKILL while the pages are reserved) cannot remove it: the name holds the creating process's id
and pid namespace (``offload_strategy-homes-<namespace>-<pid>-<random>``), and the next run on the
machine that creates one removes every such file whose process no longer lives, so a dead run's
memory is held only until then.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from ..config import format_bytes
from ..memory import HostSlab

if TYPE_CHECKING:
    from .grads.exchange import DataParallel

SHARED_MEMORY_DIR = Path("/dev/shm")
PREFIX = "offload_strategy-homes"


def shared_memory_unavailable(directory: Path = SHARED_MEMORY_DIR) -> str:
    """Why the ranks cannot map files from this machine's shared-memory file system, and what to
    do; '' when they can."""
    if not directory.is_dir():
        return f"{directory} does not exist or is not a directory (no shared-memory file system is mounted there)"
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError as err:
        return f"{directory} cannot be examined ({err.strerror})"
    if read_only:
        return (f"{directory} is mounted read-only (a container run with a read-only root, or a read-only mount); "
                f"mount a writable tmpfs there (docker: --tmpfs {directory} or --shm-size)")
    if not os.access(directory, os.W_OK):
        status = directory.stat()
        return f"{directory} is not writable by this user (uid {os.geteuid()}; it is mode {status.st_mode & 0o7777:o}, owned by uid {status.st_uid})"
    return ""


def shared_memory_available(directory: Path = SHARED_MEMORY_DIR) -> bool:
    """Whether this machine has a shared-memory file system the ranks can map files from."""
    return not shared_memory_unavailable(directory)


def map_shared_homes(
    nbytes: int, layout: list[tuple[int, int]], dp: "DataParallel", pin: bool, directory: Path = SHARED_MEMORY_DIR,
) -> HostSlab:
    """``nbytes`` of host memory every rank of this machine maps (collective on every rank).

    ``layout``: the (unit index, bytes) of each host home, in order; every rank, on every machine
    (whose copies the owners' updates are sent between), must carve the same homes from the
    memory, and a rank that planned otherwise is an error on every rank."""
    layouts: list[Optional[list[tuple[int, int]]]] = [None] * dp.world_size
    dist.all_gather_object(layouts, layout, group=dp.control_group)
    differing = [r for r, other in enumerate(layouts) if other != layouts[0]]
    if differing:
        raise RuntimeError(
            f"ranks {differing} planned other host homes than rank 0 ({len(layouts[differing[0]] or [])} units against "
            f"{len(layouts[0] or [])}), but ranks sharing host homes must plan alike; give every rank the same budgets "
            f"and plan file, or pass share_host_homes=False."
        )
    first = dp.first_on_machine
    made: list[Any] = [_create(directory, nbytes, dp.ranks_per_machine) if first else None]
    dist.broadcast_object_list(made, group=dp.machine_group, group_src=0)
    path, error = made[0]
    errors: list[Any] = [None] * dp.world_size
    dist.all_gather_object(errors, error, group=dp.control_group)  # a machine that failed stops every machine
    failed = next((e for e in errors if e), "")
    if failed:
        if first and path:
            Path(path).unlink(missing_ok=True)
        raise RuntimeError(failed)
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            return HostSlab(nbytes, pin=pin, shared_fd=fd, fault_in=first)
        finally:
            os.close(fd)
    finally:
        dist.barrier(group=dp.machine_group)  # every rank of the machine has it mapped: the name can go
        if first:
            Path(path).unlink(missing_ok=True)


def _create(directory: Path, nbytes: int, world_size: int) -> tuple[str, str]:
    """A new file of ``nbytes`` with its pages reserved: (its path, '') or ('', why not); first the
    files of dead runs are removed (their pages may be what is missing)."""
    remove_dead_runs_files(directory)
    path = directory / f"{PREFIX}-{_pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return "", f"cannot create the shared host homes in {directory}: {err}; pass share_host_homes=False to keep a copy per rank."
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as err:
        path.unlink(missing_ok=True)
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        return "", (
            f"the host homes shared by this machine's {world_size} ranks need {format_bytes(nbytes)} in {directory}, which has "
            f"{format_bytes(free)} free ({err.strerror}); raise its size (a container: --shm-size={-(-nbytes * 5 // 4 // 2**30)}g "
            f"or more), or pass share_host_homes=False to keep a copy per rank."
        )
    finally:
        os.close(fd)
    return str(path), ""


def _pid_namespace() -> str:
    """This process's pid namespace (its inode): a pid names a process only within one, and
    containers sharing ``/dev/shm`` may each have their own."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_dead_runs_files(directory: Path = SHARED_MEMORY_DIR) -> list[Path]:
    """Remove the shared-homes files this user's runs of this pid namespace made and whose
    process is gone (a run killed before it removed its own); return them. A file of a live
    process, another namespace's or another user's is left alone."""
    namespace, uid, removed = _pid_namespace(), os.getuid(), []
    for path in directory.glob(f"{PREFIX}-{namespace}-*-*"):
        pid = path.name[len(PREFIX) + len(namespace) + 2:].split("-", 1)[0]
        try:
            if not pid.isdigit() or _alive(int(pid)) or path.stat().st_uid != uid:
                continue
            path.unlink()
        except OSError:  # removed meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed
