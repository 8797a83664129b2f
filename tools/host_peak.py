"""What is alive at the steps' peak of ``tools/largest.py``'s job: the CPU tensors the steps make,
by thread, operation and the frames that made them, at the most they held together and at the
anonymous resident set's peak, beside the tiers' sizes (the pinned slab, the emulated GPU tier's
arena). Run it with glibc told to map every large block, so that the resident set is what is live:

    MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072 python tools/host_peak.py \\
        --layers 4 --width 2560 --steps 1 --gpu-memory 1GiB --host-memory 1280MiB --nvme-memory 12GiB \\
        --placement nvme --activations auto --skip-probes --nvme-path /tmp/hp

Every argument is ``tools/largest.py``'s. Tensors under 64 KiB and those made before the steps
(the tiers, the model) are not listed; the training thread is traced from the first step's start,
the update worker in each of its tasks. Tracing every operation slows the steps.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import largest
from offload_strategy.hardware.resident import proc_status

MiB = 2**20
SMALLEST = 64 * 2**10  # smaller tensors are not listed
FRAMES = 3  # frames of the project, torch.optim or transformers named for each tensor
OURS = ("offload_strategy", "torch/optim", "transformers")
Key = tuple[str, str, str]  # thread, operation, frames


def _maker() -> str:
    """The innermost frames of the project, the optimizer or the model that made a tensor."""
    frame: Any = sys._getframe(3)
    names: list[str] = []
    while frame is not None and len(names) < FRAMES:
        file = frame.f_code.co_filename
        if any(part in file for part in OURS) and "_python_dispatch" not in file:
            names.append(f"{os.path.basename(file)}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(names)


class Alive:
    """The tensors counted, shared by every thread's mode: bytes by what made them, the most held,
    and what was held then, and at the resident set's peak."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[int, tuple[int, Key]] = {}
        self.bytes = 0
        self.peak: tuple[int, list[tuple[Key, int]]] = (0, [])
        self.rss_peak: tuple[int, int, list[tuple[Key, int]]] = (0, 0, [])
        self.on = False
        self.start = 0

    def by_maker(self) -> list[tuple[Key, int]]:
        totals: collections.Counter = collections.Counter()
        for nbytes, key in self.held.values():
            totals[key] += nbytes
        return totals.most_common(20)

    def add(self, address: int, nbytes: int, key: Key) -> bool:
        with self.lock:
            if address in self.held:
                return False
            self.held[address] = (nbytes, key)
            self.bytes += nbytes
            if self.bytes > self.peak[0]:
                self.peak = (self.bytes, self.by_maker())
        return True

    def freed(self, address: int) -> None:
        with self.lock:
            self.bytes -= self.held.pop(address, (0, None))[0]

    def sample(self, stop: threading.Event) -> None:
        while not stop.wait(0.001):
            if self.on:
                rss = proc_status("RssAnon")
                with self.lock:
                    if rss > self.rss_peak[0]:
                        self.rss_peak = (rss, self.bytes, self.by_maker())


class Traced(TorchDispatchMode):
    """Counts each CPU tensor an operation returns in memory of its own (not an input's)."""

    def __init__(self, alive: Alive) -> None:
        super().__init__()
        self.alive = alive

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.alive.on:
            known = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self._count(t, known, str(func))
        return out

    def _count(self, t: torch.Tensor, known: set[int], op: str) -> None:
        storage = t.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if address in known or nbytes < SMALLEST:
            return
        if self.alive.add(address, nbytes, (threading.current_thread().name, op, _maker())):
            weakref.finalize(storage, self.alive.freed, address)


def trace(alive: Alive, tiers: list[tuple[int, int]]) -> None:
    """The worker's tasks and the training thread's steps run traced; the tiers' sizes noted."""
    from offload_strategy.runtime.tiers import TierMemory
    from offload_strategy.runtime.updates import worker

    run = worker.Pending.run

    def traced_run(self: Any) -> None:
        with Traced(alive):
            run(self)

    worker.Pending.run = traced_run  # type: ignore[method-assign]
    allocate = TierMemory.allocate.__func__  # type: ignore[attr-defined]

    def allocated(cls: type, *args: Any, **kwargs: Any) -> TierMemory:
        memory = allocate(cls, *args, **kwargs)
        tiers.append((memory.slab.nbytes, memory.arena.numel() * memory.arena.element_size()))
        return memory

    TierMemory.allocate = classmethod(allocated)  # type: ignore[method-assign, assignment]

    make = largest.make_callback

    def with_steps_traced(*args: Any, **kwargs: Any) -> Any:
        watch = make(*args, **kwargs)

        class Steps(type(watch)):  # type: ignore[misc]
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                super().on_train_start(trainer, pl_module)
                self.mode = Traced(alive)
                self.mode.__enter__()
                alive.start, alive.on = proc_status("RssAnon"), True

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                alive.on = False
                self.mode.__exit__(None, None, None)
                super().on_train_end(trainer, pl_module)

        watch.__class__ = Steps
        return watch

    largest.make_callback = with_steps_traced


def report(alive: Alive, tiers: list[tuple[int, int]]) -> None:
    print("\ntiers: " + ", ".join(f"slab {slab / MiB:.1f} MiB, emulated GPU arena {arena / MiB:.1f} MiB" for slab, arena in tiers))
    print(f"\nthe most the steps' tensors held together: {alive.peak[0] / MiB:.1f} MiB")
    for (thread, op, frames), nbytes in alive.peak[1]:
        print(f"  {nbytes / MiB:8.1f} MiB  {thread:15} {op:40} {frames}")
    rss, held, makers = alive.rss_peak
    print(f"\nat the anonymous resident set's peak, {rss / MiB:.1f} MiB ({alive.start / MiB:.1f} MiB at the first step's start): {held / MiB:.1f} MiB of them")
    for (thread, op, frames), nbytes in makers:
        print(f"  {nbytes / MiB:8.1f} MiB  {thread:15} {op:40} {frames}")


def main(argv: Optional[list[str]] = None) -> int:
    alive, tiers = Alive(), []  # type: ignore[var-annotated]
    trace(alive, tiers)
    stop = threading.Event()
    sampler = threading.Thread(target=alive.sample, args=(stop,), name="peak-sampler", daemon=True)
    sampler.start()
    try:
        return largest.main(argv)
    finally:
        stop.set()
        sampler.join()
        time.sleep(0)
        report(alive, tiers)


if __name__ == "__main__":
    sys.exit(main())
