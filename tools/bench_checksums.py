"""What the NVMe tier's checksums cost: the store's write and read rates with them on and off.

    python tools/bench_checksums.py --size 512MiB --rounds 15  # the table in docs/benchmarks.md
    python tools/bench_checksums.py --path /mnt/nvme --size 4GiB --rounds 5

Writes ``--size`` bytes as tensors of ``--tensor`` bytes each (slices of a page-aligned buffer, as
the pinned slab hands them to the store) under ``--path``, then reads them back, in rounds of one
store with checksums and one without (their order alternating from round to round), so that the
machine's drift falls on both alike. Reported: the hash's own rate on one thread, the median rate
of each direction with and without checksums, and their cost: the median over rounds of the rate
without over the rate with, less one, as a share of the store's rate (the target: at most 5%).
With ``O_DIRECT`` (the store's default where the file system takes it) the page cache is
bypassed, so the rates are the drive's.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import xxhash  # noqa: E402

from offload_strategy import format_bytes, parse_size  # noqa: E402
from offload_strategy.memory.nvme import NvmeStore  # noqa: E402


def hash_rate(buffer: torch.Tensor, repeats: int = 5) -> float:
    """Bytes per second of XXH3-64 over ``buffer`` on one thread."""
    view = memoryview(buffer.numpy())
    xxhash.xxh3_64_intdigest(view)
    start = time.perf_counter()
    for _ in range(repeats):
        xxhash.xxh3_64_intdigest(view, seed=1)
    return repeats * buffer.numel() / (time.perf_counter() - start)


def one_round(path: Path, tensors: list[torch.Tensor], checksums: bool, workers: int) -> tuple[float, float]:
    """(write, read) bytes per second of one store over ``tensors``."""
    total = sum(t.numel() for t in tensors)
    with NvmeStore(path, capacity=total, workers=workers, checksums=checksums) as store:
        start = time.perf_counter()
        for f in [store.write(str(i), t) for i, t in enumerate(tensors)]:
            f.result()
        written = time.perf_counter()
        for f in [store.read(str(i), t) for i, t in enumerate(tensors)]:
            f.result()
        read = time.perf_counter()
        direct = store.direct
    if not direct:
        print("note: the file system refused O_DIRECT; the page cache serves the reads", file=sys.stderr)
    return total / (written - start), total / (read - written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=None, help="where the store's files go (default: a temporary directory)")
    parser.add_argument("--size", default="1GiB", help="bytes written and read per round")
    parser.add_argument("--tensor", default="64MiB", help="bytes per tensor (a unit's parameters or states)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each setting, alternating")
    parser.add_argument("--workers", type=int, default=4, help="the store's I/O threads")
    args = parser.parse_args(argv)
    size, each = parse_size(args.size, "--size"), parse_size(args.tensor, "--tensor")
    count = max(1, size // each)
    buffer = mmap.mmap(-1, count * each)  # page-aligned, as the slab's slots are
    data = torch.frombuffer(buffer, dtype=torch.uint8, count=count * each)
    data.copy_(torch.randint(0, 256, (count * each,), dtype=torch.uint8))
    tensors = [data[i * each : (i + 1) * each] for i in range(count)]
    with tempfile.TemporaryDirectory(dir=args.path) as root:
        rates: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for round_ in range(args.rounds):
            for checksums in ((False, True) if round_ % 2 == 0 else (True, False)):
                rates[checksums].append(one_round(Path(root), tensors, checksums, args.workers))
    print(f"XXH3-64 on one thread: {format_bytes(int(hash_rate(tensors[0])))}/s; {count} tensors of {format_bytes(each)}, "
          f"{args.rounds} rounds, {args.workers} I/O threads")
    print("| direction | checksums off | checksums on | cost |")
    print("|---|---|---|---|")
    for index, direction in enumerate(("write", "read")):
        off = statistics.median(r[index] for r in rates[False])
        on = statistics.median(r[index] for r in rates[True])
        cost = statistics.median(a[index] / b[index] - 1 for a, b in zip(rates[False], rates[True]))
        print(f"| {direction} | {format_bytes(int(off))}/s | {format_bytes(int(on))}/s | {100 * cost:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
