"""Measure this machine's transfer paths, and the NVMe store against the raw disk under it.

    offload-strategy probe --path /mnt/nvme/offload --size 1GiB [--workers 4]

Prints one Markdown table: host memory copy bandwidth; raw sequential write and read of the disk
holding ``--path`` (a minimal O_DIRECT pwritev/preadv loop over a thread pool, 8 MiB requests);
``NvmeStore`` write and read of the same bytes as 64 MiB tensors from a page-aligned buffer; the
store/raw ratios (the target is >= 80%); and pinned host<->GPU copies where CUDA is present.
Every figure is the best of ``--repeat`` runs, and the raw and store runs alternate within each
repetition, so drift of the machine hits both alike. Bandwidths are GB/s (10^9 bytes/s). The
first repetition writes fresh files, the later ones overwrite them (no block allocation), so the
best write figures are overwrite speed; the fresh-file figures of the first repetition are shown
beside them.

O_DIRECT bypasses the page cache, so reads really come from the device (or, in a VM, from
whatever caches the virtual disk on the host). Where the file system refuses O_DIRECT both paths
fall back to buffered I/O and the table says so: those figures are inflated by the page cache.
Every file written lives in a private directory under ``--path`` that is removed at the end,
also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional

import torch

from ..config import format_bytes, parse_size
from ..hardware.probe import probe_hardware
from .nvme import NvmeStore

CHUNK = 8 * 1024**2
TENSOR = 64 * 1024**2


def best_gbps(nbytes: int, run: Callable[[], float], repeat: int) -> float:
    """``run`` returns the seconds it took; keep the fastest of ``repeat``."""
    return nbytes / min(run() for _ in range(repeat)) / 1e9


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount = fields[1]
                if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def raw_io(file: Path, buf: memoryview, pool: ThreadPoolExecutor, write: bool, direct: bool) -> float:
    """One sequential pass over ``file`` in CHUNK requests spread over ``pool``; seconds taken."""
    flags = (os.O_CREAT | os.O_WRONLY if write else os.O_RDONLY) | (os.O_DIRECT if direct else 0)
    fd = os.open(file, flags, 0o600)

    def one(offset: int) -> None:
        view, done = buf[offset : offset + CHUNK], 0
        while done < len(view):
            io = os.pwritev if write else os.preadv
            count = io(fd, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(5, f"no progress at offset {offset + done} of {file}")
            done += count

    try:
        start = time.perf_counter()
        for f in [pool.submit(one, off) for off in range(0, len(buf), CHUNK)]:
            f.result()
        return time.perf_counter() - start
    finally:
        os.close(fd)


def store_io(store: NvmeStore, tensors: list[torch.Tensor], write: bool) -> float:
    start = time.perf_counter()
    futures = [(store.write if write else store.read)(f"t{i}", t) for i, t in enumerate(tensors)]
    for f in wait(futures).done:
        f.result()
    return time.perf_counter() - start


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, repeat: int) -> float:
    """One copy between pinned host memory and the GPU, timed with CUDA events; the fastest of ``repeat``."""
    def run() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run()  # warm-up: context, first-touch
    return best_gbps(src.numel() * src.element_size(), run, repeat)


def cuda_rows(nbytes: int, repeat: int, priced_share: Optional[float] = None) -> list[tuple[str, str, str]]:
    if not torch.cuda.is_available():
        return [("pinned H2D / D2H", "-", "skipped: torch.cuda.is_available() is False on this machine")]
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = [(name, f"{copy_gbps(dst, src, repeat):.2f}", f"{torch.cuda.get_device_name()}, {format_bytes(nbytes)} (torch pin_memory)")
            for name, dst, src in (("pinned H2D", device, pinned), ("pinned D2H", pinned, device))]
    rows.append(gpu_memory_row(device, repeat, priced_share))
    return rows


def gpu_memory_row(device: torch.Tensor, repeat: int, priced_share: Optional[float] = None) -> tuple[str, str, str]:
    """A copy within GPU memory, which reads and writes every byte: what the step model's
    memory-bound work runs at, beside the datasheet figure it prices with (at ``priced_share`` of it)."""
    other = torch.empty_like(device)

    def run() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        other.copy_(device)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run()
    rate = best_gbps(2 * device.numel(), run, repeat)
    datasheet = probe_hardware().gpu_memory_gbps
    priced = "" if priced_share is None else f"; the step model prices memory-bound work at {priced_share:.0%}"
    against = (f"{rate / datasheet:.0%} of the datasheet's {datasheet:g} GB/s{priced}"
               if datasheet else "no datasheet figure known for this GPU (+hardware.gpu_memory_gbps= to price it)")
    return ("GPU memory (copy: read + write)", f"{rate:.1f}", f"{format_bytes(device.numel())} copied within the GPU; {against}")


def measure(work: Path, size: int, workers: int, repeat: int, priced_share: Optional[float] = None) -> list[tuple[str, str, str]]:
    src_map, dst_map = mmap.mmap(-1, size), mmap.mmap(-1, size)  # page-aligned, as the pinned slab is
    src = torch.frombuffer(src_map, dtype=torch.uint8)
    dst = torch.frombuffer(dst_map, dtype=torch.uint8)
    src.view(torch.int64).copy_(torch.arange(size // 8))  # not zeros: nothing may shortcut the data
    dst.zero_()  # fault the pages in before any timing

    def host_copy() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    rows = [("host memory copy", f"{best_gbps(size, host_copy, repeat):.2f}", f"torch copy_ of {format_bytes(size)} uint8, {torch.get_num_threads()} threads")]
    raw_file = work / "raw.bin"
    times: dict[str, list[float]] = {k: [] for k in ("raw_w", "store_w", "raw_r", "store_r")}
    with NvmeStore(work, capacity=size, workers=workers) as store, ThreadPoolExecutor(workers) as pool:
        direct = store.direct
        srcs = [src[i : i + TENSOR] for i in range(0, size, TENSOR)]
        dsts = [dst[i : i + TENSOR] for i in range(0, size, TENSOR)]
        for rep in range(repeat):  # side by side, who goes first alternating: drift hits both alike
            for who in ("raw", "store") if rep % 2 == 0 else ("store", "raw"):
                if who == "raw":
                    times["raw_w"].append(raw_io(raw_file, memoryview(src_map), pool, True, direct))
                else:
                    times["store_w"].append(store_io(store, srcs, True))
            for who in ("raw", "store") if rep % 2 == 0 else ("store", "raw"):
                if who == "raw":
                    times["raw_r"].append(raw_io(raw_file, memoryview(dst_map), pool, False, direct))
                else:
                    dst.zero_()  # so the check below sees what the store read
                    times["store_r"].append(store_io(store, dsts, False))
        if not torch.equal(src, dst):
            raise RuntimeError(f"NvmeStore read back different bytes than it wrote in {store.path}.")
        raw_file.unlink()
    gbps = {k: size / min(v) / 1e9 for k, v in times.items()}
    mode = "O_DIRECT" if direct else f"buffered: {fs_type(work)} refused O_DIRECT, figures inflated by the page cache"
    how = f"{format_bytes(size)}, {workers} threads, {format_bytes(CHUNK)} requests, {mode}"
    fresh = {k: size / v[0] / 1e9 for k, v in times.items()}
    rows += [
        ("raw disk write, fresh file", f"{fresh['raw_w']:.2f}", "first repetition only: the file system allocates blocks"),
        ("NvmeStore write, fresh files", f"{fresh['store_w']:.2f}", "first repetition only: the file system allocates blocks"),
        ("raw disk write", f"{gbps['raw_w']:.2f}", f"pwritev, {how}"),
        ("raw disk read", f"{gbps['raw_r']:.2f}", f"preadv, {how}"),
        ("NvmeStore write", f"{gbps['store_w']:.2f}", f"{len(srcs)} tensors of {format_bytes(TENSOR)}, all in flight"),
        ("NvmeStore read", f"{gbps['store_r']:.2f}", "same tensors, read back and verified"),
        ("store / raw, write", f"{gbps['store_w'] / gbps['raw_w']:.0%}", "target >= 80%"),
        ("store / raw, read", f"{gbps['store_r'] / gbps['raw_r']:.0%}", "target >= 80%"),
    ]
    return rows + cuda_rows(min(size, 1024**3), repeat, priced_share)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``probe`` command's arguments (``offload-strategy probe``)."""
    parser.add_argument("--path", required=True, help="directory on the disk to measure (the NVMe tier's path)")
    parser.add_argument("--size", default="1GiB", help="bytes per pass, e.g. 1GiB (host memory needs twice this)")
    parser.add_argument("--workers", type=int, default=4, help="I/O threads for raw and store alike")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the best counts")


def run(args: argparse.Namespace, priced_share: Optional[float] = None) -> int:
    """``offload-strategy probe``: the table, every file it wrote removed (also on Ctrl-C or SIGTERM)."""
    size = -(-parse_size(args.size, "--size") // TENSOR) * TENSOR
    root = Path(args.path).expanduser().absolute()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    created = [d for d in (root, *root.parents) if not d.exists()]  # removed again at the end if empty
    root.mkdir(parents=True, exist_ok=True)
    work: Optional[Path] = None
    try:
        free = shutil.disk_usage(root).free
        if free < 2 * size + TENSOR:
            raise SystemExit(f"--path {root} has {format_bytes(free)} free; the probe needs {format_bytes(2 * size + TENSOR)} (twice --size): "
                             "lower --size or pick another disk.")
        work = Path(tempfile.mkdtemp(prefix=f"probe-{os.getpid()}-", dir=root))
        rows = measure(work, size, args.workers, args.repeat, priced_share)
    except KeyboardInterrupt:
        print("interrupted; removing the probe's files", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        for directory in created:
            if not any(directory.iterdir()):
                directory.rmdir()
    print(f"path {root} ({fs_type(root.resolve())}), {os.cpu_count()} CPUs, torch {torch.__version__}, best of {args.repeat}\n")
    print("| measurement | GB/s | how |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0

