"""Activation policies side by side: keep, checkpoint (inputs in the GPU tier or in host memory), swap to host, and the planner's layout.

    python tools/bench_activations.py                         # the table in docs/benchmarks.md
    python tools/bench_activations.py --layers 8 --width 512 --seq-len 512

First a short run with the planner and an unlimited GPU tier measures the blocks (what each saves
for backward, its input, its forward time). The GPU tier is then set to the parameters plus
``--activation-share`` of what keeping every block's activations would need, so keeping them all
does not fit, and each policy trains the same model from the same seed with the copies throttled
to the ``--link`` machine's PCIe figures. Reported per policy: median step time and its ratio to
keep-all, the bytes the GPU tier held for backward at the end of forward (measured), the
planner's predicted peak and step time for that layout (from the planned run's own profile of the
blocks), and whether the layout fits the budget with the parameters streamed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.config import BlockPolicy  # noqa: E402
from offload_strategy.planning.activations import peak_bytes, step_seconds  # noqa: E402
from offload_strategy.planning.placement import minimum_gpu_bytes  # noqa: E402
from offload_strategy.demos import gpt2_config  # noqa: E402
from tools.common import StepTimer, add_run_arguments, fit, parameter_bytes  # noqa: E402


def run(args: argparse.Namespace, config: dict[str, Any], root: Path, steps: int, **strategy_kwargs: Any) -> tuple[TieredStrategy, StepTimer]:
    strategy = TieredStrategy(**strategy_kwargs)
    timer = StepTimer()
    fit(strategy, config, args, root, timer, steps)
    return strategy, timer


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, layers=6, width=256, seq_len=256, batch_size=8, steps=12, warmup=3)
    parser.add_argument("--activation-share", type=float, default=0.5, help="GPU tier = parameters + this share of keep-all activations")
    parser.add_argument("--link", default="a100_80g", help="known machine whose PCIe figures throttle the copies")
    args = parser.parse_args(argv)

    config = gpt2_config(args.layers, args.width, positions=args.seq_len)
    param_bytes = parameter_bytes(config)
    common = dict(host_memory="8GiB", hardware=args.link)
    with tempfile.TemporaryDirectory() as root:
        print("profiling the blocks", file=sys.stderr, flush=True)
        measured, _ = run(args, config, Path(root), 4, policy={"name": "auto", "activations": "auto"}, **common)  # planned after the third step
        costs = measured.activation_costs
        keep_all = sum(c.activation_bytes for c in costs)
        budget = int(param_bytes + args.activation_share * keep_all)
        policy = {"name": "auto", "throttle": True, "placement": "fill"}  # parameters placed as before the layout, for every policy alike
        results = []
        for name in ("keep", "checkpoint", "checkpoint_host", "swap_host", "auto"):
            print(f"policy {name}", file=sys.stderr, flush=True)
            strategy, timer = run(args, config, Path(root), args.steps, gpu_memory=budget, policy={**policy, "activations": name}, **common)
            if name == "auto":  # the planner's own profile of this run prices every layout
                costs = strategy.activation_costs
                results = [(*r[:5], step_seconds(costs, r[1], strategy.activation_links), r[6]) for r in results]
            layout = strategy.activation_plan.layout if name == "auto" else (name,) * len(costs)
            links = strategy.activation_links or measured.activation_links
            room = budget - minimum_gpu_bytes(strategy.planner.model.sizes, strategy.planner.model.co_resident)  # with parameters streamed
            saved = timer.metrics[-1].get("activations/saved_bytes", float("nan"))
            results.append((name, layout, statistics.median(timer.times[args.warmup :]), saved, peak_bytes(costs, layout),
                            step_seconds(costs, layout, links), room))

    keep_time = results[0][2]
    print(f"\nGPT-2 {args.layers} layers x {args.width} wide, batch {args.batch_size} x {args.seq_len}; parameters {format_bytes(param_bytes)}, "
          f"keep-all activations {format_bytes(keep_all)} ({format_bytes(costs[0].activation_bytes)} per block); gpu_memory {format_bytes(budget)} "
          f"(parameters + {args.activation_share:.0%} of keep-all); copies throttled to {args.link}; median of {args.steps - args.warmup} steps\n")
    print("| policy | layout | step (ms) | vs keep | held at end of forward (measured) | predicted peak | fits (parameters streamed) | predicted step (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, layout, seconds, saved, peak, predicted, room in results:
        print(f"| {name} | {''.join(BlockPolicy(p).letter for p in layout)} | {seconds * 1e3:.1f} | {seconds / keep_time:.3f} | {format_bytes(int(saved))} | "
              f"{format_bytes(peak)} | {'yes' if peak <= room else 'no'} | {predicted * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
