"""Convert a sharded checkpoint directory to the single-file checkpoint plain Lightning writes, and back.

    python tools/consolidate.py epoch=3-step=400.ckpt model.ckpt           # directory -> one file
    python tools/consolidate.py model.ckpt epoch=3-step=400.ckpt --sharded # one file -> directory

A sharded checkpoint (``TieredStrategy(state_dict_type="sharded")``, or ``"auto"`` for a model
whose NVMe-resident state exceeds half the host memory) is a ``torch.distributed.checkpoint``
directory plus ``meta.pt``; the single file holds the same dictionary Lightning's
``torch.save`` writes, so ``Trainer(ckpt_path=...)`` resumes from it with any strategy. The one
file is built in memory: converting to it needs host memory for the whole checkpoint; converting
to a directory reads the file memory-mapped. Either way the target appears only once complete.

Both directions load plain data only (``torch.load(weights_only=True)``, and a sharded directory's
metadata by an unpickler that builds only what ``torch.distributed.checkpoint`` writes), so a
checkpoint from elsewhere cannot run code; ``--trusted`` loads any object a checkpoint you trust
holds (its hyperparameters as your own classes, say).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from offload_strategy.checkpoint_io import AtomicCheckpointIO
from offload_strategy.sharded_checkpoint import consolidate, is_sharded_checkpoint, write_sharded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a sharded checkpoint directory, or a single-file checkpoint with --sharded")
    parser.add_argument("target", type=Path, help="where the converted checkpoint goes (replaced if it exists)")
    parser.add_argument("--sharded", action="store_true", help="convert a single file into a sharded directory")
    parser.add_argument("--trusted", action="store_true",
                        help="the source is trusted: load objects other than tensors and plain data (this runs code the file may carry)")
    args = parser.parse_args(argv)
    if not args.source.exists():
        parser.error(f"{args.source} does not exist")
    if args.source.resolve() == args.target.resolve():
        parser.error("the target must differ from the source")
    if args.sharded:
        if not args.source.is_file():
            parser.error(f"{args.source} is not a file: --sharded converts a single-file checkpoint into a directory")
        checkpoint = torch.load(args.source, map_location="cpu", mmap=True, weights_only=not args.trusted)
        write_sharded(checkpoint, args.target)
    else:
        if not is_sharded_checkpoint(args.source):
            parser.error(f"{args.source} is not a sharded checkpoint directory (no .metadata and meta.pt in it); add --sharded to convert a file into one")
        AtomicCheckpointIO().save_checkpoint(consolidate(args.source, weights_only=not args.trusted), args.target)
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
