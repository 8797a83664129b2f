"""How long backward's thread waits to read ``swap_nvme`` activations back, and the host memory the swap holds.

    python tools/swap_reads.py                      # the table in docs/benchmarks.md
    python tools/swap_reads.py --layers 8 --width 512

A GPT-2 trains with every block's activations swapped to NVMe (the store's own directory under
``--nvme-path``, O_DIRECT where the file system allows it). Per step after the warm-up it measures
the wall time of the step and of its backward (Lightning's ``on_before_backward`` to
``on_after_backward``), the time autograd's thread spent inside the swap's unpack hook (waiting
for reads from NVMe and launching the copies into the GPU tier), and at the step's end the host
memory the swap holds against its limit. Prints the medians. Runs on any version of the code that
has ``ActivationSwap._unpack``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.demos import gpt2_config  # noqa: E402
from offload_strategy.runtime.activations.swap import ActivationSwap  # noqa: E402
from tools.common import StepTimer, add_run_arguments, fit  # noqa: E402


class UnpackClock:
    """Seconds spent inside ``ActivationSwap._unpack`` (wrapped for the run), since the last ``take``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._unpack = ActivationSwap._unpack

    def __enter__(self) -> "UnpackClock":
        unpack = self._unpack

        def timed(swap: ActivationSwap, packed: Any) -> Any:
            start = time.perf_counter()
            try:
                return unpack(swap, packed)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(ActivationSwap, "_unpack", timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(ActivationSwap, "_unpack", self._unpack)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class BackwardBooks(StepTimer):
    """Per step, besides its time: backward's seconds, those inside the swap's unpack hook, and
    the host bytes the swap holds with its limit."""

    def __init__(self, clock: UnpackClock) -> None:
        super().__init__()
        self.clock = clock
        self.rows: list[tuple[float, float, int, Optional[int]]] = []
        self._backward = 0.0
        self._started = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_start(trainer, *args)
        self.clock.take()

    def on_before_backward(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_after_backward(self, *args: Any) -> None:
        self._backward = time.perf_counter() - self._started

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        swap = trainer.strategy.tiered.activations.policies_in_use.swap
        memory = swap.memory
        self.rows.append((self._backward, self.clock.take(), memory.held_bytes, memory.limit))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, layers=6, width=256, seq_len=256, batch_size=8, steps=8, warmup=2)
    parser.add_argument("--nvme-path", type=Path, default=None, help="where the NVMe store goes (default: a temporary directory)")
    args = parser.parse_args(argv)
    config = gpt2_config(args.layers, args.width, positions=args.seq_len)
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as root, UnpackClock() as clock:
        books = BackwardBooks(clock)
        strategy = TieredStrategy(policy={"name": "auto", "activations": "swap_nvme"}, nvme_path=Path(root) / "nvme", host_memory="4GiB")
        fit(strategy, config, args, Path(root) / "run", books, args.steps)
    rows, steps = books.rows[args.warmup :], books.times[args.warmup :]
    backward, unpack = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    held, limit = max(r[2] for r in rows), rows[-1][3]
    swapped = books.metrics[-1].get("activations/swapped_nvme_bytes", 0.0)
    print("| swapped to NVMe per step | step (median) | backward | in the unpack hook | host memory the swap holds (most) | its limit |")
    print("|---|---|---|---|---|---|")
    print(f"| {format_bytes(int(swapped))} | {1e3 * statistics.median(steps):.0f} ms | {1e3 * backward:.0f} ms | {1e3 * unpack:.0f} ms "
          f"| {format_bytes(held)} | {format_bytes(limit) if limit is not None else 'none'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
