"""NVMe tier: tensors as private files of one run, read and written asynchronously.

Every key is one file in a per-run directory (0700, files 0600) that ``close()`` removes, also on
exceptions and, as a last resort, when the store is garbage-collected (docs/architecture.md, invariants).
I/O uses ``O_DIRECT`` where the file system allows it, so a swap does not also fill the page cache
that the host tier is budgeting. ``O_DIRECT`` wants page-aligned addresses, lengths and offsets:
aligned tensors (slices of an mmap'ed slab) go straight to ``os.pwritev``/``os.preadv``; the rest
of a request goes through a page-aligned bounce buffer per worker thread, with the file padded to
whole pages. Requests are cut into chunks spread over a small thread pool, which measured faster
here than mmap, numpy.memmap or libaio (docs/architecture.md, "Platform facts").

Checksums (on by default): each chunk's XXH3-64 is taken by the thread that writes it and checked by
the thread that reads it back against the digests of the key's last write, kept in memory, so that
a flipped bit, a zeroed block, another file's data or an older write of the same file is an error
naming the file (docs/benchmarks.md measures what they cost).

A machine shared with other users: the NVMe path and every directory above it must be writable by
this user (or root) alone, or carry the sticky bit (``check_private_directory``), and the run's files
are opened relative to the run directory's held descriptor with ``O_NOFOLLOW``: a renamed directory
or a planted link is never followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import xxhash

from ..config import format_bytes
from ..hardware.probe import disk_free

PAGE = 4096
CHUNK = 8 * 1024**2  # bytes per request to the pool: large enough for full speed, small enough to overlap


class NvmeSpaceError(ValueError):
    """The NVMe budget (or the disk under it) cannot hold what was asked for."""


class NvmeUnsafePathError(ValueError):
    """The NVMe path lies where another user could redirect or read the run's files."""


class NvmeChecksumError(OSError):
    """Data read back from the NVMe tier differs from what was written."""


class _Mismatch(Exception):
    """A chunk read back whose digest differs from its write's (raised on a worker, named by the request)."""

    def __init__(self, offset: int, length: int) -> None:
        super().__init__(offset, length)
        self.offset, self.length = offset, length


@dataclass
class _Seal:
    """What one write of a key wrote: the XXH3-64 of each chunk, by the chunk's offset. A read of
    the key checks each chunk against its digest here, so bytes that are not this write's (damaged,
    another file's, an older write's) fail, whatever file system or disk returned them."""

    digests: dict[int, int]  # chunk offset -> digest of what was written there

    @staticmethod
    def digest(data: memoryview) -> int:
        return xxhash.xxh3_64_intdigest(data)


@dataclass
class _Entry:
    name: str  # the file's name in the run directory
    file: Path  # its full path, for messages
    length: int  # true byte length; the file may be padded to whole pages
    seal: Optional[_Seal] = None  # the last write's digests, when checksums are on
    failed: Optional[OSError] = None  # the last write's error: a read gives it, not the bytes it left


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _direct_works(directory: int) -> bool:
    """Whether the file system of the directory held open as ``directory`` takes O_DIRECT I/O
    (tmpfs refuses the open with EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = ".direct-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | NOFOLLOW, 0o600, dir_fd=directory)
        try:
            with mmap.mmap(-1, PAGE) as page:
                os.pwrite(fd, page, 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe, dir_fd=directory)


def _bytes_of(t: torch.Tensor, name: str) -> np.ndarray:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor, got device={t.device}, contiguous={t.is_contiguous()}.")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


RUN_PREFIX = "offload-"
CREATING_PREFIX = ".creating-offload-"  # a run directory before its owner lock is held
OWNER_FILE = "owner.lock"


@dataclass(frozen=True)
class RunDirectory:
    """A run's private directory: its path (for messages), its descriptor, which every file of
    the run is opened relative to, and the descriptor of its held owner lock."""

    path: Path
    fd: int
    owner: int

    def remove(self) -> None:
        """The run's files, through the held descriptor (never a file a link points at), then
        the directory; the descriptors are closed, the owner lock with them."""
        try:
            for name in os.listdir(self.fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)
        except OSError:
            pass
        finally:
            os.close(self.owner)
            os.close(self.fd)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


def create_run_directory(root: Path) -> RunDirectory:
    """A private run directory under ``root``, held open, with its owner lock held.

    The directory is created and locked under a name stale-run cleanup does not look at, then
    renamed into place: no other process ever sees a run directory whose lock is not yet held,
    so none can take a live run for a killed one. It is opened before anything is made in it:
    what happens to its name afterwards (a rename, a link put in its place) changes nothing."""
    pid = os.getpid()
    staging = Path(tempfile.mkdtemp(prefix=f"{CREATING_PREFIX}{pid}-", dir=root))  # mode 0700
    directory = owner = -1
    try:
        directory = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        if os.fstat(directory).st_uid != os.geteuid():
            raise NvmeUnsafePathError(f"{staging} was replaced by a directory of another user while it was being made; see check_private_directory.")
        owner = os.open(OWNER_FILE, os.O_CREAT | os.O_EXCL | os.O_RDWR | NOFOLLOW, 0o600, dir_fd=directory)
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(owner, str(pid).encode())
        final = root / f"{RUN_PREFIX}{pid}-{staging.name[len(CREATING_PREFIX) + len(str(pid)) + 1:]}"
        os.rename(staging, final)
    except BaseException:
        for fd in (owner, directory):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return RunDirectory(final, directory, owner)


def _unsafe_because(directory: Path) -> Optional[str]:
    """Why another user could rename or replace what ``directory`` holds; None when none can."""
    status = os.stat(directory)  # through a link: the directory it leads to
    if status.st_uid not in (os.geteuid(), 0):
        return f"{directory} belongs to another user (uid {status.st_uid})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not status.st_mode & stat.S_ISVTX:
        return f"{directory} can be written by other users (mode {stat.S_IMODE(status.st_mode):o}) and has no sticky bit"
    return None


def _directories_above(path: Path) -> list[Path]:
    """Every existing directory ``path`` passes through, as written and with its links resolved."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    real = Path(os.path.realpath(existing))
    return list(dict.fromkeys([existing, *existing.parents, real, *real.parents]))


def check_private_directory(path: Path) -> None:
    """Refuse an NVMe path under which another user could redirect the run's files: a directory
    on the way to it that another user owns (root aside), or that others may write without the
    sticky bit (there they could rename the run's directory and put a link in its place)."""
    for directory in _directories_above(path):
        reason = _unsafe_because(directory)
        if reason is not None:
            sticky = ", or give it the sticky bit (chmod +t)" if "sticky" in reason else ""
            raise NvmeUnsafePathError(
                f"nvme_path {path}: {reason}, so another user could redirect or read the run's parameters and optimizer "
                f"states; point nvme_path at a directory that only you (or root) can write, such as one made with "
                f"`mkdir -m 700` under a directory of your own{sticky}."
            )


def make_private_directory(path: Path) -> None:
    """``path`` and any missing directory above it, made only after every directory that exists
    on the way is checked (``check_private_directory``); the missing ones are made 0700."""
    check_private_directory(path)
    missing = [p for p in [path, *path.parents] if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    check_private_directory(path)


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
    removed: list[Path] = []
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

    def __init__(self, root: Union[str, Path], capacity: int, workers: int = 4, direct: bool = True, checksums: bool = True) -> None:
        root = Path(root).expanduser().absolute()
        free = disk_free(str(root))
        if capacity > free:
            raise NvmeSpaceError(
                f"NVMe store under {root} needs capacity {format_bytes(capacity)} but the file system has only "
                f"{format_bytes(free)} free; free space there, point the NVMe path at a larger disk, or lower the NVMe budget."
            )
        make_private_directory(root)
        self.removed_stale = remove_stale_run_directories(root)
        # The owner lock is held for the store's lifetime; the kernel releases it when the process
        # dies, even by SIGKILL, and the next run under this root removes the directory.
        self._run = create_run_directory(root)
        self.path = self._run.path
        self._remove_dir = weakref.finalize(self, self._run.remove)
        self.capacity = capacity
        self.checksums = checksums  # XXH3 of every chunk written, checked on every read
        self.direct = direct and _direct_works(self._run.fd)
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

    def write(self, key: str, src: torch.Tensor, after: Optional[Callable[[], object]] = None) -> Future:
        """Store ``src``'s bytes under ``key``; keep ``src`` alive and unchanged until the future is done.

        The space is booked at once, so the budget check needs no wait; if the future fails, the
        key's content is undefined until it is written again. ``after``: called on the store's
        threads before they read ``src`` (a host wait for the copy that fills it), so that the
        caller queues the write without waiting; its error fails the future.
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
                name = f"{self._next_file:08d}.bin"
                entry = self._entries[key] = _Entry(name, self.path / name, n)
                self._next_file += 1
            entry.length, self._used = n, used + n
            entry.seal = _Seal({}) if self.checksums else None  # a new write: the old digests no longer hold
            entry.failed = None
        flags = os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if self.direct else 0)
        return self._transfer(_Request(_Op.WRITE, key, entry, flags, data, _round_up(n) if self.direct else n), after)

    def read(self, key: str, dst: torch.Tensor) -> Future:
        """Fill ``dst`` with the bytes stored under ``key``; the sizes must match exactly. With
        checksums on, the future fails with :class:`NvmeChecksumError` where they differ from
        what the last write of ``key`` wrote."""
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
        if entry.failed is not None:  # what a failed write left is no value: its error is the reason
            failed: Future = Future()
            failed.set_exception(entry.failed)
            return failed
        return self._transfer(_Request(_Op.READ, key, entry, os.O_RDONLY | (os.O_DIRECT if self.direct else 0), data, None))

    def delete(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.length
        if entry is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.name, dir_fd=self._run.fd)  # in-flight I/O keeps the inode until its fd closes

    def release_buffers(self) -> None:
        """Give the OS back the pages of the worker threads' bounce buffers (``CHUNK`` each, one
        per thread that did unaligned I/O): a store left open after training, for units read when
        used, would otherwise keep them resident for the life of the process. The mappings stay;
        the next request through one faults its pages in afresh. Call with no request under way."""
        with self._lock:
            for bounce in self._bounces:
                bounce.madvise(mmap.MADV_REMOVE)  # (shared anonymous memory: DONTNEED would keep its pages)

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
        self._remove_dir()

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NVMe store {self.path} is closed.")

    def _transfer(self, request: "_Request", after: Optional[Callable[[], object]] = None) -> Future:
        """Run one request as chunks on the pool (each after ``after``); the returned future
        completes when all have."""
        done: Future = Future()
        done.set_running_or_notify_cancel()
        try:
            fd = os.open(request.entry.name, request.flags | NOFOLLOW, 0o600, dir_fd=self._run.fd)
            if request.file_length is not None:
                os.ftruncate(fd, request.file_length)
        except OSError as err:
            done.set_exception(self._failed(request, err))
            return done
        n = request.data.nbytes
        aligned = self.direct and request.data.ctypes.data % PAGE == 0
        spans = [(off, min(CHUNK, n - off)) for off in range(0, n, CHUNK)]
        state: dict[str, Any] = {"left": len(spans), "error": None}

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
                    done.set_exception(self._failed(request, err))

        if not spans:
            finish()
        chunk = self._write_chunk if request.op is _Op.WRITE else self._read_chunk
        if after is not None:
            chunk = _after(after, chunk)
        seal = request.entry.seal
        for off, length in spans:
            self._pool.submit(chunk, fd, request.data, off, length, aligned, seal).add_done_callback(finish)
        return done

    def _failed(self, request: "_Request", err: BaseException) -> BaseException:
        """The error a request fails with; a failed write's is kept for the key's next read."""
        failure = request.failure(err, self.path)
        if request.op is _Op.WRITE and isinstance(failure, OSError):
            request.entry.failed = failure
        return failure

    def _bounce(self) -> memoryview:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = mmap.mmap(-1, CHUNK)
            with self._lock:
                self._bounces.append(bounce)
        return memoryview(bounce)

    def _write_chunk(self, fd: int, data: np.ndarray, off: int, n: int, aligned: bool, seal: Optional[_Seal]) -> None:
        view = data.data[off : off + n]
        if seal is not None:
            seal.digests[off] = seal.digest(view)
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

    def _read_chunk(self, fd: int, data: np.ndarray, off: int, n: int, aligned: bool, seal: Optional[_Seal]) -> None:
        view = data.data[off : off + n]
        if self.direct:
            body = n - n % PAGE if aligned else 0
            _all(lambda b, o: os.preadv(fd, [b], o), view[:body], off)
            if body < n:
                with self._bounce() as bounce:
                    _all(lambda b, o: os.preadv(fd, [b], o), bounce[: _round_up(n - body)], off + body)
                    view[body:] = bounce[: n - body]
        else:
            _all(lambda b, o: os.preadv(fd, [b], o), view, off)
        if seal is not None and seal.digests.get(off) != seal.digest(view):
            raise _Mismatch(off, n)
        with self._lock:
            self.bytes_read += n


def _after(first: Callable[[], object], chunk: Callable[..., None]) -> Callable[..., None]:
    def chunk_after(*args: Any) -> None:
        first()
        chunk(*args)

    return chunk_after


class _Op(Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True)
class _Request:
    """One read or write of a key's whole file."""

    op: _Op
    key: str
    entry: _Entry
    flags: int
    data: np.ndarray
    file_length: Optional[int]  # a write's file size (padded to whole pages under O_DIRECT)

    def failure(self, err: BaseException, directory: Path) -> BaseException:
        """The error a request's future fails with: what was done to which key, in which file."""
        what = f"NVMe {self.op.value} of key {self.key!r} ({format_bytes(self.data.nbytes)}) in {self.entry.file}"
        if isinstance(err, _Mismatch):
            return NvmeChecksumError(
                5, f"{what}: the data came back different from what was written (bytes {err.offset}-{err.offset + err.length} "
                f"fail their XXH3 checksum): the disk or file system corrupted the file, or it was replaced. "
                f"Resume from the last checkpoint, and check the device under {directory}."
            )
        if not isinstance(err, OSError):
            return err
        hint = " The disk is full: free space or lower the NVMe budget." if err.errno == 28 else ""
        return OSError(err.errno, f"{what} failed: {err.strerror}.{hint}")


def _all(io: Callable[[memoryview, int], int], buf: memoryview, offset: int) -> None:
    """Repeat a pread/pwrite until ``buf`` is done; a short count is not an error, zero bytes is."""
    done = 0
    while done < len(buf):
        count = io(buf[done:], offset + done)
        if count <= 0:
            raise OSError(5, f"{'end of file' if count == 0 else 'no progress'} at offset {offset + done}")
        done += count
