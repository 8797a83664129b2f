"""Checkpoint files written so that a crash never destroys the previous one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
import time
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
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_partials(path.parent)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if this process dies
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, 0o666 & ~umask)  # the permissions a plain open() would give
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
                os.replace(temporary, path)  # before the lock goes with the handle
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)


PARTIAL_SUFFIX = ".partial"
FRESH_SECONDS = 10.0  # a partial file younger than this may not be locked by its writer yet
# ``.<checkpoint name>.<mkstemp's 8 characters>.partial``
_PARTIAL = re.compile(r"^\..+\.[A-Za-z0-9_]{8}" + re.escape(PARTIAL_SUFFIX) + "$")


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
            if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid() or time.time() - status.st_mtime < FRESH_SECONDS:
                continue
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a save in progress
        else:
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
            removed.append(candidate)
        finally:
            os.close(fd)
    return removed
