"""Host memory the activation swap holds against what its layout swaps there.

    python tools/swap_host_bytes.py                      # the table in docs/benchmarks.md
    python tools/swap_host_bytes.py --layers 8 --width 512

A GPT-2 trains with every block swapped to host memory, then with half the blocks swapped to NVMe.
At the end of each step it reads, from the swap's own books: the bytes the layout swapped to host
memory and to NVMe, the host memory the swap's buffers hold (each distinct storage once), and what
PyTorch's pinned caching allocator would have held for the same buffers on a GPU (each rounded up
to a power of two, as it rounds ``torch.empty(pin_memory=True)``). Runs on any version of the code
that keeps its copies in ``ActivationSwap.stats.blocks``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.demos import gpt2_config  # noqa: E402
from tools.common import StepTimer, add_run_arguments, fit  # noqa: E402


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SwapBooks(StepTimer):
    """Per step, besides its time: (swapped to host, swapped to NVMe, host bytes held, held under a
    power-of-two allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, int, int, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        swap = trainer.strategy.tiered.activations.policies_in_use.swap
        storages: dict[int, int] = {}
        for copies in swap.stats.blocks.values():
            for c in copies:
                if c.host is not None:
                    storage = c.host.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        memory = getattr(swap, "memory", None)  # the swap's own slab, where there is one
        held = memory.held_bytes if memory is not None else sum(storages.values())
        pinned = held if memory is not None else sum(_power_of_two(n) for n in storages.values())
        self.rows.append((swap.stats.host_bytes, swap.stats.nvme_bytes, held, pinned))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, layers=6, width=256, seq_len=256, batch_size=8, steps=6, warmup=2)
    args = parser.parse_args(argv)
    config = gpt2_config(args.layers, args.width, positions=args.seq_len)
    half = args.layers // 2
    layouts = {"every block to host": ("swap_host",) * args.layers,
               "half to NVMe": ("swap_host",) * (args.layers - half) + ("swap_nvme",) * half}
    print("| layout | swapped to host | swapped to NVMe | host memory the swap holds | ... with a power-of-two pinned allocator |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name, layout in layouts.items():
            books = SwapBooks()
            strategy = TieredStrategy(policy={"name": "auto", "activations": layout}, nvme_path=Path(root) / "nvme", host_memory="4GiB")
            fit(strategy, config, args, Path(root) / name.replace(" ", "_"), books, args.steps)
            host, nvme, held, pinned = books.rows[-1]  # the last step: every step swaps the same shapes
            print(f"| {name} | {format_bytes(host)} | {format_bytes(nvme)} | {format_bytes(held)} | {format_bytes(pinned)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
