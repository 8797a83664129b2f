"""Checkpoints written and read tensor by tensor, so that the model is never gathered in memory.

A sharded checkpoint is a directory in ``torch.distributed.checkpoint``'s format, laid out as
Lightning's FSDP strategy lays out its sharded checkpoints::

    epoch=0-step=100.ckpt/
        .metadata          where each tensor lies (DCP)
        __0_0.distcp       the tensors: {"model": state dict, "optimizer_0": optimizer state dict, ...}
        meta.pt            the rest of Lightning's checkpoint (loops, callbacks, schedulers, hparams)

Writing: the state dicts handed in may hold *stand-ins* for values that live on NVMe (the
placeholders their parameters and optimizer states point at between steps); ``readers`` maps each
stand-in's storage to a function that reads its true value, which DCP calls as it writes that
tensor, so one unit's values are in memory at a time. The directory is written beside its target
and swapped in whole (``checkpoint.atomic.replace_atomically``): a crash mid-save leaves the previous
checkpoint.

Reading: :class:`ShardedCheckpoint` opens the directory and hands out mappings whose values are
read when asked for; :meth:`ShardedCheckpoint.load_model` reads each parameter straight into its
tensor, or, for a parameter built without memory (``construction/deferred.py``), when the engine places it.

DCP keeps its ``.metadata`` as a pickle and every value that is not a tensor (an optimizer's
hyperparameters) as ``torch.save`` bytes, which it loads with ``weights_only=False``: a directory
from elsewhere could run code as it loads. Here ``.metadata`` is read by an unpickler that builds
only the classes DCP writes there (``_METADATA_CLASSES``) and refuses the directory otherwise, and
the other values load under ``weights_only`` as a single-file checkpoint's do (``True`` unless the
caller says ``False``, as ``torch.load``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from .atomic import (
    PARTIAL_SUFFIX, fsync_path, locked, naming_failures, partial_prefix, remove_abandoned_partials, remove_path, replace_atomically,
)
from ..runtime.params.lending import storage_address
from ..construction.weights import WeightsMismatchError

META_FILE = "meta.pt"  # Lightning's FSDP strategy names its non-tensor part so
MODEL = "model"
_DCP_METADATA = ".metadata"

Readers = dict[int, Callable[[], torch.Tensor]]  # a stand-in's storage address -> its true value


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / _DCP_METADATA).is_file()


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


class _StandInPlanner(DefaultSavePlanner):
    """Writes each stand-in's true value, read when DCP reaches it."""

    def __init__(self, readers: Readers) -> None:
        super().__init__()
        self.readers = readers

    def resolve_data(self, write_item: Any) -> Any:
        value = self.lookup_object(write_item.index)
        if torch.is_tensor(value) and value.numel() and storage_address(value) in self.readers:
            return self.readers[storage_address(value)]()
        return super().resolve_data(write_item)


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint -> (the tensors DCP writes, the rest for ``meta.pt``)."""
    rest = dict(checkpoint)
    tensors: dict[str, Any] = {}
    if "state_dict" in rest:
        tensors[MODEL] = rest.pop("state_dict")
    for i, state in enumerate(rest.pop("optimizer_states", [])):
        tensors[optimizer_key(i)] = state
    return tensors, rest


def write_sharded(checkpoint: Mapping[str, Any], path: Union[str, Path], readers: Optional[Readers] = None) -> None:
    """Write ``checkpoint`` as a sharded checkpoint directory at ``path``, replacing what is there
    (a file or a directory) only once the whole directory is on disk."""
    path = Path(path)
    if "://" in str(path):
        raise ValueError(f"a sharded checkpoint is a local directory; {str(path)!r} is remote. Save to a local path, or use state_dict_type='full'.")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_partials(path.parent)
    tensors, rest = split_checkpoint(checkpoint)
    temporary = Path(tempfile.mkdtemp(prefix=partial_prefix(path.parent, path.name), suffix=PARTIAL_SUFFIX, dir=path.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o777 & ~umask)  # what a plain mkdir gives, not mkdtemp's private mode
        with locked(temporary):
            # One thread, no read-ahead: tensors are resolved in the state dict's order, unit by
            # unit. A file per tensor: DCP's writer keeps each tensor of a file until the file
            # closes. Flushed together at the end rather than each as it closes (1.5x faster here).
            writer = dcp.FileSystemWriter(temporary, single_file_per_rank=False, sync_files=False, thread_count=1, per_thread_copy_ahead=0)
            with naming_failures("write", path, temporary):
                with _single_process():
                    dcp.save(tensors, storage_writer=writer, planner=_StandInPlanner(readers or {}), no_dist=True)
                with open(temporary / META_FILE, "wb") as handle:
                    torch.save(rest, handle)
            with naming_failures("fsync (flush to disk)", path, temporary):
                for written in temporary.iterdir():
                    fsync_path(written)
                fsync_path(temporary)
            with naming_failures("rename into place", path, temporary):
                replace_atomically(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the error that stopped the save is the one to see
            remove_path(temporary)
        raise


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP in one process: without its warning that says so, and with the error that stopped it
    (a full disk, a failed read) raised as itself instead of wrapped in a ``BaseException``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        try:
            yield
        except CheckpointException as wrapped:
            failures = [error for error, _ in wrapped.failures.values()]
            if failures and isinstance(failures[0], Exception):
                raise failures[0] from None
            raise


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A sharded checkpoint's metadata asks for more than DCP's own classes: it is refused unread."""


# what DCP's FileSystemWriter pickles into ``.metadata``: its dataclasses, torch's sizes, dtypes and
# layouts, and the path it was written to
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP writes into ``.metadata``; anything else refuses the checkpoint."""

    def __init__(self, file: Any, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where} asks to build {module}.{name}, which torch.distributed.checkpoint never writes there: the "
            f"checkpoint was not written by it (or was altered) and loading it could run code it carries. It is "
            f"refused; load only checkpoints from a source you trust, and re-save a trusted one."
        )


def read_dcp_metadata(directory: Path) -> Metadata:
    """A DCP directory's ``.metadata`` through :class:`_MetadataUnpickler`."""
    where = directory / _DCP_METADATA
    with open(where, "rb") as handle:
        metadata = _MetadataUnpickler(handle, where).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{where} holds a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata.")
    return metadata


class _CachedReader(dcp.FileSystemReader):
    """DCP's reader, reading the directory's metadata once for many small loads, through the
    allowlisting unpickler."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._directory = path
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            metadata = read_dcp_metadata(self._directory)
            storage_meta: Optional[StorageMeta] = getattr(metadata, "storage_meta", None)
            if storage_meta is None:  # as DCP's own reader does
                storage_meta = metadata.storage_meta = StorageMeta()
            storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading values that are not tensors under ``weights_only`` (DCP's own loads
    them with ``weights_only=False``)."""

    def __init__(self, weights_only: bool) -> None:
        super().__init__()
        self.weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self.weights_only:
            torch.load(value, weights_only=True)  # raises where the value holds anything but plain data
            value.seek(0)
        super().load_bytes(read_item, value)


Path_ = tuple[Union[str, int], ...]  # a value's place in the nested state: keys, and indices into lists


def _nest(paths: Mapping[Path_, Any]) -> dict[str, Any]:
    # DCP names nested values by their keys as strings (``optimizer_0.state.3.exp_avg``)
    nested: dict[str, Any] = {}
    for path, value in paths.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return nested


def _find(nested: Mapping[str, Any], path: Path_) -> Any:
    for key in path:
        nested = nested[str(key)]
    return nested


def assemble(values: Mapping[Path_, Any], strip: int = 0) -> Any:
    """Nested values from their paths (the first ``strip`` keys dropped): lists where the keys
    were list indices, integer keys where an optimizer keys its states by parameter index."""
    root: dict[Any, Any] = {}
    for path, value in values.items():
        node = root
        for key in path[strip:-1]:
            node = node.setdefault(_original_key(key), {})
        node[_original_key(path[-1])] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, _ListIndex) for k in node):
        return [node[k] for k in sorted(node)]
    return node


class _ListIndex(int):
    """An index into a list (DCP keeps it an ``int`` in the path), told apart from a mapping key
    that looked like a number."""


def _original_key(key: Union[str, int]) -> Any:
    if isinstance(key, int):
        return _ListIndex(key)
    # DCP stores mapping keys as strings; an optimizer's per-parameter states are keyed by index
    return int(key) if key.isdigit() else key


class ShardedCheckpoint:
    """A sharded checkpoint directory, read a few tensors at a time. ``weights_only``: what values
    other than tensors may hold, as for ``torch.load`` (``None``: its default, ``True``)."""

    def __init__(self, path: Union[str, Path], weights_only: Optional[bool] = None) -> None:
        self.path = Path(path)
        self.weights_only = weights_only is not False
        if not is_sharded_checkpoint(self.path):
            raise FileNotFoundError(f"{self.path} is not a sharded checkpoint directory (it needs {_DCP_METADATA} and {META_FILE}).")
        self._reader = _CachedReader(self.path)
        metadata = self._reader.read_metadata()
        self.entries: dict[Path_, Any] = {tuple(metadata.planner_data[fqn]): md for fqn, md in metadata.state_dict_metadata.items()}

    def under(self, prefix: Path_) -> list[Path_]:
        return [path for path in self.entries if path[: len(prefix)] == prefix]

    def read(self, paths: list[Path_], into: Optional[Mapping[Path_, torch.Tensor]] = None) -> dict[Path_, Any]:
        """The values at ``paths``, each tensor read into ``into[path]`` where given, else into a new one."""
        into = into or {}
        targets = {path: into[path] if path in into else self._empty(path) for path in paths}
        if not targets:
            return {}
        nested = _nest(targets)
        with naming_failures("read", self.path), _single_process():
            dcp.load(nested, storage_reader=self._reader, planner=_LoadPlanner(self.weights_only), no_dist=True)
        return {path: _find(nested, path) for path in paths}

    def _empty(self, path: Path_) -> Any:
        entry = self.entries[path]
        if isinstance(entry, TensorStorageMetadata):
            return torch.empty(entry.size, dtype=entry.properties.dtype)
        assert isinstance(entry, BytesStorageMetadata)
        return None  # DCP puts the unpickled object there

    def meta(self, load: Optional[Callable[[Path], dict[str, Any]]] = None) -> dict[str, Any]:
        """``meta.pt``, by ``load`` where given, else by ``torch.load`` under this checkpoint's ``weights_only``."""
        if load is None:
            return torch.load(self.path / META_FILE, weights_only=self.weights_only)
        return load(self.path / META_FILE)

    def optimizer_count(self) -> int:
        return len({path[0] for path in self.entries if str(path[0]).startswith("optimizer_")})

    def model_state(self) -> LazyState:
        return LazyState(self, (MODEL,))

    def optimizer_state(self, index: int) -> dict[str, Any]:
        """An optimizer's state dict whose per-parameter states are read when asked for."""
        groups = (optimizer_key(index), "param_groups")
        return {"state": LazyState(self, (optimizer_key(index), "state")), "param_groups": assemble(self.read(self.under(groups)), strip=2) or []}

    def load_model(
        self, module: nn.Module, strict: bool, defer: Callable[[nn.Parameter], bool], set_source: Callable[[nn.Parameter, Callable[[], torch.Tensor]], None]
    ) -> None:
        """Read the module's state into it: plain tensors in place now, each parameter ``defer``
        claims when its home is ready (``set_source``)."""
        state = module.state_dict(keep_vars=True)  # the tensors themselves: reading them would compute deferred ones
        stored = {str(path[1]): path for path in self.entries if path[0] == MODEL and len(path) == 2}
        _check_names(state, stored, self.entries, strict, self.path)
        now: dict[Path_, torch.Tensor] = {}
        claimed: set[int] = set()
        for name, value in state.items():
            if name not in stored or not torch.is_tensor(value) or id(value) in claimed:
                continue
            claimed.add(id(value))  # a tied parameter is read once
            if isinstance(value, nn.Parameter) and defer(value):
                set_source(value, self._reader_for(stored[name]))
            else:
                now[stored[name]] = value.detach()
        self.read(list(now), into=now)

    def _reader_for(self, path: Path_) -> Callable[[], torch.Tensor]:
        return lambda: self.read([path])[path]


def _check_names(state: Mapping[str, Any], stored: Mapping[str, Path_], entries: Mapping[Path_, Any], strict: bool, where: Path) -> None:
    missing = [name for name in state if name not in stored]
    unexpected = [name for name in stored if name not in state]
    wrong = [
        f"{name}: {tuple(entries[stored[name]].size)} in the checkpoint, {tuple(value.shape)} in the model"
        for name, value in state.items()
        if name in stored and torch.is_tensor(value) and isinstance(entries[stored[name]], TensorStorageMetadata)
        and tuple(entries[stored[name]].size) != tuple(value.shape)
    ]
    if wrong or (strict and (missing or unexpected)):
        raise WeightsMismatchError(str(where), missing if strict else [], unexpected if strict else [], wrong)


class LazyState(Mapping):
    """A nested part of a sharded checkpoint (the model's state dict, an optimizer's per-parameter
    states) as a read-only mapping: each value is read from disk when looked up."""

    def __init__(self, checkpoint: ShardedCheckpoint, prefix: Path_) -> None:
        self.checkpoint, self.prefix = checkpoint, prefix
        self._paths: dict[Any, list[Path_]] = {}
        for path in checkpoint.under(prefix):
            key = path[len(prefix)]
            self._paths.setdefault(_original_key(key) if len(path) > len(prefix) + 1 else key, []).append(path)

    def __getitem__(self, key: Any) -> Any:
        paths = self._paths[key]
        values = self.checkpoint.read(paths)
        if len(paths) == 1 and len(paths[0]) == len(self.prefix) + 1:
            return values[paths[0]]
        return assemble(values, strip=len(self.prefix) + 1)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def consolidate(directory: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The whole checkpoint a sharded directory holds, as the single-file checkpoint plain
    Lightning writes (it needs the whole state in memory); ``weights_only`` as for ``torch.load``."""
    source = ShardedCheckpoint(directory, weights_only)
    checkpoint = source.meta()
    tensors = assemble(source.read(list(source.entries)))
    checkpoint["state_dict"] = tensors.pop(MODEL, {})
    count = source.optimizer_count()
    if count:
        checkpoint["optimizer_states"] = [tensors.pop(optimizer_key(i)) for i in range(count)]
    return checkpoint
