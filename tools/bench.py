"""Side-by-side step time of plain Lightning and the tiered strategy in several placements.

    python tools/bench.py                       # the CPU table of docs/benchmarks.md
    python tools/bench.py --layers 8 --width 512 --steps 40 --repeats 5
    python tools/bench.py --precision bf16-true  # 16-bit units on the link, fp32 masters at home
    python tools/bench.py --processes 1 2        # data parallel: DDP and tiered_ddp on 1 and 2 processes

Every mode trains the same GPT-2-shaped model on random tokens from the same seed, in one
process, with the modes interleaved round by round so that a noisy machine affects them alike.
Reported: the median step time over all measured steps (the first ``--warmup`` steps of each run
are left out), its ratio to plain Lightning, and the tiered runtime's cache figures.

With ``--processes``, each run is a separate data-parallel job of that many CPU processes (gloo),
started as a user starts one, each rank with its own batches: Lightning's DDP beside ``tiered_ddp``
(GPU tier and host memory as in the host mode, per rank), reporting the median step time, the
run's samples/s, and each rank's peak resident memory and optimizer-state bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning as L  # noqa: E402

from offload_strategy import TieredDDPStrategy, TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.hardware import process_peak_rss  # noqa: E402
from offload_strategy.demos import PARAMETERS_ONLY, gpt2_config  # noqa: E402
from tools.common import StepTimer, add_run_arguments, fit, parameter_bytes  # noqa: E402


@dataclass
class Mode:
    name: str
    make_strategy: Callable[[], Union[str, L.pytorch.strategies.Strategy]]
    times: list[float] = field(default_factory=list)
    requests: float = 0.0
    hits: float = 0.0
    late: float = 0.0
    misses: float = 0.0
    wait_ms: float = 0.0
    homes: str = ""
    link_bytes: list[float] = field(default_factory=list)  # host -> GPU tier bytes per measured step
    update_ms: list[float] = field(default_factory=list)  # the offloaded units' optimizer updates, per step
    exposed_ms: list[float] = field(default_factory=list)  # the part of them the step waited for


def run_once(mode: Mode, config: dict[str, Any], args: argparse.Namespace, root: Path) -> None:
    timer = StepTimer()
    fit(mode.make_strategy(), config, args, root, timer, args.steps, precision=args.precision)
    mode.times += timer.times[args.warmup :]
    for m in timer.metrics[args.warmup :]:
        n = m.get("cache/requests", 0.0)
        mode.requests += n
        mode.hits += m.get("cache/hit_rate", 0.0) * n
        mode.late += m.get("cache/late_hit_rate", 0.0) * n
        mode.misses += m.get("cache/miss_rate", 0.0) * n
        mode.wait_ms += m.get("cache/wait_total_ms", 0.0)
        if "optimizer/update_ms" in m:
            mode.update_ms.append(m["optimizer/update_ms"])
            mode.exposed_ms.append(m.get("optimizer/exposed_ms", 0.0))
    moved = [m.get("link/h2d_bytes_total", 0.0) for m in timer.metrics[args.warmup :]]
    mode.link_bytes += [b - a for a, b in zip(moved, moved[1:])]
    if timer.metrics and "units/gpu" in timer.metrics[-1]:
        last = timer.metrics[-1]
        mode.homes = "/".join(str(int(last[f"units/{h}"])) for h in ("gpu", "host", "nvme"))


SHARED = "tiered_ddp, share_host_homes"


def data_parallel_rank(args: argparse.Namespace, config: dict[str, Any], gpu: int) -> None:
    """One rank of a ``--processes`` run (this script started again by the parent, then by Lightning)."""
    strategy: Union[str, L.pytorch.strategies.Strategy] = "ddp"
    if args.rank_strategy in ("tiered_ddp", SHARED):
        strategy = TieredDDPStrategy(gpu_memory=gpu, host_memory="4GiB", policy=PARAMETERS_ONLY, share_host_homes=args.rank_strategy == SHARED)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as root:
        trainer = fit(strategy, config, args, root, timer, args.steps, precision=args.precision, devices=args.rank_processes)
    last = timer.metrics[-1] if timer.metrics else {}
    report = {
        "times": timer.times[args.warmup :],
        "peak_rss": process_peak_rss(),
        "state_bytes": sum(last.get(f"optimizer/{tier}_state_bytes", 0.0) for tier in ("gpu", "host", "nvme")),
        "host_tier": max((m.get("tier/host_peak_bytes", 0.0) for m in timer.metrics), default=0.0),
        "homes": "/".join(str(int(last[f"units/{h}"])) for h in ("gpu", "host", "nvme")) if "units/gpu" in last else "-",
    }
    Path(args.rank_out, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def data_parallel_table(args: argparse.Namespace, param_bytes: int, gpu: int) -> None:
    """DDP and tiered_ddp (with one copy of host homes too, on several processes) on each process
    count, rounds interleaved; one table."""
    runs = [(p, name) for p in args.processes for name in ("ddp", "tiered_ddp", SHARED) if name != SHARED or p > 1]
    reports: dict[tuple[int, str], list[dict]] = {run: [] for run in runs}
    for repeat in range(args.repeats):
        for processes, name in runs:
            print(f"round {repeat + 1}/{args.repeats}: {name} on {processes} processes", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, str(Path(__file__).resolve()), "--rank-strategy", name, "--rank-processes", str(processes),
                           "--rank-out", out, *(argv_for_ranks(args))]
                env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
                result = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
                if result.returncode != 0:
                    raise SystemExit(f"{name} on {processes} processes failed:\n{result.stderr[-3000:]}")
                reports[(processes, name)].append([json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))])
    print(f"\nGPT-2 {args.layers} layers x {args.width} wide ({format_bytes(param_bytes)} fp32), batch {args.batch_size} x {args.seq_len} per rank, "
          f"precision {args.precision}; tiered_ddp: gpu_memory {format_bytes(gpu)} per rank, states sharded; median step over "
          f"{args.repeats} interleaved runs of {args.steps} steps ({args.warmup} warm-up steps dropped)\n")
    print("| strategy | processes | units gpu/host/nvme | step (ms) | samples/s (all ranks) | vs ddp | peak RSS per rank | optimizer states per rank "
          "| host tier per rank (peak) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for processes, name in runs:
        ranks = [rank for run in reports[(processes, name)] for rank in run]
        step = statistics.median(t for rank in ranks for t in rank["times"])
        base = statistics.median(t for run in reports[(processes, "ddp")] for rank in run for t in rank["times"])
        rss = max(rank["peak_rss"] for rank in ranks)
        states = max(rank["state_bytes"] for rank in ranks)
        host = max(rank.get("host_tier", 0.0) for rank in ranks)
        print(f"| {name} | {processes} | {ranks[0]['homes']} | {step * 1e3:.1f} | {processes * args.batch_size / step:.1f} | {step / base:.3f} | "
              f"{format_bytes(rss)} | {format_bytes(int(states)) if states else '-'} | {format_bytes(int(host)) if host else '-'} |")


def argv_for_ranks(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--width", str(args.width), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision, "--gpu-fraction", str(args.gpu_fraction)]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, layers=4, width=256, seq_len=128, batch_size=8, steps=30, warmup=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-fraction", type=float, default=0.25, help="gpu_memory as a fraction of the parameter bytes")
    parser.add_argument("--link", default="a100_80g", help="known machine whose PCIe figures throttle the copies (a100_80g: PCIe 4.0 x16)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"],
                        help="gpu: every mode on a CUDA GPU, copies over its real link (the --link throttle applies to the emulated GPU tier only)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision flag for every mode (32-true, bf16-mixed, bf16-true, ...)")
    parser.add_argument("--nvme-path", default=None, help="directory for the NVMe mode (default: a temporary directory under the working directory)")
    parser.add_argument("--processes", type=int, nargs="*", default=None, help="data-parallel mode: DDP and tiered_ddp on each count of CPU processes")
    parser.add_argument("--rank-strategy", default=None, help=argparse.SUPPRESS)  # set by the data-parallel mode for its ranks
    parser.add_argument("--rank-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    config = gpt2_config(args.layers, args.width)
    param_bytes = parameter_bytes(config)
    half = args.precision in ("bf16-true", "16-true")
    # gpu_memory is a fraction of the parameters in the dtype they compute in
    gpu = int(args.gpu_fraction * param_bytes / (2 if half else 1))
    # Host memory for the NVMe mode: gradients and Adam states of everything, and room for some of
    # the parameters (with 16-bit parameters: fp32 masters and gradient landing areas too).
    host_nvme = int(3.5 * param_bytes * (1.25 if half else 1.0))
    if args.rank_strategy is not None:
        data_parallel_rank(args, config, gpu)
        return 0
    if args.processes:
        data_parallel_table(args, param_bytes, gpu)
        return 0

    with tempfile.TemporaryDirectory(dir=args.nvme_path or ".", prefix="bench-nvme-") as nvme, tempfile.TemporaryDirectory() as root:
        modes = [
            Mode("lightning (auto)", lambda: "auto"),
            Mode("tiered, everything fits", lambda: TieredStrategy()),
            Mode(f"tiered, gpu {args.gpu_fraction:.0%}, host", lambda: TieredStrategy(gpu_memory=gpu, host_memory="4GiB", policy=PARAMETERS_ONLY)),
            Mode(f"tiered, gpu {args.gpu_fraction:.0%}, host, {args.link} link",
                 lambda: TieredStrategy(gpu_memory=gpu, host_memory="4GiB", hardware=args.link, policy={**PARAMETERS_ONLY, "throttle": True})),
            Mode(f"tiered, gpu {args.gpu_fraction:.0%}, host + NVMe",
                 lambda: TieredStrategy(gpu_memory=gpu, host_memory=host_nvme, nvme_path=nvme, nvme_memory="1GiB", policy=PARAMETERS_ONLY)),
        ]
        for repeat in range(args.repeats):
            for mode in modes:
                print(f"round {repeat + 1}/{args.repeats}: {mode.name}", file=sys.stderr, flush=True)
                run_once(mode, config, args, Path(root))

    base = statistics.median(modes[0].times)
    h2d = pinned_h2d_gbps() if args.accelerator == "gpu" else None
    print(f"\nGPT-2 {args.layers} layers x {args.width} wide, {param_bytes / 4 / 1e6:.2f} M parameters ({format_bytes(param_bytes)} fp32), "
          f"batch {args.batch_size} x {args.seq_len}, precision {args.precision}, gpu_memory {format_bytes(gpu)}; median of {len(modes[0].times)} steps per mode "
          f"({args.repeats} interleaved runs of {args.steps} steps, {args.warmup} warm-up steps dropped)\n")
    if h2d:
        print(f"roofline bound of a mode: the largest of plain Lightning's step, its host->GPU bytes at the measured {h2d:.1f} GB/s "
              "(pinned, one direction), and its updates at home\n")
    print("| mode | units gpu/host/nvme | step (ms) | vs lightning | hit | late hit | miss | wait per step (ms) | host->GPU per step "
          "| updates at home (ms) | of which exposed (ms) | bound / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        step = statistics.median(mode.times)
        n = mode.requests
        cache = (f"{mode.hits / n:.1%} | {mode.late / n:.1%} | {mode.misses / n:.1%} | {mode.wait_ms / len(mode.times):.2f}"
                 if n else "- | - | - | -")
        moved = format_bytes(int(statistics.median(mode.link_bytes))) if mode.link_bytes else "-"
        updates = f"{statistics.median(mode.update_ms):.1f} | {statistics.median(mode.exposed_ms):.1f}" if mode.update_ms else "- | -"
        print(f"| {mode.name} | {mode.homes or '-'} | {step * 1e3:.1f} | {step / base:.3f} | {cache} | {moved} | {updates} | {roofline(mode, base, h2d, step)} |")
    return 0


def pinned_h2d_gbps(nbytes: int = 256 << 20, repeat: int = 3) -> float:
    """Host -> GPU rate of one pinned copy, as offload-strategy probe measures it."""
    import torch

    from offload_strategy.memory.bandwidth import copy_gbps

    return copy_gbps(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), repeat)


def roofline(mode: Mode, base: float, h2d: Optional[float], step: float) -> str:
    """The mode's bound over its step: 1.00 runs at the hardware's limit for its placement."""
    if not h2d:
        return "-"
    link = statistics.median(mode.link_bytes) / (h2d * 1e9) if mode.link_bytes else 0.0
    updates = statistics.median(mode.update_ms) / 1e3 if mode.update_ms else 0.0
    return f"{max(base, link, updates) / step:.2f}"


if __name__ == "__main__":
    sys.exit(main())
