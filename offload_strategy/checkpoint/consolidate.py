"""Convert a sharded checkpoint directory to the single-file checkpoint plain Lightning writes, and back.

    offload-strategy consolidate epoch=3-step=400.ckpt model.ckpt           # directory -> one file
    offload-strategy consolidate model.ckpt epoch=3-step=400.ckpt --sharded # one file -> directory

A sharded checkpoint (``TieredStrategy(state_dict_type="sharded")``, or ``"auto"`` for a model
whose NVMe-resident state exceeds half the host memory) is a ``torch.distributed.checkpoint``
directory plus ``meta.pt``; the single file holds the same dictionary Lightning's
``torch.save`` writes, so ``Trainer(ckpt_path=...)`` resumes from it with any strategy. The one
file is built in memory: converting to it needs host memory for the whole checkpoint; converting
to a directory reads the file memory-mapped. Either way the target appears only once complete.

Both directions load plain data only (``torch.load(weights_only=True)``, and a sharded directory's
metadata by an unpickler that builds only what ``torch.distributed.checkpoint`` writes), so a
checkpoint from elsewhere cannot run code; ``trusted`` loads any object a checkpoint you trust
holds (its hyperparameters as your own classes, say).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .atomic import AtomicCheckpointIO
from .sharded import consolidate, is_sharded_checkpoint, write_sharded


def to_single_file(source: Path, target: Path, trusted: bool = False) -> None:
    """The sharded checkpoint directory ``source`` as one file at ``target`` (replaced if it exists)."""
    _check_paths(source, target)
    if not is_sharded_checkpoint(source):
        raise ValueError(f"{source} is not a sharded checkpoint directory (no .metadata and meta.pt in it); "
                         "convert a single file into one with --sharded (to_sharded).")
    AtomicCheckpointIO().save_checkpoint(consolidate(source, weights_only=not trusted), target)


def to_sharded(source: Path, target: Path, trusted: bool = False) -> None:
    """The single-file checkpoint ``source`` as a sharded directory at ``target`` (replaced if it exists)."""
    _check_paths(source, target)
    if not source.is_file():
        raise ValueError(f"{source} is not a file: --sharded converts a single-file checkpoint into a directory.")
    write_sharded(torch.load(source, map_location="cpu", mmap=True, weights_only=not trusted), target)


def _check_paths(source: Path, target: Path) -> None:
    if not source.exists():
        raise ValueError(f"{source} does not exist.")
    if source.resolve() == target.resolve():
        raise ValueError(f"the target must differ from the source ({source}).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``consolidate`` command's arguments (``offload-strategy consolidate``)."""
    parser.add_argument("source", type=Path, help="a sharded checkpoint directory, or a single-file checkpoint with --sharded")
    parser.add_argument("target", type=Path, help="where the converted checkpoint goes (replaced if it exists)")
    parser.add_argument("--sharded", action="store_true", help="convert a single file into a sharded directory")
    parser.add_argument("--trusted", action="store_true",
                        help="the source is trusted: load objects other than tensors and plain data (this runs code the file may carry)")


def run(args: argparse.Namespace) -> int:
    """``offload-strategy consolidate``: one direction or the other, a refusal that says why."""
    convert = to_sharded if args.sharded else to_single_file
    try:
        convert(args.source, args.target, trusted=args.trusted)
    except ValueError as error:
        raise SystemExit(f"offload-strategy consolidate: {error}") from None
    print(f"wrote {args.target}")
    return 0
