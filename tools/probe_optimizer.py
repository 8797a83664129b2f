"""The CPU optimizer's rate on this machine beside the step model's figure for it.

    python tools/probe_optimizer.py                       # one thread, every core, 2 ranks at once
    python tools/probe_optimizer.py --params 32M --ranks 4 --repeat 5

The step model prices an offloaded unit's update at ``CPU_PARAMS_PER_S_PER_CORE`` parameters per
second per core, bounded by what the memory channels move at 28 bytes per fp32 parameter
(``estimate/analytic.py::cpu_update_rate``), and data-parallel ranks on one machine share its cores
and channels (``HardwareSpec.rank_share``). This measures each: fused ``AdamW`` steps (what the
runtime runs for units in host memory on a GPU machine; torch's default kernel beside it) over ``--params`` fp32 parameters on one
thread, on every core, and in ``--ranks`` processes at once with an equal share of the cores each;
the memory channels as the traffic of a large copy (its bytes read plus written). Prints one
table: measured G parameters/s, the model's figure for the same cores and channels, and the ratio.
The last line gives the overrides that make a what-if (``offload-strategy simulate``) use this machine's
figures. Every figure is the best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_strategy.config import HardwareSpec, parse_size  # noqa: E402
from offload_strategy.estimate.analytic import ADAM_BYTES_PER_PARAMETER, cpu_update_rate  # noqa: E402


def adam_rate(params: int, threads: int, repeat: int, fused: bool = True) -> float:
    """Parameters per second of AdamW steps over ``params`` fp32 parameters on ``threads`` threads:
    the fused kernel (what units in host memory run on a GPU machine), or torch's default (foreach)."""
    torch.set_num_threads(threads)
    weight = torch.randn(params)
    weight.grad = torch.randn(params)
    optimizer = torch.optim.AdamW([weight], lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    optimizer.step()  # the states are made and faulted in: not timed
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return params / best


def _rank(params: int, threads: int, repeat: int, start: "multiprocessing.synchronize.Barrier", out: "multiprocessing.queues.Queue") -> None:
    torch.set_num_threads(threads)
    start.wait()  # every rank's steps run at the same time, as data-parallel ranks' updates do
    out.put(adam_rate(params, threads, repeat))


def ranks_rate(params: int, ranks: int, threads: int, repeat: int) -> float:
    """The slowest of ``ranks`` processes stepping at once, ``threads`` threads each (per rank)."""
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(ranks), context.Queue()
    workers = [context.Process(target=_rank, args=(params, threads, repeat, start, out)) for _ in range(ranks)]
    for worker in workers:
        worker.start()
    rates = [out.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return min(rates)


def channel_gbps(nbytes: int, repeat: int) -> float:
    """What the memory channels move in a copy: its bytes read and written, per second."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src).zero_()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def model_rate(cores: int, gbps: float) -> float:
    spec = HardwareSpec(name="here", gpu="-", gpu_memory=0, gpu_bf16_tflops=None, gpu_fp16_tflops=None, h2d_gbps=None, d2h_gbps=None,
                        host_memory=0, cpu_cores=cores, host_memory_gbps=gbps)
    return cpu_update_rate(spec)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="16M", help="fp32 parameters per optimizer (M = 2**20); host memory needs 16 bytes each per rank")
    parser.add_argument("--ranks", type=int, default=2, help="processes stepping at once, sharing the cores")
    parser.add_argument("--repeat", type=int, default=3, help="steps timed per figure; the best counts")
    args = parser.parse_args(argv)
    params = parse_size(args.params.replace("M", "MiB").replace("K", "KiB"), "--params")
    cores = os.cpu_count() or 1
    if args.ranks < 1 or args.ranks > cores:
        raise SystemExit(f"--ranks {args.ranks}: give 1 to {cores} (this machine's cores), so that each rank has a core at least.")
    gbps = channel_gbps(max(params * 4, 256 << 20), args.repeat)
    share = cores // args.ranks
    rows = [
        ("AdamW, 1 thread", adam_rate(params, 1, args.repeat), model_rate(1, gbps)),
        (f"AdamW, {cores} threads", adam_rate(params, cores, args.repeat), model_rate(cores, gbps)),
        (f"AdamW, default kernel (foreach), {cores} threads", adam_rate(params, cores, args.repeat, fused=False), model_rate(cores, gbps)),
        (f"AdamW per rank, {args.ranks} ranks at once, {share} threads each", ranks_rate(params, args.ranks, share, args.repeat),
         model_rate(share, gbps / args.ranks)),
    ]
    print(f"{cores} CPUs, torch {torch.__version__}, {params:,} fp32 parameters, best of {args.repeat}; memory channels "
          f"{gbps:.1f} GB/s (a copy's reads and writes), {ADAM_BYTES_PER_PARAMETER} bytes per parameter\n")
    print("| measurement | measured (G parameters/s) | step model (G parameters/s) | model / measured |\n|---|---|---|---|")
    for name, measured, model in rows:
        print(f"| {name} | {measured / 1e9:.3f} | {model / 1e9:.3f} | {model / measured:.2f} |")
    print(f"\nthis machine in a what-if: +hardware.cpu_cores={cores} +hardware.host_memory_gbps={gbps:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
