"""The step model's prediction beside the measured step, on this machine, for several placements.

    python tools/validate_cost_model.py
    python tools/validate_cost_model.py --link-gbps 0.5 --layers 6 --width 384

Trains the same GPT-2 with the tiered strategy at several GPU-tier budgets, with the emulated
GPU tier's copies throttled to ``--link-gbps`` (slow enough that transfers matter on a CPU). Each
run's own first-step profile (forward time of every unit; backward taken as twice forward) and its
placement go into planning/cost_model.py; the table lists the predicted and the measured median
step side by side.
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
from offload_strategy.planning.cost_model import GPU, Machine, UnitCost, simulate_step  # noqa: E402
from tools.common import StepTimer, add_run_arguments, fit, gpt2_config, parameter_bytes  # noqa: E402

# fused AdamW on this machine, parameters per second (docs/benchmarks.md, optimizer offload)
CPU_UPDATE_RATE = 1.5e9


class Probe(StepTimer):
    """Step times, and the step model's prediction from the run's first-step profile."""

    def __init__(self) -> None:
        super().__init__()
        self.prediction: Optional[float] = None
        self.homes = "-"

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        engine = trainer.strategy.engine
        if engine is None or self.prediction is not None or not engine.profile.forward_seconds:
            return
        spec = trainer.strategy.hardware
        machine = Machine(h2d=spec.h2d_gbps * 1e9, d2h=spec.d2h_gbps * 1e9)
        order = list(dict.fromkeys(engine.profile.order)) or list(range(len(engine.states)))
        order += [i for i in range(len(engine.states)) if i not in order]
        units = []
        for i in order:
            s = engine.states[i]
            forward = engine.profile.forward_seconds.get(i, 0.0)
            trainable = sum(p.numel() for p in s.unit.trainable)
            units.append(UnitCost(nbytes=s.unit.nbytes, forward_seconds=forward, backward_seconds=2 * forward, home=s.home,
                                  gradient_bytes=s.unit.nbytes if trainable else 0,
                                  update_seconds=0.0 if s.home == GPU else trainable / CPU_UPDATE_RATE))
        self.prediction = simulate_step(units, sum(engine.placement.device_slots.values()), machine).seconds
        self.homes = "/".join(str(sum(s.home == h for s in engine.states)) for h in ("gpu", "host", "nvme"))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, layers=4, width=256, seq_len=128, batch_size=8, steps=12, warmup=3)
    parser.add_argument("--link-gbps", type=float, default=0.2, help="throttle of the emulated PCIe link, GB/s each way")
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.3, 0.5, 0.8], help="gpu_memory as fractions of the parameter bytes")
    args = parser.parse_args(argv)

    config = gpt2_config(args.layers, args.width, positions=args.seq_len)
    param_bytes = parameter_bytes(config)
    hardware = {"name": "throttled", "gpu": "emulated", "gpu_memory": "80GiB", "gpu_bf16_tflops": None, "gpu_fp16_tflops": None,
                "h2d_gbps": args.link_gbps, "d2h_gbps": args.link_gbps, "host_memory": "16GiB", "cpu_cores": os.cpu_count() or 1}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for fraction in args.fractions:
            print(f"gpu_memory {fraction:.0%} of the parameters", file=sys.stderr, flush=True)
            probe_cb = Probe()
            strategy = TieredStrategy(gpu_memory=int(fraction * param_bytes), host_memory="4GiB", hardware=hardware, policy={"name": "auto", "throttle": True})
            fit(strategy, config, args, root, probe_cb, args.steps)
            measured = statistics.median(probe_cb.times[args.warmup :])
            rows.append((fraction, probe_cb.homes, probe_cb.prediction, measured))
    print(f"\nGPT-2 {args.layers} x {args.width}, batch {args.batch_size} x {args.seq_len}, {format_bytes(param_bytes)} of parameters, "
          f"emulated link {args.link_gbps} GB/s each way; median of {args.steps - args.warmup} steps\n")
    print("| gpu_memory | units gpu/host/nvme | predicted step (ms) | measured step (ms) | predicted / measured |")
    print("|---|---|---|---|---|")
    for fraction, homes, predicted, measured in rows:
        ratio = f"{predicted / measured:.2f}" if predicted else "-"
        print(f"| {fraction:.0%} | {homes} | {predicted * 1e3 if predicted else float('nan'):.1f} | {measured * 1e3:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
