"""NVMe tier: tensors as private files of one run, read and written asynchronously.

Every key is one file in a per-run directory (0700, files 0600) that ``close()`` removes, also on
exceptions and, as a last resort, when the store is garbage-collected (docs/architecture.md, invariants).
I/O uses ``O_DIRECT`` where the file system allows it, so a swap does not also fill the page cache
that the host tier is budgeting. ``O_DIRECT`` wants page-aligned addresses, lengths and offsets:
aligned tensors (slices of an mmap'ed slab) go straight to ``os.pwritev``/``os.preadv``; the rest
of a request goes through a page-aligned bounce buffer per worker thread, with the file padded to
whole pages. Requests are cut into chunks spread over a small thread pool, which measured faster
here than mmap, numpy.memmap or libaio (docs/architecture.md, "Platform facts").
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from ..config import format_bytes
from ..hardware.probe import disk_free

PAGE = 4096
CHUNK = 8 * 1024**2  # bytes per request to the pool: large enough for full speed, small enough to overlap


class NvmeSpaceError(ValueError):
    """The NVMe budget (or the disk under it) cannot hold what was asked for."""


@dataclass
class _Entry:
    file: Path
    length: int  # true byte length; the file may be padded to whole pages
    crc: Optional[int] = None  # CRC-32 of what was written, when checksums are on


class NvmeChecksumError(OSError):
    """Data read back from the NVMe tier differs from what was written."""


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _direct_works(directory: Path) -> bool:
    """Whether this file system takes O_DIRECT I/O (tmpfs refuses the open with EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        try:
            with mmap.mmap(-1, PAGE) as page:
                os.pwrite(fd, page, 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _bytes_of(t: torch.Tensor, name: str) -> np.ndarray:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor, got device={t.device}, contiguous={t.is_contiguous()}.")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


RUN_PREFIX = "offload-"
CREATING_PREFIX = ".creating-offload-"  # a run directory before its owner lock is held
OWNER_FILE = "owner.lock"


def create_run_directory(root: Path) -> tuple[Path, int]:
    """A private run directory under ``root`` and the descriptor of its held owner lock.

    The directory is created and locked under a name stale-run cleanup does not look at, then
    renamed into place: no other process ever sees a run directory whose lock is not yet held,
    so none can take a live run for a killed one."""
    pid = os.getpid()
    staging = Path(tempfile.mkdtemp(prefix=f"{CREATING_PREFIX}{pid}-", dir=root))  # mode 0700
    owner = -1
    try:
        owner = os.open(staging / OWNER_FILE, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(owner, str(pid).encode())
        final = root / f"{RUN_PREFIX}{pid}-{staging.name[len(CREATING_PREFIX) + len(str(pid)) + 1:]}"
        os.rename(staging, final)
    except BaseException:
        if owner >= 0:
            os.close(owner)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, owner


CREATION_SECONDS = 60.0  # a directory still under its creating name after this long was left by a killed run


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > seconds
    except OSError:
        return False


def _is_stale(candidate: Path) -> bool:
    """A run directory of this user whose owner lock nobody holds: its run was killed.
    Anything else (another user's, unreadable, live, not ours) is left alone."""
    try:
        if candidate.is_symlink() or not candidate.is_dir() or candidate.stat().st_uid != os.getuid():
            return False
        fd = os.open(candidate / OWNER_FILE, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live run
    finally:
        os.close(fd)
    return True


def remove_stale_run_directories(root: Path) -> list[Path]:
    """Remove this user's run directories under ``root`` whose owner died without cleaning up (a
    killed process): their owner lock can be taken. Live runs hold theirs and are left alone, as
    is every directory of another user or that cannot be read."""
    removed = []
    try:
        candidates = sorted(root.glob(f"{RUN_PREFIX}*")) + sorted(root.glob(f"{CREATING_PREFIX}*"))
    except OSError:
        return removed
    for candidate in candidates:
        if candidate.name.startswith(CREATING_PREFIX) and not _older_than(candidate, CREATION_SECONDS):
            continue  # possibly being created this moment: its lock may not be held yet
        if _is_stale(candidate):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    if removed:
        warnings.warn(
            f"removed {len(removed)} NVMe swap director{'y' if len(removed) == 1 else 'ies'} left under {root} by runs that were "
            f"killed: {', '.join(p.name for p in removed)}",
            stacklevel=3,
        )
    return removed


class NvmeStore:
    """Files of one run in a private directory under the NVMe path."""

    def __init__(self, root: Union[str, Path], capacity: int, workers: int = 4, direct: bool = True, checksums: bool = False) -> None:
        root = Path(root).expanduser().absolute()
        free = disk_free(str(root))
        if capacity > free:
            raise NvmeSpaceError(
                f"NVMe store under {root} needs capacity {format_bytes(capacity)} but the file system has only "
                f"{format_bytes(free)} free; free space there, point the NVMe path at a larger disk, or lower the NVMe budget."
            )
        root.mkdir(parents=True, exist_ok=True)
        self.removed_stale = remove_stale_run_directories(root)
        # The owner lock is held for the store's lifetime; the kernel releases it when the process
        # dies, even by SIGKILL, and the next run under this root removes the directory.
        self.path, self._owner = create_run_directory(root)
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
        self.capacity = capacity
        self.checksums = checksums  # CRC-32 of every write, verified on every read
        self.direct = direct and _direct_works(self.path)
        self.bytes_written = 0
        self.bytes_read = 0
        self._entries: dict[str, _Entry] = {}
        self._next_file = 0
        self._used = 0
        self._lock = threading.Lock()
        self._local = threading.local()  # one bounce buffer per worker thread
        self._bounces: list[mmap.mmap] = []
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nvme")
        # Start every worker now (the pool would start them lazily, mid-training): each waits at
        # the barrier, so the pool must spawn a new thread for the next.
        barrier = threading.Barrier(workers)
        for started in [self._pool.submit(barrier.wait) for _ in range(workers)]:
            started.result()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        return self._used

    def write(self, key: str, src: torch.Tensor) -> Future:
        """Store ``src``'s bytes under ``key``; keep ``src`` alive and unchanged until the future is done.

        The space is booked at once, so the budget check needs no wait; if the future fails, the
        key's content is undefined until it is written again.
        """
        data = _bytes_of(src, "src")
        n = data.nbytes
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            used = self._used - (entry.length if entry else 0)
            if used + n > self.capacity:
                raise NvmeSpaceError(
                    f"NVMe store {self.path}: writing {key!r} ({format_bytes(n)}) would use {format_bytes(used + n)} "
                    f"of its capacity {format_bytes(self.capacity)}; delete keys first or raise the NVMe budget."
                )
            if entry is None:  # file names are counters: keys may hold any characters
                entry = self._entries[key] = _Entry(self.path / f"{self._next_file:08d}.bin", n)
                self._next_file += 1
            entry.length, self._used = n, used + n
            entry.crc = zlib.crc32(data) if self.checksums else None
        flags = os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if self.direct else 0)
        return self._transfer("write", key, entry.file, flags, data, _round_up(n) if self.direct else n)

    def read(self, key: str, dst: torch.Tensor) -> Future:
        """Fill ``dst`` with the bytes stored under ``key``; the sizes must match exactly."""
        data = _bytes_of(dst, "dst")
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"NVMe store {self.path} has no key {key!r}.")
        if entry.length != data.nbytes:
            raise ValueError(
                f"NVMe key {key!r} holds {entry.length} bytes but dst has {data.nbytes} bytes; read into a tensor of the stored size."
            )
        transfer = self._transfer("read", key, entry.file, os.O_RDONLY | (os.O_DIRECT if self.direct else 0), data, None)
        if entry.crc is None:
            return transfer
        checked: Future = Future()
        checked.set_running_or_notify_cancel()
        expected = entry.crc

        def verify(f: Future) -> None:
            if f.exception() is not None:
                checked.set_exception(f.exception())
                return
            got = zlib.crc32(data)
            if got != expected:
                checked.set_exception(NvmeChecksumError(
                    5, f"NVMe data of key {key!r} in {entry.file} came back different from what was written "
                    f"(CRC-32 {got:#010x}, written {expected:#010x}): the disk or file system corrupted it. "
                    f"Resume from the last checkpoint, and check the device."
                ))
            else:
                checked.set_result(None)

        transfer.add_done_callback(verify)
        return checked

    def delete(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.length
        if entry is not None:
            entry.file.unlink(missing_ok=True)  # in-flight I/O keeps the inode until its fd closes

    def close(self) -> None:
        """Wait for pending I/O, stop the threads and remove the directory. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for bounce in self._bounces:
            try:
                bounce.close()
            except BufferError:  # a view is still alive somewhere; the GC frees the mapping later
                pass
        self._bounces.clear()
        os.close(self._owner)
        self._remove_dir()

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NVMe store {self.path} is closed.")

    def _transfer(self, op: str, key: str, file: Path, flags: int, data: np.ndarray, file_length: Union[int, None]) -> Future:
        """Run one request as chunks on the pool; the returned future completes when all have."""
        n, done = data.nbytes, Future()
        done.set_running_or_notify_cancel()

        def fail(err: OSError) -> OSError:
            hint = " The disk is full: free space or lower the NVMe budget." if err.errno == 28 else ""
            return OSError(err.errno, f"NVMe {op} of key {key!r} ({format_bytes(n)}) in {self.path} failed: {err.strerror}.{hint}")

        try:
            fd = os.open(file, flags, 0o600)
            if file_length is not None:
                os.ftruncate(fd, file_length)
        except OSError as err:
            done.set_exception(fail(err))
            return done
        aligned = self.direct and data.ctypes.data % PAGE == 0
        chunk = self._write_chunk if op == "write" else self._read_chunk
        spans = [(off, min(CHUNK, n - off)) for off in range(0, n, CHUNK)]
        state = {"left": len(spans), "error": None}

        def finish(f: Union[Future, None] = None) -> None:
            with self._lock:
                if f is not None and f.exception() is not None and state["error"] is None:
                    state["error"] = f.exception()
                state["left"] -= 1
                last = state["left"] <= 0
            if last:
                os.close(fd)
                err = state["error"]
                if err is None:
                    done.set_result(None)
                else:
                    done.set_exception(fail(err) if isinstance(err, OSError) else err)

        if not spans:
            finish()
        for off, length in spans:
            self._pool.submit(chunk, fd, data, off, length, aligned).add_done_callback(finish)
        return done

    def _bounce(self) -> memoryview:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = mmap.mmap(-1, CHUNK)
            with self._lock:
                self._bounces.append(bounce)
        return memoryview(bounce)

    def _write_chunk(self, fd: int, data: np.ndarray, off: int, n: int, aligned: bool) -> None:
        view = memoryview(data)[off : off + n]
        if self.direct:
            body = n - n % PAGE if aligned else 0
            _all(lambda b, o: os.pwritev(fd, [b], o), view[:body], off)
            if body < n:
                with self._bounce() as bounce:
                    bounce[: n - body] = view[body:]
                    bounce[n - body : _round_up(n - body)] = bytes(_round_up(n - body) - (n - body))
                    _all(lambda b, o: os.pwritev(fd, [b], o), bounce[: _round_up(n - body)], off + body)
        else:
            _all(lambda b, o: os.pwritev(fd, [b], o), view, off)
        with self._lock:
            self.bytes_written += n

    def _read_chunk(self, fd: int, data: np.ndarray, off: int, n: int, aligned: bool) -> None:
        view = memoryview(data)[off : off + n]
        if self.direct:
            body = n - n % PAGE if aligned else 0
            _all(lambda b, o: os.preadv(fd, [b], o), view[:body], off)
            if body < n:
                with self._bounce() as bounce:
                    _all(lambda b, o: os.preadv(fd, [b], o), bounce[: _round_up(n - body)], off + body)
                    view[body:] = bounce[: n - body]
        else:
            _all(lambda b, o: os.preadv(fd, [b], o), view, off)
        with self._lock:
            self.bytes_read += n


def _all(io: Callable[[memoryview, int], int], buf: memoryview, offset: int) -> None:
    """Repeat a pread/pwrite until ``buf`` is done; a short count is not an error, zero bytes is."""
    done = 0
    while done < len(buf):
        count = io(buf[done:], offset + done)
        if count <= 0:
            raise OSError(5, f"{'end of file' if count == 0 else 'no progress'} at offset {offset + done}")
        done += count
