"""Checkpoint files written so that a crash never destroys the previous one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO
from typing_extensions import override


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file beside its target, flushes it to disk, then renames
    it over the target: a crash or a full disk mid-save leaves the previous checkpoint whole and no
    partial file behind. Remote paths (``s3://...``) are left to Lightning's own writer."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, Path], storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # the permissions a plain open() would give
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)
