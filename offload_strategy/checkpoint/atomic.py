"""Checkpoint files written so that a crash never destroys the previous one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO
from typing_extensions import override


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file beside its target, flushes it to disk, then renames
    it over the target: a crash or a full disk mid-save leaves the previous checkpoint whole and no
    partial file behind. Remote paths (``s3://...``) are left to Lightning's own writer.

    A process killed mid-save (SIGKILL skips every cleanup) leaves its partial file; the writer
    holds a lock on it while writing, so the next save into that directory removes the partial
    files of this naming whose lock is free, and leaves a save in progress in another process alone."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, Path], storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        with naming_failures("create the directory of", path):
            path.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_partials(path.parent)
        with naming_failures("create a temporary file for", path):
            fd, temporary = tempfile.mkstemp(prefix=partial_prefix(path.parent, path.name), suffix=PARTIAL_SUFFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if this process dies
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, 0o666 & ~umask)  # the permissions a plain open() would give
                with naming_failures("write", path, temporary):
                    torch.save(checkpoint, handle)
                    handle.flush()
                with naming_failures("fsync (flush to disk)", path, temporary):
                    os.fsync(handle.fileno())
                with naming_failures("rename into place", path, temporary):
                    replace_atomically(Path(temporary), path)  # before the lock goes with the handle
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise

    @override
    def load_checkpoint(self, path: Union[str, Path], map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if Path(path).is_dir():
            raise IsADirectoryError(
                f"{path} is a directory, not a checkpoint file. A sharded checkpoint (a directory holding .metadata and meta.pt) "
                f"loads with strategy='tiered', or converts to one file with `offload-strategy consolidate {path} OUT.ckpt`."
            )
        with naming_failures("read", Path(path)):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


@contextlib.contextmanager
def naming_failures(operation: str, path: Path, temporary: Union[str, Path, None] = None) -> Iterator[None]:
    """An ``OSError`` inside raised again naming the checkpoint, the operation and the errno's
    words (a bare ``[Errno 5] Input/output error`` says none of them); its class and errno kept."""
    try:
        yield
    except OSError as err:
        if err.errno is None:
            raise
        beside = f" (through the temporary file {temporary})" if temporary is not None else ""
        hint = " The disk is full: free space there or save elsewhere." if err.errno == errno.ENOSPC else (
            " The disk or file system reported a failure: check the device (dmesg) before trusting files on it." if err.errno == errno.EIO else "")
        words = (err.strerror or os.strerror(err.errno)).rstrip(".")
        message = f"checkpoint {path}: could not {operation}{beside}: {words}.{hint}"
        try:
            named = type(err)(err.errno, message)
        except TypeError:  # a subclass constructed otherwise
            named = OSError(err.errno, message)
        raise named from err


def fsync_path(path: Path) -> None:
    """A file's bytes, or a directory's entries just created or renamed, survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (a partial file or directory) while it is written, so that
    another process's clean-up leaves it alone; the kernel drops it if this process dies."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), str(a), None, str(b))


def replace_atomically(new: Path, target: Path) -> None:
    """Put ``new`` (a file or a directory) at ``target``, replacing whatever is there, so that a
    crash at any moment leaves either the old or the new one at ``target``."""
    if not os.path.lexists(target) or (new.is_file() and not target.is_dir()):
        os.replace(new, target)
    elif _exchange(new, target):
        remove_path(new)  # the old one, now under the partial name
    else:  # a filesystem without exchange: a short moment with nothing at ``target``
        aside = new.with_name(new.name.removesuffix(PARTIAL_SUFFIX) + ".old")  # no longer than ``new``
        os.rename(target, aside)
        os.rename(new, target)
        remove_path(aside)
    fsync_path(target.parent)


def remove_path(path: Path) -> None:
    """Remove a file or a directory tree; nothing if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


PARTIAL_SUFFIX = ".partial"
FRESH_SECONDS = 10.0  # a partial file younger than this may not be locked by its writer yet
_RANDOM = 8  # the characters mkstemp and mkdtemp add
# ``.<the checkpoint name, cut>.<mkstemp's 8 characters>.partial``, or ``.<8 characters>.partial``
_PARTIAL = re.compile(r"^\.(.+\.)?[A-Za-z0-9_]{8}" + re.escape(PARTIAL_SUFFIX) + "$")


def partial_prefix(directory: Path, name: str) -> str:
    """The prefix of a temporary name beside a checkpoint called ``name`` in ``directory``, for
    ``mkstemp`` or ``mkdtemp`` with ``PARTIAL_SUFFIX``. It holds the whole name where the temporary
    name fits the file system's limit (255 bytes on Linux's); else as much of it as keeps the
    temporary name no longer than ``name`` itself, so that it fits wherever ``name`` does."""
    added = 1 + 1 + _RANDOM + len(PARTIAL_SUFFIX)  # the dot before, the dot after, the random part
    encoded = os.fsencode(name)
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    keep = len(encoded) if len(encoded) + added <= limit else max(0, len(encoded) - added)
    kept = encoded[:keep].decode(errors="ignore")  # whole characters only
    return f".{kept}." if kept else "."


def remove_abandoned_partials(directory: Path) -> list[Path]:
    """Remove this user's partial checkpoint files in ``directory`` whose writer is gone (its lock
    is free); files of another user, or of a save in progress, are left alone."""
    removed = []
    for candidate in directory.glob(f".*{PARTIAL_SUFFIX}"):
        if not _PARTIAL.match(candidate.name):
            continue
        try:
            status = candidate.lstat()
            # another user's, or just created (its writer may not hold the lock yet)
            regular = stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode)  # a sharded checkpoint is a directory
            if not regular or status.st_uid != os.getuid() or time.time() - status.st_mtime < FRESH_SECONDS:
                continue
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a save in progress
        else:
            remove_path(candidate)
            removed.append(candidate)
        finally:
            os.close(fd)
    return removed
